#include "presets.h"

#include <sstream>

#include "moe_ep/error.h"

namespace moe_ep_tool {

const std::vector<Preset>& presets() {
  // Shapes and routers from the models' published configs: OLMoE-1B-7B-0924 (norm_topk_prob
  // false), Mixtral-8x7B-v0.1 (softmax over the top-2 logits), Qwen3-30B-A3B (norm_topk_prob true),
  // DeepSeek-V3 (sigmoid scores, norm_topk_prob true, routed_scaling_factor 2.5, one shared
  // expert of moe_intermediate_size 2048).
  static const std::vector<Preset> kPresets = {
      {"olmoe", 2048, 64, 8, 1024, Scoring::kSoftmax, false, 1.0, "olmoe", "", 0},
      {"mixtral-8x7b", 4096, 8, 2, 14336, Scoring::kSoftmax, true, 1.0, "mistral", "", 0},
      {"qwen3-30b-a3b", 2048, 128, 8, 768, Scoring::kSoftmax, true, 1.0, "olmoe", "", 0},
      {"deepseek-v3", 7168, 256, 8, 2048, Scoring::kSigmoid, true, 2.5, "olmoe",
       "group-limited routing is not modelled; its shared expert (FFN = the experts' FFN) runs "
       "on every rank and enters combine_v2 as shared_expert_x, or on --shared-expert-ranks",
       1},
  };
  return kPresets;
}

const Preset* find_preset(const std::string& name) {
  for (const Preset& p : presets()) {
    if (p.name == name) return &p;
  }
  return nullptr;
}

std::string describe_scoring(const Preset& preset) {
  std::ostringstream s;
  s << (preset.scoring == Scoring::kSoftmax ? "softmax over all experts" : "sigmoid");
  s << (preset.normalise_top_k ? ", normalised over the top-k" : ", not normalised over the top-k");
  if (preset.scaling != 1.0) s << ", x" << preset.scaling;
  return s.str();
}

Preset layer_of(const std::string& command, const std::string& name, const LayerOverrides& o) {
  const Preset* p = find_preset(name);
  if (p == nullptr) {
    throw moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument,
                        command + ": unknown preset '" + name + "'");
  }
  Preset layer = *p;
  layer.hidden = o.hidden.value_or(layer.hidden);
  layer.experts = o.experts.value_or(layer.experts);
  layer.top_k = o.top_k.value_or(layer.top_k);
  layer.ffn = o.ffn.value_or(layer.ffn);
  layer.shared_experts = o.shared_experts.value_or(layer.shared_experts);
  return layer;
}

}  // namespace moe_ep_tool
