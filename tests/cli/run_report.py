"""Runs `moe-ep run` under mpirun and checks its report, not its timings:

  - exit status 0; every stdout line at most 100 columns (UTF-8 characters), but for a line that
    is a file's path alone: the report prints a path whole (it must stay one piece, to be copied),
    on a line of its own when it does not fit after its text, so however long the checkout's path
    is the layout holds; with real routing the statistics file's full path is on one line;
  - the time per phase says what "cold" is, and labels dispatch and combine cold;
  - with --warm-repeats N > 0 a "warm" block (median of N repeats) and warm bandwidths; with 0,
    no warm figure anywhere;
  - the last line(s): "PASS: <preset> layer (H h, E e, top-k) on W ranks, dispatch X ms +
    combine Y ms warm|cold; the output ..." with the header's H, E, K and W, the times of the
    warm (or cold) figures above, and the meaning of the check (bitwise / the int8 bound / the
    tolerance);
  - stderr: with --progress on, each phase's line in order; with off, none.

usage: run_report.py MPIEXEC NP EXPECT -- EXE run ARGS...   (EXPECT: exact, bound, tolerance)
"""

import os
import re
import subprocess
import sys

WIDTH = 100
PHASES = [
    "planning the run",
    "generating the tokens and the routing",
    "gathering the batch on rank 0",
    "dispatch_v2",
    "the local experts (",
    "combine_v2",
    "warm repeats of dispatch_v2 + combine_v2",
    "gathering the results on rank 0",
    "the dense single-process reference on rank 0",
]
MEANING = {
    "exact": "the output equals the dense single-process reference bitwise",
    "bound": "the output is within the bound of the dense single-process reference",
    "tolerance": "the output is within the tolerance of the dense single-process reference",
}


def fail(message, out="", err=""):
    sys.exit(f"FAILED: {message}\n--- stdout\n{out}--- stderr\n{err}")


def flag(args, name, default):
    return args[args.index(name) + 1] if name in args else default


def path_alone(line):
    """The line is an indent and the whole path of an existing file (may be wider than WIDTH)."""
    path = line.lstrip(" ")
    return path.startswith("/") and os.path.isfile(path)


def routing_file(cmd):
    """The statistics file of --routing real: --routing-file, else the tool's default (beside it)."""
    if flag(cmd, "--routing", "real") != "real" or "--load-routing" in cmd:
        return None
    tool_dir = os.path.dirname(os.path.realpath(cmd[0]))
    default = os.path.join(tool_dir, "..", "share", "moe-ep", "real-routing", "expert_counts.csv")
    return flag(cmd, "--routing-file", os.path.normpath(default))


def close(printed, value):
    """printed (3 significant digits) agrees with value (3 decimals)."""
    return abs(printed - value) <= 0.006 * max(abs(value), 1e-3) + 0.0015


def check_phases(lines, warm, out, err):
    i = next((j for j, l in enumerate(lines) if l.startswith("time per phase, ms")), None)
    if i is None or "cold = the first call, window set-up included" not in lines[i]:
        fail("no 'time per phase' line saying what cold is", out, err)
    m = re.fullmatch(r"  route [\d.]+  dispatch ([\d.]+) cold  experts [\d.]+  combine ([\d.]+) cold",
                     lines[i + 1])
    if not m:
        fail(f"phase times not labelled cold: {lines[i + 1]!r}", out, err)
    cold = (float(m.group(1)), float(m.group(2)))
    warm_lines = [j for j, l in enumerate(lines) if l.startswith("warm")]
    if warm == 0:
        if warm_lines or any("warm" in l for l in lines if l.startswith("bandwidth")):
            fail("--warm-repeats 0 still reports a warm figure", out, err)
        return cold, None
    head = (f"warm, ms (median of {warm} repeats of dispatch_v2 + combine_v2 on the same inputs, "
            "max over ranks):")
    if len(warm_lines) != 1 or lines[warm_lines[0]] != head:
        fail(f"no warm block '{head}'", out, err)
    m = re.fullmatch(r"  dispatch ([\d.]+)  combine ([\d.]+)", lines[warm_lines[0] + 1])
    if not m:
        fail(f"warm times: {lines[warm_lines[0] + 1]!r}", out, err)
    bandwidth = [l for l in lines if l.startswith("bandwidth") and "n/a" not in l]
    if bandwidth and not re.search(r"dispatch [\d.]+ cold, [\d.]+ warm  combine [\d.]+ cold, "
                                   r"[\d.]+ warm", bandwidth[0]):
        fail(f"bandwidth without cold and warm: {bandwidth[0]!r}", out, err)
    return cold, (float(m.group(1)), float(m.group(2)))


