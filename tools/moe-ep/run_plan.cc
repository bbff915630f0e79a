#include "run_plan.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>

#include "checks.h"
#include "common.h"
#include "moe_ep/error.h"
#include "numeric.h"

namespace moe_ep_tool {

using moe_ep::Error;
using moe_ep::ErrorKind;

namespace {

std::string label(const char* flag, const char* name, const std::optional<int64_t>& given,
                  int64_t value) {
  return std::string(given ? flag : name) + " " + std::to_string(value);
}

std::string join_ways(const std::vector<std::string>& ways) {
  std::string s;
  for (size_t i = 0; i < ways.size(); ++i) {
    s += (i == 0 ? "" : i + 1 == ways.size() ? " or " : ", ") + ways[i];
  }
  return s;
}

// With TP (one expert per MoE rank): as many experts as MoE ranks, or as many ranks as experts.
std::string tp_placement_advice(const Plan& p, const std::function<bool(int64_t)>& maps) {
  const int64_t E = p.layer.experts, K = p.layer.top_k, special = p.Z + p.C + p.Q;
  const int64_t m = p.Wep - p.S;
  std::vector<std::string> ways;
  if (maps(m)) {
    std::string w = "--experts " + std::to_string(m);
    if (K > m + special) w += " --top-k " + std::to_string(m + special);
    ways.push_back(w);
  }
  if (E + p.S <= 1 << 20) ways.push_back(std::to_string(p.T * (p.S + E)) + " ranks");
  return join_ways(ways);
}

// Flags that make the expert placement work when E % (W_ep - S) != 0 (or, with TP, E != W_ep - S):
// fewer experts (with --routing real: a count the data's D experts map onto), another S, another
// number of ranks.
std::string placement_advice(const Plan& p, bool tp_one_per_rank, int64_t data_experts) {
  const int64_t E = p.layer.experts, K = p.layer.top_k, special = p.Z + p.C + p.Q;
  const int64_t m = p.Wep - p.S;
  const std::function<bool(int64_t)> maps = [&](int64_t e) {
    return data_experts == 0 || e % data_experts == 0 || data_experts % e == 0;
  };
  if (tp_one_per_rank) return tp_placement_advice(p, maps);
  std::vector<std::string> ways;
  // Fewer experts: the largest multiple of m below E (that the real data maps onto).
  int64_t best = 0;
  for (int64_t e = (E / m) * m; e >= m && best == 0; e -= m) {
    if (maps(e)) best = e;
    if ((E / m) * m - e > (int64_t{1} << 22)) break;  // bounded search
  }
  if (best > 0 && best + special >= K) ways.push_back("--experts " + std::to_string(best));
  // Another number of shared-expert ranks.
  for (int64_t d = 1; d < p.Wep; ++d) {
    int64_t found = -1;
    for (int64_t s : {p.S + d, p.S - d}) {
      if (s < 0 || s >= p.Wep) continue;
      const bool ns_ok = s == 0 ? p.Ns <= 1 : p.Ns > 0 && s % p.Ns == 0;
      if (ns_ok && E % (p.Wep - s) == 0) {
        found = s;
        break;
      }
    }
    if (found >= 0) {
      ways.push_back("--shared-expert-ranks " + std::to_string(found));
      break;
    }
  }
  // Another number of ranks: the nearest MoE-rank counts that divide E.
  for (int64_t n = m + 1; n <= E && n <= m + 4096; ++n) {
    if (E % n == 0) {
      ways.push_back(std::to_string(p.T * (p.S + n)) + " ranks");
      break;
    }
  }
  return join_ways(ways);
}

// The number of experts of the real routing data (0 when not routing from it, or unreadable:
// the routing itself reports that later).
int64_t data_experts_of(const RunOptions& o, const Plan& p) {
  if (p.loaded() || p.kind != RoutingKind::kReal) return 0;
  try {
    return real_data_experts({o.routing_file.empty() ? default_routing_file() : o.routing_file,
                              o.routing_model.empty() ? p.layer.routing_model : o.routing_model,
                              o.domain, o.layer});
  } catch (const Error&) {
    return 0;
  }
}

// E + R expert slots that do not split evenly over the MoE ranks (or, with TP, are not one per
// rank): the error names the rule, the values and the ways out.
[[noreturn]] void throw_placement_error(const RunOptions& o, const Plan& p, int64_t auto_R,
                                        bool tp_mismatch) {
  const int64_t moe_ranks = p.Wep - p.S, E = p.layer.experts, slots = E + p.R;
  const int64_t data_experts = data_experts_of(o, p);
  const std::string where =
      p.S > 0 ? "the W_ep - S = " + std::to_string(p.Wep) + " - " + std::to_string(p.S) + " = " +
                    std::to_string(moe_ranks) + " MoE ranks"
              : "W" + std::string(p.T > 1 ? "_ep" : "") + " = " + std::to_string(p.Wep) + " ranks";
  // Other flags only help without redundant slots; another R helps when one exists.
  std::vector<std::string> ways;
  const bool r_helps = !tp_mismatch || E <= moe_ranks;
  if (r_helps) {
    ways.push_back("--redundant-experts " + std::to_string(tp_mismatch ? moe_ranks - E : auto_R) +
                   (tp_mismatch ? std::string(" (E + R = W_ep - S)")
                                : " (the default: the smallest R with (E + R) % " +
                                      std::to_string(moe_ranks) + " == 0)"));
  }
  if (p.R == 0) {
    const std::string advice = placement_advice(p, tp_mismatch, data_experts);
    if (!advice.empty()) ways.push_back(advice);
  }
  std::string use;
  for (size_t i = 0; i < ways.size(); ++i) use += (i == 0 ? "; use " : "; or ") + ways[i];
  const std::string real_note = data_experts > 0 && p.R == 0
                                    ? " (with --routing real, E must also map onto the data's " +
                                          std::to_string(data_experts) + " experts)"
                                    : "";
  const std::string r_words = p.R > 0 ? " + R = " + std::to_string(p.R) + " redundant" : "";
  if (tp_mismatch && slots % moe_ranks == 0) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: --tp 2 needs one expert per MoE rank (SPEC §1.3: with "
                "tp_world_size 2, local_expert_num must be 1), but E = " +
                    std::to_string(E) + r_words + " over " + where + " gives " +
                    std::to_string(slots / moe_ranks) + " per rank" + use + real_note);
  }
  throw Error(ErrorKind::kInvalidArgument,
              "moe-ep run: --redundant-experts " + std::to_string(p.R) +
                  ": E + R = " + std::to_string(E) + " + " + std::to_string(p.R) + " = " +
                  std::to_string(slots) + " expert slots cannot be split evenly over " + where +
                  (p.S > 0 ? " (SPEC §1.3: moe_expert_num % (ep_world_size - "
                             "shared_expert_rank_num) == 0 with moe_expert_num = E + R; "
                             "shared-expert ranks host no routed expert)"
                           : " (SPEC §1.3: moe_expert_num % ep_world_size == 0 with "
                             "moe_expert_num = E + R)") +
                  use + real_note);
}

// The ranks: W_ep x T, shared-expert ranks, and the expert slots per MoE rank (L).
void plan_placement(const RunOptions& o, Plan& p, int64_t W) {
  if (W % p.T != 0) {
    throw Error(ErrorKind::kInvalidArgument, "moe-ep run: --tp " + std::to_string(p.T) +
                                                 " needs a multiple of " + std::to_string(p.T) +
                                                 " ranks (W_ep x T), got " + std::to_string(W));
  }
  p.Wep = W / p.T;
  if (p.S >= p.Wep) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: --shared-expert-ranks " + std::to_string(p.S) +
                    " (shared_expert_rank_num) must be below the " + std::to_string(p.Wep) +
                    " EP ranks (SPEC §1.3: shared_expert_rank_num in [0, ep_world_size)); use "
                    "more ranks");
  }
  const int64_t moe_ranks = p.Wep - p.S;
  const int64_t auto_R = auto_redundant(p.layer.experts, moe_ranks);
  p.R = o.redundant_experts.value_or(auto_R);
  const int64_t slots = p.layer.experts + p.R;
  const bool tp_mismatch = p.T == 2 && slots != moe_ranks;
  if (slots % moe_ranks != 0 || tp_mismatch) throw_placement_error(o, p, auto_R, tp_mismatch);
  if (slots + p.Z + p.C + p.Q > kMaxExperts) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: E + R + Z + C + Q = " + std::to_string(slots + p.Z + p.C + p.Q) +
                    " (R = " + std::to_string(p.R) +
                    " redundant slots) must stay below 2^31 - 1 (SPEC §1.3: expert ids are int32)");
  }
  p.L = slots / moe_ranks;
}

