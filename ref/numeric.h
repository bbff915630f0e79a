// Reference numerics for the test oracles: loading and rounding bf16/fp16/fp32 values, written
// independently of src/kernels (no shared code), for clarity rather than speed.
#pragma once

#include <cstdint>

#include "moe_ep/tensor.h"

namespace moe_ep::ref {

// The value of element `i` of contiguous storage `p` of dtype bf16/fp16/fp32, as fp32.
float load(DType dtype, const void* p, int64_t i);
// Stores fp32 `v` rounded to nearest even in dtype at element `i`.
void store(DType dtype, void* p, int64_t i, float v);
// fp32 `v` rounded to nearest even in dtype and back (the value the stored element will have).
float round_to(DType dtype, float v);
// Element (i, j) of a 2-D (or (i) of a 1-D) view of any dtype and strides, as double.
double at(const TensorView& t, int64_t i, int64_t j = 0);

}  // namespace moe_ep::ref
