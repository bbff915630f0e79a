// SPEC §4: permute / unpermute and their gradients. The fast kernels (src/kernels/cpu/permute.cc)
// are compared bitwise with the naive reference (ref/permute_ref.cc) on fresh random inputs over a
// grid of dtypes, layouts, top-k, routings and num_out_tokens; the reference itself is checked on
// small hand-computed cases; round trips, thread-count independence, 64-bit row offsets and every
// argument check are covered.
//
// Reductions are compared bitwise too: both sides sum in fp32 in the SPEC's order, round every
// product to fp32 (-ffp-contract=off) and round once to the output dtype, so there is no excuse
// for a single differing bit.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "moe_ep/error.h"
#include "moe_ep/permute.h"
#include "moe_ep/tensor.h"
#include "moe_ep/threads.h"
#include "ref/numeric.h"
#include "ref/permute_ref.h"

namespace moe_ep {
namespace {

using Rng = std::mt19937_64;

// ---------------------------------------------------------------------------------------------
// Inputs: owned storage plus a (possibly strided) view into it.

struct Owned {
  Tensor storage;
  TensorView view;
};

void set_float(const TensorView& v, int64_t i, int64_t j, float x) {
  ref::store(v.dtype, v.data, i * v.strides[0] + (v.ndim > 1 ? j * v.strides[1] : 0), x);
}

void set_int(const TensorView& v, int64_t i, int64_t j, int64_t x) {
  const int64_t off = i * v.strides[0] + (v.ndim > 1 ? j * v.strides[1] : 0);
  if (v.dtype == DType::kI64) {
    static_cast<int64_t*>(v.data)[off] = x;
  } else {
    static_cast<int32_t*>(v.data)[off] = static_cast<int32_t>(x);
  }
}

// (n, h) rows of random values; with pad > 0, stride(0) = h + pad and the gaps hold NaN (0xff
// bytes in every float dtype), so a kernel that reads outside a row changes the result.
Owned random_rows(DType dtype, int64_t n, int64_t h, int64_t pad, Rng& rng) {
  Owned o;
  o.storage = Tensor::empty(dtype, {n, h + pad});
  std::memset(o.storage.data(), 0xff, o.storage.nbytes());
  o.view = o.storage.view();
  o.view.shape[1] = h;
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < h; ++j) set_float(o.view, i, j, u(rng));
  return o;
}

// (n, topk) probs in [-1, 1); strided = a transposed (column-major) layout.
Owned random_probs(DType dtype, int64_t n, int64_t topk, bool strided, Rng& rng) {
  Owned o;
  if (strided) {
    o.storage = Tensor::empty(dtype, {topk, n});
    o.view = TensorView::contiguous(o.storage.data(), dtype, {n, topk});
    o.view.strides = {1, n};
  } else {
    o.storage = Tensor::empty(dtype, {n, topk});
    o.view = o.storage.view();
  }
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < topk; ++k) set_float(o.view, i, k, u(rng));
  return o;
}

// Indices (n,) when !two_d (topk must be 1) or (n, topk), from flat[j], j = token*topk + k.
// strided: 1-D gets stride 3 with -1 in the gaps, 2-D a transposed layout.
Owned make_indices(DType dtype, const std::vector<int64_t>& flat, int64_t n, int64_t topk,
                   bool two_d, bool strided) {
  Owned o;
  if (!two_d) {
    o.storage = Tensor::empty(dtype, {n * (strided ? 3 : 1)});
    std::memset(o.storage.data(), 0xff, o.storage.nbytes());
    o.view = TensorView::contiguous(o.storage.data(), dtype, {n});
    o.view.strides[0] = strided ? 3 : 1;
  } else if (strided) {
    o.storage = Tensor::empty(dtype, {topk, n});
    o.view = TensorView::contiguous(o.storage.data(), dtype, {n, topk});
    o.view.strides = {1, n};
  } else {
    o.storage = Tensor::empty(dtype, {n, topk});
    o.view = o.storage.view();
  }
  for (int64_t j = 0; j < n * topk; ++j) set_int(o.view, j / topk, j % topk, flat[j]);
  return o;
}

// A copy of a 1-D int32 tensor with stride 2 and -7 in the gaps.
Owned strided_copy_i32(const Tensor& t) {
  const int64_t m = t.size(0);
  Owned o;
  o.storage = Tensor::empty(DType::kI32, {2 * m});
  for (int64_t i = 0; i < 2 * m; ++i) o.storage.ptr<int32_t>()[i] = -7;
  o.view = TensorView::contiguous(o.storage.data(), DType::kI32, {m});
  o.view.strides[0] = 2;
  for (int64_t i = 0; i < m; ++i) o.storage.ptr<int32_t>()[2 * i] = t.ptr<int32_t>()[i];
  return o;
}

enum class Routing { kUniform, kWideSparse, kSkewed, kEmptyExperts, kHugeIds };
const char* routing_name(Routing r) {
  switch (r) {
    case Routing::kUniform:
      return "uniform over 4 experts";
    case Routing::kWideSparse:
      return "uniform over 300 experts (most empty)";
    case Routing::kSkewed:
      return "all to expert 3";
    case Routing::kEmptyExperts:
      return "experts {0, 5, 9} only";
    case Routing::kHugeIds:
      return "ids up to 2^31 - 1";
  }
  return "?";
}

std::vector<int64_t> route(Routing r, int64_t m, Rng& rng) {
  std::vector<int64_t> ids(static_cast<std::size_t>(m));
  for (auto& e : ids) {
    switch (r) {
      case Routing::kUniform:
        e = static_cast<int64_t>(rng() % 4);
        break;
      case Routing::kWideSparse:
        e = static_cast<int64_t>(rng() % 300);
        break;
      case Routing::kSkewed:
        e = 3;
        break;
      case Routing::kEmptyExperts: {
        const int64_t set[3] = {0, 5, 9};
        e = set[rng() % 3];
        break;
      }
      case Routing::kHugeIds:
        e = rng() % 4 == 0 ? 2147483647 : static_cast<int64_t>(rng() % 2147483647);
        break;
    }
  }
  return ids;
}

// ---------------------------------------------------------------------------------------------
// Comparisons.

