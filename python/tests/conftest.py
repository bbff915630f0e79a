"""Shared set-up of the Python tests: the ops are registered once (importing moe_ep.torch), every
test starts from the same random seed so a failure reproduces on its own, and every test runs
with one OpenMP thread unless it asks for more.

Why one thread: the kernels open an OpenMP parallel region per call even for a handful of rows,
and torch and moe_ep share one libgomp (torch's), so torch.set_num_threads sets both. On a small
shared machine (2 cores, other jobs running) each region's barrier then waits for a descheduled
thread: the suite took 200 s with 2 threads and 11 s with 1. The results do not depend on the
thread count (SPEC §4: fixed reduction order); test_ops.py::test_thread_count_independent runs the
parallel paths with several threads and compares them bit for bit.
"""

import pytest
import torch

import moe_ep.torch  # noqa: F401  (registers torch.ops.moe_ep.*)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
