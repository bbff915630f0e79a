"""Faults under the Python front (issue 23), four ranks, MOE_EP_TIMEOUT_S=5: rank 1 exits before
its third round trip, makes one more than the others, SIGSTOPs itself or SIGKILLs itself (mpirun
--enable-recovery). The driver, tests/faults/faults.py (the CLI's cases too, in ctest), checks
from outside that the ranks left waiting name rank 1 (in the extra-op case, rank 1 names the
others) within the deadline + 1 s, and that every process exits within the deadline + 5 s: no
hang in MPI_Finalize after an error (the exit guard, moe_ep.torch.distributed).

Needs Open MPI's mpirun (--output-filename, --enable-recovery) and mpi4py; skipped without them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mpi4py")
MPIRUN = shutil.which("mpirun")
if MPIRUN is None:
    pytest.skip("mpirun is not on PATH", allow_module_level=True)
if "Open MPI" not in subprocess.run([MPIRUN, "--version"], capture_output=True, text=True).stdout:
    pytest.skip("the fault driver needs Open MPI's mpirun", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "faults"))
import faults  # noqa: E402


@pytest.mark.parametrize("mode", ["exit", "extra", "stop", "kill"])
def test_fault_is_named_and_every_process_exits(mode):
    job, survivors, culprits, fault = faults.python_cases(sys.executable)[mode]()
    bad = faults.check(job, f"python.{mode}", survivors, culprits, fault)
    faults.report(f"python.{mode}", job, bad, fault)
    assert not bad, "\n".join(bad)
    if mode == "stop":
        # rank 1 is stopped: the survivors' MPI_Finalize waits for it, and the exit guard ends
        # them, naming the first error (the first to end makes mpirun kill the others, which may
        # not get to say so). In "exit", rank 1 waits in MPI_Finalize, which the survivors then
        # complete with it: no guard needed.
        said = [r for r in survivors if "is still exiting 2 s after its interpreter began to"
                in job.stderr[r] and "The first error was Timeout: dispatch_v2" in job.stderr[r]]
        assert said, "no survivor's exit guard fired: " + job.stderr[survivors[0]][-2000:]
