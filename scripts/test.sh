#!/usr/bin/env bash
# Runs every test: installs what is missing, builds (Release), runs ctest, then installs the
# Python package into a venv (.venv) and runs pytest (python/tests).
# MOE_EP_TEST_SANITIZE=1 also builds with AddressSanitizer + UndefinedBehaviorSanitizer into
# build-asan/ and runs the library's tests there. MOE_EP_TEST_TSAN=1 also runs the ThreadSanitizer
# stage (scripts/tsan.sh: clang 16, build-tsan/). Then the libFuzzer targets, built with clang-16
# into build-fuzz/, run each for MOE_EP_FUZZ_SECONDS (default here 30) from its seed corpus
# (scripts/fuzz.sh); MOE_EP_TEST_FUZZ=0 skips them. MOE_EP_TEST_PYTHON=0 skips the Python part.
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
moe_ep_install_deps
moe_ep_mpi_env
moe_ep_build "$MOE_EP_ROOT/build" -DMOE_EP_BUILD_TESTS=ON
(cd "$MOE_EP_ROOT/build" && ctest --output-on-failure -j 2)
if [ "${MOE_EP_TEST_PYTHON:-1}" = 1 ]; then
  moe_ep_python_env
  (cd "$MOE_EP_ROOT" && MOE_EP_TIMEOUT_S=${MOE_EP_TIMEOUT_S:-60} "$MOE_EP_PYTHON" -m pytest -q)
fi
if [ "${MOE_EP_TEST_SANITIZE:-0}" = 1 ]; then
  # -O1 with line tables (ASan's advice: the tests ran in 457 s here against 630 s at -O0).
  # GCC 12 at -O1 with ASan warns that <regex>'s std::function may be used uninitialized, a false
  # positive inside libstdc++ (GCC bug 105616): that warning alone is off in this build.
  moe_ep_build "$MOE_EP_ROOT/build-asan" -DMOE_EP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Debug \
    "-DCMAKE_CXX_FLAGS_DEBUG=-g1 -O1 -Wno-maybe-uninitialized" "-DMOE_EP_SANITIZE=address;undefined"
  # OpenMPI's own allocations are not ours to chase: leaks off, everything else fatal.
  (cd "$MOE_EP_ROOT/build-asan" && ASAN_OPTIONS=detect_leaks=0 \
    ctest --output-on-failure -j 2 -LE install)
fi
if [ "${MOE_EP_TEST_TSAN:-0}" = 1 ]; then
  "$MOE_EP_ROOT/scripts/tsan.sh"
fi
if [ "${MOE_EP_TEST_FUZZ:-1}" = 1 ]; then
  MOE_EP_FUZZ_SECONDS=${MOE_EP_FUZZ_SECONDS:-30} "$MOE_EP_ROOT/scripts/fuzz.sh"
fi
