// The Highway row kernels (src/kernels/cpu/convert.cc) against their scalar definitions (the
// element functions of convert.h, applied in the documented order), BITWISE, on every SIMD target
// this CPU supports (each forced in turn): odd lengths, NaN, Inf, subnormals, values that round
// to ties, every fp16 value and a dense sample of fp32 values.
//
// NaN payloads: single operations (conversions, scale, axpy, add) are compared bit for bit,
// NaNs included. In the chains of sum_rows and dot_row two different NaNs can meet (an input
// NaN and the default NaN of Inf * 0 or Inf - Inf); x86 then returns the payload of the first
// operand, and C++ leaves the operand order of a commutative add or multiply to the compiler, so
// the payload has no defined value even in scalar code. There a NaN must match a NaN (any
// payload) and every other value bit for bit.
#include <gtest/gtest.h>
#include <hwy/highway.h>
#include <hwy/targets.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/quant.h"
#include "ref/quant_ref.h"

namespace moe_ep {
namespace {

using detail::bf16_to_f32;
using detail::f16_to_f32;
using detail::f32_to_bf16;
using detail::f32_to_f16;

constexpr DType kFloatDTypes[] = {DType::kBF16, DType::kF16, DType::kF32};
constexpr int64_t kLengths[] = {0, 1, 7, 16, 31, 33, 45, 517, 7168 + 3};

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Runs body once per SIMD target the CPU supports (and this build compiled), each forced.
template <typename F>
void for_each_target(F body) {
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  for (int64_t t : targets) {
    SCOPED_TRACE(hwy::TargetName(t));
    hwy::SetSupportedTargetsForTest(t);
    hwy::GetChosenTarget().Update(hwy::SupportedTargets());
    body();
  }
  hwy::SetSupportedTargetsForTest(0);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

float awkward_any(std::mt19937_64& rng, bool allow_nan);

// Awkward fp32 values: specials, subnormals of fp32, bf16 and fp16, exact ties of bf16 and fp16
// rounding (odd and even), overflow to Inf in fp16, and random values of wide range.
float awkward(std::mt19937_64& rng, bool allow_nan) {
  const float v = awkward_any(rng, allow_nan);
  return allow_nan || !std::isnan(v) ? v : 1.5f;  // the tie patterns can hit exponent 255
}

float awkward_any(std::mt19937_64& rng, bool allow_nan) {
  const uint32_t r = static_cast<uint32_t>(rng());
  switch (rng() % 12) {
    case 0:
      return allow_nan ? from_bits((r & 0x80000000u) | 0x7f800000u | (r & 0x7fffffu) | 1u)
                       : INFINITY;  // NaN, quiet or signalling, any payload
    case 1:
      return (r & 1) ? INFINITY : -INFINITY;
    case 2:
      return from_bits(r & 0x807fffffu);  // fp32 subnormal or zero
    case 3:
      return from_bits((r & 0x80000000u) | ((r % 30 + 100) << 23) | (r & 0x7f0000u));  // small
    case 4:
      return from_bits((r & 0xffff0000u) | 0x8000u);  // bf16 tie
    case 5:
      return from_bits((r & 0xc7ffe000u) | 0x38000000u | 0x1000u);  // fp16 tie, in range
    case 6:
      return from_bits((r & 0x80000000u) | ((r % 20 + 100) << 23) | (r & 0x7fffffu));  // fp16 sub
    case 7:
      return from_bits((r & 0x80000000u) | ((r % 8 + 142) << 23) | (r & 0x7fffffu));  // > 65504
    default:
      return std::ldexp(static_cast<float>(static_cast<int32_t>(r)) / 2147483648.0f,
                        static_cast<int>(rng() % 20) - 10);
  }
}

// A row of n elements of dtype (values rounded by the scalar conversion).
std::vector<uint16_t> make_row(std::mt19937_64& rng, DType dtype, int64_t n, bool allow_nan) {
  std::vector<uint16_t> row(static_cast<std::size_t>(n) * dtype_size(dtype) / 2 + 1);
  for (int64_t i = 0; i < n; ++i) detail::store_f32(row.data(), dtype, i, awkward(rng, allow_nan));
  return row;
}

// Element i of a row of dtype set to a signalling NaN (quiet bit clear, payload non-zero), which
// store_f32 never writes: a kernel must make it quiet exactly as the scalar code does.
void put_signalling_nan(void* row, DType dtype, int64_t i) {
  if (dtype == DType::kF32) {
    const uint32_t u = 0xff800021u;
    std::memcpy(static_cast<char*>(row) + i * 4, &u, 4);
  } else {  // bf16 0x7f81, fp16 0x7c01
    const uint16_t u = dtype == DType::kBF16 ? 0x7f81u : 0x7c01u;
    std::memcpy(static_cast<char*>(row) + i * 2, &u, 2);
  }
}

std::vector<float> f32_row(std::mt19937_64& rng, int64_t n, bool allow_nan) {
  std::vector<float> v(static_cast<std::size_t>(n) + 1);
  for (int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = awkward(rng, allow_nan);
  return v;
}

// Elements of dtype equal bit for bit, or both NaN.
void expect_same_or_nan(DType dtype, const void* a, const void* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = detail::load_f32(a, dtype, i), y = detail::load_f32(b, dtype, i);
    if (bits(x) == bits(y) || (std::isnan(x) && std::isnan(y))) continue;
    ADD_FAILURE() << "element " << i << " of " << n << ": 0x" << std::hex << bits(x) << " vs 0x"
                  << bits(y);
    return;
  }
}

void expect_same_bytes(const void* a, const void* b, std::size_t bytes) {
  const auto* x = static_cast<const unsigned char*>(a);
  const auto* y = static_cast<const unsigned char*>(b);
  for (std::size_t i = 0; i < bytes; ++i)
    if (x[i] != y[i]) {
      uint32_t u = 0, v = 0;
      std::memcpy(&u, x + i / 4 * 4, 4);
      std::memcpy(&v, y + i / 4 * 4, 4);
      ADD_FAILURE() << "byte " << i << " of " << bytes << " differs: word 0x" << std::hex << u
                    << " vs 0x" << v;
      return;
    }
}

TEST(Simd, EveryF16AndManyF32ConvertAsScalar) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  // f32 sample: a stride prime to 2^32 walks every exponent and low-bit pattern, plus ties.
  std::vector<float> f32;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 65521)
    f32.push_back(from_bits(static_cast<uint32_t>(u)));
  for (uint32_t e = 0; e < 256; ++e)
    for (uint32_t low : {0x8000u, 0x18000u, 0x1000u, 0x3000u, 0x7fffu, 0x8001u}) {
      f32.push_back(from_bits((e << 23) | low));
      f32.push_back(from_bits(0x80000000u | (e << 23) | low));
    }
  const int64_t n = static_cast<int64_t>(f32.size());
  for_each_target([&] {
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(dtype_name(dtype));
      std::vector<float> got(65536);
      detail::load_row_f32(got.data(), all.data(), dtype, 65536);
      for (uint32_t i = 0; i < 65536; ++i) {
        const float want = dtype == DType::kBF16 ? bf16_to_f32(all[i]) : f16_to_f32(all[i]);
        ASSERT_EQ(bits(got[i]), bits(want)) << "bits 0x" << std::hex << i;
      }
      std::vector<uint16_t> out(f32.size());
      detail::store_row_f32(out.data(), dtype, f32.data(), n);
      for (std::size_t i = 0; i < f32.size(); ++i) {
        const uint16_t want = dtype == DType::kBF16 ? f32_to_bf16(f32[i]) : f32_to_f16(f32[i]);
        ASSERT_EQ(out[i], want) << "fp32 bits 0x" << std::hex << bits(f32[i]);
      }
    }
  });
}

