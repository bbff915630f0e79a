// Internal: point-to-point exchanges with a deadline, and the header agreement that makes the
// collective ops safe (a bad argument on one rank never hangs the others).
//
// Every wait polls non-blocking requests (MPI_Testsome) with a backoff (sched_yield, then short
// sleeps: oversubscribed ranks must not starve their peers) against Communicator::timeout_s();
// on expiry it throws Error(kTimeout) naming this rank, the phase and the peers still pending.
// Point-to-point only (no non-blocking collectives), so a timeout knows which peers are late and
// can cancel its receives.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <memory_resource>
#include <string>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/error.h"

namespace moe_ep::detail {

// Message tags of the ops (one per phase; MPI's non-overtaking order keeps consecutive ops apart).
enum Tag : int {
  kTagHeader = 0x4d01,
  kTagCounts = 0x4d02,
  kTagMeta = 0x4d03,
  kTagRows = 0x4d04,
  kTagCombineRows = 0x4d05,
  kTagCombineMeta = 0x4d06,
  kTagShmOffsets = 0x4d07,     // shared-memory transport: where a sender's rows go (dispatch_v2)
  kTagCombineLayout = 0x4d08,  // combine_v2: an owner's rows per block, and where in its window
  kTagShmDone = 0x4d09,        // a reader is done with an owner's rows (combine_v2)
  kTagShmReady = 0x4d0a,       // every rank passed the header before a collective shm call
};

// EpConfig::transport as carried in the header (0: not resolved, the op failed before).
enum TransportCode : int64_t { kTransportMpi = 1, kTransportShm = 2 };

// Throws Error(kSystem) "<op>: <what> failed: <MPI_Error_string>" unless rc == MPI_SUCCESS.
void check_mpi(int rc, const char* op, const char* what);

// `bytes` contiguous bytes as one MPI element (a row; bytes <= INT_MAX, checked by the caller),
// created and committed on the first get(), so that a call whose rows all move through shared
// memory creates none (creating and committing one allocates inside MPI on every call); freed on
// destruction (MPI lets pending requests finish).
class MpiType {
 public:
  MpiType(int64_t bytes, const char* op);
  ~MpiType();
  MpiType(const MpiType&) = delete;
  MpiType& operator=(const MpiType&) = delete;
  // Throws Error(kSystem) "<op>: MPI_Type_contiguous failed: ..." (or MPI_Type_commit).
  MPI_Datatype get() const;

 private:
  int bytes_ = 0;
  const char* op_;
  mutable MPI_Datatype t_ = MPI_DATATYPE_NULL;
};

// One phase of point-to-point traffic: post sends and receives, then wait() for all of them.
// If the phase is abandoned (an exception, a timeout), the destructor cancels the pending receives,
// frees the pending requests and keeps the buffers registered with keep_alive() alive for the rest
// of the process, so MPI never writes into freed memory. The communicator is unusable afterwards.
// Its bookkeeping lives in an arena inside the object (heap only past a few dozen requests): a
// call of dispatch_v2 or combine_v2 runs three to five phases, and their vectors' allocations
// were a fifth of a small call's time (docs/performance.md, "Small batches").
class Exchange {
 public:
  Exchange(const Communicator& comm, const char* op, const char* phase);
  ~Exchange();
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  void isend(const void* buf, int count, MPI_Datatype type, int peer, int tag);
  void irecv(void* buf, int count, MPI_Datatype type, int peer, int tag);
  void keep_alive(std::shared_ptr<const void> buffer) { keep_.push_back(std::move(buffer)); }

  // Waits for every request until the deadline (now + comm.timeout_s()). Throws Error(kTimeout) on
  // expiry, Error(kSystem) on an MPI error, Error(kInternal) when a receive got more data than
  // posted for: the ops size every receive from what its sender announced, so that is a bug (and
  // OpenMPI's single-copy path may already have written past the buffer).
  void wait();

