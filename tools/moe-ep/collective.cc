#include "collective.h"

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common.h"
#include "moe_ep/error.h"

namespace moe_ep_tool {

using moe_ep::Error;
using moe_ep::ErrorKind;

namespace {

const char* g_command = "moe-ep";
double g_timeout_s = 300;

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

}  // namespace

void set_wait_context(const char* command, double timeout_s) {
  g_command = command;
  g_timeout_s = timeout_s;
}

double wait_timeout_s() { return g_timeout_s; }

const char* command_name() { return g_command; }

void wait_idle(MPI_Request* request, const char* what) {
  const double deadline = now_s() + g_timeout_s;
  int done = 0;
  for (int polls = 0;; ++polls) {
    MPI_Test(request, &done, MPI_STATUS_IGNORE);
    if (done) return;
    if (now_s() > deadline) {
      throw Error(ErrorKind::kTimeout, std::string(g_command) + ": rank " +
                                           std::to_string(world_rank()) + " timed out after " +
                                           fmt("%g", g_timeout_s) +
                                           " s waiting for the other ranks in " + what);
    }
    if (polls > 100) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void barrier_idle(const char* what) {
  MPI_Request request;
  MPI_Ibarrier(MPI_COMM_WORLD, &request);
  wait_idle(&request, what);
}

void agree_on_error(const std::exception_ptr& error, const char* when) {
  const int rank = world_rank();
  int mine = error ? rank : INT_MAX, lowest = INT_MAX;
  MPI_Request request;
  MPI_Iallreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD, &request);
  wait_idle(&request, "the error agreement");
  if (lowest == INT_MAX) return;
  if (rank == lowest) std::rethrow_exception(error);
  throw Error(ErrorKind::kRemote, std::string(g_command) + ": rank " + std::to_string(lowest) +
                                      " failed " + when + " (its message says why)");
}

std::vector<std::byte> gather_bytes(const void* data, std::size_t bytes, const char* what) {
  if (bytes > static_cast<std::size_t>(INT_MAX)) {
    throw Error(ErrorKind::kInvalidArgument,
                std::string(g_command) + ": " + std::to_string(bytes) +
                    " bytes on one rank exceed what MPI_Gatherv moves (2^31-1); use fewer "
                    "--tokens");
  }
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const int n = static_cast<int>(bytes);
  std::vector<int> counts(world), displs(world);
  MPI_Request request;
  MPI_Igather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD, &request);
  wait_idle(&request, what);
  std::vector<std::byte> all;
  if (rank == 0) {
    int64_t total = 0;
    for (int r = 0; r < world; ++r) {
      displs[r] = static_cast<int>(total);
      total += counts[r];
      if (total > INT_MAX) {
        throw Error(ErrorKind::kInvalidArgument,
                    std::string(g_command) +
                        ": the gathered batch exceeds 2^31-1 bytes on rank 0; use fewer --tokens");
      }
    }
    all.resize(static_cast<std::size_t>(total));
  }
  MPI_Igatherv(data, n, MPI_BYTE, all.data(), counts.data(), displs.data(), MPI_BYTE, 0,
               MPI_COMM_WORLD, &request);
  wait_idle(&request, what);
  return all;
}

Watchdog::Watchdog(double timeout_s, int rank) : timeout_s_(timeout_s), rank_(rank) {
  thread_ = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
  stop_ = true;
  thread_.join();
}

void Watchdog::arm(const char* phase) {
  phase_ = phase;
  deadline_ = now_s() + timeout_s_;
}

void Watchdog::loop() {
  while (!stop_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const double d = deadline_;
    if (d > 0 && now_s() > d) {
      std::fprintf(stderr,
                   "moe-ep: error: Timeout: %s: rank %d waited more than %g s in %s (another "
                   "rank failed or stopped; --timeout); ending the job\n",
                   g_command, rank_, timeout_s_, phase_.load());
      std::fflush(stderr);
      std::_Exit(3);
    }
  }
}

}  // namespace moe_ep_tool
