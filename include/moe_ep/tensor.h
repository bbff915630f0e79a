// Tensors: a non-owning view (data, dtype, shape, strides) that converts to and from DLPack's
// DLTensor, and a small owning Tensor that the ops return.
#pragma once

#include <dlpack/dlpack.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "moe_ep/export.h"

namespace moe_ep {

namespace detail {
struct TensorInternals;
}  // namespace detail

enum class DType : uint8_t { kBF16, kF16, kF32, kI8, kI32, kI64, kBool };

// Bytes per element: 2, 2, 4, 1, 4, 8, 1.
MOE_EP_API std::size_t dtype_size(DType dtype);
// "bf16", "fp16", "fp32", "int8", "int32", "int64", "bool".
MOE_EP_API const char* dtype_name(DType dtype);

// Element conversions between the float storage dtypes and fp32, the roundings every op uses:
// to nearest even, ties to even; a NaN stays a NaN (quiet); overflow gives +-inf. For building
// inputs and reading outputs (e.g. a bf16 x from fp32 values). `bits` is the element's storage.
MOE_EP_API float bf16_to_float(uint16_t bits);
MOE_EP_API uint16_t float_to_bf16(float value);
MOE_EP_API float fp16_to_float(uint16_t bits);
MOE_EP_API uint16_t float_to_fp16(float value);
// Element i of contiguous bf16/fp16/fp32 storage `data`, as fp32 / stores `value` rounded there.
// Error(kInvalidArgument) for any other dtype.
MOE_EP_API float load_float(DType dtype, const void* data, int64_t i);
MOE_EP_API void store_float(DType dtype, void* data, int64_t i, float value);

inline constexpr int kMaxDims = 4;

// A non-owning strided view of CPU memory.
//   data:    first element; may be null when numel() == 0. Not owned: the caller keeps it alive.
//   shape:   shape[0..ndim), each >= 0.
//   strides: in ELEMENTS (not bytes), like DLPack and PyTorch; may be any value >= 0 for dims of
//            size 1. Ops state which strided layouts they accept (SPEC §1.3: x may be strided).
struct MOE_EP_API TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};

  // A contiguous (row-major) view of `data` (not owned) with the given shape. Throws
  // Error(kInvalidArgument) for more than kMaxDims dims, a negative size, or sizes other than 0
  // whose product exceeds 2^63 - 1.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape);
  static TensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape);

  int64_t size(int dim) const { return shape[dim]; }
  int64_t stride(int dim) const { return strides[dim]; }
  // The product of the sizes: 0 when one is 0, INT64_MAX when it would exceed that (a shape
  // every op refuses).
  int64_t numel() const;
  bool is_contiguous() const;
  // e.g. "bf16[4, 2048] strides [4096, 1]", for error messages.
  std::string describe() const;
  // `data` as T*; T must match dtype (not checked here).
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

// DLPack interchange.
//   from_dlpack: the DLTensor must be on kDLCPU, lanes 1, a supported dtype (bf16, fp16, fp32,
//     int8, int32, int64, bool) and ndim <= kMaxDims; strides == NULL means contiguous. byte_offset
//     is folded into data. The strides of size-1 dimensions, and all strides of a tensor with no
//     elements, are replaced by the contiguous ones (they address nothing). Throws
//     Error(kInvalidArgument) naming `what` otherwise (Error(kUnsupported) for an unsupported
//     dtype or a negative stride).
//   to_dlpack: a DLTensor whose shape and strides point INTO `view`: `view` must outlive it.
MOE_EP_API TensorView from_dlpack(const DLTensor& tensor, const char* what = "tensor");
MOE_EP_API DLTensor to_dlpack(TensorView& view);

// An owning, contiguous, 64-byte-aligned CPU tensor. Copies share the storage (like a
// shared_ptr). Converts implicitly to its TensorView.
class MOE_EP_API Tensor {
 public:
  Tensor() = default;
  // Uninitialised storage of the given shape. Throws Error(kInvalidArgument) for a bad shape (as
  // TensorView::contiguous) or one of 2^63 bytes or more, Error(kSystem) when allocation fails.
  static Tensor empty(DType dtype, const std::vector<int64_t>& shape);
  // Storage filled with zero bytes (0, 0.0, false); errors as empty().
  static Tensor zeros(DType dtype, const std::vector<int64_t>& shape);

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: implicit by design
  void* data() const { return view_.data; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(view_.data);
  }
  DType dtype() const { return view_.dtype; }
  int ndim() const { return view_.ndim; }
  int64_t size(int dim) const { return view_.shape[dim]; }
  int64_t numel() const { return view_.numel(); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype()); }
  bool defined() const { return storage_ != nullptr; }

  // Exports as a DLManagedTensor that keeps the storage alive until its deleter runs
  // (zero-copy hand-over to PyTorch, NumPy, ...). The caller owns the returned pointer.
  DLManagedTensor* to_dlpack_managed() const;

 private:
  // Internal: wraps memory the library manages itself (a shared-memory window slot).
  friend struct detail::TensorInternals;
  std::shared_ptr<void> storage_;
  TensorView view_;
};

}  // namespace moe_ep
