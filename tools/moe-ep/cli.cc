#include "cli.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <functional>
#include <sstream>
#include <utility>

#include "checks.h"
#include "presets.h"

namespace moe_ep_tool {

namespace {

std::string preset_help() {
  std::ostringstream s;
  s << "model preset (default olmoe):";
  for (const auto& p : presets()) {
    s << "\n  " << p.name << ": H " << p.hidden << ", " << p.experts << " experts, top-" << p.top_k
      << ", FFN " << p.ffn << ", " << describe_scoring(p);
    if (!p.note.empty()) s << "; NOTE: " << p.note;
  }
  s << "\nLarge presets need a reduced --ffn to fit (one expert's fp32 weights: 3 x H x FFN x 4 B "
       "per rank at a time).";
  return s.str();
}

// A CLI11 validator from a check of checks.h ("" when valid); CLI11 prefixes the flag name:
// "--timeout: must be a finite number of seconds > 0, got 0".
CLI::Validator validator(std::function<std::string(const std::string&)> check,
                         const std::string& words) {
  return CLI::Validator([check](std::string& value) { return check(value); }, words);
}

CLI::Validator integer(int64_t low, int64_t high, const std::string& note = "") {
  return validator([=](const std::string& v) { return check_integer(v, low, high, note); },
                   "[" + std::to_string(low) + ", " + std::to_string(high) + "]");
}

// The comma-separated pieces of text, empty ones kept ("8,,16" has three).
std::vector<std::string> split_commas(const std::string& text) {
  std::vector<std::string> pieces;
  std::size_t from = 0;
  for (std::size_t at; (at = text.find(',', from)) != std::string::npos; from = at + 1)
    pieces.push_back(text.substr(from, at - from));
  pieces.push_back(text.substr(from));
  return pieces;
}

// A comma-separated list of integers in [low, high], each checked as integer() does. CLI11's own
// delimiter would drop empty entries ("8,,16" would sweep 8 and 16 without a word).
CLI::Validator integer_list(int64_t low, int64_t high) {
  return validator(
      [=](const std::string& v) {
        for (const std::string& piece : split_commas(v)) {
          if (piece.empty())
            return "must be a comma-separated list of integers in [" + std::to_string(low) + ", " +
                   std::to_string(high) + "], got " + v + " (an empty entry)";
          const std::string bad = check_integer(piece, low, high, "");
          if (!bad.empty()) return "each entry of " + v + " " + bad;
        }
        return std::string();
      },
      "[" + std::to_string(low) + ", " + std::to_string(high) + "],...");
}

// The flags of the layer and its batch.
// --n-group and --topk-group (presets.h, group-limited routing), for run, plan and bench.
void add_group_options(CLI::App* app, std::optional<int64_t>& n_group,
                       std::optional<int64_t>& topk_group) {
  app->add_option("--n-group", n_group,
                  "routing groups: the experts form this many groups of E / n_group consecutive "
                  "experts, and each token routes into --topk-group of them (DeepSeek-V3's "
                  "n_group; default: the preset's, 8 for deepseek-v3, else 1: no limit)")
      ->check(integer(1, kMaxExperts));
  app->add_option("--topk-group", topk_group,
                  "groups each token routes into (DeepSeek-V3's topk_group; default: the "
                  "preset's, 4 for deepseek-v3)")
      ->check(integer(1, kMaxExperts));
}

void add_run_layer_options(CLI::App* run, RunOptions& o) {
  std::vector<std::string> names;
  for (const auto& p : presets()) names.push_back(p.name);
  run->add_option("--preset", o.preset, preset_help())->check(CLI::IsMember(names));
  run->add_option("--tokens", o.tokens,
                  "tokens per rank (default 64; not with --load-routing, whose file fixes them)")
      ->check(integer(0, kMaxDim));
  run->add_option("--hidden", o.hidden, "override the preset's hidden size H")
      ->check(integer(1, kMaxDim));
  run->add_option("--experts", o.experts, "override the preset's number of experts E")
      ->check(integer(1, kMaxExperts, " (expert ids are int32)"));
  run->add_option("--top-k", o.top_k, "override the preset's top-k K (1 <= K <= E)")
      ->check(integer(1, kMaxExperts));
  add_group_options(run, o.n_group, o.topk_group);
  run->add_option("--ffn", o.ffn, "override the preset's expert intermediate size FFN")
      ->check(integer(1, kMaxDim));
  run->add_option("--dtype", o.dtype, "token dtype: bf16 (default), fp16, fp32")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  run->add_option("--seed", o.seed,
                  "unsigned seed (default 0) of every generated value: the tokens x, the routing "
                  "and the swiglu expert weights. With --load-routing x and the routing come from "
                  "the file and the seed sets only the swiglu expert weights (default: the seed "
                  "the file was saved with); the header prints the seed used and what it set")
      ->check(validator(check_unsigned, "[0, 2^64 - 1]"));
  run->add_option("--expert-fn", o.expert_fn,
                  "expert function: swiglu (default; y = W2 (silu(W1 x) * (W3 x)), fp32 OpenBLAS "
                  "GEMMs, checked with a tolerance), scale (expert e: y = x * (1 + e/E) in fp32, "
                  "checked bitwise), identity (checked bitwise)")
      ->check(CLI::IsMember({"swiglu", "scale", "identity"}));
}

// Where the routing comes from, and the files a run reads and writes.
void add_run_routing_options(CLI::App* run, RunOptions& o) {
  run->add_option("--routing", o.routing,
                  "routing: real (default; sampled from real per-expert top-k counts), gate "
                  "(random router matrix, top-k of x @ Wr), uniform; not with --load-routing")
      ->check(CLI::IsMember({"real", "gate", "uniform"}));
  run->add_option("--routing-model", o.routing_model,
                  "real routing data: olmoe, olmoe-sft, olmoe-dpo (64 experts, top-8), mistral "
                  "(8 experts, top-2); default: mistral for mixtral-8x7b, olmoe otherwise; other "
                  "expert counts are mapped by splitting (or merging) consecutive experts")
      ->check(CLI::IsMember({"olmoe", "olmoe-sft", "olmoe-dpo", "mistral"}));
  run->add_option("--domain", o.domain,
                  "real routing text domain: arxiv, book, c4, github, wikipedia (mistral, olmoe), "
                  "tulu (olmoe, olmoe-sft, olmoe-dpo); default: tulu for olmoe-sft and "
                  "olmoe-dpo, else c4");
  run->add_option("--layer", o.layer, "real routing MoE layer: 0, 7 (default) or 15")
      ->check(integer(0, kMaxDim));
  run->add_option("--routing-file", o.routing_file,
                  "expert_counts.csv (default: <exe dir>/../share/moe-ep/real-routing/"
                  "expert_counts.csv)");
  run->add_option("--save-routing", o.save_routing,
                  "write the global batch (expert_ids, expert_scales, x, tokens_per_rank) as "
                  "safetensors");
  run->add_option("--load-routing", o.load_routing,
                  "read the batch from a --save-routing file instead of generating it; H and K "
                  "must match the preset; rank r takes its slice (tokens_per_rank when it has W "
                  "entries, else an even split). Excludes --tokens and the routing flags")
      ->check(CLI::ExistingFile);
  run->add_option("--save-output", o.save_output,
                  "write the combined output (N, H) as safetensors tensor 'output'");
}

// TP, shared and special experts, quantisation, transport, masks, global_bs, redundant slots.
void add_run_parallel_options(CLI::App* run, RunOptions& o) {
  run->add_option("--tp", o.tp,
                  "tensor parallelism T: 1 (default) or 2. The world is W_ep x T ranks: world rank "
                  "r is EP rank r / T and TP rank r % T (EP groups {x T + i}, TP groups "
                  "{T i + x}); dispatch all-gathers each TP pair's rows, each TP rank computes a "
                  "partial expert output (swiglu: FFN split in halves; scale/identity: TP rank 0 "
                  "the value, rank 1 zeros) and combine_v2 reduce-scatters. Needs one expert per "
                  "MoE rank (E = W_ep - S)")
      ->check(integer(1, 2));
  run->add_option("--shared-experts", o.shared_experts,
                  "shared experts Ns, 0..4 (default: the preset's: 1 for deepseek-v3, else 0); "
                  "FFN = the routed experts' FFN. With --shared-expert-ranks 0 (Ns <= 1) each "
                  "rank runs it on its own tokens and passes it to combine_v2 as shared_expert_x")
      ->check(integer(0, 4));
  run->add_option("--shared-expert-ranks", o.shared_expert_ranks,
                  "shared-expert ranks S (default 0): EP ranks [0, S) run the shared experts on "
                  "the rows dispatch_v2 sends them (S/Ns ranks per shared expert; S % Ns == 0); "
                  "the routed experts go to the W_ep - S others")
      ->check(integer(0, kMaxDim));
  run->add_option("--zero-experts", o.zero_experts,
                  "zero experts Z (default 0): ids [E, E+Z), contribute 0 (SPEC §2.2); the routing "
                  "then draws ids over E+Z+C+Q, each special expert as likely as an average "
                  "routed one")
      ->check(integer(0, kMaxExperts));
  run->add_option("--copy-experts", o.copy_experts,
                  "copy experts C (default 0): ids [E+Z, E+Z+C), contribute w * x (ori_x = x)")
      ->check(integer(0, kMaxExperts));
  run->add_option("--const-experts", o.const_experts,
                  "const experts Q (default 0): ids [E+Z+C, E+Z+C+Q), contribute "
                  "w * (alpha_1[q] * x + alpha_2[q] * v[q]) with alpha_1, alpha_2, v generated "
                  "from the seed, uniform in [-1, 1)")
      ->check(integer(0, kMaxExperts));
  run->add_option("--quant", o.quant,
                  "dispatch quantisation: none (default) or int8 (quant_mode 2: rows travel as "
                  "int8 with a per-row scale; the experts read fp32(q) x dynamic_scales)")
      ->check(CLI::IsMember({"none", "int8"}));
  run->add_option("--comm-quant", o.comm_quant,
                  "combine quantisation: none (default) or int8 (comm_quant_mode 2: expert "
                  "outputs travel back as int8; not with --tp 2)")
      ->check(CLI::IsMember({"none", "int8"}));
  run->add_option("--comm-alg", o.comm_alg,
                  "fullmesh (default: every rank sends every other its rows) or hierarchy "
                  "(SPEC §3: a token crosses once per destination node, to a relay there; not "
                  "with --tp 2)")
      ->check(CLI::IsMember({"fullmesh", "hierarchy"}));
  run->add_option(
         "--partials", o.partials,
         "comm_alg hierarchy's combine partials (EpConfig::partials): fp32 (default) or the "
         "token dtype (--dtype): half the inter-node bytes of combine, one more rounding "
         "per (token, node)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  run->add_option("--transport", o.transport,
                  "how ranks on one machine move rows: shm (MPI-3 shared memory, one copy) or "
                  "mpi (point-to-point); default: $MOE_EP_TRANSPORT, else shm. Same results")
      ->check(CLI::IsMember({"mpi", "shm"}));
  run->add_flag("--exact-size", o.exact_size,
                "EpConfig::exact_size: dispatch_v2's outputs and window slots hold the rows each "
                "rank receives instead of SPEC §1.4's worst case A (which grows with the ranks); "
                "the same results. Not with --tp 2");
  run->add_option("--mask", o.mask,
                  "x_active_mask: none (default), prefix (1-D: the last quarter of each rank's "
                  "tokens, rounded, inactive) or entries (2-D: each (token, k) inactive with "
                  "probability 0.2, from the seed); inactive tokens give 0. Not with "
                  "--load-routing (a saved mask is reloaded)")
      // bad-prefix: a test hook (a 1-D mask that is not a prefix), not listed.
      ->check(CLI::Validator(
          [](const std::string& v) {
            return v == "none" || v == "prefix" || v == "entries" || v == "bad-prefix"
                       ? std::string()
                       : v + " not in {none, prefix, entries}";
          },
          "{none, prefix, entries}"));
  run->add_option("--global-bs", o.global_bs,
                  "dispatch_v2's global_bs (default: 0 when every rank has the same tokens, else "
                  "W_ep x max tokens per rank); sizes the receive buffers")
      ->check(integer(0, kMaxDim));
  run->add_option(
         "--redundant-experts", o.redundant_experts,
         "redundant expert slots R, as DeepSeek-V3 serves 256 experts on any number of ranks "
         "(EPLB): dispatch_v2 gets moe_expert_num = E + R physical slots, slot p < E holding "
         "expert p and slot E + j a replica of the j-th busiest expert (by the real routing's "
         "p_e, the loaded file's counts, else experts 0, 1, ...). The routing stays over the E "
         "experts; an entry of a replicated expert goes to copy (global token index) mod copies "
         "(one replica: even tokens the original, odd ones the replica), so outputs equal a run "
         "without redundancy. (E + R) % (W_ep - S) must be 0; default: the smallest such R")
      ->check(integer(0, kMaxExperts));
}

void add_run_options(CLI::App* run, RunOptions& o) {
  add_run_layer_options(run, o);
  add_run_routing_options(run, o);
  add_run_parallel_options(run, o);
  // Test hook: combine_v2 without ori_x (copy/const experts need it).
  run->add_flag("--debug-omit-ori-x", o.debug_omit_ori_x)->group("");
  run->add_option("--timeout", o.timeout_s,
                  "deadline of every blocking wait inside dispatch/combine, seconds > 0 "
                  "(default: $MOE_EP_TIMEOUT_S, else 300)")
      ->check(validator(check_timeout, "> 0"));
  run->add_option("--warm-repeats", o.warm_repeats,
                  "after the checked call, repeat dispatch_v2 + combine_v2 this many times on the "
                  "same inputs and report the median (max over ranks) as the warm time (default "
                  "5; 0: only the cold first call, which includes the window set-up)")
      ->check(integer(0, 1000000));
  run->add_option("--progress", o.progress,
                  "progress lines on stderr (rank 0): auto (default; a phase once it has run 1 s), "
                  "on (every phase as it starts), off")
      ->check(CLI::IsMember({"auto", "on", "off"}));
}

void add_plan_options(CLI::App* plan, PlanOptions& o) {
  std::vector<std::string> names;
  for (const auto& p : presets()) names.push_back(p.name);
  plan->add_option("--preset", o.preset, "model preset (default deepseek-v3: 256 experts, top-8)")
      ->check(CLI::IsMember(names));
  plan->add_option("--ranks", o.ranks, "EP ranks W (default 256)")->check(integer(1, 1 << 20));
  plan->add_option("--ranks-per-node", o.ranks_per_node, "ranks per node G (default 16)")
      ->check(integer(1, 1 << 20));
  plan->add_option("--tokens", o.tokens, "tokens per rank (default 512)")
      ->check(integer(1, 1 << 20));
  plan->add_option("--hidden", o.hidden, "override the preset's hidden size H")
      ->check(integer(1, kMaxDim));
  plan->add_option("--experts", o.experts, "override the preset's number of experts E")
      ->check(integer(1, kMaxExperts, " (expert ids are int32)"));
  plan->add_option("--top-k", o.top_k, "override the preset's top-k K")
      ->check(integer(1, kMaxExperts));
  add_group_options(plan, o.n_group, o.topk_group);
  plan->add_option("--dtype", o.dtype, "token dtype: bf16 (default), fp16, fp32")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  plan->add_option("--quant", o.quant, "dispatch rows: none (default) or int8")
      ->check(CLI::IsMember({"none", "int8"}));
  plan->add_option("--comm-quant", o.comm_quant, "combine rows and partials: none or int8")
      ->check(CLI::IsMember({"none", "int8"}));
  plan->add_option("--partials", o.partials,
                   "hierarchy's combine partials (EpConfig::partials): fp32 (default) or bf16 "
                   "(with bf16 tokens): half the bytes, one more rounding per (token, node)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  plan->add_option("--link-gbit", o.link_gbit, "each node's link in Gbit/s (default 100)")
      ->check(validator([](const std::string& v) { return check_positive(v, "Gbit/s"); }, "> 0"));
  plan->add_option("--seed", o.seed, "unsigned seed (default 0) of the routing")
      ->check(validator(check_unsigned, "[0, 2^64 - 1]"));
  plan->add_option("--routing", o.routing,
                   "real (default; real per-expert top-k counts) or uniform")
      ->check(CLI::IsMember({"real", "uniform"}));
  plan->add_option(
          "--routing-model", o.routing_model,
          "real routing data: olmoe, olmoe-sft, olmoe-dpo, mistral (default: the preset's)")
      ->check(CLI::IsMember({"olmoe", "olmoe-sft", "olmoe-dpo", "mistral"}));
  plan->add_option("--domain", o.domain, "real routing text domain (default c4, or tulu)");
  plan->add_option("--layer", o.layer, "real routing MoE layer: 0, 7 (default) or 15")
      ->check(integer(0, kMaxDim));
  plan->add_option("--routing-file", o.routing_file, "expert_counts.csv (default: installed)");
}

void add_bench_options(CLI::App* bench, BenchOptions& o, std::string& tokens_text) {
  std::vector<std::string> names;
  for (const auto& p : presets()) names.push_back(p.name);
  bench
      ->add_option("--preset", o.preset,
                   "model preset for E, K and the router (default olmoe: 64 experts, top-8); "
                   "shared experts are not benchmarked")
      ->check(CLI::IsMember(names));
  bench
      ->add_option("--tokens", tokens_text,
                   "tokens per rank, a comma-separated list to sweep (default 512, the performance "
                   "target; e.g. 64,128,256,512,1024); each value is verified, then timed")
      ->check(integer_list(1, kMaxDim));
  bench
      ->add_option("--hidden", o.hidden,
                   "hidden size H (default 7168 with the default preset: the performance target's; "
                   "with --preset, the preset's)")
      ->check(integer(1, kMaxDim));
  bench->add_option("--experts", o.experts, "override the preset's number of experts E")
      ->check(integer(1, kMaxExperts, " (expert ids are int32)"));
  bench->add_option("--top-k", o.top_k, "override the preset's top-k K (1 <= K <= E)")
      ->check(integer(1, kMaxExperts));
  add_group_options(bench, o.n_group, o.topk_group);
  bench->add_option("--dtype", o.dtype, "token dtype: bf16 (default), fp16, fp32")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  bench->add_option("--seed", o.seed, "unsigned seed (default 0) of the tokens and the routing")
      ->check(validator(check_unsigned, "[0, 2^64 - 1]"));
  bench
      ->add_option("--routing", o.routing,
                   "routing: real (default; sampled from real per-expert top-k counts), gate, "
                   "uniform")
      ->check(CLI::IsMember({"real", "gate", "uniform"}));
  bench
      ->add_option("--routing-model", o.routing_model,
                   "real routing data: olmoe, olmoe-sft, olmoe-dpo, mistral (default: the "
                   "preset's)")
      ->check(CLI::IsMember({"olmoe", "olmoe-sft", "olmoe-dpo", "mistral"}));
  bench->add_option("--domain", o.domain,
                    "real routing text domain (default: tulu for olmoe-sft and olmoe-dpo, else "
                    "c4)");
  bench->add_option("--layer", o.layer, "real routing MoE layer: 0, 7 (default) or 15")
      ->check(integer(0, kMaxDim));
  bench->add_option("--routing-file", o.routing_file,
                    "expert_counts.csv (default: <exe dir>/../share/moe-ep/real-routing/"
                    "expert_counts.csv)");
  bench->add_flag(
      "--compare", o.compare,
      "also time, in the same run and on the same rows, the bare MPI_Alltoallv of the "
      "payload, the textbook pipeline (permute -> MPI_Alltoallv -> regroup; combine "
      "the reverse with the weighted sum) and memcpy; print the ratios and the "
      "performance targets (docs/performance.md; PASS/FAIL; a missed target does not change "
      "the exit status)");
  bench->add_option("--iters", o.iters, "timed iterations per op (default 20)")
      ->check(integer(1, 1000000));
  bench->add_option("--warmup", o.warmup, "untimed iterations first (default 3)")
      ->check(integer(0, 1000000));
  bench
      ->add_option("--quant", o.quant,
                   "none or int8: also time dispatch_v2 with quant_mode 2 and report its bytes "
                   "and time against bf16's (default: int8 with --compare, whose targets include "
                   "it; else none)")
      ->check(CLI::IsMember({"none", "int8"}));
  bench
      ->add_option("--transport", o.transport,
                   "how moe-ep's ranks on one machine move rows: shm (MPI-3 shared memory, one "
                   "copy) or mpi (point-to-point); default: $MOE_EP_TRANSPORT, else shm. The "
                   "baselines always use plain MPI")
      ->check(CLI::IsMember({"mpi", "shm"}));
  bench->add_flag("--exact-size", o.exact_size,
                  "EpConfig::exact_size: moe-ep's dispatch_v2 outputs and window slots hold the "
                  "rows each rank receives instead of SPEC §1.4's worst case A (which grows with "
                  "the ranks); verified like the default");
  bench
      ->add_option("--comm-alg", o.comm_alg,
                   "comm_alg of moe-ep's ops: fullmesh (default) or hierarchy (SPEC §3: a token "
                   "crosses once per destination node, to a relay there); with --compare on two "
                   "nodes or more the other is timed too, on the same batch, and the bytes and "
                   "times of the two compared")
      ->check(CLI::IsMember({"fullmesh", "hierarchy"}));
  bench
      ->add_option(
          "--partials", o.partials,
          "comm_alg hierarchy's combine partials (EpConfig::partials): fp32 (default) or the "
          "token dtype (--dtype): half the inter-node bytes of combine, one more rounding "
          "per (token, node)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  bench->add_option("--csv", o.csv, "write one row per (tokens, op, impl) as CSV");
  bench->add_option("--json", o.json,
                    "write the configuration, rules, results and targets as JSON");
  bench->add_option("--plot", o.plot,
                    "write a PNG of GB/s against tokens per rank with gnuplot (the .dat and .gp "
                    "beside it); without gnuplot the plot is skipped with a message");
  CLI::Option* overlap = bench->add_flag(
      "--overlap", o.overlap,
      "time a MoE layer of two micro-batches (routing -> dispatch_v2 -> SwiGLU "
      "experts -> combine_v2) run one step after another and with one micro-batch's "
      "dispatch and combine travelling while the other's experts compute "
      "(moe_ep/async.h), and one micro-batch's experts started source by source as "
      "rows land against after the whole dispatch; the outputs are checked bitwise "
      "equal");
  bench
      ->add_option("--skew", o.skew,
                   "with --overlap: the last rank holds this many times the tokens (in [1, "
                   "1024], default 1), so its rows land last everywhere")
      ->check(validator(
          [](const std::string& v) {
            return check_positive(v, "times the tokens").empty() && std::stod(v) >= 1 &&
                           std::stod(v) <= 1024
                       ? std::string()
                       : "must be a number in [1, 1024], got " + v;
          },
          "[1, 1024]"))
      ->needs(overlap);
  bench
      ->add_option("--ffn", o.ffn,
                   "with --overlap: the experts' FFN size (default: sized so that the experts "
                   "take about as long as dispatch + combine)")
      ->check(integer(16, 1 << 16))
      ->needs(overlap);
  overlap->excludes("--compare");
  bench->add_flag("--debug-corrupt-baseline", o.debug_corrupt_baseline)->group("");
  bench
      ->add_option("--timeout", o.timeout_s,
                   "deadline of every blocking wait, seconds > 0 (default: $MOE_EP_TIMEOUT_S, "
                   "else 300)")
      ->check(validator(check_timeout, "> 0"));
}

// The real-routing flags select the statistics that --routing real samples from; with another
// routing they would be ignored, so they are refused.
void check_real_routing_flags(CLI::App& sub, const std::string& routing) {
  if (routing == "real") return;
  for (const char* flag : {"--routing-model", "--domain", "--layer", "--routing-file"}) {
    if (sub.count(flag) > 0) {
      throw CLI::ValidationError(std::string(flag) +
                                 " applies to --routing real only, got --routing " + routing);
    }
  }
}

// The expert counts: ids stay int32, top-k within the experts.
void validate_experts(const RunOptions& o) {
  const auto* p = find_preset(o.preset);
  const int64_t E = o.experts.value_or(p->experts), K = o.top_k.value_or(p->top_k);
  const int64_t special = o.zero_experts + o.copy_experts + o.const_experts;
  if (E + special > kMaxExperts) {
    throw CLI::ValidationError("--zero-experts/--copy-experts/--const-experts",
                               "E + Z + C + Q = " + std::to_string(E + special) +
                                   " must stay below 2^31 - 1 (SPEC §1.3: expert ids are int32)");
  }
  if (o.redundant_experts && E + special + *o.redundant_experts > kMaxExperts) {
    throw CLI::ValidationError(
        "--redundant-experts",
        "E + R + Z + C + Q = " + std::to_string(E + special + *o.redundant_experts) +
            " must stay below 2^31 - 1 (SPEC §1.3: expert ids are int32)");
  }
  if (K > E + special) {
    throw CLI::ValidationError(
        "--top-k", "K = " + std::to_string(K) +
                       " exceeds the number of experts E = " + std::to_string(E) +
                       (special > 0 ? " + Z + C + Q = " + std::to_string(E + special) : ""));
  }
}

// Shared experts and their ranks (SPEC §1.3), and TP's exclusion of combine quantisation.
void validate_shared(const RunOptions& o) {
  const auto* p = find_preset(o.preset);
  const int64_t Ns = o.shared_experts.value_or(p->shared_experts), S = o.shared_expert_ranks;
  const std::string ns_words =
      "--shared-experts " + std::to_string(Ns) +
      (o.shared_experts ? " (shared_expert_num)" : " (shared_expert_num, the preset's)");
  if (S > 0 && Ns == 0) {
    throw CLI::ValidationError("--shared-expert-ranks " + std::to_string(S) +
                               " (shared_expert_rank_num) needs shared experts, but " + ns_words +
                               " is 0; set --shared-experts");
  }
  if (S > 0 && S % Ns != 0) {
    throw CLI::ValidationError("--shared-expert-ranks " + std::to_string(S) +
                               " (shared_expert_rank_num) is not a multiple of " + ns_words +
                               " (SPEC §1.3: shared_expert_rank_num % shared_expert_num == 0)");
  }
  if (S == 0 && Ns > 1) {
    throw CLI::ValidationError(ns_words +
                               " needs --shared-expert-ranks > 0 (SPEC §1.3: without "
                               "shared-expert ranks shared_expert_num is 0 or 1)");
  }
  if (const std::string why = partials_misfit(o.partials, o.dtype); !why.empty())
    throw CLI::ValidationError(why);
  if (o.partials != "fp32" && o.comm_alg != "hierarchy")
    throw CLI::ValidationError(
        "--partials " + o.partials +
        " applies to --comm-alg hierarchy only (fullmesh sends no partials)");
  if (o.tp == 2 && o.comm_alg == "hierarchy") {
    throw CLI::ValidationError(
        "--comm-alg hierarchy cannot be combined with --tp 2 (SPEC §3: hierarchy runs without "
        "tensor parallelism)");
  }
  if (o.tp == 2 && o.exact_size) {
    throw CLI::ValidationError(
        "--exact-size cannot be combined with --tp 2 (exact_size = true does not support "
        "tp_world_size 2: the TP peer's rows would have to be known before the EP exchange)");
  }
  if (o.tp == 2 && o.comm_quant != "none") {
    throw CLI::ValidationError(
        "--comm-quant int8 cannot be combined with --tp 2 (SPEC §2.1: "
        "comm_quant_mode 2 is not allowed with tp_world_size 2)");
  }
}

// Flags a loaded batch would silently ignore, and outputs that would overwrite the input or each
// other.
void validate_files(CLI::App& run, const RunOptions& o) {
  if (!o.load_routing.empty()) {
    // What the file fixes.
    const std::pair<const char*, const char*> fixed[] = {
        {"--tokens", "the tokens per rank"},
        {"--routing", "the routing"},
        {"--routing-model", "the routing"},
        {"--domain", "the routing"},
        {"--layer", "the routing"},
        {"--routing-file", "the routing"},
        {"--mask", "x_active_mask (a saved mask is reloaded)"},
    };
    for (const auto& [flag, what] : fixed) {
      if (run.count(flag) > 0) {
        throw CLI::ValidationError(std::string(flag) + " cannot be combined with --load-routing: " +
                                   "the file fixes " + what);
      }
    }
  }
  // Outputs must not overwrite the input or each other.
  const std::pair<const char*, const std::string*> files[] = {{"--load-routing", &o.load_routing},
                                                              {"--save-routing", &o.save_routing},
                                                              {"--save-output", &o.save_output}};
  for (size_t i = 0; i < 3; ++i) {
    for (size_t j = i + 1; j < 3; ++j) {
      const std::string &a = *files[i].second, &b = *files[j].second;
      if (!a.empty() && !b.empty() && same_path(a, b)) {
        throw CLI::ValidationError(std::string(files[j].first) + " '" + b + "' and " +
                                   files[i].first + " '" + a + "' are the same file (" +
                                   (i == 0 ? "the run would overwrite its input"
                                           : "one output would overwrite the other") +
                                   ")");
      }
    }
  }
}

// The checks one flag cannot make alone.
void validate(CLI::App& run, const RunOptions& o) {
  check_real_routing_flags(run, o.routing);
  validate_experts(o);
  validate_shared(o);
  validate_files(run, o);
}

// The long names of a (sub)command's options, with their dashes; hidden ones (test hooks) left
// out.
std::vector<std::string> option_names(const CLI::App& app) {
  std::vector<std::string> names;
  for (const CLI::Option* opt : app.get_options()) {
    if (opt->get_group().empty()) continue;
    for (const std::string& name : opt->get_lnames()) names.push_back("--" + name);
  }
  return names;
}

// The arguments CLI11 left over (allow_extras): the first unknown option (with a suggestion) or,
// without one, the first unexpected positional word.
std::string leftover_error(const CLI::App& sub, const CLI::App& other,
                           const std::vector<std::string>& rest) {
  const std::string command = "moe-ep " + sub.get_name();
  const std::string help = " (" + command + " --help lists them)";
  for (const std::string& arg : rest) {
    if (arg.size() < 2 || arg[0] != '-') continue;
    const std::string word = arg.substr(0, arg.find('='));
    const std::vector<std::string> others = option_names(other);
    if (std::find(others.begin(), others.end(), word) != others.end()) {
      return command + ": unknown option " + word + ": it is an option of moe-ep " +
             other.get_name() + help;
    }
    const std::string near = closest_name(word, option_names(sub));
    return command + ": unknown option " + word +
           (near.empty() ? std::string() : "; did you mean " + near + "?") + help;
  }
  return command + ": unexpected argument '" + rest.front() + "': " + command +
         " takes only options" + help;
}

// Options given before the subcommand.
std::string before_subcommand_error(const std::vector<std::string>& rest) {
  return "moe-ep: unexpected argument '" + rest.front() +
         "' before the subcommand: options follow it, as in moe-ep run --tokens 8 (moe-ep "
         "--help)";
}

// CLI11's words for a parse error, where they do not say what is wrong, made to.
std::string parse_error_message(const CLI::ParseError& e) {
  const std::string what = e.what();
  // A repeated option: CLI11 says "--tokens: At Most 1 required but received 2".
  const std::string at_most = "At Most 1 required but received ";
  if (const auto at = what.find(at_most); at != std::string::npos) {
    return what.substr(0, at) + "given " + what.substr(at + at_most.size()) +
           " times; it takes one value";
  }
  // A flag without its value: "--tokens: 1 required INT:[0, 2147483647] missing".
  const std::string required = ": 1 required ";
  if (const auto at = what.find(required);
      at != std::string::npos && what.size() > 8 && what.ends_with(" missing")) {
    const std::string expected =
        what.substr(at + required.size(), what.size() - 8 - at - required.size());
    return what.substr(0, at) + ": a value is missing (expected " + expected + ")";
  }
  if (what == "A subcommand is required") {
    return "a subcommand is required: moe-ep run, moe-ep bench or moe-ep plan (moe-ep --help)";
  }
  return what;
}

struct Parser {
  CLI::App app{"moe-ep: mixture-of-experts expert parallelism over MPI"};
  CLI::App* run = nullptr;
  CLI::App* bench = nullptr;
  CLI::App* plan = nullptr;
  std::string bench_tokens;  // --tokens as given; checked by integer_list
  CommandLine line;

  Parser();
  // Throws CLI::ParseError.
  void parse(int argc, const char* const* argv);
};

Parser::Parser() {
  app.require_subcommand(1);
  app.allow_extras();
  app.set_version_flag("--version", std::string("moe-ep ") + MOE_EP_VERSION,
                       "print the version (moe-ep " MOE_EP_VERSION ") and exit");
  run = app.add_subcommand(
      "run",
      "Forward of one MoE layer across the MPI ranks: router -> dispatch_v2 -> local experts -> "
      "combine_v2, checked against a single-process dense reference on rank 0. Run it under "
      "mpirun; prints the configuration, load balance, time per phase (cold: the first call; "
      "warm: the median of --warm-repeats more), bandwidth, the check and a last line PASS: or "
      "FAIL: saying what ran, how fast and what the verdict means.");
  run->allow_extras();
  add_run_options(run, line.run);
  bench = app.add_subcommand(
      "bench",
      "Benchmark of dispatch_v2 / combine_v2 under mpirun: verifies against the SPEC first, then "
      "times each op (p50/p99 of the max over ranks) and, with --compare, the bare "
      "MPI_Alltoallv and the textbook pipeline on the same rows, printing the ratios. Defaults: "
      "bf16, H 7168, top-8 of 64 experts (olmoe), real OLMoE routing, 512 tokens per rank.");
  bench->allow_extras();
  add_bench_options(bench, line.bench, bench_tokens);
  plan = app.add_subcommand(
      "plan",
      "The bytes of a cluster you do not have (SPEC §3): routes W ranks' tokens as moe-ep run "
      "would (real routing statistics) and prints what each rank sends to other nodes in "
      "dispatch_v2 and combine_v2 under comm_alg fullmesh and hierarchy, the time on each "
      "node's link, and dispatch_v2's output memory per rank. One process; no MPI traffic.");
  plan->allow_extras();
  add_plan_options(plan, line.plan);
}

void Parser::parse(int argc, const char* const* argv) {
  // CLI11 says only "A subcommand is required" for a word that is not one.
  if (argc > 1 && argv[1][0] != '-' && std::string(argv[1]) != "run" &&
      std::string(argv[1]) != "bench" && std::string(argv[1]) != "plan") {
    const std::string near = closest_name(argv[1], {"run", "bench", "plan"});
    throw CLI::ValidationError(std::string("unknown subcommand '") + argv[1] +
                               "' (expected run, bench or plan)" +
                               (near.empty() ? std::string() : "; did you mean " + near + "?"));
  }
  app.parse(argc, argv);
  if (!app.remaining().empty())
    throw CLI::ValidationError(before_subcommand_error(app.remaining()));
  CLI::App* sub = run->parsed() ? run : bench->parsed() ? bench : plan;
  if (!sub->remaining().empty()) {
    throw CLI::ValidationError(leftover_error(*sub, sub == run ? *bench : *run, sub->remaining()));
  }
  if (plan->parsed()) {
    line.action = CommandLine::Action::kPlan;
    if (line.plan.ranks % line.plan.ranks_per_node != 0)
      throw CLI::ValidationError("moe-ep plan: --ranks " + std::to_string(line.plan.ranks) +
                                 " is not a multiple of --ranks-per-node " +
                                 std::to_string(line.plan.ranks_per_node));
    return;
  }
  if (run->parsed()) {
    line.action = CommandLine::Action::kRun;
    line.run.dtype_given = run->count("--dtype") > 0;
    line.run.tokens_given = run->count("--tokens") > 0;
    line.run.seed_given = run->count("--seed") > 0;
    validate(*run, line.run);
    return;
  }
  line.action = CommandLine::Action::kBench;
  line.bench.preset_given = bench->count("--preset") > 0;
  check_real_routing_flags(*bench, line.bench.routing);
  if (const std::string why = partials_misfit(line.bench.partials, line.bench.dtype); !why.empty())
    throw CLI::ValidationError(why);
  if (line.bench.partials != "fp32" && line.bench.comm_alg != "hierarchy")
    throw CLI::ValidationError(
        "--partials " + line.bench.partials +
        " applies to --comm-alg hierarchy only (fullmesh sends no partials)");
  if (bench->count("--tokens") > 0) {
    line.bench.tokens.clear();
    for (const std::string& piece : split_commas(bench_tokens))
      line.bench.tokens.push_back(std::stoll(piece));
  }
}

// Edit distance with swaps of neighbours (optimal string alignment).
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

}  // namespace

std::string closest_name(const std::string& word, const std::vector<std::string>& known) {
  const std::size_t letters = word.size() - std::min(word.find_first_not_of('-'), word.size());
  if (letters == 0) return "";
  std::vector<std::string> prefixed;
  for (const std::string& name : known) {
    if (name.size() > word.size() && name.compare(0, word.size(), word) == 0) {
      prefixed.push_back(name);
    }
  }
  if (prefixed.size() == 1) return prefixed.front();
  const std::size_t bound = letters >= 6 ? 2 : 1;
  std::string best;
  std::size_t best_d = bound + 1;
  for (const std::string& name : known) {
    const std::size_t d = edit_distance(word, name);
    if (d < best_d && d < letters) {
      best = name;
      best_d = d;
    }
  }
  return best;
}

CommandLine parse_command_line(int argc, const char* const* argv) {
  Parser parser;
  try {
    parser.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    CommandLine& line = parser.line;
    std::ostringstream out, err;
    if (parser.app.exit(e, out, err) == 0) {  // --help, --version
      line.action = CommandLine::Action::kPrint;
      line.text = out.str();
    } else {
      line.action = CommandLine::Action::kError;
      line.text = parse_error_message(e);
    }
  }
  return std::move(parser.line);
}

}  // namespace moe_ep_tool