std::string shape_of(const Tensor& t) {
  std::string s = std::string(dtype_name(t.dtype())) + "[";
  for (int d = 0; d < t.ndim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

::testing::AssertionResult same_bits(const Tensor& fast, const Tensor& expected) {
  if (fast.defined() != expected.defined())
    return ::testing::AssertionFailure()
           << "defined: fast " << fast.defined() << ", expected " << expected.defined();
  if (!fast.defined()) return ::testing::AssertionSuccess();
  if (shape_of(fast) != shape_of(expected))
    return ::testing::AssertionFailure()
           << "shape: fast " << shape_of(fast) << ", expected " << shape_of(expected);
  const std::size_t es = dtype_size(fast.dtype());
  const auto* a = static_cast<const unsigned char*>(fast.data());
  const auto* b = static_cast<const unsigned char*>(expected.data());
  for (int64_t i = 0; i < fast.numel(); ++i)
    if (std::memcmp(a + i * es, b + i * es, es) != 0) {
      const TensorView fa = TensorView::contiguous(fast.data(), fast.dtype(), {fast.numel()});
      const TensorView ea =
          TensorView::contiguous(expected.data(), expected.dtype(), {expected.numel()});
      const int64_t h = fast.ndim() == 2 && fast.size(1) > 0 ? fast.size(1) : 1;
      return ::testing::AssertionFailure()
             << shape_of(fast) << " element " << i << " (row " << i / h << ", col " << i % h
             << "): fast " << ref::at(fa, i) << ", expected " << ref::at(ea, i);
    }
  return ::testing::AssertionSuccess();
}

// Row i of a 2-D float view equals row r of a contiguous tensor, bitwise.
bool row_equals(const TensorView& v, int64_t i, const Tensor& t, int64_t r) {
  const int64_t h = v.shape[1];
  const std::size_t bytes = static_cast<std::size_t>(h) * dtype_size(v.dtype);
  const auto* src = static_cast<const char*>(v.data) +
                    i * v.strides[0] * static_cast<int64_t>(dtype_size(v.dtype));
  return std::memcmp(src, static_cast<const char*>(t.data()) + r * bytes, bytes) == 0;
}

std::vector<float> floats(const Tensor& t) {
  std::vector<float> out;
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(ref::load(t.dtype(), t.data(), i));
  return out;
}

std::vector<int32_t> ints(const Tensor& t) {
  return std::vector<int32_t>(t.ptr<int32_t>(), t.ptr<int32_t>() + t.numel());
}

// ---------------------------------------------------------------------------------------------
// One grid point: every op, fast against the reference.

struct Case {
  DType dtype = DType::kF32;
  DType index_dtype = DType::kI32;
  DType probs_dtype = DType::kF32;
  int64_t topk = 1;
  bool two_d = true;
  Routing routing = Routing::kUniform;
  int64_t n = 1, h = 1;
  std::optional<int64_t> num_out;
  bool strided = false;
  bool extra_rows = false;  // permuted_tokens with 3 rows nothing refers to (P > M)

  std::string describe() const {
    std::string s = std::string("tokens ") + dtype_name(dtype) + " indices " +
                    dtype_name(index_dtype) + (two_d ? " 2-D" : " 1-D") + " probs " +
                    dtype_name(probs_dtype) + " N=" + std::to_string(n) +
                    " H=" + std::to_string(h) + " topK=" + std::to_string(topk) + " routing " +
                    routing_name(routing) +
                    " num_out_tokens=" + (num_out ? std::to_string(*num_out) : "None") +
                    (strided ? " strided" : " contiguous") + (extra_rows ? " P>M" : "");
    return s;
  }
};

void run_case(const Case& c, Rng& rng) {
  SCOPED_TRACE(c.describe());
  const int64_t n = c.n, h = c.h, topk = c.topk, m = n * topk;
  const int64_t pad = c.strided ? 3 : 0;
  Owned tokens = random_rows(c.dtype, n, h, pad, rng);
  Owned indices =
      make_indices(c.index_dtype, route(c.routing, m, rng), n, topk, c.two_d, c.strided);

  // permute
  PermuteArgs pa;
  pa.tokens = tokens.view;
  pa.indices = indices.view;
  pa.num_out_tokens = c.num_out;
  const PermuteResult fast = permute(pa);
  const ref::PermuteRefResult expected = ref::permute(tokens.view, indices.view, c.num_out);
  ASSERT_TRUE(same_bits(fast.sorted_indices, expected.sorted_indices));
  ASSERT_TRUE(same_bits(fast.permuted_tokens, expected.permuted_tokens));
  const int64_t rows = fast.permuted_tokens.size(0);
  const Tensor& s_tensor = fast.sorted_indices;

  // Round trip: unpermute(permute(x)) without probs gives x's rows back, bitwise; dropped
  // entries come back as zero rows.
  {
    UnpermuteArgs ua;
    ua.permuted_tokens = fast.permuted_tokens;
    ua.sorted_indices = s_tensor;
    const Tensor back = unpermute(ua);
    ASSERT_EQ(back.size(0), m);
    const Tensor zero = Tensor::zeros(c.dtype, {1, h});
    for (int64_t j = 0; j < m; ++j) {
      if (s_tensor.ptr<int32_t>()[j] < rows) {
        EXPECT_TRUE(row_equals(tokens.view, j / topk, back, j)) << "entry " << j;
      } else {
        EXPECT_TRUE(row_equals(zero.view(), 0, back, j)) << "dropped entry " << j;
      }
    }
  }

  // Fresh inputs for the other ops: sorted_indices strided or not, permuted_tokens random.
  Owned s_strided = strided_copy_i32(s_tensor);
  const TensorView s_view = c.strided ? s_strided.view : s_tensor.view();
  const int64_t p = rows + (c.extra_rows ? 3 : 0);
  Owned permuted = random_rows(c.dtype, p, h, pad, rng);
  Owned probs = random_probs(c.probs_dtype, n, topk, c.strided, rng);

  // unpermute / unpermute_with_saved, without and with probs
  for (bool with_probs : {false, true}) {
    SCOPED_TRACE(with_probs ? "with probs" : "without probs");
    UnpermuteArgs ua;
    ua.permuted_tokens = permuted.view;
    ua.sorted_indices = s_view;
    if (with_probs) ua.probs = probs.view;
    ua.restore_shape = std::vector<int64_t>{with_probs ? n : m, h};
    const Tensor out = unpermute(ua);
    const Tensor ref_out = ref::unpermute(
        permuted.view, s_view, with_probs ? std::optional<TensorView>(probs.view) : std::nullopt);
    EXPECT_TRUE(same_bits(out, ref_out));
    const UnpermuteWithSavedResult saved = unpermute_with_saved(ua);
    EXPECT_TRUE(same_bits(saved.out, ref_out));
    ASSERT_EQ(saved.permuted_tokens_for_backward.size(0), p);
    ASSERT_EQ(saved.permuted_tokens_for_backward.size(1), h);
    for (int64_t r = 0; r < p; ++r)
      EXPECT_TRUE(row_equals(permuted.view, r, saved.permuted_tokens_for_backward, r)) << r;
  }

  // permute_grad / permute_grad_v2 (grad_permuted_tokens has P rows: with P > M the extra rows
  // are never summed, with P < M the dropped entries are skipped)
  {
    Owned grad = random_rows(c.dtype, p, h, pad, rng);
    PermuteGradArgs ga;
    ga.tokens = tokens.view;
    ga.grad_permuted_tokens = grad.view;
    ga.indices = indices.view;
    ga.sorted_indices = s_view;
    const Tensor g1 = permute_grad(ga);
    const Tensor ref_g = ref::permute_grad(grad.view, s_view, n, topk, c.dtype);
    EXPECT_TRUE(same_bits(g1, ref_g));
    PermuteGradV2Args g2;
    g2.grad_permuted_tokens = grad.view;
    g2.sorted_indices = s_view;
    g2.tokens_rows = n;
    g2.tokens_dtype = c.dtype;
    g2.num_topk = topk;
    EXPECT_TRUE(same_bits(permute_grad_v2(g2), ref_g));
  }

  // unpermute_grad / unpermute_grad_v2, without and with probs
  for (bool with_probs : {false, true}) {
    SCOPED_TRACE(with_probs ? "grad with probs" : "grad without probs");
    Owned grad_out = random_rows(c.dtype, with_probs ? n : m, h, pad, rng);
    const std::optional<TensorView> pr =
        with_probs ? std::optional<TensorView>(probs.view) : std::nullopt;
    const ref::UnpermuteGradRefResult want =
        ref::unpermute_grad(grad_out.view, s_view, p, c.dtype, pr, permuted.view);
    UnpermuteGradArgs ga;
    ga.permuted_tokens = permuted.view;
    ga.grad_out = grad_out.view;
    ga.sorted_indices = s_view;
    ga.probs = pr;
    ga.restore_shape = std::vector<int64_t>{with_probs ? n : m, h};
    const UnpermuteGradResult got = unpermute_grad(ga);
    EXPECT_TRUE(same_bits(got.grad_permuted_tokens, want.grad_permuted_tokens));
    EXPECT_TRUE(same_bits(got.grad_probs, want.grad_probs));
    EXPECT_EQ(got.grad_probs.defined(), with_probs);

    UnpermuteGradV2Args g2;
    g2.grad_out = grad_out.view;
    g2.sorted_indices = s_view;
    g2.permuted_rows = p;
    g2.permuted_dtype = c.dtype;
    g2.probs = pr;
    if (with_probs) g2.permuted_tokens = permuted.view;
    const UnpermuteGradResult got2 = unpermute_grad_v2(g2);
    EXPECT_TRUE(same_bits(got2.grad_permuted_tokens, want.grad_permuted_tokens));
    EXPECT_TRUE(same_bits(got2.grad_probs, want.grad_probs));
  }
}

std::vector<std::optional<int64_t>> num_out_values(int64_t m) {
  std::vector<std::optional<int64_t>> v = {std::nullopt, 0, m, m + 5, -m};
  if (m > 0) v.insert(v.end(), {std::max<int64_t>(m / 2, 1), -1, -(m / 3), m - 1});
  return v;
}

// The grid: every tokens dtype x index dtype x index shape x routing x num_out_tokens kind, with
// N, H, probs dtype, layout and P > M drawn at random for each point.
TEST(Permute, MatchesReferenceOverGrid) {
  Rng rng(20240611);
  const int64_t ns[] = {0, 1, 2, 7, 33};
  const int64_t hs[] = {1, 3, 16, 40};
  const DType floats3[] = {DType::kBF16, DType::kF16, DType::kF32};
  struct Shape {
    int64_t topk;
    bool two_d;
  };
  const Shape shapes[] = {{1, false}, {1, true}, {2, true}, {8, true}};
  int cases = 0;
  for (DType dt : floats3)
    for (DType idt : {DType::kI32, DType::kI64})
      for (Shape sh : shapes)
        for (Routing r : {Routing::kUniform, Routing::kWideSparse, Routing::kSkewed,
                          Routing::kEmptyExperts, Routing::kHugeIds}) {
          Case c;
          c.dtype = dt;
          c.index_dtype = idt;
          c.topk = sh.topk;
          c.two_d = sh.two_d;
          c.routing = r;
          c.n = ns[rng() % 5];
          for (const auto& num_out : num_out_values(c.n * c.topk)) {
            c.h = hs[rng() % 4];
            c.probs_dtype = floats3[rng() % 3];
            c.num_out = num_out;
            c.strided = rng() % 2 == 0;
            c.extra_rows = !num_out && rng() % 2 == 0;
            run_case(c, rng);
            ++cases;
            if (HasFatalFailure()) return;
          }
        }
  EXPECT_GT(cases, 500);
}

TEST(Permute, NoTokensAndNoHidden) {
  Rng rng(7);
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32})
    for (int64_t h : {0, 4})
      for (int64_t n : {0, 3})
        for (std::optional<int64_t> num_out :
             {std::optional<int64_t>(), std::optional<int64_t>(0), std::optional<int64_t>(5)}) {
          Case c;
          c.dtype = dt;
          c.probs_dtype = dt;
          c.n = n;
          c.h = h;
          c.topk = 2;
          c.num_out = num_out;
          c.strided = h > 0;
          run_case(c, rng);
        }
}

