#include "ref/quant_ref.h"

#include <cmath>
#include <limits>

#include "ref/numeric.h"

namespace moe_ep::ref {

namespace {

// Nearest integer to v, ties to the even neighbour, by exact double arithmetic (v is an fp32).
double round_half_even(double v) {
  const double lo = std::floor(v);
  const double frac = v - lo;  // exact: v and lo are close doubles
  if (frac > 0.5) return lo + 1;
  if (frac < 0.5) return lo;
  return std::fmod(lo, 2.0) == 0 ? lo : lo + 1;
}

}  // namespace

void smoothed_row(DType dtype, const void* x, const float* smooth, int64_t n, float* xf) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(dtype, x, i);
    if (smooth != nullptr) {
      const float prod = v * smooth[i];  // one fp32 multiply
      xf[i] = prod;
    } else {
      xf[i] = v;
    }
  }
}

float quantize_row_int8(DType dtype, const void* x, const float* smooth, int64_t n, int8_t* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    float v = load(dtype, x, i);
    if (smooth != nullptr) v = v * smooth[i];
    if (!std::isfinite(v)) finite = false;
    if (std::fabs(v) > amax) amax = std::fabs(v);
  }
  if (!finite || amax == 0.0f) {
    for (int64_t i = 0; i < n; ++i) q[i] = 0;
    return finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }

  // SPEC: s = 127 / amax. Decision (quant.h): when that overflows fp32, evaluate the formula on
  // the row scaled by 2^64 and scale the result back by 2^-64.
  float up = 1.0f;
  const float s_direct = 127.0f / amax;
  if (std::isinf(s_direct)) up = std::ldexp(1.0f, 64);
  const float s = 127.0f / (amax * up);

  for (int64_t i = 0; i < n; ++i) {
    float v = load(dtype, x, i);
    if (smooth != nullptr) v = v * smooth[i];
    const float scaled = v * up;  // exact: a power of two
    const float prod = scaled * s;
    double r = round_half_even(prod);
    if (r > 127) r = 127;
    if (r < -127) r = -127;
    q[i] = static_cast<int8_t>(r);
  }
  const float inv = 1.0f / s;  // SPEC: dynamic_scales = 1/s
  if (up == 1.0f) return inv;
  const float down = std::ldexp(1.0f, -64);
  const float scale = inv * down;  // one rounding, into the subnormal range if need be
  return scale;
}

void dequantize_row_int8(const int8_t* q, float scale, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = static_cast<float>(q[i]) * scale;
    out[i] = y;
  }
}

void axpy_row_int8(float* acc, float w, const int8_t* q, float scale, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = static_cast<float>(q[i]) * scale;
    const float p = w * y;
    const float sum = acc[i] + p;
    acc[i] = sum;
  }
}

double quant_error_bound(double amax) {
  return amax / 254.0 * (1.0 + std::ldexp(1.0, -14)) + std::ldexp(1.0, -143);
}

QuantErrorCheck check_quant_error(const float* xf, int64_t n, const int8_t* q, float scale) {
  QuantErrorCheck c;
  double amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(static_cast<double>(xf[i])));
  c.bound = quant_error_bound(amax);
  for (int64_t i = 0; i < n; ++i) {
    const float y = static_cast<float>(q[i]) * scale;
    const double err = std::fabs(static_cast<double>(y) - static_cast<double>(xf[i]));
    if (c.worst < 0 || err > c.max_error) {
      c.max_error = err;
      c.worst = i;
    }
  }
  return c;
}

}  // namespace moe_ep::ref
