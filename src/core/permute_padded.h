// Internal: SPEC §4.1's padded_mode (Megatron-LM's capacity layout) for the permute family; the
// public ops in permute.cc hand a call with padded_mode = true to these.
#pragma once

#include "moe_ep/permute.h"

namespace moe_ep::detail {

PermuteResult permute_padded(const PermuteArgs& args);
Tensor permute_grad_padded(const PermuteGradArgs& args);
Tensor permute_grad_v2_padded(const PermuteGradV2Args& args);
UnpermuteWithSavedResult unpermute_padded(const char* op, const UnpermuteArgs& args, bool save);
UnpermuteGradResult unpermute_grad_padded(const UnpermuteGradArgs& args);
UnpermuteGradResult unpermute_grad_v2_padded(const UnpermuteGradV2Args& args);

}  // namespace moe_ep::detail
