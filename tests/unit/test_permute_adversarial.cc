// Adversarial tests for SPEC §4 (permute / unpermute and their gradients), written by a reviewer
// trying to break src/kernels/cpu/permute.cc. Expected values are computed by hand from the SPEC
// text (or by an independent std::stable_sort), never by ref/permute_ref.cc, so a misunderstanding
// shared by the kernel and the reference shows up here.
//
// Inputs that used to crash, hang or overflow run in a child process (gtest's "threadsafe" death
// test style re-executes the binary, so neither OpenMP state nor a crash leaks into this process)
// under a deadline: a regression fails that one test instead of killing the whole binary.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "moe_ep/error.h"
#include "moe_ep/permute.h"
#include "moe_ep/tensor.h"
#include "moe_ep/threads.h"
#include "ref/numeric.h"

namespace moe_ep {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kInt64Min = std::numeric_limits<int64_t>::min();

std::vector<float> to_floats(const Tensor& t) {
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i)
    v[static_cast<std::size_t>(i)] = ref::load(t.dtype(), t.data(), i);
  return v;
}

std::vector<int32_t> to_ints(const Tensor& t) {
  return std::vector<int32_t>(t.ptr<int32_t>(), t.ptr<int32_t>() + t.numel());
}

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Runs f and checks it throws moe_ep::Error of `kind` whose message contains every part.
void expect_throws(const std::function<void()>& f, ErrorKind kind,
                   const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing '" << parts.front() << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << error_kind_name(e.kind()) << ": " << e.what();
    for (const std::string& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "'" << p << "' missing from: " << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "a non-moe_ep exception: " << e.what();
  }
}

// Child-process body: 0 when f behaves (returns, if no parts are given; throws a moe_ep::Error
// containing every part otherwise), 1 or 2 when not; a crash or the deadline kills the child.
int child_run(const std::function<void()>& f, const std::vector<std::string>& parts,
              unsigned deadline_s) {
  alarm(deadline_s);
  try {
    f();
    if (parts.empty()) return 0;
    std::fprintf(stderr, "no error; expected one containing '%s'\n", parts.front().c_str());
    return 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "moe_ep::Error: %s\n", e.what());
    for (const std::string& p : parts)
      if (std::string(e.what()).find(p) == std::string::npos) {
        std::fprintf(stderr, "'%s' missing from the message\n", p.c_str());
        return 2;
      }
    return parts.empty() ? 2 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "a non-moe_ep exception: %s\n", e.what());
    return 2;
  }
}

#define EXPECT_IN_CHILD(f, parts, deadline_s)                                                    \
  do {                                                                                           \
    GTEST_FLAG_SET(death_test_style, "threadsafe");                                              \
    EXPECT_EXIT(std::_Exit(child_run((f), (parts), (deadline_s))), ::testing::ExitedWithCode(0), \
                "");                                                                             \
  } while (0)

constexpr ErrorKind kInvalid = ErrorKind::kInvalidArgument;

// ---------------------------------------------------------------------------------------------
// Hand-computed semantics (SPEC §4.1 - 4.3).

// Keys on both sides of the counting-sort / std::stable_sort switch (65536 keys) and the largest
// valid expert id 2^31 - 1: flat = [65536, 3, 65535, 3, 0] sorts (stably) to order
// [4, 1, 3, 2, 0]; sorted_indices = inverse(order) = [4, 1, 3, 2, 0].
TEST(PermuteAdversarialHand, SortAcrossKeyRanges) {
  float tokens[5] = {10, 11, 12, 13, 14};
  for (int64_t top : {int64_t{65535}, int64_t{65536}, int64_t{2147483647}}) {
    SCOPED_TRACE(top);
    // top = 65535: keys 0..65535, the counting sort with exactly 65536 keys.
    int64_t idx[5] = {top, 3, top == 65535 ? 7 : 65535, 3, 0};
    PermuteArgs a;
    a.tokens = TensorView::contiguous(tokens, DType::kF32, {5, 1});
    a.indices = TensorView::contiguous(idx, DType::kI64, {5});
    const PermuteResult r = permute(a);
    EXPECT_EQ(to_ints(r.sorted_indices), (std::vector<int32_t>{4, 1, 3, 2, 0}));
    EXPECT_EQ(to_floats(r.permuted_tokens), (std::vector<float>{14, 11, 13, 12, 10}));
  }
}

