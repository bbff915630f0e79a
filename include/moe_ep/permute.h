// Local token permute / unpermute and their gradients: SPEC §4 (torch_npu npu_moe_token_permute,
// npu_moe_token_unpermute, _npu_moe_token_unpermute and their backward ops).
//
// Common rules for every op below:
// - Token-like tensors (tokens, permuted_tokens, grad_*) are 2-D (rows, H), dtype bf16, fp16 or
//   fp32. Their rows may be strided (stride(0) >= H, any value) but each row must be contiguous
//   (stride(1) == 1). N = 0 rows is valid.
// - Index tensors are int32 or int64 with any strides. sorted_indices is 1-D (M,) int32.
// - probs is (N, topK) bf16, fp16 or fp32, any strides; grad_probs comes back in probs' dtype.
// - All sums are accumulated in fp32 in the order the SPEC states and rounded once to nearest
//   even in the output dtype, so results do not depend on the thread count.
// - Row offsets are 64-bit: rows * H may exceed 2^31.
// - Outputs are freshly allocated, contiguous, owned by the returned Tensor.
// - padded_mode = true raises Error(kUnsupported) (SPEC §4.1 marks it Megatron-only).
// - Bad input raises Error(kInvalidArgument) naming the op, the parameter, the value and the bound;
//   e.g. "permute: indices[2,0] = -1 is outside [0, 2^31)". docs/errors.md lists each check.
// - Work is split across OpenMP threads (OMP_NUM_THREADS).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "moe_ep/export.h"
#include "moe_ep/tensor.h"

namespace moe_ep {

// SPEC §4.1.
struct PermuteArgs {
  TensorView tokens;   // [in] (N, H) bf16/fp16/fp32
  TensorView indices;  // [in] (N,) or (N, topK) int32/int64, values >= 0 (expert ids)
  // [in] None or 0 keeps all M = N*topK rows; n > 0 keeps min(n, M); n < 0 drops |n| rows
  // (n < -M is an error). Dropped rows are the tail of the sorted order (highest expert ids).
  std::optional<int64_t> num_out_tokens;
  bool padded_mode = false;
};
struct PermuteResult {
  Tensor permuted_tokens;  // (rows, H), tokens' dtype: permuted[p] = tokens[order[p] / topK]
  Tensor sorted_indices;   // (M,) int32: row of permuted_tokens holding entry j; >= rows if dropped
};
MOE_EP_API PermuteResult permute(const PermuteArgs& args);

// SPEC §4.3: grad_tokens[i] = sum over k (in k order) of grad_permuted[S[i*topK+k]], entries with
// S >= R (rows of grad_permuted) skipped.
struct PermuteGradArgs {
  TensorView tokens;                // [in] (N, H); only its shape and dtype are used
  TensorView grad_permuted_tokens;  // [in] (R, H), tokens' dtype
  TensorView indices;               // [in] (N,) or (N, topK): gives topK
  TensorView sorted_indices;        // [in] (N*topK,) int32, from permute
  bool padded_mode = false;
};
MOE_EP_API Tensor permute_grad(const PermuteGradArgs& args);  // (N, H) in tokens' dtype

// SPEC §4.3, sizes instead of tensors.
struct PermuteGradV2Args {
  TensorView grad_permuted_tokens;  // [in] (R, H) bf16/fp16/fp32
  TensorView sorted_indices;        // [in] (tokens_rows*num_topk,) int32
  int64_t tokens_rows = 0;          // [in] N >= 0
  DType tokens_dtype = DType::kBF16;  // [in] dtype of grad_tokens: bf16/fp16/fp32
  int64_t num_topk = 1;             // [in] topK >= 1
  bool padded_mode = false;
};
MOE_EP_API Tensor permute_grad_v2(const PermuteGradV2Args& args);  // (N, H)

// SPEC §4.2: out[i] = sum_{k, S[i*topK+k] < P} probs[i,k] * permuted[S[i*topK+k]] (fp32, k order).
// Without probs topK = 1 and out has M rows (pure gather).
struct UnpermuteArgs {
  TensorView permuted_tokens;  // [in] (P, H) bf16/fp16/fp32
  TensorView sorted_indices;   // [in] (M,) int32, distinct values >= 0
  std::optional<TensorView> probs;  // [in] optional (N, topK) float, N*topK == M
  bool padded_mode = false;
  // [in] optional; when given it must equal the output's shape {N, H} (it only matters for the
  // unsupported padded mode).
  std::optional<std::vector<int64_t>> restore_shape;
};
MOE_EP_API Tensor unpermute(const UnpermuteArgs& args);  // (N, H), permuted_tokens' dtype

struct UnpermuteWithSavedResult {
  Tensor out;                           // as unpermute
  Tensor permuted_tokens_for_backward;  // a contiguous copy of permuted_tokens
};
MOE_EP_API UnpermuteWithSavedResult unpermute_with_saved(const UnpermuteArgs& args);

// SPEC §4.3.
struct UnpermuteGradArgs {
  TensorView permuted_tokens;  // [in] (P, H): needed for grad_probs; only P is used without probs
  TensorView grad_out;         // [in] (N, H), permuted_tokens' dtype
  TensorView sorted_indices;   // [in] (M,) int32
  std::optional<TensorView> probs;  // [in] optional (N, topK)
  bool padded_mode = false;
  std::optional<std::vector<int64_t>> restore_shape;  // as UnpermuteArgs
};
struct UnpermuteGradResult {
  // (P, H): grad_permuted[S[j]] = grad_out[j / topK] * probs[j / topK, j % topK] (fp32 product,
  // one rounding); rows nothing refers to are 0.
  Tensor grad_permuted_tokens;
  // (N, topK) in probs' dtype: dot(grad_out[i], permuted[S[i*topK+k]]) in fp32, 0 for dropped
  // entries. Undefined (defined() == false) when probs is absent.
  Tensor grad_probs;
};
MOE_EP_API UnpermuteGradResult unpermute_grad(const UnpermuteGradArgs& args);

// SPEC §4.3, sizes instead of tensors: permuted_tokens is needed only when probs is given.
struct UnpermuteGradV2Args {
  TensorView grad_out;        // [in] (N, H) bf16/fp16/fp32
  TensorView sorted_indices;  // [in] (M,) int32
  int64_t permuted_rows = 0;  // [in] P >= 0
  DType permuted_dtype = DType::kBF16;  // [in] dtype of grad_permuted_tokens
  std::optional<TensorView> probs;      // [in] optional (N, topK)
  bool padded_mode = false;
  std::optional<std::vector<int64_t>> restore_shape;
  std::optional<TensorView> permuted_tokens;  // [in] (P, H); required when probs is given
};
MOE_EP_API UnpermuteGradResult unpermute_grad_v2(const UnpermuteGradV2Args& args);

}  // namespace moe_ep
