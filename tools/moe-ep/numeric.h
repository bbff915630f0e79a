// moe-ep tool: the float dtypes by name. Element conversions (bf16/fp16 <-> fp32) are the
// library's: moe_ep::load_float / store_float and friends (moe_ep/tensor.h).
#pragma once

#include <string>

#include "moe_ep/tensor.h"

namespace moe_ep_tool {

// The float dtypes the tool runs in: "bf16", "fp16", "fp32" (CLI11 has checked the name).
inline moe_ep::DType parse_float_dtype(const std::string& name) {
  if (name == "fp16") return moe_ep::DType::kF16;
  if (name == "fp32") return moe_ep::DType::kF32;
  return moe_ep::DType::kBF16;
}

}  // namespace moe_ep_tool
