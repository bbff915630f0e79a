// The asynchronous ops (moe_ep/async.h): each start call copies what the op needs past the call
// (the input structs, a handle, the buffers' views) into a task, and queues the task on the
// communicator's worker, which runs the synchronous op there.
#include "moe_ep/async.h"

#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

#include "base/check.h"
#include "base/serial_worker.h"
#include "core/ep/async_state.h"
#include "core/ep/config.h"
#include "core/ep/dispatch_call.h"
#include "core/ep/header.h"
#include "transport/communicator.h"

namespace moe_ep {

namespace detail {

void AsyncState::finish(std::shared_ptr<void> result, std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    result_ = std::move(result);
    error_ = std::move(error);
    done_ = true;
  }
  cv_.notify_all();
}

bool AsyncState::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

std::shared_ptr<void> AsyncState::take(const char* what) {
  std::unique_lock<std::mutex> lock(mu_);
  if (taken_) invalid(what, ": wait() was already called: an op's result is returned once");
  cv_.wait(lock, [&] { return done_; });
  taken_ = true;
  if (error_) std::rethrow_exception(error_);
  return std::move(result_);
}

void AsyncState::source_ready(SourceRows rows) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    sources_.push_back(std::move(rows));
  }
  cv_.notify_all();
}

std::optional<SourceRows> AsyncState::next_source() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_ || handed_ < sources_.size(); });
  if (handed_ < sources_.size()) return sources_[handed_++];
  if (error_) std::rethrow_exception(error_);
  return std::nullopt;
}

bool AsyncState::sources_started() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !sources_.empty();
}

namespace {

// The worker of cfg.group_ep, made on the first asynchronous op, after the checks every start
// call makes (moe_ep/async.h).
SerialWorker& worker_for(const char* op, const EpConfig& cfg) {
  if (cfg.group_ep == nullptr) invalid(op, ": group_ep is null");
  if (cfg.tp_world_size == 2)
    fail(ErrorKind::kUnsupported, op,
         ": tp_world_size 2 is not supported asynchronously (the op would run on the workers of "
         "two communicators); call the synchronous form");
  if (const ThreadLevel level = mpi_thread_level(); !level.multiple)
    fail(ErrorKind::kUnsupported, op, ": MPI was initialised with ", level.name,
         "; the asynchronous ops call MPI from a thread of their own while the caller's may "
         "call it too, which needs MPI_THREAD_MULTIPLE (MPI_Init_thread)");
  std::unique_ptr<SerialWorker>& w = CommInternals::worker(*cfg.group_ep);
  if (!w) w = std::make_unique<SerialWorker>();
  return *w;
}

// Starts `run` (an R from an In) on cfg.group_ep's worker over a copy of `in`, whose handle
// (and, for a dispatch, DispatchBuffers) the task owns; the state gets R or the error.
template <class R, class In, class Run>
std::shared_ptr<AsyncState> start(const char* op, const In& in, const EpConfig& cfg, Run run) {
  SerialWorker& worker = worker_for(op, cfg);
  auto state = std::make_shared<AsyncState>();
  std::optional<DispatchHandle> handle;
  if (in.handle) handle = *in.handle;
  std::optional<DispatchBuffers> out;
  if constexpr (std::is_same_v<In, DispatchInputs>)
    if (in.out) out = *in.out;
  worker.submit([state, in = In(in), cfg, handle, out, run]() mutable {
    in.handle = handle ? &*handle : nullptr;
    if constexpr (std::is_same_v<In, DispatchInputs>)
      in.out = out ? &*out : nullptr;
    else
      (void)out;  // empty: only a dispatch takes the caller's buffers
    try {
      state->finish(std::make_shared<R>(run(in, cfg, *state)), nullptr);
    } catch (...) {
      state->finish(nullptr, std::current_exception());
    }
  });
  return state;
}

// A finished dispatch's sources, reported together when they did not land one by one.
void report_sources(AsyncState& state, const DispatchOutputs& out) {
  if (state.sources_started() || !out.expert_token_nums.defined()) return;
  const int64_t L = out.expert_token_nums.numel();
  const int64_t W = L > 0 ? out.ep_recv_counts.numel() / L : 0;
  const int32_t* inclusive = out.ep_recv_counts.ptr<int32_t>();
  for (int64_t s = 0; s < W; ++s) {
    SourceRows rows;
    rows.source = s;
    for (int64_t l = 0; l < L; ++l) {
      const int64_t b = l * W + s;
      const int64_t n = inclusive[b] - (b > 0 ? inclusive[b - 1] : 0);
      rows.offsets.push_back(inclusive[b] - n);
      rows.rows.push_back(n);
    }
    rows.expand_x = out.expand_x;
    rows.dynamic_scales = out.dynamic_scales;
    rows.expand_scales = out.expand_scales;
    rows.assist_info_for_combine = out.assist_info_for_combine;
    state.source_ready(std::move(rows));
  }
}

}  // namespace

}  // namespace detail

