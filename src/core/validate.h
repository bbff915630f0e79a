// Internal: argument checks shared by the ops. Each throws Error(kInvalidArgument) with a message
// that names the op, the parameter, the value and the bound.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "base/numeric.h"
#include "base/tensor_internals.h"
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
// Every shape[d] >= 0: "permute: tokens.shape[1] = -3 is negative", and the sizes other than 0
// times the element size below 2^63, so numel(), a row's bytes and every offset into the tensor
// fit int64: "unpermute: permuted_tokens.shape = [4611686018427387904, 4] fp32 exceeds 2^63 bytes
// (the sizes other than 0 count)".
void expect_shape(const char* op, const char* name, const TensorView& t);
// Sizes >= 0 (expect_shape), non-null data when numel > 0, non-negative strides.
void expect_memory(const char* op, const char* name, const TensorView& t);

// "permute_grad_v2: tokens_dtype int32 is not one of {bf16, fp16, fp32}" (a dtype argument).
void check_float_dtype(const char* op, const char* name, DType dtype);
// "permute_grad: grad_permuted_tokens dtype fp16 must equal tokens dtype bf16"
void check_same_dtype(const char* op, const char* name, DType dtype, const char* other_name,
                      DType other);
// An output of rows x h elements of dtype must fit in 2^63 bytes; Tensor::empty does not check.
void check_output_size(const char* op, const char* what, int64_t rows, int64_t h, DType dtype);

}  // namespace moe_ep::detail
