// Internal: combine_v2's weighted sum (SPEC §2.3 and §2.2), once every expert output row is
// reachable: per active token, in fp32, for k = 0..K-1 (active entries), MoE expert:
// acc += w * y_ik; zero expert: nothing; copy expert: acc += w * ori_x[i]; const expert q:
// c = alpha_1[q] * ori_x[i] + alpha_2[q] * v[q] (each product rounded to fp32, then the sum),
// acc += w * c. Then the hosted shared experts in s order (unweighted), then shared_expert_x.
// Every product is rounded to fp32 before its add (-ffp-contract=off); one final rounding.
// Inactive tokens give 0.
#pragma once

#include <cstdint>

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

// Row i of shared_expert_x: 2-D (BS, H), or 3-D (a, b, H) with a*b = BS.
const char* shared_row(const TensorView& t, int64_t i);

}  // namespace moe_ep::detail
