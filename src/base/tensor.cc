#include "moe_ep/tensor.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <sstream>

#include "base/block_cache.h"
#include "base/check.h"
#include "base/numeric.h"
#include "base/tensor_internals.h"

namespace moe_ep {

std::string detail::shape_text(const int64_t* shape, int ndim) {
  std::string s = "[";
  for (int d = 0; d < ndim; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

namespace {
// DLPack 0.6 has no bool code; later versions use 6 (kDLBool), which PyTorch exports.
constexpr uint8_t kDLBoolCode = 6;

// DType <-> DLPack (code, bits), lanes 1: the one table both directions read.
struct DLTypeOf {
  DType dtype;
  uint8_t code;
  uint8_t bits;
};
constexpr DLTypeOf kDLTypes[] = {{DType::kBF16, kDLBfloat, 16}, {DType::kF16, kDLFloat, 16},
                                 {DType::kF32, kDLFloat, 32},   {DType::kI8, kDLInt, 8},
                                 {DType::kI32, kDLInt, 32},     {DType::kI64, kDLInt, 64},
                                 {DType::kBool, kDLBoolCode, 8}};
}  // namespace

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kI8:
    case DType::kBool:
      return 1;
    case DType::kI64:
      return 8;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kF32:
      return "fp32";
    case DType::kI8:
      return "int8";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kBool:
      return "bool";
  }
  return "?";
}

float bf16_to_float(uint16_t bits) { return detail::bf16_to_f32(bits); }
uint16_t float_to_bf16(float value) { return detail::f32_to_bf16(value); }
float fp16_to_float(uint16_t bits) { return detail::f16_to_f32(bits); }
uint16_t float_to_fp16(float value) { return detail::f32_to_f16(value); }

namespace {
void expect_float_dtype(const char* op, DType dtype) {
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32)
    detail::invalid(op, ": dtype ", dtype_name(dtype), " is not one of {bf16, fp16, fp32}");
}
}  // namespace

float load_float(DType dtype, const void* data, int64_t i) {
  expect_float_dtype("load_float", dtype);
  return detail::load_f32(data, dtype, i);
}

void store_float(DType dtype, void* data, int64_t i, float value) {
  expect_float_dtype("store_float", dtype);
  detail::store_f32(data, dtype, i, value);
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  return contiguous(data, dtype, std::vector<int64_t>(shape));
}

TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<int64_t>& shape) {
  if (shape.size() > static_cast<std::size_t>(kMaxDims))
    detail::invalid("TensorView: ndim = ", shape.size(), " exceeds ", kMaxDims);
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.ndim = static_cast<int>(shape.size());
  int64_t stride = 1, elements = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    if (shape[d] < 0) detail::invalid("TensorView: shape[", d, "] = ", shape[d], " is negative");
    // The sizes other than 0 multiply to at most 2^63 - 1, so no stride overflows (found by
    // tests/fuzz: [2^62, 4] overflowed here).
    if (shape[d] > 0 && __builtin_mul_overflow(elements, shape[d], &elements))
      detail::invalid("TensorView: shape ", detail::shape_text(shape.data(), v.ndim),
                      " has more than 2^63 - 1 elements");
    v.shape[d] = shape[d];
    v.strides[d] = stride;
    stride *= shape[d];
  }
  return v;
}

int64_t TensorView::numel() const {
  for (int d = 0; d < ndim; ++d)
    if (shape[d] == 0) return 0;
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d)
    if (__builtin_mul_overflow(n, shape[d], &n)) return std::numeric_limits<int64_t>::max();
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  std::ostringstream os;
  os << dtype_name(dtype) << "[";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  os << "] strides [";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << strides[d];
  os << "]";
  return os.str();
}

