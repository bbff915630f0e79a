#include "base/serial_worker.h"

#include <utility>

namespace moe_ep::detail {

SerialWorker::~SerialWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void SerialWorker::submit(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mu_);
  queue_.push_back(std::move(task));
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  wake_.notify_one();
}

bool SerialWorker::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.empty() && !running_;
}

void SerialWorker::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, nothing left
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    running_ = true;
    lock.unlock();
    task();
    lock.lock();
    running_ = false;
  }
}

}  // namespace moe_ep::detail
