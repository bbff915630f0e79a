// moe-ep tool, `moe-ep bench`: timing of one point of the sweep. Per iteration: MPI_Barrier,
// then each rank times one op; the ops of an iteration run in a rotating order (moe-ep,
// alltoallv, textbook, memcpy groups) so that load on the machine falls on all of them alike.
// Per op: bytes counted (per rank: the rows it sends to OTHER ranks x the row payload,
// self-traffic excluded, mean over ranks), p50 and p99 over iterations of the max over ranks of
// the op's time, GB/s = bytes / p50, and with --compare the throughput ratios moe-ep/alltoallv
// and moe-ep/textbook (= baseline p50 / moe-ep p50: the same bytes) and the targets.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bench.h"
#include "bench_point.h"
#include "collective.h"
#include "moe_ep/comm.h"
#include "nodes.h"

namespace moe_ep_tool::bench {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

enum Op {
  kMoeDispatch,
  kMoeCombine,
  kMoeDispatchInt8,
  kA2aDispatch,
  kA2aCombine,
  kA2aDispatchInt8,
  kTbDispatch,
  kTbCombine,
  kMemcpy,
  kAltDispatch,  // moe-ep with the other comm_alg (Setup::alt)
  kAltCombine,
  kOps,
};

struct OpName {
  const char* op;
  const char* impl;
};
constexpr OpName kOpNames[kOps] = {
    {"dispatch", "moe-ep"},    {"combine", "moe-ep"},    {"dispatch-int8", "moe-ep"},
    {"dispatch", "alltoallv"}, {"combine", "alltoallv"}, {"dispatch-int8", "alltoallv"},
    {"dispatch", "textbook"},  {"combine", "textbook"},  {"copy", "memcpy"},
    {"dispatch", "moe-ep"},    {"combine", "moe-ep"},
};

// The implementation an op times, as reports name it: kOpNames' impl, with moe-ep's comm_alg
// ("moe-ep/hierarchy") when both algorithms are timed.
std::string impl_name(Op op, const std::string& comm_alg, bool alt);

struct Result {
  int64_t tokens = 0;
  Op op = kMoeDispatch;
  std::string impl;  // impl_name(op, ...)
  double bytes = 0;  // per rank, mean over ranks
  double p50_s = 0, p99_s = 0;
  double gbps = 0;
  double vs_alltoallv = kNaN, vs_textbook = kNaN;  // baseline p50 / moe-ep p50
  // moe-ep's ops: what the first timed call moved to ranks of other nodes and of this one
  // (Communicator::traffic: messages and window stores and loads, metadata included), bytes per
  // rank, mean over ranks; NaN for the baselines.
  double inter_node = kNaN, intra_node = kNaN;
};

struct Target {
  int64_t tokens = 0;
  std::string name;
  double value = 0, bound = 0;
  bool at_least = true;  // value >= bound (else value <= bound)
  bool pass = false;
};

struct PointResult {
  std::vector<Result> results;
  std::vector<Target> targets;
  double rows_other_mean = 0, rows_other_min = 0, rows_other_max = 0;
  double int8_bytes_ratio = kNaN, int8_time_ratio = kNaN;
  // Memory traffic of int8 dispatch over bf16's on the one-copy path: each token row is read
  // once (bf16) and each of its K copies written (H + 4 bytes against 2H): the time ratio the
  // memory system allows, above bytes_ratio.
  double int8_traffic_ratio = kNaN;
  // With both comm_algs: hierarchy's over fullmesh's, inter-node bytes and p50 (dispatch,
  // combine).
  double hier_bytes[2] = {kNaN, kNaN}, hier_time[2] = {kNaN, kNaN};
};

// Collective. The results on rank 0 (empty elsewhere).
PointResult time_point(const BenchOptions& o, const Setup& s, const Point& p,
                       moe_ep::Communicator& comm, bool compare, bool quant, Watchdog& dog);

}  // namespace moe_ep_tool::bench
