#include "nodes.h"

#include <mpi.h>

#include <algorithm>
#include <cstdlib>

#include "collective.h"

namespace moe_ep_tool {

std::vector<int> ranks_on_this_machine(int rank) {
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int n = 1;
  MPI_Comm_size(node, &n);
  std::vector<int> ranks(static_cast<size_t>(n));
  MPI_Request request;
  MPI_Iallgather(&rank, 1, MPI_INT, ranks.data(), 1, MPI_INT, node, &request);
  wait_idle(&request, "the count of the ranks on this machine");
  MPI_Comm_free(&node);
  return ranks;
}

std::vector<int> node_leaders(int rank, const std::vector<int>& machine) {
  int n = static_cast<int>(machine.size());
  if (const char* v = std::getenv("MOE_EP_SHM_NODE_RANKS"); v != nullptr && *v != '\0')
    n = std::max(1, std::atoi(v));
  const auto at = std::find(machine.begin(), machine.end(), rank) - machine.begin();
  int leader = machine[static_cast<std::size_t>(at / n * n)];
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  std::vector<int> all(static_cast<std::size_t>(world));
  MPI_Request request;
  MPI_Iallgather(&leader, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD, &request);
  wait_idle(&request, "the gather of the nodes");
  return all;
}

NodeBytes split_traffic(const moe_ep::Traffic& t, const std::function<int(int64_t)>& world_rank_of,
                        const std::vector<int>& leaders, int rank) {
  NodeBytes b;
  for (std::size_t e = 0; e < t.message_bytes.size(); ++e) {
    const int peer = world_rank_of(static_cast<int64_t>(e));
    if (peer == rank) continue;
    const double bytes = static_cast<double>(t.message_bytes[e] + t.window_bytes[e]);
    (leaders[static_cast<std::size_t>(peer)] == leaders[static_cast<std::size_t>(rank)]
         ? b.intra
         : b.inter) += bytes;
  }
  return b;
}

}  // namespace moe_ep_tool
