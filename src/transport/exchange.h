// Internal: what every transport uses: point-to-point exchanges with a deadline (every phase of
// every op is one Exchange; the shared-memory transport, too, announces its stores with small
// messages), row datatypes, and MPI error codes as Errors.
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
#include <functional>
#include <memory>
#include <memory_resource>
#include <string>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/error.h"

namespace moe_ep::detail {

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
  void wait() { wait(nullptr); }
  // The same, calling on_received(peer) as soon as every receive from `peer` has completed
  // (between polls, on this thread; once per peer with a receive in this phase): the caller can
  // use one peer's data while others' is still in flight. An exception from it abandons the phase.
  void wait(const std::function<void(int peer)>& on_received);
  // The receives posted from `peer` (a communicator rank).
  int receives_from(int peer) const;

  // Lets MPI move what is posted (this exchange's and any other's) while the caller computes
  // between posting and wait(): OpenMPI progresses its transports (TCP, rendezvous) only inside
  // MPI calls. Completes nothing on its own; wait() still waits for every request.
  void progress() const;

  // After wait(): the status of the i-th receive posted (0-based, in posting order).
  const MPI_Status& recv_status(int i) const;  // Error(kInternal) when there is no such receive

  // After wait(): for every peer with a receive in this phase, adds to per_peer[peer] the
  // microseconds from the start of wait() until that peer's last receive completed (SPEC §1.8
  // performance_info; `peer` is the communicator rank).
  void add_recv_wait_us(int64_t* per_peer) const;

 private:
  void make_room();  // capacity for one more request, reserved before it is posted
  // Marks the communicator unusable with `what` (the first failure only): require_comm refuses
  // later ops on it.
  void broken(std::string what) const;
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

// Testing: while non-null, every Exchange this thread makes appends its phase name here, so a
// test can check which rounds an op makes (e.g. that a DispatchHandle skips the layout rounds).
extern thread_local std::vector<std::string>* phase_trace;

}  // namespace moe_ep::detail