TEST(Simd, RowKernelsMatchScalar) {
  for_each_target([] {
    std::mt19937_64 rng(7);
    for (DType dtype : kFloatDTypes)
      for (int64_t n : kLengths) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n));
        const std::size_t un = static_cast<std::size_t>(n);
        const std::size_t bytes = un * dtype_size(dtype);
        const std::vector<uint16_t> src = make_row(rng, dtype, n, true);
        const std::vector<float> f = f32_row(rng, n, true);
        const std::vector<float> acc0 = f32_row(rng, n, false);
        const float w = awkward(rng, false);

        std::vector<float> got(un + 1, 1.0f), want(un + 1, 1.0f);
        detail::load_row_f32(got.data(), src.data(), dtype, n);
        for (int64_t i = 0; i < n; ++i) want[i] = detail::load_f32(src.data(), dtype, i);
        expect_same_bytes(got.data(), want.data(), (un + 1) * 4);  // and nothing past the end

        std::vector<uint16_t> st(src.size(), 0x5555), st_want(src.size(), 0x5555);
        detail::store_row_f32(st.data(), dtype, f.data(), n);
        for (int64_t i = 0; i < n; ++i) detail::store_f32(st_want.data(), dtype, i, f[i]);
        expect_same_bytes(st.data(), st_want.data(), st.size() * 2);

        detail::scale_row_f32(st.data(), dtype, f.data(), w, n);
        for (int64_t i = 0; i < n; ++i) detail::store_f32(st_want.data(), dtype, i, f[i] * w);
        expect_same_bytes(st.data(), st_want.data(), bytes);

        got = acc0;
        want = acc0;
        detail::axpy_row_f32(got.data(), w, src.data(), dtype, n);
        for (int64_t i = 0; i < n; ++i) {
          const float p = w * detail::load_f32(src.data(), dtype, i);
          want[i] += p;
        }
        expect_same_bytes(got.data(), want.data(), (un + 1) * 4);

        got = acc0;
        want = acc0;
        detail::add_row_f32(got.data(), src.data(), dtype, n);
        for (int64_t i = 0; i < n; ++i) want[i] += detail::load_f32(src.data(), dtype, i);
        expect_same_bytes(got.data(), want.data(), (un + 1) * 4);
      }
  });
}

