// moe-ep tool: which ranks share a node, for `run` and `bench` (the memory check, and the bytes
// each rank moves inside its node and between nodes).
#pragma once

#include <functional>
#include <vector>

#include "moe_ep/comm.h"

namespace moe_ep_tool {

// The ranks of MPI_COMM_WORLD that share this machine, increasing. Collective.
std::vector<int> ranks_on_this_machine(int rank);

// Each world rank's node, named by its lowest world rank: the ranks of its machine (`machine`,
// increasing), in runs of $MOE_EP_SHM_NODE_RANKS when set (the nodes of comm_alg "hierarchy").
// Collective.
std::vector<int> node_leaders(int rank, const std::vector<int>& machine);

// The bytes of `t` (per peer of a communicator whose peer e is world rank world_rank_of(e)) to
// ranks of other nodes and to ranks of this one, by node leader; this rank's own excluded.
struct NodeBytes {
  double inter = 0, intra = 0;
};
NodeBytes split_traffic(const moe_ep::Traffic& t, const std::function<int(int64_t)>& world_rank_of,
                        const std::vector<int>& leaders, int rank);

}  // namespace moe_ep_tool
