#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with clang into build-fuzz/ and runs each for a
# bounded time from its seed corpus, failing on any crash, sanitizer report or finding.
# Installs clang-$V, Debian's libFuzzer (libclang-rt-$V-dev) and libomp-$V-dev when missing.
#   MOE_EP_FUZZ_LLVM      the LLVM version V (default 16, Debian 12's newest; 14 works too, but
#                         libomp-14-dev and libomp-16-dev exclude each other, and the ThreadSanitizer
#                         build uses 16)
#   MOE_EP_FUZZ_SECONDS   seconds per target (default 60); on demand e.g. 3600
#   MOE_EP_FUZZ_RUNS      executions per target instead of a time (e.g. 1000000)
#   MOE_EP_FUZZ_TARGETS   which targets (default: "safetensors local_ops dispatch")
#   MOE_EP_FUZZ_WORK      where the grown corpora, crash inputs and logs go (default
#                         build-fuzz/work); the seeds in tests/fuzz/corpus are never changed
# A crash input is saved as $MOE_EP_FUZZ_WORK/<target>/crash-<sha1>; replay it with
#   build-fuzz/fuzz/fuzz_<target> <file>
# and, once fixed, add it to tests/fuzz/corpus/<target>/ with a regression test (docs/design.md,
# "Fuzzing").
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
moe_ep_install_deps
moe_ep_mpi_env
llvm=${MOE_EP_FUZZ_LLVM:-16}
MOE_EP_PACKAGES=("clang-$llvm" "libclang-rt-$llvm-dev" "libomp-$llvm-dev")
moe_ep_install_deps

build="$MOE_EP_ROOT/build-fuzz"
work=${MOE_EP_FUZZ_WORK:-$build/work}
targets=${MOE_EP_FUZZ_TARGETS:-"safetensors local_ops dispatch"}
# -O1: the inputs are tiny, and the sanitizers make -O3 builds slow to compile.
cmake -S "$MOE_EP_ROOT" -B "$build" -DCMAKE_BUILD_TYPE=None \
  "-DCMAKE_CXX_COMPILER=clang++-$llvm" "-DCMAKE_CXX_FLAGS=-O1 -gline-tables-only" -DMOE_EP_BUILD_FUZZ=ON \
  -DMOE_EP_BUILD_TESTS=OFF -DMOE_EP_BUILD_TOOLS=OFF >/dev/null
# shellcheck disable=SC2046
cmake --build "$build" -j "$(nproc)" --target $(printf 'fuzz_%s ' $targets)

# A huge allocation (the fuzzer's sizes may ask for outputs of many GiB) fails with
# Error(kSystem) instead of aborting; OpenMPI's own allocations are not ours to chase.
export ASAN_OPTIONS=${ASAN_OPTIONS:-allocator_may_return_null=1:max_allocation_size_mb=64:detect_leaks=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export OMP_NUM_THREADS=1
if [ -n "${MOE_EP_FUZZ_RUNS:-}" ]; then
  limit=(-runs="$MOE_EP_FUZZ_RUNS")
else
  limit=(-max_total_time="${MOE_EP_FUZZ_SECONDS:-60}")
fi
status=0
for t in $targets; do
  mkdir -p "$work/$t/corpus"
  log="$work/$t/fuzz.log"
  echo "moe-ep fuzz: $t (${limit[*]}), log $log"
  # -timeout: one input running 30 s is a hang; -rss_limit_mb: a leak or a runaway allocation
  # (Tensor::empty's block cache alone keeps up to 2 GiB).
  if ! (cd "$work/$t" && "$build/fuzz/fuzz_$t" "${limit[@]}" -timeout=30 -rss_limit_mb=6144 \
        -print_final_stats=1 -artifact_prefix="$work/$t/" corpus "$MOE_EP_ROOT/tests/fuzz/corpus/$t" \
        >"$log" 2>&1); then
    echo "moe-ep fuzz: $t FAILED; the end of $log:"
    tail -n 40 "$log"
    status=1
    continue
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  echo "moe-ep fuzz: $t OK: $runs executions, corpus $(ls "$work/$t/corpus" | wc -l) grown +" \
       "$(ls "$MOE_EP_ROOT/tests/fuzz/corpus/$t" | wc -l) seed inputs, no crash"
done
exit $status
