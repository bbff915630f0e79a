// int8 quantisation kernels (quant.h) with Highway, compiled per x86 target and dispatched at
// run time like convert.cc. Each element sees the scalar definition's operations in its order;
// the only reduction, the row's max |xf|, is an integer max over bit patterns and so exact in any
// order.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/quant.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// (after foreach_target.h, which re-includes this file once per target)
#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include "base/parallel.h"
#include "base/threads.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/rows-inl.h"

#ifndef MOE_EP_KERNELS_CPU_QUANT_CONSTANTS_
#define MOE_EP_KERNELS_CPU_QUANT_CONSTANTS_
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "base/check.h"
#include "kernels/cpu/convert.h"

namespace moe_ep::detail::quant_constants {
constexpr float kQMax = 127.0f;
// Adding 1.5 * 2^23 to an fp32 of magnitude below 2^22 rounds it to the nearest integer, ties to
// even (the default rounding mode): the sum is exactly 1.5 * 2^23 + rne(x). One vector add.
constexpr float kRoundMagic = 12582912.0f;
// Tiny rows (127 / amax overflows) are scaled up by 2^64 first; see quant.h.
constexpr float kTinyUp = 0x1p64f;
constexpr float kTinyDown = 0x1p-64f;
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;
}  // namespace moe_ep::detail::quant_constants
#endif

HWY_BEFORE_NAMESPACE();
namespace moe_ep::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using namespace quant_constants;  // NOLINT(google-build-using-namespace)

// xf = fp32(x) (times the smoothing factors when kSmooth), Lanes elements at i; a partial last
// vector (rest > 0) is padded with zeros, which change neither the max nor the stored values.
template <DType kT, bool kSmooth>
HWY_INLINE VF LoadXf(DF df, const void* x, const float* smooth, int64_t i, size_t rest) {
  VF v = rest ? Tail<kT>(x, i, rest).load(df) : LoadF32<kT>(df, x, i);
  if constexpr (kSmooth) {
    const VF sm = rest ? Tail<DType::kF32>(smooth, i, rest).load(df) : hn::LoadU(df, smooth + i);
    v = hn::Mul(v, sm);
  }
  return v;
}

// q[i] = clamp(rne((xf[i] * pre) * s)); pre is 1 (exact, kPre false: not multiplied) or 2^64
// (exact on tiny rows). rne: p + 1.5 * 2^23 (|p| < 127.5, far below 2^22) is the float
// 1.5 * 2^23 + rne(p), exactly; clamping that float to 1.5 * 2^23 -+ 127 is clamping rne(p)
// (monotonic, every bound exact), and its bit pattern is 0x4b400000 + rne(p), whose low byte is
// rne(p) as an int8 (0x4b400000 ends in a zero byte). So the int8 is the truncated bit pattern.
template <DType kT, bool kSmooth, bool kPre>
void QuantizePass(const void* x, const float* smooth, int64_t n, float pre, float s, int8_t* q) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<uint8_t, DF> d8;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  const VF vpre = hn::Set(df, pre), vs = hn::Set(df, s), magic = hn::Set(df, kRoundMagic);
  const VF lo = hn::Set(df, kRoundMagic - kQMax), hi = hn::Set(df, kRoundMagic + kQMax);
  auto quantize = [&](VF xf) {
    const VF p = kPre ? hn::Mul(hn::Mul(xf, vpre), vs) : hn::Mul(xf, vs);
    const VF r = hn::Min(hn::Max(hn::Add(p, magic), lo), hi);
    return hn::TruncateTo(d8, hn::BitCast(du, r));
  };
  auto* q8 = reinterpret_cast<uint8_t*>(q);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes)
    hn::StoreU(quantize(LoadXf<kT, kSmooth>(df, x, smooth, i, 0)), d8, q8 + i);
  if (i < n) {
    const size_t rest = static_cast<size_t>(n - i);
    HWY_ALIGN uint8_t tmp[hn::MaxLanes(df)];
    hn::Store(quantize(LoadXf<kT, kSmooth>(df, x, smooth, i, rest)), d8, tmp);
    std::memcpy(q8 + i, tmp, rest);
  }
}