TEST(Simd, SumRowsMatchesScalarInRowOrder) {
  for_each_target([] {
    std::mt19937_64 rng(11);
    for (DType in : kFloatDTypes)
      for (DType out : kFloatDTypes)
        for (int64_t n : kLengths)
          for (int64_t count : {0, 1, 2, 3, 8, 9}) {
            SCOPED_TRACE(std::string(dtype_name(in)) + "->" + dtype_name(out) +
                         " n=" + std::to_string(n) + " count=" + std::to_string(count));
            std::vector<std::vector<uint16_t>> rows;
            std::vector<const void*> ptrs;
            std::vector<float> w;
            for (int64_t r = 0; r < count; ++r) {
              rows.push_back(make_row(rng, in, n, r == 0));
              w.push_back(awkward(rng, false));
            }
            // Signalling NaNs in bf16 and fp32 rows (not fp16: without F16C its conversions are
            // _Float16 casts, and GCC, assuming no signalling NaN, may fold a load and store into
            // a copy that keeps one: its bits are not defined by the scalar code either).
            if (count > 0 && in != DType::kF16)
              for (int64_t i = 3; i < n; i += 29) put_signalling_nan(rows[0].data(), in, i);
            for (auto& r : rows) ptrs.push_back(r.data());
            for (bool weighted : {false, true})
              for (bool from_zero : {false, true}) {
                const std::size_t ob = static_cast<std::size_t>(n) * dtype_size(out);
                std::vector<unsigned char> got(ob + 8, 0xaa), want(ob + 8, 0xaa);
                detail::sum_rows(got.data(), out, ptrs.data(), weighted ? w.data() : nullptr, count,
                                 in, n, false, from_zero);
                for (int64_t i = 0; i < n; ++i) {
                  float acc = 0.0f;
                  for (int64_t r = 0; r < count; ++r) {
                    float t = detail::load_f32(ptrs[static_cast<std::size_t>(r)], in, i);
                    if (weighted) t = w[static_cast<std::size_t>(r)] * t;
                    acc = r == 0 && !from_zero ? t : acc + t;
                  }
                  detail::store_f32(want.data(), out, i, acc);
                }
                expect_same_or_nan(out, got.data(), want.data(), n);
                // One row: no two NaNs meet, so NaNs too have the scalar bits (quiet bit set).
                if (count == 1) expect_same_bytes(got.data(), want.data(), ob);
                expect_same_bytes(got.data() + ob, want.data() + ob, 8);  // nothing past the end
              }
          }
  });
}

// A sum of -0 terms: -0 when the first term starts it, +0 from +0 (combine_v2's SPEC §2.3 sum).
TEST(Simd, SumRowsFromZeroTurnsNegativeZeroPositive) {
  for_each_target([] {
    const int64_t n = 37;
    std::vector<float> a(n, -0.0f), b(n, -0.0f), got(n, 1.0f);
    const void* rows[] = {a.data(), b.data()};
    const float w[] = {2.0f, 0.5f};
    detail::sum_rows(got.data(), DType::kF32, rows, w, 2, DType::kF32, n);
    for (float v : got) EXPECT_TRUE(v == 0.0f && std::signbit(v));
    detail::sum_rows(got.data(), DType::kF32, rows, w, 2, DType::kF32, n, false, true);
    for (float v : got) EXPECT_TRUE(v == 0.0f && !std::signbit(v));
  });
}

