# Shared set-up for scripts/demo.sh and scripts/test.sh (sourced, not run).
# Installs what is missing (Debian packages, through sudo when not root), then configures and builds.
set -euo pipefail

MOE_EP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MOE_EP_PACKAGES=(cmake g++ make libopenmpi-dev openmpi-bin libdlpack-dev nlohmann-json3-dev
                 libcli11-dev libgtest-dev libbenchmark-dev libopenblas-dev libhwy-dev
                 gnuplot-nox iproute2 ccache)
# iproute2: the multi-host tests (scripts/netns-cluster.sh). ccache: the library's sources compile
# with the same flags in build/ and in the Python package's build (build-python/), so the second
# compile is a cache hit (a fresh clone's test run is minutes shorter); its cache is
# $CCACHE_DIR, default build-ccache/ in the checkout.

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
  # Taken by CMake when a build directory is first configured (an existing one keeps its choice).
  # The compiler by one name: ccache keys on it, and CMake would pick c++ where the Python
  # package's build picks g++ (the same compiler).
  export CC=${CC:-gcc} CXX=${CXX:-g++}
  export CMAKE_C_COMPILER_LAUNCHER=${CMAKE_C_COMPILER_LAUNCHER:-ccache}
  export CMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER:-ccache}
  export CCACHE_DIR=${CCACHE_DIR:-$MOE_EP_ROOT/build-ccache}
  # Paths under the checkout reach the compiler relative to the build directory, so a checkout
  # inside this one (scripts/path-test.sh's) compiles from the same cache.
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$MOE_EP_ROOT}
}

# OpenMPI refuses to run as root unless told; CI runs as root.
moe_ep_mpi_env() {
  if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  fi
}

# The Python front: a venv ($MOE_EP_VENV, default .venv; see above) with PyTorch 2.13.0 (the CPU build; never
# a plain `pip install torch`, which would fetch a CUDA build), mpi4py on the system
# OpenMPI, pytest, and moe_ep itself (`pip install .`: scikit-build-core builds the extension
# into build-python/, reused across runs). Sets MOE_EP_PYTHON to the venv's interpreter.
# torch's inductor puts the venv's paths unquoted into its g++ command line, so a checkout whose
# path holds whitespace gets its venv outside the tree, at a path named after the checkout's.
if [ -z "${MOE_EP_VENV:-}" ]; then
  case "$MOE_EP_ROOT" in
    *[[:space:]]*)
      MOE_EP_VENV="${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/moe-ep/venv-$(printf '%s' "$MOE_EP_ROOT" |
        sha256sum | cut -c1-16)"
      ;;
    *) MOE_EP_VENV=$MOE_EP_ROOT/.venv ;;
  esac
fi
moe_ep_python_env() {
  if ! python3 -c "import venv, ensurepip" 2>/dev/null; then
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-dev
  fi
  case "$MOE_EP_VENV" in
    *[[:space:]]*) echo "moe-ep: warning: the venv's path '$MOE_EP_VENV' holds whitespace;" \
      "torch.compile's inductor backend cannot build there (set MOE_EP_VENV)" >&2 ;;
    "$MOE_EP_ROOT/.venv") ;;
    *) echo "moe-ep: the Python venv is $MOE_EP_VENV (the checkout's path holds whitespace)" ;;
  esac
  [ -x "$MOE_EP_VENV/bin/python" ] || python3 -m venv "$MOE_EP_VENV"
  MOE_EP_PYTHON="$MOE_EP_VENV/bin/python"
  local pip=("$MOE_EP_PYTHON" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" torch==2.13.0 numpy pytest "nanobind>=2" "scikit-build-core>=0.10"
  # mpi4py must use the same libmpi as moe_ep: its binary wheel (4.x) loads the system's at run
  # time (a source build takes 3.5 minutes here); built from source (needs mpicc:
  # libopenmpi-dev) where the wheel finds another MPI or none.
  "$MOE_EP_PYTHON" -c "import mpi4py" 2>/dev/null || "${pip[@]}" "mpi4py>=4"
  # (rc.initialize off: the library's version needs no MPI_Init, which could fail for other reasons)
  if ! "$MOE_EP_PYTHON" -c "import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI; assert 'Open MPI' in MPI.Get_library_version()" 2>/dev/null; then
    "${pip[@]}" --force-reinstall --no-binary mpi4py mpi4py
  fi
  "${pip[@]}" --no-build-isolation "$MOE_EP_ROOT"
  # moe_ep.transformers (the extra "transformers" of pyproject.toml pins the same version);
  # accelerate: transformers' own expert parallelism, row (b) of scripts/hf-side-by-side.sh.
  "${pip[@]}" transformers==5.25.0 safetensors accelerate
}

# moe_ep_build BUILD_DIR [cmake args...]
moe_ep_build() {
  local dir=$1
  shift
  cmake -S "$MOE_EP_ROOT" -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@"
  cmake --build "$dir" -j "$(nproc)"
}
