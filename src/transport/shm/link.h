// Internal: the shared-memory transport's Link (transport/link.h): a peer on this machine whose
// rows live in its segment of the shared-memory windows (ShmContext, transport/windows.h). Rows are
// stored and loaded in place; a count message announces the stores.
#pragma once

#include "transport/link.h"

namespace moe_ep::detail {

class ShmContext;

class WindowLink final : public Link {
 public:
  WindowLink(int peer, const ShmContext& ctx) : Link(peer), ctx_(ctx) {}
  bool addressable() const override { return true; }
  char* place(int gen, int64_t offset, int64_t bytes) const override;
  void put_block(Exchange&, const void*, int64_t, int64_t, int) const override {}
  void get_block(Exchange&, void*, int64_t, int64_t, int) const override {}
  // Fences this rank's stores into the windows (ShmContext::sync) before the first announcement
  // of a phase is posted; the reader fences after its wait.
  void announce(Exchange& ex, const int64_t* count, int tag) const override;
  void expect_announce(Exchange& ex, int64_t* count, int tag) const override;
  void acquire() const override;

 private:
  const ShmContext& ctx_;
};

}  // namespace moe_ep::detail
