// moe-ep: the command-line tool. `moe-ep run` runs one MoE layer forward across the MPI ranks
// (see run.h); `moe-ep bench` times dispatch/combine against the baselines (see bench.h). Every
// error prints one line "moe-ep: error: <kind>: <message>" and ends the job with status 2:
//   - a mistake on the command line (cli.h; kind InvalidArgument): every rank parses the same
//     argv, the ranks agree on it and the lowest failing rank prints it; MPI_Finalize;
//   - an error of the run: through MPI_Finalize when every rank fails within 10 s (an argument
//     error every rank learns, or any error of a local step the ranks agreed on: a failed write
//     of the results), else MPI_Abort (fail()). A rank whose error is Remote (another rank
//     failed and prints the real error) prints nothing.
// --help and --version print on rank 0 and exit with status 0.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <thread>

#include "bench.h"
#include "cli.h"
#include "collective.h"
#include "moe_ep/comm.h"
#include "moe_ep/error.h"
#include "plan.h"
#include "run.h"

namespace {

using moe_ep_tool::CommandLine;

// Only the error path uses it: a rank that failed waits here for the others (MPI_Ibarrier).
MPI_Comm g_fail_comm = MPI_COMM_NULL;

// True when every rank of g_fail_comm reaches this call within `seconds`.
bool all_ranks_failed_within(double seconds) {
  MPI_Request req = MPI_REQUEST_NULL;
  if (MPI_Ibarrier(g_fail_comm, &req) != MPI_SUCCESS) return false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (;;) {
    int done = 0;
    if (MPI_Test(&req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
    if (done) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void print_error(const char* kind, const char* message) {
  std::fprintf(stderr, "moe-ep: error: %s: %s\n", kind, message);
  std::fflush(stderr);
}

// Prints the error, unless it is kRemote: then another rank failed and prints the real error.
// `agreed`: an error every rank raises once the op's header agreement has run (a bad argument,
// or kRemote: another rank's), or after agree_on_error (AgreedError: a local step's error of any
// kind), which leaves no message pending: if every rank reaches the same
// point within a few seconds, they all end with MPI_Finalize and exit status 2, without
// OpenMPI's MPI_ABORT banner. Otherwise (a timeout, an MPI or internal failure, or ranks that
// do not all fail: an InvalidArgument only the source of a combine can see waits the 10 s) the job
// is aborted with MPI_Abort, as it must be so that no rank waits forever for one that left.
// Returns the exit status when it did not abort (only when `agreed`).
int fail(const char* kind, const char* message, bool remote, bool agreed) {
  if (!remote) print_error(kind, message);
  if (agreed && all_ranks_failed_within(10.0)) {
    MPI_Comm_free(&g_fail_comm);
    return 2;
  }
  // This rank's peer may still print the real error, and the other survivors of a stalled or
  // dead rank their own (each names whom it waited for; their waits began at about the same
  // time): give them a moment before MPI_Abort kills them.
  std::this_thread::sleep_for(std::chrono::milliseconds(remote ? 500 : 2000));
  MPI_Abort(MPI_COMM_WORLD, 2);
  std::_Exit(2);
}

// Collective: the command line's outcome when it runs nothing (-1 when it is a command to run).
// Ranks parse the same argv, but a file check (--load-routing) may differ between machines:
// they agree, and the lowest failing rank prints its error.
int finish_command_line(const CommandLine& line, int rank, const std::string& args) {
  std::exception_ptr error;
  if (line.action == CommandLine::Action::kError) {
    error = std::make_exception_ptr(moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument, line.text));
  }
  try {
    moe_ep_tool::agree_on_error(error, "parsing the command line");
    // Options that differ across ranks would give each rank other data (--seed, --ffn, --mask)
    // or other steps: refused on every rank before any op. A rank that only prints takes part
    // (the others' next step would otherwise wait for it) without being compared.
    moe_ep_tool::same_command_line(args, line.action == CommandLine::Action::kRun ||
                                             line.action == CommandLine::Action::kBench);
  } catch (const moe_ep::Error& e) {
    if (e.kind() == moe_ep::ErrorKind::kInvalidArgument) print_error("InvalidArgument", e.what());
    if (e.kind() == moe_ep::ErrorKind::kTimeout) throw;
    return 2;
  }
  if (line.action == CommandLine::Action::kPrint) {
    if (rank == 0) std::fputs(line.text.c_str(), stdout);
    return 0;
  }
  return -1;
}

// The deadline of the command-line agreement: --timeout, else $MOE_EP_TIMEOUT_S, else 300 s (a
// malformed value is reported by the command itself, which checks it again).
double agreement_deadline(const CommandLine& line) {
  std::optional<double> timeout_s;
  if (line.action == CommandLine::Action::kRun) timeout_s = line.run.timeout_s;
  if (line.action == CommandLine::Action::kBench) timeout_s = line.bench.timeout_s;
  try {
    moe_ep::CommOptions options;
    options.timeout_s = timeout_s;
    return moe_ep::check_environment(options, "");
  } catch (const moe_ep::Error&) {
    return 300;
  }
}

int run(const CommandLine& line) {
  try {
    if (line.action == CommandLine::Action::kPlan) return moe_ep_tool::plan_command(line.plan);
    return line.action == CommandLine::Action::kRun ? moe_ep_tool::run_command(line.run)
                                                    : moe_ep_tool::bench_command(line.bench);
  } catch (const moe_ep::Error& e) {
    const moe_ep::ErrorKind k = e.kind();
    // A local step's error every rank agreed on (AgreedError here, kRemote on the others, e.g.
    // a failed write of the results) leaves no rank behind either, whatever its kind.
    const bool agreed_on = dynamic_cast<const moe_ep_tool::AgreedError*>(&e) != nullptr;
    return fail(moe_ep::error_kind_name(k), e.what(), k == moe_ep::ErrorKind::kRemote,
                agreed_on || k == moe_ep::ErrorKind::kInvalidArgument ||
                    k == moe_ep::ErrorKind::kUnsupported || k == moe_ep::ErrorKind::kRemote);
  } catch (const std::bad_alloc&) {
    return fail("System", "out of memory (std::bad_alloc); use fewer --tokens or a smaller --ffn",
                false, false);
  } catch (const std::exception& e) {
    return fail("Internal", e.what(), false, false);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // MPI_THREAD_MULTIPLE: bench --overlap runs moe-ep's asynchronous ops (moe_ep/async.h).
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_dup(MPI_COMM_WORLD, &g_fail_comm);
  moe_ep_tool::open_collectives();

  const CommandLine line = moe_ep_tool::parse_command_line(argc, argv);
  moe_ep_tool::set_wait_context("moe-ep", agreement_deadline(line));
  int code = -1;
  try {
    std::string args;  // argv after the program name, each ended by '\0'
    for (int i = 1; i < argc; ++i) (args += argv[i]) += '\0';
    code = finish_command_line(line, rank, args);
  } catch (const moe_ep::Error& e) {  // the agreement timed out: a rank is missing
    fail(moe_ep::error_kind_name(e.kind()), e.what(), false, false);
  }
  if (code < 0) code = run(line);
  if (g_fail_comm != MPI_COMM_NULL) MPI_Comm_free(&g_fail_comm);
  moe_ep_tool::close_collectives();
  MPI_Finalize();
  return code;
}
