// Internal: dynamic per-row int8 quantisation (SPEC §1.5, quant_mode 2 of dispatch_v2; the same
// rounding for comm_quant_mode 2 of combine_v2) and the dequantising consumers.
//
// Exact fp32 operations of quantize_row_int8 (ref/quant_ref.cc evaluates the same operations
// independently, and the two agree bitwise):
//   xf[i]  = fp32(x[i]) * smooth[i]      one fp32 multiply (rounded to nearest even) with a
//                                         smoothing row; fp32(x[i]) alone without one (exact)
//   amax   = max_i |xf[i]|                exact (no rounding)
//   s      = 127.0f / amax                one fp32 division
//   q[i]   = int8(rne(xf[i] * s))         the product rounded to fp32, then to the nearest
//                                         integer, ties to even (rne); clamped to [-127, 127]
//   return = 1.0f / s                     SPEC's 1/s: one fp32 division OF THE ROUNDED s. This is
//                                         not amax / 127.0f: the two differ in the last bit for
//                                         some amax (1/fl(127/amax) carries two roundings).
// Notes:
//   * -128 never occurs. |xf[i] * s| <= amax * fl(127/amax) <= 127 (1 + u)^2 < 127.5 (u = 2^-24),
//     so rne gives at most 127 in magnitude (a product of 127.00001 rounds to 127). The clamp is
//     a guard that provably never changes a value.
//   * Zero row (every |xf| == 0, including n == 0 and -0): q = 0 and the scale is +0 (no NaN/Inf).
//   * Non-finite row (some xf is NaN or +-Inf, including a finite x times a smoothing factor that
//     overflows): q = 0 and the scale is a quiet NaN, so every dequantised element is NaN and the
//     consumer sees it (Inf becomes NaN too: the row has no meaningful scale). quantize_rows_int8
//     raises InvalidArgument naming the row instead when asked to check (SPEC §1.5: an error only
//     if the caller asks for checking).
//   * Tiny rows. **Decision** (the SPEC is silent): when 127 / amax overflows fp32 (amax < about
//     3.7e-37, i.e. 127 / FLT_MAX), the literal formula would give s = Inf, q = NaN casts and a
//     zero scale. Then, and only then, the row is first scaled by 2^64 (exact: a power of two on
//     values below 2^-121): xf' = xf * 2^64, amax' = amax * 2^64, s = 127.0f / amax',
//     q[i] = int8(rne(xf'[i] * s)), scale = (1.0f / s) * 2^-64. This is the SPEC formula with the
//     exponent range of fp32 widened; q has full 8-bit resolution and the scale is rounded into
//     fp32's subnormal range (it may round to 0 for amax near 2^-149; q is then non-zero but
//     every dequantised value is 0, within the bound below). Whenever 127 / amax is finite the
//     literal formula is used.
//
// Error bound (derived in the standard model fl(a op b) = (a op b)(1 + d) + e, |d| <= u = 2^-24,
// |e| <= 2^-150 only for subnormal results). With y[i] = fl(fp32(q[i]) * scale) (what
// dequantize_row_int8 writes), for every element of a finite row:
//     |y[i] - xf[i]| <= amax / 254 * (1 + 2^-14) + 2^-143
//   (1/2 from rounding to an integer, in units of 1/s = amax / 127 (1 + u); plus about 3 u amax
//   from rounding s, xf * s, 1/s and q * scale: 763 u < 2^-14; the absolute 2^-143 = 128 * 2^-150
//   covers a scale (and a product) rounded into the subnormal range, i.e. amax below ~1.5e-36).
// The bound is against xf, the smoothed row, which is what the consumer dequantises.
//
// Combine with comm_quant_mode 2: with y_k the dequantised row of expert k of a token and x_k the
// row before quantisation (amax_k its max|.|), the exact weighted sums differ by at most
//     |sum_k w_k y_k[i] - sum_k w_k x_k[i]| <= sum_k |w_k| (amax_k / 254 (1 + 2^-14) + 2^-143),
// and the fp32 accumulation (SPEC §2.3: products rounded, then added in k order) adds only its
// usual rounding error, at most gamma_K * sum_k |w_k y_k[i]| (gamma_K = K u / (1 - K u)), the same
// as without quantisation. axpy_row_int8 computes exactly axpy_row_f32 over the dequantised row.
//
// The kernels are Highway code (quant.cc), compiled per x86 target and dispatched at run time;
// every target gives the bits of ref/quant_ref.cc (tests/unit/test_simd.cc forces each in turn).
#pragma once

