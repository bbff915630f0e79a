// Local token permute / unpermute and their gradients: SPEC §4 (torch_npu npu_moe_token_permute,
// npu_moe_token_unpermute, _npu_moe_token_unpermute and their backward ops).
//
// Common rules for every op below:
// - Token-like tensors (tokens, permuted_tokens, grad_*) are 2-D (rows, H), dtype bf16, fp16 or
//   fp32. Their rows may be strided (any stride(0) >= 0, even 0 or overlapping) but each row must
//   be contiguous (stride(1) == 1). N = 0 rows is valid.
// - Index tensors are int32 or int64 with any strides. sorted_indices is 1-D (M,) int32 with any
//   stride; each value must lie in [0, max(rows, M)) where rows is the row count of the permuted
//   tensor (P or R): values >= rows are dropped entries. The unpermute family requires the values
//   to be distinct (checked with an O(M) bitmap, always on); permute_grad allows repeats.
// - topK >= 1 (indices.shape[1], probs.shape[1], num_topk); M = N*topK may not exceed 2^31.
// - probs is (N, topK) bf16, fp16 or fp32, any strides; grad_probs comes back in probs' dtype.
// - Sums over k are accumulated in fp32 in the order the SPEC states: the first present term starts
//   the sum (the empty sum is +0, a single term is returned unchanged), each product is rounded
//   to fp32 before it is added (no FMA), and the sum is rounded once to nearest even in the output
//   dtype, so results do not depend on the thread count.
// - grad_probs' dot products (unpermute_grad, unpermute_grad_v2) are the one sum along H. SPEC
//   §4.3 asks only for fp32; moe-ep fixes an order made for SIMD, the same on every CPU target and
//   in ref/ and python/tests/reference.py, so they too are deterministic and bitwise reproducible:
//   16 partial sums, lane l (0..15) summing from +0, in increasing h, the fp32 products
//   grad_out[i,h] * permuted[s,h] (each rounded to fp32, no FMA) for h = l, l+16, l+32, ... < H;
//   then acc[l] = acc[l] + acc[l+w] for l < w, for w = 8, 4, 2, 1; the dot product is acc[0]
//   (+0 for H = 0). Earlier moe-ep summed in plain h order, which vectors cannot follow and which
//   kept unpermute_grad at about a third of memcpy's bandwidth (docs/performance.md).
// - Gradient inputs have the dtype of the tensor whose gradient they are (grad_permuted_tokens:
//   tokens'; grad_out: permuted_tokens'); the _v2 dtype arguments must agree with them.
// - Row offsets are 64-bit: rows * H may exceed 2^31.
// - Outputs are freshly allocated, contiguous, owned by the returned Tensor.
// - padded_mode = true (SPEC §4.1; Megatron-LM's capacity layout, which Ascend's kernel lacks):
//   indices is a table of token ids, one per capacity slot, int32/int64, 1-D or 2-D (typically
//   (num_experts, capacity)), every id in [0, N); M = its entry count, taken in row-major order.
//   permute gathers permuted[p] = tokens[indices.flat[p]] (M rows, none dropped: num_out_tokens
//   must be None, 0 or M) and returns sorted_indices = indices: the table in its own shape
//   ((num_experts, capacity) for a 2-D table, as Megatron-LM's permute_with_padded_tokens
//   returns it; (M,) for a 1-D one), int32. In every other op sorted_indices is that table
//   (int32/int64, 1-D or 2-D: permute's 2-D output or the same entries flattened; values in
//   [0, N), repeats allowed),
//   the permuted side has exactly M rows, and probs, when given, holds one weight per slot (M
//   entries, 1-D or 2-D; grad_probs comes back in its shape). unpermute needs restore_shape =
//   [N, H] (N is the output rows) and sums out[t] = sum over the slots p holding t, in increasing
//   p, of probs.flat[p] * permuted[p] (fp32 as below; 0 for a token no slot holds);
//   permute_grad is the same sum unweighted; unpermute_grad gives grad_permuted[p] =
//   probs.flat[p] * grad_out[S[p]] and grad_probs.flat[p] = dot(grad_out[S[p]], permuted[p]).
//   permute_grad checks that sorted_indices holds indices' entries (row-major order, either
//   shape); num_topk is unused.
// - Bad input raises Error(kInvalidArgument) naming the op, the parameter, the value and the bound;
//   e.g. "permute: indices[2,0] = -1 is outside [0, 2147483648)". docs/errors.md lists each
//   check.
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
  TensorView indices;  // [in] (N,) or (N, topK) int32/int64, expert ids in [0, 2^31)
  // [in] None or 0 keeps all M = N*topK rows; n > 0 keeps min(n, M); n < 0 drops |n| rows
  // (n < -M is an error). Dropped rows are the tail of the sorted order (highest expert ids).
  std::optional<int64_t> num_out_tokens;
  bool padded_mode = false;
};
struct PermuteResult {
  Tensor permuted_tokens;  // (rows, H), tokens' dtype: permuted[p] = tokens[order[p] / topK]
  Tensor sorted_indices;   // (M,) int32: row of permuted_tokens holding entry j; >= rows if dropped
                           // (padded_mode: indices' entries in indices' shape, int32)
};
MOE_EP_API PermuteResult permute(const PermuteArgs& args);

