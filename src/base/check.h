// Internal: building error messages and the two tiers of internal checks (STYLE.md "Errors").
#pragma once

#include <sstream>
#include <string>
#include <utility>

#include "moe_ep/error.h"

namespace moe_ep::detail {

template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <typename... Args>
[[noreturn]] void fail(ErrorKind kind, Args&&... args) {
  throw Error(kind, cat(std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void invalid(Args&&... args) {
  fail(ErrorKind::kInvalidArgument, std::forward<Args>(args)...);
}

template <typename... Args>
[[noreturn]] void unsupported(Args&&... args) {
  fail(ErrorKind::kUnsupported, std::forward<Args>(args)...);
}

}  // namespace moe_ep::detail

// Cheap invariant, always on: a broken one is a moe-ep bug (Error kInternal).
#define MOE_EP_CHECK(cond)                                                                   \
  do {                                                                                       \
    if (!(cond))                                                                             \
      ::moe_ep::detail::fail(::moe_ep::ErrorKind::kInternal, __FILE__, ":", __LINE__,        \
                             ": internal check failed: " #cond " (please report this bug)"); \
  } while (0)

// O(n) self-check: Debug and sanitizer builds only (MOE_EP_DCHECKS defined).
#if defined(MOE_EP_DCHECKS)
#define MOE_EP_DCHECK(cond) MOE_EP_CHECK(cond)
#else
#define MOE_EP_DCHECK(cond) \
  do {                      \
  } while (0)
#endif
