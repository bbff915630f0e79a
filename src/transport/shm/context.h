// Internal: the shared-memory transport (transport/windows.h, implemented over MPI-3
// shared-memory windows): the node communicator (the ranks of group_ep on this machine), the map
// from group_ep ranks to node ranks, and the generations of windows.
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
#include "transport/windows.h"

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

class ShmContext final : public Windows {
 public:
  // See open_windows (transport/windows.h).
  static std::shared_ptr<ShmContext> create(const Communicator& comm, const char* op,
                                            int ranks_per_node);
  // Local: leaves the windows and the node communicator mapped until the process exits (freeing
  // them is collective; see context.cc). Never throws.
  ~ShmContext() override;
  ShmContext(const ShmContext&) = delete;
  ShmContext& operator=(const ShmContext&) = delete;

  int node_of(int group_rank) const override { return group_to_node_[group_rank]; }
  const Link* link(int group_rank) const override { return links_[group_rank].get(); }
  int64_t capacity() const override;
  void grow(int64_t own_bytes, const char* op, int64_t shm_window_bytes) override;
  std::optional<ShmSlot> try_alloc(int64_t bytes) override;
  std::optional<ShmSlot> adopt(const void* p, int64_t bytes) const override;
  bool should_grow(int64_t bytes) const override;
  int64_t mapped() const override;
  int generations() const override { return static_cast<int>(windows_.size()); }
  int64_t slots_allocated() const override { return slots_allocated_; }
  bool locate(const void* p, int64_t bytes, int& gen, int64_t& offset) const override;
  char* peer_ptr(int gen, int group_rank, int64_t offset, int64_t bytes) const override;
  // std::atomic_thread_fence + MPI_Win_sync of every generation.
  void sync() const override;
  void fix() override { fixed_ = true; }

 private:
  ShmContext() = default;
  MPI_Comm node_ = MPI_COMM_NULL;
  int node_rank_ = 0;
  bool fixed_ = false;
  int64_t largest_request_ = 0;
  int64_t slots_allocated_ = 0;
  std::vector<int> group_to_node_;
  std::vector<int> node_to_group_;
  std::vector<std::shared_ptr<ShmWindow>> windows_;  // by generation
  std::vector<std::unique_ptr<WindowLink>> links_;   // by group_ep rank
};

}  // namespace moe_ep::detail
