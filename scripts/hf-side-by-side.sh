#!/usr/bin/env bash
# Issue 31's side by side: one Qwen3-MoE checkpoint served at W ranks (prefill and decode
# tokens/s, peak RSS per rank, tokens checked against single-process transformers) by
#   (a) single-process transformers, experts_implementation grouped_mm and batched_mm
#   (b) transformers' own expert parallelism on gloo under torchrun (DistributedConfig)
#   (c) a textbook torch.distributed all-to-all dispatcher on gloo (torchrun)
#   (d) moe-ep, transport shm and mpi (mpirun)
# and, with root and network namespaces (scripts/netns-cluster.sh), (c) and (d) again across 2
# emulated hosts of W/2 ranks. Prints the Markdown table (docs/performance.md, "Real models
# (issue 31): side by side") and writes it to WORK/table.md. bench/hf_side_by_side.py does the
# work; each row group is one launch.
#
#   scripts/hf-side-by-side.sh [--smoke] [--world W] [--work DIR] [--no-netns] [--rows LIST]
#                              [--rate RATE]
#     --smoke     tiny sizes, W 2, every row group in one mpirun launch (bench/hf_side_by_side.py
#                 smoke), no 2-host rows unless --netns: about 20 s
#     --world W   ranks (default 4; must divide the experts)
#     --work DIR  keep the checkpoint and results there (default: a temporary directory,
#                 removed afterwards unless KEEP=1)
#     --rows LIST comma-separated subset of a,b,c,d,netns (default: all)
#     --netns / --no-netns   force the 2-host rows on or off (default: on where `check` passes)
#     --rate RATE each emulated host's link rate (netns-cluster.sh up's, e.g. 1gbit; default:
#                 unlimited veth)
# Environment: PYTHON (default: the checkout's .venv/bin/python, else python3); QUIET=L waits
# (at most QUIET_WAIT seconds, default 180) before each row group until the 1-minute load
# average is below L; ROW_TIMEOUT (default 600 s, smoke 120) per launch.
# Exit status 0 when every row ran and its tokens equal (a)'s; 1 otherwise.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bench=$root/bench/hf_side_by_side.py
smoke=0 world=4 work= rows=a,b,c,d,netns netns=auto rate=
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) smoke=1; world=2 ;;
    --world) world=$2; shift ;;
    --work) work=$2; shift ;;
    --rows) rows=$2; shift ;;
    --netns) netns=1 ;;
    --rate) rate=$2; shift ;;
    --no-netns) netns=0 ;;
    -h|--help) sed -n '2,28p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "hf-side-by-side.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ "$netns" = auto ] && { [ $smoke = 1 ] && netns=0 || netns=1; }
case ",$rows," in *,netns,*) ;; *) netns=0 ;; esac
want() { case ",$rows," in *,"$1",*) return 0 ;; *) return 1 ;; esac; }

py=${PYTHON:-}
if [ -z "$py" ]; then
  py=$root/.venv/bin/python
  [ -x "$py" ] || py=$(command -v python3)
fi
cpus=$(getconf _NPROCESSORS_ONLN)  # (a)'s threads; nproc would say OMP_NUM_THREADS
export OMP_NUM_THREADS=1 # the ranks' torch threads (each launcher's processes share the CPUs)
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
cleanup() { :; }
if [ -z "$work" ]; then
  work=$(mktemp -d)
  [ -n "${KEEP:-}" ] || cleanup() { rm -rf "$work"; }
fi
trap cleanup EXIT
mkdir -p "$work"
timeout_s=${ROW_TIMEOUT:-$([ $smoke = 1 ] && echo 120 || echo 600)}
repeat=$([ $smoke = 1 ] && echo 1 || echo 2)

log() { echo "hf-side-by-side.sh: $*" >&2; }

wait_quiet() {
  [ -n "${QUIET:-}" ] || return 0
  local waited=0 limit=${QUIET_WAIT:-180}
  while awk -v q="$QUIET" '{exit !($1 >= q)}' /proc/loadavg && [ "$waited" -lt "$limit" ]; do
    sleep 5
    waited=$((waited + 5))
  done
  log "load average $(cut -d' ' -f1-3 /proc/loadavg) (waited ${waited} s)"
}

# row GROUP LABEL LAUNCHER -- CMD...: runs CMD (one launch; it appends its rows to
# results.jsonl); when it fails without writing a row, a row with its exit status and last
# error line is written instead.
row() {
  local group=$1 label=$2 launcher=$3 ranks=$4
  shift 5
  local before after rc=0
  before=$(wc -l <"$work/results.jsonl")
  log "$label: $*"
  timeout -k 10 "$timeout_s" "$@" >"$work/$group.log" 2>&1 || rc=$?
  grep '^hf_side_by_side:' "$work/$group.log" >&2 || true
  after=$(wc -l <"$work/results.jsonl")
  if [ "$rc" -ne 0 ]; then
    tail -n 30 "$work/$group.log" >&2
    if [ "$after" -eq "$before" ]; then
      local why
      why=$(grep -E 'Error|error|Timeout' "$work/$group.log" | tail -n 1 | cut -c1-300)
      [ "$rc" -eq 124 ] && why="no result within ${timeout_s} s (ROW_TIMEOUT)"
      "$py" - "$work/results.jsonl" "$group" "$label" "$launcher" "$ranks" "$rc" "$why" <<'EOF'
import json, sys
path, group, label, launcher, ranks, rc, why = sys.argv[1:]
with open(path, "a") as f:
    f.write(json.dumps(dict(group=group, row=label, launcher=launcher, ranks=int(ranks),
                            threads=1, error=f"exit status {rc}: {why}")) + "\n")
EOF
    fi
  fi
}

