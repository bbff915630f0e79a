// dispatch_v2 / combine_v2 over MPI: SPEC §1 and §2 (torch_npu npu_moe_distribute_dispatch_v2 /
// npu_moe_distribute_combine_v2). Field names are the SPEC's parameter names.
//
// Supported in this build (everything else raises Error(kUnsupported) naming the argument, never a
// wrong answer):
//   tp_world_size 0 or 1; shared_expert_rank_num 0 with shared_expert_num 0 or 1; quant_mode 0;
//   comm_quant_mode 0; comm_alg "" or "fullmesh"; zero/copy/const_expert_num 0; no x_active_mask,
//   elastic_info, performance_info, scales, shared_expert_x, ori_x, const_expert_*;
//   expert_shard_type 0; expert id -1 = inactive entry; global_bs 0 (BS equal on all ranks) or
//   global_bs = W * m with m >= max BS (BS may differ, BS = 0 allowed); expert_token_nums_type
//   0, 1.
//
// Both ops are collective over group_ep: every rank of it must call them, in the same order. Before
// moving data, the ranks exchange a small header; a rank whose arguments fail validation throws
// its error (kInvalidArgument, or kUnsupported) and every other rank throws Error(kRemote) carrying
// that message, so a mistake on one rank never hangs the others. Ranks that disagree on
// ep_world_size, moe_expert_num, global_bs (or any other argument SPEC §1.3 requires equal) all
// throw Error(kInvalidArgument). Every wait has the communicator's deadline (Error(kTimeout) names
// rank, peer and phase); after a timeout the communicator is unusable. MPI failures raise
// Error(kSystem).
//
// Data flow (docs/design.md): a header exchange, then per-(destination, local expert) counts, then
// one message of rows per peer and direction, described by MPI derived datatypes over x's rows and
// expand_x's blocks (no packing). Row counts and offsets are 64-bit; one message holds at most
// INT32_MAX rows of at most INT_MAX bytes each (Error(kUnsupported) beyond).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "moe_ep/comm.h"
#include "moe_ep/export.h"
#include "moe_ep/tensor.h"

