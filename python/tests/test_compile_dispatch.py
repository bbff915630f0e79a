"""torch.compile(fullgraph=True) of a layer calling dispatch_v2 / combine_v2 through the Python
wrappers, with the default backend (inductor) and aot_eager, equal to eager bit for bit. One
process (MPI as a singleton), in a subprocess of its own so that this pytest process never
initialises MPI. The multi-rank compile cases are in mpi_dispatch_cases.py."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import torch, moe_ep.torch as mt
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(6, 16)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(6)]).int()
    scales = torch.rand(6, 2)

    def layer(x):
        d = mt.dispatch_v2(x, ids, moe_expert_num=8, expert_scales=scales)
        y = d.expand_x * 2  # every expert doubles its rows
        return mt.combine_v2(y, ids, d.assist_info_for_combine, d.ep_recv_counts, scales,
                             moe_expert_num=8)

    mt.group_id()  # the first use of a communicator is collective: outside the compiled code
    want = layer(x)
    for backend in ("aot_eager", "inductor"):
        got = torch.compile(layer, fullgraph=True, backend=backend)(x)
        assert torch.equal(got, want), backend
        print("OK", backend)
    """
)


def test_compile_dispatch_combine_with_inductor_and_aot_eager():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK aot_eager" in out.stdout and "OK inductor" in out.stdout
