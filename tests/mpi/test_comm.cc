// Communicator: duplication, deadline settings and their validation, and the thread count it
// sets (moe_ep/threads.h).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/threads.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "moe_ep/threads.h"

namespace moe_ep {
namespace {

// Restores an environment variable when the test ends.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    had_ = std::getenv(name) != nullptr;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(Communicator, DuplicatesTheCallersCommunicator) {
  auto comm = Communicator::from_mpi(MPI_COMM_WORLD, {.timeout_s = 12.5});
  int rank = -1, size = -1, cmp = MPI_IDENT;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(comm->rank(), rank);
  EXPECT_EQ(comm->size(), size);
  EXPECT_EQ(comm->timeout_s(), 12.5);
  MPI_Comm_compare(comm->mpi_comm(), MPI_COMM_WORLD, &cmp);
  EXPECT_EQ(cmp, MPI_CONGRUENT);  // same group, different context: our messages never mix
}

TEST(Communicator, TimeoutFromEnvironmentOnlyWhenUnset) {
  ScopedEnv env("MOE_EP_TIMEOUT_S", "7.25");
  EXPECT_EQ(Communicator::from_mpi(MPI_COMM_WORLD)->timeout_s(), 7.25);
  EXPECT_EQ(Communicator::from_mpi(MPI_COMM_WORLD, {.timeout_s = 3})->timeout_s(), 3);
}

TEST(Communicator, DefaultTimeoutIs300Seconds) {
  ScopedEnv env("MOE_EP_TIMEOUT_S", nullptr);
  EXPECT_EQ(Communicator::from_mpi(MPI_COMM_WORLD)->timeout_s(), 300);
}

TEST(Communicator, RejectsBadTimeouts) {
  for (double bad : {0.0, -1.0, 1.0 / 0.0}) {
    try {
      Communicator::from_mpi(MPI_COMM_WORLD, {.timeout_s = bad});
      ADD_FAILURE() << "no error for " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("timeout_s"), std::string::npos) << e.what();
    }
  }
  for (const char* bad : {"abc", "10s", "-5", "0", "nan"}) {
    ScopedEnv env("MOE_EP_TIMEOUT_S", bad);
    try {
      Communicator::from_mpi(MPI_COMM_WORLD);
      ADD_FAILURE() << "no error for " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(std::string("MOE_EP_TIMEOUT_S = \"") + bad + "\""),
                std::string::npos)
          << e.what();
    }
  }
}

// A rank that does not create its Communicator (it exited, stopped or took another path) is a
// Timeout on the others, not a hang in MPI_Comm_dup. On a communicator of the test's own: rank 0
// times out; the others then join its abandoned duplication with a bare MPI_Comm_idup (as a
// late rank's would), so that no collective is left pending.
TEST(Communicator, CreationTimesOutWhenARankIsMissing) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size < 2) GTEST_SKIP() << "needs 2 ranks";
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  if (rank == 0) {
    const auto start = std::chrono::steady_clock::now();
    try {
      Communicator::from_mpi(comm, {.timeout_s = 0.5});
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kTimeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("Communicator: rank 0 of " + std::to_string(size) +
                                           " timed out after 0.5 s duplicating the communicator"),
                std::string::npos)
          << e.what();
    }
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_GE(waited, 0.5);
    // That MPI_Comm_idup is still pending: a second Communicator over comm is refused at once
    // (its idup would pair with the pending one on the late ranks, and hang or mismatch).
    try {
      Communicator::from_mpi(comm, {.timeout_s = 0.5});
      ADD_FAILURE() << "a second Communicator over a pending duplication was made";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("that MPI_Comm_idup is still pending"),
                std::string::npos)
          << e.what();
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);  // rank 0 has given up
  if (rank != 0) {
    MPI_Comm late = MPI_COMM_NULL;
    MPI_Request request = MPI_REQUEST_NULL;
    MPI_Comm_idup(comm, &late, &request);
    MPI_Wait(&request, MPI_STATUS_IGNORE);
    MPI_Comm_free(&late);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Comm_free(&comm);
}

