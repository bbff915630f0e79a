// Internal: the MPI transport's Link (transport/link.h): rows as messages, one per block.
#pragma once

#include <memory>
#include <vector>

#include "moe_ep/comm.h"
#include "transport/link.h"

namespace moe_ep::detail {

class MessageLink final : public Link {
 public:
  explicit MessageLink(int peer) : Link(peer) {}
  bool addressable() const override { return false; }
  char* place(int gen, int64_t offset, int64_t bytes) const override;
  // Contiguous messages of bytes: OpenMPI moves them with its single-copy path (derived,
  // strided datatypes went through copy-in/out, about 6x slower: docs/performance.md).
  void put_block(Exchange& ex, const void* data, int64_t rows, int64_t row_bytes,
                 int tag) const override;
  void get_block(Exchange& ex, void* data, int64_t rows, int64_t row_bytes, int tag) const override;
  void announce(Exchange&, const int64_t*, int) const override {}
  void expect_announce(Exchange&, int64_t*, int) const override {}
};

}  // namespace moe_ep::detail
