// moe-ep tool: what `moe-ep run` prints on rank 0 (stdout, every line at most kReportColumns):
// the header (configuration, routing, placement), the redundant slots' use, the measurements
// (load balance, time per phase, warm repeats, bandwidth), the check against the reference, and
// a last line "PASS: ..." / "FAIL: ..." that says what ran, how fast and what the verdict means.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "batch.h"
#include "reference.h"
#include "run.h"
#include "run_plan.h"

namespace moe_ep_tool {

// What each rank measures (seconds; rows); gathered to rank 0 as doubles.
struct RankStats {
  double route_s, dispatch_s, experts_s, generate_s, combine_s;
  double received_rows;        // dispatch's valid rows (with the TP peer's)
  double sent_other_rows;      // rows this rank dispatched to another EP rank
  double received_other_rows;  // rows it received from another EP rank (and sends back)
  // Bytes the first dispatch_v2 / combine_v2 moved from this rank to ranks of other nodes
  // (messages) and of its own (messages and shared-memory windows), Communicator::traffic.
  double dispatch_inter, dispatch_intra, combine_inter, combine_intra;
};

// The warm repeats of dispatch_v2 + combine_v2: for each repeat the max over ranks, then the
// median over the n repeats (n = 0: none ran).
struct WarmTimes {
  int n = 0;
  double dispatch_s = 0, combine_s = 0;
};

// From every rank's times of each repeat (rank-major: all[r * n + i]).
WarmTimes median_of_max(const std::vector<double>& dispatch_all,
                        const std::vector<double>& combine_all, int n);

void print_header(const RunOptions& o, const Plan& p, int64_t world);

// How the replicated experts' active entries were split over their slots (R > 0).
void print_redundant_usage(const Plan& p, const Batch& global);

// Load balance, time per phase (cold: the first call), the warm repeats and the bandwidth.
void print_measurements(const RunOptions& o, const Plan& p, const std::vector<RankStats>& all,
                        const WarmTimes& warm);

// The comparison with the dense reference and its rule.
void print_check(const CheckResult& c, int64_t elements);

// "PASS: olmoe layer (H 2048, E 64, top-8) on 4 ranks, dispatch 1.2 ms + combine 0.9 ms warm;
// output equals the dense single-process reference bitwise" (FAIL: ... differs ...).
std::string summary_line(const Plan& p, int64_t world, const std::vector<RankStats>& all,
                         const WarmTimes& warm, const CheckResult& c);

}  // namespace moe_ep_tool
