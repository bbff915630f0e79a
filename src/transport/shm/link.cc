#include "transport/shm/link.h"

#include "transport/shm/context.h"

namespace moe_ep::detail {

char* WindowLink::place(int gen, int64_t offset, int64_t bytes) const {
  return ctx_.peer_ptr(gen, peer(), offset, bytes);
}

void WindowLink::announce(Exchange& ex, const int64_t* count, int tag) const {
  ctx_.sync();
  post(ex, count, 1, tag);
}

void WindowLink::acquire() const { ctx_.sync(); }

void WindowLink::expect_announce(Exchange& ex, int64_t* count, int tag) const {
  expect(ex, count, 1, tag);
}

}  // namespace moe_ep::detail
