// Internal: the SIMD row kernels: conversions between bf16/fp16/fp32 rows and fp32 arithmetic,
// weighted sums, copies. Rounding to bf16/fp16 is to nearest even; NaN stays NaN.
#pragma once

#include <cstdint>
#include <cstring>

#include "base/numeric.h"
#include "moe_ep/tensor.h"

namespace moe_ep::detail {

// The row kernels below are SIMD (Highway, dispatched at run time to the best target of the CPU;
// see convert.cc) and give, on every target, the bits of base/numeric.h's scalar functions applied
// element by element in the stated order. Rows are contiguous; n >= 0.

// acc[0..n) += w * fp32(src[0..n)), one fp32 multiply and one fp32 add per element (no FMA
// contraction: the product is rounded to fp32 before the add, matching the references).
void axpy_row_f32(float* acc, float w, const void* src, DType dtype, int64_t n);
// acc[0..n) += fp32(src[0..n)).
void add_row_f32(float* acc, const void* src, DType dtype, int64_t n);
// dst[0..n) = round(src[0..n)) in dtype.
void store_row_f32(void* dst, DType dtype, const float* src, int64_t n);
// dst[0..n) = fp32(src[0..n)).
void load_row_f32(float* dst, const void* src, DType dtype, int64_t n);
// Whether a row at p may take non-temporal stores: they need addresses aligned to the vector, and
// a row that starts on a 64-byte boundary gives every full vector of it such an address.
inline bool stream_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }
// stream (below): write dst with non-temporal stores when it starts on a 64-byte boundary, for
// large outputs that will not be read again soon (they then skip the cache and the read of the
// destination line that an ordinary store costs). The values written are the same either way.

// dst[0..n) = round(src[0..n) * w) in dtype: one fp32 product, one rounding.
void scale_row_f32(void* dst, DType dtype, const float* src, float w, int64_t n,
                   bool stream = false);
// memcpy(dst, src, bytes) for rows that do not overlap.
void copy_row(void* dst, const void* src, std::size_t bytes, bool stream = false);
// memcpy(dst[r], src, bytes) for r < count, in one pass over src: each block of src is loaded
// once and stored to every dst side by side. No dst may overlap src or another dst.
void copy_row_to(void* const* dst, int64_t count, const void* src, std::size_t bytes,
                 bool stream = false);
// dst = round(sum over r = 0..count-1, in r order, of weights[r] * fp32(rows[r])) in dst_dtype;
// each product is rounded to fp32 before it is added and the first term starts the sum (no +0
// added first; from_zero: +0 starts it and every term is added, so a sum of -0 terms is +0).
// weights == null: the plain sum of the rows. count == 0 writes zeros. Each source row is read
// once (the accumulators stay in registers), so this is one pass over the inputs. ahead: the
// ahead_count rows (of src_dtype, n elements each) the caller reads next, typically the next
// token's; their lines are prefetched block by block during this pass, so that the reads of two
// tokens' rows are in flight at once (values unchanged; measured 15-20 % faster when rows come
// from memory: docs/performance.md). They are only prefetched, never read, so any address is
// harmless.
void sum_rows(void* dst, DType dst_dtype, const void* const* rows, const float* weights,
              int64_t count, DType src_dtype, int64_t n, bool stream = false,
              bool from_zero = false, const void* const* ahead = nullptr, int64_t ahead_count = 0);
// The fp32 dot product of grad_probs (SPEC §4.3), in the order include/moe_ep/permute.h fixes
// for it: 16 partial sums, lane l (0..15) the sum from +0, in increasing element order, of the
// products g[c] * fp32(x[c]) for c = l, l+16, l+32, ... < n, each product rounded to fp32 before
// it is added; then acc[l] = acc[l] + acc[l+w] for l < w, for w = 8, 4, 2, 1; the result is
// acc[0] (+0 when n == 0). The lanes are vector lanes on every target (one AVX-512 vector, two
// AVX2 or four SSE vectors, 16 scalars in the fallback), so the sum is one pass along the row.
float dot_row_f32(const float* g, const void* x, DType dtype, int64_t n);
// The entries of a token in unpermute_grad: with gf = fp32(g[0..n)) (g a row of g_dtype), for
// r < count, out[r] = dot_row_f32(gf, x[r], x_dtype, n) and dst[r][0..n) = round(gf * w[r]) in
// dst_dtype, as scale_row_f32(dst[r], dst_dtype, gf, w[r], n, stream). Two passes: the dot
// products first, reading each row of x once with g, in groups of up to eight (four on 16-register
// targets) walked side by side; then each dst row in turn from g, which the first pass left in the
// cache (reads and non-temporal writes to many rows at once contend: docs/performance.md). The dst
// rows must not overlap g or the rows of x. `ahead` (ahead_count rows of x_dtype, n elements
// each, may be null): the next call's rows of x, whose blocks are prefetched in step with this
// call's (ahead[r] along with x[r]'s group); they are not read.
void scale_dot_rows_f32(float* out, void* const* dst, DType dst_dtype, const void* g, DType g_dtype,
                        const float* w, const void* const* x, DType x_dtype, int64_t count,
                        int64_t n, bool stream = false, const void* const* ahead = nullptr,
                        int64_t ahead_count = 0);

}  // namespace moe_ep::detail