TensorView from_dlpack(const DLTensor& t, const char* what) {
  if (t.device.device_type != kDLCPU)
    detail::invalid("from_dlpack: ", what,
                    " device_type = ", static_cast<int>(t.device.device_type),
                    " is not kDLCPU (1)");
  if (t.ndim < 0 || t.ndim > kMaxDims)
    detail::invalid("from_dlpack: ", what, " ndim = ", t.ndim, " is outside [0, ", kMaxDims, "]");
  if (t.dtype.lanes != 1)
    detail::invalid("from_dlpack: ", what, " dtype.lanes = ", t.dtype.lanes, " must be 1");
  TensorView v;
  const int code = t.dtype.code, bits = t.dtype.bits;
  const DLTypeOf* match = nullptr;
  for (const DLTypeOf& d : kDLTypes)
    if (d.code == code && d.bits == bits) match = &d;
  if (match == nullptr) {
    // The DLPack type by name (float64, uint8, complex64, ...) as well as by number.
    const char* kind = code == kDLInt        ? "int"
                       : code == kDLUInt     ? "uint"
                       : code == kDLFloat    ? "float"
                       : code == kDLBfloat   ? "bfloat"
                       : code == kDLComplex  ? "complex"
                       : code == kDLBoolCode ? "bool"
                                             : "type";
    detail::unsupported("from_dlpack: ", what, " dtype ", kind, bits, " (DLPack code ", code,
                        ", bits ", bits,
                        ") is not one of bf16, fp16, fp32, int8, int32, int64, "
                        "bool");
  }
  v.dtype = match->dtype;
  v.data = t.data == nullptr ? nullptr : static_cast<char*>(t.data) + t.byte_offset;
  v.ndim = t.ndim;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] < 0)
      detail::invalid("from_dlpack: ", what, " shape[", d, "] = ", t.shape[d], " is negative");
    v.shape[d] = t.shape[d];
    v.strides[d] = stride;
    stride *= t.shape[d];
  }
  // The strides of a size-1 dimension, and all strides of a tensor without elements, address
  // nothing; producers export arbitrary values there (PyTorch: 0 or the old stride), so they are
  // replaced by the contiguous ones rather than rejected by the ops' layout checks.
  if (t.strides != nullptr && stride != 0) {
    for (int d = 0; d < t.ndim; ++d) {
      if (t.shape[d] == 1) continue;
      if (t.strides[d] < 0)
        detail::unsupported("from_dlpack: ", what, " stride[", d, "] = ", t.strides[d],
                            " is negative");
      v.strides[d] = t.strides[d];
    }
  }
  return v;
}

DLTensor to_dlpack(TensorView& v) {
  DLTensor t{};
  t.data = v.data;
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = v.ndim;
  for (const DLTypeOf& d : kDLTypes)
    if (d.dtype == v.dtype) t.dtype = DLDataType{d.code, d.bits, 1};
  t.shape = v.shape.data();
  t.strides = v.strides.data();
  t.byte_offset = 0;
  return t;
}

Tensor Tensor::empty(DType dtype, const std::vector<int64_t>& shape) {
  Tensor t;
  t.view_ = TensorView::contiguous(nullptr, dtype, shape);
  // Ops check their own output sizes with better messages; this is the safety net.
  int64_t elems = 1, bytes64 = 0;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(elems, d, &elems))
      detail::invalid("Tensor::empty: the element count of the shape overflows int64");
  if (__builtin_mul_overflow(elems, static_cast<int64_t>(dtype_size(dtype)), &bytes64) ||
      bytes64 > std::numeric_limits<int64_t>::max() - 64)
    detail::invalid("Tensor::empty: ", elems, " elements of ", dtype_name(dtype),
                    " exceed 2^63 bytes");
  const std::size_t bytes = static_cast<std::size_t>(bytes64);
  // Large blocks are reused between calls (base/block_cache.h): fresh pages cost a page fault
  // and the kernel's zeroing each.
  void* p = detail::allocate_block(bytes);
  if (p == nullptr)
    detail::fail(ErrorKind::kSystem, "Tensor::empty: cannot allocate ", bytes, " bytes");
  t.storage_ = std::shared_ptr<void>(p, [bytes](void* q) { detail::release_block(q, bytes); });
  t.view_.data = p;
  return t;
}

Tensor Tensor::zeros(DType dtype, const std::vector<int64_t>& shape) {
  Tensor t = empty(dtype, shape);
  std::memset(t.data(), 0, t.nbytes());
  return t;
}

namespace {
struct ManagedCtx {
  std::shared_ptr<void> storage;
  TensorView view;
};
}  // namespace

DLManagedTensor* Tensor::to_dlpack_managed() const {
  auto* ctx = new ManagedCtx{storage_, view_};
  auto* m = new DLManagedTensor{};
  m->dl_tensor = to_dlpack(ctx->view);
  m->manager_ctx = ctx;
  m->deleter = [](DLManagedTensor* self) {
    delete static_cast<ManagedCtx*>(self->manager_ctx);
    delete self;
  };
  return m;
}

namespace detail {

Tensor TensorInternals::wrap(std::shared_ptr<void> owner, void* data, DType dtype,
                             const std::vector<int64_t>& shape) {
  Tensor t;
  t.view_ = TensorView::contiguous(data, dtype, shape);
  t.storage_ = std::move(owner);
  return t;
}

Tensor TensorInternals::view(const TensorView& v) {
  Tensor t;
  t.view_ = v;
  // Non-null, owning nothing: defined() holds, and no copy frees the memory.
  static char empty;
  t.storage_ = std::shared_ptr<void>(std::shared_ptr<void>(), v.data != nullptr ? v.data : &empty);
  return t;
}

}  // namespace detail

}  // namespace moe_ep