def check_summary(lines, np_, expect, times, warm, out, err):
    starts = [j for j, l in enumerate(lines) if l.startswith(("PASS: ", "FAIL: "))]
    if len(starts) != 1 or any(not l.startswith("  ") for l in lines[starts[0] + 1:]):
        fail("the report does not end with one PASS:/FAIL: summary", out, err)
    summary = " ".join(l.strip() for l in lines[starts[0]:])
    header = re.match(r"moe-ep run: preset (\S+)  H (\d+)  E (\d+).*?  K (\d+)", " ".join(lines),
                      re.S)
    preset, h, e, k = header.groups()
    m = re.fullmatch(
        rf"PASS: {re.escape(preset)} layer \(H {h}, E {e}, top-{k}\) on {np_} ranks?, "
        rf"dispatch ([\d.e+-]+) ms \+ combine ([\d.e+-]+) ms (warm|cold); (.*)", summary)
    if not m:
        fail(f"summary: {summary!r}", out, err)
    if m.group(3) != ("warm" if warm else "cold"):
        fail(f"summary says {m.group(3)}, --warm-repeats {warm}", out, err)
    if not (close(float(m.group(1)), times[0]) and close(float(m.group(2)), times[1])):
        fail(f"summary times {m.group(1)}, {m.group(2)} are not the report's {times}", out, err)
    if m.group(4) != MEANING[expect]:
        fail(f"summary meaning {m.group(4)!r}, expected {MEANING[expect]!r}", out, err)


def check_progress(mode, warm, out, err):
    seen = re.findall(r"^moe-ep run: \[\d+\.\d s\] (.*) \.\.\.$", err, re.M)
    if mode == "off" and seen:
        fail("--progress off printed progress lines", out, err)
    if mode != "on":
        return
    where = []
    for phase in (p for p in PHASES if warm or "warm" not in p):
        hits = [i for i, line in enumerate(seen) if phase in line]
        if not hits:
            fail(f"no progress line for {phase!r} in {seen}", out, err)
        where.append(hits[0])
    if where != sorted(where):
        fail(f"progress lines out of order: {seen}", out, err)


def main():
    mpiexec, np_, expect = sys.argv[1:4]
    cmd = sys.argv[sys.argv.index("--") + 1:]
    run = subprocess.run([mpiexec, "-n", np_, "--oversubscribe", *cmd], capture_output=True,
                         text=True, timeout=240)
    out, err = run.stdout, run.stderr
    if run.returncode != 0:
        fail(f"exit status {run.returncode}", out, err)
    lines = out.splitlines()
    wide = [l for l in lines if len(l) > WIDTH and not path_alone(l)]
    if wide:
        fail(f"{len(wide)} lines wider than {WIDTH} columns, e.g. {wide[0]!r}", out, err)
    statistics = routing_file(cmd)
    if statistics and not any(l.endswith(" " + statistics) for l in lines):
        fail(f"the report does not name the routing statistics {statistics!r} on one line", out,
             err)
    warm = int(flag(cmd, "--warm-repeats", "5"))
    cold, warm_times = check_phases(lines, warm, out, err)
    check_summary(lines, int(np_), expect, warm_times or cold, warm, out, err)
    check_progress(flag(cmd, "--progress", "auto"), warm, out, err)
    print(out + err)


if __name__ == "__main__":
    main()
