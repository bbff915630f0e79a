// Internal: tensor parallelism, tp_world_size 2 (SPEC §1.1 step 3, §2).
// A TP pair (group_tp, 2 ranks) is the same EP rank (same expert, L = 1) of two EP groups.
// dispatch_v2 appends the peer's rows after this rank's own, PACKED: own rows [0, valid_own), the
// peer's [valid_own, valid_own + valid_peer), unspecified up to 2A; ep_recv_counts (2W,) is ONE
// inclusive running sum (the second W entries continue from valid_own and describe the peer's
// blocks by source rank). combine_v2 reduce-scatters the partial outputs over the pair, then runs
// the EP all-to-all on the sums. Tags distinct from the EP phases'.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "core/ep/config.h"
#include "core/ep/header.h"
#include "core/ep/plan.h"
#include "moe_ep/dispatch.h"

namespace moe_ep::detail {

// This rank takes part in a TP pair (the arguments may still fail validation).
bool tp_pair(const EpConfig& cfg);
// Scale-in with TP is not implemented: checked before a removed rank would leave. Every rank of
// group_ep, removed ones included, then reports the error through the agreement of the whole
// (old) world, and the TP header, so that no rank waits for another.
void reject_tp_scale_in(const char* op, const Communicator& comm, const EpConfig& cfg, World& w);

// What the two ranks of a TP pair tell each other before the EP header agreement.
struct TpHeader {
  int32_t magic = 0x4d4f5450;  // "MOTP"
  int32_t op = 0;
  int32_t ok = 1;
  int32_t kind = 0;
  int64_t ep_rank_id = 0, ep_world_size = 0, moe_expert_num = 0, shared_expert_rank_num = 0, H = 0,
          dtype = 0, A = 0;
  int64_t own_rows = -1, peer_rows = -1;  // combine_v2: the valid rows of each half of expand_x
  char message[400] = {};
};

TpHeader tp_header(const EpConfig& cfg, const EpShape& sh, int64_t own_rows, int64_t peer_rows);

// Exchanges TpHeaders with the TP peer (phase "tp header", the communicator's deadline). A
// failure on either rank, or a disagreement within the pair, becomes a local failure of both
// ranks (kRemote naming the peer's message, or kInvalidArgument), so the EP header agreement that
// follows carries it to both EP groups: no rank is left waiting for data. mine.peer_rows -1: this
// rank does not know its peer's rows (combine_v2 with a handle) and takes them from the peer.
// Returns the peer's own rows (-1 after a failure).
int64_t tp_handshake(const char* op, const EpConfig& cfg, OpHeader& hdr,
                     std::optional<Error>& local, TpHeader mine);

// dispatch_v2's TP all-gather (SPEC §1.1 step 3), after the EP exchange: this rank's `own` valid
// rows with their ep_recv_counts, assist triples, expand_scales (and dynamic_scales when defined)
// go to the TP peer; the peer's land after them. Completes ep_recv_counts (2W entries, the first
// W this rank's), expert_token_nums and tp_recv_counts (2).
void tp_all_gather(const char* op, const EpConfig& cfg, const EpShape& sh, int64_t own,
                   DispatchOutputs& out);

// combine_v2's blocks: with tp_world_size 2 (L = 1), ep_send_counts (2W,) is one inclusive
// running sum over this rank's blocks, then the peer's; returns this rank's blocks and sets
// `peer_rows`. tp_send_counts (optional) must be dispatch_v2's tp_recv_counts.
RecvPlan combine_blocks(const char* op, const EpConfig& cfg, const CombineInputs& in,
                        const EpShape& sh, int64_t& peer_rows);

// combine_v2's TP reduce-scatter (SPEC §2): this rank's partials for the peer's rows
// [own, own + peer_rows) go to the peer; the peer's partials for this rank's rows [0, own) come
// back; rs_out[j] = fp32(partial of tp rank 0) + fp32(partial of tp rank 1), rounded once to the
// dtype (the same bits on both ranks of the pair). Row counts were agreed in the TP header.
std::shared_ptr<Tensor> tp_reduce_scatter(const char* op, const EpConfig& cfg,
                                          const CombineInputs& in, const EpShape& sh, int64_t own,
                                          int64_t peer_rows);

}  // namespace moe_ep::detail
