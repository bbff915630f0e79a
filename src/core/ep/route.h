// Internal: the nodes of comm_alg "hierarchy" across nodes as one rank sees them (SPEC §3), for
// the relay routes of dispatch_v2 and combine_v2 (relay_dispatch.cc, relay_combine.cc). The
// fullmesh route has no nodes: every rank is reached directly.
#pragma once

namespace moe_ep::detail {

// W ranks in nodes of G consecutive ranks; this rank is `me`. A rank of another node is reached
// through a relay: the rank of that node with the same index in its node as the sender ("rail").
struct Nodes {
  int G = 0, me = 0;
  int node() const { return me / G; }
  int first() const { return node() * G; }  // the first rank of this node
  int count(int W) const { return W / G; }
  bool relayed(int d) const { return d / G != node(); }
  int relay_on(int n) const { return n * G + me % G; }   // this rank's relay on node n
  int relay_of(int s) const { return first() + s % G; }  // source s's relay on this node
};

}  // namespace moe_ep::detail