// num_out_tokens at the extremes: INT64_MAX keeps M rows, -M keeps none, INT64_MIN is an error
// (and -INT64_MIN must not be computed).
TEST(PermuteAdversarialHand, NumOutTokensExtremes) {
  float tokens[6] = {1, 2, 3, 4, 5, 6};
  int32_t idx[6] = {2, 0, 1, 0, 2, 1};  // order [1,3,2,5,0,4]
  PermuteArgs a;
  a.tokens = TensorView::contiguous(tokens, DType::kF32, {3, 2});
  a.indices = TensorView::contiguous(idx, DType::kI32, {3, 2});
  a.num_out_tokens = kInt64Max;
  EXPECT_EQ(permute(a).permuted_tokens.size(0), 6);
  a.num_out_tokens = -6;
  const PermuteResult none = permute(a);
  EXPECT_EQ(none.permuted_tokens.size(0), 0);
  EXPECT_EQ(to_ints(none.sorted_indices), (std::vector<int32_t>{4, 0, 2, 1, 5, 3}));
  a.num_out_tokens = -7;
  expect_throws([&] { permute(a); }, kInvalid, {"permute: num_out_tokens = -7", "-6"});
  a.num_out_tokens = kInt64Min;
  expect_throws([&] { permute(a); }, kInvalid,
                {"permute: num_out_tokens = -9223372036854775808", "-6"});
  a.num_out_tokens = 1;  // keeps only the first row of the sorted order: token 0 (entry j = 1)
  const PermuteResult one = permute(a);
  EXPECT_EQ(to_floats(one.permuted_tokens), (std::vector<float>{1, 2}));
}

// Broadcast (stride-0) indices and probs, and overlapping token rows (stride(0) < H): all are
// "any strides" inputs.
TEST(PermuteAdversarialHand, BroadcastAndOverlappingViews) {
  // Overlapping rows: storage [10, 11, 12, 13], view (3, 2) strides (1, 1).
  float storage[4] = {10, 11, 12, 13};
  TensorView tokens = TensorView::contiguous(storage, DType::kF32, {3, 2});
  tokens.strides = {1, 1};
  // indices (3, 2) broadcast along k: token t has expert [2, 1, 0][t] twice.
  int32_t experts[3] = {2, 1, 0};
  TensorView idx = TensorView::contiguous(experts, DType::kI32, {3, 2});
  idx.strides = {1, 0};
  PermuteArgs a;
  a.tokens = tokens;
  a.indices = idx;
  const PermuteResult r = permute(a);
  // flat = [2,2,1,1,0,0]: order [4,5,2,3,0,1]; sorted_indices = [4,5,2,3,0,1].
  EXPECT_EQ(to_ints(r.sorted_indices), (std::vector<int32_t>{4, 5, 2, 3, 0, 1}));
  EXPECT_EQ(to_floats(r.permuted_tokens),
            (std::vector<float>{12, 13, 12, 13, 11, 12, 11, 12, 10, 11, 10, 11}));

  // probs broadcast to (3, 2) from a single 0.5: out[i] = 0.5 * (perm[S[2i]] + perm[S[2i+1]]).
  float half = 0.5f;
  UnpermuteArgs u;
  u.permuted_tokens = r.permuted_tokens;
  u.sorted_indices = r.sorted_indices;
  TensorView probs = TensorView::contiguous(&half, DType::kF32, {3, 2});
  probs.strides = {0, 0};
  u.probs = probs;
  EXPECT_EQ(to_floats(unpermute(u)), (std::vector<float>{10, 11, 11, 12, 12, 13}));
}

