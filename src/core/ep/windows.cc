#include "core/ep/windows.h"

#include <algorithm>
#include <memory>

#include "transport/communicator.h"
#include "transport/exchange.h"
#include "transport/tags.h"

namespace moe_ep::detail {

bool shm_applies(int64_t transport, const EpConfig& cfg, const World& w) {
  return transport == kTransportShm && cfg.tp_world_size != 2 && w.hash == 0;
}

Windows& ensure_shm(const Communicator& comm, const char* op, const std::vector<OpHeader>& h,
                    const std::vector<int>& peers, int64_t own_need) {
  std::shared_ptr<Windows>& ctx = CommInternals::shm(comm);
  // A rank that timed out in the header phase sent its header all the same, so the others'
  // agreement does not prove it is still here. Before a blocking collective (which has no
  // deadline), every rank taking part confirms it passed the agreement (phase "shm ready", with
  // the deadline): a missing rank then shows up as kTimeout instead of a hang.
  auto confirm = [&](const std::vector<int>& with) {
    Exchange ex(comm, op, "shm ready");
    auto flags = std::make_shared<std::vector<int32_t>>(with.size() + 1, 1);
    ex.keep_alive(flags);
    for (std::size_t i = 0; i < with.size(); ++i) {
      if (with[i] == comm.rank()) continue;
      ex.irecv_n(flags->data() + i, 1, with[i], kTagShmReady);
      ex.isend_n(flags->data() + with.size(), 1, with[i], kTagShmReady);
    }
    ex.wait();
  };
  bool grow = false;
  if (!ctx) {
    confirm(peers);  // MPI_Comm_split_type is collective over group_ep
    ctx = open_windows(comm, op, h[0].shm_node_ranks);
    grow = true;
  } else {
    std::vector<int> node;
    for (std::size_t p = 0; p < h.size(); ++p) {
      if (ctx->node_of(peers[p]) < 0) continue;
      node.push_back(peers[p]);
      if (h[p].shm_grow) grow = true;
    }
    if (grow) confirm(node);  // MPI_Win_allocate_shared is collective over the machine
  }
  if (grow)
    ctx->grow(std::max({ctx->capacity(), 2 * window_slot_bytes(own_need), kMinShmBytes,
                        comm.shm_window_bytes()}),
              op, comm.shm_window_bytes());
  return *ctx;
}

std::vector<Where> rows_where(const Communicator& comm, const char* op, const Windows& shm,
                              const std::vector<OpHeader>& h, const std::vector<int>& peers, int me,
                              const Where& mine) {
  const int W = static_cast<int>(peers.size());
  std::vector<Where> where(W);
  bool late = false;
  for (int p = 0; p < W; ++p) {
    if (shm.node_of(peers[p]) < 0) continue;
    where[p] = p == me ? mine : h[p].where;
    late |= h[p].shm_grow != 0;
  }
  if (!late) return where;
  Exchange ex(comm, op, "where");
  auto in = std::make_shared<std::vector<Where>>(where);
  auto out = std::make_shared<Where>(mine);
  ex.keep_alive(in);
  ex.keep_alive(out);
  for (int p = 0; p < W; ++p) {
    if (p == me || shm.node_of(peers[p]) < 0) continue;
    if (h[p].shm_grow) ex.irecv_n(&(*in)[p], 1, peers[p], kTagWhere);
    if (h[me].shm_grow) ex.isend_n(out.get(), 1, peers[p], kTagWhere);
  }
  ex.wait();
  shm.sync();  // the peers' stores before their announcement (combine_v2's staged rows)
  return *in;
}

}  // namespace moe_ep::detail