// The bit pattern of max_i |xf[i]| of each of kRows rows (out[r]). For non-negative floats the
// integer order of the bit patterns is the numeric order, and NaNs (> 0x7f800000) sort above Inf
// (== 0x7f800000) above every finite value, so one integer max both finds amax and flags non-finite
// rows, whatever the lane order. The rows are walked side by side (several rows in flight keep more
// memory requests outstanding than one: this pass is the first read of each row).
template <DType kT, bool kSmooth, int kRows>
void AmaxBitsRows(const void* const* x, const float* const* smooth, int64_t n, uint32_t* out) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  const auto mask = hn::Set(du, kAbsMask);
  hn::Vec<decltype(du)> m[kRows];
  for (int r = 0; r < kRows; ++r) m[r] = hn::Zero(du);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes)
    for (int r = 0; r < kRows; ++r)
      m[r] = hn::Max(
          m[r], hn::And(hn::BitCast(
                            du, LoadXf<kT, kSmooth>(df, x[r], kSmooth ? smooth[r] : nullptr, i, 0)),
                        mask));
  for (int r = 0; r < kRows; ++r) {
    if (i < n) {
      const VF v = LoadXf<kT, kSmooth>(df, x[r], kSmooth ? smooth[r] : nullptr, i,
                                       static_cast<size_t>(n - i));
      m[r] = hn::Max(m[r], hn::And(hn::BitCast(du, v), mask));
    }
    out[r] = hn::GetLane(hn::MaxOfLanes(du, m[r]));
  }
}

