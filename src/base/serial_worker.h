// Internal: one thread that runs tasks one at a time, in the order they were submitted. The
// asynchronous ops (moe_ep/async.h) run on the worker of their communicator, so that the ops a
// rank starts on one communicator run in the order it started them (its peers pair messages by
// that order), while the caller's thread computes.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace moe_ep::detail {

class SerialWorker {
 public:
  SerialWorker() = default;
  // Runs what is queued, then joins the thread (the tasks end by their own deadlines).
  ~SerialWorker();
  SerialWorker(const SerialWorker&) = delete;
  SerialWorker& operator=(const SerialWorker&) = delete;

  // Queues `task` behind every task submitted before; starts the thread on the first call.
  // `task` must not throw (a task reports its failure through its own state).
  void submit(std::function<void()> task);
  // Nothing queued or running.
  bool idle() const;
  // Blocks until idle(). Not from a worker's own thread (it would wait for itself).
  void drain();
  // True on the thread of any SerialWorker.
  static bool on_a_worker();

 private:
  void loop();
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable idle_;  // notified when the queue runs empty
  std::deque<std::function<void()>> queue_;
  bool running_ = false;  // a task is running
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace moe_ep::detail
