"""Every malformed argument from Python is a moe_ep error naming it (issue 23 item 7).

Local ops: a table of malformed calls per public op (None or a list for a tensor, a float, a
string or a bool for an int, an int for a flag, a string for a dtype, a malformed restore_shape,
an unknown keyword), each expected to raise moe_ep.InvalidArgumentError whose message names the
op, the parameter and the value; and sizes beyond memory, refused in under a second without an
abort (run in a child process, so that a regression to std::terminate shows as a failed case, not
as a crashed test run). The distributed part, where one rank's bad argument must reach the other
as RemoteError within a second, is mpi_pyargs_cases.py, launched below under mpirun -n 2.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import moe_ep
import moe_ep.torch as mt
import moe_ep.torch_npu as npu
from moe_ep.torch import _args

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import needs  # noqa: E402
ROOT = HERE.parents[1]

N, TOPK, H = 4, 2, 3
M = N * TOPK


def _inputs():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randn(N, H, generator=g)
    indices = torch.randint(0, 3, (N, TOPK), generator=g)
    p, s = mt.token_permute(tokens, indices)
    probs = torch.rand(N, TOPK, generator=g)
    return dict(tokens=tokens, indices=indices, p=p, s=s, probs=probs, g=torch.randn(N, H),
                gm=torch.randn(M, H))


def _calls():
    """name -> (op, a function building (args, kwargs) from the valid inputs): every public local
    op with its valid arguments, the base each malformed call changes one argument of."""
    return {
        "token_permute": (mt.token_permute, lambda i: (
            [i["tokens"], i["indices"]], {"num_out_tokens": None, "padded_mode": False})),
        "token_permute_grad": (mt.token_permute_grad, lambda i: (
            [i["tokens"], i["gm"], i["indices"], i["s"]], {"padded_mode": False})),
        "token_permute_grad_v2": (mt.token_permute_grad_v2, lambda i: (
            [i["gm"], i["s"], N, torch.float32, TOPK], {"padded_mode": False})),
        "token_unpermute": (mt.token_unpermute, lambda i: (
            [i["p"], i["s"]], {"probs": i["probs"], "padded_mode": False,
                               "restore_shape": [N, H]})),
        "_token_unpermute": (mt._token_unpermute, lambda i: (
            [i["p"], i["s"]], {"probs": i["probs"], "padded_mode": False,
                               "restore_shape": [N, H]})),
        "token_unpermute_grad": (mt.token_unpermute_grad, lambda i: (
            [i["p"], i["g"], i["s"]], {"probs": i["probs"], "padded_mode": False,
                                       "restore_shape": [N, H]})),
        "token_unpermute_grad_v2": (mt.token_unpermute_grad_v2, lambda i: (
            [i["g"], i["s"], M, torch.float32], {"probs": i["probs"], "padded_mode": False,
                                                  "restore_shape": [N, H],
                                                  "permuted_tokens": i["p"]})),
    }


# Positional parameter names of each op (the table below names parameters, not positions).
_POSITIONAL = {
    "token_permute": ["tokens", "indices"],
    "token_permute_grad": ["tokens", "grad_permuted_tokens", "indices", "sorted_indices"],
    "token_permute_grad_v2": ["grad_permuted_tokens", "sorted_indices", "tokens_rows",
                              "tokens_dtype", "num_topk"],
    "token_unpermute": ["permuted_tokens", "sorted_indices"],
    "_token_unpermute": ["permuted_tokens", "sorted_indices"],
    "token_unpermute_grad": ["permuted_tokens", "grad_out", "sorted_indices"],
    "token_unpermute_grad_v2": ["grad_out", "sorted_indices", "permuted_rows", "permuted_dtype"],
}

_TENSORS = {
    "token_permute": ["tokens", "indices"],
    "token_permute_grad": ["tokens", "grad_permuted_tokens", "indices", "sorted_indices"],
    "token_permute_grad_v2": ["grad_permuted_tokens", "sorted_indices"],
    "token_unpermute": ["permuted_tokens", "sorted_indices"],
    "_token_unpermute": ["permuted_tokens", "sorted_indices"],
    "token_unpermute_grad": ["permuted_tokens", "grad_out", "sorted_indices"],
    "token_unpermute_grad_v2": ["grad_out", "sorted_indices"],
}
_OPT_TENSORS = {
    "token_unpermute": ["probs"], "_token_unpermute": ["probs"],
    "token_unpermute_grad": ["probs"], "token_unpermute_grad_v2": ["probs", "permuted_tokens"],
}
_INTS = {
    "token_permute_grad_v2": ["tokens_rows", "num_topk"],
    "token_unpermute_grad_v2": ["permuted_rows"],
}
_DTYPES = {"token_permute_grad_v2": ["tokens_dtype"], "token_unpermute_grad_v2": ["permuted_dtype"]}
_RESTORE = ["token_unpermute", "_token_unpermute", "token_unpermute_grad",
            "token_unpermute_grad_v2"]


def _malformed():
    """(case id, op name, parameter, bad value, the words the message must hold besides
    '<op>: <param>')."""
    cases = []
    for op in _calls():
        for name in _TENSORS.get(op, []):
            cases += [(op, name, None, "must be a torch.Tensor"),
                      (op, name, [[1.0, 2.0]], "must be a torch.Tensor"),
                      (op, name, 3, "must be a torch.Tensor")]
        for name in _OPT_TENSORS.get(op, []):
            cases += [(op, name, [0.5, 0.5], "must be a torch.Tensor or None"),
                      (op, name, "probs", "must be a torch.Tensor or None")]
        for name in _INTS.get(op, []):
            cases += [(op, name, True, "not a bool"), (op, name, 2.0, "must be an int"),
                      (op, name, "4", "must be an int"), (op, name, None, "must be an int")]
        for name in _DTYPES.get(op, []):
            cases += [(op, name, "fp32", "must be a torch.dtype"),
                      (op, name, None, "must be a torch.dtype")]
        cases += [(op, "padded_mode", 1, "must be a bool"),
                  (op, "padded_mode", None, "must be a bool")]
        if op in _RESTORE:
            cases += [(op, "restore_shape", "4,3", "must be a list of ints or None"),
                      (op, "restore_shape", [4.0, 3], "must be an int"),
                      (op, "restore_shape", [True, 3], "must be an int")]
    cases += [("token_permute", "num_out_tokens", True, "not a bool"),
              ("token_permute", "num_out_tokens", False, "not a bool"),
              ("token_permute", "num_out_tokens", 2.5, "must be an int or None"),
              ("token_permute", "num_out_tokens", "3", "must be an int or None")]
    return [(f"{op}-{name}-{type(v).__name__}-{i}", op, name, v, words)
            for i, (op, name, v, words) in enumerate(cases)]


MALFORMED = _malformed()


def _call_with(op: str, name: str, value):
    fn, build = _calls()[op]
    args, kwargs = build(_inputs())
    pos = _POSITIONAL[op]
    if name in pos:
        args[pos.index(name)] = value
    else:
        kwargs[name] = value
    return fn(*args, **kwargs)


def test_the_valid_base_calls_succeed():
    # The table changes one argument of these calls; each must succeed as it is, so that the
    # errors below come from the changed argument.
    for op, (fn, build) in _calls().items():
        args, kwargs = build(_inputs())
        out = fn(*args, **kwargs)
        first = out[0] if isinstance(out, tuple) else out
        assert isinstance(first, torch.Tensor), op


@pytest.mark.parametrize("case,op,name,value,words", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_argument_is_named(case, op, name, value, words):
    with pytest.raises(moe_ep.InvalidArgumentError) as info:
        _call_with(op, name, value)
    msg = str(info.value)
    assert msg.startswith(f"{op}: {name}"), msg
    assert f"{name} = " in msg or f"{name}[" in msg, msg
    assert words in msg, msg
    assert info.value.kind == "InvalidArgument"


def test_bools_are_not_counts():
    i = _inputs()
    # True would be the count 1 to the torch dispatcher: num_out_tokens 1 keeps one row.
    assert mt.token_permute(i["tokens"], i["indices"], 1)[0].shape == (1, H)
    with pytest.raises(moe_ep.InvalidArgumentError, match=r"num_out_tokens = True \(bool\)"):
        mt.token_permute(i["tokens"], i["indices"], True)
    with pytest.raises(moe_ep.InvalidArgumentError, match=r"permuted_rows = True \(bool\)"):
        mt.token_unpermute_grad_v2(i["gm"], torch.arange(M, dtype=torch.int32), True,
                                   torch.float32)
    with pytest.raises(moe_ep.InvalidArgumentError, match=r"num_topk = False \(bool\)"):
        mt.token_permute_grad_v2(i["gm"], i["s"], N, torch.float32, False)
    # and an int is not a flag
    with pytest.raises(moe_ep.InvalidArgumentError, match=r"padded_mode = 0 \(int\) must be"):
        mt.token_permute(i["tokens"], i["indices"], None, 0)


def test_torch_npu_names_check_too():
    i = _inputs()
    with pytest.raises(moe_ep.InvalidArgumentError, match="token_permute: tokens = None"):
        npu.npu_moe_token_permute(None, i["indices"])
    with pytest.raises(moe_ep.InvalidArgumentError, match="token_unpermute: probs = "):
        npu.npu_moe_token_unpermute(i["p"], i["s"], probs=[1.0])


def test_direct_op_calls_name_a_none_tensor():
    # torch.ops.moe_ep.* passes None on where a tensor is declared (the dispatcher does not
    # check); the real implementation names it instead of an AttributeError.
    i = _inputs()
    with pytest.raises(moe_ep.InvalidArgumentError, match="token_permute: tokens = None"):
        torch.ops.moe_ep.token_permute(None, i["indices"])
    with pytest.raises(moe_ep.InvalidArgumentError, match="token_unpermute_grad: grad_out = None"):
        torch.ops.moe_ep.token_unpermute_grad(i["p"], None, i["s"])


def test_type_checks_keep_torch_compile_working():
    i = _inputs()

    def layer(x, idx, probs):
        p, s = mt.token_permute(x, idx, None, False)
        return mt.token_unpermute(p * 2, s, probs, False, None)

    eager = layer(i["tokens"], i["indices"], i["probs"])
    compiled = torch.compile(layer, fullgraph=True, backend="eager")(
        i["tokens"], i["indices"], i["probs"])
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize("kwargs,words", [
    ({"bs": True}, "dispatch_workspace: bs = True (bool) must be an int, not a bool"),
    ({"hidden": 8.0}, "dispatch_workspace: hidden = 8.0 (float) must be an int"),
    ({"top_k": None}, "dispatch_workspace: top_k = None (NoneType) must be an int"),
    ({"dtype": "fp32"}, "dispatch_workspace: dtype = 'fp32' (str) must be a torch.dtype"),
    ({"quant_mode": True}, "dispatch_workspace: quant_mode = True (bool)"),
    ({"exact_size": 0}, "dispatch_workspace: exact_size = 0 (int) must be a bool"),
    ({"comm_alg": None}, "dispatch_workspace: comm_alg = None (NoneType) must be a str"),
    ({"topk": 2}, "dispatch_workspace: topk is not a keyword argument of dispatch_workspace"),
])
def test_dispatch_workspace_checks_types_before_mpi(kwargs, words):
    # Checked before the group is resolved (12345 is no registered id, and MPI is not started):
    # the type error is what is reported.
    args = dict(bs=4, hidden=8, top_k=2, dtype=torch.float32, group_ep=12345, moe_expert_num=4)
    args.update(kwargs)
    with pytest.raises(moe_ep.InvalidArgumentError) as info:
        mt.dispatch_workspace(**args)
    assert words in str(info.value)


def test_bound_is_physical_memory_at_most_2_pow_62():
    phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert _args.out_bytes_bound() == min(phys, 2**62)


# ---------------------------------------------------------------------------------------------
# Sizes beyond memory: each case in a child process (one child runs them all and reports a line
# per case), refused by a moe_ep error naming the parameter, in under a second, without abort.

BIG = 2**40  # rows: beyond any machine's memory at H = 3 fp32 (12 TiB)
HUGE = 2**62


def _huge_cases():
    """case -> (call source evaluated in the child with i = the valid inputs, the error class's
    name, words the message must hold). Independent expectation: each names the parameter whose
    value is too large."""
    x1 = "torch.zeros(1, 1).expand(2**40, 2**10)"  # strided rows: would be copied
    r06 = int(0.6 * _args.out_bytes_bound()) // 12  # rows of 3 fp32: 0.6 of the bound
    rows0 = "torch.zeros(1, 3).expand(2**40, 3)"  # contiguous rows of one storage row
    return {
        "permute_grad_v2_tokens_rows": (
            f"mt.token_permute_grad_v2(i['gm'], i['s'], {BIG}, torch.float32, 2)",
            "InvalidArgumentError", ["token_permute_grad_v2", "tokens_rows", "more than"]),
        "permute_grad_v2_tokens_rows_2_62": (
            f"mt.token_permute_grad_v2(i['gm'], i['s'], {HUGE}, torch.float32, 2)",
            "InvalidArgumentError", ["token_permute_grad_v2", "tokens_rows", "more than"]),
        "permute_grad_v2_num_topk": (
            f"mt.token_permute_grad_v2(i['gm'], i['s'], 4, torch.float32, {HUGE})",
            "InvalidArgumentError", ["permute_grad_v2", "num_topk"]),
        "unpermute_grad_v2_permuted_rows": (
            f"mt.token_unpermute_grad_v2(i['g'], i['s'], {BIG}, torch.float32)",
            "InvalidArgumentError", ["token_unpermute_grad_v2", "permuted_rows", "more than"]),
        "unpermute_padded_restore_shape": (
            f"mt.token_unpermute(i['p'], i['s'], None, True, [{BIG}, 3])",
            "InvalidArgumentError", ["token_unpermute", "out (N, H)", "more than"]),
        "permute_expanded_tokens": (
            f"mt.token_permute({x1}, torch.zeros(1, 1, dtype=torch.int64).expand(2**40, 1))",
            "InvalidArgumentError", ["token_permute", "more than"]),
        "permute_expanded_rows": (
            f"mt.token_permute({rows0}, torch.zeros(1, 1, dtype=torch.int64).expand(2**40, 1))",
            "InvalidArgumentError", ["token_permute", "more than"]),
        "unpermute_expanded_probs": (
            "mt.token_unpermute(i['p'], torch.zeros(1, dtype=torch.int32).expand(2**40), "
            "torch.zeros(1, 1).expand(1, 2**40))",
            "InvalidArgumentError", ["token_unpermute", "more than"]),
        "unpermute_grad_expanded_grad_out": (
            f"mt.token_unpermute_grad(i['p'], {x1}, i['s'])",
            "InvalidArgumentError", ["token_unpermute_grad", "more than"]),
        # grad_out 0.6 of the bound (fits alone), copied to contiguous rows (0.6 more), and
        # sorted_indices 0.2: together beyond the bound, refused before the copy
        "unpermute_grad_v2_working_set": (
            f"mt.token_unpermute_grad_v2(torch.zeros(1, 1).expand({r06}, 3), "
            f"torch.zeros(1, dtype=torch.int32).expand({r06}), 8, torch.float32)",
            "InvalidArgumentError", ["token_unpermute_grad_v2", "the inputs (grad_out",
                                     "need", "together, more than"]),
        "permute_grad_expanded_tokens": (
            f"mt.token_permute_grad({x1}, i['gm'], i['indices'], i['s'])",
            "InvalidArgumentError", ["token_permute_grad", "more than"]),
    }


HUGE_CASES = _huge_cases()

_CHILD = r"""
import sys, time
import torch
import moe_ep
import moe_ep.torch as mt
sys.path.insert(0, {here!r})
from test_pyargs import _inputs, HUGE_CASES
torch.set_num_threads(2)  # the parallel paths, where a throw used to end the process
i = _inputs()
for name, (src, _, _) in HUGE_CASES.items():
    start = time.monotonic()
    try:
        eval(src)
        got = "no error"
    except moe_ep.Error as e:
        got = type(e).__name__ + ": " + str(e).replace("\n", " ")
    except Exception as e:
        got = "FOREIGN " + type(e).__name__ + ": " + str(e).replace("\n", " ")
    print(f"CASE {{name}} {{time.monotonic() - start:.3f}} {{got}}", flush=True)
