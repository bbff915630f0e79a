#!/usr/bin/env bash
# One machine playing a cluster of HOSTS machines, for the multi-host tests and measurements of
# comm_alg "hierarchy" (SPEC §3). Each host is a network namespace with its own hostname and its
# own /dev/shm, so MPI_Comm_split_type(SHARED) and moe-ep's shared-memory windows stay inside it;
# the hosts reach each other over TCP through a bridge, optionally rate-limited. Needs root,
# iproute2 (ip, tc) and util-linux (unshare).
#
#   scripts/netns-cluster.sh check                    exit 0 when this machine can make the hosts
#   scripts/netns-cluster.sh up HOSTS [RATE]          make them (RATE e.g. 1gbit: each host's link)
#   scripts/netns-cluster.sh run NP PROG [ARGS...]    mpirun -n NP across them, 2 slots a host,
#                                                     ranks by slot (0, 1 on host 1; 2, 3 on 2...)
#   scripts/netns-cluster.sh down HOSTS               remove them
#   scripts/netns-cluster.sh with HOSTS [RATE] -- NP PROG [ARGS...]
#                                                     up, run, down (also on failure); the exit
#                                                     status is the run's; one at a time per
#                                                     MOE_EP_NETNS_PREFIX (a lock in /tmp)
# Environment for the ranks: MOE_EP_* and OMP_NUM_THREADS of the caller are passed on (-x).
# MOE_EP_NETNS_PREFIX (default moeep) names the hosts, so two clusters can coexist.
set -euo pipefail
prefix=${MOE_EP_NETNS_PREFIX:-moeep}
subnet=192.168.${MOE_EP_NETNS_SUBNET:-77}
state=/tmp/$prefix-netns
bridge=$prefix-br

in_host() {  # in_host I CMD: CMD as host I (its namespace, hostname and /dev/shm)
  local i=$1
  shift
  ip netns exec "$prefix-n$i" unshare --uts --mount sh -c \
    "hostname $prefix-n$i && mount -t tmpfs tmpfs /dev/shm && $*"
}

up() {
  local hosts=$1 rate=${2:-}
  mkdir -p "$state"
  ip link add "$bridge" type bridge
  ip link set "$bridge" up
  : >"$state/hostfile"
  for i in $(seq 1 "$hosts"); do
    ip netns add "$prefix-n$i"
    ip link add "$prefix-h$i" type veth peer name "$prefix-p$i"
    ip link set "$prefix-h$i" netns "$prefix-n$i"
    ip link set "$prefix-p$i" master "$bridge"
    ip link set "$prefix-p$i" up
    ip -n "$prefix-n$i" addr add "$subnet.$i/24" dev "$prefix-h$i"
    ip -n "$prefix-n$i" link set "$prefix-h$i" up
    ip -n "$prefix-n$i" link set lo up
    if [ -n "$rate" ]; then
      ip netns exec "$prefix-n$i" tc qdisc add dev "$prefix-h$i" root tbf rate "$rate" \
        burst 256kb latency 50ms
    fi
    echo "$subnet.$i slots=2" >>"$state/hostfile"
  done
  # mpirun starts its daemons through this agent: "agent [options] HOST CMD" runs CMD as HOST.
  cat >"$state/agent" <<EOF
#!/bin/sh
while [ "\${1#-}" != "\$1" ]; do shift; done
host=\$1; shift
exec ip netns exec $prefix-n\${host##*.} unshare --uts --mount sh -c "hostname $prefix-n\${host##*.} && mount -t tmpfs tmpfs /dev/shm && \$*"
EOF
  chmod +x "$state/agent"
}

down() {
  local hosts=$1
  for i in $(seq 1 "$hosts"); do
    ip netns del "$prefix-n$i" 2>/dev/null || true
    ip link del "$prefix-p$i" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  rm -rf "$state"
}

run() {
  local np=$1
  shift
  local env=()
  for v in $(compgen -e | grep -E '^(MOE_EP_|OMP_NUM_THREADS$)' || true); do env+=(-x "$v"); done
  in_host 1 "mpirun --allow-run-as-root --oversubscribe -n $np --hostfile $state/hostfile \
    --mca plm_rsh_agent $state/agent --mca btl tcp,self,vader \
    --mca oob_tcp_if_include $subnet.0/24 --mca btl_tcp_if_include $subnet.0/24 \
    ${env[*]} $(printf '%q ' "$@")"
}

check() {
  [ "$(id -u)" -eq 0 ] || { echo "netns-cluster.sh: needs root"; return 1; }
  for tool in ip tc unshare mpirun; do
    command -v "$tool" >/dev/null || { echo "netns-cluster.sh: $tool not found"; return 1; }
  done
  # A namespace, a veth pair into it and a bridge: what `up` makes.
  local probe=${prefix}x$$ ok=1
  ip netns add "$probe" 2>/dev/null || ok=0
  [ $ok = 1 ] && { ip link add "${probe}a" type veth peer name "${probe}b" 2>/dev/null || ok=0; }
  [ $ok = 1 ] && { ip link set "${probe}b" netns "$probe" 2>/dev/null || ok=0; }
  [ $ok = 1 ] && { ip link add "${probe}br" type bridge 2>/dev/null || ok=0; }
  ip link del "${probe}br" 2>/dev/null || true
  ip link del "${probe}a" 2>/dev/null || true
  ip netns del "$probe" 2>/dev/null || true
  [ $ok = 1 ] || { echo "netns-cluster.sh: cannot make network namespaces, veth pairs or bridges here"; return 1; }
}

cmd=${1:?usage: netns-cluster.sh check | up HOSTS [RATE] | run NP PROG... | down HOSTS | with HOSTS [RATE] -- NP PROG...}
shift
case $cmd in
  check) check ;;
  up) up "$@" ;;
  down) down "$@" ;;
  run) run "$@" ;;
  with)
    hosts=$1
    rate=
    shift
    if [ "$1" != "--" ]; then rate=$1; shift; fi
    [ "$1" = "--" ] || { echo "netns-cluster.sh with HOSTS [RATE] -- NP PROG..." >&2; exit 2; }
    shift
    # One cluster of this prefix at a time across checkouts (ctest's RESOURCE_LOCK holds within
    # one run only): another `with` waits here instead of removing these hosts under it.
    exec 9>"/tmp/$prefix-netns.lock"
    flock 9
    down "$hosts"
    trap 'down "$hosts"' EXIT
    up "$hosts" "$rate"
    run "$@"
    ;;
  *) echo "netns-cluster.sh: unknown command $cmd" >&2; exit 2 ;;
esac
