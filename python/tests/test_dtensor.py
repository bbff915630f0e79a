"""DTensor sharding rules of SPEC §5 (python/moe_ep/torch/sharding.py).

- The rules come from the C++ strategy table: rule_table() is moe_ep._C.strategies() converted,
  and the rule DTensor calls places every schema argument as the table says.
- The table is SPEC §5's, compared with the table written out in dtensor_cases.SPEC5.
- Every op on DTensors, on gloo meshes of 1, 2, 3 and 4 CPU processes (one launch per world
  size running all of dtensor_cases.py's cases): placements as SPEC §5 says, full tensors equal
  to the single-process op (bitwise; grad_probs under Shard(1) within a justified bound).
- examples/python/tp_unpermute.py under torchrun with 2 processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from moe_ep import _C
from moe_ep.torch import sharding

sys.path.insert(0, str(Path(__file__).parent))
import dtensor_cases  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).parent / "dtensor_cases.py"
EXAMPLE = ROOT / "examples" / "python" / "tp_unpermute.py"

# Launch limits: all cases of one world size take a few seconds of CPU per process, most of it
# importing torch; the limit leaves room for a loaded 2-core machine.
LAUNCH_TIMEOUT_S = 240


def _env():
    env = dict(os.environ)
    # torchrun's default too. The C++ kernels open OpenMP regions even for tiny tensors; with
    # several processes a core, each region waits for descheduled threads (~30 ms a call).
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _placement(p):
    """moe_ep._C's placement tuple -> torch placement, written independently of sharding.py."""
    if p is None:
        return None
    kind, dim = p
    return {"replicate": Replicate, "partial": Partial}[kind]() if kind != "shard" else Shard(dim)


SPEC_PLACEMENT = {"R": Replicate(), "S1": Shard(1), "P": Partial(), "-": None}

# (has_probs, has_permuted_tokens) the ops are called with; unpermute_grad_v2 needs
# permuted_tokens whenever probs are given.
VARIANTS = [(True, True), (False, True), (False, False)]


@pytest.mark.parametrize("op", dtensor_cases.OPS)
@pytest.mark.parametrize("has_probs,has_permuted", VARIANTS)
def test_rule_table_is_the_cpp_table(op, has_probs, has_permuted):
    table = _C.strategies(sharding.OPS[op], has_probs, has_permuted)
    want = [
        (
            s["name"],
            {name: _placement(p) for name, p, _ in s["inputs"]},
            [_placement(p) for _, p, _ in s["outputs"]],
        )
        for s in table
    ]
    assert [s["name"] for s in table] == ["R", "S"]
    assert sharding.rule_table(op, has_probs, has_permuted) == want


@pytest.mark.parametrize(
    "op,has_probs",
    [(op, p) for op in dtensor_cases.OPS
     for p in ((True, False) if op in dtensor_cases.PROBS_OPS else (False,))],
)
@pytest.mark.parametrize("strategy", ["R", "S"])
def test_rule_table_is_spec5(op, has_probs, strategy):
    spec_inputs, spec_outputs = dtensor_cases.spec5(op, strategy, has_probs)
    has_permuted = has_probs or op != "token_unpermute_grad_v2"
    (got,) = [s for s in sharding.rule_table(op, has_probs, has_permuted) if s[0] == strategy]
    _, inputs, outputs = got
    # Index tensors and probs Replicate, token-like tensors Shard(1) under S (SPEC §5).
    assert inputs == {k: SPEC_PLACEMENT[v] for k, v in spec_inputs.items()}
    assert outputs == [SPEC_PLACEMENT[v] for v in spec_outputs]


