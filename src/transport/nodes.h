// Internal: the nodes (machines) of a communicator for comm_alg "hierarchy" (SPEC §3): the ranks
// that share memory (MPI_Comm_split_type SHARED), or, with $MOE_EP_SHM_NODE_RANKS = n, each run of
// n consecutive ranks of a machine.
#pragma once

#include "moe_ep/comm.h"

namespace moe_ep::detail {

// G, the ranks per node: every node must hold G ranks, numbered node-major (node = rank / G).
// Collective over `comm` (MPI_Comm_split_type, MPI_Comm_split, MPI_Allreduce, MPI_Allgather): call
// it on every rank in the same op, after the header agreement (as ShmContext::create). Kept on the
// communicator for the next op with the same `shm_node_ranks`. Throws, on every rank alike,
// Error(kInvalidArgument) naming the node sizes or the first rank out of order, e.g.
//   "dispatch_v2: comm_alg \"hierarchy\" needs nodes of equal size: rank 0's node has 3 ranks,
//    rank 3's has 1"
// and Error(kSystem) when MPI fails.
int ranks_per_node(const Communicator& comm, const char* op, int shm_node_ranks);

}  // namespace moe_ep::detail
