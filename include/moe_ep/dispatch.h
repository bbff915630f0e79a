// dispatch_v2 / combine_v2 over MPI: SPEC §1 and §2 (torch_npu npu_moe_distribute_dispatch_v2 /
// npu_moe_distribute_combine_v2). Field names are the SPEC's parameter names.
//
// Supported in this build (everything else raises Error(kUnsupported) naming the argument, never a
// wrong answer):
//   tp_world_size 0 or 1; shared_expert_rank_num 0 with shared_expert_num 0 or 1; quant_mode 0;
//   comm_quant_mode 0; comm_alg "" or "fullmesh"; zero/copy/const_expert_num 0; no x_active_mask,
//   elastic_info, performance_info, scales, shared_expert_x, ori_x, const_expert_*;
//   expert_shard_type 0; expert id -1 = inactive entry; global_bs 0 (BS equal on all ranks) or
//   global_bs = W * m with m >= max BS (BS may differ, BS = 0 allowed); expert_token_nums_type 0, 1.
//
// Both ops are collective over group_ep: every rank of it must call them, in the same order. Before
// moving data, the ranks exchange a small header; a rank whose arguments fail validation throws
// Error(kInvalidArgument) and every other rank throws Error(kRemote) carrying that message, so a
// mistake on one rank never hangs the others. Ranks that disagree on ep_world_size, moe_expert_num,
// global_bs (or any other argument SPEC §1.3 requires equal) all throw Error(kInvalidArgument).
// Every wait has the communicator's deadline (Error(kTimeout) names rank, peer and phase).
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
  Communicator* group_ep = nullptr;  // [in] not owned; group_ep->size() must equal ep_world_size
  int64_t ep_world_size = 0;         // W >= 1
  int64_t ep_rank_id = 0;            // r in [0, W); must equal group_ep->rank()
  int64_t moe_expert_num = 0;        // E >= 1, E % (W - S) == 0
  Communicator* group_tp = nullptr;  // TP: unsupported in this build (must be null)
  int64_t tp_world_size = 0;         // 0 or 1 (2: unsupported in this build)
  int64_t tp_rank_id = 0;            // 0
  int64_t expert_shard_type = 0;     // 0
  int64_t shared_expert_num = 1;     // Ns: 0 or 1 with S == 0 in this build
  int64_t shared_expert_rank_num = 0;  // S: 0 in this build
  int64_t global_bs = 0;             // 0 (BS equal on all ranks) or W * m, m >= max BS over ranks
  std::string comm_alg;              // "" or "fullmesh" ("hierarchy": unsupported)
  int64_t zero_expert_num = 0;       // Z (unsupported when > 0 in this build)
  int64_t copy_expert_num = 0;       // C (unsupported when > 0)
  int64_t const_expert_num = 0;      // Q (unsupported when > 0)
};

// SPEC §1.3.
struct DispatchInputs {
  TensorView x;           // [in] (BS, H) bf16/fp16/fp32; rows may be strided, stride(1) == 1
  TensorView expert_ids;  // [in] (BS, K) int32, any strides; each id in [0, E) or -1 (inactive);
                          //      the non-negative ids of a row are distinct
  std::optional<TensorView> expert_scales;     // [in] (BS, K) fp32 -> expand_scales
  std::optional<TensorView> scales;            // quant smoothing: unsupported in this build
  std::optional<TensorView> x_active_mask;     // unsupported in this build
  std::optional<TensorView> elastic_info;      // unsupported in this build
  std::optional<TensorView> performance_info;  // unsupported in this build
  int64_t quant_mode = 0;                      // 0 (2: unsupported in this build)
  int64_t expert_token_nums_type = 1;          // 0 = running sum, 1 = per-expert count
};

// SPEC §1.4. A = G * min(L, K) with G = global_bs, or BS * W when global_bs is 0.
struct DispatchOutputs {
  Tensor expand_x;        // (A, H), x's dtype; the first ep_recv_counts[W*L-1] rows are valid,
                          // in the SPEC §1.4 order (local expert, source rank, entry i*K+k);
                          // the rest is zero
  Tensor dynamic_scales;  // undefined for quant_mode 0
  Tensor assist_info_for_combine;  // (max(BS*K, A*128),) int32: (source rank, token, slot) per row
  Tensor expert_token_nums;        // (L,) int64
  Tensor ep_recv_counts;           // (W*L,) int32, inclusive running sum over (expert, source)
  Tensor tp_recv_counts;           // (1,) int32: the number of valid rows
  Tensor expand_scales;            // (A,) fp32: expert_scales of each row (0 when not given)
};

MOE_EP_API DispatchOutputs dispatch_v2(const DispatchInputs& in, const EpConfig& cfg);

// SPEC §2.1. expand_x holds the expert outputs, row for row in dispatch's layout.
struct CombineInputs {
  TensorView expand_x;                  // [in] (A', H) bf16/fp16/fp32 with A' >= valid rows
  TensorView expert_ids;                // [in] (BS, K) int32: the same as given to dispatch_v2
  TensorView assist_info_for_combine;   // [in] from dispatch_v2
  TensorView ep_send_counts;            // [in] dispatch_v2's ep_recv_counts
  TensorView expert_scales;             // [in] (BS, K) fp32 top-K weights
  std::optional<TensorView> tp_send_counts;       // unsupported (TP) in this build
  std::optional<TensorView> x_active_mask;        // unsupported in this build
  std::optional<TensorView> expand_scales;        // [in] accepted and ignored (hierarchy only)
  std::optional<TensorView> shared_expert_x;      // unsupported in this build
  std::optional<TensorView> elastic_info;         // unsupported in this build
  std::optional<TensorView> ori_x;                // unsupported in this build
  std::optional<TensorView> const_expert_alpha_1;  // unsupported in this build
  std::optional<TensorView> const_expert_alpha_2;  // unsupported in this build
  std::optional<TensorView> const_expert_v;        // unsupported in this build
  std::optional<TensorView> performance_info;      // unsupported in this build
  int64_t comm_quant_mode = 0;                     // 0 (2: unsupported in this build)
};

// Returns x (BS, H) in expand_x's dtype: SPEC §2.3, for each token, in fp32,
// acc += expert_scales[i,k] * y_ik for k = 0..K-1 (active entries), rounded once to nearest even.
// Bitwise independent of W. Inactive tokens (all ids -1) give 0.
MOE_EP_API Tensor combine_v2(const CombineInputs& in, const EpConfig& cfg);

}  // namespace moe_ep
