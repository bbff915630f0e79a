// How many OpenMP threads moe-ep's parallel loops use (docs/performance.md, "Threads").
//
// Every op that splits rows across threads (dispatch_v2's and combine_v2's row copies and sums,
// the int8 quantisation, permute / unpermute and their gradients) runs its parallel loops on
// num_threads() threads; small calls stay on the calling thread. Results never depend on the
// count: every element sees the same operations in the same order on any number of threads.
//
// Ranks that share a machine each start their own threads. OpenMP's default is one thread per
// CPU the process may run on, so N ranks without CPU binding (mpirun --oversubscribe, or more
// ranks than the launcher binds) start N times as many threads as there are CPUs; a parallel
// loop then waits for threads the other ranks' threads keep off the CPU, and dispatch_v2 or
// combine_v2 can take ten times longer. The automatic rule gives each rank its share instead.
#pragma once

#include <cstdint>

#include "moe_ep/export.h"

namespace moe_ep {

// The most threads moe-ep runs one loop on (more than any machine's CPUs; a team of a million
// threads makes OpenMP crash, not run slowly).
inline constexpr int64_t kMaxThreads = 1024;

// 1 <= n <= kMaxThreads: every later parallel loop of moe-ep uses n threads (at most OpenMP's
// limit, omp_get_thread_limit()). n == 0: back to the automatic rule (num_threads()).
// Process-wide; thread-safe. Throws Error(kInvalidArgument) for n < 0 or n > kMaxThreads.
MOE_EP_API void set_num_threads(int64_t n);

// The thread count of moe-ep's parallel loops, in [1, min(kMaxThreads, omp_get_thread_limit())]:
//   - n, when set_num_threads(n) set n >= 1;
//   - else omp_get_max_threads() when the caller chose the OpenMP threads: $OMP_NUM_THREADS
//     holds a positive count, or OpenMP binds its threads to places ($OMP_PROC_BIND,
//     $OMP_PLACES);
//   - else min(C, S), at least 1 and at most omp_get_max_threads(): C the CPUs of this process's
//     affinity mask, S its share of the machine, the smallest over the Communicators created so
//     far (Communicator::from_mpi: the union of the affinity masks of the communicator's ranks on
//     this machine, divided by those ranks, or by the launcher's count of the job's ranks on it
//     when larger: $OMPI_COMM_WORLD_LOCAL_SIZE, $MPI_LOCALNRANKS). So two unbound ranks on 16
//     CPUs take 8 threads each, four on 2 CPUs one each, four bound two by two to the 16 CPUs of
//     each of two sockets 8 each, and a process without communicators keeps OpenMP's default.
MOE_EP_API int num_threads();

}  // namespace moe_ep
