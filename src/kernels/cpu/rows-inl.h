// Internal, per-target (Highway's -inl.h convention: included once per target by files that
// include hwy/foreach_target.h, inside no namespace): loading rows of bf16/fp16/fp32 as fp32
// vectors and storing fp32 vectors rounded to them, with the same bits as convert.h's scalar
// functions, and safe partial last vectors. Used by convert.cc and quant.cc.
#if defined(MOE_EP_KERNELS_CPU_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MOE_EP_KERNELS_CPU_ROWS_INL_H_
#undef MOE_EP_KERNELS_CPU_ROWS_INL_H_
#else
#define MOE_EP_KERNELS_CPU_ROWS_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/convert.h"

HWY_BEFORE_NAMESPACE();
namespace moe_ep::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

#if HWY_TARGET <= HWY_AVX2
constexpr bool kNativeF16 = true;
#else
constexpr bool kNativeF16 = false;
#endif

// Lanes(d) elements of a row of dtype kT starting at element i, as fp32.
template <DType kT>
HWY_INLINE VF LoadF32(DF df, const void* row, int64_t i) {
  if constexpr (kT == DType::kF32) {
    return hn::LoadU(df, static_cast<const float*>(row) + i);
  } else if constexpr (kT == DType::kBF16) {
    const hn::RebindToUnsigned<DF> du32;
    const hn::Rebind<uint16_t, DF> du16;
    const auto h = hn::PromoteTo(du32, hn::LoadU(du16, static_cast<const uint16_t*>(row) + i));
    return hn::BitCast(df, hn::ShiftLeft<16>(h));
  } else if constexpr (kNativeF16) {
    const hn::Rebind<hwy::float16_t, DF> df16;
    return hn::PromoteTo(df, hn::LoadU(df16, static_cast<const hwy::float16_t*>(row) + i));
  } else {
    HWY_ALIGN float tmp[hn::MaxLanes(df)];
    const auto* s = static_cast<const uint16_t*>(row) + i;
    for (size_t l = 0; l < hn::Lanes(df); ++l) tmp[l] = f16_to_f32(s[l]);
    return hn::Load(df, tmp);
  }
}

// v at p; stream: a non-temporal store, p must be aligned to the vector's size. Only vectors of
// 16 bytes or more are streamed: Highway 1.0.3 streams a partial 128-bit vector (e.g. four bf16
// on SSE4) as a whole 16 bytes.
template <class D, class T>
HWY_INLINE void Put(hn::Vec<D> v, D d, T* p, bool stream) {
  if (stream && hn::Lanes(d) * sizeof(T) >= 16) {
    hn::Stream(v, d, p);
  } else {
    hn::StoreU(v, d, p);
  }
}

// Stores Lanes(d) elements rounded to dtype kT at element i of row (non-temporal when stream).
template <DType kT>
HWY_INLINE void StoreF32(DF df, VF v, void* row, int64_t i, bool stream = false) {
  if constexpr (kT == DType::kF32) {
    Put(v, df, static_cast<float*>(row) + i, stream);
  } else if constexpr (kT == DType::kBF16) {
    const hn::RebindToUnsigned<DF> du32;
    const hn::RebindToSigned<DF> di32;
    const hn::Rebind<uint16_t, DF> du16;
    const auto u = hn::BitCast(du32, v);
    const auto hi = hn::ShiftRight<16>(u);
    // |u| <= 0x7fffffff, so the signed compare is exact.
    const auto is_nan = hn::Gt(hn::BitCast(di32, hn::And(u, hn::Set(du32, 0x7fffffffu))),
                               hn::Set(di32, 0x7f800000));
    const auto rounded = hn::ShiftRight<16>(
        hn::Add(u, hn::Add(hn::Set(du32, 0x7fffu), hn::And(hi, hn::Set(du32, 1)))));
    const auto quiet = hn::Or(hi, hn::Set(du32, 0x40u));
    const auto bits = hn::IfThenElse(hn::RebindMask(du32, is_nan), quiet, rounded);
    // Every lane is below 2^16: the saturating demotion is exact.
    Put(hn::DemoteTo(du16, hn::BitCast(di32, bits)), du16, static_cast<uint16_t*>(row) + i, stream);
  } else if constexpr (kNativeF16) {
    const hn::Rebind<hwy::float16_t, DF> df16;
    Put(hn::DemoteTo(df16, v), df16, static_cast<hwy::float16_t*>(row) + i, stream);
  } else {
    HWY_ALIGN float tmp[hn::MaxLanes(df)];
    hn::Store(v, df, tmp);
    auto* d = static_cast<uint16_t*>(row) + i;
    for (size_t l = 0; l < hn::Lanes(df); ++l) d[l] = f32_to_f16(tmp[l]);
  }
}

