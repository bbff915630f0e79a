"""async_op=True outside the MPI launches (the launches' cases are in mpi_autograd_cases.py:
async_layer, async_sources_and_errors, expert_parallel_overlap): a process whose MPI gives less
than MPI_THREAD_MULTIPLE is refused with UnsupportedError naming the level it got; an op started
and never waited for, which no peer runs, fails the exit (its timeout on stderr, status 1), and a
second wait() of a failed op raises its error again."""

from __future__ import annotations

import os
import subprocess
import sys

import needs

SCRIPT = r"""
import mpi4py
mpi4py.rc.thread_level = "single"
from mpi4py import MPI
import torch
import moe_ep
import moe_ep.torch as mt
x, ids = torch.randn(2, 8), torch.tensor([[0], [1]], dtype=torch.int32)
for call in (lambda: mt.dispatch_v2(x, ids, MPI.COMM_WORLD, moe_expert_num=2, async_op=True),
             lambda: mt.combine_v2(x, ids, torch.zeros(256, dtype=torch.int32),
                                   torch.zeros(2, dtype=torch.int32), torch.ones(2, 1),
                                   MPI.COMM_WORLD, moe_expert_num=2, async_op=True)):
    try:
        call()
    except moe_ep.UnsupportedError as e:
        print("REFUSED", e)
"""


def test_async_needs_thread_multiple():
    reason = needs.mpi_reason()
    if reason is not None:
        needs.missing(reason)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REFUSED")]
    assert len(lines) == 2, out
    for op, line in zip(("dispatch_v2", "combine_v2"), lines):
        assert f"{op}_start: MPI was initialised with MPI_THREAD_SINGLE" in line, line
        assert "needs MPI_THREAD_MULTIPLE" in line, line


NEVER_WAITED = r"""
import sys
from mpi4py import MPI
import torch
import moe_ep
import moe_ep.torch as mt
comm = MPI.COMM_WORLD
x, ids = torch.randn(2, 8), torch.tensor([[0], [1]], dtype=torch.int32)
bad = ids.clone()
if comm.rank == 1:
    bad[0, 0] = 7
work = mt.dispatch_v2(x, bad, comm, moe_expert_num=2, async_op=True)
for attempt in range(2):
    try:
        work.wait()
    except moe_ep.Error as e:
        print(f"RAISED {attempt} {type(e).__name__}: {e}", flush=True)
if comm.rank == 0:
    mt.dispatch_v2(x, ids, comm, moe_expert_num=2, async_op=True)  # rank 1 never runs it
"""


def test_an_op_never_waited_for_fails_the_exit(tmp_path):
    mpirun = needs.mpirun()
    script = tmp_path / "never_waited.py"
    script.write_text(NEVER_WAITED)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               MOE_EP_TIMEOUT_S="2")
    proc = subprocess.run([mpirun, "-n", "2", "--oversubscribe", sys.executable, str(script)],
                          env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert ("moe_ep: an op started with async_op=True and never waited for failed: TimeoutError: "
            "dispatch_v2: rank 0 timed out") in out, out
    for attempt in (0, 1):  # the second wait() raises the same error
        assert f"RAISED {attempt} InvalidArgumentError: dispatch_v2: expert_ids" in out, out
        assert f"RAISED {attempt} RemoteError: dispatch_v2: rank 1 failed" in out, out