# The rule as DTensor calls it: with every schema argument positional, defaults filled in (the
# dispatcher normalises keyword calls; dtensor_cases' "kwargs" cases run those end to end), each
# tensor a DTensorSpec (a meta tensor here: the rule reads only whether an argument is given).
# The placement the rule must give each schema position under S; R is the same with Replicate.
META = torch.empty(4, 6, device="meta")
S1, REP, PART = Shard(1), Replicate(), Partial()
FP32 = torch.float32
RULE_CALLS = [
    ("token_permute", (META, META, None, False), [S1, REP, None, None], [S1, REP]),
    ("token_permute", (META, META, 3, False), [S1, REP, None, None], [S1, REP]),
    ("token_permute_grad", (META, META, META, META, False), [S1, S1, REP, REP, None], [S1]),
    ("token_permute_grad_v2", (META, META, 4, FP32, 1, False), [S1, REP, None, None, None, None],
     [S1]),
    ("token_unpermute", (META, META, META, False, None), [S1, REP, REP, None, None], [S1]),
    ("token_unpermute", (META, META, None, False, [4, 6]), [S1, REP, None, None, None], [S1]),
    ("_token_unpermute", (META, META, META, False, None), [S1, REP, REP, None, None], [S1, S1]),
    ("_token_unpermute", (META, META, None, False, None), [S1, REP, None, None, None], [S1, S1]),
    ("token_unpermute_grad", (META, META, META, META, False, None),
     [S1, S1, REP, REP, None, None], [S1, PART]),
    ("token_unpermute_grad", (META, META, META, None, False, None),
     [S1, S1, REP, None, None, None], [S1, REP]),
    ("token_unpermute_grad_v2", (META, META, 4, FP32, META, False, None, META),
     [S1, REP, None, None, REP, None, None, S1], [S1, PART]),
    ("token_unpermute_grad_v2", (META, META, 4, FP32, None, False, None, None),
     [S1, REP, None, None, None, None, None, None], [S1, REP]),
]


@pytest.mark.parametrize("op,args,inputs_s,outputs_s", RULE_CALLS)
def test_registered_rule_places_each_argument(op, args, inputs_s, outputs_s):
    overload = getattr(torch.ops.moe_ep, op).default
    assert len(args) == len(overload._schema.arguments)
    rule = sharding._make_rule(overload, sharding.OPS[op])
    (r_out, r_in), (s_out, s_in) = rule(*args)
    assert s_in == inputs_s and s_out == outputs_s
    assert r_in == [None if p is None else REP for p in inputs_s]
    assert r_out == [REP] * len(outputs_s)


def test_every_op_has_a_registered_rule():
    # DTensor's registry (private, torch 2.13): without a rule, a DTensor call would raise
    # "Operator ... does not have a sharding strategy registered".
    from torch.distributed.tensor import DTensor

    funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    for op in sharding.OPS:
        assert getattr(torch.ops.moe_ep, op).default in funcs, op


def _launch(world: int, tmp_path: Path):
    """One process a rank, rendezvous through a FileStore in tmp_path (no ports to race for).
    Returns (return codes, rank 0's output, all output)."""
    store = tmp_path / f"store-{world}"
    procs = []
    for rank in range(world):
        log = open(tmp_path / f"rank{rank}.log", "w+")
        cmd = [sys.executable, str(CASES), "--store", str(store), "--rank", str(rank),
               "--world-size", str(world)]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env()),
                      log))
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    codes = []
    for p, _ in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    outputs = []
    for _, log in procs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return codes, outputs


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dtensor_ops_on_gloo_mesh(world, tmp_path):
    codes, outputs = _launch(world, tmp_path)
    everything = "\n".join(f"--- rank {r} (exit {c}) ---\n{o[-6000:]}"
                           for r, (c, o) in enumerate(zip(codes, outputs)))
    n = len(dtensor_cases.build_cases())
    summary = f"dtensor_cases: world {world}: {n} cases, 0 failed ("
    assert None not in codes, f"timed out after {LAUNCH_TIMEOUT_S} s:\n{everything}"
    assert codes == [0] * world and summary in outputs[0], everything


def test_tp_unpermute_example(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=_env(),
                       cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-8000:]
    assert "tp_unpermute: PASS" in r.stdout, out[-8000:]
    # The placements the example checks, as it prints them.
    assert "out Shard(dim=1)" in r.stdout and "grad_probs Partial(sum)" in r.stdout, r.stdout