// f(std::integral_constant<int, count>{}) for 1 <= count <= kMax: a run-time row count as the
// template argument of a kernel that walks that many rows side by side.
template <int kMax, class F>
HWY_INLINE void WithRowCount(int64_t count, F&& f) {
  if constexpr (kMax > 1) {
    if (count < kMax) return WithRowCount<kMax - 1>(count, f);
  }
  f(std::integral_constant<int, kMax>{});
}

#if HWY_TARGET != HWY_SCALAR
// v rounded to bf16 as StoreF32 rounds it (u + 0x7fff + lsb, ties to even; NaN made quiet by
// setting bit 22, as f32_to_bf16 does), in the upper half of each 32-bit lane. Without kQuietNaN
// v must hold no NaN (the test is then skipped).
template <bool kQuietNaN>
HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> RoundedBF16(VF v) {
  const hn::RebindToUnsigned<DF> du32;
  const auto u = hn::BitCast(du32, v);
  const auto r = hn::Add(
      u, hn::Add(hn::And(hn::ShiftRight<16>(u), hn::Set(du32, 1u)), hn::Set(du32, 0x7fffu)));
  if constexpr (kQuietNaN)
    return hn::IfThenElse(hn::RebindMask(du32, hn::IsNaN(v)), hn::Or(u, hn::Set(du32, 0x00400000u)),
                          r);
  return r;
}
#endif

// Two vectors, v0 at element i and v1 after it, as StoreF32 twice. On AVX2 and AVX-512 bf16 rows
// are rounded as 32-bit lanes (the bf16 in each lane's upper half: u + 0x7fff + lsb, or u with the
// quiet bit 22 set for NaN, the same bits as StoreF32) and the two upper halves are gathered into
// one full vector: one store of a whole vector (a whole line on AVX-512, non-temporal or not)
// instead of two of half a vector, fewer shuffles, and NaN found by one unordered compare. On
// AVX2 (16 registers, no native bf16) this is about a third fewer instructions per element.
template <DType kT>
HWY_INLINE void StoreF32Pair(DF df, VF v0, VF v1, void* row, int64_t i, bool stream = false) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  if constexpr (kT == DType::kBF16) {
    const hn::Repartition<uint16_t, DF> du16;
    auto upper = [&](VF v) { return hn::BitCast(du16, RoundedBF16<true>(v)); };
    Put(hn::ConcatOdd(du16, upper(v1), upper(v0)), du16, static_cast<uint16_t*>(row) + i, stream);
    return;
  }
#endif
  StoreF32<kT>(df, v0, row, i, stream);
  StoreF32<kT>(df, v1, row, i + static_cast<int64_t>(hn::Lanes(df)), stream);
}

// A partial last vector goes through a vector-sized stack buffer, so no access passes the row's
// end. Tail<kT> holds `count` < Lanes elements of dtype kT padded with zeros.
template <DType kT>
struct Tail {
  HWY_ALIGN float buf[hn::MaxLanes(DF())];  // large enough for any dtype's Lanes elements
  size_t bytes;
  Tail(const void* row, int64_t i, size_t count) : bytes(count * dtype_size(kT)) {
    std::memset(buf, 0, sizeof(buf));
    std::memcpy(buf, static_cast<const char*>(row) + i * static_cast<int64_t>(dtype_size(kT)),
                bytes);
  }
  VF load(DF df) const { return LoadF32<kT>(df, buf, 0); }
};

template <DType kT>
HWY_INLINE void StoreTail(DF df, VF v, void* row, int64_t i, size_t count) {
  HWY_ALIGN float buf[hn::MaxLanes(df)];
  StoreF32<kT>(df, v, buf, 0);
  std::memcpy(static_cast<char*>(row) + i * static_cast<int64_t>(dtype_size(kT)), buf,
              count * dtype_size(kT));
}

// f(std::integral_constant<DType, d>{}) for a run-time float dtype d (bf16, fp16; anything else
// as fp32): a row's dtype as the template argument of a kernel, one switch for all of them.
template <class F>
HWY_INLINE decltype(auto) WithFloatDType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBF16:
      return f(std::integral_constant<DType, DType::kBF16>{});
    case DType::kF16:
      return f(std::integral_constant<DType, DType::kF16>{});
    default:
      return f(std::integral_constant<DType, DType::kF32>{});
  }
}

// LoadF32 and Tail for a row whose dtype is known only at run time (one predictable branch per
// vector), for a kernel that reads such a row beside rows of a template dtype.
HWY_INLINE VF LoadF32As(DF df, DType dtype, const void* row, int64_t i) {
  return WithFloatDType(dtype, [&](auto t) { return LoadF32<decltype(t)::value>(df, row, i); });
}
HWY_INLINE VF TailF32As(DF df, DType dtype, const void* row, int64_t i, size_t count) {
  return WithFloatDType(dtype,
                        [&](auto t) { return Tail<decltype(t)::value>(row, i, count).load(df); });
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace moe_ep::detail
HWY_AFTER_NAMESPACE();

#endif  // MOE_EP_KERNELS_CPU_ROWS_INL_H_
