// Internal: expert placement and the count/offset layouts of dispatch_v2 and combine_v2 (SPEC
// §1.2-§1.4): who sends which rows where. Pure computation: no MPI here.
#pragma once

#include <cstdint>
#include <vector>

#include "moe_ep/dispatch.h"
#include "moe_ep/tensor.h"

namespace moe_ep::detail {

// Expert placement over the W ranks of the (possibly scaled-in) EP group (SPEC §1.2): ranks
// [0, S) host the shared experts, MoE expert e lives on rank S + e / L with local index e % L.
// Count blocks (what a source tells a destination) are indexed by `block`: the S shared-expert
// ranks first (one block each), then MoE expert e at S + e; rank d's blocks are
// [block_base(d), block_base(d) + local_experts(d)).
struct Placement {
  int64_t W = 1;   // ranks
  int64_t S = 0;   // shared-expert ranks
  int64_t Ns = 0;  // shared experts HOSTED by ranks [0, S): shared_expert_num when S > 0, else 0
  int64_t E = 1;   // MoE experts
  int64_t L = 1;   // MoE experts per MoE rank: E / (W - S)
  int64_t special = 0;  // Z + C + Q: ids [E, E + special) are evaluated by combine_v2 locally

  int64_t local_experts(int64_t d) const { return d < S ? 1 : L; }
  int64_t block_base(int64_t d) const { return d < S ? d : S + (d - S) * L; }
  int64_t blocks() const { return S + E; }
  // The rank to which rank r sends its tokens for shared expert s (SPEC §1.2).
  int64_t shared_dest(int64_t r, int64_t s) const { return r % (S / Ns) + s * (S / Ns); }
  // The global id of local expert l on rank d: a MoE id, or -1 - s for shared expert s.
  int64_t expert_on(int64_t d, int64_t l) const {
    return d < S ? -1 - d / (S / Ns) : (d - S) * L + l;
  }
};
Placement make_placement(int64_t W, int64_t S, int64_t shared_expert_num, int64_t E,
                         int64_t special);

// Which entries and tokens take part (SPEC §1.3, §1.6): entry (i, k) is active when
// expert_ids[i,k] != -1 and x_active_mask allows it (1-D: mask[i]; 2-D: mask[i,k]); a token is
// active when at least one of its entries is. Only active tokens go to the shared experts and
// get a non-zero combine output.
// Element (i) of a 1-D or (i, j) of a 2-D bool view, any strides.
inline bool bool_at(const TensorView& t, int64_t i, int64_t j) {
  const int64_t off = i * t.strides[0] + (t.ndim > 1 ? j * t.strides[1] : 0);
  return static_cast<const uint8_t*>(t.data)[off] != 0;
}

struct Activity {
  const TensorView* ids = nullptr;
  const TensorView* mask = nullptr;  // null: no mask
  bool entry(int64_t i, int64_t k) const;
  bool token(int64_t i) const;
};

// The sizes one rank works with, after validation.
struct EpShape {
  int64_t W = 0;     // ep_world_size (after scale-in: the new W)
  int64_t rank = 0;  // ep_rank_id (after scale-in: the new rank)
  int64_t E = 0;     // moe_expert_num
  int64_t L = 0;     // local experts of THIS rank: 1 on a shared-expert rank, else E / (W - S)
  int64_t BS = 0;    // tokens on this rank
  int64_t K = 0;     // top-k
  int64_t KS = 0;    // slots per token: K + the hosted shared experts (Placement::Ns)
  int64_t H = 0;     // hidden size
  int64_t G = 0;     // global_bs, or BS * W when global_bs is 0
  int64_t A = 0;     // most rows this rank can receive (SPEC §1.4)
  DType dtype = DType::kBF16;
  Placement pl;
};

// What rank `rank` sends in dispatch_v2 (and receives back in combine_v2): every active entry
// (i, k) whose id is a MoE expert, and one copy (i, K + s) of every active token for each hosted
// shared expert s, flattened as i*KS + slot, grouped by destination rank, then by the
// destination's local expert, then by increasing flat index (SPEC §1.4 row order, sender side).
struct SendPlan {
  int64_t KS = 0;                    // slots per token
  std::vector<int64_t> order;        // flat indices i*KS + slot in send order
  std::vector<int64_t> rank_offset;  // W+1: entries for rank d are order[rank_offset[d], [d+1])
  std::vector<int32_t> counts;       // Placement::blocks(): entries per block
};
SendPlan plan_sends(const Activity& act, const Placement& pl, int64_t rank);

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