// Rows of several 64-element blocks and more than 8 entries per token: the reductions' and
// unpermute_grad's block loops, which prefetch the next token's rows, and unpermute_grad's
// second group of rows (8 are walked side by side).
TEST(Permute, MatchesReferenceWideRowsTopK12) {
  Rng rng(1201);
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    Case c;
    c.dtype = dt;
    c.probs_dtype = DType::kF32;
    c.index_dtype = DType::kI32;
    c.n = 37;
    c.h = 200;
    c.topk = 12;
    c.routing = Routing::kUniform;
    run_case(c, rng);
    c.num_out = -40;  // dropped entries: fewer present rows than topk in some tokens
    run_case(c, rng);
  }
}

// Large enough for the parallel counting sort (M >= 16384) and many rows per thread.
TEST(Permute, MatchesReferenceLarge) {
  Rng rng(99);
  Case c;
  c.dtype = DType::kBF16;
  c.probs_dtype = DType::kF32;
  c.index_dtype = DType::kI64;
  c.n = 2500;
  c.h = 24;
  c.topk = 8;
  c.routing = Routing::kWideSparse;
  c.num_out = -1000;
  c.strided = true;
  run_case(c, rng);
  c.routing = Routing::kHugeIds;  // the std::stable_sort path
  c.num_out = std::nullopt;
  c.extra_rows = true;
  run_case(c, rng);
}

// ---------------------------------------------------------------------------------------------
// Hand-computed cases: they check the reference as much as the kernels.
//
// tokens (3, 2) = [[1,2],[3,4],[5,6]], indices (3, 2) = [[2,0],[1,0],[2,1]]:
// flat = [2,0,1,0,2,1]; the stable order by expert is [1,3,2,5,0,4] (expert 0: j = 1, 3; expert 1:
// j = 2, 5; expert 2: j = 0, 4); sorted_indices = its inverse = [4,0,2,1,5,3]; permuted row p =
// tokens[order[p] / 2] = tokens 0, 1, 1, 2, 0, 2.
struct Hand {
  float tokens[6] = {1, 2, 3, 4, 5, 6};
  int64_t indices[6] = {2, 0, 1, 0, 2, 1};
  TensorView tokens_view() { return TensorView::contiguous(tokens, DType::kF32, {3, 2}); }
  TensorView indices_view() { return TensorView::contiguous(indices, DType::kI64, {3, 2}); }
};

TEST(PermuteHand, PermuteAndNumOutTokens) {
  Hand hd;
  const std::vector<float> all = {1, 2, 3, 4, 3, 4, 5, 6, 1, 2, 5, 6};
  const std::vector<int32_t> s = {4, 0, 2, 1, 5, 3};
  struct Want {
    std::optional<int64_t> num_out;
    int64_t rows;
  };
  for (Want w :
       {Want{std::nullopt, 6}, Want{0, 6}, Want{4, 4}, Want{9, 6}, Want{-1, 5}, Want{-6, 0}}) {
    SCOPED_TRACE(w.num_out ? std::to_string(*w.num_out) : "None");
    PermuteArgs a;
    a.tokens = hd.tokens_view();
    a.indices = hd.indices_view();
    a.num_out_tokens = w.num_out;
    const PermuteResult r = permute(a);
    const std::vector<float> want(all.begin(), all.begin() + 2 * w.rows);
    EXPECT_EQ(floats(r.permuted_tokens), want);
    EXPECT_EQ(ints(r.sorted_indices), s);
    const ref::PermuteRefResult rr = ref::permute(a.tokens, a.indices, w.num_out);
    EXPECT_EQ(floats(rr.permuted_tokens), want);
    EXPECT_EQ(ints(rr.sorted_indices), s);
  }
}

// permuted row p = [p+1, 10(p+1)], probs = [[0.5,0.25],[1,2],[0.75,-1]], S = [4,0,2,1,5,3].
TEST(PermuteHand, UnpermuteWithProbs) {
  float perm[12];
  for (int p = 0; p < 6; ++p) perm[2 * p] = p + 1.0f, perm[2 * p + 1] = 10.0f * (p + 1);
  int32_t s[6] = {4, 0, 2, 1, 5, 3};
  float probs[6] = {0.5f, 0.25f, 1, 2, 0.75f, -1};
  for (int64_t p_rows : {6, 4}) {
    SCOPED_TRACE(p_rows);
    UnpermuteArgs a;
    a.permuted_tokens = TensorView::contiguous(perm, DType::kF32, {p_rows, 2});
    a.sorted_indices = TensorView::contiguous(s, DType::kI32, {6});
    a.probs = TensorView::contiguous(probs, DType::kF32, {3, 2});
    // out[0] = .5*[5,50] + .25*[1,10]; out[1] = [3,30] + 2*[2,20]; out[2] = .75*[6,60] - [4,40]
    const std::vector<float> want6 = {2.75f, 27.5f, 7, 70, 0.5f, 5};
    // rows 4 and 5 dropped: entries j = 0 (S = 4) and j = 4 (S = 5) add nothing
    const std::vector<float> want4 = {0.25f, 2.5f, 7, 70, -4, -40};
    const std::vector<float>& want = p_rows == 6 ? want6 : want4;
    EXPECT_EQ(floats(unpermute(a)), want);
    EXPECT_EQ(floats(ref::unpermute(a.permuted_tokens, a.sorted_indices, a.probs)), want);
    // without probs: out[j] = permuted[S[j]], zeros when dropped
    a.probs.reset();
    std::vector<float> gather;
    for (int32_t v : s)
      for (int c = 0; c < 2; ++c) gather.push_back(v < p_rows ? perm[2 * v + c] : 0.0f);
    EXPECT_EQ(floats(unpermute(a)), gather);
    EXPECT_EQ(floats(ref::unpermute(a.permuted_tokens, a.sorted_indices, std::nullopt)), gather);
  }
}

