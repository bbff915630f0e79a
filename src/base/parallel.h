// Internal: OpenMP parallel regions that cost nothing when their team is one thread. Included
// only by sources compiled with OpenMP (the library's kernels and transport).
#pragma once

#include <omp.h>

#include "base/threads.h"

namespace moe_ep::detail {

// Runs body() as one OpenMP parallel region of `team` threads, or directly in the calling thread
// when team is 1 and no OpenMP region is active: entering a region costs about 0.5 us even for
// one thread, and a small dispatch_v2 + combine_v2 pair entered several (docs/performance.md,
// "Small batches"). body may hold orphaned worksharing (`#pragma omp for`), which outside any
// region runs the whole loop in the calling thread. Inside a caller's region such a loop would
// bind to the caller's team and run only this thread's share, so there a region of its own is
// always entered (Parallel.OneThreadTeamInsideACallersRegionRunsTheWholeLoop).
template <class Body>
void parallel(int team, Body&& body) {
  if (team <= 1 && !omp_in_parallel()) {
    body();
    return;
  }
#pragma omp parallel num_threads(team)
  body();
}

}  // namespace moe_ep::detail
