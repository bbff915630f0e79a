// Internal: the MPI transport's state per communicator: a MessageLink to every rank.
#pragma once

#include <memory>
#include <vector>

#include "moe_ep/comm.h"
#include "transport/mpi/link.h"

namespace moe_ep::detail {

// The message links of `comm`, one per rank (itself included), created on first use and kept
// with the communicator.
const std::vector<std::unique_ptr<MessageLink>>& message_links(const Communicator& comm);

}  // namespace moe_ep::detail