// The first present term starts each sum: a single -0 term stays -0 (a sum started at +0 would
// give +0); the empty sum is +0.
TEST(PermuteAdversarialHand, NegativeZeroAndEmptySums) {
  // unpermute: (-1) * (+0) with the other entry dropped (S = 1 >= P = 1).
  float x0[1] = {0.0f};
  float probs[2] = {-1.0f, 1.0f};
  int32_t s[2] = {0, 1};
  UnpermuteArgs u;
  u.permuted_tokens = TensorView::contiguous(x0, DType::kF32, {1, 1});
  u.sorted_indices = TensorView::contiguous(s, DType::kI32, {2});
  u.probs = TensorView::contiguous(probs, DType::kF32, {1, 2});
  EXPECT_EQ(f32_bits(unpermute(u).ptr<float>()[0]), 0x80000000u);
  // Both entries dropped (P = 0): the empty sum, +0.
  u.permuted_tokens = TensorView::contiguous(nullptr, DType::kF32, {0, 1});
  EXPECT_EQ(f32_bits(unpermute(u).ptr<float>()[0]), 0x00000000u);

  // permute_grad: one present term -0, the other dropped (S = 1 >= R = 1).
  float gneg[1] = {-0.0f};
  float tok[1] = {};
  int32_t idx[2] = {};
  PermuteGradArgs g;
  g.tokens = TensorView::contiguous(tok, DType::kF32, {1, 1});
  g.grad_permuted_tokens = TensorView::contiguous(gneg, DType::kF32, {1, 1});
  g.indices = TensorView::contiguous(idx, DType::kI32, {1, 2});
  g.sorted_indices = TensorView::contiguous(s, DType::kI32, {2});
  EXPECT_EQ(f32_bits(permute_grad(g).ptr<float>()[0]), 0x80000000u);

  // grad_probs = dot(grad_out, permuted): the only product, 1 * (-0) = -0, is added to a lane
  // that starts at +0 (the order of permute.h), so the dot product is +0 in every probs dtype, as
  // is the dropped entry's. grad_permuted[0] = grad_out * probs = 1 * (-1) = -1.
  float gout[1] = {1.0f};
  float xneg[1] = {-0.0f};
  for (DType pd : {DType::kF32, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE(dtype_name(pd));
    uint32_t pst[2];
    ref::store(pd, pst, 0, -1.0f);
    ref::store(pd, pst, 1, 1.0f);
    UnpermuteGradArgs ug;
    ug.permuted_tokens = TensorView::contiguous(xneg, DType::kF32, {1, 1});
    ug.grad_out = TensorView::contiguous(gout, DType::kF32, {1, 1});
    ug.sorted_indices = TensorView::contiguous(s, DType::kI32, {2});
    ug.probs = TensorView::contiguous(pst, pd, {1, 2});
    const UnpermuteGradResult r = unpermute_grad(ug);
    ASSERT_EQ(r.grad_probs.dtype(), pd);
    const float gp0 = ref::load(pd, r.grad_probs.data(), 0);
    const float gp1 = ref::load(pd, r.grad_probs.data(), 1);
    EXPECT_EQ(gp0, 0.0f);
    EXPECT_FALSE(std::signbit(gp0)) << "grad_probs[0,0] should be +0 (+0 + -0)";
    EXPECT_EQ(gp1, 0.0f);
    EXPECT_FALSE(std::signbit(gp1)) << "grad_probs[0,1] (dropped) should be +0";
    EXPECT_EQ(to_floats(r.grad_permuted_tokens), std::vector<float>{-1.0f});
  }
}

// grad_probs is rounded once from the fp32 dot to probs' dtype: dot = 1 + 2^-11 + 2^-20 is exact
// in fp32; fp16 rounds it to 1 + 2^-10 (above the tie), bf16 to 1. Rounding the partial sum
// 1 + 2^-11 to fp16 first would give 1 (tie to even).
TEST(PermuteAdversarialHand, GradProbsRoundedOnceInProbsDtype) {
  float gout[3] = {1.0f, std::ldexp(1.0f, -11), std::ldexp(1.0f, -20)};
  float x[3] = {1, 1, 1};
  int32_t s[1] = {0};
  struct Want {
    DType dtype;
    float value;
  };
  for (Want w : {Want{DType::kF16, 1.0f + std::ldexp(1.0f, -10)}, Want{DType::kBF16, 1.0f},
                 Want{DType::kF32, 1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)}}) {
    SCOPED_TRACE(dtype_name(w.dtype));
    uint32_t p[1];
    ref::store(w.dtype, p, 0, 1.0f);
    UnpermuteGradV2Args a;
    a.grad_out = TensorView::contiguous(gout, DType::kF32, {1, 3});
    a.sorted_indices = TensorView::contiguous(s, DType::kI32, {1});
    a.permuted_rows = 1;
    a.permuted_dtype = DType::kF32;
    a.probs = TensorView::contiguous(p, w.dtype, {1, 1});
    a.permuted_tokens = TensorView::contiguous(x, DType::kF32, {1, 3});
    const UnpermuteGradResult r = unpermute_grad_v2(a);
    ASSERT_EQ(r.grad_probs.dtype(), w.dtype);
    ASSERT_EQ(r.grad_probs.size(0), 1);
    ASSERT_EQ(r.grad_probs.size(1), 1);
    EXPECT_EQ(ref::load(w.dtype, r.grad_probs.data(), 0), w.value);
  }
}

