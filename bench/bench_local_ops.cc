// The local ops of SPEC §4 (permute, unpermute and their gradients) at the shape of a DeepSeek-V3
// MoE layer (bf16, H 7168, 4096 tokens, top-8 of 256 experts, random routing), each against a
// memcpy of the same byte count run right after it, as a ratio of bandwidths.
//
// Bytes counted (e = 2 bytes per bf16 element, int32 indices, fp32 probs; N tokens, K = top-k,
// M = N*K entries, no entry dropped so every permuted row is referenced once):
//   permute          read M*H*e (the source row of each output row: a gather of M rows)
//                    + N*K*4 (indices); write M*H*e + M*4 (sorted_indices)
//   permute_grad(_v2) read M*H*e + M*4; write N*H*e
//   unpermute        read M*H*e + M*4 + N*K*4 (probs); write N*H*e
//   unpermute_grad(_v2) read N*H*e (grad_out) + M*H*e (permuted_tokens) + M*4 + N*K*4;
//                    write M*H*e (grad_permuted) + N*K*4 (grad_probs)
// memcpy/<op> copies half of <op>'s byte count, so that it too reads and writes that many bytes,
// split over the same OpenMP threads into a destination written before (no page faults). glibc's
// memcpy streams (non-temporal stores) only copies of at least its x86_non_temporal_threshold,
// which glibc 2.36 derives from the cache sizes the CPU reports (3/4 of (L3 / threads + L2): on
// the development VM, with 480 MiB of L3, 0xb580000 = 181.5 MiB): below it every destination line
// is first read, and a 264 MB copy split over 2 threads ran at 26 GB/s against 46 GB/s streamed.
// So that the baseline is the machine's best copy at every size and thread count, main()
// re-executes the benchmark once with that threshold at 4 MiB in GLIBC_TUNABLES (unless the
// caller set it); the ops do not depend on it (their memcpy calls copy at most one row). The
// lower threshold also moves copies of 64 MiB and more to glibc's page-interleaved streaming
// loop, which raised the bar of the large copies too (42-46 to 45-48 GB/s).
// pair/<op> times <op> and its memcpy alternately, one call each in turn, and reports the median
// over the iterations of memcpy time / op time ("paired"): on a shared VM whose neighbours'
// load comes and goes within seconds, the separate medians of <op> and memcpy/<op> (taken
// seconds apart) move by 0.1-0.3 from run to run; the paired figure moves less.
// read/<op> reads as many bytes as <op> counts as read, once, in order (a word-wise OR, split over
// the threads), and writes nothing: the read-only floor of an op that reads each input byte once
// (permute reads each token row K times, so for it this is no floor). An op that reads far more
// than it writes (permute_grad, unpermute) cannot beat it, and on a machine where one core reads
// more slowly than memcpy moves data, that floor is below 0.8x memcpy. The
// ops allocate their outputs on every call (the API returns owned tensors), so their page
// faults would be part of their time, but the library keeps freed large blocks for reuse
// (src/base/block_cache.h), so from the second call on the outputs land on pages already
// mapped, as in a training or serving loop. alloc/<op> shows what fresh pages would cost.
//
// Every op is compared bitwise with its ref/ oracle once, before it is timed; a mismatch aborts.
#include <benchmark/benchmark.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "moe_ep/permute.h"
#include "ref/permute_ref.h"

namespace {

using moe_ep::DType;
using moe_ep::Tensor;

constexpr int64_t kTokens = 4096, kHidden = 7168, kTopK = 8, kExperts = 256;
constexpr int64_t kEntries = kTokens * kTopK;
constexpr int64_t kElem = 2;  // bf16

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Random bf16 values in about [-4, 4) (random mantissas, so sums round).
Tensor random_bf16(int64_t rows, int64_t h, uint64_t seed) {
  Tensor t = Tensor::empty(DType::kBF16, {rows, h});
  auto* p = t.ptr<uint16_t>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    uint64_t s = seed * 0x100000001b3ull + static_cast<uint64_t>(r);
    for (int64_t c = 0; c < h; c += 4) {
      const uint64_t z = splitmix(s);
      for (int64_t q = 0; q < 4 && c + q < h; ++q) {
        const uint16_t v = static_cast<uint16_t>(z >> (16 * q));
        // sign, exponent 2^-8 .. 2^1, random mantissa
        const uint16_t exp = static_cast<uint16_t>(119 + (v >> 7) % 10);
        p[r * h + c + q] = static_cast<uint16_t>((v & 0x8000u) | (exp << 7) | (v & 0x7fu));
      }
    }
  }
  return t;
}