// The integer value of a metadata key: 0 when absent, -1 when not an integer.
// The integer the file's metadata holds under `key` (0 when absent); kInvalidArgument naming the
// key and the value when it is not a decimal integer.
int64_t metadata_count(const Batch& file, const char* key, const std::string& where) {
  auto it = file.metadata.find(key);
  if (it == file.metadata.end()) return 0;
  const std::string& v = it->second;
  errno = 0;
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno == ERANGE)
    throw Error(ErrorKind::kInvalidArgument, where + "metadata " + key + " = '" + v +
                                                 "' is not a decimal integer (a file moe-ep "
                                                 "run --save-routing wrote has one)");
  return n;
}

// A loaded batch must fit the layer: H, K, E and the special-expert counts it was saved with.
void check_file_fits(const RunOptions& o, const Plan& p) {
  const Batch& file = p.file;
  const Preset& layer = p.layer;
  const std::string where = "--load-routing '" + o.load_routing + "': ";
  if (file.hidden != layer.hidden) {
    throw Error(ErrorKind::kInvalidArgument,
                where + "x has H = " + std::to_string(file.hidden) + ", the preset " + layer.name +
                    " has H = " + std::to_string(layer.hidden) +
                    " (choose the preset or --hidden it was saved with)");
  }
  if (file.top_k != layer.top_k) {
    throw Error(ErrorKind::kInvalidArgument,
                where + "expert_ids has K = " + std::to_string(file.top_k) + ", the preset " +
                    layer.name + " has K = " + std::to_string(layer.top_k) +
                    " (choose the preset or --top-k it was saved with)");
  }
  if (file.metadata.count("moe_expert_num") &&
      metadata_count(file, "moe_expert_num", where) != layer.experts) {
    throw Error(ErrorKind::kInvalidArgument,
                where + "saved with E = " + file.metadata.at("moe_expert_num") + ", the preset " +
                    layer.name + " has E = " + std::to_string(layer.experts) +
                    " (choose the preset or --experts it was saved with)");
  }
  const std::tuple<const char*, const char*, int64_t> counts[] = {
      {"zero_expert_num", "--zero-experts", p.Z},
      {"copy_expert_num", "--copy-experts", p.C},
      {"const_expert_num", "--const-experts", p.Q}};
  for (const auto& [key, flag, value] : counts) {
    const int64_t saved = metadata_count(file, key, where);
    if (saved != value) {
      throw Error(ErrorKind::kInvalidArgument,
                  where + "saved with " + key + " = " +
                      (file.metadata.count(key) ? file.metadata.at(key) : std::string("0")) +
                      ", this run has " + flag + " " + std::to_string(value) +
                      " (the expert ids depend on it; pass the value it was saved with)");
    }
  }
  if (o.dtype_given && file.dtype != p.dtype) {
    throw Error(ErrorKind::kInvalidArgument, where + "x is " + moe_ep::dtype_name(file.dtype) +
                                                 ", --dtype says " + moe_ep::dtype_name(p.dtype));
  }
}

