// SPEC §4.1's padded_mode (Megatron-LM's capacity layout: indices is a table of token ids, one per
// slot) for all seven permute-family ops. The fast path (src/core/permute_padded.cc) is compared
// bitwise with the naive reference (ref/permute_ref.cc) over dtypes, table shapes and layouts,
// repeated and absent tokens, N = 0 and H = 0; a hand-computed case pins the reference; the bits
// do not depend on the thread count; every argument check names the op, the parameter, the value
// and the bound.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
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

struct Owned {
  Tensor storage;
  TensorView view;
};

// (n, h) random floats; with pad > 0 stride(0) = h + pad and the gaps hold NaN.
Owned random_rows(DType dtype, int64_t n, int64_t h, int64_t pad, Rng& rng) {
  Owned o;
  o.storage = Tensor::empty(dtype, {n, h + pad});
  std::memset(o.storage.data(), 0xff, o.storage.nbytes());
  o.view = o.storage.view();
  o.view.shape[1] = h;
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < h; ++j)
      ref::store(dtype, o.view.data, i * o.view.strides[0] + j, u(rng));
  return o;
}

// A (rows, cols) table (1-D (rows*cols,) when !two_d) of dtype, filled row-major from flat;
// transposed = column-major storage (a strided view).
Owned table(DType dtype, const std::vector<double>& flat, int64_t rows, int64_t cols, bool two_d,
            bool transposed) {
  Owned o;
  if (!two_d) {
    o.storage = Tensor::empty(dtype, {rows * cols});
    o.view = o.storage.view();
  } else if (transposed) {
    o.storage = Tensor::empty(dtype, {cols, rows});
    o.view = TensorView::contiguous(o.storage.data(), dtype, {rows, cols});
    o.view.strides = {1, rows};
  } else {
    o.storage = Tensor::empty(dtype, {rows, cols});
    o.view = o.storage.view();
  }
  for (int64_t p = 0; p < rows * cols; ++p) {
    const int64_t off = two_d ? (p / cols) * o.view.strides[0] + (p % cols) * o.view.strides[1]
                              : p * o.view.strides[0];
    if (dtype == DType::kI64) {
      static_cast<int64_t*>(o.view.data)[off] = static_cast<int64_t>(flat[p]);
    } else if (dtype == DType::kI32) {
      static_cast<int32_t*>(o.view.data)[off] = static_cast<int32_t>(flat[p]);
    } else {
      ref::store(dtype, o.view.data, off, static_cast<float>(flat[p]));
    }
  }
  return o;
}

