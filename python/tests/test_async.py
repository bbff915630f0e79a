"""async_op=True outside the MPI launches (the launches' cases are in mpi_autograd_cases.py:
async_layer, async_sources_and_errors, expert_parallel_overlap): a process whose MPI gives less
than MPI_THREAD_MULTIPLE is refused with UnsupportedError naming the level it got."""

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