// check_environment reads each variable only where its reader would: the timeout when no
// timeout_s is given, the transport when EpConfig::transport is "".
TEST(Communicator, CheckEnvironmentReadsWhatTheReadersWould) {
  auto error_of = [](const CommOptions& options, const std::string& transport) -> std::string {
    try {
      check_environment(options, transport);
      return "";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      return e.what();
    }
  };
  {
    ScopedEnv t("MOE_EP_TIMEOUT_S", nullptr), tr("MOE_EP_TRANSPORT", nullptr),
        s("MOE_EP_STREAM_MIN_BYTES", nullptr);
    EXPECT_EQ(error_of({}, ""), "");
    EXPECT_EQ(check_environment(), 300);  // the deadline from_mpi would use
    EXPECT_EQ(check_environment({.timeout_s = 5}, "shm"), 5);
    EXPECT_NE(error_of({}, "tcp").find("transport = \"tcp\""), std::string::npos);
    EXPECT_NE(error_of({.timeout_s = 0.0}, "").find("timeout_s = 0"), std::string::npos);
  }
  {
    ScopedEnv t("MOE_EP_TIMEOUT_S", "7.25");
    EXPECT_EQ(check_environment(), 7.25);
  }
  {
    ScopedEnv t("MOE_EP_TIMEOUT_S", "abc");
    EXPECT_EQ(
        error_of({}, ""),
        "check_environment: MOE_EP_TIMEOUT_S = \"abc\" is not a finite number of seconds > 0");
    EXPECT_EQ(error_of({.timeout_s = 5}, ""), "");
  }
  {
    ScopedEnv tr("MOE_EP_TRANSPORT", "tcp");
    EXPECT_EQ(error_of({}, ""),
              "check_environment: MOE_EP_TRANSPORT = \"tcp\" (used because transport is \"\") "
              "is not one of \"mpi\", \"shm\"");
    EXPECT_EQ(error_of({}, "mpi"), "");
  }
  {
    ScopedEnv s("MOE_EP_STREAM_MIN_BYTES", "-1");
    EXPECT_NE(error_of({}, "mpi").find("MOE_EP_STREAM_MIN_BYTES = \"-1\""), std::string::npos);
  }
}

// A huge timeout means "no deadline"; it used to overflow the clock's nanoseconds into a deadline
// in the past, so the first wait for a late peer timed out at once.
TEST(Communicator, HugeTimeoutWaitsForALatePeer) {
  auto comm = Communicator::from_mpi(MPI_COMM_WORLD, {.timeout_s = 1e18});
  const int W = comm->size(), r = comm->rank();
  std::vector<float> x(4, 1.0f);
  std::vector<int32_t> ids = {r % W};
  EpConfig cfg;
  cfg.group_ep = comm.get();
  cfg.ep_world_size = W;
  cfg.ep_rank_id = r;
  cfg.moe_expert_num = W;
  DispatchInputs in;
  in.x = TensorView::contiguous(x.data(), DType::kF32, {1, 4});
  in.expert_ids = TensorView::contiguous(ids.data(), DType::kI32, {1, 1});
  if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  DispatchOutputs out;
  EXPECT_NO_THROW(out = dispatch_v2(in, cfg));
  EXPECT_EQ(out.expand_x.size(1), 4);
}

