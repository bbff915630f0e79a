// moe-ep tool, `moe-ep bench`: what is fixed for the whole sweep (Setup: the layer, the routing
// source, the checks of sizes, memory and output files) and one point of it (Point: this rank's
// batch at one tokens-per-rank value, every rank's routing and the traffic it implies).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bench.h"
#include "collective.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/tensor.h"
#include "presets.h"
#include "routing.h"

namespace moe_ep_tool::bench {

// The target configuration (issue 6): DeepSeek-V3's hidden size with OLMoE's 64 experts
// and top-8, 512 tokens per rank, W = 2.
constexpr int64_t kTargetHidden = 7168;
constexpr int64_t kTargetTokens = 512;
// Targets: moe-ep at least 1.0x the bare MPI_Alltoallv and 2x the textbook pipeline; int8
// dispatch "moves about half the bytes and its time drops accordingly": at most this fraction
// of the bf16 dispatch time (half, plus slack for the per-row scale and the quantisation pass).
constexpr double kTargetVsAlltoallv = 1.0;
constexpr double kTargetVsTextbook = 2.0;
constexpr double kTargetInt8Time = 0.6;
// comm_alg hierarchy against fullmesh across nodes (issue 21): at most this fraction of the
// inter-node bytes (fp32 partials in combine), and of the p50 time.
constexpr double kTargetHierBytes = 0.6;
constexpr double kTargetHierTime = 0.7;

// Everything fixed for the whole sweep.
struct Setup {
  Preset layer;
  moe_ep::DType dtype = moe_ep::DType::kBF16;
  RoutingKind kind = RoutingKind::kReal;
  std::vector<double> real_p;
  std::string routing_desc;
  int64_t W = 1, rank = 0, L = 1;
  bool gnuplot = false;
  // Each world rank's node (named by its lowest rank, nodes.h); `alt`: the comm_alg other than
  // --comm-alg is timed too (--compare, on two nodes or more); `hierarchy`: comm_alg hierarchy
  // is timed (--comm-alg hierarchy, or alt).
  std::vector<int> leaders;
  bool alt = false, hierarchy = false;
};

// Throws moe_ep::Error(kInvalidArgument) for a layer that does not fit W ranks, sizes past the
// MPI counts, more memory than `node_ranks` ranks on this machine have, or (rank 0) an output
// file that cannot be written.
Setup plan_bench(const BenchOptions& o, int64_t W, int64_t rank, int node_ranks);

// The transport the ops use, as printed: --transport, else $MOE_EP_TRANSPORT, else shm (the
// library's own rule, EpConfig::transport).
std::string transport_name(const std::string& flag);

// The one place the benchmark builds its EpConfig: routed experts only (SPEC §1.3: (Ns, S) =
// (0, 0)), --transport, --exact-size and `comm_alg`.
moe_ep::EpConfig make_ep_config(const BenchOptions& options, moe_ep::Communicator& comm,
                                int64_t experts, const std::string& comm_alg);

// The comm_alg that is not `comm_alg`.
std::string other_comm_alg(const std::string& comm_alg);

// One point of the sweep: this rank's batch, every rank's routing and the traffic it implies.
struct Point {
  int64_t BS = 0, H = 0, K = 0, E = 0, L = 1, W = 1, rank = 0;
  moe_ep::DType dtype = moe_ep::DType::kBF16;
  int64_t row_bytes = 0;
  // (BS, H): this rank's tokens. Other ranks' rows are made again where verification needs them
  // (token_row): a copy of every rank's tokens would make each rank's memory grow with W.
  std::vector<std::byte> x_local;
  uint64_t seed = 0;
  std::vector<int32_t> ids_all;     // (W x BS, K): every rank's expert_ids
  std::vector<float> scales;        // (BS, K): this rank's expert_scales
  std::vector<int32_t> recv_block;  // (W x L): [s L + l] = rows source s sends local expert l
  std::vector<int> send_rows, send_displ, recv_rows, recv_displ;  // rows per peer
  std::vector<int64_t> order;  // this rank's entries i K + k, stably sorted by expert
  int64_t valid = 0;           // rows dispatch delivers here
  int64_t other_send = 0;      // rows sent to other ranks (dispatch)
  int64_t other_recv = 0;      // rows received from other ranks (combine sends them back)

  const std::byte* x() const { return x_local.data(); }
  // Global token g's row (g = source rank x BS + token), as its rank made it, into `row`.
  void token_row(int64_t g, std::byte* row) const;
  const int32_t* ids() const { return ids_all.data() + rank * BS * K; }
  moe_ep::TensorView x_view() const;
  moe_ep::TensorView ids_view() const;
  moe_ep::TensorView scales_view() const;
  // dispatch_v2's inputs: x, expert_ids, expert_scales of this rank.
  moe_ep::DispatchInputs dispatch_inputs() const;
};

// Collective: this rank's x from the seed (a function of the global token index, not sent),
// this rank's routing, every rank's routing (all-gathered) and the row counts.
Point make_point(const BenchOptions& o, const Setup& s, int64_t BS, Watchdog& dog);

}  // namespace moe_ep_tool::bench
