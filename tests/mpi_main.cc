// main() of the MPI test binary: every rank runs every test; only rank 0 prints, and the binary
// fails when any rank fails.
#include <gtest/gtest.h>
#include <mpi.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    // Keep failures visible on every rank but drop the progress chatter of ranks > 0.
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int local = RUN_ALL_TESTS();
  int any = 0;
  MPI_Allreduce(&local, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (local != 0) fprintf(stderr, "[rank %d] tests FAILED\n", rank);
  MPI_Finalize();
  return any;
}
