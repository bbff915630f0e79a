#!/usr/bin/env bash
# Prints the results table of docs/performance.md ("Results on this machine") as Markdown, from
# fresh runs on this machine:
#   mpirun -n 2 moe-ep bench --compare                        (512 tokens per rank, bf16 and int8)
#   mpirun -n 2 moe-ep bench --compare --tokens 1,16,64 --iters 200 --quant none  (small batches)
#   moe-ep-bench-local --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
# each RUNS times (default 3), interleaved. Each row shows the run in which moe-ep's time was
# lowest, with that run's own baselines (a shared machine's load moves whole runs).
#   scripts/perf-table.sh [BUILD_DIR]       default: build (configured with -DMOE_EP_BUILD_BENCH=ON)
# RUNS=n sets the number of runs; WORK=dir keeps the raw outputs there (default: a temporary
# directory, printed at the end); REUSE=1 prints the table from WORK's outputs without running.
# Exits non-zero if a run fails (a failed verification included).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(realpath "${1:-$root/build}")
runs=${RUNS:-3}
work=${WORK:-$(mktemp -d)}
mkdir -p "$work"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
tool=$build/bin/moe-ep
local_bench=$build/bin/moe-ep-bench-local
for exe in "$tool" "$local_bench"; do
  [ -x "$exe" ] || { echo "perf-table.sh: $exe not found (build with -DMOE_EP_BUILD_BENCH=ON)" >&2; exit 1; }
done

[ -n "${REUSE:-}" ] || cut -d' ' -f1 /proc/loadavg >"$work/load"
load=$(cat "$work/load" 2>/dev/null || echo '?')
for i in $(seq 1 "$runs"); do
  [ -n "${REUSE:-}" ] && break
  echo "perf-table.sh: run $i of $runs ($work)" >&2
  mpirun -n 2 "$tool" bench --compare --csv "$work/target.$i.csv" >"$work/target.$i.log" 2>&1 ||
    { cat "$work/target.$i.log" >&2; exit 1; }
  mpirun -n 2 "$tool" bench --compare --tokens 1,16,64 --iters 200 --quant none \
    --csv "$work/small.$i.csv" \
    >"$work/small.$i.log" 2>&1 || { cat "$work/small.$i.log" >&2; exit 1; }
  "$local_bench" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    >"$work/local.$i.log" 2>&1 || { cat "$work/local.$i.log" >&2; exit 1; }
done

commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$root" diff --quiet HEAD 2>/dev/null || commit="$commit (with uncommitted changes)"
cpu=$(awk -F': ' '/^model name/ {m = $2} /^cpu family/ {f = $2} /^model\t/ {n = $2}
  END {printf "%s (family %s, model %s)", m, f, n}' /proc/cpuinfo)
isa=AVX2
grep -qw avx512f /proc/cpuinfo && isa=AVX-512
grep -qw avx2 /proc/cpuinfo || isa="no AVX2"
l3=$(lscpu 2>/dev/null | awk -F': *' '/^L3 cache/ {sub(/ \(.*/, "", $2); print $2}')
threads=$(grep -m1 -o 'threads: [0-9]* per rank' "$work/target.1.log" || echo 'threads: ?')
omp=$(grep -m1 -o 'OpenMP threads: [0-9]*' "$work/local.1.log" | grep -o '[0-9]*$' || echo '?')
echo "Measured $(date -u -r "$work/target.1.csv" +%Y-%m-%d) on commit $commit: $cpu, $isa, $(nproc) cores, L3 ${l3:-?},"
echo "$(getconf GNU_LIBC_VERSION 2>/dev/null), load average $load at the start;"
echo "moe-ep bench: $threads; moe-ep-bench-local: $omp OpenMP threads."
echo "Best of $runs runs (per row, the run with moe-ep's lowest time, with its own baselines)."
echo
echo "| op | tokens | moe-ep ms | p99 ms | GB/s | vs MPI_Alltoallv | vs textbook | vs memcpy |"
echo "|---|---|---|---|---|---|---|---|"

# moe-ep bench CSV: tokens_per_rank,op,impl,bytes_per_rank,p50_ms,p99_ms,gbps,
# ratio_vs_alltoallv,ratio_vs_textbook. vs memcpy = memcpy p50 / moe-ep p50 (bf16 bytes only).
for kind in target small; do
  for i in $(seq 1 "$runs"); do tail -n +2 "$work/$kind.$i.csv" | sed "s/^/$i,/"; done
done | awk -F, '
  function x(v) { return v == "" ? "-" : sprintf("%.2fx", v) }
  $4 == "memcpy" { mem[$1, $2] = $6 }
  $4 == "moe-ep" {
    k = $2 SUBSEP $3
    if (!(k in best) || $6 < best[k]) { best[k] = $6; row[k] = $0; run[k] = $1 }
    if (!(k in seen)) { seen[k] = 1; order[++n] = k }
  }
  END {
    for (j = 1; j <= n; ++j) {
      k = order[j]; split(row[k], f, ",")
      m = f[3] == "dispatch-int8" ? "-" : x(mem[run[k], f[2]] / f[6])
      name = f[3] == "dispatch-int8" ? "dispatch, int8" : f[3] ", bf16"
      printf "| %s | %s/rank | %.3f | %.3f | %.2f | %s | %s | %s |\n", name, f[2], f[6], f[7],
             f[8], x(f[9]), x(f[10]), m
    }
  }'

# moe-ep-bench-local summary: op ms GB/s memcpy ratio best-ratio paired read-only-ms of-floor
# fresh-pages-ms. vs memcpy: the paired ratio (memcpy time / op time, call by call).
for i in $(seq 1 "$runs"); do
  awk -v run="$i" '/^op +ms +GB\/s/ {on = 1; next} /^\(OpenMP threads/ {on = 0} on && NF >= 10 {
    print run, $0 }' "$work/local.$i.log"
done | awk '
  { k = $2; if (!(k in best) || $3 < best[k]) { best[k] = $3; line[k] = $0 }
    if (!(k in seen)) { seen[k] = 1; order[++n] = k } }
  END {
    for (j = 1; j <= n; ++j) {
      split(line[order[j]], f, " ")
      printf "| %s | 4096 | %.1f | - | %.1f | - | - | %.2fx |\n", f[2], f[3], f[4], f[8]
      floor[order[j]] = sprintf("%.2f (%.2f)", f[6] / f[10], f[10])
    }
    printf "\n- Read-only floor / memcpy (in brackets: floor time / op time): permute_grad %s, unpermute %s.\n", floor["permute_grad"],
           floor["unpermute"]
  }'

# int8 / bf16 dispatch time at 512 tokens, every run.
ratios=$(for i in $(seq 1 "$runs"); do
  awk -F, '$3 == "moe-ep" && $2 == "dispatch" {b = $5} $3 == "moe-ep" && $2 == "dispatch-int8" {
    q = $5} END {printf "%.3f ", q / b}' "$work/target.$i.csv"
done)
echo "- int8 / bf16 dispatch time at 512 tokens/rank, each run: ${ratios% } (memory traffic 0.556)."
echo "perf-table.sh: raw outputs in $work" >&2
