#include "exit_guard.h"

#include <mpi.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

namespace moe_ep_python {
namespace {

constexpr double kDefaultGraceS = 2.0;
constexpr double kMaxGraceS = 86400.0;

std::mutex g_mutex;
bool g_fault = false;
std::string g_first;  // "TimeoutError: rank 0: ..." of the first fault

double grace_seconds() {
  const char* v = std::getenv("MOE_EP_EXIT_GRACE_S");
  if (v == nullptr || *v == '\0') return kDefaultGraceS;
  char* end = nullptr;
  errno = 0;
  const double s = std::strtod(v, &end);
  if (errno == 0 && end != v && *end == '\0' && s > 0 && s <= kMaxGraceS) return s;
  std::fprintf(stderr,
               "moe_ep: MOE_EP_EXIT_GRACE_S = '%s' is not a number of seconds in (0, %g]; "
               "using %g\n",
               v, kMaxGraceS, kDefaultGraceS);
  return kDefaultGraceS;
}

}  // namespace

void note_fault(const char* kind, const std::string& message) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_fault) return;
  g_fault = true;
  // Bounded: the line is written from a thread racing the process's exit.
  g_first = std::string(kind) + ": " + message.substr(0, 400);
}

double arm_exit_guard() {
  std::string line;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_fault) return -1;
    line = g_first;
  }
  const double grace = grace_seconds();
  int rank = -1, initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char head[320];
  std::snprintf(head, sizeof head,
                "moe_ep: rank %d (of MPI_COMM_WORLD) is still exiting %g s after its "
                "interpreter began to (MPI_Finalize waits for a peer that is stalled or "
                "gone); ending it with status 1. The first error was ",
                rank, grace);
  // Formatted now, while the process is whole; the thread only writes it and exits.
  auto* text = new std::string(std::string(head) + line + "\n");
  std::thread([grace, text] {
    std::this_thread::sleep_for(std::chrono::duration<double>(grace));
    ssize_t unused = ::write(2, text->data(), text->size());
    (void)unused;
    ::_exit(1);
  }).detach();
  return grace;
}

bool abort_job(const std::string& what) {
  int initialized = 0, finalized = 0, rank = -1, size = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return false;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size < 2) return false;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const std::string line =
      "moe_ep: rank " + std::to_string(rank) + " of " + std::to_string(size) +
      " (MPI_COMM_WORLD) ended on an uncaught " + what.substr(0, 200) +
      " (traceback above); calling MPI_Abort so that the other ranks do not wait for it "
      "(MOE_EP_ABORT_ON_EXCEPTION=0 turns this off)\n";
  ssize_t unused = ::write(2, line.data(), line.size());
  (void)unused;
  MPI_Abort(MPI_COMM_WORLD, 1);
  ::_exit(1);  // not reached: MPI_Abort does not return
}

}  // namespace moe_ep_python
