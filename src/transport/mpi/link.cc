#include "transport/mpi/link.h"

#include <climits>

#include "base/check.h"

namespace moe_ep::detail {

char* MessageLink::place(int, int64_t, int64_t) const {
  fail(ErrorKind::kInternal, "rank ", peer(),
       " is reached through messages; its memory is not addressable (please report this bug)");
}

void MessageLink::put_block(Exchange& ex, const void* data, int64_t rows, const MpiType& type,
                            int tag) const {
  MOE_EP_CHECK(rows >= 0 && rows <= INT_MAX);
  ex.isend(data, static_cast<int>(rows), type.get(), peer(), tag);
}

void MessageLink::get_block(Exchange& ex, void* data, int64_t rows, const MpiType& type,
                            int tag) const {
  MOE_EP_CHECK(rows >= 0 && rows <= INT_MAX);
  ex.irecv(data, static_cast<int>(rows), type.get(), peer(), tag);
}

}  // namespace moe_ep::detail
