// SPEC §1.5: dynamic per-row int8 quantisation (dispatch_v2 quant_mode 2, combine_v2
// comm_quant_mode 2). The kernels (src/kernels/cpu/quant.cc) are compared BITWISE with the naive
// reference (ref/quant_ref.cc) on fresh random rows over a grid of dtypes, lengths, value
// distributions and smoothing; the error bound stated in quant.h is checked in double on the same
// rows; zero rows, NaN/Inf rows, exact ties, the clamp, tiny rows, the combine bound, the rows
// version's indexing, its finiteness check and thread-count independence have their own tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/quant.h"
#include "moe_ep/error.h"
#include "moe_ep/tensor.h"
#include "moe_ep/threads.h"
#include "ref/numeric.h"
#include "ref/quant_ref.h"

namespace moe_ep {
namespace {

using Rng = std::mt19937_64;

constexpr DType kFloatDTypes[] = {DType::kBF16, DType::kF16, DType::kF32};
constexpr int64_t kLengths[] = {0, 1, 2, 7, 31, 33, 1023, 7168};

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (bits(a[i]) != bits(b[i])) return false;
  return true;
}

// A row stored in `dtype` (values rounded to nearest even by ref::store).
struct Row {
  DType dtype;
  std::vector<unsigned char> bytes;
  const void* data() const { return bytes.data(); }
  void* data() { return bytes.data(); }
};

Row make_row(DType dtype, const std::vector<float>& v) {
  Row r{dtype, std::vector<unsigned char>(v.size() * dtype_size(dtype) + 1)};
  for (std::size_t i = 0; i < v.size(); ++i)
    ref::store(dtype, r.data(), static_cast<int64_t>(i), v[i]);
  return r;
}

// Largest magnitude we put into a dtype without overflowing it.
float dtype_max(DType dtype) { return dtype == DType::kF16 ? 6.0e4f : 1.0e30f; }

enum class Dist {
  kUniform,
  kHeavyTail,
  kOutlier,
  kSubnormal,
  kNearOverflowOfS,
  kLogUniform,
  kSparse
};
constexpr Dist kDists[] = {Dist::kUniform,   Dist::kHeavyTail,       Dist::kOutlier,
                           Dist::kSubnormal, Dist::kNearOverflowOfS, Dist::kLogUniform,
                           Dist::kSparse};
const char* dist_name(Dist d) {
  switch (d) {
    case Dist::kUniform:
      return "uniform";
    case Dist::kHeavyTail:
      return "heavy-tail";
    case Dist::kOutlier:
      return "outlier";
    case Dist::kSubnormal:
      return "subnormal";
    case Dist::kNearOverflowOfS:
      return "amax-near-127/FLT_MAX";
    case Dist::kLogUniform:
      return "log-uniform";
    case Dist::kSparse:
      return "sparse";
  }
  return "?";
}

// Row values for a distribution. Magnitudes the dtype cannot hold (fp16 subnormal-fp32 values)
// are produced through the smoothing row instead (see make_smooth).
std::vector<float> random_values(Dist d, DType dtype, int64_t n, Rng& rng) {
  std::vector<float> v(static_cast<std::size_t>(n));
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::cauchy_distribution<float> cauchy(0.0f, 0.5f);
  std::uniform_real_distribution<float> expo(dtype == DType::kF16 ? -20.0f : -30.0f,
                                             dtype == DType::kF16 ? 14.0f : 30.0f);
  std::bernoulli_distribution coin(0.5);
  const float lim = dtype_max(dtype);
  const bool tiny_ok = dtype != DType::kF16;
  for (auto& x : v) {
    switch (d) {
      case Dist::kUniform:
        x = u(rng);
        break;
      case Dist::kHeavyTail:
        x = std::clamp(cauchy(rng), -lim, lim);
        break;
      case Dist::kOutlier:
        x = u(rng) * 0.5f;
        break;
      case Dist::kSubnormal:  // fp32 subnormals (below 2^-126), down to a few ulps of 2^-149
        x = tiny_ok ? u(rng) * 0x1p-130f : u(rng);
        break;
      case Dist::kNearOverflowOfS:  // amax around 127 / FLT_MAX = 3.7e-37, on both sides
        x = tiny_ok ? u(rng) * std::ldexp(1.0f, -121 - static_cast<int>(rng() % 6)) : u(rng);
        break;
      case Dist::kLogUniform:
        x = std::ldexp(1.0f, static_cast<int>(expo(rng))) * (coin(rng) ? 1.0f : -1.0f) *
            (1.0f + std::fabs(u(rng)) / 2);
        break;
      case Dist::kSparse:
        x = rng() % 8 == 0 ? u(rng) : (coin(rng) ? 0.0f : -0.0f);
        break;
    }
  }
  if (d == Dist::kOutlier && n > 0) v[rng() % n] = (coin(rng) ? 1.0f : -1.0f) * lim * 0.9f;
  return v;
}

// Smoothing factors in [0.25, 4); for the tiny distributions in fp16 (which cannot hold fp32's
// tiny values) the factors carry the tininess instead.
std::vector<float> make_smooth(Dist d, DType dtype, int64_t n, Rng& rng) {
  std::uniform_real_distribution<float> u(0.25f, 4.0f);
  float k = 1.0f;
  if (dtype == DType::kF16 && d == Dist::kSubnormal) k = 0x1p-132f;
  if (dtype == DType::kF16 && d == Dist::kNearOverflowOfS) k = 0x1p-122f;
  std::vector<float> s(static_cast<std::size_t>(n));
  for (auto& x : s) x = u(rng) * k;
  return s;
}

// ---------------------------------------------------------------------------------------------
// The reference itself, on hand-computed rows.

TEST(QuantRef, HandComputedRow) {
  const Row x = make_row(DType::kF32, {1.0f, -2.0f, 0.5f, 0.0f});
  int8_t q[4];
  const float scale = ref::quantize_row_int8(DType::kF32, x.data(), nullptr, 4, q);
  // amax = 2, s = 63.5 (exact); 1 * 63.5 = 63.5 is a tie -> 64 (even); 0.5 * 63.5 = 31.75 -> 32.
  EXPECT_EQ(q[0], 64);
  EXPECT_EQ(q[1], -127);
  EXPECT_EQ(q[2], 32);
  EXPECT_EQ(q[3], 0);
  EXPECT_EQ(bits(scale), bits(1.0f / 63.5f));
  // With smoothing: xf = {2, -1, 0.5, 0}; amax = 2 again; 2 * 63.5 = 127, -63.5 -> -64.
  const float sm[4] = {2.0f, 0.5f, 1.0f, 7.0f};
  EXPECT_EQ(bits(ref::quantize_row_int8(DType::kF32, x.data(), sm, 4, q)), bits(1.0f / 63.5f));
  EXPECT_EQ(q[0], 127);
  EXPECT_EQ(q[1], -64);
  EXPECT_EQ(q[2], 32);
  EXPECT_EQ(q[3], 0);
}

// ---------------------------------------------------------------------------------------------
// Kernel == reference, bitwise, and the error bound, over the grid.

TEST(QuantKernel, MatchesReferenceBitwiseAndBound) {
  Rng rng(1234);
  double worst_ratio = 0;  // max over dense rows of max_error / bound: shows the bound is tight
  int rows = 0;
  for (DType dtype : kFloatDTypes) {
    for (int64_t n : kLengths) {
      for (Dist d : kDists) {
        for (int smooth_on = 0; smooth_on < 2; ++smooth_on) {
          for (int rep = 0; rep < (n < 64 ? 6 : 2); ++rep) {
            SCOPED_TRACE(testing::Message()
                         << dtype_name(dtype) << " n=" << n << " " << dist_name(d)
                         << " smooth=" << smooth_on << " rep=" << rep);
            const Row x = make_row(dtype, random_values(d, dtype, n, rng));
            const std::vector<float> sm = make_smooth(d, dtype, n, rng);
            const float* smp = smooth_on ? sm.data() : nullptr;
            const bool fp16_tiny =
                dtype == DType::kF16 && (d == Dist::kSubnormal || d == Dist::kNearOverflowOfS);
            if (fp16_tiny && !smooth_on) continue;  // fp16 alone cannot hold these values
            std::vector<int8_t> qk(n + 1, 99), qr(n + 1, 99);
            const float sk = detail::quantize_row_int8(x.data(), dtype, smp, n, qk.data());
            const float sr = ref::quantize_row_int8(dtype, x.data(), smp, n, qr.data());
            ++rows;
            ASSERT_EQ(bits(sk), bits(sr));
            ASSERT_EQ(qk, qr);             // includes the sentinel past the end
            ASSERT_EQ(qk[n], int8_t{99});  // nothing written past n
            EXPECT_TRUE(std::isfinite(sk));
            EXPECT_GE(sk, 0.0f);
            for (int64_t i = 0; i < n; ++i) ASSERT_GE(qk[i], -127) << i;

            std::vector<float> xf(n);
            ref::smoothed_row(dtype, x.data(), smp, n, xf.data());
            const ref::QuantErrorCheck c = ref::check_quant_error(xf.data(), n, qk.data(), sk);
            EXPECT_LE(c.max_error, c.bound) << "element " << c.worst << " xf=" << xf[c.worst];
            if (n >= 1023 && (d == Dist::kUniform || d == Dist::kHeavyTail))
              worst_ratio = std::max(worst_ratio, c.max_error / c.bound);
            // A non-zero row uses the full range: its largest element maps to +-127.
            const bool nonzero = std::any_of(xf.begin(), xf.end(), [](float f) { return f != 0; });
            if (nonzero) {
              int qmax = 0;
              for (int64_t i = 0; i < n; ++i) qmax = std::max(qmax, std::abs(int{qk[i]}));
              EXPECT_EQ(qmax, 127);
            }

            // Consumers: kernel == reference bitwise; axpy == dequantise then axpy_row_f32.
            std::vector<float> dk(n), dr(n);
            detail::dequantize_row_int8(qk.data(), sk, n, dk.data());
            ref::dequantize_row_int8(qk.data(), sk, n, dr.data());
            ASSERT_TRUE(same_bits(dk, dr));
            std::vector<float> ak(n), ar(n), af(n);
            std::uniform_real_distribution<float> u(-1.0f, 1.0f);
            for (int64_t i = 0; i < n; ++i) ak[i] = ar[i] = af[i] = u(rng);
            const float w = u(rng);
            detail::axpy_row_int8(ak.data(), w, qk.data(), sk, n);
            ref::axpy_row_int8(ar.data(), w, qk.data(), sk, n);
            detail::axpy_row_f32(af.data(), w, dk.data(), DType::kF32, n);
            ASSERT_TRUE(same_bits(ak, ar));
            ASSERT_TRUE(same_bits(ak, af));
          }
        }
      }
    }
  }
  EXPECT_GT(rows, 1000);
  // Dense random rows come close to the bound (rounding to an integer loses up to 1/2 step).
  EXPECT_GT(worst_ratio, 0.95);
  EXPECT_LE(worst_ratio, 1.0);
}

// ---------------------------------------------------------------------------------------------
// Special rows.

TEST(QuantKernel, ZeroRowGivesZeroScaleAndZeroQ) {
  for (DType dtype : kFloatDTypes) {
    for (int64_t n : {1, 7, 33, 7168}) {
      std::vector<float> v(n, 0.0f);
      for (int64_t i = 0; i < n; i += 3) v[i] = -0.0f;
      const Row x = make_row(dtype, v);
      std::vector<int8_t> q(n, 55);
      const float s = detail::quantize_row_int8(x.data(), dtype, nullptr, n, q.data());
      EXPECT_EQ(bits(s), 0u) << dtype_name(dtype) << " n=" << n;  // +0, not NaN, not -0
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(q[i], 0) << i;
      // A zero smoothing row zeroes any finite row.
      const Row y = make_row(dtype, std::vector<float>(n, 3.0f));
      const std::vector<float> zero(n, 0.0f);
      EXPECT_EQ(bits(detail::quantize_row_int8(y.data(), dtype, zero.data(), n, q.data())), 0u);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(q[i], 0) << i;
    }
  }
  // n == 0: nothing is read or written; the scale is 0.
  EXPECT_EQ(bits(detail::quantize_row_int8(nullptr, DType::kBF16, nullptr, 0, nullptr)), 0u);
}

TEST(QuantKernel, NonFiniteRowGivesNaNScaleAndZeroQ) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType dtype : kFloatDTypes) {
    for (int64_t n : {1, 7, 33, 7168}) {
      for (float bad : {nan, inf, -inf}) {
        for (int64_t pos : {int64_t{0}, n / 2, n - 1}) {
          SCOPED_TRACE(testing::Message()
                       << dtype_name(dtype) << " n=" << n << " bad=" << bad << " at " << pos);
          std::vector<float> v(n, 1.5f);
          v[pos] = bad;
          const Row x = make_row(dtype, v);
          std::vector<int8_t> q(n, 55), qr(n, 55);
          const float s = detail::quantize_row_int8(x.data(), dtype, nullptr, n, q.data());
          EXPECT_TRUE(std::isnan(s));
          EXPECT_EQ(bits(s), bits(ref::quantize_row_int8(dtype, x.data(), nullptr, n, qr.data())));
          for (int64_t i = 0; i < n; ++i) ASSERT_EQ(q[i], 0) << i;
          // The consumer sees NaN in every element.
          std::vector<float> out(n);
          detail::dequantize_row_int8(q.data(), s, n, out.data());
          for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(std::isnan(out[i])) << i;
        }
      }
    }
  }
  // Finite x, but smoothing overflows fp32 (3e38 * 10) or multiplies 0 by Inf.
  const Row x = make_row(DType::kF32, {3e38f, 1.0f, 0.0f});
  int8_t q[3];
  const float over[3] = {10.0f, 1.0f, 1.0f};
  EXPECT_TRUE(std::isnan(detail::quantize_row_int8(x.data(), DType::kF32, over, 3, q)));
  const float zero_inf[3] = {1.0f, 1.0f, inf};
  EXPECT_TRUE(std::isnan(detail::quantize_row_int8(x.data(), DType::kF32, zero_inf, 3, q)));
  EXPECT_EQ(q[0], 0);
  EXPECT_EQ(q[1], 0);
}

