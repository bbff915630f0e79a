#include "transport/communicator.h"

#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "base/check.h"
#include "base/env.h"
#include "base/serial_worker.h"
#include "base/threads.h"
#include "transport/exchange.h"
#include "transport/mpi/check.h"
#include "transport/mpi/link.h"
#include "transport/windows.h"

namespace moe_ep::detail {

// Environment variables fill only the fields the caller left unset (STYLE.md "API"). `op` names
// the caller in messages.
double resolve_timeout(const CommOptions& options, const char* op) {
  if (options.timeout_s) {
    const double t = *options.timeout_s;
    if (!(t > 0) || !std::isfinite(t))
      invalid(op, ": timeout_s = ", t, " must be a finite number > 0");
    return t;
  }
  return env_timeout_s(op).value_or(300.0);
}

}  // namespace moe_ep::detail

namespace moe_ep {

namespace {

// sysconf(_SC_PHYS_PAGES) x sysconf(_SC_PAGESIZE), or 0 when unknown (or beyond int64_t).
int64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0 || pages > INT64_MAX / page) return 0;
  return static_cast<int64_t>(pages) * page;
}

// Tells the automatic thread count (moe_ep/threads.h) how many ranks share this machine and on
// how many CPUs: the ranks of `comm` on it and the union of their affinity masks (collective over
// comm), or, when larger, the launcher's count of all of the job's ranks on it (OpenMPI's
// $OMPI_COMM_WORLD_LOCAL_SIZE, MPICH's $MPI_LOCALNRANKS): they all compete for those CPUs, also
// when `comm` is a subgroup.
void note_this_machine(MPI_Comm comm) {
  MPI_Comm node = MPI_COMM_NULL;
  detail::check_mpi(MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
                    "Communicator", "MPI_Comm_split_type");
  int ranks = 1;
  MPI_Comm_size(node, &ranks);
  cpu_set_t mine, all;
  CPU_ZERO(&mine);
  CPU_ZERO(&all);
  if (sched_getaffinity(0, sizeof(mine), &mine) != 0) CPU_ZERO(&mine);  // unknown: adds nothing
  const int rc =
      MPI_Allreduce(&mine, &all, static_cast<int>(sizeof(cpu_set_t)), MPI_BYTE, MPI_BOR, node);
  MPI_Comm_free(&node);
  detail::check_mpi(rc, "Communicator", "MPI_Allreduce");
  int cpus = CPU_COUNT(&all);
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') continue;
    char* end = nullptr;
    errno = 0;
    const long n = std::strtol(v, &end, 10);
    if (errno == 0 && *end == '\0' && n > ranks && n < (1L << 20)) {
      ranks = static_cast<int>(n);
      // The ranks outside `comm` were not asked for their masks: bound to other cores (mpirun's
      // default), they have CPUs of their own, so count the machine's, not only comm's.
      cpus = std::max<int>(cpus,
                           static_cast<int>(std::min<long>(sysconf(_SC_NPROCESSORS_ONLN), ranks)));
    }
  }
  detail::note_node(ranks, cpus);
}

// The MPI communicators whose duplication timed out: their MPI_Comm_idup is still pending, so a
// new collective over one would pair, on the late ranks, with that idup instead of its own.
std::mutex g_pending_mutex;
std::vector<MPI_Comm> g_pending_dup;

bool dup_pending(MPI_Comm comm) {
  std::lock_guard<std::mutex> lock(g_pending_mutex);
  return std::find(g_pending_dup.begin(), g_pending_dup.end(), comm) != g_pending_dup.end();
}

// MPI_Comm_idup waited on with the deadline: a rank that never creates its Communicator (it
// exited, stopped, or took another path) is a Timeout, not a hang in MPI_Comm_dup. On timeout
// the duplication stays pending (a collective cannot be cancelled): the handle MPI will write
// when it completes lives on the heap and leaks with it, and `comm` is refused from then on.
void duplicate(MPI_Comm comm, double timeout_s, MPI_Comm* dup) {
  // A communicator of one rank has no other rank to wait for: MPI_Comm_dup is local then, and
  // a tiny deadline must not blame a rank that is not there.
  int ranks = 1;
  MPI_Comm_size(comm, &ranks);
  if (ranks == 1) {
    if (MPI_Comm_dup(comm, dup) != MPI_SUCCESS)
      detail::fail(ErrorKind::kSystem, "Communicator: MPI_Comm_dup failed");
    return;
  }
  auto* out = new MPI_Comm(MPI_COMM_NULL);
  MPI_Request request = MPI_REQUEST_NULL;
  if (MPI_Comm_idup(comm, out, &request) != MPI_SUCCESS) {
    delete out;
    detail::fail(ErrorKind::kSystem, "Communicator: MPI_Comm_idup failed");
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int polls = 0;; ++polls) {
    int done = 0;
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done) {
      *dup = *out;
      delete out;
      return;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      {
        std::lock_guard<std::mutex> lock(g_pending_mutex);
        g_pending_dup.push_back(comm);
      }
      int rank = 0, size = 0;
      MPI_Comm_rank(comm, &rank);
      MPI_Comm_size(comm, &size);
      detail::fail(ErrorKind::kTimeout, "Communicator: rank ", rank, " of ", size,
                   " timed out after ", timeout_s,
                   " s duplicating the communicator (MPI_Comm_idup): another rank did not create "
                   "its Communicator (every rank creates it at the same point; one may have "
                   "exited, stopped or failed)");
    }
    // Oversubscribed ranks must leave the CPU to the peers they wait for.
    if (polls > 100) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// CommOptions::shm_grow: every rank must pass the same, and, with false, the same
// $MOE_EP_SHM_NODE_RANKS (one allreduce of both; the duplication just proved every rank is
// here), so that either every rank raises or every rank goes on into the collective window
// calls. With false, the window is made now, once (open_windows and one generation, collective
// over the machine), and fixed.
void apply_shm_grow(const Communicator& comm, const CommOptions& options) {
  const char* op = "Communicator";
  int node_ranks = 0;  // -1: this rank's $MOE_EP_SHM_NODE_RANKS is malformed (raised below)
  std::optional<Error> env_error;
  if (!options.shm_grow) try {
      node_ranks = detail::env_shm_node_ranks(op);
    } catch (const Error& e) {
      env_error = e;
      node_ranks = -1;
    }
  const int grow = options.shm_grow ? 1 : 0;
  int in[4] = {grow, -grow, node_ranks, -node_ranks},
      out[4] = {grow, -grow, node_ranks, -node_ranks};
  if (comm.size() > 1)
    detail::check_mpi(MPI_Allreduce(in, out, 4, MPI_INT, MPI_MIN, comm.mpi_comm()), op,
                      "MPI_Allreduce");
  if (out[0] != -out[1])
    detail::invalid("Communicator: ranks disagree on shm_grow (this rank: ",
                    options.shm_grow ? "true" : "false",
                    "); every rank must pass the same CommOptions::shm_grow");
  if (options.shm_grow) return;
  if (env_error) throw *env_error;
  if (out[2] != -out[3])
    detail::invalid(
        "Communicator: with shm_grow = false every rank must see the same "
        "$MOE_EP_SHM_NODE_RANKS; this rank's is ",
        node_ranks, ", another's differs (or is malformed)");
  std::shared_ptr<detail::Windows> windows = detail::open_windows(comm, op, node_ranks);
  windows->grow(options.shm_window_bytes, op, options.shm_window_bytes);
  windows->fix();
  detail::CommInternals::shm(comm) = std::move(windows);
}

}  // namespace

