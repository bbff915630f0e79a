#include "presets.h"

#include <algorithm>
#include <sstream>

#include "moe_ep/error.h"

namespace moe_ep_tool {

const std::vector<Preset>& presets() {
  // Shapes and routers from the models' published configs: OLMoE-1B-7B-0924 (norm_topk_prob
  // false), Mixtral-8x7B-v0.1 (softmax over the top-2 logits), Qwen3-30B-A3B (norm_topk_prob true),
  // DeepSeek-V3 (sigmoid scores, norm_topk_prob true, routed_scaling_factor 2.5, one shared
  // expert of moe_intermediate_size 2048, n_group 8, topk_group 4).
  static const std::vector<Preset> kPresets = {
      {"olmoe", 2048, 64, 8, 1024, Scoring::kSoftmax, false, 1.0, "olmoe", "", 0},
      {"mixtral-8x7b", 4096, 8, 2, 14336, Scoring::kSoftmax, true, 1.0, "mistral", "", 0},
      {"qwen3-30b-a3b", 2048, 128, 8, 768, Scoring::kSoftmax, true, 1.0, "olmoe", "", 0},
      {"deepseek-v3", 7168, 256, 8, 2048, Scoring::kSigmoid, true, 2.5, "olmoe",
       "its shared expert (FFN = the experts' FFN) runs on every rank and enters combine_v2 as "
       "shared_expert_x, or on --shared-expert-ranks; the router has no trained bias "
       "(e_score_correction_bias 0)",
       1, 8, 4},
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
  const std::string groups = describe_groups(preset);
  if (!groups.empty()) s << "; " << groups;
  return s.str();
}

std::string describe_groups(const Preset& preset) {
  if (preset.group_limited())
    return "group-limited: " + std::to_string(preset.n_group) + " groups of " +
           std::to_string(preset.experts / preset.n_group) + " experts, each token in " +
           std::to_string(preset.topk_group) +
           " (gate: those whose two best scores sum highest; real, uniform: drawn by their "
           "experts' share of the load, more only while those hold fewer than K experts with "
           "load)";
  if (!preset.groups_dropped.empty()) return "not group-limited: " + preset.groups_dropped;
  return "";
}

std::string partials_misfit(const std::string& partials, const std::string& dtype) {
  if (partials == "fp32" || (partials == "bf16" && dtype == "bf16")) return "";
  return "--partials " + partials + " must be fp32, or bf16 with bf16 tokens (--dtype " + dtype +
         ")";
}

namespace {

// Why n_group and topk_group do not fit the layer (empty: they do).
std::string groups_misfit(const Preset& l) {
  const std::string groups = "n_group " + std::to_string(l.n_group);
  if (l.n_group < 1) return groups + " is below 1";
  if (l.experts % l.n_group != 0)
    return groups + " does not divide E = " + std::to_string(l.experts) + " experts";
  if (l.topk_group < 1 || l.topk_group > l.n_group)
    return "topk_group " + std::to_string(l.topk_group) + " is not in [1, " + groups + "]";
  if (l.topk_group * (l.experts / l.n_group) < l.top_k)
    return "topk_group " + std::to_string(l.topk_group) + " groups of " +
           std::to_string(l.experts / l.n_group) +
           " experts hold fewer than K = " + std::to_string(l.top_k);
  return "";
}

}  // namespace

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
  layer.n_group = o.n_group.value_or(layer.n_group);
  // --n-group alone keeps the preset's topk_group where it fits (--n-group 1: no limit).
  if (o.n_group && !o.topk_group && p->n_group == 1 && *o.n_group > 1)
    throw moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument,
                        command + ": --n-group " + std::to_string(*o.n_group) +
                            " needs --topk-group: preset '" + name + "' has no routing groups");
  layer.topk_group = o.topk_group.value_or(std::min(layer.topk_group, layer.n_group));
  const std::string misfit = groups_misfit(layer);
  if (!misfit.empty() && (o.n_group || o.topk_group))
    throw moe_ep::Error(
        moe_ep::ErrorKind::kInvalidArgument,
        command + ": " + (o.n_group ? "--n-group " + std::to_string(layer.n_group) : "") +
            (o.n_group && o.topk_group ? " " : "") +
            (o.topk_group ? "--topk-group " + std::to_string(layer.topk_group) : "") + ": " +
            misfit +
            " (n_group groups of E / n_group consecutive experts; each token routes into "
            "topk_group of them)");
  if (!misfit.empty()) {
    layer.groups_dropped = "the preset's " + misfit;
    layer.n_group = layer.topk_group = 1;
  }
  return layer;
}

}  // namespace moe_ep_tool
