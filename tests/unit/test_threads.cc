// moe_ep/threads.h: the thread count of the parallel loops. The automatic rule is checked as a
// table against hand-computed counts; set_num_threads against its bounds. That results do not
// depend on the count is checked per op (test_permute.cc, SameBitsWithOneAndFourThreads) and, for
// dispatch / combine, by the MPI suites at 1 and 2 threads.
#include <gtest/gtest.h>

#include <climits>
#include <cstdlib>
#include <string>

#include "base/threads.h"
#include "moe_ep/error.h"
#include "moe_ep/threads.h"

namespace moe_ep {
namespace {

TEST(Threads, AutomaticRuleGivesEachRankItsShareOfTheCpus) {
  struct Case {
    int omp_max;
    bool caller_chose;
    int cpus, share, want;
  };
  const Case cases[] = {
      {2, false, 2, INT_MAX, 2},  // before any Communicator: OpenMP's default
      {2, false, 2, 1, 1},        // two ranks on 2 CPUs: one thread each
      {12, false, 12, 6, 6},      // two unbound ranks on 12 CPUs: 12 / 2
      {16, false, 16, 8, 8},      // four ranks on 2 x 16 CPUs, each bound to its 16: 32 / 4
                                  // (its mask / 4 ranks, 4, would leave half the CPUs idle)
      {16, false, 1, 4, 1},       // bound to one CPU: never more threads than the mask holds
      {4, false, 64, 32, 4},      // at most omp_get_max_threads()
      {4, true, 2, 1, 4},         // $OMP_NUM_THREADS or OpenMP binding: the caller's count
      {8, false, 0, 1, 8},        // affinity unknown: OpenMP's default
      {0, false, 2, 1, 1},        // a nonsensical omp_max still gives >= 1
  };
  for (const Case& c : cases)
    EXPECT_EQ(detail::auto_threads(c.omp_max, c.caller_chose, c.cpus, c.share), c.want)
        << "omp_max " << c.omp_max << " caller_chose " << c.caller_chose << " cpus " << c.cpus
        << " share " << c.share;
}

TEST(Threads, NodeShareDividesTheCpusOfTheRanksAmongThem) {
  struct Case {
    int ranks, cpus, share;
    bool crowded;
  };
  const Case cases[] = {
      {1, 2, 2, false},       {2, 2, 1, false},  {4, 2, 1, true},
      {4, 32, 8, false},      {3, 16, 5, false},  // rounded down: the ranks never oversubscribe
      {0, 8, 8, false},                           // ranks < 1 read as 1
      {4, 0, INT_MAX, false},                     // CPUs unknown: no limit, no crowding known
  };
  for (const Case& c : cases) {
    const detail::NodeShare s = detail::node_share(c.ranks, c.cpus);
    EXPECT_EQ(s.share, c.share) << c.ranks << " ranks on " << c.cpus << " CPUs";
    EXPECT_EQ(s.crowded, c.crowded) << c.ranks << " ranks on " << c.cpus << " CPUs";
  }
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

TEST(Threads, SetNumThreadsRejectsCountsOutsideItsBounds) {
  const int before = num_threads();
  struct Case {
    int64_t n;
    const char* message;
  };
  const Case cases[] = {
      {-2, "set_num_threads: n = -2 must be >= 0 (0: the automatic rule)"},
      {kMaxThreads + 1, "set_num_threads: n = 1025 exceeds 1024 (kMaxThreads"},
      {int64_t{1} << 40, "set_num_threads: n = 1099511627776 exceeds 1024"},
  };
  for (const Case& c : cases) {
    try {
      set_num_threads(c.n);
      ADD_FAILURE() << "no error for n = " << c.n;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      const std::string msg = e.what();
      EXPECT_NE(msg.find(c.message), std::string::npos) << msg;
    }
    EXPECT_EQ(num_threads(), before);
  }
  set_num_threads(kMaxThreads);  // the bound itself is accepted
  if (std::getenv("OMP_THREAD_LIMIT") == nullptr) {
    EXPECT_EQ(num_threads(), kMaxThreads);
  }
  set_num_threads(0);
  EXPECT_EQ(num_threads(), before);
}

}  // namespace
}  // namespace moe_ep