std::shared_ptr<Communicator> Communicator::from_mpi(MPI_Comm comm, const CommOptions& options) {
  const double timeout = detail::resolve_timeout(options, "Communicator");
  if (options.shm_window_bytes < 0)
    detail::invalid("Communicator: shm_window_bytes = ", options.shm_window_bytes,
                    " must be >= 0 (0: sized by the first op)");
  if (!options.shm_grow && options.shm_window_bytes == 0)
    detail::invalid(
        "Communicator: shm_grow = false needs shm_window_bytes > 0 (the window is "
        "made once, with that size; see dispatch_workspace for the bytes a call "
        "needs), got 0");
  // A rank's window segment is memory of this machine: more than all of it cannot be had, and
  // MPI_Win_allocate_shared would fail much later with an error code naming neither.
  if (const int64_t physical = physical_memory_bytes();
      physical > 0 && options.shm_window_bytes > physical)
    detail::invalid("Communicator: shm_window_bytes = ", options.shm_window_bytes,
                    " exceeds this machine's physical memory of ", physical,
                    " bytes (sysconf(_SC_PHYS_PAGES) x sysconf(_SC_PAGESIZE)), which each "
                    "rank's segment of the shared-memory window must fit in");
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    detail::invalid("Communicator: MPI is not initialised (call MPI_Init first)");
  if (comm == MPI_COMM_NULL) detail::invalid("Communicator: comm is MPI_COMM_NULL");
  if (dup_pending(comm))
    detail::invalid(
        "Communicator: an earlier Communicator over this MPI communicator timed out while "
        "duplicating it, and that MPI_Comm_idup is still pending: a new collective over it would "
        "pair, on the late ranks, with the pending one. Make it over another MPI communicator "
        "(every rank alike), or end the job");
  MPI_Comm dup = MPI_COMM_NULL;
  duplicate(comm, timeout, &dup);
  // Errors come back as codes that moe-ep turns into Error(kSystem), not as aborts.
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  int rank = 0, size = 0;
  MPI_Comm_rank(dup, &rank);
  MPI_Comm_size(dup, &size);
  std::shared_ptr<Communicator> made(
      new Communicator(dup, rank, size, timeout, options.shm_window_bytes));
  made->shm_grow_ = options.shm_grow;
  note_this_machine(dup);
  apply_shm_grow(*made, options);
  return made;
}

Communicator::Communicator(MPI_Comm dup, int rank, int size, double timeout_s,
                           int64_t shm_window_bytes)
    : comm_(dup),
      rank_(rank),
      size_(size),
      timeout_s_(timeout_s),
      shm_window_bytes_(shm_window_bytes) {
  static std::atomic<uint64_t> serials{0};
  serial_ = ++serials;
  reset_traffic();
}

namespace detail {

ThreadLevel mpi_thread_level() {
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  switch (level) {
    case MPI_THREAD_MULTIPLE:
      return {"MPI_THREAD_MULTIPLE", true};
    case MPI_THREAD_SERIALIZED:
      return {"MPI_THREAD_SERIALIZED", false};
    case MPI_THREAD_FUNNELED:
      return {"MPI_THREAD_FUNNELED", false};
    default:
      return {"MPI_THREAD_SINGLE", false};
  }
}

}  // namespace detail

void Communicator::reset_traffic() const {
  traffic_.message_bytes.assign(static_cast<std::size_t>(size_), 0);
  traffic_.window_bytes.assign(static_cast<std::size_t>(size_), 0);
}

Communicator::~Communicator() {
  worker_.reset();  // joins: the started ops use the communicator to their end
  shm_.reset();     // before the communicator it was split from
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

}  // namespace moe_ep
