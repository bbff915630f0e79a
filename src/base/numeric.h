// Internal: scalar conversions between bf16/fp16/fp32 storage and fp32 arithmetic, and element
// access to strided views. Rounding to bf16/fp16 is to nearest even; NaN stays NaN. The public
// moe_ep::bf16_to_float etc. (tensor.h) and the SIMD row kernels (kernels/cpu/convert.h) give
// these bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "moe_ep/tensor.h"

namespace moe_ep::detail {

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if defined(__clang__) && __clang_major__ < 15
// clang 14 (Debian 12's default clang) has no _Float16 on x86 without AVX512-FP16: the same
// conversions in integer operations, bit for bit those of _Float16 and F16C (round to nearest
// even; a NaN is made quiet and keeps the top bits of its payload).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13) | (man != 0 ? 0x400000u : 0u);
  } else if (exp == 0) {
    const float mag = static_cast<float>(man) * 0x1p-24f;  // exact
    return sign != 0 ? -mag : mag;
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (a < 0x38800000u) {  // below 2^-14: a subnormal or 0, rounded by an fp32 add
    float mag;
    std::memcpy(&mag, &a, 4);
    const float t = mag + 0.5f;  // ulp 2^-24 in [0.5, 1): rounds mag to a multiple of 2^-24
    uint32_t bits;
    std::memcpy(&bits, &t, 4);
    return static_cast<uint16_t>(sign | (bits - 0x3f000000u));
  }
  a += 0xc8000fffu + ((a >> 13) & 1u);  // rebias the exponent by -112, round to nearest even
  return static_cast<uint16_t>(sign | (a >> 13));
}
#else
inline float f16_to_f32(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

inline uint16_t f32_to_f16(float f) {
  const _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}
#endif

// Element i of a contiguous float row of dtype bf16/fp16/fp32, as fp32.
inline float load_f32(const void* row, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(row)[i]);
    case DType::kF16:
      return f16_to_f32(static_cast<const uint16_t*>(row)[i]);
    default:
      return static_cast<const float*>(row)[i];
  }
}

inline void store_f32(void* row, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kBF16:
      static_cast<uint16_t*>(row)[i] = f32_to_bf16(v);
      break;
    case DType::kF16:
      static_cast<uint16_t*>(row)[i] = f32_to_f16(v);
      break;
    default:
      static_cast<float*>(row)[i] = v;
      break;
  }
}

// Element (i) of a 1-D or (i, j) of a 2-D int32/int64 view, any strides.
inline int64_t index_at(const TensorView& t, int64_t i, int64_t j = 0) {
  const int64_t off = i * t.strides[0] + (t.ndim > 1 ? j * t.strides[1] : 0);
  return t.dtype == DType::kI64 ? static_cast<const int64_t*>(t.data)[off]
                                : static_cast<const int32_t*>(t.data)[off];
}
// Element (i) / (i, j) of a float view (bf16/fp16/fp32), any strides, as fp32.
inline float float_at(const TensorView& t, int64_t i, int64_t j = 0) {
  const int64_t off = i * t.strides[0] + (t.ndim > 1 ? j * t.strides[1] : 0);
  return load_f32(t.data, t.dtype, off);
}
// Start of row i of a 2-D view; null when the view has no data (rows of H = 0 elements: an
// offset from null is undefined, found by tests/fuzz).
inline const char* row_ptr(const TensorView& t, int64_t i) {
  if (t.data == nullptr) return nullptr;
  return static_cast<const char*>(t.data) +
         i * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
}
inline char* row_ptr_mut(const TensorView& t, int64_t i) {
  if (t.data == nullptr) return nullptr;
  return static_cast<char*>(t.data) + i * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
}

}  // namespace moe_ep::detail