cd "$root"
if [ $smoke = 0 ] && [ ! -f "$work/bench.json" ]; then
  "$py" "$bench" make --dir "$work" --world "$world" 2>&1 | grep '^hf_side_by_side' >&2
fi
: >"$work/results.jsonl"
cut -d' ' -f1 /proc/loadavg >"$work/load.start"

if [ $smoke = 1 ] || want b; then
  # transformers' distributed loading (row b) needs accelerate: a private copy when the Python
  # has none (pip install --target WORK/pydeps, on the path of the launches below).
  if ! "$py" -c 'import accelerate' 2>/dev/null; then
    if "$py" -m pip install -q --disable-pip-version-check --no-deps --target "$work/pydeps" \
        accelerate psutil >"$work/pip.log" 2>&1; then
      export PYTHONPATH=$PYTHONPATH:$work/pydeps
    else
      log "(b) needs accelerate, and pip install --target failed ($work/pip.log)"
    fi
  fi
fi

if [ $smoke = 1 ]; then
  # One launch: every row group in the same W processes (bench/hf_side_by_side.py smoke).
  rm -f "$work/bench.json"
  row smoke "(a)-(d) smoke" mpirun "$world" -- \
    mpirun --oversubscribe -n "$world" -x OMP_NUM_THREADS -x PYTHONPATH \
    "$py" "$bench" smoke --dir "$work"
  rows=
fi

if want a; then
  wait_quiet
  # The reference first: every other row compares its tokens with grouped_mm's.
  row a1 "(a) transformers, 1 process, grouped_mm" python 1 -- \
    "$py" "$bench" single --dir "$work" --impl grouped_mm --reference --threads "$cpus" \
    --repeat "$repeat"
  row a2 "(a) transformers, 1 process, batched_mm" python 1 -- \
    "$py" "$bench" single --dir "$work" --impl batched_mm --threads "$cpus" --repeat 1
fi

torchrun=("$py" -m torch.distributed.run --nproc-per-node "$world" --master-port 29531)
if want b; then
  modes=(ep tp+ep dp+ep)
  wait_quiet
  for mode in "${modes[@]}"; do
    row "b-$mode" "(b) transformers $mode" torchrun "$world" -- \
      "${torchrun[@]}" "$bench" hf-ep --dir "$work" --ep-mode "$mode" --threads 1 --repeat "$repeat"
  done
fi

if want c; then
  wait_quiet
  row c "(c) textbook all-to-all, gloo" torchrun "$world" -- \
    "${torchrun[@]}" "$bench" a2a --dir "$work" --threads 1 --repeat "$repeat"
fi

if want d; then
  wait_quiet
  row d "(d) moe-ep" mpirun "$world" -- \
    mpirun --oversubscribe -n "$world" -x OMP_NUM_THREADS -x PYTHONPATH \
    "$py" "$bench" moe-ep --dir "$work" --transport shm,mpi --threads 1 --repeat "$repeat"
fi

if [ "$netns" = 1 ]; then
  cluster=$root/scripts/netns-cluster.sh
  # A cluster of its own (prefix and subnet), so that it does not meet the tests'.
  export MOE_EP_NETNS_PREFIX=hfsbs MOE_EP_NETNS_SUBNET=78
  if ! why=$("$cluster" check 2>&1); then
    log "no 2-host rows: $why"
    "$py" - "$work/results.jsonl" "$why" <<'EOF'
import json, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(dict(group="netns", row="(c), (d) on 2 emulated hosts",
                            launcher="netns-cluster.sh", ranks=0, threads=1,
                            error=f"not run: {sys.argv[2]}")) + "\n")
EOF
  else
    hosts=2
    label="2 hosts x $((world / hosts))${rate:+, $rate links}"
    "$cluster" down $hosts >/dev/null 2>&1 || true
    trap '"$cluster" down '$hosts' >/dev/null 2>&1 || true; cleanup' EXIT
    "$cluster" up $hosts $rate
    wait_quiet
    row netns-c "(c) textbook all-to-all, gloo, 2 hosts" netns-cluster.sh "$world" -- \
      "$cluster" run "$world" "$py" "$bench" a2a --dir "$work" --threads 1 --repeat "$repeat" \
      --master-addr "192.168.$MOE_EP_NETNS_SUBNET.1" --label "$label"
    row netns-d "(d) moe-ep, 2 hosts" netns-cluster.sh "$world" -- \
      "$cluster" run "$world" "$py" "$bench" moe-ep --dir "$work" --transport shm,mpi \
      --threads 1 --repeat "$repeat" --label "$label"
    "$cluster" down $hosts
  fi
fi

cut -d' ' -f1 /proc/loadavg >"$work/load.end"
"$py" "$bench" table --dir "$work" --out "$work/table.md"
log "results in $work (results.jsonl, table.md, one log per launch)"
"$py" - "$work/results.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
bad = [r for r in rows if "error" in r or r.get("match") != "yes"]
for r in bad:
    why = r.get("error") or r.get("match")
    print(f"hf-side-by-side.sh: FAIL: {r['row']}: {why}", file=sys.stderr)
sys.exit(1 if bad else 0)
EOF