// A saved routing's description with its statistics file whole (common.h): a real routing's
// file ends it, after the last " from " (files saved before went on after it: left as they are).
std::string saved_routing(const std::string& text) {
  const std::size_t at = text.rfind(" from ");
  if (text.rfind("real (", 0) != 0 || at == std::string::npos ||
      text.find("; ", at) != std::string::npos) {
    return text;
  }
  return text.substr(0, at + 6) + whole(text.substr(at + 6));
}

// The inputs of --load-routing: the file (checked against the layer), its split over the ranks.
// Returns the file's size in bytes (0 when unknown).
uint64_t plan_loaded_inputs(const RunOptions& o, Plan& p, int64_t W, uint64_t physical) {
  std::error_code ec;
  uint64_t file_bytes = std::filesystem::file_size(o.load_routing, ec);
  if (ec) file_bytes = 0;
  check_load_memory(o.load_routing, file_bytes, physical);
  p.file = load_routing(o.load_routing);
  check_file_fits(o, p);
  const Batch& file = p.file;
  p.dtype = file.dtype;
  p.batch_seed = file.seed;
  if (!o.seed_given && file.seed) p.seed = *file.seed;
  p.bs = split_tokens(file.tokens, file.tokens_per_rank, W);
  p.mask_dims = file.mask_dims;
  if (p.mask_dims > 0) {
    p.mask_desc = std::string(p.mask_dims == 1 ? "1-D" : "2-D") + " from the file";
  }
  const bool own_split = static_cast<int64_t>(file.tokens_per_rank.size()) == W;
  p.routing_desc = "loaded from " + whole(o.load_routing) + " (" + std::to_string(file.tokens) +
                   " tokens, " +
                   (own_split ? std::string("its tokens_per_rank")
                              : std::string("split evenly over the ranks")) +
                   ")" +
                   (file.metadata.count("routing")
                        ? "; saved routing: " + saved_routing(file.metadata.at("routing"))
                        : std::string());
  return file_bytes;
}

