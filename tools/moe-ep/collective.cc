#include "collective.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

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

// The presence round's messages: the step's name, on a duplicate of MPI_COMM_WORLD that returns
// errors (a send to a dead peer, with mpirun's recovery enabled, names it instead of aborting).
constexpr int kPresenceTag = 1;
MPI_Comm g_presence = MPI_COMM_NULL;

// "1", "1 and 3", "1, 2 and 5"
std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += i + 1 == ranks.size() ? " and " : ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

// A step's name, as present() sends it (cut to fit).
constexpr int kStepBytes = 64;
struct StepName {
  char text[kStepBytes] = {};
};

[[noreturn]] void throw_elsewhere(int peer, const char* theirs, const char* what) {
  throw Error(ErrorKind::kInvalidArgument,
              std::string(g_command) + ": rank " + std::to_string(world_rank()) + " is at " + what +
                  ", rank " + std::to_string(peer) + " at " +
                  std::string(theirs, strnlen(theirs, kStepBytes)) +
                  ": the ranks ran different steps (every rank must be given the same command "
                  "line)");
}

[[noreturn]] void throw_missing(const std::vector<int>& missing, const char* what) {
  throw Error(ErrorKind::kTimeout,
              std::string(g_command) + ": rank " + std::to_string(world_rank()) +
                  " timed out after " + fmt("%g", g_timeout_s) + " s waiting in " + what +
                  (missing.size() == 1 ? ": rank " : ": ranks ") + rank_list(missing) +
                  " did not arrive" + " (stopped, dead, or failed in an earlier step; --timeout)");
}

}  // namespace

void open_collectives() {
  MPI_Comm_dup(MPI_COMM_WORLD, &g_presence);
  MPI_Comm_set_errhandler(g_presence, MPI_ERRORS_RETURN);
}

void close_collectives() {
  if (g_presence != MPI_COMM_NULL) MPI_Comm_free(&g_presence);
}

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

void present(const char* what) {
  const int rank = world_rank();
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world == 1) return;
  const MPI_Comm comm = g_presence != MPI_COMM_NULL ? g_presence : MPI_COMM_WORLD;
  const auto n = static_cast<std::size_t>(world);
  // Static: a send still pending when this throws must not read a dead stack frame.
  static StepName mine;
  std::snprintf(mine.text, sizeof mine.text, "%s", what);
  std::vector<StepName> theirs(n);
  std::vector<MPI_Request> recv(n, MPI_REQUEST_NULL), send(n, MPI_REQUEST_NULL);
  std::vector<int> missing;  // peers MPI reports gone (with mpirun's recovery enabled)
  for (int r = 0; r < world; ++r) {
    if (r == rank) continue;
    if (MPI_Irecv(theirs[r].text, kStepBytes, MPI_CHAR, r, kPresenceTag, comm, &recv[r]) !=
            MPI_SUCCESS ||
        MPI_Isend(mine.text, kStepBytes, MPI_CHAR, r, kPresenceTag, comm, &send[r]) !=
            MPI_SUCCESS) {
      missing.push_back(r);
    }
  }
  const double start = now_s(), deadline = start + g_timeout_s;
  constexpr double kSpinS = 2e-3;
  std::vector<int> index(n);
  bool all = false;
  for (int polls = 0; missing.empty(); ++polls) {
    int done = 0;
    if (MPI_Testsome(world, recv.data(), &done, index.data(), MPI_STATUSES_IGNORE) != MPI_SUCCESS) {
      break;  // a receive failed: its peer is gone, named below
    }
    if ((all = done == MPI_UNDEFINED)) break;
    const double now = now_s();
    if (now > deadline) break;
    // Yield for the first kSpinS (a peer a little behind is seen at once, and oversubscribed
    // ranks still leave the CPU to it), then sleep: a sleeping rank leaves this round up to a
    // sleep (and its wake-up) after the last arrival.
    if (now - start < kSpinS || polls < 100) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  if (all) {
    // Every peer posted its receive before its send arrived here: the sends complete now.
    MPI_Waitall(world, send.data(), MPI_STATUSES_IGNORE);
    for (int r = 0; r < world; ++r) {
      if (r != rank && std::strncmp(theirs[r].text, mine.text, kStepBytes) != 0)
        throw_elsewhere(r, theirs[r].text, what);
    }
    return;
  }
  for (int r = 0; r < world; ++r) {
    if (send[r] != MPI_REQUEST_NULL) MPI_Request_free(&send[r]);
    if (recv[r] == MPI_REQUEST_NULL) continue;
    if (std::find(missing.begin(), missing.end(), r) == missing.end()) missing.push_back(r);
    MPI_Cancel(&recv[r]);
    MPI_Request_free(&recv[r]);
  }
  std::sort(missing.begin(), missing.end());
  throw_missing(missing, what);
}

void barrier_idle(const char* what) { present(what); }

void line_up(const char* what) {
  // The first round waits as long as it must, sleeping when long, so the ranks leave it up to a
  // sleep apart; the second then starts within that on every rank, ends while each one still
  // yields, and lets them go within microseconds of each other.
  present(what);
  present(what);
}

void same_command_line(const std::string& args, bool compared) {
  present("the command-line comparison");
  uint64_t mine = 0;  // 0: not compared; else FNV-1a of the arguments, never 0
  if (compared) {
    mine = 1469598103934665603ull;
    for (const char c : args) mine = (mine ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    mine |= 1;
  }
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  std::vector<uint64_t> all(static_cast<std::size_t>(world));
  MPI_Request request;
  MPI_Iallgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD, &request);
  wait_idle(&request, "the command-line comparison");
  const auto first = std::find_if(all.begin(), all.end(), [](uint64_t h) { return h != 0; });
  if (first == all.end()) return;
  std::string differ;
  for (auto it = first + 1; it != all.end(); ++it)
    if (*it != 0 && *it != *first)
      differ += (differ.empty() ? "" : ", ") + std::to_string(it - all.begin());
  if (differ.empty() || !compared) return;
  std::string shown = args;
  std::replace(shown.begin(), shown.end(), '\0', ' ');
  if (!shown.empty()) shown.pop_back();  // the last argument's end
  throw Error(ErrorKind::kInvalidArgument,
              std::string(g_command) + ": rank(s) " + differ +
                  " were given another command line than rank " +
                  std::to_string(first - all.begin()) +
                  "; every rank must be given the same options (other data or steps on one rank "
                  "give wrong results or waits). Rank " +
                  std::to_string(world_rank()) + "'s: '" + shown + "'");
}

void agree_on_error(const std::exception_ptr& error, const char* when) {
  const int rank = world_rank();
  present("the error agreement");
  int mine = error ? rank : INT_MAX, lowest = INT_MAX;
  MPI_Request request;
  MPI_Iallreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD, &request);
  wait_idle(&request, "the error agreement");
  if (lowest == INT_MAX) return;
  if (rank == lowest) {
    try {
      std::rethrow_exception(error);
    } catch (const Error& e) {
      throw AgreedError(e.kind(), e.what());  // other exceptions go on as they are
    }
  }
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
  present(what);
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
      // As main's fail(): the other survivors may still report whom they waited for.
      std::this_thread::sleep_for(std::chrono::seconds(2));
      std::_Exit(3);
    }
  }
}

}  // namespace moe_ep_tool