// permute_grad with R < M and repeated sorted_indices (allowed): token 0 = g[1] + g[1]; token 1 =
// g[0] (S = 3 >= R = 2 is a dropped entry). Values >= max(R, M) are errors.
TEST(PermuteAdversarialHand, PermuteGradRepeatsAndDrops) {
  uint16_t grad[2];
  ref::store(DType::kBF16, grad, 0, 3.0f);
  ref::store(DType::kBF16, grad, 1, 1.0078125f);  // 1 + 2^-7: 2 * (1 + 2^-7) = 2 + 2^-6 exact
  int32_t s[4] = {1, 1, 0, 3};
  PermuteGradV2Args a;
  a.grad_permuted_tokens = TensorView::contiguous(grad, DType::kBF16, {2, 1});
  a.sorted_indices = TensorView::contiguous(s, DType::kI32, {4});
  a.tokens_rows = 2;
  a.num_topk = 2;
  a.tokens_dtype = DType::kBF16;
  EXPECT_EQ(to_floats(permute_grad_v2(a)), (std::vector<float>{2.015625f, 3.0f}));
  s[3] = 4;  // max(R, M) = 4
  expect_throws([&] { permute_grad_v2(a); }, kInvalid,
                {"permute_grad_v2: sorted_indices[3] = 4 is outside [0, 4)"});
}

// Rows of grad_permuted_tokens that nothing refers to are 0 even when the allocator hands back
// dirty memory (a same-sized buffer full of 0xff was just freed), in bf16 with strided inputs.
TEST(PermuteAdversarialHand, UnreferencedGradRowsAreZeroOnDirtyMemory) {
  const int64_t p = 9, h = 3;
  for (bool with_probs : {false, true}) {
    SCOPED_TRACE(with_probs);
    {
      Tensor dirty = Tensor::empty(DType::kBF16, {p, h});
      std::memset(dirty.data(), 0xff, dirty.nbytes());
    }
    // grad_out (2, 3) bf16 with stride(0) = 5; S = [7, 2] (N = 2, topK = 1).
    uint16_t gstore[10];
    std::memset(gstore, 0xff, sizeof gstore);
    TensorView gout = TensorView::contiguous(gstore, DType::kBF16, {2, h});
    gout.strides = {5, 1};
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t c = 0; c < h; ++c) ref::store(DType::kBF16, gstore, i * 5 + c, 1.0f + i + c);
    int32_t sstore[4] = {7, -1, 2, -1};
    TensorView s = TensorView::contiguous(sstore, DType::kI32, {2});
    s.strides = {2};
    float probs[2] = {2.0f, -0.5f};
    UnpermuteGradV2Args a;
    a.grad_out = gout;
    a.sorted_indices = s;
    a.permuted_rows = p;
    a.permuted_dtype = DType::kBF16;
    std::vector<uint16_t> xb(static_cast<std::size_t>(p * h));
    for (std::size_t i = 0; i < xb.size(); ++i) ref::store(DType::kBF16, xb.data(), i, 1.0f);
    if (with_probs) {
      a.probs = TensorView::contiguous(probs, DType::kF32, {2, 1});
      a.permuted_tokens = TensorView::contiguous(xb.data(), DType::kBF16, {p, h});
    }
    const UnpermuteGradResult r = unpermute_grad_v2(a);
    std::vector<float> want(static_cast<std::size_t>(p * h), 0.0f);
    for (int64_t c = 0; c < h; ++c) {
      want[static_cast<std::size_t>(7 * h + c)] = (1.0f + c) * (with_probs ? 2.0f : 1.0f);
      want[static_cast<std::size_t>(2 * h + c)] = (2.0f + c) * (with_probs ? -0.5f : 1.0f);
    }
    EXPECT_EQ(to_floats(r.grad_permuted_tokens), want);
    if (with_probs) {  // dot(grad_out[i], ones) = 1+2+3, 2+3+4
      EXPECT_EQ(to_floats(r.grad_probs), (std::vector<float>{6.0f, 9.0f}));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Thread-count independence of the parallel counting sort, at awkward sizes: sorted_indices and
// the permuted rows must equal an independent std::stable_sort for 1, 2, 3, 7 and 16 threads.

TEST(PermuteAdversarial, ParallelSortMatchesStableSortForAnyThreadCount) {
  std::mt19937_64 rng(7);
  const int64_t n = 3 * 16384 + 17;
  std::vector<float> tokens(static_cast<std::size_t>(n));
  std::iota(tokens.begin(), tokens.end(), 0.0f);
  for (int64_t key_range : {int64_t{5}, int64_t{300}, int64_t{65536}, int64_t{1} << 31}) {
    SCOPED_TRACE(key_range);
    std::uniform_int_distribution<int64_t> d(0, key_range - 1);
    std::vector<int32_t> idx(static_cast<std::size_t>(n));
    for (int32_t& v : idx) v = static_cast<int32_t>(d(rng));
    std::vector<int64_t> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return idx[a] < idx[b]; });
    std::vector<int32_t> want_s(static_cast<std::size_t>(n));
    std::vector<float> want_rows(static_cast<std::size_t>(n));
    for (int64_t p = 0; p < n; ++p) {
      want_s[static_cast<std::size_t>(order[p])] = static_cast<int32_t>(p);
      want_rows[static_cast<std::size_t>(p)] = static_cast<float>(order[p]);
    }
    for (int threads : {1, 2, 3, 7, 16}) {
      SCOPED_TRACE(threads);
      set_num_threads(threads);
      ASSERT_EQ(num_threads(), threads);
      PermuteArgs a;
      a.tokens = TensorView::contiguous(tokens.data(), DType::kF32, {n, 1});
      a.indices = TensorView::contiguous(idx.data(), DType::kI32, {n});
      a.num_out_tokens = -3;
      const PermuteResult r = permute(a);
      EXPECT_EQ(to_ints(r.sorted_indices), want_s);
      EXPECT_EQ(to_floats(r.permuted_tokens),
                std::vector<float>(want_rows.begin(), want_rows.end() - 3));
    }
  }
  set_num_threads(0);
}

