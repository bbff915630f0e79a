// Internal: the state one asynchronous op shares between its Pending (the caller's thread) and
// the task on the communicator's worker (moe_ep/async.h).
#pragma once

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "moe_ep/async.h"

namespace moe_ep::detail {

class AsyncState {
 public:
  // The task's end: its result (a T, type-erased) or the exception it threw.
  void finish(std::shared_ptr<void> result, std::exception_ptr error);
  bool done() const;
  // Blocks until finish(); then, once, the result (or rethrows the error).
  std::shared_ptr<void> take(const char* what);

  // Per-source completion (dispatch routes only): the worker adds each source as its rows land;
  // wait_source() hands them out in that order.
  void source_ready(SourceRows rows);
  // Blocks until a source not yet handed out is ready, or the task ended (then nullopt, or its
  // error rethrown).
  std::optional<SourceRows> next_source();
  // Whether the worker has reported any source yet (the end of the op reports the rest).
  bool sources_started() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false, taken_ = false;
  std::shared_ptr<void> result_;
  std::exception_ptr error_;
  std::vector<SourceRows> sources_;
  std::size_t handed_ = 0;
};

struct AsyncInternals {
  template <class T>
  static std::shared_ptr<AsyncState>& state(Pending<T>& p) {
    return p.state_;
  }
};

}  // namespace moe_ep::detail

namespace moe_ep::detail {

// The synchronous ops' entry: waits until the ops started on cfg.group_ep and cfg.group_tp have
// ended (their workers are idle), so that this rank issues a communicator's ops in the order its
// caller made them; at once on a worker's own thread (a started op's task runs in order).
void wait_for_started_ops(const EpConfig& cfg);

}  // namespace moe_ep::detail
