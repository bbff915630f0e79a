// Naive single-process reference of dispatch_v2 / combine_v2 (SPEC §1.4, §2.3): the test oracle.
// Written for clarity from the SPEC's wording ("concatenate all ranks' tokens in (rank, token)
// order and stably sort by expert id"), independent of src/ (no shared code), never optimised.
// Slice of the SPEC: S = 0, T <= 1, no quantisation, no masks, no special experts.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "moe_ep/tensor.h"

namespace moe_ep::ref {

// One rank's inputs (views: the caller owns the memory).
struct EpRankInput {
  TensorView x;                             // (BS, H) bf16/fp16/fp32, any row stride
  TensorView expert_ids;                    // (BS, K) int32, -1 = inactive entry
  std::optional<TensorView> expert_scales;  // (BS, K) fp32
};

// What SPEC §1.4 says one rank receives.
struct EpRankDispatch {
  int64_t A = 0;                            // capacity: G * min(L, K)
  int64_t valid = 0;                        // rows received
  std::vector<unsigned char> expand_x;      // (A, H) in x's dtype, rows >= valid are zero
  std::vector<int32_t> ep_recv_counts;      // (W*L,) inclusive over (local expert, source rank)
  std::vector<int64_t> expert_token_nums0;  // (L,) expert_token_nums_type 0: running sum
  std::vector<int64_t> expert_token_nums1;  // (L,) expert_token_nums_type 1: counts
  std::vector<int32_t> assist_info;         // (max(BS*K, A*128),): (source, token, slot) per row
  std::vector<float> expand_scales;         // (A,) expert_scales of each row, 0 when not given
  std::vector<int64_t> row_expert;          // (valid,) the global expert id of each row
};

// ranks[r] is rank r's input; W = ranks.size(); E % W == 0; global_bs 0 or W * m, m >= max BS.
std::vector<EpRankDispatch> dispatch_reference(const std::vector<EpRankInput>& ranks, int64_t E,
                                               int64_t global_bs);

// An expert: writes the H-element output row of expert e for input row `in` (both dtype `dtype`).
using ExpertFn = std::function<void(int64_t e, DType dtype, const void* in, void* out, int64_t H)>;

// The `scale` expert of the tests: expert e multiplies its row by (1 + e/E) in fp32 and rounds once
// to nearest even in the row's dtype.
ExpertFn scale_expert(int64_t E);

// SPEC §2.3 per token of every rank: acc = 0 (fp32); for k = 0..K-1 with expert_ids[i,k] != -1:
// acc += fp32(expert_scales[i,k] * fp32(y_ik)) with y_ik = expert(e, x_i); the output row is acc
// rounded to nearest even in x's dtype; all-inactive tokens give 0. Returns each rank's (BS, H)
// result as bytes. Needs expert_scales.
std::vector<std::vector<unsigned char>> combine_reference(const std::vector<EpRankInput>& ranks,
                                                          const ExpertFn& expert);

}  // namespace moe_ep::ref
