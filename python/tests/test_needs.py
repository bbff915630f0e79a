"""Issue 30, item 2: the MPI tests skip without mpirun on a developer's machine, but fail under CI
(CI=true), so that a CI image without mpirun cannot pass by skipping them (needs.py). Each test
module that needs mpirun is collected in a child pytest with a PATH that has no mpirun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
MODULES = ["test_dispatch_mpi.py", "test_autograd_mpi.py", "test_faults.py", "test_readme.py"]


def _collect(ci: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """One child pytest over every module of MODULES (each child imports torch: seconds)."""
    empty = tmp_path / "bin"  # a PATH with no mpirun (pytest runs as sys.executable -m pytest)
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(PATH=str(empty), PYTHONDONTWRITEBYTECODE="1")
    if ci:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
        + [str(HERE / m) for m in MODULES],
        env=env, cwd=HERE, capture_output=True, text=True, timeout=300)


def test_a_missing_mpirun_skips_but_fails_under_ci(tmp_path):
    here = _collect("", tmp_path)
    out = here.stdout + here.stderr
    assert here.returncode in (0, 5), out  # 5: nothing collected (the modules skipped)
    assert f"SKIPPED [{len(MODULES)}]" in out and "mpirun is not on PATH" in out, out
    assert f"{len(MODULES)} skipped" in out, out
    ci = _collect("true", tmp_path)
    out = ci.stdout + ci.stderr
    assert ci.returncode not in (0, 5), out
    for module in MODULES:  # each module fails on its own
        assert f"ERROR collecting python/tests/{module}" in out, out
    assert out.count("mpirun is not on PATH; under CI (CI='true') a missing dependency is a "
                     "failure, not a skip") == len(MODULES), out


def test_pyargs_distributed_tests_fail_under_ci_without_mpirun(tmp_path):
    # test_pyargs.py has local tests too: only its distributed test fails.
    empty = tmp_path / "bin"
    empty.mkdir()
    env = dict(os.environ, PATH=str(empty), CI="true")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(HERE / "test_pyargs.py") + "::test_every_mpi_case_ran"],
        env=env, cwd=HERE, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 failed" in out, out
    assert "mpirun is not on PATH; under CI" in out, out
