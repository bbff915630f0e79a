// moe-ep tool: `moe-ep plan`, the bytes of a cluster you do not have. From the real routing
// statistics (or uniform routing) and a preset, it routes every token of W ranks (G per node) as
// `moe-ep run` would, and counts what each rank sends to other nodes in dispatch_v2 and
// combine_v2 under comm_alg fullmesh and hierarchy, as the library sends it (SPEC §3 "Bytes"):
//   fullmesh dispatch: per remote rank, its rows (a token once when that sends at most 3/4 of
//     its copies, as over MPI) x the row bytes, plus 16 B of metadata per copy;
//   hierarchy dispatch: per remote node, its distinct tokens x the row bytes, plus 28 B per copy;
//   fullmesh combine: each owner sends each remote source its rows back, plus 12 B of checks each;
//   hierarchy combine: each source sends each remote relay 16 B per entry (the weights), each
//     relay sends each remote source one partial row per token: fp32, or --partials' dtype, or
//     H + 4 B with int8.
// Control messages (headers, counts; under 1 KB per peer) are not counted. Also the time those
// bytes take on each node's link, and dispatch_v2's output memory per rank. One process: no MPI
// traffic, run it with or without mpirun (rank 0 prints).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace moe_ep_tool {

struct PlanOptions {
  std::string preset = "deepseek-v3";
  int64_t ranks = 256;          // W
  int64_t ranks_per_node = 16;  // G; W % G == 0
  int64_t tokens = 512;         // per rank
  std::optional<int64_t> hidden, experts, top_k;
  std::optional<int64_t> n_group, topk_group;  // group-limited routing (presets.h)
  std::string dtype = "bf16";
  std::string quant = "none";       // dispatch rows as int8 (H + 4 B)
  std::string comm_quant = "none";  // combine rows and partials as int8
  std::string partials = "fp32";    // hierarchy's partials: fp32 or dtype (EpConfig::partials)
  double link_gbit = 100;           // each node's link, Gbit/s
  uint64_t seed = 0;
  std::string routing = "real";  // real, uniform
  std::string routing_model, domain, routing_file;
  int64_t layer = 7;
};

// Prints the table on rank 0; returns 0. Throws moe_ep::Error(kInvalidArgument) for a layout
// that does not divide (W % G, E % W).
int plan_command(const PlanOptions& options);

}  // namespace moe_ep_tool
