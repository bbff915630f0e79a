#include "core/validate.h"

#include <sstream>

#include "base/check.h"

namespace moe_ep::detail {

void expect_dtype(const char* op, const char* name, const TensorView& t,
                  std::initializer_list<DType> allowed) {
  for (DType d : allowed)
    if (t.dtype == d) return;
  std::ostringstream os;
  bool first = true;
  for (DType d : allowed) {
    os << (first ? "" : ", ") << dtype_name(d);
    first = false;
  }
  invalid(op, ": ", name, " dtype ", dtype_name(t.dtype), " is not one of {", os.str(), "}");
}

void expect_ndim(const char* op, const char* name, const TensorView& t, int ndim) {
  if (t.ndim != ndim) invalid(op, ": ", name, ".ndim = ", t.ndim, " must be ", ndim);
}

void expect_size(const char* op, const char* name, const TensorView& t, int dim, int64_t expected,
                 const char* what) {
  if (t.shape[dim] != expected)
    invalid(op, ": ", name, ".shape[", dim, "] = ", t.shape[dim], " must equal ", expected, " (",
            what, ")");
}

void expect_shape(const char* op, const char* name, const TensorView& t) {
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] < 0) invalid(op, ": ", name, ".shape[", d, "] = ", t.shape[d], " is negative");
  // Also for a tensor without elements: the kernels compute a row's bytes (H x the element size)
  // before they look at the rows (found by tests/fuzz: tokens [0, 2^62] overflowed there).
  int64_t bytes = static_cast<int64_t>(dtype_size(t.dtype));
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] > 0 && __builtin_mul_overflow(bytes, t.shape[d], &bytes))
      invalid(op, ": ", name, ".shape = ", shape_text(t.shape.data(), t.ndim), " ",
              dtype_name(t.dtype), " exceeds 2^63 bytes (the sizes other than 0 count)");
}

void expect_memory(const char* op, const char* name, const TensorView& t) {
  expect_shape(op, name, t);
  int64_t bytes = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.strides[d] < 0)
      unsupported(op, ": ", name, ".stride(", d, ") = ", t.strides[d], " is negative");
    // A size-1 dim may have any stride, but the kernels scale strides to bytes (found by
    // tests/fuzz: expand_x.stride(0) = 5142332531317346309 of bf16 overflowed in combine_v2).
    if (__builtin_mul_overflow(t.strides[d], static_cast<int64_t>(dtype_size(t.dtype)), &bytes))
      invalid(op, ": ", name, ".stride(", d, ") = ", t.strides[d], " ", dtype_name(t.dtype),
              " elements exceed 2^63 bytes");
  }
  if (t.data == nullptr && t.numel() > 0)
    invalid(op, ": ", name, " has ", t.numel(), " elements but data is null");
}

void expect_tensor(const char* op, const char* name, const TensorView& t,
                   std::initializer_list<DType> allowed, int ndim) {
  expect_dtype(op, name, t, allowed);
  expect_ndim(op, name, t, ndim);
  expect_memory(op, name, t);
}

void expect_rows(const char* op, const char* name, const TensorView& t) {
  expect_tensor(op, name, t, {DType::kBF16, DType::kF16, DType::kF32}, 2);
  if (t.shape[1] > 1 && t.strides[1] != 1)
    unsupported(op, ": ", name, ".stride(1) = ", t.strides[1],
                " is not 1 (rows may be strided, each row must be contiguous)");
}

void check_float_dtype(const char* op, const char* name, DType dtype) {
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32)
    invalid(op, ": ", name, " ", dtype_name(dtype), " is not one of {bf16, fp16, fp32}");
}

void check_same_dtype(const char* op, const char* name, DType dtype, const char* other_name,
                      DType other) {
  if (dtype != other)
    invalid(op, ": ", name, " dtype ", dtype_name(dtype), " must equal ", other_name, " ",
            dtype_name(other));
}

void check_output_size(const char* op, const char* what, int64_t rows, int64_t h, DType dtype) {
  int64_t elems = 0, bytes = 0;
  if (__builtin_mul_overflow(rows, h, &elems) ||
      __builtin_mul_overflow(elems, static_cast<int64_t>(dtype_size(dtype)), &bytes))
    invalid(op, ": ", what, " = [", rows, ", ", h, "] ", dtype_name(dtype), " exceeds 2^63 bytes");
}

}  // namespace moe_ep::detail
