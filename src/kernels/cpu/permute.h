// Internal: the row kernels of SPEC §4 (token permute / unpermute and their gradients), on inputs
// src/core/permute.cc has validated.
//
// Every kernel is a gather or a scatter of whole rows, parallel over output rows (or tokens) with
// OpenMP. Each output element is written by exactly one iteration and every reduction runs in the
// SPEC's k (or h) order inside that iteration, so the bits never depend on the thread count.
// Reductions: the first present term starts the fp32 accumulator (the empty sum is +0), each
// product is rounded to fp32 before it is added (-ffp-contract=off), and the result is rounded
// once to the output dtype.
#pragma once

#include <cstdint>
#include <vector>

#include "moe_ep/permute.h"
#include "moe_ep/tensor.h"

namespace moe_ep::detail {

// Loops over fewer elements (or bytes, for copies) than this run on the calling thread: an
// OpenMP parallel region costs microseconds even with libgomp's thread pool, more than such a
// loop takes alone.
constexpr int64_t kParallelMinWork = int64_t{1} << 16;
// Outputs of at least this many bytes are written with non-temporal stores (copy_row, sum_rows
// and scale_row_f32 with stream = true): far larger than the caches, they would only evict the
// inputs, and an ordinary store first reads each destination line.
constexpr int64_t kStreamMinBytes = int64_t{32} << 20;

// Element j of sorted_indices (int32, 1-D, any stride).
inline int64_t sorted_at(const TensorView& si, int64_t j) {
  return static_cast<const int32_t*>(si.data)[j * si.strides[0]];
}

inline bool bit_set(const std::vector<uint64_t>& bits, int64_t i) {
  return (bits[static_cast<std::size_t>(i >> 6)] >> (i & 63)) & 1u;
}

// permute's outputs (SPEC §4.1) from the stable order of the m entries: si[order[pos]] = pos for
// pos < m, and out[pos] = tokens[order[pos] / topk] for pos < rows (out contiguous, rows x H).
void permute_rows(int32_t* si, char* out, const TensorView& tokens, const int32_t* order, int64_t m,
                  int64_t rows, int64_t topk);

// unpermute (SPEC §4.2) into contiguous `out` (n, H = src.shape[1] > 0):
//   probs given: out[i] = sum over k (k order) of probs[i,k] * src[S[i*topk+k]] for the entries
//                with S < src.shape[0];
//   probs null:  out[i] = src[S[i]] (bit copies; zeros when S[i] >= src.shape[0]), topk == 1.
void unpermute_rows(char* out, const TensorView& src, const TensorView& si, int64_t n, int64_t topk,
                    const TensorView* probs);
// permute_grad (SPEC §4.3): out[i] = sum over k of grad[S[i*topk+k]] for S < grad.shape[0], into
// contiguous `out` (n, H) of out_dtype.
void permute_grad_rows(char* out, DType out_dtype, const TensorView& grad, const TensorView& si,
                       int64_t n, int64_t topk);
// dst (contiguous, src's shape) = src, row by row.
void copy_rows(char* dst, const TensorView& src);

// padded_mode (SPEC §4.1, Megatron-LM's capacity layout): slot p of the m slots holds token
// ids[p] (validated: in [0, n) for the token count n of the op).
// out[p] = src[ids[p]] for p < m: bit copies into contiguous `out` (m, H = src.shape[1] > 0).
void gather_rows(char* out, const TensorView& src, const int32_t* ids, int64_t m);
// out[t] = sum over the slots p < m with ids[p] == t, in increasing p, of w[p] * src[p] (w null:
// the plain sum), as sum_rows sums (the first term starts it, products rounded to fp32, one
// rounding to out_dtype); 0 for a token no slot holds. `out` is contiguous (n, H), H > 0.
void scatter_sum_rows(char* out, DType out_dtype, const TensorView& src, const int32_t* ids,
                      int64_t n, int64_t m, const float* w);
// unpermute_grad in padded mode, for p < m: gp[p] = round(w[p] * fp32(g[ids[p]])) in dtype and
// grad_probs[p] = dot_row_f32(fp32(g[ids[p]]), x[p]) stored in probs_dtype; w null: gp[p] is a
// bit copy of g[ids[p]] and grad_probs / x are unused. `gp` is contiguous (m, H), H > 0.
void padded_unpermute_grad_rows(char* gp, DType dtype, void* grad_probs, DType probs_dtype,
                                const TensorView& g, const int32_t* ids, int64_t m, const float* w,
                                const TensorView* x);

// Validated inputs of unpermute_grad / unpermute_grad_v2 (SPEC §4.3).
struct UnpermuteGradProblem {
  const TensorView* grad_out;
  const TensorView* sorted_indices;
  const TensorView* probs;            // null without probs
  const TensorView* permuted_tokens;  // non-null with probs
  int64_t n, h, topk, p;
  DType dtype;                 // of grad_permuted_tokens
  std::vector<uint64_t> seen;  // values of sorted_indices as a bitmap; empty: not computed
};
UnpermuteGradResult unpermute_grad_rows(const UnpermuteGradProblem& q);

}  // namespace moe_ep::detail
