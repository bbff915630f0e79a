#!/usr/bin/env bash
# ThreadSanitizer stage (scripts/test.sh runs it when MOE_EP_TEST_TSAN=1; docs/design.md,
# "Testing"): builds the library, the unit tests and the MPI tests with clang and
# -fsanitize=thread into build-tsan/, then runs the tests whose code runs on several threads with
# OpenMP teams of more than one thread. Any report fails the stage (halt_on_error).
#
# Why clang 16 and LLVM's libomp: GCC's libgomp is not instrumented, so TSan cannot see the
# synchronisation of its barriers and reports every parallel loop's writes as racing with the
# code after it (310 reports in the unit tests). LLVM's libomp loads Archer (libarcher.so), which
# tells TSan what OpenMP synchronises. clang 14, Debian 12's default, has no _Float16 on x86
# (src/base/numeric.h needs it); clang 15 added it.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
MOE_EP_TSAN_LLVM=/usr/lib/llvm-16
moe_ep_install_deps
# clang 16 with its TSan runtime and libomp (with Archer), and llvm-16 for llvm-symbolizer
# (without it the reports have no file and line); not their recommends (llvm-16-dev, ...).
moe_ep_install_tsan_deps() {
  local missing=() p sudo=""
  for p in clang-16 libclang-rt-16-dev libomp-16-dev llvm-16; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  echo "moe-ep: installing ${missing[*]}"
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}"
}
moe_ep_install_tsan_deps
moe_ep_mpi_env

dir=$MOE_EP_ROOT/build-tsan
# -O1 (TSan's advice: -O0 runs about twice as long) with line tables only (what a report shows;
# full debug info only lengthens the build).
cmake -S "$MOE_EP_ROOT" -B "$dir" -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS_DEBUG="-gline-tables-only -O1" \
  "-DCMAKE_CXX_COMPILER=$MOE_EP_TSAN_LLVM/bin/clang++" -DMOE_EP_SANITIZE=thread \
  -DMOE_EP_BUILD_TESTS=ON -DMOE_EP_BUILD_TOOLS=ON
cmake --build "$dir" -j "$(nproc)" --target moe_ep_unit_tests moe_ep_mpi_tests

# Archer: libomp would find it beside itself anyway; naming it makes a missing one fail below.
# ignore_noninstrumented_modules (Archer's advice): no reports of accesses made inside libomp,
# OpenMPI and the C++ runtime, which are not instrumented; moe-ep's own accesses are all checked.
# tests/tsan.supp: each entry says why it is there.
export OMP_TOOL_LIBRARIES=$MOE_EP_TSAN_LLVM/lib/libarcher.so ARCHER_OPTIONS=verbose=1
# The paths are quoted within the options: the sanitizers split them at spaces, and the checkout's
# path may hold some.
export TSAN_OPTIONS="halt_on_error=1 ignore_noninstrumented_modules=1 \
suppressions='$MOE_EP_ROOT/tests/tsan.supp' \
external_symbolizer_path='$MOE_EP_TSAN_LLVM/bin/llvm-symbolizer'"
log=$dir/tsan-archer.log

# moe_ep_tsan_run COMMAND...: runs it, failing also when Archer did not load.
moe_ep_tsan_run() {
  echo "moe-ep tsan: $*"
  "$@" 2>&1 | tee "$log"
  grep -q "Archer detected OpenMP application with TSan" "$log" ||
    { echo "moe-ep tsan: Archer ($OMP_TOOL_LIBRARIES) was not loaded" >&2; return 1; }
}

# The unit tests at 4 OpenMP threads (the tests that fix their own count run 1 to 16 threads,
# and Permute.TwoCallerThreadsAtOnceGetTheSameBits runs two callers' ops at once, as two Python
# threads do with the GIL released). Simd.* left out: one thread, no OpenMP (and, built by
# clang, SumRowsMatchesScalarInRowOrder finds a signalling NaN's bits kept where the scalar code
# quiets them: a compiler difference, not a thread one).
OMP_NUM_THREADS=4 moe_ep_tsan_run "$dir/tests/moe_ep_unit_tests" --gtest_brief=1 \
  --gtest_filter=-Simd.*
# Every MPI test, each rank with 2 threads (dispatch, combine, the backward and sharded ops run
# their parallel loops at the tests' larger sizes): 2 ranks on the shm transport, 3 on the
# point-to-point one, then comm_alg "hierarchy" on 2 emulated nodes of 2 ranks.
moe_ep_tsan_mpi() {  # moe_ep_tsan_mpi RANKS [gtest args...]
  local n=$1
  shift
  moe_ep_tsan_run mpiexec -n "$n" --oversubscribe "$dir/tests/moe_ep_mpi_tests" --gtest_brief=1 "$@"
}
export OMP_NUM_THREADS=2 MOE_EP_TIMEOUT_S=120
MOE_EP_TRANSPORT=shm moe_ep_tsan_mpi 2
MOE_EP_TRANSPORT=mpi moe_ep_tsan_mpi 3
MOE_EP_SHM_NODE_RANKS=2 MOE_EP_TEST_COMM_ALG=hierarchy moe_ep_tsan_mpi 4 \
  "--gtest_filter=*FeatureGrid*:Hierarchy*"
echo "moe-ep tsan: no data races reported"