// The rest of quantize_row_int8 once the row's max |xf| (as bits, mb) is known.
template <DType kT, bool kSmooth>
float QuantizeWithAmax(uint32_t mb, const void* x, const float* smooth, int64_t n, int8_t* q) {
  if (mb == 0 || mb >= kInfBits) {
    if (n > 0) std::memset(q, 0, static_cast<std::size_t>(n));
    return mb == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  float amax;
  std::memcpy(&amax, &mb, 4);
  float s = kQMax / amax;
  float pre = 1.0f;
  if (s > std::numeric_limits<float>::max()) {  // 127 / amax overflowed: amax < ~3.7e-37
    pre = kTinyUp;
    s = kQMax / (amax * kTinyUp);
  }
  if (pre == 1.0f)
    QuantizePass<kT, kSmooth, false>(x, smooth, n, pre, s, q);
  else
    QuantizePass<kT, kSmooth, true>(x, smooth, n, pre, s, q);
  const float inv = 1.0f / s;
  return pre == 1.0f ? inv : inv * kTinyDown;
}

template <DType kT, bool kSmooth>
float QuantizeT(const void* x, const float* smooth, int64_t n, int8_t* q) {
  uint32_t mb;
  AmaxBitsRows<kT, kSmooth, 1>(&x, &smooth, n, &mb);
  return QuantizeWithAmax<kT, kSmooth>(mb, x, smooth, n, q);
}

constexpr int kQuantRows = 4;

// count rows (smooth: null, or one smoothing row per row), kQuantRows side by side for the max.
template <DType kT, bool kSmooth>
void QuantizeRowsT(const void* const* x, const float* const* smooth, int64_t count, int64_t n,
                   int8_t* const* q, float* scales) {
  for (int64_t r = 0; r < count; r += kQuantRows) {
    const int64_t c = std::min<int64_t>(kQuantRows, count - r);
    const float* const* sm = kSmooth ? smooth + r : nullptr;
    uint32_t mb[kQuantRows];
    WithRowCount<kQuantRows>(
        c, [&](auto rows) { AmaxBitsRows<kT, kSmooth, decltype(rows)::value>(x + r, sm, n, mb); });
    for (int64_t j = 0; j < c; ++j)
      scales[r + j] =
          QuantizeWithAmax<kT, kSmooth>(mb[j], x[r + j], kSmooth ? sm[j] : nullptr, n, q[r + j]);
  }
}

template <DType kT>
void QuantizeRowsSmooth(const void* const* x, const float* const* smooth, int64_t count, int64_t n,
                        int8_t* const* q, float* scales) {
  if (smooth != nullptr)
    QuantizeRowsT<kT, true>(x, smooth, count, n, q, scales);
  else
    QuantizeRowsT<kT, false>(x, smooth, count, n, q, scales);
}

void QuantizeRows(const void* const* x, DType dtype, const float* const* smooth, int64_t count,
                  int64_t n, int8_t* const* q, float* scales) {
  WithFloatDType(dtype, [&](auto t) {
    QuantizeRowsSmooth<decltype(t)::value>(x, smooth, count, n, q, scales);
  });
}

template <DType kT>
float QuantizeSmooth(const void* x, const float* smooth, int64_t n, int8_t* q) {
  return smooth != nullptr ? QuantizeT<kT, true>(x, smooth, n, q)
                           : QuantizeT<kT, false>(x, smooth, n, q);
}

float QuantizeRow(const void* x, DType dtype, const float* smooth, int64_t n, int8_t* q) {
  return WithFloatDType(
      dtype, [&](auto t) { return QuantizeSmooth<decltype(t)::value>(x, smooth, n, q); });
}

#if HWY_TARGET != HWY_SCALAR
// The int8 values of four vectors from QuantizePass's rounding (each the low byte of a 32-bit
// lane), in element order, as one full vector of bytes: one store per destination. (The scalar
// target has no byte shuffles; there QuantizeToT quantises into the first destination and copies.)
template <class DU>
HWY_INLINE hn::Vec<hn::Repartition<uint8_t, DU>> PackLowBytes(DU, hn::Vec<DU> b0, hn::Vec<DU> b1,
                                                              hn::Vec<DU> b2, hn::Vec<DU> b3) {
  const hn::Repartition<uint16_t, DU> d16;
  const hn::Repartition<uint8_t, DU> d8;
  // ConcatEven(hi, lo): the even lanes of lo, then those of hi. The even 16-bit half of a 32-bit
  // lane is its low half (little endian), and the even byte of that is the low byte.
  const auto t01 = hn::ConcatEven(d16, hn::BitCast(d16, b1), hn::BitCast(d16, b0));
  const auto t23 = hn::ConcatEven(d16, hn::BitCast(d16, b3), hn::BitCast(d16, b2));
  return hn::ConcatEven(d8, hn::BitCast(d8, t23), hn::BitCast(d8, t01));
}
#endif

// quantize_row_int8 of one row without smoothing whose max bits mb are known, its int8 row
// written to each of count destinations: one pass that quantises a block of elements at a time
// and stores it to each destination in turn (several lines each, below). The arithmetic runs
// between the stores, which bound the time when a token goes to several places (dispatch_v2: one
// copy per expert). The same pass reads the next row (next, may be null) for its max (*next_mb):
// its reads overlap these stores instead of making a pass of their own that the core waits for.
// Zero, non-finite and tiny rows go through QuantizeWithAmax once, then are copied. stream: every
// dst is 64-byte aligned and the full vectors are stored non-temporally (the caller flushes).
template <DType kT>
float QuantizeToT(const void* x, uint32_t mb, int64_t n, int8_t* const* dst, int64_t count,
                  const void* next, uint32_t* next_mb, [[maybe_unused]] bool stream) {
  [[maybe_unused]] const DF df;  // unused on the scalar target
  const hn::RebindToUnsigned<DF> du;
  auto next_max = hn::Zero(du);  // of next's elements [0, i)
  int64_t i = 0;
  float scale;
  float amax;
  std::memcpy(&amax, &mb, 4);
  const float s = mb == 0 || mb >= kInfBits ? 0.0f : kQMax / amax;
  if (s == 0.0f || s > std::numeric_limits<float>::max()) {
    scale = QuantizeWithAmax<kT, false>(mb, x, nullptr, n, dst[0]);
    for (int64_t r = 1; r < count && n > 0; ++r)
      std::memcpy(dst[r], dst[0], static_cast<std::size_t>(n));
  } else {
#if HWY_TARGET != HWY_SCALAR
    const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
    const int64_t esize = static_cast<int64_t>(dtype_size(kT));
    constexpr int64_t kPrefetchAhead = 4096;
    const VF vs = hn::Set(df, s), magic = hn::Set(df, kRoundMagic);
    const VF lo = hn::Set(df, kRoundMagic - kQMax), hi = hn::Set(df, kRoundMagic + kQMax);
    const hn::Repartition<uint8_t, DF> d8;
    const auto mask = hn::Set(du, kAbsMask);
    auto bits = [&](int64_t at) {  // as QuantizePass<kT, false, false>
      const VF p = hn::Mul(LoadF32<kT>(df, x, at), vs);
      return hn::BitCast(du, hn::Min(hn::Max(hn::Add(p, magic), lo), hi));
    };
    auto abs_bits = [&](int64_t at) {
      return hn::And(hn::BitCast(du, LoadF32<kT>(df, next, at)), mask);
    };
    auto packed = [&](int64_t at) {
      return PackLowBytes(du, bits(at), bits(at + lanes), bits(at + 2 * lanes),
                          bits(at + 3 * lanes));
    };
    auto put = [&](auto v, int64_t r, int64_t at) {
      auto* out = reinterpret_cast<uint8_t*>(dst[r]) + at;
      if (stream)
        hn::Stream(v, d8, out);
      else
        hn::StoreU(v, d8, out);
    };
    auto next_step = [&](int64_t at) {
      next_max = hn::Max(hn::Max(next_max, hn::Max(abs_bits(at), abs_bits(at + lanes))),
                         hn::Max(abs_bits(at + 2 * lanes), abs_bits(at + 3 * lanes)));
    };
    // Several lines to each destination in turn: with AVX2 eight vectors of bytes, four lines
    // (int8 dispatch_v2 0.74-1.04 of bf16's time with one line, 0.58-0.63 with four); elsewhere
    // two vectors (AVX-512: two lines, measured a little faster than one line and than four).
    constexpr int64_t kPer = HWY_TARGET == HWY_AVX2 ? 8 : 2;  // vectors of bytes per destination
    for (; i + kPer * 4 * lanes <= n; i += kPer * 4 * lanes) {
      const auto v0 = packed(i), v1 = packed(i + 4 * lanes);
      if constexpr (kPer == 2) {
        for (int64_t r = 0; r < count; ++r) {
          put(v0, r, i);
          put(v1, r, i + 4 * lanes);
        }
      } else {
        const auto v2 = packed(i + 8 * lanes), v3 = packed(i + 12 * lanes);
        const auto v4 = packed(i + 16 * lanes), v5 = packed(i + 20 * lanes);
        const auto v6 = packed(i + 24 * lanes), v7 = packed(i + 28 * lanes);
        for (int64_t r = 0; r < count; ++r) {
          put(v0, r, i);
          put(v1, r, i + 4 * lanes);
          put(v2, r, i + 8 * lanes);
          put(v3, r, i + 12 * lanes);
          put(v4, r, i + 16 * lanes);
          put(v5, r, i + 20 * lanes);
          put(v6, r, i + 24 * lanes);
          put(v7, r, i + 28 * lanes);
        }
      }
      if (next != nullptr) {
        // The next row's lines 4 KiB ahead of its reads (measured 2-5 % faster with
        // non-temporal stores, which leave these reads the most waiting; prefetches never fault,
        // so those past the row's end are harmless).
        const char* ahead = static_cast<const char*>(next) + i * esize + kPrefetchAhead;
        for (int64_t c = 0; c < kPer * 4 * lanes * esize; c += 64) hwy::Prefetch(ahead + c);
        for (int64_t v = 0; v < kPer; ++v) next_step(i + v * 4 * lanes);
      }
    }
    for (; i + 4 * lanes <= n; i += 4 * lanes) {
      const auto v = packed(i);
      for (int64_t r = 0; r < count; ++r) put(v, r, i);
      if (next != nullptr) next_step(i);
    }
#endif
    if (i < n) {  // fewer than four vectors left (all of the row on the scalar target)
      const auto* xi = static_cast<const char*>(x) + i * static_cast<int64_t>(dtype_size(kT));
      QuantizePass<kT, false, false>(xi, nullptr, n - i, 1.0f, s, dst[0] + i);
      for (int64_t r = 1; r < count; ++r)
        std::memcpy(dst[r] + i, dst[0] + i, static_cast<std::size_t>(n - i));
    }
    scale = 1.0f / s;
  }
  if (next != nullptr) {  // the max of next's elements [i, n), then of the whole row
    const void* rest = static_cast<const char*>(next) + i * static_cast<int64_t>(dtype_size(kT));
    uint32_t rest_mb;
    AmaxBitsRows<kT, false, 1>(&rest, nullptr, n - i, &rest_mb);
    *next_mb = std::max(rest_mb, hn::GetLane(hn::MaxOfLanes(du, next_max)));
  }
  return scale;
}

// rows rows one after the other, row t to dst[first[t] .. first[t + 1]) (QuantizeToT), each
// row's max read during the previous row's stores. stream: non-temporal stores for the rows whose
// destinations are all 64-byte aligned, flushed before returning.
template <DType kT>
void QuantizeRowsToT(const void* const* x, int64_t rows, int64_t n, int8_t* const* dst,
                     const int64_t* first, float* scales, bool stream) {
  uint32_t mb;
  AmaxBitsRows<kT, false, 1>(x, nullptr, n, &mb);
  bool streamed = false;
  for (int64_t t = 0; t < rows; ++t) {
    bool aligned = stream;
    for (int64_t r = first[t]; r < first[t + 1] && aligned; ++r) aligned = stream_aligned(dst[r]);
    streamed |= aligned;
    uint32_t next_mb = 0;
    scales[t] = QuantizeToT<kT>(x[t], mb, n, dst + first[t], first[t + 1] - first[t],
                                t + 1 < rows ? x[t + 1] : nullptr, &next_mb, aligned);
    mb = next_mb;
  }
  if (streamed) hwy::FlushStream();
}

void QuantizeRowsTo(const void* const* x, DType dtype, int64_t rows, int64_t n, int8_t* const* dst,
                    const int64_t* first, float* scales, bool stream) {
  WithFloatDType(dtype, [&](auto t) {
    QuantizeRowsToT<decltype(t)::value>(x, rows, n, dst, first, scales, stream);
  });
}

// fl(fp32(q[i]) * scale), Lanes values at i (rest > 0: a partial last vector, zero-padded).
HWY_INLINE VF Dequant(DF df, const int8_t* q, VF scale, int64_t i, size_t rest) {
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<int8_t, DF> d8;
  hn::Vec<decltype(d8)> v;
  if (rest) {
    HWY_ALIGN int8_t tmp[hn::MaxLanes(df)] = {};
    std::memcpy(tmp, q + i, rest);
    v = hn::Load(d8, tmp);
  } else {
    v = hn::LoadU(d8, q + i);
  }
  return hn::Mul(hn::ConvertTo(df, hn::PromoteTo(di, v)), scale);
}

void AxpyRowInt8(float* acc, float w, const int8_t* q, float scale, int64_t n) {
  const DF df;
  const VF vw = hn::Set(df, w), vs = hn::Set(df, scale);
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const VF p = hn::Mul(vw, Dequant(df, q, vs, i, 0));  // both products rounded to fp32
    hn::StoreU(hn::Add(hn::LoadU(df, acc + i), p), df, acc + i);
  }
  if (i < n) {
    const size_t rest = static_cast<size_t>(n - i);
    const VF p = hn::Mul(vw, Dequant(df, q, vs, i, rest));
    StoreTail<DType::kF32>(df, hn::Add(Tail<DType::kF32>(acc, i, rest).load(df), p), acc, i, rest);
  }
}

