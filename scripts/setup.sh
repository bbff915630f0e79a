# Shared set-up for scripts/demo.sh and scripts/test.sh (sourced, not run).
# Installs what is missing (Debian packages, through sudo when not root), then configures and builds.
set -euo pipefail

MOE_EP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOE_EP_PACKAGES=(cmake g++ make libopenmpi-dev openmpi-bin libdlpack-dev nlohmann-json3-dev
                 libcli11-dev libgtest-dev libbenchmark-dev libopenblas-dev libhwy-dev)

moe_ep_install_deps() {
  local missing=() p
  for p in "${MOE_EP_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "moe-ep: installing ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  fi
}

# OpenMPI refuses to run as root unless told; CI runs as root.
moe_ep_mpi_env() {
  if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
}

# moe_ep_build BUILD_DIR [cmake args...]
moe_ep_build() {
  local dir=$1
  shift
  cmake -S "$MOE_EP_ROOT" -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@"
  cmake --build "$dir" -j "$(nproc)"
}
