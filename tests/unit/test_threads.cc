// moe_ep/threads.h: the thread count of the parallel loops. The automatic rule is checked as a
// table against hand-computed counts; set_num_threads against its bounds. That results do not
// depend on the count is checked per op (test_permute.cc, SameBitsWithOneAndFourThreads) and, for
// dispatch / combine, by the MPI suites at 1 and 2 threads.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "core/threads.h"
#include "moe_ep/error.h"
#include "moe_ep/threads.h"

namespace moe_ep {
namespace {

TEST(Threads, AutomaticRuleGivesEachRankItsShareOfTheCpus) {
  struct Case {
    int omp_max;
    bool env_set;
    int cpus, ranks, want;
  };
  const Case cases[] = {
      {2, false, 2, 1, 2},     // one process: OpenMP's default
      {2, false, 2, 2, 1},     // two ranks on 2 CPUs: one thread each
      {2, false, 2, 4, 1},     // oversubscribed: never below 1
      {16, false, 16, 2, 8},   // two ranks on 16 CPUs
      {16, false, 16, 3, 5},   // rounded down, so the ranks never oversubscribe
      {4, false, 64, 2, 4},    // at most omp_get_max_threads()
      {4, true, 2, 4, 4},      // $OMP_NUM_THREADS set: the caller's count
      {8, false, 0, 4, 8},     // affinity unknown: OpenMP's default
      {0, false, 2, 1, 1},     // a nonsensical omp_max still gives >= 1
      {16, false, 16, 0, 16},  // ranks < 1 read as 1
  };
  for (const Case& c : cases)
    EXPECT_EQ(detail::auto_threads(c.omp_max, c.env_set, c.cpus, c.ranks), c.want)
        << "omp_max " << c.omp_max << " env_set " << c.env_set << " cpus " << c.cpus << " ranks "
        << c.ranks;
}

TEST(Threads, SetNumThreadsFixesTheCountUntilReset) {
  const int automatic = num_threads();
  ASSERT_GE(automatic, 1);
  set_num_threads(1);
  EXPECT_EQ(num_threads(), 1);
  EXPECT_EQ(detail::threads_if(true), 1);
  set_num_threads(3);
  if (std::getenv("OMP_THREAD_LIMIT") == nullptr) {
    EXPECT_EQ(num_threads(), 3);
  }
  EXPECT_EQ(detail::threads_if(false), 1);  // a loop too small to split stays on one thread
  set_num_threads(0);
  EXPECT_EQ(num_threads(), automatic);
}

TEST(Threads, SetNumThreadsRejectsANegativeCount) {
  const int before = num_threads();
  try {
    set_num_threads(-2);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("set_num_threads: n = -2 must be >= 0"), std::string::npos) << msg;
  }
  EXPECT_EQ(num_threads(), before);
}

// Exchange::wait polls before it yields only while every rank of the machine has a CPU. (This
// raises the process's count of ranks on the machine for good: with $OMP_NUM_THREADS unset, the
// automatic thread count of later tests in this process is then 1, which changes no result.)
TEST(Threads, PollingOnlyWhileEveryRankHasACpu) {
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  ASSERT_GT(online, 0);
  detail::note_ranks_on_node(static_cast<int>(online));
  EXPECT_TRUE(detail::cpus_for_every_rank());
  detail::note_ranks_on_node(static_cast<int>(online) + 1);
  EXPECT_FALSE(detail::cpus_for_every_rank());
}

}  // namespace
}  // namespace moe_ep