template <class T>
bool Pending<T>::test() const {
  return state_ != nullptr && state_->done();
}

template <class T>
T Pending<T>::wait() {
  if (!state_) detail::invalid("Pending::wait: this Pending holds no op (default-constructed)");
  return std::move(*std::static_pointer_cast<T>(state_->take("Pending::wait")));
}

template class Pending<DispatchOutputs>;
template class Pending<Tensor>;
template class Pending<CombineBackwardOutputs>;

std::optional<SourceRows> PendingDispatch::wait_source() {
  if (!state_)
    detail::invalid("PendingDispatch::wait_source: this Pending holds no op (default-constructed)");
  return state_->next_source();
}

PendingDispatch dispatch_v2_start(const DispatchInputs& in, const EpConfig& cfg) {
  using namespace detail;
  PendingDispatch p;
  AsyncInternals::state(p) = start<DispatchOutputs>(
      "dispatch_v2_start", in, cfg,
      [](const DispatchInputs& i, const EpConfig& c, AsyncState& state) {
        DispatchOutputs out = run_dispatch(i, c, "dispatch_v2", kOpDispatch, &state);
        report_sources(state, out);
        return out;
      });
  return p;
}

Pending<Tensor> combine_v2_start(const CombineInputs& in, const EpConfig& cfg) {
  Pending<Tensor> p;
  detail::AsyncInternals::state(p) =
      detail::start<Tensor>("combine_v2_start", in, cfg,
                            [](const CombineInputs& i, const EpConfig& c, detail::AsyncState&) {
                              return combine_v2(i, c);
                            });
  return p;
}

Pending<Tensor> dispatch_v2_backward_start(const DispatchBackwardInputs& in, const EpConfig& cfg) {
  Pending<Tensor> p;
  detail::AsyncInternals::state(p) =
      detail::start<Tensor>("dispatch_v2_backward_start", in, cfg,
                            [](const DispatchBackwardInputs& i, const EpConfig& c,
                               detail::AsyncState&) { return dispatch_v2_backward(i, c); });
  return p;
}

Pending<CombineBackwardOutputs> combine_v2_backward_start(const CombineBackwardInputs& in,
                                                          const EpConfig& cfg) {
  Pending<CombineBackwardOutputs> p;
  detail::AsyncInternals::state(p) = detail::start<CombineBackwardOutputs>(
      "combine_v2_backward_start", in, cfg,
      [](const CombineBackwardInputs& i, const EpConfig& c, detail::AsyncState&) {
        return combine_v2_backward(i, c);
      });
  return p;
}

namespace detail {

void wait_for_started_ops(const EpConfig& cfg) {
  if (SerialWorker::on_a_worker()) return;  // a started op's own task: it runs in order already
  for (const Communicator* group : {cfg.group_ep, cfg.group_tp})
    if (group != nullptr)
      if (SerialWorker* w = CommInternals::worker(*group).get(); w != nullptr) w->drain();
}

}  // namespace detail

}  // namespace moe_ep
