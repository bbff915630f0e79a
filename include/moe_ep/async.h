// Asynchronous forms of dispatch_v2, combine_v2 and their backward ops: start the op, compute,
// then wait for it (DeepEP's async_finish, NCCL EP's send_only + complete, torch.distributed's
// async_op=True). Not SPEC ops: each computes exactly what its synchronous form computes, bit
// for bit, with the same arguments, agreement, deadlines and errors.
//
// Progress: each Communicator has one worker thread (started by the first *_start on it) that
// runs the started ops one after another, in the order this rank started them, while the calling
// thread goes on: OpenMPI moves a message between machines only inside MPI calls, so an op whose
// transfers are to proceed while the caller computes needs a thread of its own in MPI
// (docs/design.md, "Asynchronous ops", has the measurement). A synchronous op on a communicator
// whose worker still has ops runs on the worker after them, so every rank still issues one
// communicator's ops in one order; the caller blocks until it ends.
//
// Requirements, checked by every *_start (errors raised by the start call itself):
//   - MPI initialised with MPI_THREAD_MULTIPLE (MPI_Init_thread; mpi4py's default): the worker
//     calls MPI while the caller's thread may call MPI too. Else Error(kUnsupported) naming the
//     level MPI provided.
//   - cfg.group_ep not null (Error(kInvalidArgument)); tp_world_size 0 or 1 (Error(kUnsupported):
//     a TP op would run on two communicators' workers).
// Lifetimes: the tensors the inputs view (x, expert_ids, expand_x, ...), the memory of
// DispatchInputs::out and the Communicators must stay alive and unchanged until wait() has
// returned (or thrown): the op reads and writes them while it runs, as MPI_Isend does. The input
// structs themselves, a DispatchHandle and DispatchBuffers are copied by the start call. A Pending
// destroyed without wait() leaves its op running to its end (the peers run it too), so that
// memory must stay valid until then; the Communicator's destructor waits for it.
// One thread at a time may start, test and wait the ops of one communicator.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "moe_ep/backward.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/export.h"
#include "moe_ep/tensor.h"

namespace moe_ep {

namespace detail {
class AsyncState;
struct AsyncInternals;
}  // namespace detail

// An op started and not yet waited for. Move-only in spirit: copies share the one op, and only
// one wait() of them returns its result.
template <class T>
class MOE_EP_API Pending {
 public:
  Pending() = default;
  // False for a default-constructed one.
  bool valid() const { return state_ != nullptr; }
  // True once the op has ended, with its result or an error (wait() then returns at once).
  // Never blocks, never throws (false when !valid()).
  bool test() const;
  // Blocks until the op has ended, then returns its outputs or throws its error (any error of
  // the synchronous form, e.g. Error(kTimeout) naming the late peer). The op's own deadlines
  // bound the wait. Once: a second wait(), or wait() on an invalid Pending, throws
  // Error(kInvalidArgument).
  T wait();

 protected:
  friend struct detail::AsyncInternals;
  std::shared_ptr<detail::AsyncState> state_;
};

extern template class Pending<DispatchOutputs>;
extern template class Pending<Tensor>;
extern template class Pending<CombineBackwardOutputs>;

// The rows one source rank sent this rank, landed in the outputs (PendingDispatch::wait_source).
struct SourceRows {
  // The source rank: assist_info_for_combine's first field (its group_ep rank; after a scale-in,
  // elastic_info, its new rank).
  int64_t source = -1;
  // Per local expert l in [0, L): expand_x rows [offsets[l], offsets[l] + rows[l]) are this
  // source's rows for local expert l (SPEC §1.4's order), with their expand_scales,
  // dynamic_scales and assist_info_for_combine entries written.
  std::vector<int64_t> offsets, rows;
  // The outputs the rows landed in: the Tensors wait() will return (same memory), valid for the
  // rows this SourceRows names (and those of the sources returned before it); other rows may
  // still be in flight.
  Tensor expand_x, dynamic_scales, expand_scales, assist_info_for_combine;
};

// A started dispatch_v2.
class MOE_EP_API PendingDispatch : public Pending<DispatchOutputs> {
 public:
  // Per-source completion: blocks until the rows of one more source rank have landed, and
  // returns them; std::nullopt once every source has been returned (in the order they landed,
  // each once). A MoE layer can start its experts on early sources while late ones travel.
  // Sources land one by one (with comm_alg "hierarchy" a remote source's rows when its relay's
  // have) when dispatch_v2 writes into its own expand_x (no DispatchBuffers::expand_x that must
  // be copied at the end); otherwise all at the end of the op, together. A source that sent no rows
  // is returned too (rows all 0). Throws the op's error if it failed (and wait() throws it again).
  // Error(kInvalidArgument) if !valid().
  std::optional<SourceRows> wait_source();
};

// The asynchronous forms. Each returns at once (after its own checks, above) with the op queued
// on cfg.group_ep's worker; the op's argument checks and collective agreement run there, and
// their errors come out of wait() (or wait_source()).
MOE_EP_API PendingDispatch dispatch_v2_start(const DispatchInputs& in, const EpConfig& cfg);
MOE_EP_API Pending<Tensor> combine_v2_start(const CombineInputs& in, const EpConfig& cfg);
MOE_EP_API Pending<Tensor> dispatch_v2_backward_start(const DispatchBackwardInputs& in,
                                                      const EpConfig& cfg);
MOE_EP_API Pending<CombineBackwardOutputs> combine_v2_backward_start(
    const CombineBackwardInputs& in, const EpConfig& cfg);

}  // namespace moe_ep
