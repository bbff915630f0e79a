// moe-ep tool, `moe-ep bench`: the baselines moe-ep is compared with in the same run, on the same
// rows: the textbook pipeline (permute -> MPI_Alltoallv -> regroup, and back) and the bare
// MPI_Alltoallv of the payload. Both use blocking MPI calls, as a user would write them (the
// caller bounds them with a Watchdog).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "bench_point.h"
#include "moe_ep/tensor.h"

namespace moe_ep_tool::bench {

// An owned MPI datatype of `bytes` contiguous bytes (one row).
class RowType {
 public:
  explicit RowType(int64_t bytes);
  ~RowType();
  RowType(const RowType&) = delete;
  RowType& operator=(const RowType&) = delete;
  MPI_Datatype get() const { return t_; }

 private:
  MPI_Datatype t_ = MPI_DATATYPE_NULL;
};

// The textbook pipeline, written as a user would (Megatron-LM's alltoall token dispatcher):
// dispatch = permute (moe_ep::permute: sort the (token, k) copies by expert) -> MPI_Alltoall of
// the per-expert counts -> MPI_Alltoallv of the rows -> regroup the received (source, local
// expert) chunks by local expert (Megatron's sort_chunks_by_idxs); combine = regroup back ->
// MPI_Alltoallv -> unpermute with the top-k weights (moe_ep::unpermute: the weighted sum). Its
// buffers are allocated once per point (as a caching allocator would), the permute/unpermute
// outputs by those ops.
class Textbook {
 public:
  Textbook(const Point& p, MPI_Datatype row);

  // permute -> MPI_Alltoall(counts) -> MPI_Alltoallv(rows) -> regroup by local expert.
  void dispatch(const moe_ep::TensorView& x, const moe_ep::TensorView& ids);

  // The rows dispatch delivered, grouped by local expert: (valid, H).
  std::byte* expand() { return expand_.data(); }
  int64_t valid() const { return valid_; }

  // y: the expert outputs in expand()'s layout, (valid, H).
  moe_ep::Tensor combine(const std::byte* y, const moe_ep::TensorView& probs);

 private:
  const Point& p_;
  MPI_Datatype row_;
  std::vector<int32_t> per_expert_, recv_block_;
  std::vector<int64_t> block_at_;  // [s L + l]: first row of chunk (s, l) in recv_
  std::vector<int> send_counts_, send_displs_, recv_counts_, recv_displs_;
  std::vector<std::byte> recv_, expand_, back_send_, back_recv_;
  moe_ep::Tensor sorted_indices_;
  int64_t valid_ = 0;
};

// The bare MPI_Alltoallv: the rows dispatch moves (counts from the same routing, self included),
// pre-packed contiguously by destination, and the same rows back for combine. No routing, no
// layout: what MPI itself does with the payload.
class Alltoallv {
 public:
  // row_bytes: the payload of one row (H x dtype, or H + 4 for int8 and its scale). The send
  // buffer holds the rows of x in `order` (truncated or zero-padded to row_bytes).
  Alltoallv(const Point& p, int64_t row_bytes);
  void dispatch();  // the rows out
  void combine();   // the same rows back
  const std::vector<std::byte>& sent() const { return send_; }
  const std::vector<std::byte>& received() const { return recv_; }
  const std::vector<std::byte>& returned() const { return back_; }

 private:
  const Point& p_;
  RowType type_;
  std::vector<std::byte> send_, recv_, back_;
};

}  // namespace moe_ep_tool::bench
