"""What the MPI tests need (mpirun on PATH, mpi4py), and what happens when it is missing: the tests
are skipped on a developer's machine, but under CI (the environment variable CI set to true, 1 or
yes, as GitHub Actions, GitLab CI and most others set it) a missing dependency fails them, so that
a CI image that lost mpirun or mpi4py cannot pass by skipping every distributed test."""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Optional

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def missing(reason: str) -> None:
    """Skips (the module, when called at import, or the test), or fails under CI."""
    if under_ci():
        pytest.fail(f"{reason}; under CI (CI={os.environ.get('CI')!r}) a missing dependency is a "
                    "failure, not a skip", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def mpi_reason() -> Optional[str]:
    """Why the MPI tests cannot run here (mpirun or mpi4py missing), or None."""
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed"
    return None


def mpirun() -> str:
    """mpirun's path, after missing() when the MPI tests cannot run (mpirun or mpi4py)."""
    reason = mpi_reason()
    if reason is not None:
        missing(reason)
    return shutil.which("mpirun")
