// Inputs the libFuzzer targets (tests/fuzz) found to crash or to reach undefined behaviour, as
// tests of the fixed behaviour: each names the target and the report. The crashing inputs are
// in tests/fuzz/corpus/<target>/ too (finding-*), so the fuzzers replay them on every run.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>

#include "moe_ep/error.h"
#include "moe_ep/permute.h"
#include "moe_ep/tensor.h"

namespace moe_ep {
namespace {

// The message of the moe_ep::Error f throws (kInvalidArgument), or a failure.
std::string invalid_argument(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

TensorView view(DType dtype, std::initializer_list<int64_t> shape, void* data = nullptr) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = shape.begin()[d];
    v.strides[d] = stride;
    if (v.shape[d] > 0 && v.shape[d] < (int64_t{1} << 31)) stride *= v.shape[d];
  }
  return v;
}

// fuzz_local_ops, UBSan "signed integer overflow: 4140026316437061631 * 4" in TensorView::numel
// (via expect_memory): a padded unpermute's permuted_tokens whose element count overflows int64.
TEST(FuzzFindings, UnpermutePaddedRefusesAShapeWhoseSizeOverflows) {
  int32_t si[1] = {0};
  UnpermuteArgs a;
  a.padded_mode = true;
  a.permuted_tokens = view(DType::kF32, {4140026316437061631, 4});
  a.sorted_indices = view(DType::kI32, {1}, si);
  a.restore_shape = std::vector<int64_t>{1, 4};
  EXPECT_EQ(invalid_argument([&] { unpermute(a); }),
            "unpermute: permuted_tokens.shape = [4140026316437061631, 4] fp32 exceeds 2^63 bytes "
            "(the sizes other than 0 count)");
  a.padded_mode = false;  // the same check without padded_mode
  a.restore_shape.reset();
  EXPECT_NE(invalid_argument([&] { unpermute(a); }).find("exceeds 2^63 bytes"), std::string::npos);
}

// fuzz_local_ops, UBSan "signed integer overflow: 7310868735955319296 * 2" in permute_rows: tokens
// with no rows but a row of more than 2^63 bytes passed validation, and the kernel computed the
// row's bytes.
TEST(FuzzFindings, PermuteRefusesAnEmptyTokensWithAnImpossibleRow) {
  PermuteArgs a;
  a.tokens = view(DType::kBF16, {0, 7310868735955319296});
  a.indices = view(DType::kI32, {0, 1});
  EXPECT_EQ(invalid_argument([&] { permute(a); }),
            "permute: tokens.shape = [0, 7310868735955319296] bf16 exceeds 2^63 bytes (the sizes "
            "other than 0 count)");
  a.tokens = view(DType::kBF16, {0, 8});  // an empty tokens with a real row is fine
  const PermuteResult r = permute(a);
  EXPECT_EQ(r.permuted_tokens.size(0), 0);
  EXPECT_EQ(r.permuted_tokens.size(1), 8);
}

// fuzz_local_ops, UBSan "applying non-zero offset 8 to null pointer" in row_ptr (via
// unpermute_grad_rows): permuted_tokens with rows of H = 0 elements has no data, and its rows
// were addressed from null. The gradients of empty rows: grad_probs +0, grad_permuted (P, 0).
TEST(FuzzFindings, UnpermuteGradOfRowsWithoutElements) {
  int32_t si[2] = {1, 0};
  float probs[2] = {0.5f, 2.0f};
  UnpermuteGradArgs a;
  a.permuted_tokens = view(DType::kF32, {2, 0});
  a.permuted_tokens.strides = {1, 1};  // torch.empty(2, 0)'s strides
  a.grad_out = view(DType::kF32, {1, 0});
  a.sorted_indices = view(DType::kI32, {2}, si);
  a.probs = view(DType::kF32, {1, 2}, probs);
  const UnpermuteGradResult r = unpermute_grad(a);
  EXPECT_EQ(r.grad_permuted_tokens.size(0), 2);
  EXPECT_EQ(r.grad_permuted_tokens.size(1), 0);
  ASSERT_EQ(r.grad_probs.numel(), 2);
  EXPECT_EQ(r.grad_probs.ptr<float>()[0], 0.0f);
  EXPECT_EQ(r.grad_probs.ptr<float>()[1], 0.0f);
  UnpermuteGradV2Args b;  // the same through the sizes-only variant
  b.grad_out = a.grad_out;
  b.sorted_indices = a.sorted_indices;
  b.permuted_rows = 2;
  b.permuted_dtype = DType::kF32;
  b.probs = a.probs;
  b.permuted_tokens = a.permuted_tokens;
  EXPECT_EQ(unpermute_grad_v2(b).grad_probs.ptr<float>()[1], 0.0f);
}

// fuzz_local_ops, ASan "out of memory: allocator is trying to allocate 0x200000000 bytes" in
// unpermute_grad_rows: with N = 0 tokens, topK (probs.shape[1], num_topk, indices.shape[1])
// bounds no data, and topK = 2^31 sized each thread's buffers (8 GiB). The ops now return the
// empty results at once; the same for permute_grad's and unpermute's sums.
TEST(FuzzFindings, NoTokensWithAHugeTopK) {
  constexpr int64_t kTopK = int64_t{1} << 31;
  UnpermuteGradArgs a;
  a.permuted_tokens = view(DType::kF32, {0, 4});
  a.grad_out = view(DType::kF32, {0, 4});
  a.sorted_indices = view(DType::kI32, {0});
  a.probs = view(DType::kF32, {0, kTopK});
  const UnpermuteGradResult g = unpermute_grad(a);
  EXPECT_EQ(g.grad_probs.size(1), kTopK);
  EXPECT_EQ(g.grad_permuted_tokens.size(0), 0);
  UnpermuteArgs u;
  u.permuted_tokens = a.permuted_tokens;
  u.sorted_indices = a.sorted_indices;
  u.probs = a.probs;
  EXPECT_EQ(unpermute(u).size(0), 0);
  PermuteGradV2Args p;
  p.grad_permuted_tokens = a.permuted_tokens;
  p.sorted_indices = a.sorted_indices;
  p.tokens_rows = 0;
  p.tokens_dtype = DType::kF32;
  p.num_topk = kTopK;
  const Tensor grad_tokens = permute_grad_v2(p);
  EXPECT_EQ(grad_tokens.size(0), 0);
  EXPECT_EQ(grad_tokens.size(1), 4);
}

// fuzz_dispatch, UBSan "signed integer overflow: 5142332531317346309 * 2" in combine_v2: a
// size-1 dim may have any stride, but scaled to bytes this one overflowed. Every op's tensor
// checks (expect_memory) refuse a stride of 2^63 bytes or more.
TEST(FuzzFindings, AStrideOfMoreThan2To63BytesIsRefused) {
  uint16_t row[8] = {};
  int32_t ids[1] = {0};
  PermuteArgs a;
  a.tokens = view(DType::kBF16, {1, 8}, row);
  a.tokens.strides[0] = 5142332531317346309;
  a.indices = view(DType::kI32, {1, 1}, ids);
  EXPECT_EQ(invalid_argument([&] { permute(a); }),
            "permute: tokens.stride(0) = 5142332531317346309 bf16 elements exceed 2^63 bytes");
  a.tokens.strides[0] = int64_t{1} << 40;  // any stride of fewer bytes is fine for one row
  EXPECT_EQ(permute(a).permuted_tokens.size(0), 1);
}

// The same overflow in the public TensorView: numel() saturates instead of overflowing, and
// contiguous() refuses such a shape (its strides would overflow).
TEST(FuzzFindings, TensorViewElementCountsDoNotOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(view(DType::kF32, {int64_t{1} << 62, 4}).numel(), kMax);
  EXPECT_EQ(view(DType::kF32, {int64_t{1} << 62, 4, 0}).numel(), 0);
  EXPECT_EQ(view(DType::kF32, {3, 5}).numel(), 15);
  EXPECT_EQ(invalid_argument([] {
              TensorView::contiguous(nullptr, DType::kF32, {int64_t{1} << 62, 4});
            }),
            "TensorView: shape [4611686018427387904, 4] has more than 2^63 - 1 elements");
  const TensorView empty = TensorView::contiguous(nullptr, DType::kF32, {0, int64_t{1} << 61, 2});
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.strides[1], 2);
}

}  // namespace
}  // namespace moe_ep
