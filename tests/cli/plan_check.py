#!/usr/bin/env python3
"""moe-ep plan against what moe-ep run measures: the same layer on 2 emulated nodes of
2 ranks ($MOE_EP_SHM_NODE_RANKS=2), both algorithms (hierarchy also with bf16 partials); the
planner's mean inter-node bytes per rank must be within 10 % of the measured ones
(Communicator::traffic), dispatch and combine.
  plan_check.py MPIEXEC MOE_EP"""
import os
import re
import subprocess
import sys

LAYER = ["--preset", "olmoe", "--tokens", "256", "--hidden", "2048"]


def words(text):
    return " ".join(text.split())


def measured(mpiexec, exe, alg, extra):
    env = dict(os.environ, MOE_EP_SHM_NODE_RANKS="2")
    out = subprocess.run([mpiexec, "-n", "4", "--oversubscribe", exe, "run", "--comm-alg", alg,
                          "--expert-fn", "scale", *LAYER, *extra], env=env, capture_output=True,
                         text=True, timeout=240)
    if out.returncode != 0:
        sys.exit(f"moe-ep run --comm-alg {alg} failed:\n{out.stdout}\n{out.stderr}")
    m = re.search(r"comm_alg " + alg + r"\): dispatch inter-node ([0-9.]+), intra-node [0-9.]+; "
                  r"combine inter-node ([0-9.]+)", words(out.stdout))
    if not m:
        sys.exit(f"no bytes line in moe-ep run's output:\n{out.stdout}")
    return float(m.group(1)), float(m.group(2))


def planned(exe, extra):
    out = subprocess.run([exe, "plan", "--ranks", "4", "--ranks-per-node", "2", *LAYER, *extra],
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        sys.exit(f"moe-ep plan failed:\n{out.stdout}\n{out.stderr}")
    rows = {}
    for op in ("dispatch", "combine"):
        m = re.search(r"^  " + op + r"\s+([0-9.]+) / [0-9.]+\s+([0-9.]+) / ", out.stdout, re.M)
        if not m:
            sys.exit(f"no {op} row in moe-ep plan's output:\n{out.stdout}")
        rows[op] = (float(m.group(1)), float(m.group(2)))
    return {"fullmesh": (rows["dispatch"][0], rows["combine"][0]),
            "hierarchy": (rows["dispatch"][1], rows["combine"][1])}


def main():
    mpiexec, exe = sys.argv[1], sys.argv[2]
    bad = []
    for alg, extra in (("fullmesh", []), ("hierarchy", []),
                       ("hierarchy", ["--partials", "bf16"])):
        plan = planned(exe, extra)
        got = measured(mpiexec, exe, alg, extra)
        name = " ".join([alg, *extra])
        for op, want, have in zip(("dispatch", "combine"), plan[alg], got):
            ok = abs(want - have) <= 0.10 * have
            print(f"{name:9} {op:8} planned {want:.3f} MB, measured {have:.3f} MB: "
                  f"{'ok' if ok else 'OFF BY MORE THAN 10 %'}")
            if not ok:
                bad.append(f"{name} {op}")
    if bad:
        sys.exit("moe-ep plan disagrees with the measured bytes: " + ", ".join(bad))


main()
