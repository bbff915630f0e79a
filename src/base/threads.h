// Internal: the thread count of the parallel loops (moe_ep/threads.h) and the inputs of its
// automatic rule.
#pragma once

namespace moe_ep::detail {

// num_threads().
int op_threads();

// The team of a parallel loop worth splitting only when `parallel` (a size test): op_threads()
// threads, else 1 (as an OpenMP `if (false)` clause: the calling thread alone). Used as
//   const int team = detail::threads_if(rows * row_bytes >= kParallelMinWork);
//   #pragma omp parallel for num_threads(team)
inline int threads_if(bool parallel) { return parallel ? op_threads() : 1; }

// What one Communicator learns of this machine: `ranks` processes share the `cpus` CPUs of the
// union of their affinity masks. share: each one's part, cpus / ranks, at least 1; crowded: the
// ranks outnumber the CPUs.
struct NodeShare {
  int share;
  bool crowded;
};
NodeShare node_share(int ranks, int cpus);

// Communicator::from_mpi: applies node_share(ranks, cpus) to every later op of the process (the
// smallest share so far; crowded once any communicator was).
void note_node(int ranks, int cpus);

// False when some Communicator's ranks on this machine outnumber their CPUs (node_share): a rank
// waiting for a message then yields the CPU at once instead of polling first (Exchange::wait).
bool cpus_for_every_rank();

// The automatic rule of num_threads(), as a pure function: omp_max = omp_get_max_threads();
// caller_chose = $OMP_NUM_THREADS holds a positive count, or OpenMP binds its threads
// ($OMP_PROC_BIND, $OMP_PLACES); cpus = CPUs of this process's affinity mask (<= 0: unknown);
// share = the smallest node_share so far (a large value before the first Communicator).
int auto_threads(int omp_max, bool caller_chose, int cpus, int share);

}  // namespace moe_ep::detail
