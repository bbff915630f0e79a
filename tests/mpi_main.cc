// main() of the MPI test binary: every rank runs every test; rank 0 prints the usual progress, the
// other ranks print only their failures (prefixed with the rank), and the binary fails when any
// rank fails.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  // The name is taken here: current_test_info() inside OnTestPartResult would deadlock on gtest's
  // own mutex.
  void OnTestStart(const ::testing::TestInfo& info) override {
    name_ = std::string(info.test_suite_name()) + "." + info.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d: %s\n", rank_, name_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }

 private:
  int rank_;
  std::string name_;
};

}  // namespace

int main(int argc, char** argv) {
  // MPI_THREAD_MULTIPLE: the asynchronous ops (test_async.cc) call MPI from a worker thread.
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  const int local = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&local, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (local != 0) std::fprintf(stderr, "[rank %d] tests FAILED\n", rank);
  MPI_Finalize();
  return any;
}