struct Data {
  Tensor tokens, indices, probs, permuted, sorted_indices, grad_permuted, grad_out;
};

moe_ep::PermuteArgs permute_args(const Data& d) {
  moe_ep::PermuteArgs a;
  a.tokens = d.tokens;
  a.indices = d.indices;
  return a;
}

const Data& data() {
  static const Data d = [] {
    Data x;
    x.tokens = random_bf16(kTokens, kHidden, 1);
    x.grad_out = random_bf16(kTokens, kHidden, 2);
    x.grad_permuted = random_bf16(kEntries, kHidden, 3);
    x.indices = Tensor::empty(DType::kI32, {kTokens, kTopK});
    x.probs = Tensor::empty(DType::kF32, {kTokens, kTopK});
    uint64_t s = 42;
    for (int64_t i = 0; i < kTokens; ++i) {  // K distinct experts per token, uniform
      std::vector<bool> used(kExperts, false);
      for (int64_t k = 0; k < kTopK; ++k) {
        int64_t e;
        do e = static_cast<int64_t>(splitmix(s) % kExperts);
        while (used[static_cast<std::size_t>(e)]);
        used[static_cast<std::size_t>(e)] = true;
        x.indices.ptr<int32_t>()[i * kTopK + k] = static_cast<int32_t>(e);
        x.probs.ptr<float>()[i * kTopK + k] =
            static_cast<float>(splitmix(s) >> 40) * 0x1p-24f / kTopK;
      }
    }
    moe_ep::PermuteResult p = moe_ep::permute(permute_args(x));
    x.permuted = std::move(p.permuted_tokens);
    x.sorted_indices = std::move(p.sorted_indices);
    return x;
  }();
  return d;
}

void expect_same(const char* op, const char* what, const Tensor& got, const Tensor& want) {
  if (got.nbytes() == want.nbytes() && std::memcmp(got.data(), want.data(), got.nbytes()) == 0)
    return;
  std::fprintf(stderr, "moe-ep-bench-local: %s: %s differs from the ref/ oracle\n", op, what);
  std::exit(1);
}

// Bytes each op reads and writes (see the top of this file).
constexpr int64_t kRowBytes = kHidden * kElem;
constexpr int64_t kPermuteBytes = 2 * kEntries * kRowBytes + kTokens * kTopK * 4 + kEntries * 4;
constexpr int64_t kPermuteGradBytes = (kEntries + kTokens) * kRowBytes + kEntries * 4;
constexpr int64_t kUnpermuteBytes = (kEntries + kTokens) * kRowBytes + kEntries * 4 + kEntries * 4;
constexpr int64_t kUnpermuteGradBytes =
    (kTokens + 2 * kEntries) * kRowBytes + kEntries * 4 + 2 * kEntries * 4;
// Of which read:
constexpr int64_t kPermuteReadBytes = kEntries * kRowBytes + kTokens * kTopK * 4;
constexpr int64_t kPermuteGradReadBytes = kEntries * kRowBytes + kEntries * 4;
constexpr int64_t kUnpermuteReadBytes = kEntries * kRowBytes + kEntries * 4 + kTokens * kTopK * 4;
constexpr int64_t kUnpermuteGradReadBytes =
    (kTokens + kEntries) * kRowBytes + kEntries * 4 + kTokens * kTopK * 4;

