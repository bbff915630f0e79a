// Naive reference for SPEC §1.5 (dynamic per-row int8 quantisation, quant_mode 2 and
// comm_quant_mode 2): the test oracle.
//
// Written from the SPEC formula, independent of src/ (elements are loaded through ref/numeric.h),
// one element at a time, with the same fp32 operations src/kernels/cpu/quant.h documents, so the
// kernel must agree BITWISE:
//   xf = fp32(x) * smooth (fp32) or fp32(x); amax = max|xf|; s = 127.0f / amax;
//   q = int8(round_half_even(xf * s)); scale = 1.0f / s;
//   zero row: q = 0, scale = +0; a NaN or Inf in xf: q = 0, scale = NaN;
//   127 / amax overflowing fp32: the row is scaled by 2^64 first and the scale by 2^-64 after.
// Rounding to an integer is done here with exact double arithmetic (floor and a comparison with
// one half), not with the kernel's add-and-subtract trick. The error bound is checked in double.
#pragma once

#include <cstdint>

#include "moe_ep/tensor.h"

namespace moe_ep::ref {

// The smoothed row xf (n fp32 values) of SPEC §1.5: fp32(x[i]) * smooth[i], or fp32(x[i]).
void smoothed_row(DType dtype, const void* x, const float* smooth, int64_t n, float* xf);

// Quantises one row: q[0..n) and the returned dynamic scale as SPEC §1.5 (see above).
float quantize_row_int8(DType dtype, const void* x, const float* smooth, int64_t n, int8_t* q);

// out[i] = fp32(fp32(q[i]) * scale).
void dequantize_row_int8(const int8_t* q, float scale, int64_t n, float* out);

// acc[i] = fp32(acc[i] + fp32(w * fp32(fp32(q[i]) * scale))): SPEC §2.3's weighted sum step on a
// dequantised row.
void axpy_row_int8(float* acc, float w, const int8_t* q, float scale, int64_t n);

// The per-element bound of quant.h: |dequant(quant(xf)) - xf| <= amax / 254 (1 + 2^-14) + 2^-143.
double quant_error_bound(double amax);

// In double: the largest |fp32(q[i] * scale) - xf[i]| over the row and the bound for its amax.
// For a row whose bound holds, max_error <= bound.
struct QuantErrorCheck {
  double max_error = 0;
  double bound = 0;
  int64_t worst = -1;  // the element with the largest error; -1 for n == 0
};
QuantErrorCheck check_quant_error(const float* xf, int64_t n, const int8_t* q, float scale);

}  // namespace moe_ep::ref