// The inputs generated from the seed: --tokens per rank, the mask kind.
void plan_generated_inputs(const RunOptions& o, Plan& p, int64_t W) {
  p.bs.assign(W, o.tokens);
  p.batch_seed = p.seed;
  p.mask_dims = o.mask == "entries" ? 2 : o.mask == "none" ? 0 : 1;
  p.mask_desc = o.mask == "prefix"    ? "prefix (1-D: the last quarter of each rank's tokens "
                                        "inactive)"
                : o.mask == "entries" ? "entries (2-D: each entry inactive with probability 0.2)"
                : o.mask == "bad-prefix"
                    ? "bad-prefix (test hook: 1-D {T, F, T, F, ...}, not a prefix)"
                    : "";
}

// EP group i = {x T + i} (i = r % T): whether its ranks' tokens differ.
std::vector<bool> uneven_groups(const Plan& p) {
  const std::vector<int64_t>& bs = p.bs;
  std::vector<bool> uneven(static_cast<std::size_t>(p.T), false);
  for (int64_t r = p.T; r < static_cast<int64_t>(bs.size()); ++r) {
    if (bs[r] != bs[r % p.T]) uneven[static_cast<std::size_t>(r % p.T)] = true;
  }
  return uneven;
}

// --global-bs at least W_ep x max BS and a multiple of W_ep; 0 only with the same tokens on every
// rank of an EP group (SPEC §1.3).
void check_global_bs(const RunOptions& o, const Plan& p, bool any_uneven) {
  if (!o.global_bs) return;
  const int64_t g = *o.global_bs;
  const int64_t max_bs = *std::max_element(p.bs.begin(), p.bs.end());
  if (g == 0 && any_uneven) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: --global-bs 0 needs the same tokens on every rank of an EP group; "
                "this split has " +
                    join_ints(p.bs) +
                    " (SPEC §1.3; leave --global-bs out for W_ep x max tokens per rank)");
  }
  if (g > 0 && g < p.Wep * max_bs) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: --global-bs " + std::to_string(g) +
                    " is less than W_ep x max tokens per rank = " + std::to_string(p.Wep) + " x " +
                    std::to_string(max_bs) + " = " + std::to_string(p.Wep * max_bs) +
                    " (SPEC §1.3)");
  }
  if (g % p.Wep != 0) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: --global-bs " + std::to_string(g) +
                    " is not a multiple of W_ep = " + std::to_string(p.Wep) + " (SPEC §1.3)");
  }
}