TEST(Simd, CopyRowToWritesEveryDestination) {
  for_each_target([] {
    std::mt19937_64 rng(5);
    for (std::size_t bytes : {0, 1, 63, 64, 255, 256, 257, 1000, 14336})
      for (int64_t count : {0, 1, 3, 8}) {
        SCOPED_TRACE("bytes=" + std::to_string(bytes) + " count=" + std::to_string(count));
        std::vector<unsigned char> src(bytes + 1);
        for (auto& c : src) c = static_cast<unsigned char>(rng());
        // Destinations at odd offsets of one buffer, a guard byte after each.
        std::vector<unsigned char> buf(static_cast<std::size_t>(count) * (bytes + 2) + 1, 0x5c);
        std::vector<void*> dst;
        for (int64_t r = 0; r < count; ++r)
          dst.push_back(buf.data() + 1 + static_cast<std::size_t>(r) * (bytes + 2));
        detail::copy_row_to(dst.data(), count, src.data() + 1, bytes);
        for (int64_t r = 0; r < count; ++r) {
          const auto* d = static_cast<const unsigned char*>(dst[static_cast<std::size_t>(r)]);
          EXPECT_EQ(0, std::memcmp(d, src.data() + 1, bytes));
          EXPECT_EQ(0x5c, d[bytes]);  // nothing past the end
        }
        EXPECT_EQ(0x5c, buf[0]);
      }
  });
}

// grad_probs' dot product by its definition (convert.h, include/moe_ep/permute.h): 16 partial
// sums from +0, lane l adding the products of elements l, l+16, ... in order, then the tree.
float blocked_dot(const float* g, const void* x, DType dtype, int64_t n) {
  float lane[16] = {};
  for (int64_t i = 0; i < n; ++i)
    lane[i % 16] = lane[i % 16] + g[i] * detail::load_f32(x, dtype, i);
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] = lane[l] + lane[l + w];
  return lane[0];
}

TEST(Simd, DotRowFollowsTheBlockedOrder) {
  for_each_target([] {
    std::mt19937_64 rng(13);
    for (DType dtype : kFloatDTypes)
      for (int64_t n : {0, 1, 7, 15, 16, 17, 31, 33, 47, 64, 65, 80, 85, 111, 127, 513, 2071})
        for (int kind = 0; kind < 7; ++kind) {
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n) +
                       " kind=" + std::to_string(kind));
          // kind 0: awkward values, NaN included; 1: no NaN; 2: signed zeros and small values,
          // where the sign of a zero partial sum shows whether the tail added anything; 3: finite
          // awkward values (ties, subnormals, products that overflow to Inf), for the bf16 path
          // that skips the NaN test when g and w are finite; 4: moderate finite values, so that
          // every dot product is finite and shows the order of its lanes (awkward rows hold Inf);
          // 5: some weights NaN (payloads 0x7fffffff, signalling 0x7fa00001), g without NaN; 6: g's
          // row of x's dtype with signalling NaNs, weights finite (one NaN per product: its bits
          // are defined).
          std::vector<float> g = f32_row(rng, n, kind == 0);
          if (kind == 3 || kind == 5)  // 5: so that only w can make a product NaN
            for (float& v : g)
              if (!std::isfinite(v)) v = 0x1.fep127f;
          // Nine rows sharing g, as a token's entries share its grad_out row.
          constexpr int kMaxRows = 9;
          std::vector<std::vector<uint16_t>> x;
          std::vector<const void*> xp;
          std::vector<float> w;
          for (int r = 0; r < kMaxRows; ++r) {
            x.push_back(make_row(rng, dtype, n, false));
            w.push_back(awkward(rng, false));
          }
          if (kind == 2)
            for (int64_t i = 0; i < n; ++i) {
              const std::size_t ui = static_cast<std::size_t>(i);
              g[ui] = rng() % 4 == 0 ? 0.5f : -1.0f;
              for (auto& row : x) detail::store_f32(row.data(), dtype, i, rng() % 3 ? -0.0f : 0.0f);
            }
          if (kind == 4) {
            std::uniform_real_distribution<float> unit(-2.0f, 2.0f);
            for (int64_t i = 0; i < n; ++i) {
              g[static_cast<std::size_t>(i)] = unit(rng);
              for (auto& row : x) detail::store_f32(row.data(), dtype, i, unit(rng));
            }
          }
          if (kind == 5) {
            w[1] = from_bits(0x7fffffffu);
            w[4] = from_bits(0x7fa00001u);
          }
          if (kind >= 4)
            for (float& v : w)
              if (std::isinf(v)) v = 0.375f;
          for (auto& row : x) xp.push_back(row.data());
          // g is read as fp32 (g_dtype kF32) and, rounded to x's dtype, as a row of that dtype
          // (grad_out of unpermute_grad); gf holds the values the kernel must see in fp32.
          std::vector<uint16_t> g_row(static_cast<std::size_t>(n) * dtype_size(dtype) / 2 + 1);
          std::vector<float> g_rounded(g.size());
          for (int64_t i = 0; i < n; ++i) {
            detail::store_f32(g_row.data(), dtype, i, g[static_cast<std::size_t>(i)]);
            if (kind == 6 && i % 23 == 5) put_signalling_nan(g_row.data(), dtype, i);
            g_rounded[static_cast<std::size_t>(i)] = detail::load_f32(g_row.data(), dtype, i);
          }
          for (const DType g_dtype : {DType::kF32, dtype}) {
            const bool rounded = g_dtype != DType::kF32;
            SCOPED_TRACE(std::string("g as ") + dtype_name(g_dtype));
            const std::vector<float>& gf = rounded ? g_rounded : g;
            const void* const gp = rounded ? static_cast<const void*>(g_row.data()) : gf.data();
            std::vector<float> want;
            for (auto& row : x) want.push_back(blocked_dot(gf.data(), row.data(), dtype, n));
            if (!rounded) {
              const float got = detail::dot_row_f32(gf.data(), xp[0], dtype, n);
              expect_same_or_nan(DType::kF32, &got, &want[0], 1);
            }
            // The fused pass over 1..9 rows (whole and partial groups of eight): the same dot
            // products, each row of scale_row_f32, nothing past the ends.
            // Every group size on short rows; on long ones (whose tails the short ones already
            // cover) one row, a whole group and a group plus one, to keep the test fast.
            const std::vector<int> counts =
                n <= 127 ? std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8, 9} : std::vector<int>{1, 8, 9};
            for (DType out : kFloatDTypes)
              for (int count : counts) {
                SCOPED_TRACE(std::string("scaled to ") + dtype_name(out) +
                             " count=" + std::to_string(count));
                const std::size_t ob = static_cast<std::size_t>(n) * dtype_size(out);
                std::vector<std::vector<uint8_t>> a, b;
                std::vector<void*> ap;
                for (int r = 0; r < count; ++r) {
                  a.emplace_back(ob + 8, 0xa5);
                  b.emplace_back(ob + 8, 0xa5);
                  ap.push_back(a.back().data());
                  for (int64_t i = 0; i < n; ++i)
                    detail::store_f32(
                        b.back().data(), out, i,
                        gf[static_cast<std::size_t>(i)] * w[static_cast<std::size_t>(r)]);
                }
                std::vector<float> dots(static_cast<std::size_t>(count) + 1, 2.0f);
                detail::scale_dot_rows_f32(dots.data(), ap.data(), out, gp, g_dtype, w.data(),
                                           xp.data(), dtype, count, n);
                for (int r = 0; r < count; ++r) {
                  SCOPED_TRACE("row " + std::to_string(r));
                  const std::size_t ur = static_cast<std::size_t>(r);
                  expect_same_or_nan(DType::kF32, &dots[ur], &want[ur], 1);
                  // g * w is one operation with at most one NaN operand (kinds 0 and 6: in g, 5: in
                  // w): NaNs too have the scalar bits.
                  expect_same_bytes(a[ur].data(), b[ur].data(), ob);
                  expect_same_bytes(a[ur].data() + ob, b[ur].data() + ob, 8);
                }
                EXPECT_EQ(dots[static_cast<std::size_t>(count)], 2.0f);  // nothing past `count`
              }
          }
        }
  });
}

