#!/usr/bin/env bash
# How asynchronous MPI exchanges progress while the caller computes (bench/progress_probe.cc):
# builds the probe with mpicxx (no project build needed) and runs it, 2 ranks,
#   1. on this machine over TCP (--mca btl self,tcp: loopback sockets, so the rendezvous
#      protocol of large messages needs the receiver's and the sender's progress),
#   2. on this machine over shared memory (--mca btl self,vader),
#   3. as root, where scripts/netns-cluster.sh can make hosts: across 2 emulated hosts whose links
#      are limited to RATE (default 1gbit), one rank on each; the hosts are removed at the end.
#   scripts/progress-probe.sh [PROBE ARGS...]    default --bytes 65536,1048576,8388608
# WORK=dir keeps the binary and the JSON of each run there (default: a temporary directory,
# printed at the end); RATE=... sets the emulated link.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=${WORK:-$(mktemp -d)}
mkdir -p "$work"
[ $# -gt 0 ] || set -- --bytes 65536,1048576,8388608
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
probe=$work/progress_probe
mpicxx -O2 -std=c++17 -pthread "$root/bench/progress_probe.cc" -o "$probe"

for btl in tcp vader; do
  echo "== one machine, btl self,$btl (load $(cut -d" " -f1 /proc/loadavg))"
  # --oversubscribe: each rank runs a progress thread too, beyond this machine's cores.
  mpirun -n 2 --oversubscribe --mca btl "self,$btl" "$probe" --json "$work/$btl.json" "$@"
done

cluster=$root/scripts/netns-cluster.sh
rate=${RATE:-1gbit}
if [ "$(id -u)" -eq 0 ] && [ -x "$cluster" ] && "$cluster" check; then
  echo "== 2 hosts (network namespaces), $rate links (load $(cut -d" " -f1 /proc/loadavg))"
  # Own names and subnet, so that a cluster of the tests can run beside this one.
  export MOE_EP_NETNS_PREFIX=moeprobe MOE_EP_NETNS_SUBNET=78
  # netns-cluster.sh places ranks by slot (0 and 1 on host 1); --map-by node puts the pair on
  # different hosts. `with` removes the hosts also when the run fails.
  "$cluster" with 2 "$rate" -- 2 --map-by node "$probe" --json "$work/netns-$rate.json" "$@"
else
  echo "== 2 hosts: skipped (needs root and scripts/netns-cluster.sh check to pass)"
fi
echo "progress-probe.sh: JSON in $work"
