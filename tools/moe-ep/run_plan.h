// moe-ep tool: the plan of `moe-ep run`, everything decided before the first allocation of the
// run's size and the first message: the layer, the ranks (W_ep x T, shared-expert ranks), the
// expert placement (with redundant slots, or advice when E does not divide), the batch split over
// the ranks, the sizes and memory checks, the routing source and what the seed sets.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "batch.h"
#include "experts.h"
#include "moe_ep/tensor.h"
#include "presets.h"
#include "redundant.h"
#include "routing.h"
#include "run.h"

namespace moe_ep_tool {

struct Plan {
  Preset layer;
  moe_ep::DType dtype = moe_ep::DType::kBF16;
  ExpertFn fn = ExpertFn::kSwiglu;
  RoutingKind kind = RoutingKind::kReal;
  uint64_t seed = 0;                   // of every value generated here
  std::optional<uint64_t> batch_seed;  // the seed x and the routing were generated with
  std::string file_path;               // --load-routing ("" when the batch is generated)
  Batch file;                          // its contents (emptied once each rank took its rows)
  std::vector<int64_t> bs;             // tokens per (world) rank
  std::vector<double> real_p;          // over E + Z + C + Q
  std::string routing_desc, seed_desc;
  int64_t T = 1, Wep = 1, S = 0, Ns = 0, L = 1;
  int64_t Z = 0, C = 0, Q = 0;
  int64_t R = 0;               // redundant expert slots (moe_expert_num = E + R)
  RedundantExperts redundant;  // which experts they replicate
  std::string redundant_desc;  // how the replicated experts were chosen
  int mask_dims = 0;           // 0, 1, 2 (generated or loaded)
  std::string mask_desc;
  // From bs: the global batch N, whether the ranks' tokens differ, and dispatch_v2's global_bs
  // (--global-bs, else W_ep x max tokens per rank when uneven, else 0).
  int64_t N = 0;
  bool uneven = false;
  int64_t global_bs = 0;

  bool loaded() const { return !file_path.empty(); }
  // The first global token of world rank r.
  int64_t first_token(int64_t r) const;
};

// Collective-free. Throws moe_ep::Error on any rank whose setup fails (every rank alike for a bad
// flag or file); rank 0 also checks that the output files can be written. `node_ranks`: the
// ranks sharing this machine (for the memory check).
Plan plan_run(const RunOptions& o, int rank, int64_t world, const std::vector<int>& node_ranks);

}  // namespace moe_ep_tool
