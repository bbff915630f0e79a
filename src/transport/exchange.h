// Internal: the transport's unit of work, as the ops see it: one phase of point-to-point traffic
// (bytes to and from peers, each with a tag) waited on against a deadline. Every phase of every op
// is one Exchange; the shared-memory transport, too, announces its stores with small messages.
// Nothing here names MPI: transport/mpi/exchange.cc implements it over non-blocking MPI requests.
//
// Every wait polls its requests with a backoff (sched_yield, then short sleeps: oversubscribed
// ranks must not starve their peers) against Communicator::timeout_s(); on expiry it throws
// Error(kTimeout) naming this rank, the phase and the peers still pending. Point-to-point only (no
// non-blocking collectives), so a timeout knows which peers are late and can cancel its receives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/error.h"

namespace moe_ep::detail {

// One phase: post sends and receives, then wait() for all of them. If the phase is abandoned (an
// exception, a timeout), the destructor cancels the pending receives, frees the pending requests
// and keeps the buffers registered with keep_alive() alive for the rest of the process, so the
// transport never writes into freed memory. The communicator is unusable afterwards.
// Its bookkeeping lives inside the object (heap only past a few dozen requests): a call of
// dispatch_v2 or combine_v2 runs three to five phases, and their vectors' allocations were a fifth
// of a small call's time (docs/performance.md, "Small batches").
class Exchange {
 public:
  Exchange(const Communicator& comm, const char* op, const char* phase);
  ~Exchange();
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  // `bytes` bytes at `buf` (0 <= bytes <= INT_MAX; Error(kInternal) otherwise) to or from `peer`
  // (a communicator rank) with `tag`. The buffer must stay alive and untouched until wait()
  // returns. A receive may be posted larger than what arrives (received_bytes says how much).
  void isend(const void* buf, int64_t bytes, int peer, int tag);
  void irecv(void* buf, int64_t bytes, int peer, int tag);
  // `count` objects of a trivially copyable T (count <= INT_MAX; the bytes may pass it).
  template <class T>
  void isend_n(const T* items, int64_t count, int peer, int tag) {
    static_assert(std::is_trivially_copyable_v<T>);
    isend_rows(items, count, static_cast<int64_t>(sizeof(T)), peer, tag);
  }
  template <class T>
  void irecv_n(T* items, int64_t count, int peer, int tag) {
    static_assert(std::is_trivially_copyable_v<T>);
    irecv_rows(items, count, static_cast<int64_t>(sizeof(T)), peer, tag);
  }
  // One contiguous block of `rows` rows of `row_bytes` bytes each (both <= INT_MAX; the block may
  // pass INT_MAX bytes): the row blocks of the ops.
  void isend_rows(const void* buf, int64_t rows, int64_t row_bytes, int peer, int tag);
  void irecv_rows(void* buf, int64_t rows, int64_t row_bytes, int peer, int tag);
  void keep_alive(std::shared_ptr<const void> buffer);

  // Waits for every request until the deadline (now + comm.timeout_s()). Throws Error(kTimeout) on
  // expiry, Error(kSystem) when the transport fails, Error(kInternal) when a receive got more data
  // than posted for: the ops size every receive from what its sender announced, so that is a bug.
  void wait() { wait(nullptr); }
  // The same, calling on_received(peer) as soon as every receive from `peer` has completed
  // (between polls, on this thread; once per peer with a receive in this phase): the caller can
  // use one peer's data while others' is still in flight. An exception from it abandons the phase.
  void wait(const std::function<void(int peer)>& on_received);
  // The receives posted from `peer` (a communicator rank).
  int receives_from(int peer) const;

  // Lets the transport move what is posted (this exchange's and any other's) while the caller
  // computes between posting and wait(): MPI progresses TCP and rendezvous transfers only inside
  // its calls. Completes nothing on its own; wait() still waits for every request.
  void progress() const;

  // After wait(): the bytes the i-th receive posted (0-based, in posting order) got.
  // Error(kInternal) when there is no such receive.
  int64_t received_bytes(int i) const;

  // After wait(): for every peer with a receive in this phase, adds to per_peer[peer] the
  // microseconds from the start of wait() until that peer's last receive completed (SPEC §1.8
  // performance_info; `peer` is the communicator rank).
  void add_recv_wait_us(int64_t* per_peer) const;

  // The implementation's state, defined by the transport (transport/mpi/exchange.cc) and built in
  // place below: no heap allocation per phase.
  struct State;

 private:
  State& state();
  const State& state() const;
  static constexpr std::size_t kStateBytes = 4864;
  alignas(std::max_align_t) std::byte storage_[kStateBytes];
};

// Testing: while non-null, every Exchange this thread makes appends its phase name here, so a
// test can check which rounds an op makes (e.g. that a DispatchHandle skips the layout rounds).
extern thread_local std::vector<std::string>* phase_trace;

}  // namespace moe_ep::detail