// Rows where xf * s hits k + 0.5 exactly: amax = 127 gives s = 1; amax = 254 gives s = 0.5.
TEST(QuantKernel, RoundsExactTiesToEven) {
  const std::vector<float> v1 = {127.0f, 0.5f,  1.5f,   2.5f,   3.5f,    -0.5f, -1.5f,
                                 -2.5f,  -3.5f, 125.5f, 126.5f, -126.5f, 63.5f, 2.5000002f};
  const std::vector<int> e1 = {127, 0, 2, 2, 4, 0, -2, -2, -4, 126, 126, -126, 64, 3};
  const std::vector<float> v2 = {-254.0f, 1.0f, 3.0f, 5.0f, 7.0f, -1.0f, -3.0f, 251.0f, 253.0f};
  const std::vector<int> e2 = {-127, 0, 2, 2, 4, 0, -2, 126, 126};
  for (DType dtype : kFloatDTypes) {
    for (int smooth_on = 0; smooth_on < 2; ++smooth_on) {
      SCOPED_TRACE(testing::Message() << dtype_name(dtype) << " smooth=" << smooth_on);
      for (int which = 0; which < 2; ++which) {
        const auto& v = which == 0 ? v1 : v2;
        const auto& e = which == 0 ? e1 : e2;
        // 2.5000002 (the last of v1) is an fp32 value only.
        const int64_t n =
            static_cast<int64_t>(v.size()) - (which == 0 && dtype != DType::kF32 ? 1 : 0);
        // With smoothing the row is stored halved and the factor 2 restores it (exact).
        std::vector<float> stored(v.begin(), v.begin() + n);
        if (smooth_on)
          for (auto& f : stored) f /= 2;
        const Row x = make_row(dtype, stored);
        const std::vector<float> two(n, 2.0f);
        std::vector<int8_t> q(n), qr(n);
        const float* sm = smooth_on ? two.data() : nullptr;
        const float s = detail::quantize_row_int8(x.data(), dtype, sm, n, q.data());
        EXPECT_EQ(s, which == 0 ? 1.0f : 2.0f);
        EXPECT_EQ(bits(s), bits(ref::quantize_row_int8(dtype, x.data(), sm, n, qr.data())));
        for (int64_t i = 0; i < n; ++i) {
          EXPECT_EQ(int{q[i]}, e[i]) << "xf = " << v[i];
          EXPECT_EQ(q[i], qr[i]) << "xf = " << v[i];
        }
      }
    }
  }
}

