#include "transport/mpi/context.h"

#include "transport/communicator.h"

namespace moe_ep::detail {

const std::vector<std::unique_ptr<MessageLink>>& message_links(const Communicator& comm) {
  auto& links = CommInternals::links(comm);
  if (!links) {
    links = std::make_shared<std::vector<std::unique_ptr<MessageLink>>>();
    for (int p = 0; p < comm.size(); ++p) links->push_back(std::make_unique<MessageLink>(p));
  }
  return *links;
}

}  // namespace moe_ep::detail
