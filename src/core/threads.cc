#include "core/threads.h"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "core/check.h"
#include "moe_ep/threads.h"

namespace moe_ep {

namespace {

std::atomic<int> g_fixed{0};          // set_num_threads(n >= 1), else 0
std::atomic<int> g_ranks_on_node{1};  // the most ranks sharing this machine in a Communicator

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

bool omp_env_set() {
  static const bool set = [] {
    const char* v = std::getenv("OMP_NUM_THREADS");
    return v != nullptr && *v != '\0';
  }();
  return set;
}

}  // namespace

void set_num_threads(int n) {
  if (n < 0) detail::invalid("set_num_threads: n = ", n, " must be >= 0 (0: the automatic rule)");
  g_fixed.store(n, std::memory_order_relaxed);
}

int num_threads() { return detail::op_threads(); }

namespace detail {

int auto_threads(int omp_max, bool env_set, int cpus, int ranks) {
  omp_max = std::max(omp_max, 1);
  if (env_set || cpus <= 0) return omp_max;
  return std::clamp(cpus / std::max(ranks, 1), 1, omp_max);
}

int op_threads() {
  const int fixed = g_fixed.load(std::memory_order_relaxed);
  if (fixed > 0) return std::min(fixed, std::max(omp_get_thread_limit(), 1));
  return auto_threads(omp_get_max_threads(), omp_env_set(), affinity_cpus(),
                      g_ranks_on_node.load(std::memory_order_relaxed));
}

bool cpus_for_every_rank() {
  static const long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 && g_ranks_on_node.load(std::memory_order_relaxed) <= online;
}

void note_ranks_on_node(int ranks) {
  int seen = g_ranks_on_node.load(std::memory_order_relaxed);
  while (ranks > seen &&
         !g_ranks_on_node.compare_exchange_weak(seen, ranks, std::memory_order_relaxed)) {
  }
}

}  // namespace detail
}  // namespace moe_ep