TEST(PermuteHand, PermuteGrad) {
  float grad[12];
  for (int p = 0; p < 6; ++p) grad[2 * p] = p + 1.0f, grad[2 * p + 1] = 10.0f * (p + 1);
  int32_t s[6] = {4, 0, 2, 1, 5, 3};
  float tokens[6] = {};
  int32_t indices[6] = {};
  for (int64_t r : {6, 4}) {
    SCOPED_TRACE(r);
    PermuteGradArgs a;
    a.tokens = TensorView::contiguous(tokens, DType::kF32, {3, 2});
    a.grad_permuted_tokens = TensorView::contiguous(grad, DType::kF32, {r, 2});
    a.indices = TensorView::contiguous(indices, DType::kI32, {3, 2});
    a.sorted_indices = TensorView::contiguous(s, DType::kI32, {6});
    // token 0: g[4] + g[0]; token 1: g[2] + g[1]; token 2: g[5] + g[3]; R = 4 skips g[4], g[5]
    const std::vector<float> want = r == 6 ? std::vector<float>{6, 60, 5, 50, 10, 100}
                                           : std::vector<float>{1, 10, 5, 50, 4, 40};
    EXPECT_EQ(floats(permute_grad(a)), want);
    EXPECT_EQ(
        floats(ref::permute_grad(a.grad_permuted_tokens, a.sorted_indices, 3, 2, DType::kF32)),
        want);
  }
}

TEST(PermuteHand, UnpermuteGrad) {
  float perm[12];
  for (int p = 0; p < 6; ++p) perm[2 * p] = p + 1.0f, perm[2 * p + 1] = 10.0f * (p + 1);
  int32_t s[6] = {4, 0, 2, 1, 5, 3};
  float probs[6] = {0.5f, 0.25f, 1, 2, 0.75f, -1};
  float grad_out[6] = {1, 2, 3, 4, 5, 6};
  for (int64_t p_rows : {6, 4}) {
    SCOPED_TRACE(p_rows);
    UnpermuteGradArgs a;
    a.permuted_tokens = TensorView::contiguous(perm, DType::kF32, {p_rows, 2});
    a.grad_out = TensorView::contiguous(grad_out, DType::kF32, {3, 2});
    a.sorted_indices = TensorView::contiguous(s, DType::kI32, {6});
    a.probs = TensorView::contiguous(probs, DType::kF32, {3, 2});
    // grad_permuted[S[j]] = grad_out[j/2] * probs[j]
    std::vector<float> want_gp = {0.25f, 0.5f, 6, 8, 3, 4, -5, -6, 0.5f, 1, 3.75f, 4.5f};
    want_gp.resize(2 * p_rows);
    // grad_probs[i,k] = dot(grad_out[i], permuted[S[2i+k]]); dropped entries are 0
    const std::vector<float> want_gprobs = p_rows == 6
                                               ? std::vector<float>{105, 21, 129, 86, 390, 260}
                                               : std::vector<float>{0, 21, 129, 86, 0, 260};
    const UnpermuteGradResult r = unpermute_grad(a);
    EXPECT_EQ(floats(r.grad_permuted_tokens), want_gp);
    EXPECT_EQ(floats(r.grad_probs), want_gprobs);
    const ref::UnpermuteGradRefResult rr = ref::unpermute_grad(
        a.grad_out, a.sorted_indices, p_rows, DType::kF32, a.probs, a.permuted_tokens);
    EXPECT_EQ(floats(rr.grad_permuted_tokens), want_gp);
    EXPECT_EQ(floats(rr.grad_probs), want_gprobs);
  }
  // Without probs: grad_permuted[S[i]] = grad_out[i]; rows nothing refers to (P = 5 > M = 3)
  // are 0.
  int32_t s3[3] = {4, 0, 2};
  UnpermuteGradArgs a;
  a.permuted_tokens = TensorView::contiguous(perm, DType::kF32, {5, 2});
  a.grad_out = TensorView::contiguous(grad_out, DType::kF32, {3, 2});
  a.sorted_indices = TensorView::contiguous(s3, DType::kI32, {3});
  const std::vector<float> want = {3, 4, 0, 0, 5, 6, 0, 0, 1, 2};
  const UnpermuteGradResult r = unpermute_grad(a);
  EXPECT_EQ(floats(r.grad_permuted_tokens), want);
  EXPECT_FALSE(r.grad_probs.defined());
  EXPECT_EQ(floats(ref::unpermute_grad(a.grad_out, a.sorted_indices, 5, DType::kF32, std::nullopt,
                                       std::nullopt)
                       .grad_permuted_tokens),
            want);
}

// The sums are fp32 in k order with one final rounding: in bf16, 1 + 3 * 2^-8 accumulated in
// fp32 is 1.01171875, a tie that rounds to even 1.015625 (rounding after every add would give 1).
// In fp32, k order matters: (1e8 + 1) - 1e8 = 0, not 1.
TEST(PermuteHand, SumOrderAndSingleRounding) {
  // bf16 rows [1, 2^-8, 2^-8, 2^-8], all four summed into one token.
  uint16_t rows[4];
  for (int i = 0; i < 4; ++i) ref::store(DType::kBF16, rows, i, i == 0 ? 1.0f : 0.00390625f);
  int32_t s4[4] = {0, 1, 2, 3};
  float ones[4] = {1, 1, 1, 1};
  UnpermuteArgs ua;
  ua.permuted_tokens = TensorView::contiguous(rows, DType::kBF16, {4, 1});
  ua.sorted_indices = TensorView::contiguous(s4, DType::kI32, {4});
  ua.probs = TensorView::contiguous(ones, DType::kF32, {1, 4});
  const std::vector<float> want = {1.015625f};
  EXPECT_EQ(floats(unpermute(ua)), want);
  EXPECT_EQ(floats(ref::unpermute(ua.permuted_tokens, ua.sorted_indices, ua.probs)), want);

  int32_t idx4[4] = {};
  uint16_t tok1[1] = {};
  PermuteGradArgs ga;
  ga.tokens = TensorView::contiguous(tok1, DType::kBF16, {1, 1});
  ga.grad_permuted_tokens = ua.permuted_tokens;
  ga.indices = TensorView::contiguous(idx4, DType::kI32, {1, 4});
  ga.sorted_indices = ua.sorted_indices;
  EXPECT_EQ(floats(permute_grad(ga)), want);
  EXPECT_EQ(
      floats(ref::permute_grad(ga.grad_permuted_tokens, ga.sorted_indices, 1, 4, DType::kBF16)),
      want);

  // grad_probs of that token against grad_out = 1: the same fp32 dot, rounded once to bf16.
  uint16_t one_bf16[1];
  ref::store(DType::kBF16, one_bf16, 0, 1.0f);
  uint16_t probs_bf16[4];
  for (int i = 0; i < 4; ++i) ref::store(DType::kBF16, probs_bf16, i, 1.0f);
  UnpermuteGradArgs ug;
  ug.permuted_tokens = ua.permuted_tokens;
  ug.grad_out = TensorView::contiguous(one_bf16, DType::kBF16, {1, 1});
  ug.sorted_indices = ua.sorted_indices;
  ug.probs = TensorView::contiguous(probs_bf16, DType::kBF16, {1, 4});
  EXPECT_EQ(floats(unpermute_grad(ug).grad_probs),
            (std::vector<float>{1.0f, 0.00390625f, 0.00390625f, 0.00390625f}));

  // fp32, k order: (1e8 + 1) - 1e8 = 0 (1 is lost in the first add); (1e8 - 1e8) + 1 = 1.
  float big[3] = {1e8f, 1.0f, -1e8f};
  int32_t s3[3] = {0, 1, 2}, s3_alt[3] = {0, 2, 1};
  int32_t idx3[3] = {};
  float tok3[1] = {};
  ga.tokens = TensorView::contiguous(tok3, DType::kF32, {1, 1});
  ga.grad_permuted_tokens = TensorView::contiguous(big, DType::kF32, {3, 1});
  ga.indices = TensorView::contiguous(idx3, DType::kI32, {1, 3});
  ga.sorted_indices = TensorView::contiguous(s3, DType::kI32, {3});
  EXPECT_EQ(floats(permute_grad(ga)), std::vector<float>{0.0f});
  EXPECT_EQ(
      floats(ref::permute_grad(ga.grad_permuted_tokens, ga.sorted_indices, 1, 3, DType::kF32)),
      std::vector<float>{0.0f});
  ga.sorted_indices = TensorView::contiguous(s3_alt, DType::kI32, {3});
  EXPECT_EQ(floats(permute_grad(ga)), std::vector<float>{1.0f});
  EXPECT_EQ(
      floats(ref::permute_grad(ga.grad_permuted_tokens, ga.sorted_indices, 1, 3, DType::kF32)),
      std::vector<float>{1.0f});

  // Products are rounded to fp32 before the add (no FMA): with a = 1 + 2^-12, a*a = 1 + 2^-11 +
  // 2^-24 rounds (tie to even) to 1 + 2^-11, so -(1 + 2^-11) + a*a = 0; a fused multiply-add
  // would give 2^-24.
  const float a = 1.0f + 0.000244140625f, c = -(1.0f + 0.00048828125f);
  float gout[2] = {c, a};
  float xrow[2] = {1, a};
  float p1[1] = {1};
  int32_t s1[1] = {0};
  ug.permuted_tokens = TensorView::contiguous(xrow, DType::kF32, {1, 2});
  ug.grad_out = TensorView::contiguous(gout, DType::kF32, {1, 2});
  ug.sorted_indices = TensorView::contiguous(s1, DType::kI32, {1});
  ug.probs = TensorView::contiguous(p1, DType::kF32, {1, 1});
  EXPECT_EQ(floats(unpermute_grad(ug).grad_probs), std::vector<float>{0.0f});
  EXPECT_EQ(floats(ref::unpermute_grad(ug.grad_out, ug.sorted_indices, 1, DType::kF32, ug.probs,
                                       ug.permuted_tokens)
                       .grad_probs),
            std::vector<float>{0.0f});
  // unpermute: 1 * c + a * a over two permuted rows.
  float rows2[2] = {c, a};
  int32_t s2[2] = {0, 1};
  float w2[2] = {1, a};
  ua.permuted_tokens = TensorView::contiguous(rows2, DType::kF32, {2, 1});
  ua.sorted_indices = TensorView::contiguous(s2, DType::kI32, {2});
  ua.probs = TensorView::contiguous(w2, DType::kF32, {1, 2});
  EXPECT_EQ(floats(unpermute(ua)), std::vector<float>{0.0f});
  EXPECT_EQ(floats(ref::unpermute(ua.permuted_tokens, ua.sorted_indices, ua.probs)),
            std::vector<float>{0.0f});
}

