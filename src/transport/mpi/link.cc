#include "transport/mpi/link.h"

#include "base/check.h"
#include "transport/communicator.h"

namespace moe_ep::detail {

char* MessageLink::place(int, int64_t, int64_t) const {
  fail(ErrorKind::kInternal, "rank ", peer(),
       " is reached through messages; its memory is not addressable (please report this bug)");
}

void MessageLink::put_block(Exchange& ex, const void* data, int64_t rows, int64_t row_bytes,
                            int tag) const {
  ex.isend_rows(data, rows, row_bytes, peer(), tag);
}

void MessageLink::get_block(Exchange& ex, void* data, int64_t rows, int64_t row_bytes,
                            int tag) const {
  ex.irecv_rows(data, rows, row_bytes, peer(), tag);
}

const std::vector<std::unique_ptr<Link>>& message_links(const Communicator& comm) {
  auto& links = CommInternals::links(comm);
  if (!links) {
    links = std::make_shared<std::vector<std::unique_ptr<Link>>>();
    for (int p = 0; p < comm.size(); ++p) links->push_back(std::make_unique<MessageLink>(p));
  }
  return *links;
}

}  // namespace moe_ep::detail