// amax * fl(127 / amax) can round above 127 (e.g. 127.00001); q must still be 127, never 128 or
// -128, and the guard must not change anything the reference computes.
TEST(QuantKernel, ProductAbove127RoundsTo127) {
  Rng rng(7);
  std::uniform_real_distribution<float> u(1.0f, 2.0f);
  int above = 0;
  for (int t = 0; t < 20000; ++t) {
    const float a = std::ldexp(u(rng), static_cast<int>(rng() % 200) - 100);
    const float s = 127.0f / a;
    if (!(a * s > 127.0f)) continue;
    ++above;
    const Row x = make_row(DType::kF32, {a, -a, a / 3});
    int8_t q[3], qr[3];
    const float sk = detail::quantize_row_int8(x.data(), DType::kF32, nullptr, 3, q);
    EXPECT_EQ(bits(sk), bits(ref::quantize_row_int8(DType::kF32, x.data(), nullptr, 3, qr)));
    EXPECT_EQ(q[0], 127) << a;
    EXPECT_EQ(q[1], -127) << a;
    EXPECT_EQ(q[2], qr[2]) << a;
  }
  EXPECT_GT(above, 100);  // the case is common, so the test is not vacuous
}

// The scale is SPEC's 1/s = 1 / fl(127 / amax), which differs from amax / 127 in some last bits.
TEST(QuantKernel, ScaleIsOneOverRoundedS) {
  Rng rng(11);
  std::uniform_real_distribution<float> u(1.0f, 2.0f);
  int differ = 0;
  for (int t = 0; t < 5000; ++t) {
    const float a = std::ldexp(u(rng), static_cast<int>(rng() % 100) - 50);
    const Row x = make_row(DType::kF32, {a * 0.25f, -a});
    int8_t q[2];
    const float sk = detail::quantize_row_int8(x.data(), DType::kF32, nullptr, 2, q);
    EXPECT_EQ(bits(sk), bits(1.0f / (127.0f / a))) << a;
    if (bits(sk) != bits(a / 127.0f)) ++differ;
  }
  EXPECT_GT(differ, 0);
}

