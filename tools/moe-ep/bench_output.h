// moe-ep tool, `moe-ep bench`: what rank 0 prints and writes: the header with the counting
// rules, the verification of each point, the table of each point, the targets, and the --csv,
// --json and --plot files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench.h"
#include "bench_point.h"
#include "bench_timing.h"
#include "bench_verify.h"

namespace moe_ep_tool::bench {

// The rules behind the numbers, printed in the header and written to the JSON.
struct Rules {
  std::string bytes, time;
};
Rules counting_rules(const BenchOptions& o, const Setup& s);

void print_header(const BenchOptions& o, const Setup& s, const Rules& rules, bool compare,
                  bool quant);
void print_verification(const Verification& v, int64_t tokens);
void print_table(const PointResult& pr, int64_t tokens);

// Everything measured, on rank 0.
struct Sweep {
  std::vector<Result> results;
  std::vector<Target> targets;
  std::vector<PointResult> points;
};

// The targets (with --compare), then the files asked for. Throws moe_ep::Error(kSystem) when a
// file cannot be written.
void write_report(const BenchOptions& o, const Setup& s, const Rules& rules, const Sweep& sweep,
                  bool compare);

// The plot's series colours, one per op, all distinct ("#rrggbb").
const char* series_colour(Op op);

}  // namespace moe_ep_tool::bench
