"""Checks the outputs of one `moe-ep bench --compare --quant int8` run for consistency, never
for speed (timings on a shared machine are noisy; speed is measured in benchmarks, not asserted
in tests). Each check can fail on a broken tool:

  - every verification line reads "N checked, 0 bad" with N > 0, all seven checks per point, and
    the point ends "verified";
  - every table row is well formed: numbers, p50 <= p99, ratios "<x.xx>x" on moe-ep's rows and
    "-" elsewhere; the JSON and CSV say the same (p50, p99, bytes, GB/s = bytes / p50, the ratios
    = baseline p50 / moe-ep p50, int8's time ratio = int8 p50 / bf16 p50);
  - each target's verdict (printed PASS/FAIL and JSON "pass") agrees with its value and bound,
    and the value is the ratio it names;
  - the plot's script gives every series its own colour;
  - on two nodes or more (both comm_algs timed, "moe-ep/fullmesh" and "moe-ep/hierarchy"): the
    hierarchy check ran too, and the hierarchy/fullmesh targets are the ratios of the JSON's
    inter-node bytes and p50s.

usage: bench_check.py STDOUT CSV JSON [GP]
"""

import csv
import json
import math
import re
import sys

CHECKS = 7  # with --compare and --quant int8 (8 with both comm_algs)
ROW = re.compile(r"  (\S+) +(moe-ep(?:/fullmesh|/hierarchy)?|alltoallv|textbook|memcpy) +([\d.]+) +"
                 r"([\d.]+) +([\d.]+) +([\d.]+|nan|inf) +(\S+) +(\S+)")
TARGET = re.compile(r"  tokens/rank +(\d+)  (.+?) +(-?[\d.]+|nan|inf) (>=|<=) ([\d.]+)  (PASS|FAIL)")


def rel(a, b, tol):
    return abs(a - b) <= tol * max(abs(a), abs(b))


def check_stdout(text):
    both = "moe-ep/hierarchy" in text  # both comm_algs timed
    # The hierarchy check runs whenever hierarchy is timed (also --comm-alg hierarchy alone).
    checks = CHECKS + ("comm_alg hierarchy: expand_x == fullmesh's" in text)
    points = re.findall(r"verify tokens/rank (\d+):\n((?:  .*\n)+)", text)
    assert points, "no verification"
    for tokens, block in points:
        lines = block.splitlines()
        assert lines[-1] == "  verified", f"tokens {tokens}: {lines[-1]!r}"
        counts = [re.fullmatch(r"  .+: (\d+) checked, (\d+) bad", l) for l in lines[:-1]]
        assert len(counts) == checks and all(counts), f"tokens {tokens}: {lines}"
        for m in counts:
            assert int(m.group(1)) > 0 and int(m.group(2)) == 0, m.group(0)
    rows = [ROW.fullmatch(l) for l in text.splitlines() if ROW.fullmatch(l)]
    assert len(rows) == (11 if both else 9) * len(points), f"{len(rows)} rows, {len(points)} points"
    main = rows[0].group(2)  # the first row: moe-ep's dispatch with --comm-alg
    assert main.startswith("moe-ep"), rows[0].group(0)
    for m in rows:
        p50, p99 = float(m.group(4)), float(m.group(5))
        assert p50 <= p99, m.group(0)
        ratio = r"\d+\.\d\dx" if m.group(2) == main else "-"
        if m.group(1) == "dispatch-int8" and m.group(2) == main:
            assert re.fullmatch(ratio, m.group(7)) and m.group(8) == "-", m.group(0)
        else:
            assert re.fullmatch(ratio, m.group(7)) and re.fullmatch(ratio, m.group(8)), m.group(0)
    targets = [TARGET.fullmatch(l) for l in text.splitlines() if l.startswith("  tokens/rank ")]
    assert targets and all(targets), "malformed target lines"
    for m in targets:
        value, bound = float(m.group(3)), float(m.group(5))
        # A printed value equal to the bound after rounding could go either way.
        if abs(value - bound) > 0.0005:
            holds = value >= bound if m.group(4) == ">=" else value <= bound
            assert (m.group(6) == "PASS") == holds, f"verdict against value: {m.group(0)}"
    return {(int(m.group(1)), m.group(2)): m for m in targets}, len(points), both


def hierarchy_ratio(by, t, name):
    """The value of target "<op> hierarchy/fullmesh inter-node bytes" or "... p50"."""
    op = name.split(" ")[0]
    hier, full = by[(t, op, "moe-ep/hierarchy")], by[(t, op, "moe-ep/fullmesh")]
    if name.endswith("inter-node bytes"):
        return hier["inter_node_bytes_per_rank"] / full["inter_node_bytes_per_rank"]
    return hier["p50_ms"] / full["p50_ms"]