void DequantizeRowInt8(const int8_t* q, float scale, int64_t n, float* out) {
  const DF df;
  const VF vs = hn::Set(df, scale);
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) hn::StoreU(Dequant(df, q, vs, i, 0), df, out + i);
  if (i < n) {
    const size_t rest = static_cast<size_t>(n - i);
    StoreTail<DType::kF32>(df, Dequant(df, q, vs, i, rest), out, i, rest);
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace moe_ep::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moe_ep::detail {

HWY_EXPORT(QuantizeRow);
HWY_EXPORT(QuantizeRows);
HWY_EXPORT(QuantizeRowsTo);
HWY_EXPORT(AxpyRowInt8);
HWY_EXPORT(DequantizeRowInt8);

float quantize_row_int8(const void* src, DType dtype, const float* smooth, int64_t n, int8_t* q) {
  MOE_EP_CHECK(n >= 0);
  MOE_EP_CHECK(n == 0 || (src != nullptr && q != nullptr));
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32)
    fail(ErrorKind::kInternal, "quantize_row_int8: dtype ", dtype_name(dtype),
         " is not bf16, fp16 or fp32 (please report this bug)");
  return HWY_DYNAMIC_DISPATCH(QuantizeRow)(src, dtype, smooth, n, q);
}

void quantize_rows_int8_to(const void* const* src, DType dtype, int64_t rows, int64_t n,
                           int8_t* const* dst, const int64_t* first, float* scales, bool stream) {
  MOE_EP_CHECK(rows >= 0 && n >= 0);
  MOE_EP_CHECK(dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF32);
  if (rows == 0) return;
  for (int64_t t = 0; t < rows; ++t) MOE_EP_CHECK(first[t + 1] > first[t]);
  // Each thread takes a contiguous run of rows (the kernel reads a row's max during the stores
  // of the row before it); rows are independent, so any split gives the same bits.
  detail::parallel(
      detail::threads_if(rows > 1 && (first[rows] - first[0]) * n >= (int64_t{1} << 15)), [&] {
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t lo = rows * me / nt, hi = rows * (me + 1) / nt;
        if (hi > lo) HWY_DYNAMIC_DISPATCH(QuantizeRowsTo)
        (src + lo, dtype, hi - lo, n, dst, first + lo, scales + lo, stream);
      });
}

void axpy_row_int8(float* acc, float w, const int8_t* q, float scale, int64_t n) {
  HWY_DYNAMIC_DISPATCH(AxpyRowInt8)(acc, w, q, scale, n);
}

void dequantize_row_int8(const int8_t* q, float scale, int64_t n, float* out) {
  HWY_DYNAMIC_DISPATCH(DequantizeRowInt8)(q, scale, n, out);
}

void quantize_rows_int8(const QuantizeRowsInt8Args& a) {
  MOE_EP_CHECK(a.rows >= 0 && a.n >= 0);
  MOE_EP_CHECK(a.dtype == DType::kBF16 || a.dtype == DType::kF16 || a.dtype == DType::kF32);
  if (a.rows == 0) return;
  MOE_EP_CHECK(a.scales != nullptr);
  MOE_EP_CHECK(a.n == 0 || (a.src != nullptr && a.q != nullptr));
  const int64_t esize = static_cast<int64_t>(dtype_size(a.dtype));
  const char* src = static_cast<const char*>(a.src);
  auto src_row = [&a](int64_t r) -> int64_t {
    return a.src_index != nullptr ? static_cast<int64_t>(a.src_index[r]) : r;
  };
  auto smooth_row = [&a](int64_t r) -> int64_t {
    return a.smooth_index != nullptr ? static_cast<int64_t>(a.smooth_index[r]) : r;
  };
  // Rows are independent, so any split gives the same bits; small jobs stay on one thread. Groups
  // of kGroup rows go to one QuantizeRows call (its max pass walks them side by side).
  constexpr int64_t kGroup = 16;
  const int64_t groups = (a.rows + kGroup - 1) / kGroup;
  detail::parallel(detail::threads_if(a.rows > 1 && a.rows * a.n >= (int64_t{1} << 15)), [&] {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
      const void* x[kGroup];
      const float* sm[kGroup];
      int8_t* q[kGroup];
      const int64_t first = g * kGroup, count = std::min(kGroup, a.rows - first);
      for (int64_t j = 0; j < count; ++j) {
        const int64_t r = first + j;
        x[j] = a.n > 0 ? src + src_row(r) * a.src_stride * esize : nullptr;
        sm[j] = a.smooth != nullptr ? a.smooth + smooth_row(r) * a.smooth_stride : nullptr;
        q[j] = a.n > 0 ? a.q + r * a.q_stride : nullptr;
      }
      HWY_DYNAMIC_DISPATCH(QuantizeRows)
      (x, a.dtype, a.smooth != nullptr ? sm : nullptr, count, a.n, q, a.scales + first);
    }
  });
  if (!a.check_finite) return;
  for (int64_t r = 0; r < a.rows; ++r) {
    if (a.scales[r] == a.scales[r]) continue;  // only a non-finite row has a NaN scale
    if (a.smooth != nullptr)
      invalid(a.op, ": ", a.name, "[", src_row(r), "] (quantised row ", r, ", smoothed by scales[",
              smooth_row(r), "]) holds a NaN or Inf (after smoothing); int8 quantisation needs ",
              "finite values");
    invalid(a.op, ": ", a.name, "[", src_row(r), "] (quantised row ", r,
            ") holds a NaN or Inf; int8 quantisation needs finite values");
  }
}

}  // namespace moe_ep::detail
#endif  // HWY_ONCE