  // After wait(): the status of the i-th receive posted (0-based, in posting order).
  const MPI_Status& recv_status(int i) const;  // Error(kInternal) when there is no such receive

  // After wait(): for every peer with a receive in this phase, adds to per_peer[peer] the
  // microseconds from the start of wait() until that peer's last receive completed (SPEC §1.8
  // performance_info; `peer` is the communicator rank).
  void add_recv_wait_us(int64_t* per_peer) const;

 private:
  void make_room();  // capacity for one more request, reserved before it is posted
  struct Posted {
    int peer;
    bool recv;
    int64_t done_us;    // after wait(): microseconds from its start to this request's completion
    MPI_Status status;  // after wait()
  };
  const Communicator& comm_;
  const char* op_;
  const char* phase_;
  alignas(std::max_align_t) std::byte arena_[4096];
  std::pmr::monotonic_buffer_resource pool_{arena_, sizeof(arena_)};
  std::pmr::vector<MPI_Request> reqs_{&pool_};  // contiguous, for MPI_Testsome
  std::pmr::vector<Posted> posted_{&pool_};     // one per request
  std::pmr::vector<std::shared_ptr<const void>> keep_{&pool_};
};

// The fixed-size header every rank sends every other rank before an op moves data.
struct OpHeader {
  int32_t magic = 0x4d4f4550;  // "MOEP"
  int32_t op = 0;              // 1 = dispatch_v2, 2 = combine_v2
  int32_t ok = 1;              // 0: local validation failed, see kind and message
  int32_t kind = 0;            // ErrorKind of the local failure
  int64_t ep_world_size = 0, moe_expert_num = 0, tp_world_size = 0, shared_expert_num = 0,
          shared_expert_rank_num = 0, expert_shard_type = 0, global_bs = 0, zero_expert_num = 0,
          copy_expert_num = 0, const_expert_num = 0, comm_alg = 0;
  int64_t BS = 0, H = 0, K = 0, dtype = 0;
  int64_t elastic = 0;     // hash of elastic_info (0: none or not scaled down)
  int32_t all_active = 1;  // 0: x_active_mask given and not all True
  int32_t quant_mode = 0;  // dispatch_v2: quant_mode; combine_v2: comm_quant_mode (the op checks)
  int64_t transport = 0;   // TransportCode, must be equal on all ranks
  int32_t shm_grow = 0;    // shm: this rank's window segment is too small (or there is none yet)
  int32_t shm_rows = 0;    // combine_v2, shm: this rank's rows can be read from its window
  int32_t shm_node_ranks = 0;  // $MOE_EP_SHM_NODE_RANKS (0: unset), must be equal on all ranks
  char message[400] = {};      // the local error, truncated
};

// Exchanges `mine` with the ranks `peers` of `comm` (the op's world, in its rank order: all of
// comm's ranks, or the survivors of a scale-in; `comm.rank()` must be one of them) in phase
// "header" and returns their headers in that order. Then, in this order:
//   - `local` is set (this rank failed validation): rethrows it;
//   - another rank failed: throws Error(kRemote) "<op>: rank <r> failed: <its message>" (lowest r);
//   - the ranks disagree on an argument that must be equal (op, ep_world_size, moe_expert_num,
//     global_bs, H, K, dtype, transport, $MOE_EP_SHM_NODE_RANKS, ...): throws
//     Error(kInvalidArgument) on every rank naming the argument, two ranks and their values.
// `perf` (optional, indexed by communicator rank): the wait for each peer's header is added to it.
std::vector<OpHeader> agree_on_headers(const Communicator& comm, const std::vector<int>& peers,
                                       const char* op, const OpHeader& mine, const Error* local,
                                       int64_t* perf = nullptr);

// check_environment (comm.h): $MOE_EP_TIMEOUT_S (communicator.cc) and $MOE_EP_TRANSPORT,
// $MOE_EP_STREAM_MIN_BYTES (dispatch_combine.cc), each read as its user reads it.
void check_transport_environment(const char* op, const std::string& transport);

}  // namespace moe_ep::detail
