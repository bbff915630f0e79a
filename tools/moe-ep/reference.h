// moe-ep tool: the single-process dense reference of one MoE layer and the comparison with the
// distributed result.
//
// For each expert (routed e, or shared s as expert id E + s; weights generated one expert at a
// time), run every row routed to it as one batch; then for each token, in fp32 (SPEC §2.3):
//   acc = 0
//   for k = 0..K-1, active entries only (id != -1 and x_active_mask allows it), e = id:
//     e < E:                acc += w_ik * fp32(y_ik)
//     zero [E, E+Z):        nothing
//     copy [E+Z, E+Z+C):    acc += w_ik * fp32(x_i)
//     const q [E+Z+C, ...): acc += w_ik * (alpha_1[q] * fp32(x_i) + alpha_2[q] * v[q])
//                           (every product and sum rounded to fp32, element-wise over H)
//   for s = 0..Ns-1:        acc += fp32(shared_y_is)          (without weight)
//   output = acc rounded once to the dtype; inactive tokens (1-D mask False, or no active entry)
//   give 0.
// With --quant int8 / --comm-quant int8 and expert-fn swiglu the reference quantises like the
// run (SPEC §1.5 on each expert input row, the same on each routed or shared expert output row)
// and the check keeps swiglu's relative tolerance. With scale/identity the reference stays
// unquantised and returns a per-element bound derived from the int8 error (see bound_rule).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "batch.h"
#include "experts.h"

namespace moe_ep_tool {

// What the reference needs beyond the batch.
struct LayerSpec {
  int64_t experts = 0;                       // E
  int64_t zero = 0, copy = 0, constant = 0;  // Z, C, Q
  int64_t shared =
      0;  // shared expert outputs added per active token (Ns, or 1 via shared_expert_x)
  // (Q, H) in the batch's dtype: const_expert_alpha_1, const_expert_alpha_2, const_expert_v.
  std::vector<std::byte> alpha_1, alpha_2, const_v;
  bool quant = false;       // dispatch quant_mode 2
  bool comm_quant = false;  // combine comm_quant_mode 2
  // comm_alg "hierarchy" (SPEC §3): the sum re-associated per node, and with comm_quant the
  // relays' partial sums quantised once more: a bound, not bitwise equality.
  bool hierarchy = false;
  // With hierarchy, EpConfig::partials in the dtype: each remote node's partial p rounded once
  // more (at most u |p|).
  bool low_partials = false;
  // The shared expert runs on each rank's own tokens and enters combine_v2 as shared_expert_x
  // (S = 0): its input and output are never quantised.
  bool shared_local = false;
};

struct Reference {
  std::vector<std::byte> out;  // (N, H) in the batch's dtype
  // Quantised runs with expert-fn scale or identity: (N, H) bounds on |out - ref|; else empty.
  std::vector<double> bound;
  std::string bound_rule;  // the rule behind `bound`, in words
  std::string note;        // how the reference was computed, appended to the check's rule
};

// SPEC §1.5 on one row of n fp32 values: q = rne(xf * s) with s = 127 / max|xf| (fp32), returns
// the dequantisation factor 1/s (0 for a zero row); deq[i] = fl(fp32(q[i]) * (1/s)).
float quantize_dequantize_row(const float* xf, int64_t n, float* deq);

Reference dense_reference(const Batch& batch, const LayerSpec& spec, ExpertFn fn, ExpertBank& bank);

struct CheckResult {
  bool exact = false;    // bitwise equality was required
  bool bounded = false;  // the per-element bound of a quantised run was applied
  bool pass = false;
  int64_t mismatches = 0;      // elements whose bits differ or that are NaN in out or ref
  int64_t nans = 0;            // elements that are NaN in out or ref (counted in mismatches too)
  int64_t over_bound = 0;      // bounded: elements with |out - ref| > bound
  bool size_mismatch = false;  // out and ref differ in size (every element counts as mismatched)
  double max_abs = 0;          // max |out - ref| over the elements where neither is NaN
  double max_ref = 0;          // max |ref|
  double max_rel = 0;          // max_abs / max_ref (0 when max_ref is 0)
  double max_ratio = 0;        // bounded: max |out - ref| / bound
  double tolerance = 0;        // on max_rel, for the non-exact check
  std::string rule;            // the rule applied, in words
};

// scale and identity must match bitwise; swiglu within a relative tolerance of 1e-2 (bf16),
// 1e-3 (fp16), 1e-5 (fp32) on max|out - ref| / max|ref|; a reference with a bound (quantised
// scale/identity runs) element-wise |out - ref| <= bound. NaN anywhere fails, and each NaN
// element counts as a mismatch even when its bits agree.
CheckResult compare_outputs(const std::vector<std::byte>& out, const Reference& ref,
                            moe_ep::DType dtype, ExpertFn fn);

}  // namespace moe_ep_tool
