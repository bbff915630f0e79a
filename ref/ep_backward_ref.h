// Naive reference of dispatch_v2_backward / combine_v2_backward (SPEC §6), the test oracle: from
// the formulas, over the layout dispatch_reference gives (assist_info: which (source, token, slot)
// each row holds), independent of src/ (no shared code), never optimised.
#pragma once

#include <cstdint>
#include <vector>

#include "ref/ep_ref.h"

namespace moe_ep::ref {

// dispatch_v2_backward on every rank: grads[d] holds rank d's grad_expand_x rows (the valid rows of
// dispatched[d], x's dtype, contiguous). Per active token i of rank r, in fp32: the rows made from
// it, each as fp32: its active MoE entries in k order, then its shared-expert copies in s order;
// G == 0: acc = 0, acc += each row; G > 0 (comm_alg "hierarchy", nodes of G ranks): for each
// node in increasing order holding any of those rows, p = 0, p += its rows in that order, acc +=
// p. Rounded once; inactive tokens give 0. Returns each rank's (BS, H).
std::vector<std::vector<unsigned char>> dispatch_backward_reference(
    const std::vector<EpRankInput>& ranks, const EpWorld& world,
    const std::vector<EpRankDispatch>& dispatched,
    const std::vector<std::vector<unsigned char>>& grads, int64_t G);

struct CombineBackwardRef {
  std::vector<unsigned char> grad_expand_x;  // (valid, H) of this rank as an owner
  std::vector<float> grad_expert_scales;     // (BS, K)
  std::vector<unsigned char> grad_shared_expert_x, grad_ori_x;    // (BS, H)
  std::vector<unsigned char> grad_alpha_1, grad_alpha_2, grad_v;  // (Q, H)
};

// combine_v2_backward on every rank, with grad_out[r] rank r's (BS, H) gradient (x's dtype,
// contiguous) and y_ik = expert(e, x_i), as combine_reference (a shared-expert copy has no weight,
// so its y enters no gradient here). Owner rows: rne(w_ik * g_i) for entry (i, k), g_i for a shared
// copy. grad_expert_scales: a dot product of g_i with y_ik (copy: ori_x[i]; const q:
// fp32(alpha_1[q] * ori_x[i]) + fp32(alpha_2[q] * v[q])) in 16 lanes from +0 (element c to lane c %
// 16), then lane l += lane l + w for w = 8, 4, 2, 1; 0 for inactive entries and zero experts.
// grad_shared_expert_x: g_i on active tokens. grad_ori_x: per token from +0 in k order, copy:
// += fp32(w * g), const: += fp32(fp32(w * alpha_1[q]) * g). The const tables: over the rank's
// const entries in (token, k) order from +0, t = fp32(w * g): alpha_1 += t * ori_x, alpha_2 += t *
// v[q], v += t * alpha_2[q]. All rounded once to x's dtype.
std::vector<CombineBackwardRef> combine_backward_reference(
    const std::vector<EpRankInput>& ranks, const EpWorld& world,
    const std::vector<EpRankDispatch>& dispatched,
    const std::vector<std::vector<unsigned char>>& grad_out, const ExpertFn& expert);

}  // namespace moe_ep::ref
