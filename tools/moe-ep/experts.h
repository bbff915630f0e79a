// moe-ep tool: the expert functions, with weights generated deterministically from (seed, expert)
// so each rank builds only its local experts and the reference can rebuild any one of them.
//
//   swiglu:   y = W2 (silu(W1 x) * (W3 x)), W1, W3: (F, H), W2: (H, F); GEMMs in fp32 (OpenBLAS
//             cblas_sgemm) on fp32(x), y rounded once to the dtype.
//             W1[f, h] = uniform(seed, kExpertW13, e, f*H + h) / sqrt(H),
//             W3[f, h] = uniform(seed, kExpertW13, e, (F + f)*H + h) / sqrt(H),
//             W2[h, f] = uniform(seed, kExpertW2, e, h*F + f) / sqrt(F)   (rng.h).
//   scale:    y = round_to_dtype(fp32(x) * (1 + e/E)), the factor computed in fp32 as
//             1.0f + float(e) / float(E).
//   identity: y = x.
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
  ExpertBank(ExpertFn fn, uint64_t seed, int64_t experts, int64_t hidden, int64_t ffn);

  // out (rows, H) = expert_e(in (rows, H)); both contiguous in `dtype`; may not alias.
  void forward(int64_t e, const void* in, void* out, int64_t rows, moe_ep::DType dtype);

  // Seconds spent generating weights and computing, since construction.
  double generate_seconds() const { return generate_s_; }
  double compute_seconds() const { return compute_s_; }

 private:
  void load_weights(int64_t e);

  ExpertFn fn_;
  uint64_t seed_;
  int64_t experts_, hidden_, ffn_;
  int64_t loaded_ = -1;
  std::vector<float> w13_;  // (2F, H): W1 rows then W3 rows
  std::vector<float> w2_;   // (H, F)
  std::vector<float> xf_, h13_, act_, yf_;
  double generate_s_ = 0, compute_s_ = 0;
};

}  // namespace moe_ep_tool
