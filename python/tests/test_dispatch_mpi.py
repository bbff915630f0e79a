"""dispatch_v2 / combine_v2 through moe_ep.torch, under mpirun at world sizes 1-4.

Each world size is one mpirun launch of mpi_dispatch_cases.py, which runs every case of that size
(starting the ranks and importing torch costs seconds; the cases take milliseconds); the tests
below read its per-rank report, one test per (world size, case). The oracle (in the helper) is an
independent pure-torch reference: SPEC §1.4's row order, counts and assist triples, §1.5's int8
quantisation, and §2.3's weighted sum, bitwise (also with §2.2's special experts, comm_quant_mode
2, elastic_info scale-in and tp_world_size 2). examples/python/moe_layer.py runs in the 4-rank
launch too (as __main__, with its default arguments).

Needs mpirun (Open MPI or MPICH) and mpi4py; skipped without them, failed without them under CI
(CI=true; needs.py).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CASES_SCRIPT = HERE / "mpi_dispatch_cases.py"
WORLD_SIZES = (1, 2, 3, 4)
LAUNCH_TIMEOUT_S = 300  # a hang shows up as MOE_EP_TIMEOUT_S (60 s) timeouts well before this

sys.path.insert(0, str(HERE))
import needs  # noqa: E402

MPIRUN = needs.mpirun()  # skipped without mpirun or mpi4py; failed under CI (CI=true)

import mpi_dispatch_cases  # noqa: E402  (after the skips: imports torch and moe_ep)


def _env() -> dict:
    env = dict(os.environ, MOE_EP_TIMEOUT_S="60", OMP_NUM_THREADS="1")
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers: Open MPI refuses root otherwise
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _mpirun(np_: int, *argv: str) -> subprocess.CompletedProcess:
    """Runs a case script; .report holds the lines its ranks wrote with mpi_report.say(), whole
    (in stdout, mpirun may cut one rank's line with another's)."""
    cmd = [MPIRUN, "-n", str(np_)]
    if "Open MPI" in _mpirun_version():
        cmd.append("--oversubscribe")
    cmd += [sys.executable, *argv]
    with tempfile.TemporaryDirectory(prefix="moe-ep-report-") as folder:
        try:
            proc = subprocess.run(
                cmd, env=dict(_env(), MOE_EP_TEST_REPORT_DIR=folder), cwd=ROOT,
                capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as e:
            pytest.fail(
                f"{' '.join(cmd)} did not finish in {LAUNCH_TIMEOUT_S} s\n"
                f"stdout:\n{e.stdout}\nstderr:\n{e.stderr}"
            )
        proc.report = "".join(p.read_text() for p in sorted(Path(folder).glob("*.log")))
    return proc


@functools.lru_cache(maxsize=None)
def _mpirun_version() -> str:
    return subprocess.run([MPIRUN, "--version"], capture_output=True, text=True).stdout


@functools.lru_cache(maxsize=None)
def _launch(world: int):
    """Runs every case of this world size once: (process, {case: {rank: "OK" or "FAIL: ..."}})."""
    proc = _mpirun(world, str(CASES_SCRIPT))
    results: dict = {}
    for m in re.finditer(r"^CASE (\S+) rank=(\d+) (OK|FAIL: .*?)(?: \([\d.]+ s\))?$",
                         proc.report, re.M):
        results.setdefault(m.group(1), {})[int(m.group(2))] = m.group(3)
    return proc, results


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_launch_completes(world):
    """Every rank reached the end, and the launch exited 0."""
    proc, _ = _launch(world)
    done = re.findall(r"^DONE rank=(\d+) failed=(\d+)$", proc.report, re.M)
    assert sorted(int(r) for r, _ in done) == list(range(world)), _tail(proc.stdout + proc.stderr)
    assert proc.returncode == 0, _tail(proc.stdout + proc.stderr)


@pytest.mark.parametrize(
    "world,name",
    [(w, n) for w in WORLD_SIZES for n in mpi_dispatch_cases.case_names(w)],
)
def test_case(world, name):
    proc, results = _launch(world)
    got = results.get(name, {})
    missing = [r for r in range(world) if r not in got]
    assert not missing, f"no report from rank(s) {missing}:\n{_tail(proc.stdout + proc.stderr)}"
    failed = {r: v for r, v in sorted(got.items()) if v != "OK"}
    assert not failed, "\n".join(f"rank {r}: {v}" for r, v in failed.items())


def test_every_world_size_has_the_core_cases():
    """The case table is what the tests above enumerate: guard against it shrinking silently."""
    for w in WORLD_SIZES:
        names = mpi_dispatch_cases.case_names(w)
        assert {"round_trip_fp32", "quant_mode_2", "bad_expert_id_on_one_rank"} <= set(names)
        assert {"comm_quant_mode_2", "special_experts"} <= set(names)
        assert {"workspace_matches_outputs", "shm_window_bytes_option"} <= set(names)
        assert "exact_size_matches_default" in names
        assert ("elastic_scale_in" in names) == (w >= 2)
    assert "shared_expert_rank" in mpi_dispatch_cases.case_names(2)
    assert "compile_fullgraph" in mpi_dispatch_cases.case_names(2)
    assert "compile_fullgraph_exact_size" in mpi_dispatch_cases.case_names(2)
    assert "exact_size_errors" in mpi_dispatch_cases.case_names(2)
    assert "opcheck_dispatch_combine" in mpi_dispatch_cases.case_names(2)
    assert "moe_layer_example" in mpi_dispatch_cases.case_names(4)
    assert "tensor_parallel_pairs" in mpi_dispatch_cases.case_names(4)


def test_moe_layer_example():
    """examples/python/moe_layer.py (a Mixtral-style layer over 4 ranks against the dense layer)
    runs as the case moe_layer_example of the 4-rank launch: exit status 0 on every rank, and
    rank 0 printed PASS."""
    proc, results = _launch(4)
    assert results.get("moe_layer_example") == {r: "OK" for r in range(4)}, _tail(
        proc.stdout + proc.stderr
    )
    assert re.search(r"^moe_layer\.py rank=0: PASS$", proc.report, re.M), _tail(proc.stdout)
