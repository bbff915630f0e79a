// Internal: Tensors over memory the library does not allocate itself.
#pragma once

#include <memory>
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

}  // namespace moe_ep::detail
