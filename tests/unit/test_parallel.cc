// detail::parallel (src/core/parallel.h): a one-thread team runs its body in the calling thread,
// and an orphaned `omp for` in the body still covers the whole loop, also when the caller is
// inside an OpenMP region of its own. This file is compiled with OpenMP (tests/CMakeLists.txt).
#include <gtest/gtest.h>
#include <omp.h>

#include <vector>

#include "base/parallel.h"

namespace moe_ep {
namespace {

// Every index of [0, n) written once by `team` threads through the orphaned loop.
std::vector<int> cover(int team, int n) {
  std::vector<int> hits(static_cast<std::size_t>(n), 0);
  detail::parallel(team, [&] {
#pragma omp for schedule(static)
    for (int i = 0; i < n; ++i) ++hits[static_cast<std::size_t>(i)];
  });
  return hits;
}

TEST(Parallel, EveryTeamSizeRunsTheWholeLoopOnce) {
  for (int team : {1, 2, 3, 4})
    EXPECT_EQ(cover(team, 100), std::vector<int>(100, 1)) << "team " << team;
}

TEST(Parallel, OneThreadTeamRunsInTheCallingThread) {
  int level = -1;
  detail::parallel(1, [&] { level = omp_get_level(); });
  EXPECT_EQ(level, 0);  // no region entered
}

// Inside a caller's region an orphaned loop would bind to the caller's team: each of its threads
// would cover only its share of the rows. Each caller thread must still get every index.
TEST(Parallel, OneThreadTeamInsideACallersRegionRunsTheWholeLoop) {
  std::vector<int> whole(4, 0);
#pragma omp parallel num_threads(4)
  {
    const std::vector<int> hits = cover(1, 100);
    whole[static_cast<std::size_t>(omp_get_thread_num())] = hits == std::vector<int>(100, 1);
  }
  EXPECT_EQ(whole, std::vector<int>(4, 1));
}

}  // namespace
}  // namespace moe_ep
