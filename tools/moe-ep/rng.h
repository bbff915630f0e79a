// moe-ep tool: the deterministic generator behind every synthetic value (expert weights, token
// features, router logits, routing draws).
//
// Counter-based, so any value can be produced on its own, on any rank, in any order:
//   key(seed, stream, a) = splitmix64(splitmix64(seed ^ (stream << 56)) ^ a)
//   bits(seed, stream, a, b) = splitmix64(key + (b + 1) * 0x9e3779b97f4a7c15)
// i.e. element b of the SplitMix64 sequence (Steele, Lea, Flood 2014) whose state starts at `key`.
// `a` names the object (an expert id, a global token index) and `b` the element inside it.
// uniform() maps the top 24 bits to [-1, 1) exactly (every value is a multiple of 2^-23);
// normal() is Box-Muller in double over two consecutive elements.
#pragma once

#include <cmath>
#include <cstdint>

namespace moe_ep_tool {

// The streams (the top byte of the key): one per kind of value.
enum class Stream : uint64_t {
  kTokenX = 1,        // a = global token index, b = hidden index h
  kExpertW13 = 2,     // a = expert id, b = row-major index into [2F, H] (W1 rows, then W3 rows)
  kExpertW2 = 3,      // a = expert id, b = row-major index into [H, F]
  kRouterMatrix = 4,  // a = 0, b = row-major index into [H, E]
  kRouteSample = 5,   // a = global token index, b = draw number
  kRouteLogits = 6,   // a = global token index, b = 2 * logit index (+1): normal pairs
  kActiveMask = 7,    // a = global token index, b = top-k slot k (--mask entries)
  kConstExpert = 8,   // a = 3 q + {0: alpha_1, 1: alpha_2, 2: v} of const expert q, b = h
  kRouteGroups = 9,   // a = global token index, b = draw number (group-limited routing)
};

inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

class Counter {
 public:
  Counter(uint64_t seed, Stream stream, uint64_t a)
      : key_(splitmix64(splitmix64(seed ^ (static_cast<uint64_t>(stream) << 56)) ^ a)) {}

  uint64_t bits(uint64_t b) const { return splitmix64(key_ + (b + 1) * 0x9e3779b97f4a7c15ull); }
  // Uniform in [-1, 1), a multiple of 2^-23.
  float uniform(uint64_t b) const {
    return static_cast<float>(static_cast<int64_t>(bits(b) >> 40) - (int64_t{1} << 23)) * 0x1p-23f;
  }
  // Uniform in [0, 1), 53 bits.
  double unit(uint64_t b) const { return static_cast<double>(bits(b) >> 11) * 0x1p-53; }
  // Standard normal from elements 2b and 2b+1.
  double normal(uint64_t b) const {
    const double u1 = 1.0 - unit(2 * b);  // (0, 1]
    const double u2 = unit(2 * b + 1);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  }

 private:
  uint64_t key_;
};

}  // namespace moe_ep_tool