"""


@functools.lru_cache(maxsize=None)
def _huge_results():
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(here=str(HERE))],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    got = {m.group(1): (float(m.group(2)), m.group(3))
           for m in re.finditer(r"^CASE (\S+) ([\d.]+) (.*)$", proc.stdout, re.M)}
    return proc, got


@pytest.mark.parametrize("name", list(HUGE_CASES))
def test_sizes_beyond_memory_are_refused_fast(name):
    proc, got = _huge_results()
    assert name in got, (f"the child ended (status {proc.returncode}) before case {name}:\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    took, message = got[name]
    _, kind, words = HUGE_CASES[name]
    assert message.startswith(kind + ": "), message
    for w in words:
        assert w in message, message
    assert took < 1.0, f"{name} took {took:.2f} s to be refused: {message}"


# ---------------------------------------------------------------------------------------------
# Distributed: rank 1 passes each kind of bad argument, rank 0 must raise RemoteError naming
# rank 1 within a second (mpi_pyargs_cases.py, 2 ranks, MOE_EP_TIMEOUT_S 20: a regression shows
# as a slow timeout).

MPIRUN = shutil.which("mpirun")


@functools.lru_cache(maxsize=None)
def _mpi_launch():
    cmd = [MPIRUN, "-n", "2"]
    version = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version:
        cmd.append("--oversubscribe")
    cmd += [sys.executable, str(HERE / "mpi_pyargs_cases.py")]
    env = dict(os.environ, MOE_EP_TIMEOUT_S="20", OMP_NUM_THREADS="1")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with tempfile.TemporaryDirectory(prefix="moe-ep-report-") as folder:
        proc = subprocess.run(cmd, env=dict(env, MOE_EP_TEST_REPORT_DIR=folder), cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        report = "".join(p.read_text() for p in sorted(Path(folder).glob("*.log")))
    results: dict = {}
    for m in re.finditer(r"^CASE (\S+) rank=(\d+) (OK|FAIL: .*)$", report, re.M):
        results.setdefault(m.group(1), {})[int(m.group(2))] = m.group(3)
    return proc, report, results


# Without mpirun or mpi4py the distributed tests below are skipped, or fail under CI (CI=true;
# needs.py); the local tests above run either way.
NO_MPI = needs.mpi_reason()
HAVE_MPI = NO_MPI is None


def _mpi_case_names():
    sys.path.insert(0, str(HERE))
    import mpi_pyargs_cases

    return list(mpi_pyargs_cases.CASES_AND_ROUND_TRIP)


MPI_CASES = _mpi_case_names() if HAVE_MPI else []


@pytest.mark.parametrize("case", MPI_CASES)
def test_bad_argument_on_one_rank_reaches_the_other_within_a_second(case):
    proc, report, results = _mpi_launch()
    got = results.get(case, {})
    assert set(got) == {0, 1}, (f"case {case}: reports from ranks {sorted(got)} (status "
                                f"{proc.returncode})\n{report[-3000:]}\n{proc.stderr[-3000:]}")
    for rank, verdict in sorted(got.items()):
        assert verdict == "OK", f"rank {rank}: {verdict}"


def test_every_mpi_case_ran():
    if not HAVE_MPI:
        needs.missing(NO_MPI)
    assert len(MPI_CASES) >= 10
    proc, report, results = _mpi_launch()
    assert sorted(results) == sorted(MPI_CASES), report[-3000:]
