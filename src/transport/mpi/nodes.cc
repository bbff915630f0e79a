#include "transport/nodes.h"

#include <mpi.h>

#include <map>
#include <vector>

#include "base/check.h"
#include "transport/communicator.h"
#include "transport/mpi/check.h"

namespace moe_ep::detail {

namespace {

// The lowest rank of `comm` in this rank's node: its name.
int node_leader(const Communicator& comm, const char* op, int shm_node_ranks) {
  MPI_Comm machine = MPI_COMM_NULL, node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm.mpi_comm(), MPI_COMM_TYPE_SHARED, comm.rank(), MPI_INFO_NULL,
                                &machine),
            op, "MPI_Comm_split_type");
  int machine_rank = 0;
  MPI_Comm_rank(machine, &machine_rank);
  const int color = shm_node_ranks > 0 ? machine_rank / shm_node_ranks : 0;
  const int rc = MPI_Comm_split(machine, color, machine_rank, &node);
  MPI_Comm_free(&machine);
  check_mpi(rc, op, "MPI_Comm_split");
  int me = comm.rank(), leader = 0;
  const int rc2 = MPI_Allreduce(&me, &leader, 1, MPI_INT, MPI_MIN, node);
  MPI_Comm_free(&node);
  check_mpi(rc2, op, "MPI_Allreduce");
  return leader;
}

}  // namespace

int ranks_per_node(const Communicator& comm, const char* op, int shm_node_ranks) {
  int& cached = CommInternals::node_ranks(comm);
  int& cached_env = CommInternals::node_ranks_env(comm);
  if (cached > 0 && cached_env == shm_node_ranks) return cached;
  const int leader = node_leader(comm, op, shm_node_ranks);
  const int W = comm.size();
  std::vector<int> leaders(static_cast<std::size_t>(W));
  check_mpi(MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, comm.mpi_comm()), op,
            "MPI_Allgather");
  std::map<int, int> size;  // leader -> ranks
  for (const int l : leaders) ++size[l];
  const int G = size.begin()->second;
  for (const auto& [l, n] : size)
    if (n != G)
      invalid(op, ": comm_alg \"hierarchy\" needs nodes of equal size: rank ", size.begin()->first,
              "'s node has ", G, " ranks, rank ", l, "'s has ", n);
  for (int r = 0; r < W; ++r)
    if (leaders[r] != r / G * G)
      invalid(op, ": comm_alg \"hierarchy\" needs the ranks numbered node-major (", G,
              " per node, node = rank / ", G, "), but rank ", r, " shares a node with rank ",
              leaders[r]);
  cached = G;
  cached_env = shm_node_ranks;
  return G;
}

}  // namespace moe_ep::detail
