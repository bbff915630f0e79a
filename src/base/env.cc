#include "base/env.h"

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>

#include "base/check.h"

namespace moe_ep::detail {

namespace {

constexpr EnvEntry kTable[] = {
    {EnvVar::kTimeoutS, "MOE_EP_TIMEOUT_S", "a finite number of seconds > 0", "300",
     "Deadline of every blocking wait of an op, in seconds, when CommOptions::timeout_s is "
     "unset."},
    {EnvVar::kTransport, "MOE_EP_TRANSPORT", "one of \"mpi\", \"shm\"", "shm",
     "How ranks on one machine move rows when EpConfig::transport is \"\": MPI-3 shared memory "
     "or MPI point-to-point (same results)."},
    {EnvVar::kStreamMinBytes, "MOE_EP_STREAM_MIN_BYTES",
     "a byte count (an integer in [0, 2^63 - 1])", "16777216",
     "Bytes one dispatch_v2 call writes into shared-memory windows from which its stores bypass "
     "the cache (0: always)."},
    {EnvVar::kShmNodeRanks, "MOE_EP_SHM_NODE_RANKS",
     "a rank count (an integer in [1, 2^31 - 1]; unset: the whole machine)", "the whole machine",
     "Testing: each run of this many ranks of a machine is a machine of its own for the "
     "shared-memory transport, so one machine runs the paths of a job spanning several."},
};

const EnvEntry& entry(EnvVar v) {
  MOE_EP_CHECK(kTable[static_cast<int>(v)].var == v);
  return kTable[static_cast<int>(v)];
}

// The variable's value, or null when unset or empty.
const char* raw(EnvVar v) {
  const char* s = std::getenv(entry(v).name);
  return s == nullptr || *s == '\0' ? nullptr : s;
}

[[noreturn]] void malformed(const char* op, EnvVar v, const char* value, const char* note = "") {
  invalid(op, ": ", entry(v).name, " = \"", value, "\"", note, " is not ", entry(v).what);
}

std::optional<int64_t> integer(const char* op, EnvVar v, int64_t lo, int64_t hi) {
  const char* s = raw(v);
  if (s == nullptr) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(s, &end, 10);
  if (*end != '\0' || errno != 0 || end == s || n < lo || n > hi) malformed(op, v, s);
  return static_cast<int64_t>(n);
}

}  // namespace

std::span<const EnvEntry> env_table() { return kTable; }

std::optional<double> env_timeout_s(const char* op) {
  const char* s = raw(EnvVar::kTimeoutS);
  if (s == nullptr) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const double t = std::strtod(s, &end);
  if (errno != 0 || end == s || *end != '\0' || !(t > 0) || !std::isfinite(t))
    malformed(op, EnvVar::kTimeoutS, s);
  return t;
}

std::optional<std::string> env_transport(const char* op) {
  const char* s = raw(EnvVar::kTransport);
  if (s == nullptr) return std::nullopt;
  const std::string v = s;
  if (v != "mpi" && v != "shm")
    malformed(op, EnvVar::kTransport, s, " (used because transport is \"\")");
  return v;
}

int64_t env_stream_min_bytes(const char* op) {
  return integer(op, EnvVar::kStreamMinBytes, 0, INT64_MAX).value_or(int64_t{16} << 20);
}

int env_shm_node_ranks(const char* op) {
  return static_cast<int>(integer(op, EnvVar::kShmNodeRanks, 1, INT_MAX).value_or(0));
}

void check_env(const char* op, bool timeout_given, bool transport_given) {
  for (const EnvEntry& e : kTable) switch (e.var) {
      case EnvVar::kTimeoutS:
        if (!timeout_given) env_timeout_s(op);
        break;
      case EnvVar::kTransport:
        if (!transport_given) env_transport(op);
        break;
      case EnvVar::kStreamMinBytes:
        env_stream_min_bytes(op);
        break;
      case EnvVar::kShmNodeRanks:
        env_shm_node_ranks(op);
        break;
    }
}

}  // namespace moe_ep::detail
