// moe-ep tool: the single-process dense reference of one MoE layer and the comparison with the
// distributed result.
//
// For each expert e (weights generated one expert at a time), run every token routed to it as one
// batch; then for each token, in fp32: acc = 0; for k = 0..K-1 (ids >= 0): acc += scale_ik *
// fp32(y_ik); output = acc rounded once to the dtype (SPEC §2.3). Only -1 (inactive) may appear
// among the ids besides [0, E): the reference runs after dispatch_v2 has validated them.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "batch.h"
#include "experts.h"

namespace moe_ep_tool {

// (N, H) in batch.dtype.
std::vector<std::byte> dense_reference(const Batch& batch, int64_t experts, ExpertBank& bank);

struct CheckResult {
  bool exact = false;  // bitwise equality was required
  bool pass = false;
  int64_t mismatches = 0;      // elements whose bits differ or that are NaN in out or ref
  int64_t nans = 0;            // elements that are NaN in out or ref (counted in mismatches too)
  bool size_mismatch = false;  // out and ref differ in size (every element counts as mismatched)
  double max_abs = 0;          // max |out - ref| over the elements where neither is NaN
  double max_ref = 0;          // max |ref|
  double max_rel = 0;          // max_abs / max_ref (0 when max_ref is 0)
  double tolerance = 0;        // on max_rel, for the non-exact check
  std::string rule;            // the rule applied, in words
};

// scale and identity must match bitwise; swiglu within a relative tolerance of 1e-2 (bf16),
// 1e-3 (fp16), 1e-5 (fp32) on max|out - ref| / max|ref|. NaN anywhere fails, and each NaN
// element counts as a mismatch even when its bits agree.
CheckResult compare_outputs(const std::vector<std::byte>& out, const std::vector<std::byte>& ref,
                            moe_ep::DType dtype, ExpertFn fn);

}  // namespace moe_ep_tool
