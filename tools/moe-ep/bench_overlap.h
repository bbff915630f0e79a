// moe-ep tool, `moe-ep bench --overlap`: a MoE layer of two micro-batches (routing -> dispatch_v2
// -> SwiGLU experts -> combine_v2), run one step after another (sequential) and with one
// micro-batch's dispatch and combine travelling on the communicator's worker while the other's
// experts compute (overlapped, moe_ep/async.h), interleaved in one run on the same routing; the
// two give the same bits (checked every iteration). With --straggler-ms D the last rank starts
// each dispatch D ms late (a slow source), and the layer is also timed with per-source completion
// (PendingDispatch::wait_source: experts start on the sources that have landed) against waiting
// for the whole dispatch.
#pragma once

#include "bench.h"
#include "bench_point.h"
#include "collective.h"
#include "moe_ep/comm.h"

namespace moe_ep_tool::bench {

// Collective over `comm`. Prints the table on rank 0; returns 0, or 1 when the overlapped layer's
// output differs from the sequential one's on some rank (the same on every rank).
int overlap_command(const BenchOptions& o, const Setup& s, moe_ep::Communicator& comm,
                    Watchdog& dog);

}  // namespace moe_ep_tool::bench