// Copies bytes/2 (reads and writes `bytes` in all), in one contiguous chunk per thread, between
// tensors of the library's allocator (the same pages as the ops' inputs and outputs: 2 MiB
// aligned, transparent huge pages where the kernel grants them), written before.
void copy_half(int64_t bytes) {
  const int64_t half = bytes / 2;
  static Tensor src_t, dst_t;
  if (src_t.nbytes() < static_cast<std::size_t>(half)) {
    src_t = Tensor::empty(DType::kI8, {half});
    dst_t = Tensor::empty(DType::kI8, {half});
    std::memset(src_t.data(), 1, static_cast<std::size_t>(half));
    std::memset(dst_t.data(), 0, static_cast<std::size_t>(half));
  }
  char* const src = static_cast<char*>(src_t.data());
  char* const dst = static_cast<char*>(dst_t.data());
#pragma omp parallel
  {
    const std::size_t t = static_cast<std::size_t>(omp_get_thread_num());
    const std::size_t nt = static_cast<std::size_t>(omp_get_num_threads());
    const std::size_t lo = static_cast<std::size_t>(half) * t / nt;
    const std::size_t hi = static_cast<std::size_t>(half) * (t + 1) / nt;
    std::memcpy(dst + lo, src + lo, hi - lo);
  }
  benchmark::ClobberMemory();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Times op(). paired (pair/<op>): each iteration runs op() and then the memcpy of the same
// bytes, each timed on its own, and the counter paired_ratio is the median over the iterations
// of memcpy's time / op's time: both see the same moment of a shared machine, so a neighbour's
// load that comes and goes moves both (a ratio of medians taken seconds apart does not cancel
// it).
template <typename F>
void run_op(benchmark::State& state, int64_t bytes, F op, bool paired) {
  std::vector<double> ratios;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    auto out = op();
    benchmark::DoNotOptimize(out);
    if (!paired) continue;
    const double op_s = seconds_since(t0);
    const auto t1 = std::chrono::steady_clock::now();
    copy_half(bytes);
    ratios.push_back(seconds_since(t1) / op_s);
  }
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["threads"] = omp_get_max_threads();
  if (paired && !ratios.empty()) {
    std::sort(ratios.begin(), ratios.end());
    const std::size_t n = ratios.size();
    state.counters["paired_ratio"] =
        n % 2 == 1 ? ratios[n / 2] : (ratios[n / 2 - 1] + ratios[n / 2]) / 2;
  }
}

void BM_permute(benchmark::State& state, bool paired) {
  const Data& d = data();
  auto op = [&d] { return moe_ep::permute(permute_args(d)); };
  static bool verified = false;  // once, not once per repetition
  if (!std::exchange(verified, true)) {
    auto got = op();
    auto want = moe_ep::ref::permute(d.tokens, d.indices, std::nullopt);
    expect_same("permute", "permuted_tokens", got.permuted_tokens, want.permuted_tokens);
    expect_same("permute", "sorted_indices", got.sorted_indices, want.sorted_indices);
  }
  run_op(state, kPermuteBytes, op, paired);
}

template <bool kV2>
void BM_permute_grad(benchmark::State& state, bool paired) {
  const Data& d = data();
  auto op = [&d] {
    if constexpr (kV2)
      return moe_ep::permute_grad_v2({.grad_permuted_tokens = d.grad_permuted,
                                      .sorted_indices = d.sorted_indices,
                                      .tokens_rows = kTokens,
                                      .tokens_dtype = DType::kBF16,
                                      .num_topk = kTopK});
    else
      return moe_ep::permute_grad({.tokens = d.tokens,
                                   .grad_permuted_tokens = d.grad_permuted,
                                   .indices = d.indices,
                                   .sorted_indices = d.sorted_indices});
  };
  static bool verified = false;
  if (!std::exchange(verified, true))
    expect_same(
        "permute_grad", "grad_tokens", op(),
        moe_ep::ref::permute_grad(d.grad_permuted, d.sorted_indices, kTokens, kTopK, DType::kBF16));
  run_op(state, kPermuteGradBytes, op, paired);
}

