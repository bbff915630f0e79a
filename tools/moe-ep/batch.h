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
//   __metadata__    moe_expert_num, seed, preset, routing (strings; informative except
//                   moe_expert_num, which must match, and seed, the default --seed on loading:
//                   with a loaded batch the seed only generates the swiglu expert weights).
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
  std::map<std::string, std::string> metadata;
  std::optional<uint64_t> seed;  // metadata "seed", parsed by load_routing
};

void save_routing(const std::string& path, const Batch& batch);
// Throws moe_ep::Error(kInvalidArgument) naming the file when a tensor is missing or its shape
// or dtype is wrong, when x or expert_scales holds a NaN or an infinity ("routing file 'F':
// expert_scales[3,0] = nan is not finite") or when metadata seed is not an unsigned integer.
Batch load_routing(const std::string& path);
void save_output(const std::string& path, const std::vector<std::byte>& output, int64_t tokens,
                 int64_t hidden, moe_ep::DType dtype);

// Token counts of W ranks for N tokens: batch.tokens_per_rank when it has W entries summing to N,
// else the even split.
std::vector<int64_t> split_tokens(int64_t tokens, const std::vector<int64_t>& tokens_per_rank,
                                  int64_t world);

}  // namespace moe_ep_tool
