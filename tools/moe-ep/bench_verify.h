// moe-ep tool, `moe-ep bench`: verification before timing, at each point of the sweep:
//   - dispatch_v2's expand_x rows equal the SPEC §1.4 layout rebuilt from every rank's tokens;
//   - combine_v2 of the rows passed through the `scale` expert function equals the SPEC §2.3
//     dense reference (reference.h) bitwise;
//   - with --compare, the textbook pipeline produces the same expand_x rows and the same combine
//     output (bitwise, +0 == -0), and the bare MPI_Alltoallv moves the same rows (each (source,
//     local expert) block equal to expand_x's, and back again unchanged);
//   - with --quant int8, every int8 row and dynamic scale equals SPEC §1.5 applied to the
//     expected row.
#pragma once

#include <cstdint>

#include "bench.h"
#include "bench_point.h"
#include "collective.h"
#include "moe_ep/comm.h"

namespace moe_ep_tool::bench {

enum Check {
  kCheckLayout,       // dispatch_v2 expand_x vs SPEC §1.4
  kCheckCombine,      // combine_v2 (scale experts) vs SPEC §2.3 reference
  kCheckTbDispatch,   // textbook expand vs moe-ep expand_x
  kCheckTbCombine,    // textbook combine vs moe-ep combine
  kCheckA2aDispatch,  // alltoallv blocks vs expand_x blocks
  kCheckA2aCombine,   // alltoallv round trip
  kCheckInt8,         // quant_mode 2 rows and scales vs SPEC §1.5
  kCheckHierarchy,    // comm_alg hierarchy: expand_x vs fullmesh's, combine vs SPEC §3's bound
  kChecks,
};

// What the check compares, and in what unit: "dispatch_v2 expand_x == SPEC §1.4 layout (rows)".
const char* check_description(Check check);

// Summed over ranks.
struct Verification {
  int64_t failures[kChecks] = {};
  int64_t total[kChecks] = {};  // what each check compared (rows or elements)
  int64_t failed() const;
};

// Collective. The first mismatch of each check is described on stderr by the rank that saw it.
// The checks run fullmesh's ops; with s.hierarchy, hierarchy's are checked against them and
// against SPEC §3's bound too.
Verification verify(const BenchOptions& o, const Setup& s, const Point& p,
                    moe_ep::Communicator& comm, bool compare, bool quant, Watchdog& dog);

}  // namespace moe_ep_tool::bench
