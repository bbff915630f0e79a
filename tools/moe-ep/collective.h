// moe-ep tool: the tool's own collectives over MPI_COMM_WORLD, each with a deadline (the
// library's ops have their own), and the agreement of the ranks on an error in a local step.
//
// Two kinds of wait: wait_idle() polls a non-blocking MPI call and throws Error(kTimeout) past the
// deadline; a Watchdog thread bounds the blocking MPI calls that must stay blocking (the bench's
// baselines, written as a user would) and ends the process past it.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "moe_ep/error.h"

namespace moe_ep_tool {

// main: after MPI_Init, before any collective below (collective: duplicates MPI_COMM_WORLD for
// present()); and before MPI_Finalize.
void open_collectives();
void close_collectives();

// The command named in messages ("moe-ep run") and the deadline of the tool's own waits, seconds:
// --timeout, $MOE_EP_TIMEOUT_S, else 300. Set by the command before its first collective.
void set_wait_context(const char* command, double timeout_s);
double wait_timeout_s();
const char* command_name();

// Waits for a non-blocking MPI call without spinning: with more ranks than cores (CI runs
// oversubscribed) a spinning rank would steal the CPU from the one doing the work. Throws
// Error(kTimeout) naming this rank and `what` ("the gather of the batch") past the deadline.
void wait_idle(MPI_Request* request, const char* what);
// A barrier that names who is missing: every rank sends `what` (cut to 63 bytes) to every other
// and waits for each one's (O(W) messages; for the tool's own steps, never inside a timed op).
// Past the deadline throws Error(kTimeout) naming this rank, `what` and the ranks that did not
// arrive; a peer MPI reports gone (mpirun's recovery enabled) is named at once. A peer at
// another step (ranks given different command lines) is Error(kInvalidArgument) naming both.
void present(const char* what);
// present(what).
void barrier_idle(const char* what);
// A barrier before a timed op: present(what) twice, so that the ranks leave it together (one
// round lets a rank that slept out a long wait leave late, and the op after it would count that
// skew as its own time). Errors as present().
void line_up(const char* what);

// Collective: the ranks that are `compared` (those that run a command) were given the same
// arguments `args` (argv after the program name, each ended by '\0'), else each of them throws
// Error(kInvalidArgument) naming the ranks whose arguments differ from the lowest compared rank's
// and showing its own. A rank not compared (it only prints, e.g. --version) takes part and
// returns.
void same_command_line(const std::string& args, bool compared);

// The error agree_on_error rethrows on the lowest failed rank (a moe_ep::Error of the same kind
// and message): every rank leaves the step with an error (the others with kRemote), so main
// ends the job through MPI_Finalize with status 2 whatever the kind (a failed write: System),
// not through MPI_Abort.
class AgreedError : public moe_ep::Error {
 public:
  using moe_ep::Error::Error;
};

// Collective. Every rank learns whether any failed in a local step (`when`: "before the run",
// "writing the results"): the lowest failed rank rethrows its error (a moe_ep::Error as
// AgreedError), the others throw kRemote naming it (main prints only the former, so a failure
// every rank shares is reported once), and no rank is left waiting for one that is unwinding.
void agree_on_error(const std::exception_ptr& error, const char* when);

// Collective: every rank runs `step` (a local step: no communication), then every rank agrees on
// its outcome. Returns what `step` returned (default-constructible).
template <typename F>
auto agreed(const char* when, F&& step) {
  decltype(step()) result{};
  std::exception_ptr error;
  try {
    result = step();
  } catch (...) {
    error = std::current_exception();
  }
  agree_on_error(error, when);
  return result;
}

// Collective: rank 0 runs `step` (output only it writes), then every rank agrees on its outcome.
template <typename F>
void on_rank_0(const char* when, F&& step) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::exception_ptr error;
  if (rank == 0) {
    try {
      step();
    } catch (...) {
      error = std::current_exception();
    }
  }
  agree_on_error(error, when);
}

// Concatenates every rank's bytes on rank 0, in rank order (one MPI_Igatherv: at most 2^31 - 1
// bytes in all, else Error(kInvalidArgument)). Other ranks get an empty vector.
std::vector<std::byte> gather_bytes(const void* data, std::size_t bytes, const char* what);

template <typename T>
std::vector<T> gather_values(const std::vector<T>& local, const char* what) {
  const auto bytes = gather_bytes(local.data(), local.size() * sizeof(T), what);
  std::vector<T> all(bytes.size() / sizeof(T));
  if (!all.empty()) std::memcpy(all.data(), bytes.data(), bytes.size());
  return all;
}

// Bounds blocking MPI calls: a thread that, while armed for longer than the timeout, prints
// "moe-ep: error: Timeout: <command>: rank R waited more than T s in <phase> ..." and ends the
// process with status 3 (mpirun then ends the job).
class Watchdog {
 public:
  Watchdog(double timeout_s, int rank);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // `phase` must outlive the wait (a string literal).
  void arm(const char* phase);
  void disarm() { deadline_ = 0; }

 private:
  void loop();

  double timeout_s_;
  int rank_;
  std::atomic<double> deadline_{0};
  std::atomic<const char*> phase_{""};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Runs f with the watchdog armed, once every rank is present (so that a rank missing before the
// blocking call is named, not only outwaited).
template <typename F>
void guarded(Watchdog& dog, const char* phase, F&& f) {
  present(phase);
  dog.arm(phase);
  f();
  dog.disarm();
}

}  // namespace moe_ep_tool