std::string shape_of(const Tensor& t) {
  std::string s = std::string(dtype_name(t.dtype())) + "[";
  for (int d = 0; d < t.ndim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

::testing::AssertionResult same_bits(const Tensor& fast, const Tensor& expected) {
  if (fast.defined() != expected.defined())
    return ::testing::AssertionFailure() << "defined: fast " << fast.defined();
  if (!fast.defined()) return ::testing::AssertionSuccess();
  if (shape_of(fast) != shape_of(expected))
    return ::testing::AssertionFailure()
           << "shape: fast " << shape_of(fast) << ", expected " << shape_of(expected);
  const std::size_t es = dtype_size(fast.dtype());
  const auto* a = static_cast<const unsigned char*>(fast.data());
  const auto* b = static_cast<const unsigned char*>(expected.data());
  for (int64_t i = 0; i < fast.numel(); ++i)
    if (std::memcmp(a + i * es, b + i * es, es) != 0)
      return ::testing::AssertionFailure()
             << shape_of(fast) << " element " << i << ": fast "
             << ref::load(fast.dtype(), fast.data(), i) << ", expected "
             << ref::load(expected.dtype(), expected.data(), i);
  return ::testing::AssertionSuccess();
}

// A capacity table: e experts x c slots of token ids in [0, n), with repeats (a token in several
// experts' slots, as Megatron's padding fills them) and, for n > 2, tokens no slot holds.
std::vector<double> capacity_ids(int64_t n, int64_t slots, Rng& rng) {
  std::vector<double> ids(static_cast<std::size_t>(slots));
  std::uniform_int_distribution<int64_t> u(0, n > 2 ? n - 2 : n - 1);  // token n-1 often absent
  for (auto& v : ids) v = static_cast<double>(u(rng));
  return ids;
}

struct Case {
  DType dtype = DType::kF32, index_dtype = DType::kI32, probs_dtype = DType::kF32;
  int64_t n = 5, h = 7, e = 3, c = 4;
  bool two_d = true, transposed = false, with_probs = true;
  int64_t pad = 0;
  std::string describe() const {
    return std::string(dtype_name(dtype)) + " ids " + dtype_name(index_dtype) + " probs " +
           (with_probs ? dtype_name(probs_dtype) : "none") + " N=" + std::to_string(n) +
           " H=" + std::to_string(h) + " table " + std::to_string(e) + "x" + std::to_string(c) +
           (two_d ? " 2-D" : " 1-D") + (transposed ? " transposed" : "") +
           " pad=" + std::to_string(pad);
  }
};

// Every op on one case, fast against the reference; returns the outputs (for the thread test).
std::vector<Tensor> run_case(const Case& k, uint64_t seed) {
  SCOPED_TRACE(k.describe());
  Rng rng(seed);
  const int64_t m = k.e * k.c;
  const Owned tokens = random_rows(k.dtype, k.n, k.h, k.pad, rng);
  const Owned ids =
      table(k.index_dtype, k.n > 0 ? capacity_ids(k.n, m, rng) : std::vector<double>(m, 0), k.e,
            k.c, k.two_d, k.transposed);
  std::vector<double> wflat(static_cast<std::size_t>(m));
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  for (auto& v : wflat) v = u(rng);
  const Owned probs = table(k.probs_dtype, wflat, k.e, k.c, k.two_d, k.transposed);
  const std::optional<TensorView> pr =
      k.with_probs ? std::optional<TensorView>(probs.view) : std::nullopt;
  std::vector<Tensor> outs;

  PermuteArgs pa;
  pa.tokens = tokens.view;
  pa.indices = ids.view;
  pa.padded_mode = true;
  const PermuteResult got = permute(pa);
  const ref::PermuteRefResult want = ref::permute_padded(tokens.view, ids.view);
  EXPECT_TRUE(same_bits(got.permuted_tokens, want.permuted_tokens)) << "permute";
  EXPECT_TRUE(same_bits(got.sorted_indices, want.sorted_indices)) << "permute sorted_indices";
  outs.push_back(got.permuted_tokens);

  // The permuted side: fresh values (expert outputs), (M, H), padded rows.
  const Owned y = random_rows(k.dtype, m, k.h, k.pad, rng);
  const Owned g = random_rows(k.dtype, k.n, k.h, k.pad, rng);  // grad_out (N, H)

  PermuteGradArgs pg;
  pg.tokens = tokens.view;
  pg.grad_permuted_tokens = y.view;
  pg.indices = ids.view;
  pg.sorted_indices = got.sorted_indices.view();
  pg.padded_mode = true;
  const Tensor gt = permute_grad(pg);
  EXPECT_TRUE(same_bits(gt, ref::scatter_padded(y.view, ids.view, std::nullopt, k.n, k.dtype)))
      << "permute_grad";
  outs.push_back(gt);
  PermuteGradV2Args pg2;
  pg2.grad_permuted_tokens = y.view;
  pg2.sorted_indices = ids.view;  // the caller's own table works too
  pg2.tokens_rows = k.n;
  pg2.tokens_dtype = k.dtype;
  pg2.num_topk = 1;
  pg2.padded_mode = true;
  EXPECT_TRUE(same_bits(permute_grad_v2(pg2), gt)) << "permute_grad_v2";

  UnpermuteArgs ua;
  ua.permuted_tokens = y.view;
  ua.sorted_indices = ids.view;
  ua.probs = pr;
  ua.padded_mode = true;
  ua.restore_shape = std::vector<int64_t>{k.n, k.h};
  const Tensor out = unpermute(ua);
  EXPECT_TRUE(same_bits(out, ref::scatter_padded(y.view, ids.view, pr, k.n, k.dtype)))
      << "unpermute";
  outs.push_back(out);
  const UnpermuteWithSavedResult saved = unpermute_with_saved(ua);
  EXPECT_TRUE(same_bits(saved.out, out)) << "unpermute_with_saved";
  EXPECT_EQ(shape_of(saved.permuted_tokens_for_backward), shape_of(got.permuted_tokens));

  UnpermuteGradArgs ug;
  ug.permuted_tokens = y.view;
  ug.grad_out = g.view;
  ug.sorted_indices = got.sorted_indices.view();
  ug.probs = pr;
  ug.padded_mode = true;
  const UnpermuteGradResult gr = unpermute_grad(ug);
  const ref::UnpermuteGradRefResult wr =
      ref::unpermute_grad_padded(g.view, ids.view, k.dtype, pr, y.view);
  EXPECT_TRUE(same_bits(gr.grad_permuted_tokens, wr.grad_permuted_tokens)) << "unpermute_grad";
  EXPECT_TRUE(same_bits(gr.grad_probs, wr.grad_probs)) << "unpermute_grad grad_probs";
  outs.push_back(gr.grad_permuted_tokens);
  outs.push_back(gr.grad_probs);
  UnpermuteGradV2Args ug2;
  ug2.grad_out = g.view;
  ug2.sorted_indices = ids.view;
  ug2.permuted_rows = m;
  ug2.permuted_dtype = k.dtype;
  ug2.probs = pr;
  ug2.padded_mode = true;
  ug2.restore_shape = std::vector<int64_t>{k.n, k.h};
  if (k.with_probs) ug2.permuted_tokens = y.view;
  const UnpermuteGradResult gr2 = unpermute_grad_v2(ug2);
  EXPECT_TRUE(same_bits(gr2.grad_permuted_tokens, wr.grad_permuted_tokens)) << "v2";
  EXPECT_TRUE(same_bits(gr2.grad_probs, wr.grad_probs)) << "v2 grad_probs";
  return outs;
}

TEST(PermutePadded, MatchesReferenceOverGrid) {
  uint64_t seed = 1;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16})
    for (DType index_dtype : {DType::kI32, DType::kI64})
      for (bool two_d : {true, false})
        for (bool with_probs : {true, false})
          for (int64_t h : {int64_t{1}, int64_t{7}, int64_t{40}}) {
            Case k;
            k.dtype = dtype;
            k.index_dtype = index_dtype;
            k.probs_dtype = dtype == DType::kF32 ? DType::kBF16 : DType::kF32;
            k.two_d = two_d;
            k.transposed = two_d && h == 7;
            k.with_probs = with_probs;
            k.h = h;
            k.pad = h == 40 ? 3 : 0;
            run_case(k, seed++);
          }
}