// ---------------------------------------------------------------------------------------------
// Bad input: moe_ep::Error naming the op, the parameter, the value and the bound.

TEST(PermuteAdversarialErrors, IndexBounds) {
  float tokens[2] = {1, 2};
  int64_t idx[2] = {0, int64_t{1} << 31};
  PermuteArgs a;
  a.tokens = TensorView::contiguous(tokens, DType::kF32, {2, 1});
  a.indices = TensorView::contiguous(idx, DType::kI64, {2});
  expect_throws([&] { permute(a); }, kInvalid,
                {"permute: indices[1] = 2147483648 is outside [0, 2147483648)"});
  idx[1] = kInt64Min;
  expect_throws([&] { permute(a); }, kInvalid,
                {"permute: indices[1] = -9223372036854775808 is outside"});
  // 2-D, the bad entry hidden behind a stride: view (1, 2) with stride(1) = 2 over [0, 9, -3].
  int32_t i3[3] = {0, 9, -3};
  TensorView v = TensorView::contiguous(i3, DType::kI32, {1, 2});
  v.strides = {4, 2};
  a.tokens = TensorView::contiguous(tokens, DType::kF32, {1, 2});
  a.indices = v;
  expect_throws([&] { permute(a); }, kInvalid, {"permute: indices[0,1] = -3 is outside [0, "});
}

TEST(PermuteAdversarialErrors, EntryCountOverflow) {
  float grad[2] = {};
  int32_t s[1] = {0};
  PermuteGradV2Args a;
  a.grad_permuted_tokens = TensorView::contiguous(grad, DType::kF32, {1, 2});
  a.sorted_indices = TensorView::contiguous(s, DType::kI32, {1});
  a.tokens_dtype = DType::kF32;
  a.tokens_rows = 1;
  a.num_topk = kInt64Max;
  expect_throws([&] { permute_grad_v2(a); }, kInvalid,
                {"permute_grad_v2: tokens_rows*num_topk = 1 * 9223372036854775807 exceeds "
                 "2147483648"});
  a.tokens_rows = (int64_t{1} << 31) + 1;
  a.num_topk = 1;
  expect_throws([&] { permute_grad_v2(a); }, kInvalid, {"permute_grad_v2: tokens_rows*num_topk"});
  a.tokens_rows = kInt64Min;
  expect_throws([&] { permute_grad_v2(a); }, kInvalid,
                {"permute_grad_v2: tokens_rows = -9223372036854775808 must be >= 0"});
  a.tokens_rows = 0;  // M = 0 with any topK: a valid empty problem
  a.num_topk = kInt64Max;
  a.sorted_indices = TensorView::contiguous(nullptr, DType::kI32, {0});
  const Tensor out = permute_grad_v2(a);
  EXPECT_EQ(out.size(0), 0);
  EXPECT_EQ(out.size(1), 2);
  a.num_topk = kInt64Min;
  expect_throws([&] { permute_grad_v2(a); }, kInvalid, {"permute_grad_v2: num_topk = "});
}

