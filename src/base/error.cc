#include "moe_ep/error.h"

namespace moe_ep {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      return "InvalidArgument";
    case ErrorKind::kUnsupported:
      return "Unsupported";
    case ErrorKind::kTimeout:
      return "Timeout";
    case ErrorKind::kRemote:
      return "Remote";
    case ErrorKind::kSystem:
      return "System";
    case ErrorKind::kInternal:
      return "Internal";
  }
  return "Unknown";
}

Error::Error(ErrorKind kind, const std::string& message)
    : std::runtime_error(message), kind_(kind) {}

}  // namespace moe_ep
