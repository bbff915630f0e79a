// Internal: shared-memory windows, as the ops see them (docs/design.md, "Shared-memory
// transport"): per communicator, the ranks of group_ep on this machine and generations of
// windows in which every such rank has a segment that the others map. dispatch_v2's receive
// buffers (expand_x) and combine_v2's staging rows live there, written and read in place through
// WindowLinks (transport/link.h). Nothing here names MPI: transport/shm implements it over MPI-3
// shared-memory windows.
//
// Collective calls (open_windows over group_ep, grow over the node) are made only after an op's
// header agreement showed every rank healthy and asking for them, so no rank is left in a
// collective that a failed peer never enters. Windows only grow: a new generation is allocated
// when a rank's segment is too small for one call, or full within the bound of should_grow; every
// rank of the node then adds a segment, asked for or not. Older generations stay mapped (their
// slots may still back live tensors, and new slots use their space once it is free) until the
// communicator is destroyed.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "moe_ep/comm.h"
#include "transport/link.h"

namespace moe_ep::detail {

// A region of this rank's segment, reserved until `token` (and every copy) is released.
struct ShmSlot {
  std::shared_ptr<void> token;
  int gen = 0;
  int64_t offset = 0;
  char* ptr = nullptr;
};

// The bytes of a segment a request of `bytes` takes (at least 1, rounded up to 4 KiB).
int64_t window_slot_bytes(int64_t bytes);

class Windows {
 public:
  virtual ~Windows() = default;

  // Node rank of group_ep rank `g`, or -1 when it is on another machine.
  virtual int node_of(int group_rank) const = 0;
  // The link to group_ep rank `g` on this machine (itself included), or null for one elsewhere.
  virtual const Link* link(int group_rank) const = 0;
  // Bytes of this rank's segment in the newest generation (0: no window yet).
  virtual int64_t capacity() const = 0;
  // Node-collective (every rank of the node, same op): allocates a new generation in which this
  // rank's segment has `own_bytes` bytes. Throws Error(kSystem) naming the bytes asked for and
  // `shm_window_bytes` (the communicator's CommOptions value, for the message) when the
  // allocation fails.
  virtual void grow(int64_t own_bytes, const char* op, int64_t shm_window_bytes) = 0;
  // Reserves window_slot_bytes(bytes) of this rank's segment in a generation, the newest first
  // (an older one's space is used again once its slots are released); nullopt when they fit
  // beside the live slots of none. Thread-safe release. Records the request (should_grow).
  virtual std::optional<ShmSlot> try_alloc(int64_t bytes) = 0;
  // The slot a live tensor starting at `p` occupies (a slot try_alloc gave, still held), when it
  // is at least window_slot_bytes(bytes) long: the caller may write a new output there
  // (dispatch_v2's caller-provided expand_x). nullopt otherwise.
  virtual std::optional<ShmSlot> adopt(const void* p, int64_t bytes) const = 0;
  // Whether a request of `bytes` that try_alloc could not place should grow the windows (a new
  // generation, node-collective) rather than use messages for that call: when the newest segment
  // is too small for it, or when it is big enough but full (earlier outputs still held) while
  // this rank's segments together map less than kFullGrowthFactor times its largest request. So
  // a caller holding a few outputs, or a sweep of sizes whose requests fill the window exactly,
  // stays on shared memory, and one holding many falls back to messages with bounded memory.
  static constexpr int64_t kFullGrowthFactor = 4;
  virtual bool should_grow(int64_t bytes) const = 0;
  // Bytes of this rank's segments over all generations.
  virtual int64_t mapped() const = 0;
  // Generations of windows allocated so far (the same on every rank of the node).
  virtual int generations() const = 0;
  // Slots try_alloc has handed out so far (for tests: whether a call used shared memory).
  virtual int64_t slots_allocated() const = 0;
  // If [p, p + bytes) lies inside this rank's segment of a generation: its (gen, offset).
  virtual bool locate(const void* p, int64_t bytes, int& gen, int64_t& offset) const = 0;
  // The address, in this process, of byte `offset` of group rank `g`'s segment of generation
  // `gen`, after checking that [offset, offset + bytes) lies inside it (kInternal otherwise).
  virtual char* peer_ptr(int gen, int group_rank, int64_t offset, int64_t bytes) const = 0;
  // Memory barrier for the windows: after this rank's stores, before a message that publishes
  // them; after a message that announces a peer's stores, before loading them.
  virtual void sync() const = 0;
  // CommOptions::shm_grow false, after the one grow() of from_mpi: should_grow is false from
  // then on, and grow() a bug (Error(kInternal)).
  virtual void fix() = 0;
};

// Collective over `comm` (every rank in the same op, after the header agreement): finds the ranks
// of group_ep on this machine; maps no window yet (grow does). ranks_per_node > 0
// ($MOE_EP_SHM_NODE_RANKS, agreed in the header): each run of that many of a machine's ranks is
// a node of its own. Throws Error(kSystem) if the transport fails.
std::shared_ptr<Windows> open_windows(const Communicator& comm, const char* op, int ranks_per_node);

}  // namespace moe_ep::detail
