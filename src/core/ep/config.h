// Internal: the arguments of dispatch_v2 and combine_v2 checked on one rank (SPEC §1.3, §2.1),
// and what follows from them alone: the world the op runs on (all of group_ep, or the survivors
// of a scale-in, SPEC §1.7), the sizes (EpShape) and the transport. Each check throws
// Error(kInvalidArgument) (or kUnsupported for what this build does not implement) naming the op,
// the argument, the value and the bound; docs/errors.md lists them.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <utility>
#include <vector>

#include "core/ep/plan.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/tensor.h"

namespace moe_ep::detail {

// Checks the EpConfig fields against the SPEC (see dispatch.h): kUnsupported for values the SPEC
// allows but this build does not implement, kInvalidArgument otherwise. `comm_rank` /
// `comm_size` are group_ep's. W, S and E are checked for the world the op runs on (after a
// scale-in: the new values, see check_placement).
void check_ep_config(const char* op, const EpConfig& cfg, int comm_rank, int comm_size);
// W >= 1, S in [0, W), Ns in [0, 4] with a valid (Ns, S) combination, E >= 1, E % (W - S) == 0.
// `what` names where the values come from ("" or " (elastic_info)").
void check_placement(const char* op, int64_t W, int64_t S, int64_t Ns, int64_t E, const char* what);

// expert_ids: int32 (BS, K), 1 <= K <= E + special, each id in [0, E + special) or -1, the ids
// >= 0 of a row distinct.
//   "dispatch_v2: expert_ids[3,1] = 300 is outside [0, 64) (or -1 for an inactive entry)"
//   "dispatch_v2: expert_ids[2,*] repeats expert 5 (slots 0 and 3)"
void check_expert_ids(const char* op, const TensorView& expert_ids, int64_t BS, int64_t E,
                      int64_t special);

// x_active_mask: bool (BS,) with all Trues before all Falses, or bool (BS, K); any strides.
void check_active_mask(const char* op, const TensorView& mask, int64_t BS, int64_t K);
// True when the mask leaves every token active (SPEC §1.3): 1-D, every element True; 2-D, every
// row with a True.
bool mask_tokens_active(const TensorView& mask);

// expert_scales: fp32 (BS, K), any non-negative strides.
void check_expert_scales(const char* op, const TensorView& expert_scales, int64_t BS, int64_t K);

// Fills shape.G and shape.A from the other fields and global_bs (A = G * min(L, K) on a MoE rank,
// (G / W) * ceil(W / (S / Ns)) on a shared-expert rank) (local checks only: global_bs a
// multiple of W; global_bs >= W * max BS needs every rank's BS and is checked after the header
// exchange); kUnsupported when A or BS*K do not fit int32 (ep_recv_counts is
// int32) or one row exceeds INT_MAX bytes (an MPI count).
void compute_capacity(const char* op, int64_t global_bs, EpShape& shape);

// cfg.group_ep, or kInvalidArgument "<op>: group_ep is null".
const Communicator& require_comm(const char* op, const EpConfig& cfg);

// Optional arguments outside this build's slice: kUnsupported naming the first one given.
void reject_given(const char* op, std::initializer_list<std::pair<const char*, bool>> given);

// comm_alg "hierarchy" (SPEC §3) runs without elastic_info and performance_info: kUnsupported
// naming the one given ("hierarchy" named). Nothing for fullmesh.
void check_hierarchy_scope(const char* op, const EpConfig& cfg, bool elastic_info,
                           bool performance_info);

// The route of an op after its header agreement: comm_alg "hierarchy" across nodes gives G, the
// ranks per node (transport/nodes.h: collective over group_ep, kInvalidArgument for unequal
// nodes); fullmesh, or every rank on one node, gives 0 (the fullmesh route, SPEC §3).
int relay_nodes(const Communicator& comm, const char* op, const EpConfig& cfg, int shm_node_ranks);

// The ranks an op runs on: all of group_ep, or the survivors of a scale-in (SPEC §1.7).
struct World {
  int64_t W = 1, S = 0, E = 1, rank = 0;  // of the (new) world
  std::vector<int> peers;                 // new rank -> group_ep rank
  bool removed = false;                   // this rank was scaled in: it takes no part
  int64_t hash = 0;                       // of the table when scaled down, else 0
};

// All of group_ep: the world of an op whose arguments failed before elastic_info was read.
World whole_world(const Communicator& comm);
// The world of cfg and elastic_info: int32 (4 + 2W,) [is_scaled_down, new W, new S, new E,
// W x old->new (-1 removed), W x new->old (-1 padding)], checked for consistency.
World resolve_world(const char* op, const EpConfig& cfg, const std::optional<TensorView>& elastic);

// performance_info: int64 (W,), W = ep_world_size (group_ep's ranks); null when not given.
int64_t* perf_ptr(const char* op, const std::optional<TensorView>& perf, const EpConfig& cfg);

// The sizes every op derives from the world and its token tensor (K, KS, G and A are set later).
EpShape local_shape(const EpConfig& cfg, const World& w, int64_t BS, int64_t H, DType dtype);

// Rows of expand_x (and expand_scales, dynamic_scales): max(1, T) * A.
inline int64_t tp_rows(const EpConfig& cfg, int64_t A) {
  return cfg.tp_world_size == 2 ? 2 * A : A;
}

// EpConfig::transport as the ops carry it in their header (0: not resolved, the op failed before).
enum TransportCode : int64_t { kTransportMpi = 1, kTransportShm = 2 };
// EpConfig::transport, or $MOE_EP_TRANSPORT when it is "" (default "shm").
int64_t resolve_transport(const char* op, const EpConfig& cfg);

// Whether the bytes two views address (non-negative strides) share any: a caller's output must
// not be one of the op's inputs.
bool overlap(const TensorView& a, const TensorView& b);

// v as an int (0 <= v <= INT_MAX: an MPI count; kInternal otherwise).
int to_int(int64_t v);

}  // namespace moe_ep::detail