// A loaded mask on this split: every token active where an EP group's tokens differ, and a 1-D
// mask all Trues before all Falses in each rank's rows (the tool's copy of dispatch_v2's check,
// which it cannot call before the run).
void check_loaded_mask(const RunOptions& o, const Plan& p, const std::vector<bool>& uneven) {
  const std::vector<int64_t>& bs = p.bs;
  const int64_t W = static_cast<int64_t>(bs.size());
  const std::vector<uint8_t>& mask = p.file.x_active_mask;
  const int64_t row = p.mask_dims == 2 ? p.file.top_k : 1;  // mask entries per token
  const std::string where = "moe-ep run: --load-routing '" + o.load_routing + "': ";
  // Saved on another number of ranks: a hint (the saving run's dispatch_v2 accepted that split).
  const int64_t saved_ranks = static_cast<int64_t>(p.file.tokens_per_rank.size());
  const std::string saved =
      saved_ranks > 0 && saved_ranks != W
          ? "; it was saved on " + ranks_words(saved_ranks) + ", where it fits"
          : std::string();
  int64_t first = 0;
  for (int64_t r = 0; r < W; ++r) {
    std::string rows = "[";  // (appended: GCC 12 warns falsely on "[" + std::string)
    rows += join_ints({first, first + bs[r]});
    rows += ")";
    const auto begin = mask.begin() + first * row, end = mask.begin() + (first + bs[r]) * row;
    bool inactive = false;  // a token without a True (SPEC §1.3)
    for (auto t = begin; t < end && !inactive; t += row)
      inactive = std::none_of(t, t + row, [](uint8_t v) { return v != 0; });
    if (uneven[static_cast<std::size_t>(r % p.T)] && inactive) {
      throw Error(
          ErrorKind::kInvalidArgument,
          where + "on " + ranks_words(W) + " the " + std::to_string(p.file.tokens) +
              " tokens split unevenly (" + join_ints(bs) + "), and rank " + std::to_string(r) +
              "'s file rows " + rows +
              " have a token that x_active_mask leaves inactive (SPEC §1.3: when BS differs "
              "across ranks every token must be active)" +
              saved);
    }
    for (int64_t i = first + 1; p.mask_dims == 1 && i < first + bs[r]; ++i) {
      if (mask[i] && !mask[i - 1]) {
        throw Error(ErrorKind::kInvalidArgument,
                    where + "on " + ranks_words(W) + ", rank " + std::to_string(r) +
                        " takes file rows " + rows +
                        ", where its 1-D x_active_mask has a True after a False (SPEC §1.3: all "
                        "Trues before all Falses on each rank)" +
                        saved);
      }
    }
    first += bs[r];
  }
}

// dispatch_v2's rules on the tokens per rank (SPEC §1.3), checked here so that the error names
// the flag or the file and is agreed on (printed once) before the run. Throws
// Error(kInvalidArgument).
void check_batch_split(const RunOptions& o, const Plan& p) {
  const std::vector<bool> uneven = uneven_groups(p);
  check_global_bs(o, p, std::find(uneven.begin(), uneven.end(), true) != uneven.end());
  if (o.load_routing.empty() || p.mask_dims == 0) return;
  check_loaded_mask(o, p, uneven);
}