#include <cstdint>

#include "moe_ep/tensor.h"

namespace moe_ep::detail {

// Quantises one row (SPEC §1.5, see above).
//   src:    [in] n elements of `dtype` (bf16, fp16 or fp32), contiguous; may be null when n == 0.
//   smooth: [in] optional n fp32 smoothing factors multiplied into the row; null: none.
//   q:      [out] n int8 values; may be null when n == 0.
// Returns the dynamic scale (dequantisation factor): 1/s, +0 for a zero row, NaN for a
// non-finite row. Throws only Error(kInternal) for a dtype other than bf16/fp16/fp32.
float quantize_row_int8(const void* src, DType dtype, const float* smooth, int64_t n, int8_t* q);

// quantize_row_int8 without smoothing of rows rows in turn, each written to several places: row t
// (src[t], n contiguous elements of `dtype`, bf16/fp16/fp32) is quantised once and its n int8
// values stored to each of dst[first[t]], ..., dst[first[t + 1] - 1] (first: rows + 1 increasing
// offsets, first[t + 1] > first[t]); scales[t] gets its dynamic scale. One token's row for each of
// its destinations (dispatch_v2, quant_mode 2 without smoothing scales), in one pass per row that
// also reads the next row for its max. The dst rows must not overlap the src rows or each other.
// OpenMP-parallel over contiguous runs of rows; the bits equal quantize_row_int8's. stream:
// non-temporal stores for each row whose destinations are all 64-byte aligned (large outputs not
// read again soon: they skip the cache and the read of each destination line; same values).
void quantize_rows_int8_to(const void* const* src, DType dtype, int64_t rows, int64_t n,
                           int8_t* const* dst, const int64_t* first, float* scales,
                           bool stream = false);

// acc[0..n) += w * fl(fp32(q[i]) * scale): the dequantised value rounded to fp32, then the product
// with w rounded to fp32, then the add (no FMA), exactly as axpy_row_f32 on dequantize_row_int8's
// output (SPEC §2.3 with comm_quant_mode 2).
void axpy_row_int8(float* acc, float w, const int8_t* q, float scale, int64_t n);

// out[0..n) = fl(fp32(q[i]) * scale), one fp32 multiply per element.
void dequantize_row_int8(const int8_t* q, float scale, int64_t n, float* out);

// Many rows at once, OpenMP-parallel over groups of 16 rows; each row is quantize_row_int8 of its
// source row, so the results do not depend on the thread count. Strides are in elements.
struct QuantizeRowsInt8Args {
  const char* op = "quantize";  // names the op in error messages, e.g. "dispatch_v2"
  const char* name = "x";       // names the source tensor in error messages
  int64_t rows = 0;             // number of rows to quantise (>= 0)
  int64_t n = 0;                // elements per row, H (>= 0)
  DType dtype = DType::kBF16;   // dtype of src: bf16, fp16 or fp32
  // [in] row r reads the n contiguous elements at src + src_row * src_stride, where src_row is
  // src_index[r] when src_index is given (a token may be quantised once per destination), else r.
  const void* src = nullptr;
  int64_t src_stride = 0;
  const int32_t* src_index = nullptr;
  // [in] optional fp32 smoothing rows of n contiguous factors, smooth_stride apart; row r uses
  // smoothing row smooth_index[r] when smooth_index is given (SPEC §1.3 scales: Ns + e for MoE
  // expert e), else r. Null: no smoothing.
  const float* smooth = nullptr;
  int64_t smooth_stride = 0;
  const int32_t* smooth_index = nullptr;
  // [out] row r is written at q + r * q_stride (n int8 values); scales[r] gets its dynamic scale.
  int8_t* q = nullptr;
  int64_t q_stride = 0;
  float* scales = nullptr;
  // When true, a non-finite row raises Error(kInvalidArgument) naming the lowest such row, e.g.
  // "dispatch_v2: x[5] (quantised row 9, smoothed by scales[3]) holds a NaN or Inf (after
  // smoothing); int8 quantisation needs finite values". Every row has been written by then.
  bool check_finite = false;
};
// Indices and pointers are trusted (the op validated them); only cheap invariants are checked.
void quantize_rows_int8(const QuantizeRowsInt8Args& args);

}  // namespace moe_ep::detail