TEST(PermutePadded, EdgeSizes) {
  for (int64_t n : {0, 1, 2})
    for (int64_t h : {0, 3})
      for (int64_t c : {0, 2}) {
        Case k;
        k.n = n;
        k.h = h;
        k.c = n == 0 ? 0 : c;  // no tokens: an empty table
        k.e = 2;
        run_case(k, 100 + static_cast<uint64_t>(n * 10 + h + c));
      }
  Case big;  // large enough for several threads and the streaming stores' paths
  big.n = 300;
  big.h = 520;
  big.e = 16;
  big.c = 40;
  run_case(big, 7);
}

TEST(PermutePadded, SameBitsWithOneAndFourThreads) {
  Case k;
  k.n = 200;
  k.h = 300;
  k.e = 8;
  k.c = 50;
  k.dtype = DType::kBF16;
  set_num_threads(1);
  const std::vector<Tensor> one = run_case(k, 9);
  set_num_threads(4);
  const std::vector<Tensor> four = run_case(k, 9);
  set_num_threads(0);
  ASSERT_EQ(one.size(), four.size());
  for (std::size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(same_bits(four[i], one[i])) << i;
}

// Hand-computed: 3 tokens, 2 experts x 2 slots holding tokens [[0, 2], [2, 1]], weights
// [[0.5, 1], [2, 0.25]].
TEST(PermutePadded, HandComputed) {
  float tokens[6] = {1, 2, 3, 4, 5, 6};
  int64_t ids[4] = {0, 2, 2, 1};
  float w[4] = {0.5f, 1, 2, 0.25f};
  PermuteArgs pa;
  pa.tokens = TensorView::contiguous(tokens, DType::kF32, {3, 2});
  pa.indices = TensorView::contiguous(ids, DType::kI64, {2, 2});
  pa.padded_mode = true;
  const PermuteResult p = permute(pa);
  EXPECT_EQ(std::vector<float>(p.permuted_tokens.ptr<float>(), p.permuted_tokens.ptr<float>() + 8),
            (std::vector<float>{1, 2, 5, 6, 5, 6, 3, 4}));
  // sorted_indices = indices, as Megatron-LM's permute_with_padded_tokens: 2-D (E, capacity)
  EXPECT_EQ(shape_of(p.sorted_indices), "int32[2, 2]");
  EXPECT_EQ(
      std::vector<int32_t>(p.sorted_indices.ptr<int32_t>(), p.sorted_indices.ptr<int32_t>() + 4),
      (std::vector<int32_t>{0, 2, 2, 1}));
  UnpermuteArgs ua;
  ua.permuted_tokens = p.permuted_tokens.view();
  ua.sorted_indices = p.sorted_indices.view();
  ua.probs = TensorView::contiguous(w, DType::kF32, {2, 2});
  ua.padded_mode = true;
  ua.restore_shape = std::vector<int64_t>{3, 2};
  const Tensor out = unpermute(ua);
  // token 0: 0.5*[1,2]; token 1: 0.25*[3,4]; token 2: 1*[5,6] + 2*[5,6]
  EXPECT_EQ(std::vector<float>(out.ptr<float>(), out.ptr<float>() + 6),
            (std::vector<float>{0.5f, 1, 0.75f, 1, 15, 18}));
  float grad_out[6] = {1, 0, 0, 1, 2, 2};
  UnpermuteGradArgs ug;
  ug.permuted_tokens = p.permuted_tokens.view();
  ug.grad_out = TensorView::contiguous(grad_out, DType::kF32, {3, 2});
  ug.sorted_indices = p.sorted_indices.view();
  ug.probs = ua.probs;
  ug.padded_mode = true;
  const UnpermuteGradResult g = unpermute_grad(ug);
  // grad_permuted[p] = w[p] * grad_out[ids[p]]; grad_probs[p] = dot(grad_out[ids[p]], permuted[p])
  EXPECT_EQ(std::vector<float>(g.grad_permuted_tokens.ptr<float>(),
                               g.grad_permuted_tokens.ptr<float>() + 8),
            (std::vector<float>{0.5f, 0, 2, 2, 4, 4, 0, 0.25f}));
  EXPECT_EQ(shape_of(g.grad_probs), "fp32[2, 2]");
  EXPECT_EQ(std::vector<float>(g.grad_probs.ptr<float>(), g.grad_probs.ptr<float>() + 4),
            (std::vector<float>{1, 22, 22, 4}));
  PermuteGradArgs pg;
  pg.tokens = pa.tokens;
  pg.grad_permuted_tokens = g.grad_permuted_tokens.view();
  pg.indices = pa.indices;
  pg.sorted_indices = p.sorted_indices.view();
  pg.padded_mode = true;
  const Tensor gt = permute_grad(pg);  // token 0: slot 0; token 1: slot 3; token 2: slots 1, 2
  EXPECT_EQ(std::vector<float>(gt.ptr<float>(), gt.ptr<float>() + 6),
            (std::vector<float>{0.5f, 0, 0, 0.25f, 6, 6}));
}

void expect_error(const std::function<void()>& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << *parts.begin() << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    for (const std::string& part : parts)
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "'" << part << "' missing from: " << e.what();
  }
}

