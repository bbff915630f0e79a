// moe-ep tool: progress lines on stderr while a long `moe-ep run` goes through its phases, from
// rank 0 only: "moe-ep run: [12.3 s] the dense reference on rank 0 ..." (seconds since the run
// started). --progress auto (default) prints a phase once it has run kAutoAfterS seconds, so a
// quick run prints none; on prints every phase as it starts; off prints none.
#pragma once

#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

namespace moe_ep_tool {

class Progress {
 public:
  enum class Mode { kAuto, kOn, kOff };
  static constexpr double kAutoAfterS = 1.0;

  // "auto", "on", "off" (CLI11 has checked the word).
  static Mode parse(const std::string& word);

  // `active`: whether this rank prints (rank 0). `after_s`: kAuto's wait before a phase is printed.
  Progress(Mode mode, bool active, const char* command, double after_s = kAutoAfterS,
           std::FILE* out = stderr);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // A new phase begins (the previous one ends).
  void phase(const std::string& what);
  // The last phase ended; nothing is printed until the next phase().
  void done() { phase(""); }

 private:
  void loop();
  void print(const std::string& what);  // with mutex_ held

  Mode mode_;
  bool active_;
  const char* command_;
  double after_s_;
  std::FILE* out_;
  double start_s_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::string phase_;
  double phase_start_s_ = 0;
  bool printed_ = true;  // whether phase_ was printed (nothing to print yet)
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace moe_ep_tool