// Values that only the chosen order gives, on every target. g = 1, so the products are x.
// Lanes 1 and 3 hold 1 each and lane 0 holds 2^24: the tree adds lane 3 to lane 1 (w = 2),
// giving 2, and then lane 1 to lane 0 (w = 1): 2^24 + 2. In plain h order each 1 is absorbed by
// 2^24 (ties to even) and the result is 2^24; so it is with the adjacent-pairs tree
// ((l0 + l1) + (l2 + l3)) and with a lane-by-lane sum. Lane 5 holds 2^24, 1, -2^24 at elements
// 5, 21, 37: summed in order within the lane the 1 is absorbed and the lane is 0; two
// accumulators per lane (32 lanes) would keep the 1.
TEST(Simd, DotRowOrderIsFixed) {
  std::vector<float> g(64, 1.0f), x(64, 0.0f);
  x[0] = 0x1p24f;
  x[1] = 1.0f;
  x[3] = 1.0f;
  x[5] = 0x1p24f;
  x[21] = 1.0f;
  x[37] = -0x1p24f;
  // All products -0: every lane starts at +0, so the dot product is +0 (h order starting with
  // the first product would give -0).
  std::vector<float> neg(40, -1.0f), zeros(40, 0.0f);
  for_each_target([&] {
    EXPECT_EQ(detail::dot_row_f32(g.data(), x.data(), DType::kF32, 64), 0x1p24f + 2.0f);
    const float z = detail::dot_row_f32(neg.data(), zeros.data(), DType::kF32, 40);
    EXPECT_EQ(bits(z), 0u) << z;
  });
}

