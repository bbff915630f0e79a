// Internal: moe-ep's environment variables (MOE_EP_*), one table, read and validated here and
// nowhere else (STYLE.md "API": they only fill what the caller left unset, and a malformed value
// is an error, never ignored). Each reader looks at the variable at the time of the call, so a
// test or a program may change it between calls. Unset or empty means "not given".
//
// A malformed value throws Error(kInvalidArgument)
//   "<op>: <NAME> = \"<value>\"<note> is not <what>"
// with the variable's `what` from the table, e.g.
//   "dispatch_v2: MOE_EP_STREAM_MIN_BYTES = \"-1\" is not a byte count (an integer in [0, 2^63 -
//   1])"
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

namespace moe_ep::detail {

enum class EnvVar { kTimeoutS, kTransport, kStreamMinBytes, kShmNodeRanks };

// One row of the table (docs/errors.md and docs/performance.md, "Knobs", describe them too).
struct EnvEntry {
  EnvVar var;
  const char* name;      // e.g. "MOE_EP_TIMEOUT_S"
  const char* what;      // what a valid value is, for the error message
  const char* fallback;  // the value used when unset, in words
  const char* doc;       // what it does, one sentence
};

// Every variable, in EnvVar order.
std::span<const EnvEntry> env_table();

// $MOE_EP_TIMEOUT_S: the deadline of every blocking wait, in seconds (finite, > 0), used when
// CommOptions::timeout_s is unset.
std::optional<double> env_timeout_s(const char* op);
// $MOE_EP_TRANSPORT: "mpi" or "shm", used when EpConfig::transport is "".
std::optional<std::string> env_transport(const char* op);
// $MOE_EP_STREAM_MIN_BYTES: the bytes one dispatch_v2 call must write into shared-memory windows
// before its stores bypass the cache (default 16 MiB; 0: always).
int64_t env_stream_min_bytes(const char* op);
// $MOE_EP_SHM_NODE_RANKS: each run of this many ranks of a machine is a node of its own for the
// shared-memory transport (testing the paths of jobs that span machines); 0 when unset.
int env_shm_node_ranks(const char* op);

// Reads and validates the variables of the table that the ops would read (check_environment,
// comm.h): all, except MOE_EP_TIMEOUT_S when the caller gives CommOptions::timeout_s and
// MOE_EP_TRANSPORT when it gives EpConfig::transport.
void check_env(const char* op, bool timeout_given, bool transport_given);

}  // namespace moe_ep::detail
