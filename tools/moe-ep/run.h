// moe-ep tool: `moe-ep run`, the forward of one MoE layer across the MPI ranks
// (router -> dispatch_v2 -> each rank's local experts -> combine_v2) checked against a
// single-process dense reference on rank 0. Its parts: run_plan.h (what runs where),
// run_layer.h (the layer on one rank), run_report.h (what rank 0 prints).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace moe_ep_tool {

struct RunOptions {
  std::string preset = "olmoe";
  int64_t tokens = 64;  // per rank
  bool tokens_given = false;
  std::optional<int64_t> hidden, experts, top_k, ffn;  // overrides of the preset
  std::optional<int64_t> n_group, topk_group;          // group-limited routing (presets.h)
  std::string partials = "fp32";                       // EpConfig::partials
  std::string dtype = "bf16";
  bool dtype_given = false;
  uint64_t seed = 0;
  bool seed_given = false;
  std::string expert_fn = "swiglu";
  std::string routing = "real";  // real, gate, uniform
  std::string routing_model;     // empty: the preset's
  std::string domain;            // empty: the model's (tulu for olmoe-sft/-dpo, else c4)
  int64_t layer = 7;
  std::string routing_file;  // empty: next to the executable
  std::string save_routing, load_routing, save_output;
  std::optional<double> timeout_s;
  // Issue 3: TP, shared and special experts, int8, masks, global_bs.
  int64_t tp = 1;                                                 // T: 1 or 2 (world = W_ep x T)
  std::optional<int64_t> shared_experts;                          // Ns (default: the preset's)
  int64_t shared_expert_ranks = 0;                                // S
  int64_t zero_experts = 0, copy_experts = 0, const_experts = 0;  // Z, C, Q
  std::string quant = "none";         // none, int8 (dispatch quant_mode 2)
  std::string comm_quant = "none";    // none, int8 (combine comm_quant_mode 2)
  std::string comm_alg = "fullmesh";  // EpConfig::comm_alg: fullmesh, hierarchy (SPEC §3)
  std::string transport;              // EpConfig::transport: "" (default), mpi, shm
  bool exact_size = false;            // EpConfig::exact_size
  std::string mask = "none";          // none, prefix, entries; bad-prefix (test hook)
  std::optional<int64_t> global_bs;
  // R physical expert slots holding replicas of busy experts (redundant.h); default: the smallest
  // R >= 0 with (E + R) % (W_ep - S) == 0.
  std::optional<int64_t> redundant_experts;
  bool debug_omit_ori_x = false;  // test hook: combine_v2 without ori_x
  // Repeats of dispatch_v2 + combine_v2 after the verified call, timed warm (0: none).
  int64_t warm_repeats = 5;
  std::string progress = "auto";  // progress lines on stderr: auto, on, off (progress.h)
};

// Collective over MPI_COMM_WORLD. Returns 0 on PASS, 1 on FAIL (the same on every rank); throws
// moe_ep::Error or std::exception on errors (the caller aborts the job).
int run_command(const RunOptions& options);

}  // namespace moe_ep_tool