// A communicator of one rank has no other rank to wait for: a deadline far shorter than any MPI
// call (1 ns, from timeout_s or $MOE_EP_TIMEOUT_S) neither fails its creation nor its ops. The
// creation (MPI_Comm_idup, polled against the deadline) used to time out blaming "another rank".
TEST(Communicator, OneRankNeverTimesOutAlone) {
  for (const bool from_env : {false, true}) {
    ScopedEnv env("MOE_EP_TIMEOUT_S", from_env ? "1e-9" : nullptr);
    SCOPED_TRACE(from_env ? "MOE_EP_TIMEOUT_S=1e-9" : "timeout_s = 1e-9");
    CommOptions options;
    if (!from_env) options.timeout_s = 1e-9;
    std::shared_ptr<Communicator> comm;
    ASSERT_NO_THROW(comm = Communicator::from_mpi(MPI_COMM_SELF, options));
    ASSERT_EQ(comm->timeout_s(), 1e-9);
    for (const char* transport : {"mpi", "shm"}) {
      SCOPED_TRACE(transport);
      const int64_t BS = 16, H = 64, E = 4;
      std::vector<float> x(BS * H, 0.5f), scales(BS * 2, 0.5f);
      std::vector<int32_t> ids(BS * 2);
      for (int64_t i = 0; i < BS * 2; ++i) ids[i] = static_cast<int32_t>((i + i / 2) % E);
      EpConfig cfg;
      cfg.group_ep = comm.get();
      cfg.ep_world_size = 1;
      cfg.ep_rank_id = 0;
      cfg.moe_expert_num = E;
      cfg.transport = transport;
      DispatchInputs in;
      in.x = TensorView::contiguous(x.data(), DType::kF32, {BS, H});
      in.expert_ids = TensorView::contiguous(ids.data(), DType::kI32, {BS, 2});
      in.expert_scales = TensorView::contiguous(scales.data(), DType::kF32, {BS, 2});
      for (int call = 0; call < 20; ++call) {
        try {
          const DispatchOutputs out = dispatch_v2(in, cfg);
          CombineInputs cin;
          cin.expand_x = out.expand_x;
          cin.expert_ids = in.expert_ids;
          cin.assist_info_for_combine = out.assist_info_for_combine;
          cin.ep_send_counts = out.ep_recv_counts;
          cin.expert_scales = *in.expert_scales;
          const Tensor y = combine_v2(cin, cfg);
          ASSERT_EQ(y.size(0), BS);
          ASSERT_EQ(y.ptr<float>()[0], 0.5f);  // 0.5 x (0.5 + 0.5)
        } catch (const Error& e) {
          FAIL() << "call " << call << ": " << e.what();
        }
      }
    }
  }
}

TEST(Communicator, RejectsNullCommunicator) {
  try {
    Communicator::from_mpi(MPI_COMM_NULL);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("MPI_COMM_NULL"), std::string::npos) << e.what();
  }
}

// The automatic thread count (threads.h) after a Communicator exists: each rank takes its share
// of the CPUs, counted here independently of the library (the job's ranks on this machine, the
// union of their affinity masks). ctest also runs this test at 4 ranks without
// $OMP_NUM_THREADS (mpi_tests_threads_auto.np4), where on a machine of fewer than 8 CPUs the
// share (1 or 2) differs from OpenMP's default and the ranks outnumber 2 or 3 CPUs.
TEST(Communicator, AutomaticThreadCountSharesTheMachine) {
  set_num_threads(0);
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int ranks = 0;
  MPI_Comm_size(node, &ranks);
  cpu_set_t mine;
  CPU_ZERO(&mine);
  ASSERT_EQ(sched_getaffinity(0, sizeof(mine), &mine), 0);
  std::vector<cpu_set_t> masks(static_cast<std::size_t>(ranks));
  MPI_Allgather(&mine, sizeof(cpu_set_t), MPI_BYTE, masks.data(), sizeof(cpu_set_t), MPI_BYTE,
                node);
  MPI_Comm_free(&node);
  cpu_set_t all;
  CPU_ZERO(&all);
  for (cpu_set_t& m : masks) CPU_OR(&all, &all, &m);
  const int cpus = CPU_COUNT(&mine), node_cpus = CPU_COUNT(&all);
  // The test binary does not link OpenMP itself; the library's runtime is already loaded.
  using GetFn = int (*)();
  auto max_threads = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  auto proc_bind = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "omp_get_proc_bind"));
  ASSERT_NE(max_threads, nullptr);
  ASSERT_NE(proc_bind, nullptr);
  const int omp_max = max_threads();
  auto comm = Communicator::from_mpi(MPI_COMM_WORLD);
  const char* env = std::getenv("OMP_NUM_THREADS");
  const bool chose = (env != nullptr && std::atoi(env) > 0) || proc_bind() != 0;
  const int want = chose ? omp_max : std::clamp(std::min(cpus, node_cpus / ranks), 1, omp_max);
  EXPECT_EQ(num_threads(), want) << ranks << " ranks on this machine, " << node_cpus
                                 << " CPUs, this rank's " << cpus << ", omp_get_max_threads() "
                                 << omp_max << (chose ? ", the caller chose" : "");
  EXPECT_EQ(detail::cpus_for_every_rank(), ranks <= node_cpus)
      << ranks << " ranks on " << node_cpus << " CPUs";
  set_num_threads(1);
  EXPECT_EQ(num_threads(), 1);
  set_num_threads(0);
  EXPECT_EQ(num_threads(), want);
}

}  // namespace
}  // namespace moe_ep