TEST(PermuteAdversarialErrors, SortedIndicesRangeAndDuplicatesThroughStrides) {
  float x[12] = {};
  float probs[6] = {1, 1, 1, 1, 1, 1};
  // Storage [0, 5, 1, 5, 2, 5, 3, 5, 4, 5, 0, 5] viewed with stride 2: [0, 1, 2, 3, 4, 0].
  int32_t st[12] = {0, 5, 1, 5, 2, 5, 3, 5, 4, 5, 0, 5};
  TensorView s = TensorView::contiguous(st, DType::kI32, {6});
  s.strides = {2};
  UnpermuteArgs u;
  u.permuted_tokens = TensorView::contiguous(x, DType::kF32, {6, 2});
  u.sorted_indices = s;
  u.probs = TensorView::contiguous(probs, DType::kF32, {3, 2});
  expect_throws([&] { unpermute(u); }, kInvalid,
                {"unpermute: sorted_indices[5] = 0 duplicates sorted_indices[0]"});
  st[10] = 5;  // now [0, 1, 2, 3, 4, 5]: distinct (the 5s between them are not in the view)
  EXPECT_NO_THROW(unpermute(u));
  st[10] = 6;  // == max(P, M)
  expect_throws([&] { unpermute_with_saved(u); }, kInvalid,
                {"unpermute_with_saved: sorted_indices[5] = 6 is outside [0, 6)"});
  st[10] = std::numeric_limits<int32_t>::min();
  expect_throws([&] { unpermute(u); }, kInvalid,
                {"unpermute: sorted_indices[5] = -2147483648 is outside [0, 6)"});
  // A stride-0 sorted_indices repeats its one value.
  st[0] = 1;
  s.strides = {0};
  u.sorted_indices = s;
  expect_throws([&] { unpermute(u); }, kInvalid,
                {"unpermute: sorted_indices[1] = 1 duplicates sorted_indices[0]"});
}

TEST(PermuteAdversarialErrors, BadDTypesAndShapes) {
  float grad[4] = {};
  int32_t s[2] = {0, 1};
  PermuteGradV2Args a;
  a.grad_permuted_tokens = TensorView::contiguous(grad, DType::kF32, {2, 2});
  a.sorted_indices = TensorView::contiguous(s, DType::kI32, {2});
  a.tokens_rows = 2;
  a.tokens_dtype = DType::kI8;
  expect_throws([&] { permute_grad_v2(a); }, kInvalid,
                {"permute_grad_v2: tokens_dtype int8 is not one of {bf16, fp16, fp32}"});
  a.tokens_dtype = static_cast<DType>(77);  // not a DType at all
  expect_throws([&] { permute_grad_v2(a); }, kInvalid, {"permute_grad_v2: tokens_dtype"});
  a.tokens_dtype = DType::kBF16;
  expect_throws([&] { permute_grad_v2(a); }, kInvalid,
                {"permute_grad_v2: grad_permuted_tokens dtype fp32 must equal tokens_dtype bf16"});

  // unpermute_grad_v2: probs without permuted_tokens; restore_shape with 3 dims.
  float gout[4] = {};
  float probs[2] = {1, 1};
  UnpermuteGradV2Args g;
  g.grad_out = TensorView::contiguous(gout, DType::kF32, {2, 2});
  g.sorted_indices = TensorView::contiguous(s, DType::kI32, {2});
  g.permuted_rows = 2;
  g.permuted_dtype = DType::kF32;
  g.probs = TensorView::contiguous(probs, DType::kF32, {2, 1});
  expect_throws([&] { unpermute_grad_v2(g); }, kInvalid,
                {"unpermute_grad_v2: permuted_tokens is missing"});
  g.probs.reset();
  g.restore_shape = std::vector<int64_t>{2, 2, 1};
  expect_throws([&] { unpermute_grad_v2(g); }, kInvalid,
                {"unpermute_grad_v2: restore_shape = [2, 2, 1] must equal [2, 2]"});
  g.restore_shape.reset();
  g.permuted_rows = kInt64Min;
  expect_throws([&] { unpermute_grad_v2(g); }, kInvalid,
                {"unpermute_grad_v2: permuted_rows = -9223372036854775808 must be >= 0"});
}