// Sizes and memory, before anything of the run's size is allocated.
void check_run_size(const RunOptions& o, const Plan& p, const std::vector<int>& node_ranks,
                    uint64_t physical, uint64_t file_bytes) {
  const Preset& layer = p.layer;
  RunShape shape;
  shape.world = static_cast<int64_t>(p.bs.size());
  shape.tokens_per_rank = p.bs;
  shape.hidden = layer.hidden;
  shape.experts = layer.experts;
  shape.top_k = layer.top_k;
  shape.ffn = layer.ffn;
  shape.dtype = p.dtype;
  shape.fn = p.fn;
  shape.routing = p.kind;
  shape.loaded = p.loaded();
  shape.file_bytes = file_bytes;
  shape.tp = p.T;
  shape.shared_ranks = p.S;
  shape.shared_experts = p.Ns;
  shape.special = p.Z + p.C + p.Q;
  shape.global_bs = o.global_bs.value_or(0);
  shape.quant = o.quant == "int8";
  shape.comm_quant = o.comm_quant == "int8";
  shape.mask_dims = p.mask_dims;
  shape.tokens_label = p.loaded() ? "--load-routing '" + o.load_routing + "' (" +
                                        std::to_string(p.file.tokens) + " tokens)"
                                  : "--tokens " + std::to_string(o.tokens);
  shape.hidden_label = label("--hidden", "H", o.hidden, layer.hidden);
  shape.experts_label = label("--experts", "E", o.experts, layer.experts);
  shape.top_k_label = label("--top-k", "K", o.top_k, layer.top_k);
  shape.ffn_label = label("--ffn", "FFN", o.ffn, layer.ffn);
  check_sizes(shape);
  check_memory(shape, node_ranks, physical);
  check_gather_limits(shape);
}

// Where a generated routing comes from (a loaded one: its file, set with the inputs).
void plan_routing_source(const RunOptions& o, Plan& p) {
  const Preset& layer = p.layer;
  const int64_t special = p.Z + p.C + p.Q;
  const std::string special_note =
      special > 0 ? "; ids over E + Z + C + Q = " + std::to_string(layer.experts + special) +
                        ", each special expert as likely as an average routed expert"
                  : "";
  if (p.kind == RoutingKind::kReal) {
    const std::string routing_file =
        o.routing_file.empty() ? default_routing_file() : o.routing_file;
    RealRoutingSource src{routing_file,
                          o.routing_model.empty() ? layer.routing_model : o.routing_model, o.domain,
                          o.layer};
    ExpertDistribution d =
        load_real_distribution(src, layer.experts, std::min(layer.top_k, layer.experts));
    p.real_p = std::move(d.p);
    // Special experts: each with the mean probability of a routed one (sum of p is 1).
    p.real_p.resize(static_cast<size_t>(layer.experts + special),
                    1.0 / static_cast<double>(layer.experts));
    // The file last, whole (common.h): the report prints its path unbroken, at the line's end.
    p.routing_desc = d.description + special_note +
                     (special_note.empty() ? " from " : "; counts from ") + whole(routing_file);
  } else if (p.kind == RoutingKind::kGate) {
    p.routing_desc =
        "gate (router matrix Wr [H, E] from the seed, logits = x @ Wr, top-k)" + special_note;
  } else {
    p.routing_desc = "uniform (K distinct experts, each equally likely)" + special_note;
  }
}

// Redundant expert slots: replicas of the busiest experts.
void plan_redundant(const RunOptions& o, Plan& p) {
  const int64_t E = p.layer.experts;
  if (p.R == 0) {
    p.redundant = make_redundant(E, 0, {});
    return;
  }
  std::vector<double> load;
  if (p.loaded()) {
    // The file's own counts (every id in [0, E), masked or not).
    load.assign(static_cast<size_t>(E), 0.0);
    for (const int32_t e : p.file.expert_ids) {
      if (e >= 0 && e < E) load[static_cast<size_t>(e)] += 1;
    }
    p.redundant_desc = "the busiest by the loaded file's expert_ids counts";
  } else if (p.kind == RoutingKind::kReal) {
    load.assign(p.real_p.begin(), p.real_p.begin() + E);
    p.redundant_desc = "the busiest by the real routing's p_e";
  } else {
    p.redundant_desc = "experts 0, 1, ... (routing " + o.routing + " has no expected load)";
  }
  p.redundant = make_redundant(E, p.R, load);
  p.redundant_desc += "; an entry of a replicated expert goes to copy (global token) mod copies";
}

