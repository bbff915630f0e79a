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
};

const std::vector<Preset>& presets();
// Null when there is no preset of that name.
const Preset* find_preset(const std::string& name);
// The layer of `command` ("moe-ep run"): preset `name` with the given H, E and K (nullopt: the
// preset's). Throws moe_ep::Error(kInvalidArgument) "<command>: unknown preset '<name>'".
struct LayerOverrides {
  std::optional<int64_t> hidden, experts, top_k, ffn, shared_experts;
};
Preset layer_of(const std::string& command, const std::string& name, const LayerOverrides& o);
// "softmax over all experts, not normalised over the top-k", "sigmoid, normalised over the
// top-k, x2.5", ...
std::string describe_scoring(const Preset& preset);

}  // namespace moe_ep_tool