// ---------------------------------------------------------------------------------------------
// Thread-count independence: 1 and 4 OpenMP threads give the same bits.

struct AllOutputs {
  std::vector<Tensor> tensors;
};

AllOutputs run_all_ops(uint64_t seed, int64_t n = 3000, int64_t h = 40) {
  Rng rng(seed);
  const int64_t topk = 8, m = n * topk;
  Owned tokens = random_rows(DType::kBF16, n, h, 2, rng);
  Owned indices =
      make_indices(DType::kI32, route(Routing::kWideSparse, m, rng), n, topk, true, false);
  Owned probs = random_probs(DType::kF32, n, topk, false, rng);
  PermuteArgs pa;
  pa.tokens = tokens.view;
  pa.indices = indices.view;
  pa.num_out_tokens = -500;
  AllOutputs out;
  const PermuteResult pr = permute(pa);
  out.tensors = {pr.permuted_tokens, pr.sorted_indices};
  const int64_t p = pr.permuted_tokens.size(0);
  UnpermuteArgs ua;
  ua.permuted_tokens = pr.permuted_tokens;
  ua.sorted_indices = pr.sorted_indices;
  ua.probs = probs.view;
  out.tensors.push_back(unpermute(ua));
  Owned grad = random_rows(DType::kBF16, p, h, 0, rng);
  PermuteGradArgs ga;
  ga.tokens = tokens.view;
  ga.grad_permuted_tokens = grad.view;
  ga.indices = indices.view;
  ga.sorted_indices = pr.sorted_indices;
  out.tensors.push_back(permute_grad(ga));
  Owned grad_out = random_rows(DType::kBF16, n, h, 0, rng);
  UnpermuteGradArgs ug;
  ug.permuted_tokens = pr.permuted_tokens;
  ug.grad_out = grad_out.view;
  ug.sorted_indices = pr.sorted_indices;
  ug.probs = probs.view;
  const UnpermuteGradResult gr = unpermute_grad(ug);
  out.tensors.push_back(gr.grad_permuted_tokens);
  out.tensors.push_back(gr.grad_probs);
  return out;
}

TEST(Permute, SameBitsWithOneAndFourThreads) {
  // moe_ep::set_num_threads fixes the team of every parallel loop (OpenMP's own count may be
  // capped by the automatic rule, threads.h).
  for (uint64_t seed : {5, 6}) {
    set_num_threads(1);
    ASSERT_EQ(num_threads(), 1);
    const AllOutputs one = run_all_ops(seed);
    set_num_threads(4);
    ASSERT_EQ(num_threads(), 4);
    const AllOutputs four = run_all_ops(seed);
    set_num_threads(0);
    ASSERT_EQ(one.tensors.size(), four.tensors.size());
    for (std::size_t i = 0; i < one.tensors.size(); ++i)
      EXPECT_TRUE(same_bits(four.tensors[i], one.tensors[i])) << "seed " << seed << " output " << i;
  }
}

// Two callers at once, each on its own tensors: the Python front releases the GIL during every
// op, so two Python threads may run ops together. Their OpenMP teams, the kernels' thread-local
// scratch and the block cache (outputs of 4 MiB and more: the second size) are shared by both
// callers, and each must still get the bits a lone caller gets. scripts/test.sh's ThreadSanitizer
// stage (MOE_EP_TEST_TSAN=1) runs this test for its data races.
TEST(Permute, TwoCallerThreadsAtOnceGetTheSameBits) {
  set_num_threads(2);
  ASSERT_EQ(num_threads(), 2);
  for (const auto& size : {std::pair<int64_t, int64_t>{3000, 40}, {2048, 160}}) {
    const int64_t n = size.first, h = size.second;  // not a structured binding: clang's
                                                    // -fopenmp cannot capture one
    SCOPED_TRACE("n " + std::to_string(n) + " h " + std::to_string(h));
    const uint64_t seeds[2] = {21, 22};
    AllOutputs want[2];
    for (int c = 0; c < 2; ++c) want[c] = run_all_ops(seeds[c], n, h);
    for (int round = 0; round < 2; ++round) {
      AllOutputs got[2];
      std::exception_ptr failed[2];
      std::vector<std::thread> callers;
      for (int c = 0; c < 2; ++c)
        callers.emplace_back([&, c] {
          try {
            got[c] = run_all_ops(seeds[c], n, h);
          } catch (...) {
            failed[c] = std::current_exception();
          }
        });
      for (auto& t : callers) t.join();
      for (int c = 0; c < 2; ++c) {
        ASSERT_FALSE(failed[c]) << "caller " << c << " threw";
        ASSERT_EQ(got[c].tensors.size(), want[c].tensors.size());
        for (std::size_t i = 0; i < got[c].tensors.size(); ++i)
          EXPECT_TRUE(same_bits(got[c].tensors[i], want[c].tensors[i]))
              << "caller " << c << " round " << round << " output " << i;
      }
    }
  }
  set_num_threads(0);
}

// ---------------------------------------------------------------------------------------------
// 64-bit row offsets: rows 2^31 elements apart in a sparse mapping (only touched pages exist).