// What the seed sets.
std::string describe_seed(const RunOptions& o, const Plan& p) {
  const std::string seed = std::to_string(p.seed);
  const bool seeded = p.fn == ExpertFn::kSwiglu || p.Q > 0;
  if (!p.loaded()) return "seed " + seed;
  if (!seeded) {
    return std::string("seed not used (x and routing come from the file; expert-fn ") +
           expert_fn_name(p.fn) + " has no weights)";
  }
  const std::string saved =
      p.file.seed ? "saved with seed " + std::to_string(*p.file.seed) : "saved without a seed";
  return "seed " + seed + " (" +
         (o.seed_given  ? "--seed"
          : p.file.seed ? "the file's"
                        : "default") +
         "; " +
         (p.fn == ExpertFn::kSwiglu
              ? (p.Q > 0 ? "expert weights and const experts" : "expert weights")
              : "const experts") +
         " only: x and routing come from the file, " + saved + ")";
}

// The flags as plan fields.
Plan initial_plan(const RunOptions& o) {
  Plan p;
  p.layer =
      layer_of("moe-ep run", o.preset,
               {o.hidden, o.experts, o.top_k, o.ffn, o.shared_experts, o.n_group, o.topk_group});
  p.dtype = parse_float_dtype(o.dtype);
  p.seed = o.seed;
  p.fn = o.expert_fn == "scale"      ? ExpertFn::kScale
         : o.expert_fn == "identity" ? ExpertFn::kIdentity
                                     : ExpertFn::kSwiglu;
  p.kind = o.routing == "gate"      ? RoutingKind::kGate
           : o.routing == "uniform" ? RoutingKind::kUniform
                                    : RoutingKind::kReal;
  p.T = o.tp;
  p.S = o.shared_expert_ranks;
  p.Ns = p.layer.shared_experts;
  p.Z = o.zero_experts;
  p.C = o.copy_experts;
  p.Q = o.const_experts;
  // Special experts are routed to but belong to no group: the limit would leave them out.
  if (p.layer.group_limited() && p.Z + p.C + p.Q > 0) {
    if (o.n_group || o.topk_group)
      throw Error(ErrorKind::kInvalidArgument,
                  "moe-ep run: --n-group / --topk-group cannot be combined with --zero-experts, "
                  "--copy-experts or --const-experts (special experts belong to no routing "
                  "group)");
    p.layer.groups_dropped =
        "special experts (--zero-experts, --copy-experts, --const-experts) belong to no group";
    p.layer.n_group = p.layer.topk_group = 1;
  }
  p.file_path = o.load_routing;
  return p;
}

// N, whether the split is uneven, and dispatch_v2's global_bs.
void plan_batch_totals(const RunOptions& o, Plan& p) {
  const std::vector<int64_t>& bs = p.bs;
  p.N = std::accumulate(bs.begin(), bs.end(), int64_t{0});
  const int64_t max_bs = *std::max_element(bs.begin(), bs.end());
  p.uneven = std::any_of(bs.begin(), bs.end(), [&](int64_t n) { return n != bs[0]; });
  p.global_bs = o.global_bs ? *o.global_bs : p.uneven ? p.Wep * max_bs : 0;
}

}  // namespace

int64_t Plan::first_token(int64_t r) const {
  return std::accumulate(bs.begin(), bs.begin() + r, int64_t{0});
}

Plan plan_run(const RunOptions& o, int rank, int64_t W, const std::vector<int>& node_ranks) {
  Plan p = initial_plan(o);
  const uint64_t physical = physical_memory_bytes();
  plan_placement(o, p, W);
  uint64_t file_bytes = 0;
  if (p.loaded()) {
    file_bytes = plan_loaded_inputs(o, p, W, physical);
  } else {
    plan_generated_inputs(o, p, W);
  }
  check_batch_split(o, p);
  check_run_size(o, p, node_ranks, physical, file_bytes);
  // Output files: writable (rank 0 writes them).
  if (rank == 0) {
    if (!o.save_routing.empty()) check_writable("--save-routing", o.save_routing);
    if (!o.save_output.empty()) check_writable("--save-output", o.save_output);
  }
  if (!p.loaded()) plan_routing_source(o, p);
  plan_redundant(o, p);
  p.seed_desc = describe_seed(o, p);
  plan_batch_totals(o, p);
  return p;
}

}  // namespace moe_ep_tool
