// Internal: what the sharding files share: boxes (the region of the global tensor a rank holds),
// DTensor validation, the header agreement of the sharded collectives, and redistribution without
// the agreement (the ops agree once for all their arguments).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/error.h"
#include "moe_ep/sharding.h"
#include "moe_ep/tensor.h"

namespace moe_ep::detail {

// A box of the global index space: [lo[d], lo[d] + len[d]) in each of ndim dims.
struct Box {
  int ndim = 0;
  std::array<int64_t, kMaxDims> lo{};
  std::array<int64_t, kMaxDims> len{};
  int64_t numel() const;
  friend bool operator==(const Box& a, const Box& b) {
    return a.ndim == b.ndim && a.lo == b.lo && a.len == b.len;
  }
};

// The box mesh rank `rank` holds: the whole tensor for Replicate and Partial.
Box box_of(const std::vector<int64_t>& global_shape, Placement p, int mesh_size, int rank);
Box intersect(const Box& a, const Box& b);

// Copies the elements of `region` (global coordinates, inside both boxes) from `src`, which holds
// `src_box`, to `dst`, which holds `dst_box`. Same dtype; any non-negative strides.
void copy_box(const TensorView& src, const Box& src_box, const TensorView& dst, const Box& dst_box,
              const Box& region);

// Whether x.owner is exactly x.local (same data, dtype and shape, contiguous), so that the owner
// can stand for the piece. A DTensor may keep alive a larger buffer (a flat storage the piece
// views): then it cannot.
bool owner_is_local(const DTensor& x);

// A contiguous copy of a view.
Tensor contiguous_copy(const TensorView& v);

// "[4, 10]"
std::string shape_str(const std::vector<int64_t>& shape);

// Checks x against the mesh (placement dim, ndim, local shape, dtypes); throws
// Error(kInvalidArgument) "<op>: <name> ..." naming the value and the bound.
void check_dtensor(const char* op, const char* name, const DTensor& x, int mesh_size, int rank);

// The arguments a rank passes to a sharded collective, flattened to named integers: every rank
// must pass the same ones.
class ArgSummary {
 public:
  enum class Kind : uint8_t { kInt, kPlacement, kDType, kBool };
  void add(const std::string& name, int64_t value, Kind kind = Kind::kInt);
  // Presence, placement, ndim, global shape (4 slots) and global dtype of an optional DTensor.
  void add_tensor(const std::string& name, const DTensor* x);
  std::size_t size() const { return values_.size(); }
  int64_t value(std::size_t i) const { return values_[i]; }
  const std::string& name(std::size_t i) const { return names_[i]; }
  std::string format(std::size_t i, int64_t v) const;

 private:
  std::vector<std::string> names_;
  std::vector<int64_t> values_;
  std::vector<Kind> kinds_;
};

// Codes of the sharded collectives in the header.
enum ShardedCall : int32_t {
  kCallRedistribute = 100,
  kCallOpBase = 101,  // + static_cast<int>(ShardedOp)
};

// Exchanges a header with every rank (phase "header"), then: rethrows `local` if set; throws
// Error(kRemote) naming the lowest failed rank; throws Error(kInvalidArgument) on every rank when
// the ranks called different collectives or passed different arguments (naming the argument, two
// ranks and their values).
void agree_sharded(const Communicator& mesh, const char* op, int32_t call, const ArgSummary& mine,
                   const Error* local);

// redistribute() after the agreement.
DTensor redistribute_agreed(const Communicator& mesh, const char* op, const char* name,
                            const DTensor& x, Placement to);

}  // namespace moe_ep::detail