// Non-temporal stores (stream = true) write the same bytes as ordinary ones, aligned or not (an
// unaligned destination falls back to ordinary stores), and nothing past the end.
TEST(Simd, StreamingStoresWriteTheSameBytes) {
  for_each_target([] {
    std::mt19937_64 rng(17);
    for (int64_t n : kLengths)
      for (std::size_t offset : {std::size_t{0}, std::size_t{2}}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " offset=" + std::to_string(offset));
        const std::size_t bytes = static_cast<std::size_t>(n) * 2;
        const std::vector<uint16_t> src = make_row(rng, DType::kBF16, n, true);
        const std::vector<float> f = f32_row(rng, n, true);
        // 64-byte aligned storage; offset 2 misaligns the destination.
        std::vector<float> a(static_cast<std::size_t>(n) + 64, 0.0f), b(a.size(), 0.0f);
        auto* pa = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(a.data()) + 63) / 64 * 64) +
                   offset;
        auto* pb = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(b.data()) + 63) / 64 * 64) +
                   offset;
        detail::copy_row(pa, src.data(), bytes, true);
        std::memcpy(pb, src.data(), bytes);
        expect_same_bytes(pa, pb, bytes + 8);
        detail::scale_row_f32(pa, DType::kBF16, f.data(), 0.75f, n, true);
        detail::scale_row_f32(pb, DType::kBF16, f.data(), 0.75f, n, false);
        expect_same_bytes(pa, pb, bytes + 8);
        const void* rows[2] = {src.data(), src.data()};
        const float w[2] = {0.5f, -3.0f};
        detail::sum_rows(pa, DType::kBF16, rows, w, 2, DType::kBF16, n, true);
        detail::sum_rows(pb, DType::kBF16, rows, w, 2, DType::kBF16, n, false);
        expect_same_or_nan(DType::kBF16, pa, pb, n);
        expect_same_bytes(pa + bytes, pb + bytes, 8);
        // unpermute_grad's rows (scale_dot_rows_f32) into two rows, the second on the next 64-byte
        // boundary: with NaNs in g, and with g finite (the path without the NaN test).
        std::uniform_real_distribution<float> unit(-4.0f, 4.0f);
        std::vector<uint16_t> finite(src.size());
        for (int64_t i = 0; i < n; ++i)
          detail::store_f32(finite.data(), DType::kBF16, i, unit(rng));
        const std::size_t second = (bytes + 63) / 64 * 64;
        const std::vector<uint16_t>* gs[] = {&src, &finite};
        for (const std::vector<uint16_t>* g : gs) {
          std::memset(pa, 0x5a, second + bytes + 8);
          std::memset(pb, 0x5a, second + bytes + 8);
          void* da[2] = {pa, pa + second};
          void* db[2] = {pb, pb + second};
          const void* xs[2] = {src.data(), finite.data()};
          float dots_a[2], dots_b[2];
          detail::scale_dot_rows_f32(dots_a, da, DType::kBF16, g->data(), DType::kBF16, w, xs,
                                     DType::kBF16, 2, n, true);
          detail::scale_dot_rows_f32(dots_b, db, DType::kBF16, g->data(), DType::kBF16, w, xs,
                                     DType::kBF16, 2, n, false);
          expect_same_bytes(pa, pb, second + bytes + 8);
          expect_same_or_nan(DType::kF32, dots_a, dots_b, 2);
        }
      }
  });
}

// int8 quantisation (quant.cc) against ref/quant_ref.cc on every target: odd lengths, smoothing,
// zero, non-finite and tiny rows.
TEST(Simd, QuantMatchesReferenceOnEveryTarget) {
  for_each_target([] {
    std::mt19937_64 rng(19);
    for (DType dtype : kFloatDTypes)
      for (int64_t n : kLengths)
        for (int kind = 0; kind < 4; ++kind) {
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n) +
                       " kind=" + std::to_string(kind));
          const std::size_t un = static_cast<std::size_t>(n);
          std::vector<float> v(un + 1);
          for (auto& x : v) {
            x = awkward(rng, false);
            if (kind != 2 && std::isinf(x)) x = 3.0f;  // kind 2: rows that may hold Inf
            if (kind == 3) x = std::ldexp(x, -130);    // tiny rows
          }
          std::vector<uint16_t> x(un * dtype_size(dtype) / 2 + 2);
          for (int64_t i = 0; i < n; ++i) detail::store_f32(x.data(), dtype, i, v[i]);
          std::vector<float> smooth(un + 1);
          for (auto& f : smooth) f = 0.5f + static_cast<float>(rng() % 1000) / 500.0f;
          for (const float* sm :
               {static_cast<const float*>(nullptr), static_cast<const float*>(smooth.data())}) {
            std::vector<int8_t> qk(un + 1, 99), qr(un + 1, 99);
            const float sk = detail::quantize_row_int8(x.data(), dtype, sm, n, qk.data());
            const float sr = ref::quantize_row_int8(dtype, x.data(), sm, n, qr.data());
            EXPECT_TRUE(bits(sk) == bits(sr) || (std::isnan(sk) && std::isnan(sr)));
            expect_same_bytes(qk.data(), qr.data(), un + 1);
            if (std::isnan(sk)) continue;
            std::vector<float> dk(un + 1, 7.0f), dr(un + 1, 7.0f);
            detail::dequantize_row_int8(qk.data(), sk, n, dk.data());
            ref::dequantize_row_int8(qk.data(), sk, n, dr.data());
            expect_same_bytes(dk.data(), dr.data(), (un + 1) * 4);
            std::vector<float> ak = f32_row(rng, n, false), ar = ak;
            detail::axpy_row_int8(ak.data(), 0.3f, qk.data(), sk, n);
            ref::axpy_row_int8(ar.data(), 0.3f, qk.data(), sk, n);
            expect_same_or_nan(DType::kF32, ak.data(), ar.data(), n + 1);
          }
        }
  });
}

