#include "experts.h"

#include <cblas.h>

#include <chrono>
#include <cmath>
#include <cstring>

#include "moe_ep/error.h"
#include "numeric.h"
#include "rng.h"

namespace moe_ep_tool {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

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

ExpertBank::ExpertBank(ExpertFn fn, uint64_t seed, int64_t experts, int64_t hidden, int64_t ffn)
    : fn_(fn), seed_(seed), experts_(experts), hidden_(hidden), ffn_(ffn) {
  // cblas takes int sizes.
  if (fn_ == ExpertFn::kSwiglu && (2 * ffn_ * hidden_ > INT32_MAX)) {
    throw moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument,
                        "swiglu expert: 2 x FFN x H = " + std::to_string(2 * ffn_ * hidden_) +
                            " weights exceed 2^31; use a smaller --ffn");
  }
}

void ExpertBank::load_weights(int64_t e) {
  if (loaded_ == e) return;
  const double t0 = now_s();
  const int64_t H = hidden_, F = ffn_;
  w13_.resize(static_cast<size_t>(2 * F * H));
  w2_.resize(static_cast<size_t>(H * F));
  const float s1 = 1.0f / std::sqrt(static_cast<float>(H));
  const float s2 = 1.0f / std::sqrt(static_cast<float>(F));
  const Counter c13(seed_, Stream::kExpertW13, static_cast<uint64_t>(e));
  const Counter c2(seed_, Stream::kExpertW2, static_cast<uint64_t>(e));
  for (int64_t i = 0; i < 2 * F * H; ++i) w13_[i] = c13.uniform(i) * s1;
  for (int64_t i = 0; i < H * F; ++i) w2_[i] = c2.uniform(i) * s2;
  loaded_ = e;
  generate_s_ += now_s() - t0;
}

void ExpertBank::forward(int64_t e, const void* in, void* out, int64_t rows, moe_ep::DType dtype) {
  if (rows == 0) return;
  const int64_t H = hidden_, F = ffn_, n = rows * H;
  if (fn_ == ExpertFn::kIdentity) {
    std::memcpy(out, in, static_cast<size_t>(n) * moe_ep::dtype_size(dtype));
    return;
  }
  if (fn_ == ExpertFn::kScale) {
    const double t0 = now_s();
    const float factor = 1.0f + static_cast<float>(e) / static_cast<float>(experts_);
    for (int64_t i = 0; i < n; ++i) store(dtype, out, i, load(dtype, in, i) * factor);
    compute_s_ += now_s() - t0;
    return;
  }
  load_weights(e);
  const double t0 = now_s();
  xf_.resize(static_cast<size_t>(n));
  h13_.resize(static_cast<size_t>(rows * 2 * F));
  act_.resize(static_cast<size_t>(rows * F));
  yf_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) xf_[i] = load(dtype, in, i);
  const int m = static_cast<int>(rows), h = static_cast<int>(H), f = static_cast<int>(F);
  // h13 (rows, 2F) = x (rows, H) @ W13^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, 2 * f, h, 1.0f, xf_.data(), h,
              w13_.data(), h, 0.0f, h13_.data(), 2 * f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = h13_.data() + r * 2 * F;
    const float* u = g + F;
    float* a = act_.data() + r * F;
    for (int64_t j = 0; j < F; ++j) a[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
  // y (rows, H) = act (rows, F) @ W2^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, h, f, 1.0f, act_.data(), f, w2_.data(), f,
              0.0f, yf_.data(), h);
  for (int64_t i = 0; i < n; ++i) store(dtype, out, i, yf_[i]);
  compute_s_ += now_s() - t0;
}

}  // namespace moe_ep_tool
