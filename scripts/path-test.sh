#!/usr/bin/env bash
# The tests must not depend on where the checkout is (issue 30): clones this repository's HEAD
# (the committed tree, not uncommitted changes) to a path of about 200 characters with spaces in
# it, builds the tool and the tool's test binary there (Release) and runs the ctest tests labelled
# `paths`: a few of each kind that prints a path or passes one on (the run report's routing
# file, the command strings of tests/cli/expect_*.cmake, the cmake -P scripts, the Python
# checkers, the `sh -c` of the multi-host tests, the installed tool). Exits non-zero on any
# failure. .ci/run runs it after scripts/test.sh.
#   scripts/path-test.sh [WORK_DIR]    (default: build-path-test/ in this checkout, removed
#                                       afterwards: inside the checkout, the clone compiles from
#                                       its compiler cache, scripts/setup.sh)
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
moe_ep_install_deps
moe_ep_mpi_env

start=$SECONDS
if [ $# -ge 1 ]; then
  work=$1
  mkdir -p "$work"
else
  work=$MOE_EP_ROOT/build-path-test
  rm -rf "$work"
  mkdir -p "$work"
  trap 'rm -rf "$work"' EXIT
fi
base="$work/moe-ep checkout with spaces"
clone="$base/$(printf 'p%.0s' $(seq $((${#base} < 190 ? 200 - ${#base} - 1 : 10))))"
rm -rf "$base"
echo "moe-ep path test: ${#clone}-character checkout $clone"
git clone -q "$MOE_EP_ROOT" "$clone"
cmake -S "$clone" -B "$clone/build" -DCMAKE_BUILD_TYPE=Release -DMOE_EP_BUILD_TESTS=ON >/dev/null
cmake --build "$clone/build" -j "$(nproc)" --target moe-ep moe_ep_cli_tests
(cd "$clone/build" && ctest --output-on-failure -j 2 -L '^paths$')
echo "moe-ep path test: passed in $((SECONDS - start)) s"
