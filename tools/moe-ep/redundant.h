// moe-ep tool: redundant expert slots, as DeepSeek-V3 serves its 256 routed experts (EPLB: extra
// physical expert slots holding replicas of busy logical experts).
//
// The library places moe_expert_num experts evenly over the W_ep - S MoE ranks (SPEC §1.2, §1.3:
// moe_expert_num % (W_ep - S) == 0). With R redundant slots it is given E + R physical slots:
//   slot p < E        holds logical expert p;
//   slot E + j        holds a replica of logical expert replica_of[j], j in [0, R).
// replica_of[j] = order[j % E], `order` listing the logical experts by decreasing expected load
// (ties: lower id first); without a load (gate and uniform routing) order = 0, 1, 2, ...
// The routing stays over the E logical experts; then each (token, k) entry whose logical expert e
// has c_e copies (its own slot first, then its replica slots in increasing j) goes to copy
// (global token index) % c_e: with one replica, even tokens to the original slot and odd ones to
// the replica. This depends only on the global token index, so the mapping is the same at every W.
// Special expert ids (zero/copy/const, logical [E, E + Z + C + Q)) come after the physical slots:
// logical id i >= E becomes i + R. Ids < 0 (-1: inactive) are kept.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace moe_ep_tool {

// The smallest R >= 0 with (experts + R) % moe_ranks == 0.
int64_t auto_redundant(int64_t experts, int64_t moe_ranks);

struct RedundantExperts {
  int64_t experts = 0;              // E: logical experts
  std::vector<int32_t> replica_of;  // (R): slot E + j holds logical expert replica_of[j]
  // The slots of each replicated logical expert, its own first (replicated experts only).
  std::map<int32_t, std::vector<int32_t>> copies;

  int64_t redundant() const { return static_cast<int64_t>(replica_of.size()); }
  // The logical expert held by slot p in [0, E + R).
  int64_t logical(int64_t slot) const;
  // The library id of logical id `id` in an entry of global token `token`.
  int32_t physical(int32_t id, int64_t token) const;
  // physical() over `count` tokens' rows of K ids, the first being global token `first`.
  void map_rows(const int32_t* logical_ids, int32_t* physical_ids, int64_t first, int64_t count,
                int64_t top_k) const;
  // "replicas of experts 3, 7" (at most `limit` ids, then ", ...").
  std::string describe(size_t limit = 16) const;
};

// `load`: expected load per logical expert (E entries), or empty for experts 0, 1, 2, ...
RedundantExperts make_redundant(int64_t experts, int64_t redundant,
                                const std::vector<double>& load);

}  // namespace moe_ep_tool
