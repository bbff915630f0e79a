// moe-ep tool: synthetic token features and routing (expert_ids, expert_scales).
//
// Everything is a deterministic function of (seed, global token index): a token gets the same
// features, experts and gate weights whatever W and whichever rank holds it.
//   x[g, h] = round_to_dtype(uniform(seed, kTokenX, g, h)), uniform in [-1, 1).
//   real:    K distinct experts drawn without replacement from p_e = count_e / sum(count) (the
//            per-layer top-k counts of the real-routing data); router logits: E standard normals
//            drawn for the token, sorted, the k-th drawn expert gets the k-th largest.
//   uniform: as real with p_e = 1/E.
//   gate:    logits = fp32(x) @ Wr with Wr[h, e] = uniform(seed, kRouterMatrix, 0, h*E+e) /
//            sqrt(H), accumulated in fp32 in increasing h; the K largest (ties: lower id first).
// The gate weights follow the preset's scoring rule (presets.h) applied to those logits.
// Group-limited routing (Preset::n_group, topk_group; DeepSeek-V3's):
//   gate:          the scores (the scoring rule on all E logits) of each group's two best experts
//                  summed; the topk_group groups of the largest sums (ties: the lower group),
//                  then the K largest logits inside them. Bias 0; weights as above.
//   real, uniform: a node-limited draw: topk_group groups without replacement, each with
//                  probability proportional to its experts' total p_e (more only while those
//                  drawn hold fewer than K experts of nonzero p_e), then the K experts from p_e
//                  restricted to them, as above.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "moe_ep/tensor.h"
#include "presets.h"

namespace moe_ep_tool {

enum class RoutingKind { kReal, kGate, kUniform };

struct RealRoutingSource {
  std::string file;    // expert_counts.csv
  std::string model;   // olmoe, olmoe-sft, olmoe-dpo, mistral
  std::string domain;  // c4, arxiv, ...; empty: tulu for olmoe-sft/olmoe-dpo, else c4
  int64_t layer = 7;
};

// <dir of /proc/self/exe>/../share/moe-ep/real-routing/expert_counts.csv: the statistics installed
// beside the tool (the default of --routing-file).
std::string default_routing_file();

// Per-expert selection probabilities over the preset's E experts.
struct ExpertDistribution {
  std::vector<double> p;
  std::string description;  // source and how the data's experts were mapped onto E
};

// Reads the CSV and maps the data's E_data experts onto `experts`: equal counts are used as they
// are; E = m * E_data splits each data expert's probability evenly over m consecutive experts;
// E_data = m * E merges m consecutive data experts. Throws moe_ep::Error(kInvalidArgument) when
// the file, model, domain or layer is missing, when neither count divides the other, or when
// fewer than `top_k` experts have a nonzero probability.
ExpertDistribution load_real_distribution(const RealRoutingSource& source, int64_t experts,
                                          int64_t top_k);

// The number of experts D of the data for `source` (throws like load_real_distribution).
int64_t real_data_experts(const RealRoutingSource& source);

// Features of global tokens [first, first + count): (count, H) row-major in dtype.
std::vector<std::byte> make_tokens(uint64_t seed, int64_t first, int64_t count, int64_t hidden,
                                   moe_ep::DType dtype);

class Router {
 public:
  // `layer` gives H, E, K and the scoring rule; `real_p` is used by kReal only.
  Router(const Preset& layer, RoutingKind kind, uint64_t seed, std::vector<double> real_p);

  // Routes global tokens [first, first + count) whose features `x` ((count, H) in dtype) came
  // from make_tokens: writes expert_ids (count, K) and expert_scales (count, K).
  void route(int64_t first, int64_t count, const void* x, moe_ep::DType dtype, int32_t* expert_ids,
             float* expert_scales) const;

 private:
  void sample(int64_t token, const std::vector<double>& p, int32_t* ids,
              std::vector<double>& logits) const;
  void scores(const std::vector<double>& logits, const int32_t* ids, float* out) const;
  std::vector<double> drawn_groups(int64_t token, const std::vector<double>& p) const;
  void gate_groups(const std::vector<float>& logits, std::vector<char>& allowed) const;

  Preset layer_;
  RoutingKind kind_;
  uint64_t seed_;
  std::vector<double> p_;      // kReal: the data's distribution; kUniform: 1/E each
  std::vector<float> router_;  // kGate: Wr (H, E)
};

}  // namespace moe_ep_tool
