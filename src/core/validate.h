// Internal: argument checks shared by the ops. Each throws Error(kInvalidArgument) with a message
// that names the op, the parameter, the value and the bound.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "moe_ep/tensor.h"

namespace moe_ep::detail {

// "permute: tokens dtype int32 is not one of {bf16, fp16, fp32}"
void expect_dtype(const char* op, const char* name, const TensorView& t,
                  std::initializer_list<DType> allowed);
// "permute: tokens.ndim = 3 must be 2"
void expect_ndim(const char* op, const char* name, const TensorView& t, int ndim);
// "combine_v2: expert_scales.shape[0] = 3 must equal 4 (BS, x.shape[0])"
void expect_size(const char* op, const char* name, const TensorView& t, int dim, int64_t expected,
                 const char* what);
// expect_dtype, expect_ndim and expect_memory in that order: the usual checks of a tensor argument.
void expect_tensor(const char* op, const char* name, const TensorView& t,
                   std::initializer_list<DType> allowed, int ndim);
// 2-D float rows: dtype in {bf16, fp16, fp32}, ndim 2, stride(1) == 1 (or H <= 1), stride(0) >= 0,
// data non-null when numel > 0.
void expect_rows(const char* op, const char* name, const TensorView& t);
// Every shape[d] >= 0: "permute: tokens.shape[1] = -3 is negative".
void expect_shape(const char* op, const char* name, const TensorView& t);
// Sizes >= 0 (expect_shape), non-null data when numel > 0, non-negative strides.
void expect_memory(const char* op, const char* name, const TensorView& t);

// Element (i) of a 1-D or (i, j) of a 2-D int32/int64 view, any strides.
inline int64_t index_at(const TensorView& t, int64_t i, int64_t j = 0) {
  const int64_t off = i * t.strides[0] + (t.ndim > 1 ? j * t.strides[1] : 0);
  return t.dtype == DType::kI64 ? static_cast<const int64_t*>(t.data)[off]
                                : static_cast<const int32_t*>(t.data)[off];
}
// Element (i) / (i, j) of a float view (bf16/fp16/fp32), any strides, as fp32.
float float_at(const TensorView& t, int64_t i, int64_t j = 0);
// Start of row i of a 2-D view.
inline const char* row_ptr(const TensorView& t, int64_t i) {
  return static_cast<const char*>(t.data) +
         i * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
}
inline char* row_ptr_mut(const TensorView& t, int64_t i) {
  return static_cast<char*>(t.data) + i * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
}

}  // namespace moe_ep::detail