TEST(Permute, RowOffsetsBeyond32Bits) {
  const int64_t n = 3, h = 4, stride = (int64_t{1} << 31) + 64;
  const std::size_t bytes = static_cast<std::size_t>((n - 1) * stride + h) * 2;
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) GTEST_SKIP() << "cannot map " << bytes << " bytes of address space";
  TensorView tokens = TensorView::contiguous(mem, DType::kF16, {n, h});
  tokens.strides[0] = stride;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < h; ++c) set_float(tokens, i, c, static_cast<float>(10 * i + c));
  int32_t idx[6] = {1, 0, 0, 1, 1, 0};
  PermuteArgs pa;
  pa.tokens = tokens;
  pa.indices = TensorView::contiguous(idx, DType::kI32, {n, 2});
  const PermuteResult r = permute(pa);
  EXPECT_TRUE(same_bits(r.permuted_tokens, ref::permute(tokens, pa.indices, {}).permuted_tokens));
  EXPECT_EQ(floats(r.permuted_tokens)[4 * 5], 20.0f);  // the last row holds token 2 (expert 1)

  // The same sparse rows as permuted_tokens (P = 3) and grad_permuted_tokens.
  int32_t s[3] = {2, 0, 1};
  float probs[3] = {1, 0.5f, 2};
  UnpermuteArgs ua;
  ua.permuted_tokens = tokens;
  ua.sorted_indices = TensorView::contiguous(s, DType::kI32, {3});
  ua.probs = TensorView::contiguous(probs, DType::kF32, {1, 3});
  EXPECT_TRUE(same_bits(unpermute(ua), ref::unpermute(tokens, ua.sorted_indices, ua.probs)));
  PermuteGradV2Args ga;
  ga.grad_permuted_tokens = tokens;
  ga.sorted_indices = ua.sorted_indices;
  ga.tokens_rows = 1;
  ga.num_topk = 3;
  ga.tokens_dtype = DType::kF16;
  EXPECT_TRUE(same_bits(permute_grad_v2(ga),
                        ref::permute_grad(tokens, ua.sorted_indices, 1, 3, DType::kF16)));
  UnpermuteGradArgs ug;
  ug.permuted_tokens = tokens;
  ug.grad_out = tokens;  // (3, H) = (N, H) with N = 3, topK = 1
  ug.sorted_indices = ua.sorted_indices;
  ug.probs = TensorView::contiguous(probs, DType::kF32, {3, 1});
  const UnpermuteGradResult gr = unpermute_grad(ug);
  const ref::UnpermuteGradRefResult want =
      ref::unpermute_grad(tokens, ua.sorted_indices, 3, DType::kF16, ug.probs, tokens);
  EXPECT_TRUE(same_bits(gr.grad_permuted_tokens, want.grad_permuted_tokens));
  EXPECT_TRUE(same_bits(gr.grad_probs, want.grad_probs));
  munmap(mem, bytes);
}

// ---------------------------------------------------------------------------------------------
// Argument checks: the kind, and a message that names the op, the parameter, the value and the
// bound.

void expect_error(const std::function<void()>& f, ErrorKind kind,
                  std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << *parts.begin() << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << error_kind_name(e.kind()) << ": " << e.what();
    for (const std::string& part : parts)
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "'" << part << "' missing from: " << e.what();
  }
}

constexpr ErrorKind kInvalid = ErrorKind::kInvalidArgument;
constexpr ErrorKind kUnsupported = ErrorKind::kUnsupported;

// Valid small inputs that each check below breaks in one way.
struct Valid {
  float tokens[6] = {1, 2, 3, 4, 5, 6};     // (3, 2)
  int32_t indices[6] = {0, 1, 1, 0, 2, 1};  // (3, 2)
  int32_t sorted[6] = {0, 2, 3, 1, 5, 4};   // (6,), a permutation
  float probs[6] = {1, 1, 1, 1, 1, 1};      // (3, 2)
  float permuted[12] = {};                  // (6, 2)
  float grad_out[6] = {};                   // (3, 2)
  TensorView tokens_v() { return TensorView::contiguous(tokens, DType::kF32, {3, 2}); }
  TensorView indices_v() { return TensorView::contiguous(indices, DType::kI32, {3, 2}); }
  TensorView sorted_v() { return TensorView::contiguous(sorted, DType::kI32, {6}); }
  TensorView probs_v() { return TensorView::contiguous(probs, DType::kF32, {3, 2}); }
  TensorView permuted_v() { return TensorView::contiguous(permuted, DType::kF32, {6, 2}); }
  TensorView grad_out_v() { return TensorView::contiguous(grad_out, DType::kF32, {3, 2}); }
  PermuteArgs permute_args() {
    PermuteArgs a;
    a.tokens = tokens_v();
    a.indices = indices_v();
    return a;
  }
  PermuteGradArgs permute_grad_args() {
    PermuteGradArgs a;
    a.tokens = tokens_v();
    a.grad_permuted_tokens = permuted_v();
    a.indices = indices_v();
    a.sorted_indices = sorted_v();
    return a;
  }
  PermuteGradV2Args permute_grad_v2_args() {
    PermuteGradV2Args a;
    a.grad_permuted_tokens = permuted_v();
    a.sorted_indices = sorted_v();
    a.tokens_rows = 3;
    a.num_topk = 2;
    a.tokens_dtype = DType::kF32;
    return a;
  }
  UnpermuteArgs unpermute_args() {
    UnpermuteArgs a;
    a.permuted_tokens = permuted_v();
    a.sorted_indices = sorted_v();
    a.probs = probs_v();
    return a;
  }
  UnpermuteGradArgs unpermute_grad_args() {
    UnpermuteGradArgs a;
    a.permuted_tokens = permuted_v();
    a.grad_out = grad_out_v();
    a.sorted_indices = sorted_v();
    a.probs = probs_v();
    return a;
  }
  UnpermuteGradV2Args unpermute_grad_v2_args() {
    UnpermuteGradV2Args a;
    a.grad_out = grad_out_v();
    a.sorted_indices = sorted_v();
    a.permuted_rows = 6;
    a.permuted_dtype = DType::kF32;
    a.probs = probs_v();
    a.permuted_tokens = permuted_v();
    return a;
  }
};

// P far larger than M: repeats are found by sorting instead of a P-bit bitmap, and every row of
// grad_permuted_tokens that nothing refers to is still 0.
TEST(Permute, ManyMorePermutedRowsThanEntries) {
  const int64_t p = int64_t{1} << 20;
  float grad_out[6] = {1, 2, 3, 4, 5, 6};
  int32_t s[3] = {0, 1000000, 5};
  UnpermuteGradV2Args a;
  a.grad_out = TensorView::contiguous(grad_out, DType::kF32, {3, 2});
  a.sorted_indices = TensorView::contiguous(s, DType::kI32, {3});
  a.permuted_rows = p;
  a.permuted_dtype = DType::kF32;
  const UnpermuteGradResult got = unpermute_grad_v2(a);
  const ref::UnpermuteGradRefResult want =
      ref::unpermute_grad(a.grad_out, a.sorted_indices, p, DType::kF32, std::nullopt, std::nullopt);
  EXPECT_TRUE(same_bits(got.grad_permuted_tokens, want.grad_permuted_tokens));
  EXPECT_EQ(got.grad_permuted_tokens.ptr<float>()[2 * 1000000 + 1], 4.0f);
  s[2] = 1000000;
  expect_error([&] { unpermute_grad_v2(a); }, ErrorKind::kInvalidArgument,
               {"unpermute_grad_v2: sorted_indices[2] = 1000000 duplicates sorted_indices[1]"});
}

TEST(PermuteErrors, ValidBaselinesPass) {
  Valid v;
  EXPECT_NO_THROW(permute(v.permute_args()));
  EXPECT_NO_THROW(permute_grad(v.permute_grad_args()));
  EXPECT_NO_THROW(permute_grad_v2(v.permute_grad_v2_args()));
  EXPECT_NO_THROW(unpermute(v.unpermute_args()));
  EXPECT_NO_THROW(unpermute_with_saved(v.unpermute_args()));
  EXPECT_NO_THROW(unpermute_grad(v.unpermute_grad_args()));
  EXPECT_NO_THROW(unpermute_grad_v2(v.unpermute_grad_v2_args()));
}

TEST(PermuteErrors, PermuteTokens) {
  Valid v;
  auto a = v.permute_args();
  a.tokens.dtype = DType::kI32;
  expect_error([&] { permute(a); }, kInvalid,
               {"permute: tokens dtype int32 is not one of {bf16, fp16, fp32}"});
  a = v.permute_args();
  a.tokens = TensorView::contiguous(v.tokens, DType::kF32, {6});
  expect_error([&] { permute(a); }, kInvalid, {"permute: tokens.ndim = 1 must be 2"});
  a = v.permute_args();
  a.tokens = TensorView::contiguous(v.tokens, DType::kF32, {3, 2});
  a.tokens.strides = {2, 2};
  expect_error([&] { permute(a); }, kUnsupported, {"permute: tokens.stride(1) = 2 is not 1"});
  a = v.permute_args();
  a.tokens.data = nullptr;
  expect_error([&] { permute(a); }, kInvalid, {"permute: tokens has 6 elements but data is null"});
}