void BM_unpermute(benchmark::State& state, bool paired) {
  const Data& d = data();
  auto op = [&d] {
    moe_ep::UnpermuteArgs a;
    a.permuted_tokens = d.permuted;
    a.sorted_indices = d.sorted_indices;
    a.probs = d.probs.view();
    return moe_ep::unpermute(a);
  };
  static bool verified = false;
  if (!std::exchange(verified, true))
    expect_same("unpermute", "out", op(),
                moe_ep::ref::unpermute(d.permuted, d.sorted_indices, d.probs.view()));
  run_op(state, kUnpermuteBytes, op, paired);
}

template <bool kV2>
void BM_unpermute_grad(benchmark::State& state, bool paired) {
  const Data& d = data();
  auto op = [&d] {
    if constexpr (kV2) {
      moe_ep::UnpermuteGradV2Args a;
      a.grad_out = d.grad_out;
      a.sorted_indices = d.sorted_indices;
      a.permuted_rows = kEntries;
      a.permuted_dtype = DType::kBF16;
      a.probs = d.probs.view();
      a.permuted_tokens = d.permuted.view();
      return moe_ep::unpermute_grad_v2(a);
    } else {
      moe_ep::UnpermuteGradArgs a;
      a.permuted_tokens = d.permuted;
      a.grad_out = d.grad_out;
      a.sorted_indices = d.sorted_indices;
      a.probs = d.probs.view();
      return moe_ep::unpermute_grad(a);
    }
  };
  static bool verified = false;
  if (!std::exchange(verified, true)) {
    auto got = op();
    auto want = moe_ep::ref::unpermute_grad(d.grad_out, d.sorted_indices, kEntries, DType::kBF16,
                                            d.probs.view(), d.permuted.view());
    expect_same("unpermute_grad", "grad_permuted_tokens", got.grad_permuted_tokens,
                want.grad_permuted_tokens);
    expect_same("unpermute_grad", "grad_probs", got.grad_probs, want.grad_probs);
  }
  run_op(state, kUnpermuteGradBytes, op, paired);
}

// memcpy of bytes/2 (copy_half), timed alone.
void BM_memcpy(benchmark::State& state, int64_t bytes) {
  for (auto _ : state) copy_half(bytes);
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["threads"] = omp_get_max_threads();
}

// Reads `bytes` once in order (a word-wise OR, one contiguous chunk per thread) from a tensor of
// the library's allocator written before, writing nothing.
uint64_t or_words(const uint64_t* p, std::size_t n) {
  uint64_t a[8] = {};
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (std::size_t j = 0; j < 8; ++j) a[j] |= p[i + j];
  for (; i < n; ++i) a[0] |= p[i];
  for (std::size_t j = 1; j < 8; ++j) a[0] |= a[j];
  return a[0];
}
void BM_read(benchmark::State& state, int64_t bytes) {
  static Tensor src_t;
  if (src_t.nbytes() < static_cast<std::size_t>(bytes)) {
    src_t = Tensor::empty(DType::kI8, {bytes});
    std::memset(src_t.data(), 1, static_cast<std::size_t>(bytes));
  }
  const auto* const src = static_cast<const uint64_t*>(src_t.data());
  const std::size_t words = static_cast<std::size_t>(bytes) / 8;
  for (auto _ : state) {
    uint64_t sink = 0;
#pragma omp parallel reduction(| : sink)
    {
      const std::size_t t = static_cast<std::size_t>(omp_get_thread_num());
      const std::size_t nt = static_cast<std::size_t>(omp_get_num_threads());
      const std::size_t lo = words * t / nt, hi = words * (t + 1) / nt;
      sink |= or_words(src + lo, hi - lo);
    }
    benchmark::DoNotOptimize(sink);
  }
  state.SetBytesProcessed(state.iterations() * bytes);
  state.counters["threads"] = omp_get_max_threads();
}

// Allocates fresh blocks of the given byte sizes (aligned_alloc, bypassing the library's block
// cache) and touches each page: what an op's outputs would cost on fresh pages.
void BM_alloc(benchmark::State& state, std::vector<int64_t> sizes) {
  for (auto _ : state) {
    std::vector<char*> outs;
    for (int64_t b : sizes) {
      char* p =
          static_cast<char*>(std::aligned_alloc(64, static_cast<std::size_t>(b + 63) / 64 * 64));
      if (p == nullptr) std::abort();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < b; i += 4096) p[i] = 1;
      outs.push_back(p);
    }
    benchmark::DoNotOptimize(outs.data());
    for (char* p : outs) std::free(p);
  }
  state.counters["threads"] = omp_get_max_threads();
}