def check_json(j, printed_targets, both):
    r = j["results"]
    by = {(x["tokens_per_rank"], x["op"], x["impl"]): x for x in r}
    main = "moe-ep/" + j["config"]["comm_alg"] if both else "moe-ep"
    for x in r:
        assert x["p50_ms"] > 0 and x["p99_ms"] >= x["p50_ms"] and x["bytes_per_rank"] > 0, x
        assert rel(x["gbps"], x["bytes_per_rank"] / (x["p50_ms"] * 1e-3) / 1e9, 1e-9), x
    for (t, op, impl), x in by.items():
        if impl != main:
            assert x["ratio_vs_alltoallv"] is None and x["ratio_vs_textbook"] is None, x
            continue
        a2a = by[(t, op, "alltoallv")]["p50_ms"] / x["p50_ms"]
        assert rel(x["ratio_vs_alltoallv"], a2a, 1e-9), x
        if op != "dispatch-int8":
            tb = by[(t, op, "textbook")]["p50_ms"] / x["p50_ms"]
            assert rel(x["ratio_vs_textbook"], tb, 1e-9), x
    for i in j["int8"]:
        t = i["tokens_per_rank"]
        time = by[(t, "dispatch-int8", main)]["p50_ms"] / by[(t, "dispatch", main)]["p50_ms"]
        assert rel(i["time_ratio"], time, 1e-9), i
    assert len(j["targets"]) == len(printed_targets), "printed and JSON targets differ"
    for t in j["targets"]:
        holds = t["value"] >= t["bound"] if t["at_least"] else t["value"] <= t["bound"]
        assert t["pass"] is holds, f"verdict against value: {t}"
        m = printed_targets[(t["tokens_per_rank"], t["name"])]
        assert (m.group(6) == "PASS") is t["pass"], f"printed {m.group(0)!r}, JSON {t}"
        assert abs(float(m.group(3)) - t["value"]) <= 0.0005 + 1e-12, (m.group(0), t)
        assert t["bound"] == float(m.group(5)) and t["at_least"] is (m.group(4) == ">="), t
        name = t["name"]
        if name.endswith("moe-ep/alltoallv") or name.endswith("moe-ep/textbook"):
            op, base = name.split(" ")[0], name.split("/")[1]
            value = by[(t["tokens_per_rank"], op, main)][f"ratio_vs_{base}"]
        elif "hierarchy/fullmesh" in name:
            value = hierarchy_ratio(by, t["tokens_per_rank"], name)
            assert rel(value, t["value"], 1e-9), (name, value, t)
            continue
        else:
            value = next(i["time_ratio"] for i in j["int8"]
                         if i["tokens_per_rank"] == t["tokens_per_rank"])
        assert value == t["value"], (name, value, t)
    return by


def check_csv(rows, by):
    assert len(rows) == len(by), f"{len(rows)} CSV rows, {len(by)} JSON results"
    for row in rows:
        x = by[(int(row["tokens_per_rank"]), row["op"], row["impl"])]
        assert float(row["bytes_per_rank"]) > 0
        assert float(row["p50_ms"]) <= float(row["p99_ms"]), row
        for key in ("p50_ms", "p99_ms", "gbps", "ratio_vs_alltoallv", "ratio_vs_textbook"):
            if x[key] is None:
                assert row[key] == "", row
            else:
                assert rel(float(row[key]), x[key], 1e-5), (key, row, x)
        assert abs(float(row["bytes_per_rank"]) - x["bytes_per_rank"]) <= 0.5, row


def check_plot(script, both):
    colours = re.findall(r"lc rgb '(#[0-9a-f]{6})'", script)
    series = re.findall(r"with linespoints .* title '([^']+)'", script)
    assert len(series) == (11 if both else 9) and len(colours) == len(series), (series, colours)
    assert len(set(colours)) == len(colours), f"series share a colour: {list(zip(series, colours))}"


def main():
    text = open(sys.argv[1], encoding="utf-8").read()
    printed_targets, points, both = check_stdout(text)
    j = json.load(open(sys.argv[3]))
    by = check_json(j, printed_targets, both)
    check_csv(list(csv.DictReader(open(sys.argv[2]))), by)
    if len(sys.argv) > 4:
        check_plot(open(sys.argv[4]).read(), both)
    print(f"bench outputs consistent: {points} points, {len(by)} results, "
          f"{len(j['targets'])} targets")


if __name__ == "__main__":
    main()