// Hand-built views with a negative size (from_dlpack and TensorView::contiguous reject them, but
// TensorView is a public aggregate): the error should name the op and the parameter, not come
// from deep inside Tensor::empty ("TensorView: shape[1] = -3 is negative") or blame another
// tensor ("grad_permuted_tokens.shape[1] = 2 must equal -2").
TEST(PermuteAdversarialErrors, NegativeSizesNameTheOpAndParameter) {
  float tokens[6] = {1, 2, 3, 4, 5, 6};
  int32_t idx[2] = {0, 1};
  PermuteArgs a;
  a.tokens = TensorView::contiguous(tokens, DType::kF32, {2, 3});
  a.tokens.shape[1] = -3;
  a.indices = TensorView::contiguous(idx, DType::kI32, {2});
  expect_throws([&] { permute(a); }, kInvalid, {"permute: tokens.shape[1] = -3"});

  float grad[4] = {};
  int32_t s[2] = {0, 1};
  PermuteGradArgs g;
  g.tokens = TensorView::contiguous(tokens, DType::kF32, {2, 2});
  g.tokens.shape[1] = -2;
  g.grad_permuted_tokens = TensorView::contiguous(grad, DType::kF32, {2, 2});
  g.indices = a.indices;
  g.sorted_indices = TensorView::contiguous(s, DType::kI32, {2});
  expect_throws([&] { permute_grad(g); }, kInvalid, {"permute_grad: tokens.shape[1] = -2"});

  // unpermute_grad without probs reads only permuted_tokens' shape.
  UnpermuteGradArgs ug;
  ug.permuted_tokens = TensorView::contiguous(nullptr, DType::kF32, {0, 2});
  ug.permuted_tokens.shape[0] = -5;
  ug.grad_out = TensorView::contiguous(grad, DType::kF32, {2, 2});
  ug.sorted_indices = g.sorted_indices;
  expect_throws([&] { unpermute_grad(ug); }, kInvalid,
                {"unpermute_grad: permuted_tokens.shape[0] = -5"});
}

// ---------------------------------------------------------------------------------------------
// Output sizes the kernels never validate: permuted_rows (a plain integer), or the row count /
// width of a view with no elements or with stride 0 (a broadcast, e.g. torch's expand). The
// output (rows, H) is then allocated by Tensor::empty, whose numel and byte count overflow
// silently; the kernel then writes far past a 64-byte allocation. Each must be an Error.

// permuted_rows = 2^58, H = 64 fp32: numel = 2^64 overflows int64 (UB), 64 bytes are allocated
// and the zeroing loop writes 2^58 rows of 256 bytes into them.
TEST(PermuteAdversarialCrash, UnpermuteGradV2HugePermutedRowsOverflowsOutputSize) {
  const auto body = [] {
    std::vector<float> gout(64, 1.0f);
    int32_t s[1] = {0};
    UnpermuteGradV2Args a;
    a.grad_out = TensorView::contiguous(gout.data(), DType::kF32, {1, 64});
    a.sorted_indices = TensorView::contiguous(s, DType::kI32, {1});
    a.permuted_rows = int64_t{1} << 58;
    a.permuted_dtype = DType::kF32;
    unpermute_grad_v2(a);
  };
  const std::vector<std::string> parts{"unpermute_grad_v2", "permuted_rows"};
  EXPECT_IN_CHILD(body, parts, 60);
}

// The same through unpermute_grad without probs: permuted_tokens' data may be null there, so its
// shape (2^58, 64) is unchecked.
TEST(PermuteAdversarialCrash, UnpermuteGradHugePermutedShapeOverflowsOutputSize) {
  const auto body = [] {
    std::vector<float> gout(64, 1.0f);
    int32_t s[1] = {0};
    UnpermuteGradArgs a;
    a.permuted_tokens = TensorView::contiguous(nullptr, DType::kF32, {0, 64});
    a.permuted_tokens.shape[0] = int64_t{1} << 58;
    a.grad_out = TensorView::contiguous(gout.data(), DType::kF32, {1, 64});
    a.sorted_indices = TensorView::contiguous(s, DType::kI32, {1});
    unpermute_grad(a);
  };
  const std::vector<std::string> parts{"unpermute_grad", "permuted_tokens"};
  EXPECT_IN_CHILD(body, parts, 60);
}