// Prints each run as the console reporter does, then a summary: each op's bandwidth (median
// over repetitions when there are several) next to its memcpy's, and the ratio.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      const std::string& name = r.run_name.function_name;
      const double seconds = r.GetAdjustedRealTime() / 1e3;  // reported in ms
      const bool single = r.run_type == Run::RT_Iteration && r.repetitions <= 1;
      const bool median = r.run_type == Run::RT_Aggregate && r.aggregate_name == "median";
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name == "min") best_[name] = seconds;
      if (!single && !median) continue;
      const auto it = r.counters.find("bytes_per_second");
      if (it != r.counters.end()) rate_[name] = it->second.value;
      const auto pr = r.counters.find("paired_ratio");
      if (pr != r.counters.end()) paired_[name] = pr->second.value;
      seconds_[name] = seconds;
      if (single) best_[name] = seconds;
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf(
        "\nGB/s = 1e9 bytes/s (read + written) at the median time over repetitions; ratio = op / "
        "memcpy; best ratio: the same from each one's fastest repetition; paired: the median over "
        "iterations of memcpy time / op time, each op call followed at once by its memcpy "
        "(pair/<op>; the median over repetitions), the figure least moved by a shared "
        "machine's load. read-only ms: reading "
        "as many bytes as the op reads, once in order, and writing nothing (read/<op>); of floor "
        "= read-only ms / ms. "
        "fresh-pages ms: what the op's outputs would add on pages never touched before "
        "(alloc/<op>).\n"
        "%-18s %8s %8s %8s %7s %10s %7s %13s %9s %15s\n",
        "op", "ms", "GB/s", "memcpy", "ratio", "best ratio", "paired", "read-only ms", "of floor",
        "fresh-pages ms");
    for (const auto& [name, rate] : rate_) {
      if (name.find('/') != std::string::npos) continue;
      const std::string mc = "memcpy/" + name;
      const auto m = rate_.find(mc);
      const auto a = seconds_.find("alloc/" + name);
      const auto r = seconds_.find("read/" + name);
      if (m == rate_.end()) continue;
      // A column whose run was filtered out prints "-".
      auto column = [](bool have, double v, int width, int digits) {
        char buf[32];
        if (have)
          std::snprintf(buf, sizeof buf, "%*.*f", width, digits, v);
        else
          std::snprintf(buf, sizeof buf, "%*s", width, "-");
        return std::string(buf);
      };
      const auto p = paired_.find("pair/" + name);
      const bool read = r != seconds_.end(), alloc = a != seconds_.end();
      const bool pair = p != paired_.end();
      // Same byte counts: the ratio of bandwidths is the inverse ratio of times.
      std::printf("%-18s %8.1f %8.2f %8.2f %7.2f %10.2f %s %s %s %s\n", name.c_str(),
                  seconds_[name] * 1e3, rate / 1e9, m->second / 1e9, rate / m->second,
                  best_[mc] / best_[name], column(pair, pair ? p->second : 0, 7, 2).c_str(),
                  column(read, read ? r->second * 1e3 : 0, 13, 1).c_str(),
                  column(read, read ? r->second / seconds_[name] : 0, 9, 2).c_str(),
                  column(alloc, alloc ? a->second * 1e3 : 0, 15, 1).c_str());
    }
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    std::printf("(OpenMP threads: %d; GLIBC_TUNABLES=%s)\n", omp_get_max_threads(),
                tunables != nullptr ? tunables : "");
  }

 private:
  std::map<std::string, double> rate_, seconds_, best_, paired_;
};

double max_of(const std::vector<double>& v) {
  double m = v.empty() ? 0.0 : v[0];
  for (double x : v) m = x > m ? x : m;
  return m;
}
double min_of(const std::vector<double>& v) {
  double m = v.empty() ? 0.0 : v[0];
  for (double x : v) m = x < m ? x : m;
  return m;
}

