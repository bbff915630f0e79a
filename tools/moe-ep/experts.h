// moe-ep tool: the expert functions, with weights generated deterministically from (seed, expert)
// so each rank builds only its local experts and the reference can rebuild any one of them.
//
// Expert ids: routed expert e in [0, E); shared expert s is computed as the expert with id E + s
// (the ids [E, E + Z + C + Q) of the special experts never reach an ExpertBank: combine_v2
// evaluates those, SPEC §2.2).
//
//   swiglu:   y = W2 (silu(W1 x) * (W3 x)), W1, W3: (F, H), W2: (H, F); GEMMs in fp32 (OpenBLAS
//             cblas_sgemm) on fp32(x), y rounded once to the dtype.
//             W1[f, h] = uniform(seed, kExpertW13, e, f*H + h) / sqrt(H),
//             W3[f, h] = uniform(seed, kExpertW13, e, (F + f)*H + h) / sqrt(H),
//             W2[h, f] = uniform(seed, kExpertW2, e, h*F + f) / sqrt(F)   (rng.h).
//   scale:    y = round_to_dtype(fp32(x) * (1 + e/E)), the factor computed in fp32 as
//             1.0f + float(e) / float(E).
//   identity: y = x (y = round_to_dtype(fp32(x)) when the input is fp32, e.g. dequantised rows).
//
// Tensor parallelism (--tp 2): part p of P computes a partial output whose sum over the parts is
// the full one. swiglu: W1/W3 rows and W2 columns [f0, f1) of the FFN dimension, f0 = p*F/P
// rounded up (a column split of W1/W3 and a row split of W2 in the x @ W convention); scale and
// identity: part 0 computes y, the others write zeros (so the sum is y bit for bit).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe_ep/tensor.h"

namespace moe_ep_tool {

enum class ExpertFn { kSwiglu, kScale, kIdentity };

const char* expert_fn_name(ExpertFn fn);

// Holds one expert's weights at a time (regenerated when the expert changes).
class ExpertBank {
 public:
  // `experts` is E (the divisor of the scale factor). part/parts: this TP rank's share.
  ExpertBank(ExpertFn fn, uint64_t seed, int64_t experts, int64_t hidden, int64_t ffn,
             int64_t part = 0, int64_t parts = 1);

  // out (rows, H) in out_dtype = expert_e(in (rows, H) in in_dtype); both contiguous; may not
  // alias. in_dtype is the tokens' dtype, or fp32 for dequantised rows.
  void forward(int64_t e, const void* in, moe_ep::DType in_dtype, void* out,
               moe_ep::DType out_dtype, int64_t rows);

  // scale and identity: y = round(fp32(x) * factor(e)); the factor (1 for identity).
  float factor(int64_t e) const;

  // Seconds spent generating weights and computing, since construction.
  double generate_seconds() const { return generate_s_; }
  double compute_seconds() const { return compute_s_; }

 private:
  void load_weights(int64_t e);

  ExpertFn fn_;
  uint64_t seed_;
  int64_t experts_, hidden_, ffn_;
  int64_t part_, f0_, f1_;  // this part's FFN range [f0, f1)
  int64_t loaded_ = -1;
  std::vector<float> w13_;  // (2 Fp, H): W1 rows [f0, f1) then W3 rows [f0, f1), Fp = f1 - f0
  std::vector<float> w2_;   // (H, Fp): W2 columns [f0, f1)
  std::vector<float> xf_, h13_, act_, yf_;
  double generate_s_ = 0, compute_s_ = 0;
};

}  // namespace moe_ep_tool
