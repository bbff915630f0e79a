// Internal: the Communicator's implementation side: the state the transports keep with it, and
// its deadline.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "moe_ep/comm.h"

namespace moe_ep::detail {

class Windows;
class Link;
class SerialWorker;

// The private members of Communicator that the transports keep there.
struct CommInternals {
  static std::shared_ptr<Windows>& shm(const Communicator& comm) { return comm.shm_; }
  static std::shared_ptr<std::vector<std::unique_ptr<Link>>>& links(const Communicator& comm) {
    return comm.links_;
  }
  static uint64_t& plans(const Communicator& comm) { return comm.plans_; }
  static uint64_t serial(const Communicator& comm) { return comm.serial_; }
  static int& node_ranks(const Communicator& comm) { return comm.node_ranks_; }
  static int& node_ranks_env(const Communicator& comm) { return comm.node_ranks_env_; }
  static Traffic& traffic(const Communicator& comm) { return comm.traffic_; }
  static std::string& broken(const Communicator& comm) { return comm.broken_; }
  // The worker of the asynchronous ops, or null before the first (no thread is started for a
  // communicator that never runs one).
  static std::unique_ptr<SerialWorker>& worker(const Communicator& comm) { return comm.worker_; }
};

// The level of thread support MPI was initialised with (MPI_Query_thread), by name, and whether
// it lets a second thread call MPI while the caller's does (MPI_THREAD_MULTIPLE).
struct ThreadLevel {
  const char* name;
  bool multiple;
};
ThreadLevel mpi_thread_level();

// The deadline from_mpi uses: options.timeout_s (finite, > 0), else $MOE_EP_TIMEOUT_S, else
// 300 s. Error(kInvalidArgument) "<op>: ..." for a bad value.
double resolve_timeout(const CommOptions& options, const char* op);

}  // namespace moe_ep::detail