TEST(PermutePaddedErrors, NameTheOpParameterValueAndBound) {
  float tokens[6] = {1, 2, 3, 4, 5, 6};  // (3, 2)
  int32_t ids[4] = {0, 2, 3, 1};         // [1,0] = 3 is out of range
  float rows[8] = {};                    // (4, 2)
  float w[4] = {1, 1, 1, 1};
  const TensorView t = TensorView::contiguous(tokens, DType::kF32, {3, 2});
  const TensorView bad_ids = TensorView::contiguous(ids, DType::kI32, {2, 2});
  PermuteArgs pa;
  pa.tokens = t;
  pa.indices = bad_ids;
  pa.padded_mode = true;
  expect_error([&] { permute(pa); },
               {"permute: indices[1,0] = 3 is outside [0, 3) (token ids, N = tokens.shape[0]"});
  ids[2] = 2;
  pa.num_out_tokens = 3;
  expect_error([&] { permute(pa); }, {"permute: num_out_tokens = 3 must be None, 0 or 4"});
  pa.num_out_tokens = 4;
  const PermuteResult p = permute(pa);

  UnpermuteArgs ua;
  ua.permuted_tokens = TensorView::contiguous(rows, DType::kF32, {4, 2});
  ua.sorted_indices = p.sorted_indices.view();
  ua.padded_mode = true;
  expect_error([&] { unpermute(ua); }, {"unpermute: restore_shape is missing"});
  ua.restore_shape = std::vector<int64_t>{3, 5};
  expect_error([&] { unpermute(ua); }, {"unpermute: restore_shape = [3, 5] must be [N, 2]"});
  ua.restore_shape = std::vector<int64_t>{2, 2};
  expect_error(
      [&] { unpermute_with_saved(ua); },
      {"unpermute_with_saved: sorted_indices[0,1] = 2 is outside [0, 2)", "N = restore_shape[0]"});
  ua.restore_shape = std::vector<int64_t>{3, 2};
  ua.probs = TensorView::contiguous(w, DType::kF32, {3});
  expect_error([&] { unpermute(ua); }, {"unpermute: probs has 3 entries, must equal 4"});
  ua.probs = std::nullopt;
  ua.permuted_tokens = TensorView::contiguous(rows, DType::kF32, {3, 2});
  expect_error([&] { unpermute(ua); },
               {"unpermute: permuted_tokens.shape[0] = 3 must equal 4", "one row per slot"});

  PermuteGradArgs pg;
  pg.tokens = t;
  pg.grad_permuted_tokens = TensorView::contiguous(rows, DType::kF32, {4, 2});
  pg.indices = bad_ids;
  int32_t other[4] = {0, 2, 2, 0};
  pg.sorted_indices = TensorView::contiguous(other, DType::kI32, {4});
  pg.padded_mode = true;
  expect_error([&] { permute_grad(pg); },
               {"permute_grad: sorted_indices[3] = 0 differs from indices[1,1] = 1"});
  PermuteGradV2Args pg2;
  pg2.grad_permuted_tokens = TensorView::contiguous(rows, DType::kF32, {3, 2});
  pg2.sorted_indices = p.sorted_indices.view();
  pg2.tokens_rows = 3;
  pg2.tokens_dtype = DType::kF32;
  pg2.padded_mode = true;
  expect_error([&] { permute_grad_v2(pg2); },
               {"permute_grad_v2: grad_permuted_tokens.shape[0] = 3 must equal 4"});

  float grad_out[6] = {};
  UnpermuteGradV2Args ug2;
  ug2.grad_out = TensorView::contiguous(grad_out, DType::kF32, {3, 2});
  ug2.sorted_indices = p.sorted_indices.view();
  ug2.permuted_rows = 4;
  ug2.permuted_dtype = DType::kF32;
  ug2.padded_mode = true;
  ug2.restore_shape = std::vector<int64_t>{2, 2};
  expect_error([&] { unpermute_grad_v2(ug2); },
               {"unpermute_grad_v2: restore_shape[0] = 2 must equal N = 3"});
  ug2.restore_shape = std::nullopt;
  ug2.probs = TensorView::contiguous(w, DType::kF32, {4});
  expect_error([&] { unpermute_grad_v2(ug2); }, {"unpermute_grad_v2: permuted_tokens is missing"});
  UnpermuteGradArgs ug;
  ug.permuted_tokens = TensorView::contiguous(rows, DType::kF32, {4, 2});
  ug.grad_out = TensorView::contiguous(grad_out, DType::kF32, {2, 2});
  ug.sorted_indices = p.sorted_indices.view();
  ug.padded_mode = true;
  expect_error(
      [&] { unpermute_grad(ug); },
      {"unpermute_grad: sorted_indices[0,1] = 2 is outside [0, 2)", "N = grad_out.shape[0]"});
  int32_t three_d[1] = {0};
  ug.sorted_indices = TensorView::contiguous(three_d, DType::kI32, {1, 1, 1});
  expect_error([&] { unpermute_grad(ug); },
               {"unpermute_grad: sorted_indices.ndim = 3 must be 1 or 2"});
}

}  // namespace
}  // namespace moe_ep
