"""moe_ep.torch_npu takes exactly torch_npu's keyword names, defaults and argument order (the
signatures below are torch_npu's, as docs/spec.md states them from its documents). The ops
themselves run in mpi_autograd_cases.py (torch_npu_names, ascend_single_op_example)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest

torch_npu = pytest.importorskip("moe_ep.torch_npu")

SIGNATURES = {
    "npu_moe_distribute_dispatch_v2": (
        "x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None, "
        "x_active_mask=None, expert_scales=None, elastic_info=None, performance_info=None, "
        "group_tp='', tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1, "
        "shared_expert_rank_num=0, quant_mode=0, global_bs=0, expert_token_nums_type=1, "
        "comm_alg='', zero_expert_num=0, copy_expert_num=0, const_expert_num=0"
    ),
    "npu_moe_distribute_combine_v2": (
        "expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep, "
        "ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None, x_active_mask=None, "
        "expand_scales=None, shared_expert_x=None, elastic_info=None, ori_x=None, "
        "const_expert_alpha_1=None, const_expert_alpha_2=None, const_expert_v=None, "
        "performance_info=None, group_tp='', tp_world_size=0, tp_rank_id=0, "
        "expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, global_bs=0, "
        "comm_quant_mode=0, comm_alg='', zero_expert_num=0, copy_expert_num=0, "
        "const_expert_num=0"
    ),
    "npu_moe_token_permute": "tokens, indices, num_out_tokens=None, padded_mode=False",
    "npu_moe_token_unpermute": (
        "permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None"
    ),
}


def _plain(fn) -> str:
    """The parameters as the documents write them: names, defaults, the '*' marker."""
    out, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(out)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_is_torch_npus(name):
    assert _plain(getattr(torch_npu, name)) == SIGNATURES[name]


def test_unknown_group_name_is_refused_before_any_communication():
    import torch

    import moe_ep

    with pytest.raises(moe_ep.InvalidArgumentError, match="is not a registered group name"):
        torch_npu.npu_moe_distribute_dispatch_v2(
            torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.int32), "no-such-group", 1, 0, 1)


def _run(script: str) -> str:
    """script in a fresh interpreter (this pytest process never initialises MPI, nor changes
    torch's attributes twice); its stdout, after checking that it exited 0."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_register_group_refuses_a_name_taken_by_another_communicator():
    """With real communicators (MPI as a singleton, in a subprocess): a name names one
    communicator; group_name gives one name per communicator."""
    out = _run("""
        import moe_ep, moe_ep.torch_npu as torch_npu
        from mpi4py import MPI
        a, b = MPI.COMM_SELF.Dup(), MPI.COMM_SELF.Dup()
        assert torch_npu.register_group("test-name", a) == "test-name"
        assert torch_npu.register_group("test-name", a) == "test-name"  # again: the same
        try:
            torch_npu.register_group("test-name", b)
        except moe_ep.InvalidArgumentError as e:
            assert "register_group: name 'test-name' names another communicator" in str(e)
        else:
            raise AssertionError("a second communicator took the name")
        assert torch_npu.group_name(a) == "test-name" and torch_npu.group_name(b) != "test-name"
        try:
            torch_npu.register_group("null", MPI.COMM_NULL)
        except moe_ep.InvalidArgumentError as e:
            assert "comm = " in str(e) and "is MPI.COMM_NULL" in str(e), e
        else:
            raise AssertionError("MPI.COMM_NULL was accepted")
        print("OK")
        """)
    assert out.strip().endswith("OK")


@pytest.mark.parametrize("comm,shown", [
    (object(), "is a builtins.object"), (None, "None is a builtins.NoneType"),
    (0, "0 is a builtins.int"), ("MPI.COMM_WORLD", "'MPI.COMM_WORLD' is a builtins.str"),
])
def test_register_group_refuses_what_is_not_a_communicator(comm, shown):
    """Refused at once, naming the parameter and what is accepted (before, any object was taken,
    and the ops failed later, collectively, with group_id's message); the name stays free."""
    import torch

    import moe_ep

    for call, op in [(lambda: torch_npu.register_group("not-a-comm", comm), "register_group"),
                     (lambda: torch_npu.group_name(comm), "group_name")]:
        with pytest.raises(moe_ep.InvalidArgumentError) as info:
            call()
        msg = str(info.value)
        assert msg.startswith(f"{op}: comm = ") and shown in msg, msg
        assert "it must be an mpi4py communicator (mpi4py.MPI.Intracomm" in msg, msg
    with pytest.raises(moe_ep.InvalidArgumentError, match="non-empty string"):
        torch_npu.register_group("", object())
    with pytest.raises(moe_ep.InvalidArgumentError, match="is not a registered group name"):
        torch_npu.npu_moe_distribute_dispatch_v2(
            torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.int32), "not-a-comm", 1, 0, 1)


def test_device_calls_are_no_ops_on_cpu(monkeypatch):
    """A torch_npu program's device calls (the seed's graph-mode example: model.npu(),
    torch.npu.synchronize()) run on CPU torch after importing moe_ep.torch_npu."""
    import torch

    import moe_ep

    assert torch.npu is torch_npu.npu
    model = torch.nn.Linear(2, 3)
    assert model.npu() is model and model.npu(0) is model
    x = torch.ones(2)
    assert x.npu() is x
    npu = torch.npu
    assert npu.is_available() is True
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert npu.device_count() == 4  # one device per rank of this machine
    for var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MPI_LOCAL_NRANKS",
                "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert npu.device_count() == 1
    try:
        assert npu.current_device() == 0
        npu.set_device(3)
        assert npu.current_device() == 3
        npu.set_device("npu:1")
        assert npu.current_device() == 1
        with pytest.raises(moe_ep.InvalidArgumentError,
                           match=r"npu.set_device: device = 'cuda:0' \(str\) must be an int"):
            npu.set_device("cuda:0")
        with pytest.raises(moe_ep.InvalidArgumentError, match="npu.set_device: device = -1"):
            npu.set_device(-1)
    finally:
        npu.set_device(0)
    assert npu.synchronize() is None and npu.synchronize(0) is None
    assert npu.empty_cache() is None
    state = torch.get_rng_state()
    npu.manual_seed(5)
    npu.manual_seed_all(5)
    assert torch.equal(torch.get_rng_state(), state)  # the CPU generator is not the NPU's
    start, end = npu.Event(enable_timing=True), npu.Event(enable_timing=True)
    start.record()
    end.record()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0
    stream = npu.current_stream()
    assert stream is npu.default_stream() and stream.query()
    stream.wait_stream(npu.Stream())
    assert stream.record_event().query()
    with npu.stream(stream):
        pass


def test_device_calls_leave_what_torch_defines():
    """Where torch has them already (a torch with NPU support), importing moe_ep.torch_npu
    changes nothing."""
    out = _run("""
        import torch
        mine = object()
        torch.npu = mine
        torch.nn.Module.npu = lambda self: "torch's own"
        torch.Tensor.npu = lambda self: "torch's own tensor"
        import moe_ep.torch_npu
        assert torch.npu is mine
        assert torch.nn.Linear(1, 1).npu() == "torch's own"
        assert torch.ones(1).npu() == "torch's own tensor"
        assert moe_ep.torch_npu.npu is not mine  # the program's torch_npu.npu calls still work
        moe_ep.torch_npu.npu.set_device(0)
        print("OK")
        """)
    assert out.strip().endswith("OK")
