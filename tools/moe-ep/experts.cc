#include "experts.h"

#include <cblas.h>

#include <cmath>
#include <cstring>

#include "common.h"
#include "moe_ep/error.h"
#include "moe_ep/tensor.h"
#include "rng.h"

namespace moe_ep_tool {

const char* expert_fn_name(ExpertFn fn) {
  switch (fn) {
    case ExpertFn::kSwiglu:
      return "swiglu";
    case ExpertFn::kScale:
      return "scale";
    default:
      return "identity";
  }
}

ExpertBank::ExpertBank(ExpertFn fn, uint64_t seed, int64_t experts, int64_t hidden, int64_t ffn,
                       int64_t part, int64_t parts)
    : fn_(fn), seed_(seed), experts_(experts), hidden_(hidden), ffn_(ffn), part_(part) {
  // cblas takes int sizes.
  if (fn_ == ExpertFn::kSwiglu && (2 * ffn_ * hidden_ > INT32_MAX)) {
    throw moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument,
                        "swiglu expert: 2 x FFN x H = " + std::to_string(2 * ffn_ * hidden_) +
                            " weights exceed 2^31; use a smaller --ffn");
  }
  f0_ = (part * ffn_ + parts - 1) / parts;
  f1_ = ((part + 1) * ffn_ + parts - 1) / parts;
}

float ExpertBank::factor(int64_t e) const {
  return fn_ == ExpertFn::kScale ? 1.0f + static_cast<float>(e) / static_cast<float>(experts_)
                                 : 1.0f;
}

void ExpertBank::load_weights(int64_t e) {
  if (loaded_ == e) return;
  const double t0 = now_s();
  const int64_t H = hidden_, F = ffn_, Fp = f1_ - f0_;
  w13_.resize(static_cast<size_t>(2 * Fp * H));
  w2_.resize(static_cast<size_t>(H * Fp));
  const float s1 = 1.0f / std::sqrt(static_cast<float>(H));
  const float s2 = 1.0f / std::sqrt(static_cast<float>(F));
  const Counter c13(seed_, Stream::kExpertW13, static_cast<uint64_t>(e));
  const Counter c2(seed_, Stream::kExpertW2, static_cast<uint64_t>(e));
  for (int64_t f = 0; f < Fp; ++f) {
    for (int64_t h = 0; h < H; ++h) {
      w13_[f * H + h] = c13.uniform(static_cast<uint64_t>((f0_ + f) * H + h)) * s1;
      w13_[(Fp + f) * H + h] = c13.uniform(static_cast<uint64_t>((F + f0_ + f) * H + h)) * s1;
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t f = 0; f < Fp; ++f) {
      w2_[h * Fp + f] = c2.uniform(static_cast<uint64_t>(h * F + f0_ + f)) * s2;
    }
  }
  loaded_ = e;
  generate_s_ += now_s() - t0;
}

void ExpertBank::forward(int64_t e, const void* in, moe_ep::DType in_dtype, void* out,
                         moe_ep::DType out_dtype, int64_t rows) {
  if (rows == 0) return;
  const int64_t H = hidden_, Fp = f1_ - f0_, n = rows * H;
  const size_t out_bytes = static_cast<size_t>(n) * moe_ep::dtype_size(out_dtype);
  if (fn_ != ExpertFn::kSwiglu && part_ != 0) {
    std::memset(out, 0, out_bytes);  // the TP peer (part 0) outputs the value
    return;
  }
  if (fn_ == ExpertFn::kIdentity && in_dtype == out_dtype) {
    std::memcpy(out, in, out_bytes);
    return;
  }
  if (fn_ != ExpertFn::kSwiglu) {
    const double t0 = now_s();
    const float f = factor(e);
    for (int64_t i = 0; i < n; ++i)
      moe_ep::store_float(out_dtype, out, i, moe_ep::load_float(in_dtype, in, i) * f);
    compute_s_ += now_s() - t0;
    return;
  }
  if (Fp == 0) {  // this TP part holds no FFN column (FFN = 1)
    std::memset(out, 0, out_bytes);
    return;
  }
  load_weights(e);
  const double t0 = now_s();
  xf_.resize(static_cast<size_t>(n));
  h13_.resize(static_cast<size_t>(rows * 2 * Fp));
  act_.resize(static_cast<size_t>(rows * Fp));
  yf_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) xf_[i] = moe_ep::load_float(in_dtype, in, i);
  const int m = static_cast<int>(rows), h = static_cast<int>(H), f = static_cast<int>(Fp);
  // h13 (rows, 2Fp) = x (rows, H) @ W13^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, 2 * f, h, 1.0f, xf_.data(), h,
              w13_.data(), h, 0.0f, h13_.data(), 2 * f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = h13_.data() + r * 2 * Fp;
    const float* u = g + Fp;
    float* a = act_.data() + r * Fp;
    for (int64_t j = 0; j < Fp; ++j) a[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
  // y (rows, H) = act (rows, Fp) @ W2^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, h, f, 1.0f, act_.data(), f, w2_.data(), f,
              0.0f, yf_.data(), h);
  for (int64_t i = 0; i < n; ++i) moe_ep::store_float(out_dtype, out, i, yf_[i]);
  compute_s_ += now_s() - t0;
}

}  // namespace moe_ep_tool
