// Internal: expert placement, argument validation and the count/offset layouts of dispatch_v2 and
// combine_v2 (SPEC §1.2-§1.4). Pure computation: no MPI here.
#pragma once

#include <cstdint>
#include <vector>

#include "moe_ep/dispatch.h"
#include "moe_ep/tensor.h"

namespace moe_ep::detail {

// The sizes one rank works with, after validation.
struct EpShape {
  int64_t W = 0;     // ep_world_size
  int64_t rank = 0;  // ep_rank_id
  int64_t E = 0;     // moe_expert_num
  int64_t L = 0;     // local experts per rank: E / W (S == 0 in this build)
  int64_t BS = 0;    // tokens on this rank
  int64_t K = 0;     // top-k
  int64_t H = 0;     // hidden size
  int64_t G = 0;     // global_bs, or BS * W when global_bs is 0
  int64_t A = 0;     // most rows this rank can receive: G * min(L, K)
  DType dtype = DType::kBF16;
};

// Checks the EpConfig fields against this build's slice of the SPEC (see dispatch.h): kUnsupported
// for values the SPEC allows but this build does not implement, kInvalidArgument otherwise.
// `comm_rank` / `comm_size` are group_ep's.
void check_ep_config(const char* op, const EpConfig& cfg, int comm_rank, int comm_size);

// expert_ids: int32 (BS, K), 1 <= K <= E, each id in [0, E) or -1, the ids >= 0 of a row distinct.
//   "dispatch_v2: expert_ids[3,1] = 300 is outside [0, 64) (or -1 for an inactive entry)"
//   "dispatch_v2: expert_ids[2,*] repeats expert 5 (slots 0 and 3)"
void check_expert_ids(const char* op, const TensorView& expert_ids, int64_t BS, int64_t E);

// expert_scales: fp32 (BS, K), any non-negative strides.
void check_expert_scales(const char* op, const TensorView& expert_scales, int64_t BS, int64_t K);

// Fills shape.G and shape.A from the other fields and global_bs (local checks only: global_bs a
// multiple of W; global_bs >= W * max BS needs every rank's BS and is checked after the header
// exchange); kUnsupported when A or BS*K do not fit int32 (ep_recv_counts is
// int32) or one row exceeds INT_MAX bytes (an MPI count).
void compute_capacity(const char* op, int64_t global_bs, EpShape& shape);

// What this rank sends in dispatch_v2 (and receives back in combine_v2): every active entry
// (i, k), flattened as i*K+k, grouped by destination rank, then by the destination's local expert,
// then by increasing flat index (SPEC §1.4 row order, sender side).
struct SendPlan {
  std::vector<int64_t> order;        // flat entry indices in send order (active entries only)
  std::vector<int64_t> rank_offset;  // W+1: entries for rank d are order[rank_offset[d], [d+1])
  std::vector<int32_t> counts;       // W*L: entries for (rank d, local expert l) at [d*L + l]
};
SendPlan plan_sends(const TensorView& expert_ids, int64_t W, int64_t L);

// What this rank receives in dispatch_v2 (and sends back in combine_v2), as blocks (local expert
// l, source rank s) in expert-major order (SPEC §1.4).
struct RecvPlan {
  std::vector<int32_t> inclusive;     // W*L: ep_recv_counts, inclusive running sum at [l*W + s]
  std::vector<int64_t> block_offset;  // W*L: first row of block (l, s) at [l*W + s]
  std::vector<int32_t> block_rows;    // W*L: rows of block (l, s) at [l*W + s]
  std::vector<int64_t> source_rows;   // W: rows from (or back to) source rank s
  int64_t valid = 0;                  // total rows
};
// From the counts each source sent: from_source[s*L + l] = rows source s sends for local expert l.
RecvPlan plan_recvs_from_counts(const std::vector<int32_t>& from_source, int64_t W, int64_t L);
// From combine_v2's ep_send_counts (dispatch's ep_recv_counts): int32 (W*L,), non-negative,
// non-decreasing; at most `capacity` rows (expand_x.shape[0]).
RecvPlan plan_recvs_from_inclusive(const char* op, const TensorView& ep_send_counts, int64_t W,
                                   int64_t L, int64_t capacity);

}  // namespace moe_ep::detail