// quantize_rows_int8_to: each row's reference int8 row and scale, written to every one of its
// destinations, on every target. Lengths that end in each loop of the kernel (a block of 32 to
// 256 elements, one vector of bytes, the scalar tail: 300 = 256 + 32 + 12 with AVX2); a fixed run
// of kinds so that every kind follows and precedes an ordinary row (each row's max is read during
// the row before it), ordinary rows with their max at a random place (in any of the loops); 1-8
// destinations per row; and, at n = 7168 with 9 rows, enough work for the rows to be split over
// threads.
TEST(Simd, QuantizeRowsToEveryDestinationMatchReference) {
  for_each_target([] {
    std::mt19937_64 rng(29);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    // 0: ordinary (awkward values, or values in [-1, 1] with one spike of 100 at a random place),
    // 1: zero, 2: an Inf, 3: a NaN, 4: tiny (|x| < 2^-130: the 2^64 pre-scale; zero in fp16)
    const int kinds[] = {0, 0, 4, 0, 2, 0, 3, 0, 1, 0};
    for (DType dtype : kFloatDTypes)
      for (int64_t n : {0, 1, 15, 64, 65, 127, 200, 300, 517, 7168})
        for (int64_t rows : {1, 2, 9})
          for (int stream : {0, 1, 2}) {  // 1: non-temporal, 64-byte aligned; 2: some not
            SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n) +
                         " rows=" + std::to_string(rows) + " stream=" + std::to_string(stream));
            const std::size_t un = static_cast<std::size_t>(n);
            const std::size_t row_elems = un * dtype_size(dtype) / 2 + 1;
            std::vector<std::vector<uint16_t>> x;
            std::vector<const void*> xp;
            std::vector<int64_t> first = {0};
            for (int64_t t = 0; t < rows; ++t) {
              const int kind = rows == 9 ? kinds[t] : static_cast<int>(rng() % 5);
              const bool spiked = rng() % 2 == 0;
              const int64_t spike = n > 0 ? static_cast<int64_t>(rng() % un) : 0;
              x.emplace_back(row_elems);
              for (int64_t i = 0; i < n; ++i) {
                float v = spiked ? (i == spike ? 100.0f : unit(rng)) : awkward(rng, false);
                if (std::isinf(v)) v = -2.5f;
                if (kind == 1) v = rng() % 2 ? 0.0f : -0.0f;
                if (kind == 2 && i == n / 2) v = -INFINITY;
                if (kind == 3 && i == n - 1) v = NAN;
                if (kind == 4) v = std::ldexp(unit(rng), -130);
                detail::store_f32(x.back().data(), dtype, i, v);
              }
              first.push_back(first.back() + 1 + static_cast<int64_t>(rng() % 8));  // 1..8 copies
            }
            for (auto& row : x) xp.push_back(row.data());
            // Destination r at r * stride (+1 for every third with stream 2) of a 64-aligned
            // buffer, the byte after each row a sentinel.
            const std::size_t stride = (un + 1 + 63) / 64 * 64 + 64;
            const std::size_t dsts = static_cast<std::size_t>(first.back());
            std::vector<int8_t> buf(dsts * stride + 128, 99);
            int8_t* base =
                buf.data() + (64 - reinterpret_cast<std::uintptr_t>(buf.data()) % 64) % 64;
            std::vector<int8_t*> qp;
            for (std::size_t r = 0; r < dsts; ++r)
              qp.push_back(base + r * stride + (stream == 2 && r % 3 == 2 ? 1 : 0));
            std::vector<float> scales(static_cast<std::size_t>(rows) + 1, 7.0f);
            detail::quantize_rows_int8_to(xp.data(), dtype, rows, n, qp.data(), first.data(),
                                          scales.data(), stream > 0);
            for (int64_t t = 0; t < rows; ++t) {
              SCOPED_TRACE("row " + std::to_string(t));
              const std::size_t ut = static_cast<std::size_t>(t);
              std::vector<int8_t> want(un + 1, 99);
              const float want_scale =
                  ref::quantize_row_int8(dtype, xp[ut], nullptr, n, want.data());
              EXPECT_TRUE(bits(scales[ut]) == bits(want_scale) ||
                          (std::isnan(scales[ut]) && std::isnan(want_scale)))
                  << scales[ut] << " vs " << want_scale;
              for (int64_t r = first[ut]; r < first[ut + 1]; ++r)
                expect_same_bytes(qp[static_cast<std::size_t>(r)], want.data(), un + 1);
            }
            EXPECT_EQ(scales[static_cast<std::size_t>(rows)], 7.0f);  // nothing past `rows`
          }
  });
}

