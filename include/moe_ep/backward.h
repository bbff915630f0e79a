// The backward of dispatch_v2 and combine_v2 (SPEC §6): dispatch and combine are each other's
// transpose, so each backward runs the other op's route over the forward's handle (SPEC §7): no
// layout is exchanged, only rows (and, for grad_expert_scales, one fp32 per row).
//
// Both ops are collective over cfg.group_ep like the forward ones, with their agreement, deadlines
// and errors (kInvalidArgument on this rank, kRemote on the others, kTimeout naming the rank and
// phase; include/moe_ep/dispatch.h). cfg must be the forward's EpConfig (every field), and
// `handle` the DispatchHandle that dispatch_v2 returned (required: kInvalidArgument when absent or
// not defined). Supported: everything the forward supports (tp_world_size 2 too) except a
// handle whose dispatch had elastic_info or quant_mode 2 (kUnsupported: int8 rows have no
// gradient, SPEC §6) and performance_info (not an argument here). comm_quant_mode is combine's
// and not in the handle: these ops compute the gradient of the unquantised combine (the Python
// front raises Unsupported after a combine with comm_quant_mode 2).
#pragma once

#include <cstdint>
#include <optional>

#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "moe_ep/export.h"
#include "moe_ep/tensor.h"

namespace moe_ep {

struct DispatchBackwardInputs {
  // [in] (R, H), bf16/fp16/fp32 (grad_x comes back in this dtype: pass x's), R >= the valid
  // rows of the handle's dispatch (with tp_world_size 2 its own and its TP peer's); rows may be
  // strided, stride(1) == 1. The gradient of expand_x, row for row in dispatch's layout; rows past
  // the valid ones are not read.
  TensorView grad_expand_x;
  TensorView expert_ids;                    // [in] (BS, K) int32: the dispatch's (checked)
  std::optional<TensorView> x_active_mask;  // [in] the dispatch's (checked)
  const DispatchHandle* handle = nullptr;   // [in] required; not owned
  // A bad argument the caller found before the call (as DispatchInputs::caller_error).
  std::optional<Error> caller_error;
};

// SPEC §6: grad_x (BS, H) in grad_expand_x's dtype: for each active token i, in fp32 from +0,
// the rows dispatch made from token i (its active MoE entries in k order, then its shared-expert
// copies in s order), each added as fp32, rounded once to nearest even; inactive tokens and
// special-expert entries (never sent) give nothing. With comm_alg "hierarchy" the terms on each
// node are summed first and the nodes' sums added in node order (SPEC §3's re-association, as
// combine_v2 does). With tp_world_size 2, grad_expand_x holds this rank's rows then its TP peer's
// (dispatch_v2's layout), and each of this rank's rows first becomes rne(fp32(the row on TP rank
// 0) + fp32(its copy on TP rank 1)) (combine_v2's reduce-scatter, the all-gather's transpose).
// It moves the bytes of combine_v2. Collective over cfg.group_ep (and group_tp).
MOE_EP_API Tensor dispatch_v2_backward(const DispatchBackwardInputs& in, const EpConfig& cfg);

struct CombineBackwardInputs {
  TensorView grad_out;  // [in] (BS, H), expand_x's dtype; rows may be strided, stride(1) == 1
  // [in] (R, H): the expert outputs the forward combine_v2 was given (the y rows), R >= the valid
  // rows, any row stride, stride(1) == 1
  TensorView expand_x;
  TensorView expert_ids;                    // [in] (BS, K) int32: the dispatch's (checked)
  TensorView expert_scales;                 // [in] (BS, K) fp32: the forward's weights
  std::optional<TensorView> x_active_mask;  // [in] the dispatch's (checked)
  // Whether the forward was given shared_expert_x: then grad_shared_expert_x is returned.
  bool shared_expert_x = false;
  // [in] the forward's, required when copy_expert_num > 0 or const_expert_num > 0 (as in
  // combine_v2): (BS, H) and (Q, H), expand_x's dtype, any row stride.
  std::optional<TensorView> ori_x;
  std::optional<TensorView> const_expert_alpha_1;
  std::optional<TensorView> const_expert_alpha_2;
  std::optional<TensorView> const_expert_v;
  const DispatchHandle* handle = nullptr;  // [in] required; not owned
  std::optional<Error> caller_error;       // as DispatchInputs::caller_error
};

// SPEC §6. All in expand_x's dtype unless said otherwise; undefined (defined() == false) when the
// forward had no such input.
struct CombineBackwardOutputs {
  // (R, H), R = expand_x.shape[0]: the row of entry (i, k) is rne(expert_scales[i,k] *
  // fp32(grad_out[i])), a shared-expert copy's row is grad_out[i]; rows past the valid ones 0.
  // With tp_world_size 2 the TP peer's rows (after this rank's) likewise, from the peer group's
  // grad_out: each partial's gradient is the sum's.
  Tensor grad_expand_x;
  // (BS, K) fp32: dot(fp32(grad_out[i]), fp32(y_ik)) in the order of permute.h's grad_probs (16
  // lanes, then a pairwise fold; y_ik with tp_world_size 2: the pair's rounded sum, as combine_v2
  // weighted it, formed again by the same reduce-scatter of expand_x, which must then hold the
  // pair's rows), computed on the rank that holds y_ik (one fp32 travels back);
  // copy expert: dot(grad_out[i], ori_x[i]); const expert q: dot(grad_out[i], c) with c the fp32
  // value combine_v2 forms (fp32(alpha_1[q] * ori_x[i]) + fp32(alpha_2[q] * v[q])); 0 for an
  // inactive entry and a zero expert.
  Tensor grad_expert_scales;
  // (BS, H): grad_out on active tokens, 0 elsewhere (the forward's shared_expert_x shape is
  // (BS, H) or (a, b, H): reshape as needed).
  Tensor grad_shared_expert_x;
  // (BS, H): per token, in fp32 from +0, in k order over its copy and const entries, w =
  // expert_scales[i,k]: copy: fp32(w * g); const q: fp32(fp32(w * alpha_1[q]) * g), g =
  // fp32(grad_out[i]) element by element; rounded once (0 for tokens without such entries).
  // Defined when copy_expert_num > 0 or const_expert_num > 0.
  Tensor grad_ori_x;
  // (Q, H) each, defined when const_expert_num > 0: per const expert q, over THIS rank's entries
  // routed to q in (token, k) order, in fp32 from +0, with t = fp32(w * g): alpha_1 adds
  // fp32(t * ori_x[i]), alpha_2 adds fp32(t * v[q]), v adds fp32(t * alpha_2[q]); rounded once.
  // Each rank's tables enter only its own tokens' sums, so each rank gets its own tokens'
  // gradient (sum them over ranks, as for any replicated parameter, when the tables are shared).
  Tensor grad_const_expert_alpha_1;
  Tensor grad_const_expert_alpha_2;
  Tensor grad_const_expert_v;
};

// SPEC §6: grad_out travels dispatch_v2's route (a cached dispatch of the handle: the same bytes as
// dispatch_v2), the rank holding y_ik forms its grad_expand_x row and the dot product, and the dot
// products (one fp32 per row) go back to the sources. The results are the same bits for comm_alg
// "fullmesh" and "hierarchy" and either transport. Collective over cfg.group_ep.
MOE_EP_API CombineBackwardOutputs combine_v2_backward(const CombineBackwardInputs& in,
                                                      const EpConfig& cfg);

}  // namespace moe_ep
