// moe-ep tool: the global batch of one run (all ranks' tokens in rank order) and its
// safetensors files.
//
// Routing file (--save-routing / --load-routing):
//   expert_ids      I32 (N, K)
//   expert_scales   F32 (N, K)
//   x               BF16/F16/F32 (N, H), the run's dtype
//   tokens_per_rank I64 (W), optional: rank r's consecutive slice; without it (or when its
//                   length is not the loading run's W) the N tokens are split evenly, the first
//                   N % W ranks getting one more.
//   x_active_mask   BOOL (N) or (N, K), optional (--mask): SPEC §1.3's x_active_mask of all
//                   tokens; each rank takes the rows of its slice.
//   __metadata__    moe_expert_num, zero_expert_num, copy_expert_num, const_expert_num, seed,
//                   preset, routing, mask (strings; informative except the expert counts, which
//                   must match the loading run's, and seed, the default --seed on loading: with a
//                   loaded batch the seed only generates the expert weights and the const
//                   experts' alpha_1, alpha_2, v).
// Loading rejects non-finite values in x and expert_scales and a seed that is not an unsigned
// integer.
// Output file (--save-output): `output` (N, H) in x's dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "moe_ep/tensor.h"

namespace moe_ep_tool {

struct Batch {
  int64_t tokens = 0;  // N
  int64_t hidden = 0;  // H
  int64_t top_k = 0;   // K
  moe_ep::DType dtype = moe_ep::DType::kBF16;
  std::vector<std::byte> x;              // (N, H) in dtype
  std::vector<int32_t> expert_ids;       // (N, K)
  std::vector<float> expert_scales;      // (N, K)
  std::vector<int64_t> tokens_per_rank;  // (W) or empty
  int mask_dims = 0;                     // 0: no x_active_mask; 1: (N); 2: (N, K)
  std::vector<uint8_t> x_active_mask;    // 0 or 1
  std::map<std::string, std::string> metadata;
  std::optional<uint64_t> seed;  // metadata "seed", parsed by load_routing
};

void save_routing(const std::string& path, const Batch& batch);
// Throws moe_ep::Error(kInvalidArgument) naming the file when a tensor is missing or its shape
// or dtype is wrong, when x or expert_scales holds a NaN or an infinity ("routing file 'F':
// expert_scales[3,0] = nan is not finite"), when x_active_mask is not (N) or (N, K) bool of 0/1
// values or when metadata seed is not an unsigned integer.
Batch load_routing(const std::string& path);
// load_routing's checks on a file already read (`path` names it in messages).
struct StFile;
Batch routing_from_file(const std::string& path, const StFile& f);
void save_output(const std::string& path, const std::vector<std::byte>& output, int64_t tokens,
                 int64_t hidden, moe_ep::DType dtype);

// Token counts of W ranks for N tokens: batch.tokens_per_rank when it has W entries summing to N,
// else the even split.
std::vector<int64_t> split_tokens(int64_t tokens, const std::vector<int64_t>& tokens_per_rank,
                                  int64_t world);

}  // namespace moe_ep_tool
