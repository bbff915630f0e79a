// moe-ep errors: one exception type with a closed set of kinds.
//
// Every message names the op, the parameter, the value and the bound, e.g.
//   dispatch_v2: expert_ids[3,1] = 300 is outside [0, 64)
// docs/errors.md lists every check and the test that covers it.
#pragma once

#include <stdexcept>
#include <string>

#include "moe_ep/export.h"

namespace moe_ep {

enum class ErrorKind {
  kInvalidArgument,  // the caller passed a value the SPEC does not allow
  kUnsupported,      // allowed by the SPEC, not implemented by this build (never a wrong answer)
  kTimeout,          // a blocking wait passed its deadline; names rank, peer and phase
  kRemote,           // another rank of the communicator failed; carries that rank's message
  kSystem,           // the OS or MPI failed (allocation, MPI error code)
  kInternal,         // a broken invariant inside moe-ep: a bug, please report it
};

// "InvalidArgument", "Unsupported", ...
MOE_EP_API const char* error_kind_name(ErrorKind kind);

class MOE_EP_API Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message);
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace moe_ep
