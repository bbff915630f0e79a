"""The per-rank report of the mpirun case scripts (mpi_dispatch_cases.py, mpi_autograd_cases.py).

mpirun forwards each rank's stdout in chunks that need not end at a line end, so under load one
rank's line can be cut by another's and a "CASE ... OK" line can be lost to a parser. say() writes
every line to stdout for people and, when the launcher set MOE_EP_TEST_REPORT_DIR, appends it whole
to this process's own file there, which the launcher parses.
"""

from __future__ import annotations

import os
import sys

_REPORT = None


def say(line: str) -> None:
    global _REPORT
    # one write per line: print() makes two (text, then newline) when stdout is unbuffered
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    folder = os.environ.get("MOE_EP_TEST_REPORT_DIR")
    if folder:
        if _REPORT is None:
            _REPORT = open(os.path.join(folder, f"{os.getpid()}.log"), "a", encoding="utf-8")
        _REPORT.write(line + "\n")
        _REPORT.flush()
