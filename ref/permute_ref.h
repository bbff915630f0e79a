// Naive reference for SPEC §4 (token permute / unpermute and their gradients): the test oracle.
//
// Written straight from the SPEC formulas for clarity, never optimised, independent of src/ (it
// loads and rounds through ref/numeric.h). Inputs are assumed valid: no argument checks.
// Sums follow the SPEC: fp32, in k (or h) order, each product rounded to fp32 before it is added,
// the first present term starting the sum (the empty sum is +0), one rounding to the output dtype.
#pragma once

#include <cstdint>
#include <optional>

#include "moe_ep/tensor.h"

namespace moe_ep::ref {

struct PermuteRefResult {
  Tensor permuted_tokens;  // (rows, H), tokens' dtype
  Tensor sorted_indices;   // (M,) int32
};
// tokens (N, H); indices (N,) or (N, topK) int32/int64; any strides.
PermuteRefResult permute(const TensorView& tokens, const TensorView& indices,
                         std::optional<int64_t> num_out_tokens);

// grad_tokens (tokens_rows, H) in tokens_dtype; topK = num_topk.
Tensor permute_grad(const TensorView& grad_permuted_tokens, const TensorView& sorted_indices,
                    int64_t tokens_rows, int64_t num_topk, DType tokens_dtype);

// out (N, H) (N = M without probs), permuted_tokens' dtype.
Tensor unpermute(const TensorView& permuted_tokens, const TensorView& sorted_indices,
                 const std::optional<TensorView>& probs);

struct UnpermuteGradRefResult {
  Tensor grad_permuted_tokens;  // (permuted_rows, H) in permuted_dtype
  Tensor grad_probs;            // (N, topK) in probs' dtype; undefined without probs
};
// permuted_tokens is read only when probs is given.
UnpermuteGradRefResult unpermute_grad(const TensorView& grad_out, const TensorView& sorted_indices,
                                      int64_t permuted_rows, DType permuted_dtype,
                                      const std::optional<TensorView>& probs,
                                      const std::optional<TensorView>& permuted_tokens);

// padded_mode (SPEC §4.1): `table` holds token ids (int32/int64, 1-D or 2-D, read row-major:
// slot p is its p-th entry); probs, when given, one weight per slot in the same order.
// permuted[p] = tokens[table.flat[p]]; sorted_indices = the table in its own shape, int32.
PermuteRefResult permute_padded(const TensorView& tokens, const TensorView& table);
// out (n, H) in out_dtype: out[t] = sum over the slots p with table.flat[p] == t, in increasing
// p, of probs.flat[p] * src[p] (unweighted without probs). unpermute and permute_grad alike.
Tensor scatter_padded(const TensorView& src, const TensorView& table,
                      const std::optional<TensorView>& probs, int64_t n, DType out_dtype);
// grad_permuted (M, H) in permuted_dtype: probs.flat[p] * grad_out[table.flat[p]] (a copy
// without probs); grad_probs in probs' shape: dot(grad_out[table.flat[p]], permuted[p]).
UnpermuteGradRefResult unpermute_grad_padded(const TensorView& grad_out, const TensorView& table,
                                             DType permuted_dtype,
                                             const std::optional<TensorView>& probs,
                                             const std::optional<TensorView>& permuted_tokens);

}  // namespace moe_ep::ref