// unpermute_with_saved copies P rows of a broadcast (stride-0) permuted_tokens of shape
// (2^58, 64): the saved copy's size overflows the same way.
TEST(PermuteAdversarialCrash, UnpermuteWithSavedBroadcastRowsOverflowSavedSize) {
  const auto body = [] {
    std::vector<float> row(64, 1.0f);
    int32_t s[1] = {0};
    UnpermuteArgs a;
    a.permuted_tokens = TensorView::contiguous(row.data(), DType::kF32, {1, 64});
    a.permuted_tokens.shape[0] = int64_t{1} << 58;
    a.permuted_tokens.strides[0] = 0;
    a.sorted_indices = TensorView::contiguous(s, DType::kI32, {1});
    unpermute_with_saved(a);
  };
  const std::vector<std::string> parts{"unpermute_with_saved", "permuted_tokens"};
  EXPECT_IN_CHILD(body, parts, 60);
}

// grad_permuted_tokens with no rows but H = 2^62 (numel 0, data null: valid): the output
// (1, 2^62) fp32 needs 2^64 bytes, which wraps to 0 in size_t; a 64-byte buffer is allocated and
// then std::vector<float>(2^62) throws inside an OpenMP region (std::terminate).
TEST(PermuteAdversarialCrash, PermuteGradV2HugeHiddenOverflowsOutputSize) {
  const auto body = [] {
    int32_t s[1] = {0};
    PermuteGradV2Args a;
    a.grad_permuted_tokens = TensorView::contiguous(nullptr, DType::kF32, {0, 0});
    a.grad_permuted_tokens.shape[1] = int64_t{1} << 62;
    a.grad_permuted_tokens.strides = {int64_t{1} << 62, 1};
    a.sorted_indices = TensorView::contiguous(s, DType::kI32, {1});
    a.tokens_rows = 1;
    a.num_topk = 1;
    a.tokens_dtype = DType::kF32;
    permute_grad_v2(a);
  };
  const std::vector<std::string> parts{"permute_grad_v2"};
  EXPECT_IN_CHILD(body, parts, 60);
}

// unpermute with permuted_tokens (0, 2^62) (no elements, data null: valid) and one dropped entry:
// out = (1, 2^62) fp32 needs 2^64 bytes.
TEST(PermuteAdversarialCrash, UnpermuteHugeHiddenOverflowsOutputSize) {
  const auto body = [] {
    int32_t s[1] = {0};
    UnpermuteArgs a;
    a.permuted_tokens = TensorView::contiguous(nullptr, DType::kF32, {0, 0});
    a.permuted_tokens.shape[1] = int64_t{1} << 62;
    a.permuted_tokens.strides = {int64_t{1} << 62, 1};
    a.sorted_indices = TensorView::contiguous(s, DType::kI32, {1});
    unpermute(a);
  };
  const std::vector<std::string> parts{"unpermute"};
  EXPECT_IN_CHILD(body, parts, 60);
}

// H = 0 with permuted_rows = 2^50: the result (2^50, 0) is empty, but the zeroing loop runs 2^50
// iterations of a 0-byte memset (hours). It must return within 10 s.
TEST(PermuteAdversarialHang, UnpermuteGradV2ZeroHiddenHugePermutedRows) {
  const auto body = [] {
    int32_t s[1] = {0};
    UnpermuteGradV2Args a;
    a.grad_out = TensorView::contiguous(nullptr, DType::kF32, {1, 0});
    a.sorted_indices = TensorView::contiguous(s, DType::kI32, {1});
    a.permuted_rows = int64_t{1} << 50;
    a.permuted_dtype = DType::kF32;
    const UnpermuteGradResult r = unpermute_grad_v2(a);
    if (r.grad_permuted_tokens.size(0) != (int64_t{1} << 50) || r.grad_permuted_tokens.size(1) != 0)
      std::_Exit(3);
  };
  const std::vector<std::string> parts{};
  EXPECT_IN_CHILD(body, parts, 10);
}

}  // namespace
}  // namespace moe_ep
