// Naive single-process reference of dispatch_v2 / combine_v2 (SPEC §1.4, §2.3): the test oracle.
// Written for clarity from the SPEC's wording ("concatenate all ranks' tokens in (rank, token)
// order and stably sort by expert id"), independent of src/ (no shared code), never optimised.
// Covers shared-expert ranks (§1.2), x_active_mask (§1.3, §1.6) and special experts (§2.2); no
// quantisation. TP is tp_layout / tp_sum_expert below; scale-in is composed by the tests (a
// scaled-in world is a fresh smaller world).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "moe_ep/tensor.h"

namespace moe_ep::ref {

// One rank's inputs (views: the caller owns the memory).
struct EpRankInput {
  TensorView x;                               // (BS, H) bf16/fp16/fp32, any row stride
  TensorView expert_ids;                      // (BS, K) int32, -1 = inactive entry
  std::optional<TensorView> expert_scales;    // (BS, K) fp32
  std::optional<TensorView> x_active_mask;    // bool (BS,) or (BS, K)
  std::optional<TensorView> shared_expert_x;  // (BS, H) x's dtype, any row stride
  std::optional<TensorView> ori_x;            // (BS, H) x's dtype (copy / const experts)
};

// The world: E MoE experts on ranks [S, W), Ns shared experts hosted on ranks [0, S) (Ns = 0 when
// S = 0), Z/C/Q special experts (ids [E, E+Z+C+Q), never sent).
struct EpWorld {
  int64_t E = 1;
  int64_t S = 0;
  int64_t Ns = 0;
  int64_t global_bs = 0;
  int64_t Z = 0, C = 0, Q = 0;
  std::optional<TensorView> alpha_1, alpha_2, v;  // (Q, H) x's dtype
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
  std::vector<int64_t> row_expert;          // (valid,) the global expert id of each row; shared
                                            // expert s is -1 - s
};

// ranks[r] is rank r's input; W = ranks.size(); E % (W - S) == 0; global_bs 0 or W * m, m >= max
// BS.
std::vector<EpRankDispatch> dispatch_reference(const std::vector<EpRankInput>& ranks,
                                               const EpWorld& world);
// The world without shared-expert ranks and special experts.
std::vector<EpRankDispatch> dispatch_reference(const std::vector<EpRankInput>& ranks, int64_t E,
                                               int64_t global_bs);

// An expert: writes the H-element output row of expert e for input row `in` (both dtype `dtype`).
using ExpertFn = std::function<void(int64_t e, DType dtype, const void* in, void* out, int64_t H)>;

// The `scale` expert of the tests: expert e multiplies its row by (1 + e/E) in fp32 and rounds once
// to nearest even in the row's dtype.
ExpertFn scale_expert(int64_t E);

// TP (tp_world_size 2, SPEC §1.1 step 3, §1.4): the layout of a rank whose own EP rank received
// `own` (dispatch_reference of its EP group) and whose TP peer received `peer` (the same EP rank of
// the other EP group; L = 1, W = ep_world_size). Own rows first, then the peer's, packed:
// expand_x (2A, H) rows [0, own.valid) own, [own.valid, own.valid + peer.valid) the peer's, zeros
// after; ep_recv_counts (2W,) one inclusive running sum (the peer's W blocks continue from
// own.valid); expert_token_nums both (own + peer); assist_info and expand_scales (2A,) both halves;
// A stays own.A (the capacity per TP rank). tp_recv_counts is [own tp rank] = own.valid,
// [peer] = peer.valid.
EpRankDispatch tp_layout(const EpRankDispatch& own, const EpRankDispatch& peer, int64_t W);

// The TP sum of two partial experts (SPEC §2): fp32(part0(e, x)) + fp32(part1(e, x)) (tp rank 0's
// first), rounded once to nearest even in the row's dtype. The combine result of a TP pair equals
// combine_reference with this expert.
ExpertFn tp_sum_expert(ExpertFn part0, ExpertFn part1);

// SPEC §2.3 per token of every rank: acc = 0 (fp32); for k = 0..K-1 with expert_ids[i,k] != -1
// (and the mask True): MoE expert e: acc += fp32(expert_scales[i,k] * fp32(y_ik)) with
// y_ik = expert(e, x_i); zero expert: nothing; copy expert: acc += w * ori_x[i]; const expert q:
// acc += w * fp32(fp32(alpha_1[q] * ori_x[i]) + fp32(alpha_2[q] * v[q])). Then, for the hosted
// shared experts s = 0..Ns-1, acc += shared(-1 - s, x_i); then shared_expert_x[i]. The output row
// is acc rounded to nearest even in x's dtype; a token with no active entry gives 0. Returns each
// rank's (BS, H) result as bytes. Needs expert_scales. With comm_quant (comm_quant_mode 2, SPEC
// §2.1), each row that travels back (a MoE expert's y_ik, a hosted shared expert's output) enters
// as its dequantised value fp32(q * scale) after quant_ref.h's quantisation without smoothing.
std::vector<std::vector<unsigned char>> combine_reference(const std::vector<EpRankInput>& ranks,
                                                          const EpWorld& world,
                                                          const ExpertFn& expert,
                                                          const ExpertFn& shared,
                                                          bool comm_quant = false);
std::vector<std::vector<unsigned char>> combine_reference(const std::vector<EpRankInput>& ranks,
                                                          const ExpertFn& expert);

// SPEC §3, combine_v2 with comm_alg "hierarchy" on nodes of G ranks (rank r on node r / G): per
// active token of rank r, acc = 0; for each node n in increasing order that holds any of the
// token's terms: p = 0; p += each term on node n in §2.3's order (the MoE experts hosted there,
// and the special experts when n is r's own node, k ascending; then the shared experts r sends
// to a rank there, s ascending); acc += p. Then acc += shared_expert_x[i]; one rounding. MoE
// expert e lives on rank S + e / (E / (W - S)); rank r's shared expert s on rank
// r % (S / Ns) + s * (S / Ns) (SPEC §1.2).
std::vector<std::vector<unsigned char>> combine_reference_hierarchy(
    const std::vector<EpRankInput>& ranks, const EpWorld& world, const ExpertFn& expert,
    const ExpertFn& shared, int64_t G);

}  // namespace moe_ep::ref