namespace moe_ep {

// The arguments dispatch_v2 and combine_v2 share; they must be equal on all ranks (except
// ep_rank_id and tp_rank_id) and equal between a dispatch and its combine.
struct EpConfig {
  Communicator* group_ep = nullptr;    // [in] not owned; group_ep->size() must equal ep_world_size
  int64_t ep_world_size = 0;           // W >= 1
  int64_t ep_rank_id = 0;              // r in [0, W); must equal group_ep->rank()
  int64_t moe_expert_num = 0;          // E >= 1, E % (W - S) == 0
  Communicator* group_tp = nullptr;    // TP group: ignored (tp_world_size 2 is unsupported)
  int64_t tp_world_size = 0;           // 0 or 1 (2: unsupported in this build)
  int64_t tp_rank_id = 0;              // must be 0
  int64_t expert_shard_type = 0;       // must be 0 (the only placement: expert e on rank e / L)
  int64_t shared_expert_num = 1;       // Ns: 0 or 1 with S == 0 in this build
  int64_t shared_expert_rank_num = 0;  // S: 0 in this build
  int64_t global_bs = 0;  // 0 (BS equal on all ranks) or W * m, m >= max BS over ranks (BS may
                          // then differ across ranks, and be 0)
  std::string comm_alg;   // "" or "fullmesh" ("hierarchy": unsupported)
  int64_t zero_expert_num = 0;   // Z (unsupported when > 0 in this build)
  int64_t copy_expert_num = 0;   // C (unsupported when > 0)
  int64_t const_expert_num = 0;  // Q (unsupported when > 0)
};

// SPEC §1.3.
struct DispatchInputs {
  TensorView x;           // [in] (BS, H) bf16/fp16/fp32, BS >= 0; rows may be strided
                          //      (stride(0) >= 0 any), stride(1) == 1. Read during the call only
  TensorView expert_ids;  // [in] (BS, K) int32, any strides; each id in [0, E) or -1 (inactive);
                          //      the non-negative ids of a row are distinct
  std::optional<TensorView> expert_scales;     // [in] (BS, K) fp32, any strides -> expand_scales
  std::optional<TensorView> scales;            // quant smoothing: unsupported in this build
  std::optional<TensorView> x_active_mask;     // unsupported in this build
  std::optional<TensorView> elastic_info;      // unsupported in this build
  std::optional<TensorView> performance_info;  // unsupported in this build
  int64_t quant_mode = 0;                      // 0 (2: unsupported in this build)
  int64_t expert_token_nums_type = 1;          // 0 = running sum, 1 = per-expert count
};

// SPEC §1.4. A = G * min(L, K) with G = global_bs, or BS * W when global_bs is 0; L = E / W.
// All outputs are newly allocated, contiguous and owned by the returned Tensors.
struct DispatchOutputs {
  Tensor expand_x;        // (A, H), x's dtype; the first ep_recv_counts[W*L-1] rows are valid,
                          // in the SPEC §1.4 order (local expert, source rank, entry i*K+k);
                          // the rest is zero
  Tensor dynamic_scales;  // undefined (defined() == false) for quant_mode 0
  Tensor assist_info_for_combine;  // (max(BS*K, A*128),) int32: [3j, 3j+1, 3j+2] = (source rank,
                                   // source token, top-k slot) of row j; the rest is zero
  Tensor expert_token_nums;        // (L,) int64: rows per local expert (expert_token_nums_type
                                   // 1) or their running sum (type 0)
  Tensor ep_recv_counts;           // (W*L,) int32, inclusive running sum over (expert, source)
  Tensor tp_recv_counts;           // (1,) int32: the number of valid rows
  Tensor expand_scales;            // (A,) fp32: expert_scales of each row (0 when not given,
                                   // and beyond the valid rows)
};

// Collective over cfg.group_ep. Errors: kInvalidArgument (this rank's arguments, or ranks that
// disagree), kUnsupported (outside this build's slice), kRemote (another rank's arguments),
// kTimeout, kSystem. docs/errors.md lists every check.
MOE_EP_API DispatchOutputs dispatch_v2(const DispatchInputs& in, const EpConfig& cfg);

// SPEC §2.1. expand_x holds the expert outputs, row for row in dispatch's layout.
struct CombineInputs {
  TensorView expand_x;                 // [in] (A', H) bf16/fp16/fp32 with A' >= valid rows;
                                       //      rows may be strided, stride(1) == 1. The dtype
                                       //      and H must be equal on all ranks
  TensorView expert_ids;               // [in] (BS, K) int32: the same as given to dispatch_v2
                                       //      (other ids: Error(kInvalidArgument) on this rank)
  TensorView assist_info_for_combine;  // [in] from dispatch_v2, (max(BS*K, A*128),) int32; the
                                       //      source rank of each valid row is checked
  TensorView ep_send_counts;           // [in] dispatch_v2's ep_recv_counts, (W*L,) int32
  TensorView expert_scales;            // [in] (BS, K) fp32 top-K weights, any strides
  std::optional<TensorView> tp_send_counts;        // unsupported (TP) in this build
  std::optional<TensorView> x_active_mask;         // unsupported in this build
  std::optional<TensorView> expand_scales;         // [in] accepted and ignored (hierarchy only)
  std::optional<TensorView> shared_expert_x;       // unsupported in this build
  std::optional<TensorView> elastic_info;          // unsupported in this build
  std::optional<TensorView> ori_x;                 // unsupported in this build
  std::optional<TensorView> const_expert_alpha_1;  // unsupported in this build
  std::optional<TensorView> const_expert_alpha_2;  // unsupported in this build
  std::optional<TensorView> const_expert_v;        // unsupported in this build
  std::optional<TensorView> performance_info;      // unsupported in this build
  int64_t comm_quant_mode = 0;                     // 0 (2: unsupported in this build)
};

// Returns x (BS, H) in expand_x's dtype: SPEC §2.3, for each token, in fp32,
// acc += expert_scales[i,k] * y_ik for k = 0..K-1 (active entries), rounded once to nearest even.
// Bitwise independent of W. Inactive tokens (all ids -1) give 0; entries with id -1 are skipped.
// Collective over cfg.group_ep, with the errors of dispatch_v2.
MOE_EP_API Tensor combine_v2(const CombineInputs& in, const EpConfig& cfg);

}  // namespace moe_ep
