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
// Start of row i of a 2-D view.
inline const char* row_ptr(const TensorView& t, int64_t i) {
  return static_cast<const char*>(t.data) +
         i * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
}
inline char* row_ptr_mut(const TensorView& t, int64_t i) {
  return static_cast<char*>(t.data) + i * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
}

}  // namespace moe_ep::detail
