#include "redundant.h"

#include <algorithm>
#include <climits>
#include <numeric>

namespace moe_ep_tool {

int64_t auto_redundant(int64_t experts, int64_t moe_ranks) {
  if (moe_ranks <= 0) return 0;
  return (moe_ranks - experts % moe_ranks) % moe_ranks;
}

int64_t RedundantExperts::logical(int64_t slot) const {
  return slot < experts ? slot : replica_of[static_cast<size_t>(slot - experts)];
}

int32_t RedundantExperts::physical(int32_t id, int64_t token) const {
  if (id < 0) return id;
  if (id >= experts) {
    // A special expert (or an id out of range, which stays out of range for dispatch_v2 to
    // report).
    return static_cast<int32_t>(std::min<int64_t>(int64_t{id} + redundant(), INT32_MAX));
  }
  if (copies.empty()) return id;
  const auto it = copies.find(id);
  if (it == copies.end()) return id;
  const auto& slots = it->second;
  return slots[static_cast<size_t>(token % static_cast<int64_t>(slots.size()))];
}

void RedundantExperts::map_rows(const int32_t* logical_ids, int32_t* physical_ids, int64_t first,
                                int64_t count, int64_t top_k) const {
  for (int64_t i = 0; i < count; ++i) {
    for (int64_t k = 0; k < top_k; ++k) {
      physical_ids[i * top_k + k] = physical(logical_ids[i * top_k + k], first + i);
    }
  }
}

std::string RedundantExperts::describe(size_t limit) const {
  std::string s = replica_of.size() == 1 ? "replica of expert " : "replicas of experts ";
  for (size_t j = 0; j < replica_of.size(); ++j) {
    if (j == limit) {
      s += ", ...";
      break;
    }
    s += (j == 0 ? "" : ", ") + std::to_string(replica_of[j]);
  }
  return s;
}

RedundantExperts make_redundant(int64_t experts, int64_t redundant,
                                const std::vector<double>& load) {
  RedundantExperts r;
  r.experts = experts;
  if (redundant <= 0 || experts <= 0) return r;
  // The busiest first; only the first min(R, E) of the order are needed.
  const int64_t needed = std::min(redundant, experts);
  std::vector<int32_t> order;
  if (static_cast<int64_t>(load.size()) == experts) {
    order.resize(static_cast<size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(
        order.begin(), order.begin() + needed, order.end(),
        [&](int32_t a, int32_t b) { return load[a] != load[b] ? load[a] > load[b] : a < b; });
    order.resize(static_cast<size_t>(needed));
  } else {
    for (int64_t e = 0; e < needed; ++e) order.push_back(static_cast<int32_t>(e));
  }
  r.replica_of.reserve(static_cast<size_t>(redundant));
  for (int64_t j = 0; j < redundant; ++j) {
    const int32_t e = order[static_cast<size_t>(j % needed)];
    r.replica_of.push_back(e);
    auto& slots = r.copies[e];
    if (slots.empty()) slots.push_back(e);
    slots.push_back(static_cast<int32_t>(experts + j));
  }
  return r;
}

}  // namespace moe_ep_tool
