// moe-ep tool: `moe-ep bench`, the dispatch/combine benchmark (issue 6).
//
// For each tokens-per-rank value of the sweep, on every rank of MPI_COMM_WORLD (the EP group):
//   1. builds the batch (bench_point.h): x from the seed (routing.h make_tokens) and top-k
//      routing (real OLMoE statistics by default), E experts placed E / W per rank (SPEC §1.2,
//      no shared experts);
//   2. verifies before timing (bench_verify.h; exit 1 on any mismatch, before anything is
//      timed), against the SPEC and, with --compare, the baselines (bench_baselines.h: the
//      textbook pipeline and the bare MPI_Alltoallv);
//   3. times each op (bench_timing.h): p50/p99 over iterations of the max over ranks, bytes
//      counted without self-traffic, the ratios against the baselines and the targets;
//   4. prints the table, the targets and writes --csv, --json and --plot (bench_output.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moe_ep_tool {

struct BenchOptions {
  std::string preset = "olmoe";
  std::vector<int64_t> tokens = {512};  // per rank; each value is one point of the sweep
  // Overrides of the preset. hidden: default 7168 with the default preset (the target
  // configuration), else the preset's.
  std::optional<int64_t> hidden, experts, top_k;
  std::optional<int64_t> n_group, topk_group;  // group-limited routing (presets.h)
  std::string partials = "fp32";               // EpConfig::partials
  bool preset_given = false;
  std::string dtype = "bf16";
  uint64_t seed = 0;
  std::string routing = "real";  // real, gate, uniform
  std::string routing_model;     // empty: the preset's
  std::string domain;            // empty: the model's (tulu for olmoe-sft/-dpo, else c4)
  int64_t layer = 7;
  std::string routing_file;  // empty: next to the executable
  bool compare = false;      // the bare MPI_Alltoallv, textbook pipeline and memcpy baselines
  int64_t iters = 20, warmup = 3;
  // none, int8: also time dispatch_v2 with quant_mode 2; empty: int8 with --compare (its targets
  // include int8's), else none.
  std::string quant;
  std::string transport;    // EpConfig::transport: "" ($MOE_EP_TRANSPORT, else shm), shm, mpi
  bool exact_size = false;  // EpConfig::exact_size
  // EpConfig::comm_alg of moe-ep's ops; with --compare on two nodes or more the other algorithm
  // is timed too, on the same batch.
  std::string comm_alg = "fullmesh";
  std::string csv, json, plot;
  std::optional<double> timeout_s;
  bool debug_corrupt_baseline = false;  // test hook: flips one byte of the textbook's expand_x
  // --overlap: the two-micro-batch layer, sequential against overlapped (bench_overlap.h), with
  // the last rank holding `skew` times the tokens, and the experts' FFN size (unset: sized so
  // that the experts take about as long as dispatch + combine).
  bool overlap = false;
  double skew = 1.0;
  std::optional<int64_t> ffn;
};

// Collective over MPI_COMM_WORLD. Returns 0 when every verification passed (missed performance
// targets do not change it), 1 when one failed (the same on every rank); throws moe_ep::Error on
// errors (bad configuration, files that cannot be written).
int bench_command(const BenchOptions& options);

}  // namespace moe_ep_tool
