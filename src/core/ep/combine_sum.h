// Internal: combine_v2's weighted sum (SPEC §2.3 and §2.2), once every expert output row is
// reachable: per active token, in fp32, for k = 0..K-1 (active entries), MoE expert:
// acc += w * y_ik; zero expert: nothing; copy expert: acc += w * ori_x[i]; const expert q:
// c = alpha_1[q] * ori_x[i] + alpha_2[q] * v[q] (each product rounded to fp32, then the sum),
// acc += w * c. Then the hosted shared experts in s order (unweighted), then shared_expert_x.
// Every product is rounded to fp32 before its add (-ffp-contract=off); one final rounding.
// Inactive tokens give 0.
#pragma once

#include <cstdint>
#include <vector>

#include "core/ep/plan.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/tensor.h"

namespace moe_ep::detail {

struct CombineSum {
  const CombineInputs* in = nullptr;  // expert_ids, expert_scales, shared_expert_x, ori_x, consts
  const TensorView* mask = nullptr;   // x_active_mask or null
  const EpShape* sh = nullptr;
  int64_t zero = 0, copy = 0, consts = 0;  // Z, C, Q
  // yrow[i*KS + k]: the row holding y_ik (expand_x's dtype, or int8 with yscale[i*KS + k]).
  const char* const* yrow = nullptr;
  const float* yscale = nullptr;  // comm_quant_mode 2; else null
  char* out = nullptr;            // (BS, H) contiguous, expand_x's dtype
};
void combine_sum(const CombineSum& a);

// comm_alg "hierarchy" (SPEC §3) at the source: per active token, acc = 0; for each node n in
// increasing order: this rank's own node adds its partial p = 0 + its terms there in §2.3's
// order (the entries of experts on the node and the special experts, k ascending, then the
// hosted shared experts on the node, s ascending); another node adds its relay's partial (fp32,
// or int8 * scale) when the token has a term there. Then shared_expert_x; one rounding.
struct NodePartials {
  int64_t G = 0, node = 0, rank = 0;  // ranks per node, this rank's node and rank
  bool int8 = false;                  // partials as int8 rows with scales
  DType dtype = DType::kF32;          // else their dtype (EpConfig::partials)
  // Per node: its tokens with a term there, increasing, and their partials in that order.
  std::vector<const std::vector<int32_t>*> tokens;
  std::vector<const char*> rows;
  std::vector<const float*> scales;
  // This node's partials (BS, H) by own_node_partials, computed while the others' were on the
  // wire; null: computed here.
  const float* own = nullptr;
};
void combine_sum_nodes(const CombineSum& a, const NodePartials& np);
// This node's partial of each active token in [first, last) to own + i * H (fp32).
void own_node_partials(const CombineSum& a, const NodePartials& np, int64_t first, int64_t last,
                       float* own);

// A relay's partial of one token of one source for its node (SPEC §3): p = 0, then for each of the
// token's rows on the node in flat (slot) order, p += w * y (a MoE slot, slot < K) or p += y (a
// shared expert). Rows are `dtype`, or int8 with `scale` (comm_quant_mode 2). p has H floats.
struct PartialTerm {
  const char* row;
  float weight;  // unused for a shared expert
  float scale;   // int8 rows only
  bool shared;
};
void relay_partial(float* p, const PartialTerm* terms, int64_t n, DType dtype, bool int8,
                   int64_t H);

// Row i of shared_expert_x: 2-D (BS, H), or 3-D (a, b, H) with a*b = BS.
const char* shared_row(const TensorView& t, int64_t i);

}  // namespace moe_ep::detail
