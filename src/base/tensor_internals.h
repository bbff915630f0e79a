// Internal: Tensors over memory the library does not allocate itself, and the shape text of
// messages. The tensor view (moe_ep/tensor.h) is implemented in this bottom layer (tensor.cc),
// since kernels, transport, core and ref all use it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "moe_ep/tensor.h"

namespace moe_ep::detail {

struct TensorInternals {
  // A contiguous tensor over `data`, kept valid by `owner` (released with the last copy): a slot
  // of a shared-memory window, or a view of another tensor's storage.
  static Tensor wrap(std::shared_ptr<void> owner, void* data, DType dtype,
                     const std::vector<int64_t>& shape);
  // A tensor over a caller's contiguous view, owning nothing (the caller keeps the memory alive).
  static Tensor view(const TensorView& v);
};

// "[4, 2048]": the first ndim sizes, for messages.
std::string shape_text(const int64_t* shape, int ndim);

}  // namespace moe_ep::detail
