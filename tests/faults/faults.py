"""Fault cases (issue 23): a rank that exits early, calls an extra op (the tool: is given an extra
iteration, named at the command-line comparison), is SIGSTOPped past the
deadline or is SIGKILLed, under `moe-ep bench` and under the Python front. Each case runs one
mpirun job and checks, from outside:
  - every process exits (mpirun returns) within deadline + 5 s of the fault;
  - every survivor prints an error that names the culprit rank;
  - the first of those appears no later than deadline + 1 s after the fault.
Each rank's output goes to its own file (mpirun --output-filename), polled every 20 ms, so the
time a rank's first line appears is known to about that. Standard library only.

  python3 tests/faults/faults.py cli BUILD/bin/moe-ep [CASE...]
  python3 tests/faults/faults.py python PYTHON [CASE...]     (PYTHON: with moe_ep and mpi4py)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

DEADLINE_S = 5.0
WORLD = 4
CULPRIT = 1
POLL_S = 0.02
# A job that outlives this is a hang: killed, and the case fails.
HANG_S = 60.0
HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Job:
    """What one mpirun job did, times in seconds since mpirun started."""

    rc: int
    end: float  # mpirun returned (every process had exited), or HANG_S when killed
    hung: bool
    first_error: Dict[int, float]  # rank -> when its first stderr line appeared
    stderr: Dict[int, str]
    stdout: Dict[int, str]
    fault: Optional[float] = None  # when the fault began (injected, or reported by the rank)
    notes: List[str] = field(default_factory=list)


def mpi_env(extra: Dict[str, str]) -> Dict[str, str]:
    env = dict(os.environ)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.update(extra)
    return env


def find_rank_pid(tag: str, rank: int) -> Optional[int]:
    """The pid of the job's process of MPI_COMM_WORLD rank `rank` (by its environment)."""
    want = (f"MOE_EP_FAULT_TAG={tag}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode())
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if all(w in env for w in want) and b"OMPI_COMM_WORLD_SIZE" in b"\0".join(env):
            try:
                with open(f"/proc/{pid}/comm", "rb") as f:
                    if f.read().strip() in (b"mpirun", b"orted", b"prterun"):
                        continue
            except OSError:
                continue
            return int(pid)
    return None


def rank_file(out: str, rank: int, stream: str) -> str:
    return os.path.join(out, "1", f"rank.{rank}", stream)


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def run_job(
    contexts: List[List[str]],
    env: Dict[str, str],
    recovery: bool = False,
    inject: Optional[tuple] = None,
) -> Job:
    """Runs `mpirun ctx0 : ctx1 : ...` (each context: [-n, N, program, args...]).
    inject: (signal, marker): sends the signal to rank CULPRIT 0.5 s after `marker` appears in
    rank 0's stdout (a step the job reaches only once every rank has set up)."""
    out = tempfile.mkdtemp(prefix="moe-ep-faults-")
    tag = uuid.uuid4().hex
    cmd = ["mpirun", "--oversubscribe", "--output-filename", out, "-x", "MOE_EP_FAULT_TAG"]
    for k in env:
        cmd += ["-x", k]
    if recovery:
        cmd += ["--enable-recovery"]
    for i, ctx in enumerate(contexts):
        if i:
            cmd.append(":")
        cmd += ctx
    t0 = time.monotonic()
    with open(os.path.join(out, "mpirun.log"), "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=mpi_env({**env, "MOE_EP_FAULT_TAG": tag})
        )
        first: Dict[int, float] = {}
        fault = None
        marked = None
        notes: List[str] = []
        hung = False
        while True:
            now = time.monotonic() - t0
            for r in range(WORLD):
                path = rank_file(out, r, "stderr")
                if r not in first and os.path.exists(path) and os.path.getsize(path) > 0:
                    first[r] = now
            if inject and marked is None and inject[1] in read(rank_file(out, 0, "stdout")):
                marked = now
            if inject is not None and fault is None and marked is not None and now >= marked + 0.5:
                pid = find_rank_pid(tag, CULPRIT)
                if pid is None:
                    notes.append("no process of rank %d found to signal" % CULPRIT)
                    fault = now
                else:
                    os.kill(pid, inject[0])
                    fault = time.monotonic() - t0
            if proc.poll() is not None:
                break
            if now > HANG_S:
                hung = True
                proc.kill()
                proc.wait()
                break
            time.sleep(POLL_S)
        end = time.monotonic() - t0
    job = Job(
        rc=proc.returncode,
        end=end,
        hung=hung,
        first_error=first,
        stderr={r: read(rank_file(out, r, "stderr")) for r in range(WORLD)},
        stdout={r: read(rank_file(out, r, "stdout")) for r in range(WORLD)},
        fault=fault,
        notes=notes,
    )
    job.notes.append("mpirun: " + read(os.path.join(out, "mpirun.log"))[-2000:])
    shutil.rmtree(out, ignore_errors=True)
    return job


# "waiting for rank(s) 1, 3" (the library), "ranks 1 and 3 did not arrive" (the tool),
# "rank 1 failed" / "rank 1 exited" (a peer's report), "rank 0 is at X, rank 1 at Y" (the tool).
_NAMED = [
    re.compile(r"waiting for rank\(s\) ([0-9, ]+)"),
    re.compile(r"ranks? ([0-9, and]+?) did not arrive"),
    re.compile(r"rank ([0-9]+) (?:failed|exited|died|is gone)"),
    re.compile(r"is at .*?, rank ([0-9]+) at "),  # the tool: a rank at another step
    re.compile(r"rank\(s\) ([0-9, ]+) were given another command line"),  # the tool
]


def named_ranks(text: str) -> set:
    ranks = set()
    for pat in _NAMED:
        for m in pat.finditer(text):
            ranks.update(int(x) for x in re.findall(r"[0-9]+", m.group(1)))
    return ranks


def check(job: Job, name: str, survivors: List[int], culprits: set, fault: float) -> List[str]:
    """The case's failures (empty: it passed)."""
    bad = []
    if job.hung:
        bad.append(f"{name}: still running {HANG_S:.0f} s after start (killed): a hang")
    if job.end > fault + DEADLINE_S + 5:
        bad.append(
            f"{name}: the last process exited {job.end - fault:.1f} s after the fault "
            f"(bound: deadline {DEADLINE_S:g} s + 5)"
        )
    first = min((job.first_error[r] for r in survivors if r in job.first_error), default=None)
    if first is not None and first - fault > DEADLINE_S + 1:
        bad.append(
            f"{name}: the first error came {first - fault:.1f} s after the fault "
            f"(bound: deadline {DEADLINE_S:g} s + 1)"
        )
    for r in survivors:
        if r not in job.first_error:
            bad.append(f"{name}: rank {r} printed no error")
            continue
        first_line = next((l for l in job.stderr[r].splitlines() if "rror" in l), "")
        if not (named_ranks(job.stderr[r]) & culprits):
            bad.append(
                f"{name}: rank {r}'s error does not name rank(s) {sorted(culprits)}: "
                f"{first_line!r}"
            )
    return bad


def report(name: str, job: Job, bad: List[str], fault: float) -> None:
    times = ", ".join(f"{r}: {t - fault:+.2f}" for r, t in sorted(job.first_error.items()))
    print(
        f"CASE {name}: {'OK' if not bad else 'FAIL'}: rc {job.rc}, every process exited "
        f"{job.end - fault:.2f} s after the fault, first error per rank (s after it) {{{times}}}"
    )
    for b in bad:
        print("  " + b)
    if bad or os.environ.get("MOE_EP_FAULTS_VERBOSE") == "1":
        for r in range(WORLD):
            print(f"  --- rank {r} stderr:\n" + job.stderr[r][-1500:])
        for n in job.notes:
            print("  " + n)


# ---- moe-ep bench -------------------------------------------------------------------------------


def bench_args(tool: str, iters: int) -> List[str]:
    return [tool, "bench", "--tokens", "16", "--hidden", "64", "--experts", "8", "--top-k", "2",
            "--iters", str(iters), "--warmup", "1", "--timeout", f"{DEADLINE_S:g}"]


def cli_cases(tool: str) -> Dict[str, callable]:
    others = WORLD - CULPRIT - 1
    survivors = [r for r in range(WORLD) if r != CULPRIT]

    def healthy_end() -> float:
        job = run_job([["-n", str(WORLD)] + bench_args(tool, 3)], {})
        if job.rc != 0 or job.hung:
            raise SystemExit(f"the healthy bench failed (rc {job.rc}):\n" + "\n".join(job.notes)
                             + "\n" + job.stderr[0])
        return job.end

    def mpmd(culprit_cmd: List[str], iters: int) -> List[List[str]]:
        return [["-n", str(CULPRIT)] + bench_args(tool, iters), ["-n", "1"] + culprit_cmd,
                ["-n", str(others)] + bench_args(tool, iters)]

    def exit_early():
        # Rank 1 agrees on the command line, then ends (MPI_Finalize) without joining the bench.
        # The fault is no later than a healthy run's end: its errors are bounded from there.
        fault = healthy_end()
        job = run_job(mpmd([tool, "--version"], 3), {})
        return job, survivors, {CULPRIT}, fault

    def extra_op():
        # Rank 1 is told to time one more iteration than the others: every rank names it at the
        # command-line comparison, before any op.
        fault = healthy_end()
        job = run_job(mpmd(bench_args(tool, 4), 3), {})
        return job, survivors, {CULPRIT}, fault

    def signalled(sig, recovery):
        def case():
            # the first timed iterations follow the verification's last line
            job = run_job([["-n", str(WORLD)] + bench_args(tool, 1000000)], {},
                          recovery=recovery, inject=(sig, "verified\n"))
            if job.fault is None:
                raise SystemExit("the bench never reached its timed iterations:\n" + job.stderr[0])
            return job, survivors, {CULPRIT}, job.fault
        return case

    return {"exit": exit_early, "extra": extra_op, "stop": signalled(signal.SIGSTOP, False),
            "kill": signalled(signal.SIGKILL, True)}


# ---- the Python front ---------------------------------------------------------------------------


def python_cases(python: str) -> Dict[str, callable]:
    program = os.path.join(HERE, "fault_case.py")
    survivors = [r for r in range(WORLD) if r != CULPRIT]
    # The exit guard at its default grace. MOE_EP_ABORT_ON_EXCEPTION=0: each survivor raises its
    # own error (naming rank 1) and exits through the guard, instead of the first to raise ending
    # the job with MPI_Abort (python/moe_ep/__init__.py) before the others have said anything.
    env = {"MOE_EP_TIMEOUT_S": f"{DEADLINE_S:g}", "MOE_EP_ABORT_ON_EXCEPTION": "0"}

    def fault_time(job: Job, t0_wall: float) -> float:
        m = re.search(r"FAULT ([0-9.]+)", job.stdout[CULPRIT])
        if not m:
            raise SystemExit(f"rank {CULPRIT} did not report its fault:\n" + job.stderr[CULPRIT])
        return float(m.group(1)) - t0_wall

    def case(mode: str, roles):
        def run():
            t0_wall = time.time()
            job = run_job([["-n", str(WORLD), python, program, mode, str(CULPRIT)]], env,
                          recovery=(mode == "kill"))
            who, culprits = roles
            return job, who, culprits, fault_time(job, t0_wall)
        return run

    rest = {r for r in range(WORLD) if r != CULPRIT}
    return {
        "exit": case("exit", (survivors, {CULPRIT})),
        # The others finish and exit: only rank 1's extra call waits, and names whom it waits for.
        "extra": case("extra", ([CULPRIT], rest)),
        "stop": case("stop", (survivors, {CULPRIT})),
        "kill": case("kill", (survivors, {CULPRIT})),
    }


def main(argv: List[str]) -> int:
    if len(argv) < 3 or argv[1] not in ("cli", "python"):
        print(__doc__)
        return 2
    cases = (cli_cases if argv[1] == "cli" else python_cases)(argv[2])
    names = argv[3:] or list(cases)
    failed = 0
    for name in names:
        job, survivors, culprits, fault = cases[name]()
        label = f"{argv[1]}.{name}"
        bad = check(job, label, survivors, culprits, fault)
        report(label, job, bad, fault)
        failed += bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
