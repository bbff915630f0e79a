#include "base/threads.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>

#include "base/check.h"
#include "moe_ep/threads.h"

namespace moe_ep {

namespace {

std::atomic<int> g_fixed{0};         // set_num_threads(n >= 1), else 0
std::atomic<int> g_share{INT_MAX};   // the smallest NodeShare::share so far
std::atomic<bool> g_crowded{false};  // some NodeShare was crowded

// CPUs this process may run on (its affinity mask; the launcher's binding shows here), 0 when
// unknown. Read once: the mask of a running process rarely changes, and a wrong guess only
// changes how many threads run, never a result.
int affinity_cpus() {
  static const int cpus = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) return 0;
    return CPU_COUNT(&set);
  }();
  return cpus;
}

// $OMP_NUM_THREADS holds a positive count (its first, for a list; OpenMP ignores a malformed
// value, so it chooses nothing), or OpenMP binds threads to places: it has then pinned this
// thread, whose mask no longer shows the process's CPUs, and the caller placed the threads.
bool caller_chose() {
  static const bool chose = [] {
    if (const char* v = std::getenv("OMP_NUM_THREADS"); v != nullptr) {
      errno = 0;
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (errno == 0 && end != v && n > 0 && (*end == '\0' || *end == ',')) return true;
    }
    return omp_get_proc_bind() != omp_proc_bind_false;
  }();
  return chose;
}

}  // namespace

void set_num_threads(int64_t n) {
  if (n < 0) detail::invalid("set_num_threads: n = ", n, " must be >= 0 (0: the automatic rule)");
  if (n > kMaxThreads)
    detail::invalid("set_num_threads: n = ", n, " exceeds ", kMaxThreads,
                    " (kMaxThreads, the most threads moe-ep runs a loop on)");
  g_fixed.store(static_cast<int>(n), std::memory_order_relaxed);
}

int num_threads() { return detail::op_threads(); }

namespace detail {

int auto_threads(int omp_max, bool caller_chose, int cpus, int share) {
  omp_max = std::max(omp_max, 1);
  if (caller_chose || cpus <= 0) return omp_max;
  return std::clamp(std::min(cpus, share), 1, omp_max);
}

int op_threads() {
  // OpenMP never runs more than its thread limit; neither does moe-ep more than kMaxThreads
  // ($OMP_NUM_THREADS=1000000 makes OpenMP crash).
  const int limit = static_cast<int>(std::clamp<int64_t>(omp_get_thread_limit(), 1, kMaxThreads));
  const int fixed = g_fixed.load(std::memory_order_relaxed);
  if (fixed > 0) return std::min(fixed, limit);
  return std::min(auto_threads(omp_get_max_threads(), caller_chose(), affinity_cpus(),
                               g_share.load(std::memory_order_relaxed)),
                  limit);
}

NodeShare node_share(int ranks, int cpus) {
  ranks = std::max(ranks, 1);
  if (cpus <= 0) return {INT_MAX, false};  // unknown: no limit from this machine
  return {std::max(cpus / ranks, 1), ranks > cpus};
}

void note_node(int ranks, int cpus) {
  const NodeShare s = node_share(ranks, cpus);
  int seen = g_share.load(std::memory_order_relaxed);
  while (s.share < seen &&
         !g_share.compare_exchange_weak(seen, s.share, std::memory_order_relaxed)) {
  }
  if (s.crowded) g_crowded.store(true, std::memory_order_relaxed);
}

bool cpus_for_every_rank() { return !g_crowded.load(std::memory_order_relaxed); }

}  // namespace detail
}  // namespace moe_ep
