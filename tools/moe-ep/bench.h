// moe-ep tool: `moe-ep bench`, the dispatch/combine benchmark (issue 6).
//
// For each tokens-per-rank value of the sweep, on every rank of MPI_COMM_WORLD (the EP group):
//   1. builds the batch: x from the seed (routing.h make_tokens) and top-k routing (real OLMoE
//      statistics by default), E experts placed E / W per rank (SPEC §1.2, no shared experts);
//   2. verifies before timing (exit 1 on any mismatch, before anything is timed):
//      - dispatch_v2's expand_x rows equal the SPEC §1.4 layout rebuilt from every rank's tokens;
//      - combine_v2 of the rows passed through the `scale` expert function equals the SPEC §2.3
//        dense reference (reference.h) bitwise;
//      - with --compare, the textbook pipeline produces the same expand_x rows and the same
//        combine output (bitwise, +0 == -0), and the bare MPI_Alltoallv moves the same rows (each
//        (source, local expert) block equal to expand_x's, and back again unchanged);
//      - with --quant int8, every int8 row and dynamic scale equals SPEC §1.5 applied to the
//        expected row;
//   3. times, per iteration: MPI_Barrier, then each rank times one op; the ops of an iteration
//      run in a rotating order (moe-ep, alltoallv, textbook, memcpy groups) so that load on the
//      machine falls on all of them alike.
// Reports, per op: bytes counted (per rank: the rows it sends to OTHER ranks x the row payload,
// self-traffic excluded, mean over ranks), p50 and p99 over iterations of the max over ranks of
// the op's time, GB/s = bytes / p50, and with --compare the throughput ratios moe-ep/alltoallv and
// moe-ep/textbook (= baseline p50 / moe-ep p50: the same bytes) and the targets.
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
  std::string transport;  // EpConfig::transport: "" ($MOE_EP_TRANSPORT, else shm), shm, mpi
  std::string csv, json, plot;
  std::optional<double> timeout_s;
  bool debug_corrupt_baseline = false;  // test hook: flips one byte of the textbook's expand_x
};

// Collective over MPI_COMM_WORLD. Returns 0 when every verification passed (missed performance
// targets do not change it), 1 when one failed (the same on every rank); throws moe_ep::Error on
// errors (bad configuration, files that cannot be written).
int bench_command(const BenchOptions& options);

}  // namespace moe_ep_tool