// quantize_rows_int8, the path combine and smoothed dispatch use: rows in groups (the max pass
// walks up to 4 rows side by side), gathered through src_index and smooth_index; every row equals
// the ref/ oracle.
TEST(Simd, QuantizeRowsMatchReferenceOnEveryTarget) {
  for_each_target([] {
    std::mt19937_64 rng(23);
    for (DType dtype : kFloatDTypes)
      for (int64_t n : {0, 1, 33, 517})
        for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 17, 19, 35})
          for (bool smoothed : {false, true}) {
            SCOPED_TRACE(std::string(dtype_name(dtype)) + " n=" + std::to_string(n) +
                         " rows=" + std::to_string(rows) + (smoothed ? " smoothed" : ""));
            const std::size_t un = static_cast<std::size_t>(n);
            const int64_t src_rows = rows + 3;  // gathered in a shuffled order
            const std::size_t row_elems = un * dtype_size(dtype) / 2 + 2;
            std::vector<uint16_t> x(static_cast<std::size_t>(src_rows) * row_elems);
            for (int64_t r = 0; r < src_rows; ++r) {
              const int kind = static_cast<int>(r % 4);  // 1: zero row, 2: Inf, 3: tiny
              for (int64_t i = 0; i < n; ++i) {
                float v = awkward(rng, false);
                if (kind != 2 && std::isinf(v)) v = 3.0f;
                if (kind == 1) v = 0.0f;
                if (kind == 3) v = std::ldexp(v, -130);
                detail::store_f32(x.data() + static_cast<std::size_t>(r) * row_elems, dtype, i, v);
              }
            }
            std::vector<float> smooth(static_cast<std::size_t>(3 * n + 1));
            for (auto& f : smooth) f = 0.5f + static_cast<float>(rng() % 1000) / 500.0f;
            std::vector<int32_t> src_index, smooth_index;
            for (int64_t r = 0; r < rows; ++r) {
              src_index.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(src_rows)));
              smooth_index.push_back(static_cast<int32_t>(rng() % 3));
            }
            const int64_t q_stride = n + 5;
            std::vector<int8_t> q(static_cast<std::size_t>(rows * q_stride), 99);
            std::vector<float> scales(static_cast<std::size_t>(rows) + 1, 7.0f);
            detail::QuantizeRowsInt8Args a;
            a.rows = rows;
            a.n = n;
            a.dtype = dtype;
            a.src = x.data();
            a.src_stride = static_cast<int64_t>(row_elems * 2 / dtype_size(dtype));
            a.src_index = src_index.data();
            a.q = q.data();
            a.q_stride = q_stride;
            a.scales = scales.data();
            if (smoothed) {
              a.smooth = smooth.data();
              a.smooth_stride = n;
              a.smooth_index = smooth_index.data();
            }
            detail::quantize_rows_int8(a);
            for (int64_t r = 0; r < rows; ++r) {
              SCOPED_TRACE("row " + std::to_string(r));
              const std::size_t ur = static_cast<std::size_t>(r);
              std::vector<int8_t> qr(static_cast<std::size_t>(q_stride), 99);
              const float sr = ref::quantize_row_int8(
                  dtype, x.data() + static_cast<std::size_t>(src_index[ur]) * row_elems,
                  smoothed ? smooth.data() + smooth_index[ur] * n : nullptr, n, qr.data());
              EXPECT_TRUE(bits(scales[ur]) == bits(sr) ||
                          (std::isnan(scales[ur]) && std::isnan(sr)));
              expect_same_bytes(q.data() + r * q_stride, qr.data(), un);
              EXPECT_EQ(q[static_cast<std::size_t>(r * q_stride + n)], 99);  // nothing past n
            }
            EXPECT_EQ(scales[static_cast<std::size_t>(rows)], 7.0f);
          }
  });
}

}  // namespace
}  // namespace moe_ep
