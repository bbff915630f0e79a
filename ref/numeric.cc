#include "ref/numeric.h"

#include <cmath>
#include <cstring>

namespace moe_ep::ref {

namespace {

// Round a finite fp32 value to `mant` mantissa bits (bf16: 7, fp16: 10) by exact arithmetic on
// its neighbours, ties to even. Subnormal and overflow handling as IEEE for the target format.
float round_bits(float v, int mant, int min_exp, int max_exp) {
  if (std::isnan(v) || std::isinf(v) || v == 0.0f) return v;
  const double x = v;
  int e = 0;
  std::frexp(x, &e);                 // x = m * 2^e, 0.5 <= |m| < 1
  int exp = e - 1;                   // x = 1.f * 2^exp
  if (exp < min_exp) exp = min_exp;  // subnormals share the smallest exponent's spacing
  const double ulp = std::ldexp(1.0, exp - mant);
  const double q = x / ulp;  // exact: a power-of-two scaling
  const double lo = std::floor(q);
  double r;
  if (q - lo > 0.5) {
    r = lo + 1;
  } else if (q - lo < 0.5) {
    r = lo;
  } else {
    r = std::fmod(lo, 2.0) == 0 ? lo : lo + 1;
  }
  const double out = r * ulp;
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, -mant), max_exp);
  if (std::fabs(out) > max_finite) return std::copysign(INFINITY, v);
  return std::copysign(static_cast<float>(out), v);  // keeps -0 for tiny negatives
}

}  // namespace

float round_to(DType dtype, float v) {
  switch (dtype) {
    case DType::kBF16:
      return round_bits(v, 7, -126, 127);
    case DType::kF16:
      return round_bits(v, 10, -14, 15);
    default:
      return v;
  }
}

float load(DType dtype, const void* p, int64_t i) {
  if (dtype == DType::kF32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (dtype == DType::kBF16) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  // fp16: sign, 5-bit exponent, 10-bit mantissa.
  const int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
  double mag;
  if (exp == 0) {
    mag = std::ldexp(man, -24);
  } else if (exp == 31) {
    mag = man ? NAN : INFINITY;
  } else {
    mag = std::ldexp(1024 + man, exp - 25);
  }
  return static_cast<float>(sign ? -mag : mag);
}

void store(DType dtype, void* p, int64_t i, float v) {
  if (dtype == DType::kF32) {
    static_cast<float*>(p)[i] = v;
    return;
  }
  const float r = round_to(dtype, v);
  uint16_t h = 0;
  if (dtype == DType::kBF16) {
    uint32_t u;
    std::memcpy(&u, &r, 4);
    h = std::isnan(r) ? 0x7fc0 : static_cast<uint16_t>(u >> 16);
  } else {
    const int sign = std::signbit(r) ? 1 : 0;
    const double a = std::fabs(static_cast<double>(r));
    if (std::isnan(r)) {
      h = 0x7e00;
    } else if (std::isinf(r)) {
      h = static_cast<uint16_t>((sign << 15) | (31 << 10));
    } else if (a < std::ldexp(1.0, -14)) {
      h = static_cast<uint16_t>((sign << 15) | static_cast<int>(a / std::ldexp(1.0, -24)));
    } else {
      int e = 0;
      const double m = std::frexp(a, &e);  // a = m * 2^e
      const int exp = e - 1 + 15;
      const int man = static_cast<int>((m * 2 - 1) * 1024);
      h = static_cast<uint16_t>((sign << 15) | (exp << 10) | man);
    }
  }
  static_cast<uint16_t*>(p)[i] = h;
}

double at(const TensorView& t, int64_t i, int64_t j) {
  const int64_t off = i * t.strides[0] + (t.ndim > 1 ? j * t.strides[1] : 0);
  switch (t.dtype) {
    case DType::kBF16:
    case DType::kF16:
    case DType::kF32:
      return load(t.dtype, t.data, off);
    case DType::kI8:
      return static_cast<const int8_t*>(t.data)[off];
    case DType::kI32:
      return static_cast<const int32_t*>(t.data)[off];
    case DType::kI64:
      return static_cast<double>(static_cast<const int64_t*>(t.data)[off]);
    case DType::kBool:
      return static_cast<const uint8_t*>(t.data)[off] != 0;
  }
  return 0;
}

}  // namespace moe_ep::ref
