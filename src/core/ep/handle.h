// Internal: what a DispatchHandle holds (SPEC §7): the plan one dispatch_v2 computed, so that the
// combine_v2 of its outputs and a later dispatch_v2 of the same routing (a "cached dispatch")
// exchange rows only, never layout. A plan is immutable once made and shared by every handle
// to it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/ep/config.h"
#include "core/ep/plan.h"
#include "moe_ep/dispatch.h"

namespace moe_ep::detail {

struct EpPlan {
  uint64_t id = 0;  // the dispatch_v2 call that made it, counted per communicator (1, 2, ...)
  uint64_t comm_serial = 0;  // its communicators (CommInternals::serial; tp: 0 without group_tp)
  uint64_t tp_serial = 0;
  // What it is bound to: later calls must pass the same (check_plan).
  EpConfig cfg;  // group_ep, group_tp and the arguments every rank must agree on
  int64_t world_hash = 0;
  int64_t transport = 0;            // TransportCode
  bool may_merge = false;           // tokens may travel once per MPI destination (dispatch.cc)
  std::vector<int32_t> expert_ids;  // (BS, K) row-major copy
  int mask_ndim = 0;                // 0: no x_active_mask
  std::vector<uint8_t> mask;        // its elements, row-major
  EpShape sh;
  // What the backward ops (backward.cc) refuse or need: the dispatch's quant_mode, whether it had
  // elastic_info, and with tp_world_size 2 the TP peer's rows appended to its expand_x.
  int64_t quant_mode = 0;
  bool elastic = false;
  int64_t tp_peer_rows = 0;
  // This rank as a sender (dispatch) and, in combine_v2, as the source the rows come back to.
  SendPlan send;
  // This rank as a receiver (dispatch) and, in combine_v2, as the owner that sends them back.
  RecvPlan recv;
  // Over MPI a token travels once per destination d when distinct[d] is not empty: the
  // send-order entries of each token's first copy to d (dispatch.cc, "merges").
  std::vector<std::vector<int64_t>> distinct;
  std::vector<int32_t> distinct_from;  // per source: rows on the wire
  // For each rank d of this machine (world order; empty for others): the first row, in d's
  // expand_x, of each block this rank sends d (one per local expert of d).
  std::vector<std::vector<int64_t>> block_row;
  // comm_alg "hierarchy" (relay_dispatch.cc): the ranks per node (0: the fullmesh route); as a
  // source, per node, its tokens with a copy there (increasing; empty for its own node); as a
  // relay, per source, the tokens and copies it relays to its node.
  int64_t G = 0;
  std::vector<std::vector<int32_t>> node_tokens;
  std::vector<int32_t> relay_tokens, relay_entries;
  // As a relay, per source: (token, slot, rank, local expert) of each copy it made, in the
  // source's send order: what combine_v2 with the handle gets back from the node's owners.
  std::vector<std::vector<int32_t>> relay_routes;
  // As a relay, for each other rank d of this node (empty for the rest): the first row, in d's
  // expand_x, of each block (l, s) of the source s of node m it relays, at [m * L_d + l] (s = m *
  // G + this rank's local index; the entries of this node are block_row's).
  std::vector<std::vector<int64_t>> relay_block_row;
};

struct HandleInternals {
  static const std::shared_ptr<const EpPlan>& plan(const DispatchHandle& h) { return h.plan_; }
  static DispatchHandle make(std::shared_ptr<const EpPlan> plan) {
    DispatchHandle h;
    h.plan_ = std::move(plan);
    return h;
  }
};

// The next plan id of `comm` (every rank counts its dispatch_v2 calls on it alike).
uint64_t next_plan_id(const Communicator& comm);

// Checks that `plan` belongs to this call: the communicator, the arguments every rank agrees on
// (the resolved transport and the elastic_info hash too), expert_ids and x_active_mask (element
// by element). kInvalidArgument naming what differs, e.g.
// "combine_v2: expert_ids[3,1] = 7 differs from the dispatch_v2 of the handle (5)".
void check_plan(const char* op, const EpPlan& plan, const EpConfig& cfg,
                const TensorView& expert_ids, const TensorView* mask, int64_t transport,
                int64_t world_hash);

// The copies of expert_ids and x_active_mask a plan keeps.
void keep_routing(EpPlan& plan, const TensorView& expert_ids, const TensorView* mask);

}  // namespace moe_ep::detail