void add(const char* name, void (*fn)(benchmark::State&, bool), int64_t bytes, int64_t read_bytes,
         std::vector<int64_t> out_bytes) {
  benchmark::RegisterBenchmark(name, fn, false)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond)
      ->ComputeStatistics("max", max_of)
      ->ComputeStatistics("min", min_of);
  benchmark::RegisterBenchmark((std::string("pair/") + name).c_str(), fn, true)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark((std::string("memcpy/") + name).c_str(), BM_memcpy, bytes)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond)
      ->ComputeStatistics("max", max_of)
      ->ComputeStatistics("min", min_of);
  benchmark::RegisterBenchmark((std::string("read/") + name).c_str(), BM_read, read_bytes)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond)
      ->ComputeStatistics("max", max_of)
      ->ComputeStatistics("min", min_of);
  benchmark::RegisterBenchmark((std::string("alloc/") + name).c_str(), BM_alloc, out_bytes)
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond)
      ->ComputeStatistics("max", max_of)
      ->ComputeStatistics("min", min_of);
}

// Re-executes this program once with glibc's non-temporal memcpy threshold at 4 MiB (see the top
// of this file), unless GLIBC_TUNABLES already sets it; returns when that is not possible, and
// re-executes at most once ($MOE_EP_BENCH_REEXEC marks the second run: a secure-mode run drops
// GLIBC_TUNABLES). Only glibc on x86-64 has the tunable.
void reexec_with_streaming_memcpy([[maybe_unused]] char** argv) {
#if defined(__GLIBC__) && defined(__x86_64__)
  constexpr const char* kTunable = "glibc.cpu.x86_non_temporal_threshold";
  constexpr const char* kMarker = "MOE_EP_BENCH_REEXEC";
  const char* env = std::getenv("GLIBC_TUNABLES");
  const std::string old = env != nullptr ? env : "";  // setenv may invalidate env
  if (std::getenv(kMarker) != nullptr || old.find(kTunable) != std::string::npos) return;
  const std::string value = (old.empty() ? "" : old + ":") + kTunable + "=0x400000";
  if (setenv("GLIBC_TUNABLES", value.c_str(), 1) != 0 || setenv(kMarker, "1", 1) != 0) return;
  execv("/proc/self/exe", argv);
  std::fprintf(stderr,
               "moe-ep-bench-local: re-executing with GLIBC_TUNABLES failed (%s); memcpy "
               "keeps glibc's default non-temporal threshold\n",
               std::strerror(errno));
  if (env != nullptr)
    setenv("GLIBC_TUNABLES", old.c_str(), 1);
  else
    unsetenv("GLIBC_TUNABLES");
  unsetenv(kMarker);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  reexec_with_streaming_memcpy(argv);
  add("permute", BM_permute, kPermuteBytes, kPermuteReadBytes,
      {kEntries * kRowBytes, kEntries * 4});
  add("permute_grad", BM_permute_grad<false>, kPermuteGradBytes, kPermuteGradReadBytes,
      {kTokens * kRowBytes});
  add("permute_grad_v2", BM_permute_grad<true>, kPermuteGradBytes, kPermuteGradReadBytes,
      {kTokens * kRowBytes});
  add("unpermute", BM_unpermute, kUnpermuteBytes, kUnpermuteReadBytes, {kTokens * kRowBytes});
  add("unpermute_grad", BM_unpermute_grad<false>, kUnpermuteGradBytes, kUnpermuteGradReadBytes,
      {kEntries * kRowBytes, kEntries * 4});
  add("unpermute_grad_v2", BM_unpermute_grad<true>, kUnpermuteGradBytes, kUnpermuteGradReadBytes,
      {kEntries * kRowBytes, kEntries * 4});
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("moe-ep local ops: bf16, H %" PRId64 ", %" PRId64 " tokens, top-%" PRId64 ", %" PRId64
              " experts, random routing; outputs verified against ref/ first\n",
              kHidden, kTokens, kTopK, kExperts);
  SummaryReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
