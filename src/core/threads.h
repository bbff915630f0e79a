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

// Communicator::from_mpi: `ranks` processes of the new communicator share this machine.
void note_ranks_on_node(int ranks);

// True when the ranks sharing this machine (note_ranks_on_node) do not outnumber its online
// CPUs: a rank waiting for a message may then poll for a few microseconds before it yields the
// CPU, without keeping a peer off it (Exchange::wait).
bool cpus_for_every_rank();

// The automatic rule of num_threads(), as a pure function: omp_max = omp_get_max_threads(),
// env_set = $OMP_NUM_THREADS is set and not empty, cpus = CPUs of the affinity mask (<= 0:
// unknown), ranks = ranks sharing this machine (>= 1).
int auto_threads(int omp_max, bool env_set, int cpus, int ranks);

}  // namespace moe_ep::detail
