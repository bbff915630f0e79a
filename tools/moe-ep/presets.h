// moe-ep tool: the model presets (the MoE layer shapes and router scoring rules of real models).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moe_ep_tool {

enum class Scoring {
  kSoftmax,  // softmax over all E router logits
  kSigmoid,  // independent sigmoid per expert
};

struct Preset {
  std::string name;
  int64_t hidden = 0;   // H
  int64_t experts = 0;  // E (routed experts)
  int64_t top_k = 0;    // K
  int64_t ffn = 0;      // expert intermediate size F
  Scoring scoring = Scoring::kSoftmax;
  bool normalise_top_k = false;  // divide the K selected scores by their sum
  double scaling = 1.0;          // multiply the (normalised) scores by this
  std::string routing_model;     // default --routing-model (a model of the real-routing data)
  std::string note;              // what the preset leaves out, for --help and the output
  int64_t shared_experts = 0;    // Ns: shared experts (FFN = the routed experts' FFN)
  // Group-limited (node-limited) routing, DeepSeek-V3's n_group and topk_group: the E experts
  // form n_group groups of E / n_group consecutive experts, and each token routes into at most
  // topk_group of them (n_group 1: no limit). Expert placement being contiguous (SPEC §1.2), a
  // group is a node's experts when n_group is the number of nodes.
  int64_t n_group = 1;
  int64_t topk_group = 1;
  // Set by layer_of when the preset's groups do not fit an overridden E or K: why the routing is
  // not group-limited.
  std::string groups_dropped = {};
  bool group_limited() const { return n_group > 1 && topk_group < n_group; }
};

const std::vector<Preset>& presets();
// Null when there is no preset of that name.
const Preset* find_preset(const std::string& name);
// The layer of `command` ("moe-ep run"): preset `name` with the given H, E and K (nullopt: the
// preset's). Throws moe_ep::Error(kInvalidArgument) "<command>: unknown preset '<name>'".
// n_group and topk_group (--n-group, --topk-group) must fit the layer: E % n_group == 0,
// 1 <= topk_group <= n_group and topk_group * E / n_group >= K, else the same error names the
// flag; a preset's own groups that do not fit an overridden E or K are dropped (groups_dropped).
// n_group alone keeps the preset's topk_group, at most n_group; on a preset without groups it
// needs topk_group too.
struct LayerOverrides {
  std::optional<int64_t> hidden, experts, top_k, ffn, shared_experts, n_group, topk_group;
};
Preset layer_of(const std::string& command, const std::string& name, const LayerOverrides& o);
// "softmax over all experts, not normalised over the top-k", "sigmoid, normalised over the
// top-k, x2.5; group-limited: ...", ...
std::string describe_scoring(const Preset& preset);
// "group-limited: 8 groups of 32 experts, ...", "not group-limited: <why>", or "" (no groups).
std::string describe_groups(const Preset& preset);
// Why `partials` (fp32, bf16, fp16) cannot be EpConfig::partials with tokens of `dtype` ("": it
// can): bf16 only, and only with bf16 tokens.
std::string partials_misfit(const std::string& partials, const std::string& dtype);

}  // namespace moe_ep_tool