TEST(PermuteErrors, PermuteIndices) {
  Valid v;
  auto a = v.permute_args();
  a.indices.dtype = DType::kF32;
  expect_error([&] { permute(a); }, kInvalid,
               {"permute: indices dtype fp32 is not one of {int32, int64}"});
  a = v.permute_args();
  a.indices = TensorView::contiguous(v.indices, DType::kI32, {3, 2, 1});
  expect_error([&] { permute(a); }, kInvalid, {"permute: indices.ndim = 3 must be 1 or 2"});
  a = v.permute_args();
  a.indices = TensorView::contiguous(v.indices, DType::kI32, {2, 3});
  expect_error([&] { permute(a); }, kInvalid,
               {"permute: indices.shape[0] = 2 must equal 3 (N, tokens.shape[0])"});
  a = v.permute_args();
  a.indices = TensorView::contiguous(v.indices, DType::kI32, {3, 0});
  expect_error([&] { permute(a); }, kInvalid,
               {"permute: indices.shape[1] = 0 must be >= 1 (topK)"});
  a = v.permute_args();
  v.indices[4] = -1;  // [2, 0]
  expect_error([&] { permute(a); }, kInvalid,
               {"permute: indices[2,0] = -1 is outside [0, 2147483648)"});
  a.indices = TensorView::contiguous(v.indices, DType::kI32, {3});
  v.indices[1] = -5;
  expect_error([&] { permute(a); }, kInvalid,
               {"permute: indices[1] = -5 is outside [0, 2147483648)"});
  int64_t big[6] = {0, 2147483648LL, 1, 0, 0, 0};
  a.indices = TensorView::contiguous(big, DType::kI64, {3, 2});
  expect_error([&] { permute(a); }, kInvalid,
               {"permute: indices[0,1] = 2147483648 is outside [0, 2147483648)"});
  big[1] = 2147483647;  // the largest valid id
  EXPECT_NO_THROW(permute(a));
}

TEST(PermuteErrors, PermuteSizes) {
  Valid v;
  auto a = v.permute_args();
  a.num_out_tokens = -7;
  expect_error([&] { permute(a); }, kInvalid, {"permute: num_out_tokens = -7 is below -M = -6"});
  a.num_out_tokens = -6;
  EXPECT_EQ(permute(a).permuted_tokens.size(0), 0);
  // M = N*topK must fit int32 (checked before any element is read: stride-0 views suffice).
  int32_t zero = 0;
  a = v.permute_args();
  a.tokens = TensorView::contiguous(v.tokens, DType::kF32, {int64_t{1} << 30, 0});
  a.indices = TensorView::contiguous(&zero, DType::kI32, {int64_t{1} << 30, 4});
  a.indices.strides = {0, 0};
  expect_error([&] { permute(a); }, kInvalid,
               {"permute: M = N*topK = 1073741824 * 4 exceeds 2147483648"});
}

TEST(PermuteErrors, PermuteGrad) {
  Valid v;
  auto a = v.permute_grad_args();
  a.grad_permuted_tokens.dtype = DType::kF16;
  expect_error([&] { permute_grad(a); }, kInvalid,
               {"permute_grad: grad_permuted_tokens dtype fp16 must equal tokens dtype fp32"});
  a = v.permute_grad_args();
  a.tokens.dtype = DType::kI64;
  expect_error([&] { permute_grad(a); }, kInvalid,
               {"permute_grad: tokens dtype int64 is not one of {bf16, fp16, fp32}"});
  a = v.permute_grad_args();
  a.grad_permuted_tokens = TensorView::contiguous(v.permuted, DType::kF32, {4, 3});
  expect_error([&] { permute_grad(a); }, kInvalid,
               {"permute_grad: grad_permuted_tokens.shape[1] = 3 must equal 2 (H, "
                "tokens.shape[1])"});
  a = v.permute_grad_args();
  a.indices = TensorView::contiguous(v.indices, DType::kI32, {2});
  expect_error([&] { permute_grad(a); }, kInvalid,
               {"permute_grad: indices.shape[0] = 2 must equal 3 (N, tokens.shape[0])"});
  a = v.permute_grad_args();
  a.sorted_indices = TensorView::contiguous(v.sorted, DType::kI32, {5});
  expect_error([&] { permute_grad(a); }, kInvalid,
               {"permute_grad: sorted_indices.shape[0] = 5 must equal 6 (M = N*topK)"});
  a = v.permute_grad_args();
  a.sorted_indices.dtype = DType::kI64;
  a.sorted_indices.shape[0] = 3;
  expect_error([&] { permute_grad(a); }, kInvalid,
               {"permute_grad: sorted_indices dtype int64 is not one of {int32}"});
  a = v.permute_grad_args();
  a.sorted_indices = TensorView::contiguous(v.sorted, DType::kI32, {3, 2});
  expect_error([&] { permute_grad(a); }, kInvalid,
               {"permute_grad: sorted_indices.ndim = 2 must be 1"});
  a = v.permute_grad_args();
  v.sorted[3] = 6;
  expect_error([&] { permute_grad(a); }, kInvalid,
               {"permute_grad: sorted_indices[3] = 6 is outside [0, 6) (max(R, M)"});
  v.sorted[3] = -2;
  expect_error([&] { permute_grad(a); }, kInvalid,
               {"permute_grad: sorted_indices[3] = -2 is outside [0, 6)"});
  // With R = 8 > M the bound is 8; repeats are allowed (a gather-sum is well defined).
  float g8[16] = {};
  v.sorted[3] = 7;
  v.sorted[4] = 7;
  a.grad_permuted_tokens = TensorView::contiguous(g8, DType::kF32, {8, 2});
  EXPECT_NO_THROW(permute_grad(a));
}

TEST(PermuteErrors, PermuteGradV2) {
  Valid v;
  auto a = v.permute_grad_v2_args();
  a.tokens_rows = -1;
  expect_error([&] { permute_grad_v2(a); }, kInvalid,
               {"permute_grad_v2: tokens_rows = -1 must be >= 0"});
  a = v.permute_grad_v2_args();
  a.num_topk = 0;
  expect_error([&] { permute_grad_v2(a); }, kInvalid,
               {"permute_grad_v2: num_topk = 0 must be >= 1"});
  a = v.permute_grad_v2_args();
  a.tokens_dtype = DType::kI8;
  expect_error([&] { permute_grad_v2(a); }, kInvalid,
               {"permute_grad_v2: tokens_dtype int8 is not one of {bf16, fp16, fp32}"});
  a = v.permute_grad_v2_args();
  a.tokens_dtype = DType::kBF16;
  expect_error([&] { permute_grad_v2(a); }, kInvalid,
               {"permute_grad_v2: grad_permuted_tokens dtype fp32 must equal tokens_dtype bf16"});
  a = v.permute_grad_v2_args();
  a.num_topk = 3;
  expect_error([&] { permute_grad_v2(a); }, kInvalid,
               {"permute_grad_v2: sorted_indices.shape[0] = 6 must equal 9 (M = "
                "tokens_rows*num_topk)"});
  a = v.permute_grad_v2_args();
  a.grad_permuted_tokens.strides[1] = 3;
  expect_error([&] { permute_grad_v2(a); }, kUnsupported,
               {"permute_grad_v2: grad_permuted_tokens.stride(1) = 3 is not 1"});
  a = v.permute_grad_v2_args();
  a.tokens_rows = int64_t{1} << 40;
  a.num_topk = 1 << 10;
  expect_error([&] { permute_grad_v2(a); }, kInvalid,
               {"permute_grad_v2: tokens_rows*num_topk = 1099511627776 * 1024 exceeds "
                "2147483648"});
  a = v.permute_grad_v2_args();
  v.sorted[5] = 9;
  expect_error([&] { permute_grad_v2(a); }, kInvalid,
               {"permute_grad_v2: sorted_indices[5] = 9 is outside [0, 6)"});
}

