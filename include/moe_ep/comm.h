// The communicator: an MPI communicator plus moe-ep's deadline settings.
//
// moe-ep duplicates the caller's MPI communicator (MPI_Comm_idup, collective over it, waited on
// with the deadline), so its messages never match the caller's. Every blocking wait inside an op
// polls non-blocking MPI requests against a deadline; on expiry the op throws Error(kTimeout)
// naming this rank, the peer still pending and the phase. After a timeout the communicator is
// unusable: sends of the op that timed out may still be posted and read the caller's input (x,
// expand_x) if a late peer matches them, so keep those inputs alive until the job ends (or MPI is
// aborted). Later ops on it (as group_ep or group_tp) are refused with Error(kInvalidArgument)
// naming the failure, as after an MPI error in an op: release it and make a new one. moe-ep's own
// buffers are kept alive for the rest of the process. A duplication that timed out stays pending:
// from_mpi then refuses that MPI communicator (Error(kInvalidArgument)).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moe_ep/export.h"

namespace moe_ep {

namespace detail {
class Windows;
class Link;
class SerialWorker;
struct CommInternals;
}  // namespace detail

struct CommOptions {
  // Deadline of every blocking wait, in seconds (> 0). Unset: $MOE_EP_TIMEOUT_S, else 300.
  // A malformed $MOE_EP_TIMEOUT_S raises Error(kInvalidArgument).
  std::optional<double> timeout_s;
  // Shared-memory transport (EpConfig::transport): bytes of this rank's window segment when the
  // first op that uses it creates the window (>= 0; 0, the default: twice that op's need, at
  // least 1 MiB). A window holds live dispatch_v2 outputs and combine_v2's staging rows; size it
  // with dispatch_workspace() (dispatch.h): n x shm_slot_bytes + shm_stage_bytes for n outputs
  // alive at once, so that no later call grows it. Later calls that need more still grow it (a
  // larger request, or a full window while this rank's windows map less than 4 times its largest
  // request). At most this machine's physical memory (sysconf(_SC_PHYS_PAGES) x
  // sysconf(_SC_PAGESIZE)): a rank's segment is memory of its machine; from_mpi refuses more.
  // A size within that bound that MPI_Win_allocate_shared still cannot give (the machine's other
  // ranks' segments, the rest of the job, a limit on /dev/shm or the address space) fails the op
  // that creates or grows the window with Error(kSystem) naming the bytes asked for and this
  // value.
  int64_t shm_window_bytes = 0;
  // Whether ops may create and grow the shared-memory window (true, the default: as above).
  // false: the window is made once, by from_mpi (collectively, as part of it), with
  // shm_window_bytes (> 0) per rank, and no op ever creates or grows it, so no op makes a
  // collective window allocation or maps more memory behind the caller's back: a call whose rows
  // find no free slot in a receiver's window moves them by messages (EpConfig::transport "shm"
  // stays a per-call choice). Every rank must pass the same value; $MOE_EP_SHM_NODE_RANKS is read
  // by from_mpi then. from_mpi throws Error(kInvalidArgument) for false with shm_window_bytes 0
  // (on this rank, before duplicating) and, on every rank, when ranks disagree.
  bool shm_grow = true;
};

// The bytes one rank moved to or from each peer (SPEC §3, "Bytes"), see Communicator::traffic.
struct Traffic {
  std::vector<int64_t> message_bytes;  // per group rank: bytes of the messages this rank sent it
  std::vector<int64_t> window_bytes;   // per group rank: bytes this rank stored into or loaded
                                       // from that rank's shared-memory window (rows, metadata)
};

class MOE_EP_API Communicator {
 public:
  // Collective over `comm` (MPI must be initialised; MPI_THREAD_SINGLE suffices for the
  // synchronous ops, which call MPI from the calling thread only; the asynchronous ones,
  // moe_ep/async.h, need MPI_THREAD_MULTIPLE). `comm` is duplicated, not owned: the caller may free
  // it. Also counts the ranks of `comm` on this machine and the CPUs of their affinity masks
  // (MPI_Comm_split_type, MPI_Allreduce) for the automatic thread count of moe-ep's parallel
  // loops (threads.h): process-wide, it only ever lowers that count, also after the
  // Communicator is gone.
  // Throws Error(kSystem) if MPI fails, Error(kInvalidArgument) for a bad timeout or a
  // shm_window_bytes that is negative or above this machine's physical memory (both checked on
  // this rank, before duplicating), Error(kTimeout) when another rank of `comm` does not create
  // its Communicator within the deadline (the duplication is then left pending and leaks: `comm`
  // must not be used for collectives again unless the missing ranks join it late, and from_mpi
  // refuses it from then on with Error(kInvalidArgument)); never for a `comm` of one rank, which
  // has no other rank to wait for.
  static std::shared_ptr<Communicator> from_mpi(MPI_Comm comm, const CommOptions& options = {});