// Tiny rows: 127 / amax overflows fp32 below amax ~ 3.7e-37; the row is scaled by 2^64 so q keeps
// full resolution, and the scale is rounded into fp32's subnormal range.
TEST(QuantKernel, TinyRowsKeepResolutionAndStayFinite) {
  for (float amax : {1e-36f, 3e-37f, 1e-38f, 1e-40f, 1e-44f, 0x1p-149f}) {
    SCOPED_TRACE(testing::Message() << "amax=" << amax);
    const Row x = make_row(DType::kF32, {amax, -amax / 2, amax / 127, 0.0f});
    int8_t q[4], qr[4];
    const float s = detail::quantize_row_int8(x.data(), DType::kF32, nullptr, 4, q);
    EXPECT_EQ(bits(s), bits(ref::quantize_row_int8(DType::kF32, x.data(), nullptr, 4, qr)));
    float xf[4];
    ref::smoothed_row(DType::kF32, x.data(), nullptr, 4, xf);
    // Full 8-bit resolution: q is xf * 127 / amax rounded (up to the fp32 rounding of s and xf*s).
    for (int i = 0; i < 4; ++i)
      EXPECT_LE(std::fabs(q[i] - static_cast<double>(xf[i]) * 127.0 / amax), 0.5 + 1e-5) << i;
    EXPECT_EQ(q[0], 127);
    EXPECT_TRUE(std::isfinite(s));
    // The scale is amax / 127 up to its subnormal rounding (half an ulp of 2^-149 at most) and
    // its normal-range rounding.
    const double want = static_cast<double>(amax) / 127.0;
    EXPECT_LE(std::fabs(s - want), std::ldexp(1.0, -150) + want * std::ldexp(1.0, -22));
    const ref::QuantErrorCheck c = ref::check_quant_error(xf, 4, q, s);
    EXPECT_LE(c.max_error, c.bound);
  }
  // The smallest subnormal row: q = 127 but the scale 2^-149 / 127 rounds to 0.
  const Row x = make_row(DType::kF32, {0x1p-149f});
  int8_t q;
  EXPECT_EQ(bits(detail::quantize_row_int8(x.data(), DType::kF32, nullptr, 1, &q)), 0u);
  EXPECT_EQ(q, 127);
}