void unpermute_checks(const char* op, const std::function<void(const UnpermuteArgs&)>& call) {
  const std::string o = std::string(op) + ": ";
  Valid v;
  auto a = v.unpermute_args();
  a.permuted_tokens.dtype = DType::kI8;
  expect_error([&] { call(a); }, kInvalid,
               {o + "permuted_tokens dtype int8 is not one of {bf16, fp16, fp32}"});
  a = v.unpermute_args();
  a.sorted_indices.dtype = DType::kI64;
  a.sorted_indices.shape[0] = 3;
  a.probs.reset();
  expect_error([&] { call(a); }, kInvalid,
               {o + "sorted_indices dtype int64 is not one of {int32}"});
  a = v.unpermute_args();
  a.probs->dtype = DType::kI32;
  expect_error([&] { call(a); }, kInvalid,
               {o + "probs dtype int32 is not one of {bf16, fp16, fp32}"});
  a = v.unpermute_args();
  a.probs = TensorView::contiguous(v.probs, DType::kF32, {6});
  expect_error([&] { call(a); }, kInvalid, {o + "probs.ndim = 1 must be 2"});
  a = v.unpermute_args();
  a.probs = TensorView::contiguous(v.probs, DType::kF32, {6, 0});
  expect_error([&] { call(a); }, kInvalid, {o + "probs.shape[1] = 0 must be >= 1 (topK)"});
  a = v.unpermute_args();
  a.probs = TensorView::contiguous(v.probs, DType::kF32, {2, 2});
  expect_error(
      [&] { call(a); }, kInvalid,
      {o + "sorted_indices.shape[0] = 6 must equal 4 (M = N*topK from probs.shape (2, 2))"});
  a = v.unpermute_args();
  a.restore_shape = std::vector<int64_t>{3, 5};
  expect_error([&] { call(a); }, kInvalid,
               {o + "restore_shape = [3, 5] must equal [3, 2] (the output shape)"});
  a.restore_shape = std::vector<int64_t>{3, 2};
  EXPECT_NO_THROW(call(a));
  a.probs.reset();  // without probs the output is (M, H)
  expect_error([&] { call(a); }, kInvalid, {o + "restore_shape = [3, 2] must equal [6, 2]"});
  a = v.unpermute_args();
  v.sorted[4] = 2;
  expect_error(
      [&] { call(a); }, kInvalid,
      {o + "sorted_indices[4] = 2 duplicates sorted_indices[1] (values must be distinct)"});
  v.sorted[4] = 6;
  expect_error([&] { call(a); }, kInvalid,
               {o + "sorted_indices[4] = 6 is outside [0, 6) (max(P, M)"});
  v.sorted[4] = -1;
  expect_error([&] { call(a); }, kInvalid, {o + "sorted_indices[4] = -1 is outside [0, 6)"});
  // With P = 8 > M = 6 values up to 7 are fine.
  float p8[16] = {};
  v.sorted[4] = 7;
  a.permuted_tokens = TensorView::contiguous(p8, DType::kF32, {8, 2});
  EXPECT_NO_THROW(call(a));
}

TEST(PermuteErrors, Unpermute) {
  unpermute_checks("unpermute", [](const UnpermuteArgs& a) { unpermute(a); });
}

TEST(PermuteErrors, UnpermuteWithSaved) {
  unpermute_checks("unpermute_with_saved", [](const UnpermuteArgs& a) { unpermute_with_saved(a); });
}

TEST(PermuteErrors, UnpermuteGrad) {
  Valid v;
  auto a = v.unpermute_grad_args();
  a.grad_out.dtype = DType::kBF16;
  expect_error([&] { unpermute_grad(a); }, kInvalid,
               {"unpermute_grad: grad_out dtype bf16 must equal permuted_tokens dtype fp32"});
  a = v.unpermute_grad_args();
  a.permuted_tokens = TensorView::contiguous(v.permuted, DType::kF32, {4, 3});
  expect_error([&] { unpermute_grad(a); }, kInvalid,
               {"unpermute_grad: permuted_tokens.shape[1] = 3 must equal 2 (H, "
                "grad_out.shape[1])"});
  a = v.unpermute_grad_args();
  a.probs = TensorView::contiguous(v.probs, DType::kF32, {2, 3});
  expect_error([&] { unpermute_grad(a); }, kInvalid,
               {"unpermute_grad: probs.shape[0] = 2 must equal 3 (N, grad_out.shape[0])"});
  a = v.unpermute_grad_args();
  a.probs = TensorView::contiguous(v.probs, DType::kF32, {3, 1});
  expect_error([&] { unpermute_grad(a); }, kInvalid,
               {"unpermute_grad: sorted_indices.shape[0] = 6 must equal 3 (M = N*topK from "
                "probs.shape (3, 1))"});
  a = v.unpermute_grad_args();
  a.probs.reset();
  expect_error([&] { unpermute_grad(a); }, kInvalid,
               {"unpermute_grad: sorted_indices.shape[0] = 6 must equal 3 (N = "
                "grad_out.shape[0]; topK = 1 without probs)"});
  // Without probs permuted_tokens' data is not needed, only its shape.
  a.sorted_indices = TensorView::contiguous(v.sorted, DType::kI32, {3});
  a.permuted_tokens.data = nullptr;
  EXPECT_NO_THROW(unpermute_grad(a));
  a = v.unpermute_grad_args();
  a.permuted_tokens.data = nullptr;  // with probs it is read
  expect_error([&] { unpermute_grad(a); }, kInvalid,
               {"unpermute_grad: permuted_tokens has 12 elements but data is null"});
  a = v.unpermute_grad_args();
  a.restore_shape = std::vector<int64_t>{2, 3};
  expect_error([&] { unpermute_grad(a); }, kInvalid,
               {"unpermute_grad: restore_shape = [2, 3] must equal [3, 2] (the output shape)"});
  a = v.unpermute_grad_args();
  v.sorted[5] = 0;
  expect_error([&] { unpermute_grad(a); }, kInvalid,
               {"unpermute_grad: sorted_indices[5] = 0 duplicates sorted_indices[0]"});
  v.sorted[5] = 100;
  expect_error([&] { unpermute_grad(a); }, kInvalid,
               {"unpermute_grad: sorted_indices[5] = 100 is outside [0, 6) (max(P, M)"});
}

TEST(PermuteErrors, UnpermuteGradV2) {
  Valid v;
  auto a = v.unpermute_grad_v2_args();
  a.permuted_tokens.reset();
  expect_error([&] { unpermute_grad_v2(a); }, kInvalid,
               {"unpermute_grad_v2: permuted_tokens is missing; it is required when probs is "
                "given"});
  a.probs.reset();  // without probs it is not needed
  a.sorted_indices = TensorView::contiguous(v.sorted, DType::kI32, {3});
  EXPECT_NO_THROW(unpermute_grad_v2(a));
  a = v.unpermute_grad_v2_args();
  a.permuted_rows = -2;
  expect_error([&] { unpermute_grad_v2(a); }, kInvalid,
               {"unpermute_grad_v2: permuted_rows = -2 must be >= 0"});
  a = v.unpermute_grad_v2_args();
  a.permuted_dtype = DType::kBool;
  expect_error([&] { unpermute_grad_v2(a); }, kInvalid,
               {"unpermute_grad_v2: permuted_dtype bool is not one of {bf16, fp16, fp32}"});
  a = v.unpermute_grad_v2_args();
  a.permuted_dtype = DType::kF16;
  expect_error([&] { unpermute_grad_v2(a); }, kInvalid,
               {"unpermute_grad_v2: grad_out dtype fp32 must equal permuted_dtype fp16"});
  a = v.unpermute_grad_v2_args();
  a.permuted_rows = 5;
  expect_error([&] { unpermute_grad_v2(a); }, kInvalid,
               {"unpermute_grad_v2: permuted_tokens.shape[0] = 6 must equal 5 (P, "
                "permuted_rows)"});
  a = v.unpermute_grad_v2_args();
  a.probs = TensorView::contiguous(v.probs, DType::kF32, {1, 6});
  expect_error([&] { unpermute_grad_v2(a); }, kInvalid,
               {"unpermute_grad_v2: probs.shape[0] = 1 must equal 3 (N, grad_out.shape[0])"});
  a = v.unpermute_grad_v2_args();
  a.restore_shape = std::vector<int64_t>{3};
  expect_error([&] { unpermute_grad_v2(a); }, kInvalid,
               {"unpermute_grad_v2: restore_shape = [3] must equal [3, 2]"});
  a = v.unpermute_grad_v2_args();
  v.sorted[2] = 0;
  expect_error([&] { unpermute_grad_v2(a); }, kInvalid,
               {"unpermute_grad_v2: sorted_indices[2] = 0 duplicates sorted_indices[0]"});
  v.sorted[2] = 6;
  expect_error([&] { unpermute_grad_v2(a); }, kInvalid,
               {"unpermute_grad_v2: sorted_indices[2] = 6 is outside [0, 6) (max(P, M), P = "
                "permuted_rows)"});
}

}  // namespace
}  // namespace moe_ep
