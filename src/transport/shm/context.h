// Internal: the shared-memory transport's per-communicator state (docs/design.md, "Shared-memory
// transport"): the node communicator (the ranks of group_ep on this machine), the map from
// group_ep ranks to node ranks, and generations of MPI-3 shared-memory windows in which
// dispatch_v2's receive buffers (expand_x) and combine_v2's staging rows live.
//
// Collective calls (MPI_Comm_split_type over group_ep, MPI_Win_allocate_shared over the node) are
// made only after an op's header agreement showed every rank healthy and asking for them, so no
// rank is left in a collective that a failed peer never enters. Windows only grow: a new
// generation is allocated when a rank's segment is too small for one call, or full within the
// bound of should_grow; every rank of the node then adds a segment, asked for or not. Older
// generations stay mapped (their slots may still back live tensors, and new slots use their
// space once it is free) until the communicator is destroyed.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/tensor.h"
#include "transport/shm/link.h"

namespace moe_ep::detail {

class ShmContext;

// One generation of windows: every rank of the node allocated its segment in the same call.
struct ShmWindow {
  MPI_Win win = MPI_WIN_NULL;
  int gen = 0;
  std::vector<char*> base;     // per node rank: the segment's address in THIS process
  std::vector<int64_t> bytes;  // per node rank
  int me = 0;                  // this rank's node rank
  // The regions of this rank's own segment in use, sorted by offset, with the token that keeps
  // each reserved.
  struct Live {
    int64_t offset, bytes;
    std::weak_ptr<void> token;
  };
  std::mutex mu;
  std::vector<Live> live;
};

// A region of this rank's segment, reserved until `token` (and every copy) is released.
struct ShmSlot {
  std::shared_ptr<void> token;
  int gen = 0;
  int64_t offset = 0;
  char* ptr = nullptr;
};

class ShmContext {
 public:
  // Collective over `comm` (MPI_Comm_split_type, then the node's group ranks): call it on every
  // rank in the same op, after the header agreement. ranks_per_node > 0 ($MOE_EP_SHM_NODE_RANKS,
  // agreed in the header): each run of that many of a machine's ranks is a node of its own.
  // Throws Error(kSystem) if MPI fails.
  static std::shared_ptr<ShmContext> create(const Communicator& comm, const char* op,
                                            int ranks_per_node);
  // Local: leaves the windows and the node communicator mapped until the process exits (freeing
  // them is collective; see context.cc). Never throws.
  ~ShmContext();
  ShmContext(const ShmContext&) = delete;
  ShmContext& operator=(const ShmContext&) = delete;

  int node_size() const { return static_cast<int>(node_to_group_.size()); }
  int node_rank() const { return node_rank_; }
  // Node rank of group_ep rank `g`, or -1 when it is on another machine.
  int node_of(int group_rank) const { return group_to_node_[group_rank]; }
  // The link to group_ep rank `g` on this machine (itself included), or null for one elsewhere.
  const Link* link(int group_rank) const { return links_[group_rank].get(); }
  // Bytes of this rank's segment in the newest generation (0: no window yet).
  int64_t capacity() const;
  // Node-collective (every rank of the node, same op): allocates a new generation in which this
  // rank's segment has `own_bytes` bytes. Throws Error(kSystem) naming the bytes asked for and
  // `shm_window_bytes` (the communicator's CommOptions value, for the message) when
  // MPI_Win_allocate_shared fails.
  void grow(int64_t own_bytes, const char* op, int64_t shm_window_bytes);
  // The bytes of a segment a request of `bytes` takes (at least 1, rounded up to 4 KiB).
  static int64_t slot_bytes(int64_t bytes);
  // Reserves slot_bytes(bytes) of this rank's segment in a generation, the newest first (an
  // older one's space is used again once its slots are released); nullopt when they fit beside
  // the live slots of none. Thread-safe release. Records slot_bytes(bytes) as a request
  // (should_grow).
  std::optional<ShmSlot> try_alloc(int64_t bytes);
  // The slot a live tensor starting at `p` occupies (a slot try_alloc gave, still held), when it
  // is at least slot_bytes(bytes) long: the caller may write a new output there (dispatch_v2's
  // caller-provided expand_x). nullopt otherwise.
  std::optional<ShmSlot> adopt(const void* p, int64_t bytes) const;
  // Whether a request of `bytes` that try_alloc could not place should grow the windows (a new
  // generation, node-collective) rather than use MPI for that call: when the newest segment is
  // too small for it, or when it is big enough but full (earlier outputs still held) while this
  // rank's segments together map less than kFullGrowthFactor times its largest request. So a
  // caller holding a few outputs, or a sweep of sizes whose requests fill the window exactly,
  // stays on shared memory, and one holding many falls back to MPI with bounded memory.
  static constexpr int64_t kFullGrowthFactor = 4;
  bool should_grow(int64_t bytes) const;
  // Bytes of this rank's segments over all generations.
  int64_t mapped() const;
  // Generations of windows allocated so far (the same on every rank of the node).
  int generations() const { return static_cast<int>(windows_.size()); }
  // Slots try_alloc has handed out so far (for tests: whether a call used shared memory).
  int64_t slots_allocated() const { return slots_allocated_; }
  // If [p, p + bytes) lies inside this rank's segment of a generation: its (gen, offset).
  bool locate(const void* p, int64_t bytes, int& gen, int64_t& offset) const;
  // The address, in this process, of byte `offset` of group rank `g`'s segment of generation
  // `gen`, after checking that [offset, offset + bytes) lies inside it (kInternal otherwise).
  char* peer_ptr(int gen, int group_rank, int64_t offset, int64_t bytes) const;
  // Memory barrier for the windows (std::atomic_thread_fence + MPI_Win_sync of every
  // generation): after this rank's stores, before a message that publishes them; after a
  // message that announces a peer's stores, before loading them.
  void sync() const;

 private:
  ShmContext() = default;
  MPI_Comm node_ = MPI_COMM_NULL;
  int node_rank_ = 0;
  int64_t largest_request_ = 0;
  int64_t slots_allocated_ = 0;
  std::vector<int> group_to_node_;
  std::vector<int> node_to_group_;
  std::vector<std::shared_ptr<ShmWindow>> windows_;  // by generation
  std::vector<std::unique_ptr<WindowLink>> links_;   // by group_ep rank
};

}  // namespace moe_ep::detail
