// moe-ep tool: bf16/fp16/fp32 storage <-> fp32 arithmetic. Rounding is to nearest even; NaN stays
// NaN. The tool keeps its own copy (it links only the public moe_ep target, not src/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "moe_ep/tensor.h"

namespace moe_ep_tool {

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
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

// Element i of contiguous bf16/fp16/fp32 storage, as fp32.
inline float load(moe_ep::DType dtype, const void* p, int64_t i) {
  switch (dtype) {
    case moe_ep::DType::kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case moe_ep::DType::kF16:
      return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// Stores v rounded to nearest even in dtype at element i.
inline void store(moe_ep::DType dtype, void* p, int64_t i, float v) {
  switch (dtype) {
    case moe_ep::DType::kBF16:
      static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
      break;
    case moe_ep::DType::kF16:
      static_cast<uint16_t*>(p)[i] = f32_to_f16(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
      break;
  }
}

// The float dtypes the tool runs in: "bf16", "fp16", "fp32" (CLI11 has checked the name).
inline moe_ep::DType parse_float_dtype(const std::string& name) {
  if (name == "fp16") return moe_ep::DType::kF16;
  if (name == "fp32") return moe_ep::DType::kF32;
  return moe_ep::DType::kBF16;
}

}  // namespace moe_ep_tool
