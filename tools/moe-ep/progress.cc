#include "progress.h"

#include <chrono>

#include "common.h"

namespace moe_ep_tool {

Progress::Mode Progress::parse(const std::string& word) {
  return word == "on" ? Mode::kOn : word == "off" ? Mode::kOff : Mode::kAuto;
}

Progress::Progress(Mode mode, bool active, const char* command, double after_s, std::FILE* out)
    : mode_(mode),
      active_(active && mode != Mode::kOff),
      command_(command),
      after_s_(after_s),
      out_(out),
      start_s_(now_s()) {
  if (active_ && mode_ == Mode::kAuto) thread_ = std::thread([this] { loop(); });
}

Progress::~Progress() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Progress::phase(const std::string& what) {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  phase_ = what;
  phase_start_s_ = now_s();
  printed_ = what.empty();
  if (mode_ == Mode::kOn && !printed_) print(what);
}

void Progress::print(const std::string& what) {
  std::fprintf(out_, "%s: [%.1f s] %s ...\n", command_, now_s() - start_s_, what.c_str());
  std::fflush(out_);
  printed_ = true;
}

void Progress::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    wake_.wait_for(lock, std::chrono::milliseconds(50));
    if (!stop_ && !printed_ && now_s() - phase_start_s_ >= after_s_) print(phase_);
  }
}

}  // namespace moe_ep_tool