// ---------------------------------------------------------------------------------------------
// combine_v2 with comm_quant_mode 2: the fp32 weighted sum over dequantised rows, against the
// exact (double) weighted sum of the rows before quantisation.

TEST(QuantKernel, CombineWeightedSumWithinBound) {
  Rng rng(99);
  const double u = std::ldexp(1.0, -24);
  for (int topk : {1, 2, 8}) {
    for (Dist d : {Dist::kUniform, Dist::kHeavyTail, Dist::kOutlier, Dist::kSubnormal}) {
      for (DType dtype : {DType::kBF16, DType::kF32}) {
        SCOPED_TRACE(testing::Message()
                     << "K=" << topk << " " << dist_name(d) << " " << dtype_name(dtype));
        const int64_t n = 513;
        std::vector<float> acc(n, 0.0f);
        std::vector<double> exact(n, 0.0), abs_sum(n, 0.0);
        double bound_q = 0;
        std::uniform_real_distribution<float> wd(-1.0f, 1.0f);
        for (int k = 0; k < topk; ++k) {
          const Row x = make_row(dtype, random_values(d, dtype, n, rng));
          const float w = wd(rng);
          std::vector<int8_t> q(n);
          const float s = detail::quantize_row_int8(x.data(), dtype, nullptr, n, q.data());
          detail::axpy_row_int8(acc.data(), w, q.data(), s, n);
          std::vector<float> xf(n), y(n);
          ref::smoothed_row(dtype, x.data(), nullptr, n, xf.data());
          detail::dequantize_row_int8(q.data(), s, n, y.data());
          double amax = 0;
          for (int64_t i = 0; i < n; ++i) {
            exact[i] += static_cast<double>(w) * xf[i];
            abs_sum[i] += std::fabs(static_cast<double>(w) * y[i]);
            amax = std::max(amax, std::fabs(static_cast<double>(xf[i])));
          }
          bound_q += std::fabs(w) * ref::quant_error_bound(amax);
        }
        const double gamma = topk * u / (1 - topk * u);
        double worst = 0;
        for (int64_t i = 0; i < n; ++i) {
          const double bound = bound_q + gamma * abs_sum[i] + topk * std::ldexp(1.0, -150);
          const double err = std::fabs(acc[i] - exact[i]);
          ASSERT_LE(err, bound) << "element " << i;
          worst = std::max(worst, err / bound_q);
        }
        if (d == Dist::kUniform && topk == 1) {
          EXPECT_GT(worst, 0.5);  // the bound is not loose
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The rows version: indexing, strides, the finiteness check, thread-count independence.

struct RowsCase {
  DType dtype;
  int64_t tokens, rows, n, src_stride, smooth_stride, q_stride;
  Row src;
  std::vector<float> smooth;
  std::vector<int32_t> src_index, smooth_index;
};

RowsCase make_rows_case(DType dtype, int64_t rows, int64_t n, Rng& rng) {
  RowsCase c{dtype, 37, rows, n, n + 3, n + 1, n + 5, {}, {}, {}, {}};
  std::vector<float> v;
  for (int64_t t = 0; t < c.tokens; ++t) {
    std::vector<float> r = random_values(kDists[t % 7], dtype, n, rng);
    r.resize(c.src_stride, std::numeric_limits<float>::quiet_NaN());  // gaps: NaN, never read
    v.insert(v.end(), r.begin(), r.end());
  }
  c.src = make_row(dtype, v);
  const int64_t nsmooth = 9;
  std::uniform_real_distribution<float> u(0.25f, 4.0f);
  c.smooth.assign(nsmooth * c.smooth_stride, std::numeric_limits<float>::quiet_NaN());
  for (int64_t e = 0; e < nsmooth; ++e)
    for (int64_t i = 0; i < n; ++i) c.smooth[e * c.smooth_stride + i] = u(rng);
  for (int64_t r = 0; r < rows; ++r) {
    c.src_index.push_back(static_cast<int32_t>(rng() % c.tokens));
    c.smooth_index.push_back(static_cast<int32_t>(rng() % nsmooth));
  }
  return c;
}

struct RowsOut {
  std::vector<int8_t> q;
  std::vector<float> scales;
};

RowsOut run_rows(const RowsCase& c, bool smooth, bool check = false) {
  RowsOut o{std::vector<int8_t>(c.rows * c.q_stride, 99), std::vector<float>(c.rows, -1.0f)};
  detail::QuantizeRowsInt8Args a;
  a.op = "dispatch_v2";
  a.name = "x";
  a.rows = c.rows;
  a.n = c.n;
  a.dtype = c.dtype;
  a.src = c.src.data();
  a.src_stride = c.src_stride;
  a.src_index = c.src_index.data();
  if (smooth) {
    a.smooth = c.smooth.data();
    a.smooth_stride = c.smooth_stride;
    a.smooth_index = c.smooth_index.data();
  }
  a.q = o.q.data();
  a.q_stride = c.q_stride;
  a.scales = o.scales.data();
  a.check_finite = check;
  detail::quantize_rows_int8(a);
  return o;
}

void expect_rows_match_reference(const RowsCase& c, bool smooth, const RowsOut& o) {
  const int64_t es = static_cast<int64_t>(dtype_size(c.dtype));
  for (int64_t r = 0; r < c.rows; ++r) {
    const char* x = static_cast<const char*>(c.src.data()) + c.src_index[r] * c.src_stride * es;
    const float* sm = smooth ? c.smooth.data() + c.smooth_index[r] * c.smooth_stride : nullptr;
    std::vector<int8_t> qr(c.n);
    const float sr = ref::quantize_row_int8(c.dtype, x, sm, c.n, qr.data());
    ASSERT_EQ(bits(o.scales[r]), bits(sr)) << "row " << r;
    ASSERT_TRUE(std::equal(qr.begin(), qr.end(), o.q.begin() + r * c.q_stride)) << "row " << r;
    for (int64_t i = c.n; i < c.q_stride; ++i)
      ASSERT_EQ(o.q[r * c.q_stride + i], int8_t{99}) << "gap of row " << r;
  }
}

TEST(QuantRows, MatchReferenceWithIndexingAndStrides) {
  Rng rng(5);
  for (DType dtype : kFloatDTypes) {
    for (int64_t n : {0, 1, 33, 7168}) {
      for (int64_t rows : {0, 1, 70}) {
        RowsCase c = make_rows_case(dtype, rows, n, rng);
        for (bool smooth : {false, true}) {
          SCOPED_TRACE(testing::Message() << dtype_name(dtype) << " n=" << n << " rows=" << rows
                                          << " smooth=" << smooth);
          expect_rows_match_reference(c, smooth, run_rows(c, smooth, /*check=*/true));
        }
      }
    }
  }
}

TEST(QuantRows, SameBitsWithOneTwoAndFourThreads) {
  Rng rng(17);
  for (DType dtype : kFloatDTypes) {
    const RowsCase c = make_rows_case(dtype, 97, 1031, rng);  // 97 * 1031 elements: parallel
    std::vector<RowsOut> outs;
    for (int t : {1, 2, 4}) {
      set_num_threads(t);
      ASSERT_EQ(num_threads(), t);
      outs.push_back(run_rows(c, true));
    }
    set_num_threads(0);
    for (std::size_t k = 1; k < outs.size(); ++k) {
      EXPECT_EQ(outs[k].q, outs[0].q) << dtype_name(dtype);
      EXPECT_TRUE(same_bits(outs[k].scales, outs[0].scales)) << dtype_name(dtype);
    }
    expect_rows_match_reference(c, true, outs[0]);
  }
}

TEST(QuantRows, CheckFiniteNamesTheLowestBadRow) {
  Rng rng(23);
  RowsCase c = make_rows_case(DType::kBF16, 40, 64, rng);
  // Rows 12 and 30 read bad tokens; make src_index distinct there so the message is unambiguous.
  for (int64_t r = 0; r < c.rows; ++r) c.src_index[r] = static_cast<int32_t>(r % 30);
  c.src_index[12] = 31;
  c.src_index[30] = 32;
  c.smooth_index[12] = 4;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  ref::store(DType::kBF16, c.src.data(), 32 * c.src_stride + 5, nan);
  ref::store(DType::kBF16, c.src.data(), 31 * c.src_stride + 63,
             -std::numeric_limits<float>::infinity());

  // Without checking: no error, NaN scales exactly on the bad rows, the others as the reference.
  const RowsOut o = run_rows(c, true);
  for (int64_t r = 0; r < c.rows; ++r)
    EXPECT_EQ(std::isnan(o.scales[r]), r == 12 || r == 30) << "row " << r;
  expect_rows_match_reference(c, true, o);

  for (bool smooth : {true, false}) {
    try {
      run_rows(c, smooth, /*check=*/true);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      const std::string m = e.what();
      EXPECT_NE(m.find("dispatch_v2: x[31] (quantised row 12"), std::string::npos) << m;
      EXPECT_EQ(m.find("scales[4]") != std::string::npos, smooth) << m;
      EXPECT_NE(m.find("NaN or Inf"), std::string::npos) << m;
    }
  }
}

}  // namespace
}  // namespace moe_ep