// SPEC §4.3: grad_tokens[i] = sum over k (in k order) of grad_permuted[S[i*topK+k]], entries with
// S >= R (rows of grad_permuted) skipped.
struct PermuteGradArgs {
  TensorView tokens;                // [in] (N, H); only its shape and dtype are used
  TensorView grad_permuted_tokens;  // [in] (R, H), tokens' dtype
  TensorView indices;               // [in] (N,) or (N, topK): gives topK
  TensorView sorted_indices;        // [in] (N*topK,) int32, from permute; in [0, max(R, M))
  bool padded_mode = false;
};
MOE_EP_API Tensor permute_grad(const PermuteGradArgs& args);  // (N, H) in tokens' dtype

// SPEC §4.3, sizes instead of tensors.
struct PermuteGradV2Args {
  TensorView grad_permuted_tokens;    // [in] (R, H) bf16/fp16/fp32, tokens_dtype
  TensorView sorted_indices;          // [in] (tokens_rows*num_topk,) int32, in [0, max(R, M))
  int64_t tokens_rows = 0;            // [in] N >= 0
  DType tokens_dtype = DType::kBF16;  // [in] dtype of grad_tokens: bf16/fp16/fp32
  int64_t num_topk = 1;               // [in] topK >= 1
  bool padded_mode = false;
};
MOE_EP_API Tensor permute_grad_v2(const PermuteGradV2Args& args);  // (N, H)

// SPEC §4.2: out[i] = sum_{k, S[i*topK+k] < P} probs[i,k] * permuted[S[i*topK+k]] (fp32, k order).
// Without probs topK = 1 and out has M rows (pure gather: bit copies; rows of dropped entries
// are 0).
struct UnpermuteArgs {
  TensorView permuted_tokens;       // [in] (P, H) bf16/fp16/fp32
  TensorView sorted_indices;        // [in] (M,) int32, distinct values in [0, max(P, M))
  std::optional<TensorView> probs;  // [in] optional (N, topK) float, N*topK == M
  bool padded_mode = false;
  // [in] the output's shape {N, H}: optional (and then checked) without padded_mode, required
  // with it (it alone gives N).
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
  // [in] (P, H): read for grad_probs; without probs only its shape and dtype are used (data may
  // be null).
  TensorView permuted_tokens;
  TensorView grad_out;              // [in] (N, H), permuted_tokens' dtype
  TensorView sorted_indices;        // [in] (M,) int32, distinct; M = N*topK (N without probs)
  std::optional<TensorView> probs;  // [in] optional (N, topK)
  bool padded_mode = false;
  std::optional<std::vector<int64_t>> restore_shape;  // as UnpermuteArgs: must equal {N, H}
};
struct UnpermuteGradResult {
  // (P, H): grad_permuted[S[j]] = grad_out[j / topK] * probs[j / topK, j % topK] (fp32 product,
  // one rounding; without probs a bit copy of grad_out[j]); rows nothing refers to are 0.
  Tensor grad_permuted_tokens;
  // (N, topK) in probs' dtype: dot(grad_out[i], permuted[S[i*topK+k]]) in fp32, in the blocked
  // order of the common rules above (16 lanes, then a tree), 0 for dropped entries. Undefined
  // (defined() == false) when probs is absent.
  Tensor grad_probs;
};
MOE_EP_API UnpermuteGradResult unpermute_grad(const UnpermuteGradArgs& args);

// SPEC §4.3, sizes instead of tensors: permuted_tokens is needed only when probs is given.
struct UnpermuteGradV2Args {
  TensorView grad_out;                  // [in] (N, H) bf16/fp16/fp32, permuted_dtype
  TensorView sorted_indices;            // [in] (M,) int32, as UnpermuteGradArgs
  int64_t permuted_rows = 0;            // [in] P >= 0
  DType permuted_dtype = DType::kBF16;  // [in] dtype of grad_permuted_tokens
  std::optional<TensorView> probs;      // [in] optional (N, topK)
  bool padded_mode = false;
  std::optional<std::vector<int64_t>> restore_shape;  // as UnpermuteArgs: must equal {N, H}
  // [in] (P, H) in permuted_dtype; required when probs is given, checked when present.
  std::optional<TensorView> permuted_tokens;
};
MOE_EP_API UnpermuteGradResult unpermute_grad_v2(const UnpermuteGradV2Args& args);

}  // namespace moe_ep
