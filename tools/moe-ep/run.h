// moe-ep tool: `moe-ep run`, the forward of one MoE layer across the MPI ranks
// (router -> dispatch_v2 -> each rank's local experts -> combine_v2) checked against a
// single-process dense reference on rank 0.
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
  std::string dtype = "bf16";
  bool dtype_given = false;
  uint64_t seed = 0;
  bool seed_given = false;
  std::string expert_fn = "swiglu";
  std::string routing = "real";  // real, gate, uniform
  std::string routing_model;     // empty: the preset's
  std::string domain = "c4";
  int64_t layer = 7;
  std::string routing_file;  // empty: next to the executable
  std::string save_routing, load_routing, save_output;
  std::optional<double> timeout_s;
};

// Collective over MPI_COMM_WORLD. Returns 0 on PASS, 1 on FAIL (the same on every rank); throws
// moe_ep::Error or std::exception on errors (the caller aborts the job).
int run_command(const RunOptions& options);

// <dir of /proc/self/exe>/../share/moe-ep/real-routing/expert_counts.csv
std::string default_routing_file();

}  // namespace moe_ep_tool