  // First waits for the ops started on it (moe_ep/async.h) that are still running or queued:
  // they end by their deadlines. Then frees the duplicate (if MPI is not finalised yet); local,
  // never throws. When the shared-memory transport was used (EpConfig::transport), its node
  // communicator and windows stay mapped until the process exits: freeing them is collective over
  // the machine, and destructors run at different moments on different ranks (docs/design.md,
  // "Shared-memory transport"), so create communicators once per process rather than per step.
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // The bytes moe-ep's ops on this communicator moved from this rank to each peer since it was
  // made or reset_traffic(): every message (rows, metadata, headers, counts), and the rows and
  // metadata dispatch_v2 stores into / combine_v2 loads from a peer's window. This rank's own
  // counts (no communication). Every byte between machines is a message; a window never spans
  // machines. Not safe against a concurrent op.
  Traffic traffic() const { return traffic_; }
  void reset_traffic() const;

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm mpi_comm() const { return comm_; }
  double timeout_s() const { return timeout_s_; }
  int64_t shm_window_bytes() const { return shm_window_bytes_; }
  bool shm_grow() const { return shm_grow_; }

 private:
  Communicator(MPI_Comm dup, int rank, int size, double timeout_s, int64_t shm_window_bytes);
  MPI_Comm comm_;
  int rank_;
  int size_;
  double timeout_s_;
  int64_t shm_window_bytes_;
  bool shm_grow_ = true;
  // The shared-memory transport's state (node communicator, windows, slots), created by the
  // first op that uses it. Internal: reached through detail::CommInternals.
  friend struct detail::CommInternals;
  mutable std::shared_ptr<detail::Windows> shm_;
  // The MPI transport's per-peer links, created by the first op.
  mutable std::shared_ptr<std::vector<std::unique_ptr<detail::Link>>> links_;
  // dispatch_v2 calls so far: the id of each one's plan (DispatchHandle, dispatch.h).
  mutable uint64_t plans_ = 0;
  // comm_alg "hierarchy": the ranks per node, found by the first op that needs them, and the
  // $MOE_EP_SHM_NODE_RANKS they were found with (-1: not yet).
  mutable int node_ranks_ = 0;
  mutable int node_ranks_env_ = -1;
  mutable Traffic traffic_;
  // Runs the asynchronous ops (moe_ep/async.h) in the order they were started; made by the first.
  mutable std::unique_ptr<detail::SerialWorker> worker_;
  // The first failure of an op's wait on this communicator (a timeout, an MPI error), or "":
  // afterwards messages of the failed op may still be in flight, so no later op may start on it.
  mutable std::string broken_;
  // Unique in the process: a plan names its communicator by it, not by its address (which a
  // later communicator may reuse).
  uint64_t serial_ = 0;
};

// Reads moe-ep's environment variables as from_mpi(comm, comm_options) and ops with
// EpConfig::transport = `transport` will, at the time of the call (they read them again on each
// call): $MOE_EP_TIMEOUT_S (when comm_options.timeout_s is unset; comm_options.shm_window_bytes
// is not looked at), $MOE_EP_TRANSPORT (when `transport` is ""), $MOE_EP_STREAM_MIN_BYTES
// (dispatch_v2) and $MOE_EP_SHM_NODE_RANKS (testing: each run of that many ranks of a machine is
// a machine of its own for the shm transport, so one machine runs the paths of a job spanning
// several; every op checks it, and its ranks must agree on it; the split is made when the shm
// transport is first set up). Local: no MPI call (MPI need not be initialised), so a program can
// run it on every rank before its first collective and fail there instead of in the middle of one.
// Unset or empty variables are fine. Nothing is kept; not safe against a concurrent setenv.
//   comm_options: [in] the options the program will pass to from_mpi.
//   transport:    [in] the EpConfig::transport its ops will use: "", "mpi" or "shm".
// Returns the deadline in seconds from_mpi would use (comm_options.timeout_s, else
// $MOE_EP_TIMEOUT_S, else 300). Throws only Error(kInvalidArgument), with the reader's message
// under the prefix "check_environment: ", e.g. "check_environment: MOE_EP_TRANSPORT = \"tcp\"
// (used because transport is \"\") is not one of \"mpi\", \"shm\"" (also for a `transport` other
// than "", "mpi", "shm", or a timeout_s that is not finite and > 0).
MOE_EP_API double check_environment(const CommOptions& comm_options = {},
                                    const std::string& transport = "");

}  // namespace moe_ep
