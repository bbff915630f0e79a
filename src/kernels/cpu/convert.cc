// Row kernels of convert.h with Highway: compiled once per x86 target (SSSE3, SSE4, AVX2,
// AVX-512, AVX-512 with the DL extensions, and the portable fallback) and dispatched at run time
// to the best one the CPU supports.
//
// Every kernel vectorises across the element dimension only, so each element sees exactly the
// operations the scalar definition gives it, in the same order: an fp32 product is rounded
// before it is added (Mul then Add, never MulAdd; -ffp-contract=off keeps the compiler from
// fusing them), sums run in the row (k) order, and one rounding to nearest even ends them. The
// bits are therefore those of the scalar code and of ref/, on every target. The one sum along the
// elements, grad_probs' dot product, has an order made for vectors (16 partial sums, one per
// lane, then a fixed tree: convert.h), the same on every target, the 16 lanes being one, two or
// four vectors (16 scalars in the fallback).
//
// bf16 rounding uses integer operations, not Highway's DemoteTo (which truncates) nor AVX-512
// BF16's vcvtneps2bf16 (which flushes subnormals): round to nearest even, NaN made quiet by
// setting bit 6 of the bf16, exactly as f32_to_bf16. fp16 uses F16C (vcvtps2ph with round to
// nearest even, vcvtph2ps) on AVX2 and newer, where it agrees bitwise with the scalar
// _Float16 conversions (tests/unit/test_simd.cc checks every fp16 and a dense sample of fp32);
// older targets convert fp16 element by element with the scalar functions.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/convert.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// (after foreach_target.h, which re-includes this file once per target)
#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/rows-inl.h"

HWY_BEFORE_NAMESPACE();
namespace moe_ep::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// dst[i] = f(fp32(src[i]), old) elementwise, from a row of dtype kIn to a row of dtype kOut; old
// is the current fp32 value of dst[i] when kReadDst (read-modify-write rows), else unused.
template <DType kIn, DType kOut, bool kReadDst = false, class F>
HWY_INLINE void Map(const void* src, void* dst, int64_t n, F f, bool stream = false) {
  const DF df;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const VF old = kReadDst ? LoadF32<kOut>(df, dst, i) : hn::Zero(df);
    StoreF32<kOut>(df, f(LoadF32<kIn>(df, src, i), old), dst, i, stream);
  }
  if (i < n) {
    const size_t rest = static_cast<size_t>(n - i);
    const VF old = kReadDst ? Tail<kOut>(dst, i, rest).load(df) : hn::Zero(df);
    StoreTail<kOut>(df, f(Tail<kIn>(src, i, rest).load(df), old), dst, i, rest);
  }
}

template <DType kT>
void LoadRowT(float* dst, const void* src, int64_t n) {
  Map<kT, DType::kF32>(src, dst, n, [](VF v, VF) { return v; });
}
template <DType kT>
void StoreRowT(void* dst, const float* src, int64_t n) {
  Map<DType::kF32, kT>(src, dst, n, [](VF v, VF) { return v; });
}
template <DType kT>
void ScaleRowT(void* dst, const float* src, float w, int64_t n, bool stream) {
  const VF vw = hn::Set(DF(), w);
  Map<DType::kF32, kT>(
      src, dst, n, [vw](VF v, VF) { return hn::Mul(v, vw); }, stream);
}
template <DType kT>
void AxpyRowT(float* acc, float w, const void* src, int64_t n) {
  const VF vw = hn::Set(DF(), w);
  Map<kT, DType::kF32, true>(src, acc, n, [vw](VF x, VF a) {
    const VF p = hn::Mul(vw, x);  // rounded to fp32 before the add
    return hn::Add(a, p);
  });
}
template <DType kT>
void AddRowT(float* acc, const void* src, int64_t n) {
  Map<kT, DType::kF32, true>(src, acc, n, [](VF x, VF a) { return hn::Add(a, x); });
}

// Prefetches bytes [offset, offset + bytes) of each of the count rows (the same block of the
// next call's rows that this call is about to read of its own).
HWY_INLINE void PrefetchBlock(const void* const* rows, int64_t count, int64_t offset,
                              int64_t bytes) {
  for (int64_t r = 0; r < count; ++r)
    for (int64_t b = 0; b < bytes; b += 64)
      hwy::Prefetch(static_cast<const char*>(rows[r]) + offset + b);
}

#if HWY_TARGET != HWY_SCALAR
// bf16 as fp32 without widening: a vector of 2 * Lanes bf16 (elements c .. c + 2 Lanes - 1)
// holds element c + 2j in the lower and c + 2j + 1 in the upper half of 32-bit lane j, so a shift
// gives the even elements (c, c + 2, ..) as fp32 and a mask the odd ones, and one blend puts two
// rounded vectors back in element order.
using DU32 = hn::RebindToUnsigned<DF>;
using DU16 = hn::Repartition<uint16_t, DF>;
using VU32 = hn::Vec<DU32>;
using VU16 = hn::Vec<DU16>;
HWY_INLINE VF EvenF32(VU16 v) {
  return hn::BitCast(DF(), hn::ShiftLeft<16>(hn::BitCast(DU32(), v)));
}
HWY_INLINE VF OddF32(VU16 v) {
  return hn::BitCast(DF(), hn::And(hn::BitCast(DU32(), v), hn::Set(DU32(), 0xffff0000u)));
}
HWY_INLINE VU16 PackBF16(VU32 even, VU32 odd) {
  const DU16 du16;
  return hn::OddEven(hn::BitCast(du16, odd), hn::BitCast(du16, hn::ShiftRight<16>(even)));
}

#endif  // HWY_TARGET != HWY_SCALAR

// The terms of SumRowsT: w[r] * x (x itself unweighted), the first one starting the sum (after
// +0 with kFromZero).
template <bool kWeighted, bool kFromZero>
struct SumTerms {
  const float* w;
  HWY_INLINE VF term(VF x, int64_t r) const {
    if constexpr (kWeighted) return hn::Mul(hn::Set(DF(), w[r]), x);
    return x;
  }
  HWY_INLINE VF first(VF x) const {
    if constexpr (kFromZero) return hn::Add(hn::Zero(DF()), term(x, 0));
    return term(x, 0);
  }
};

#if HWY_TARGET != HWY_SCALAR
// SumRowsT's bf16 -> bf16 blocks (2 vectors of bf16, 4 of fp32); returns the first element not
// done. The sums may hold NaN (Inf - Inf) even of finite rows.
template <bool kWeighted, bool kFromZero>
HWY_INLINE int64_t SumBF16EvenOdd(uint16_t* dst, const void* const* rows,
                                  SumTerms<kWeighted, kFromZero> t, int64_t count, int64_t n,
                                  bool stream, const void* const* ahead, int64_t ahead_count) {
  const DU16 du16;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(du16));
  auto row = [&](int64_t r) { return static_cast<const uint16_t*>(rows[r]); };
  int64_t i = 0;
  for (; i + 2 * lanes <= n; i += 2 * lanes) {
    PrefetchBlock(ahead, ahead_count, i * 2, 2 * lanes * 2);
    VU16 v0 = hn::LoadU(du16, row(0) + i), v1 = hn::LoadU(du16, row(0) + i + lanes);
    VF e0 = t.first(EvenF32(v0)), o0 = t.first(OddF32(v0));
    VF e1 = t.first(EvenF32(v1)), o1 = t.first(OddF32(v1));
    for (int64_t r = 1; r < count; ++r) {
      v0 = hn::LoadU(du16, row(r) + i);
      v1 = hn::LoadU(du16, row(r) + i + lanes);
      e0 = hn::Add(e0, t.term(EvenF32(v0), r));
      o0 = hn::Add(o0, t.term(OddF32(v0), r));
      e1 = hn::Add(e1, t.term(EvenF32(v1), r));
      o1 = hn::Add(o1, t.term(OddF32(v1), r));
    }
    Put(PackBF16(RoundedBF16<true>(e0), RoundedBF16<true>(o0)), du16, dst + i, stream);
    Put(PackBF16(RoundedBF16<true>(e1), RoundedBF16<true>(o1)), du16, dst + i + lanes, stream);
  }
  return i;
}
#endif  // HWY_TARGET != HWY_SCALAR

// dst = round(sum over r (in r order) of w[r] * fp32(rows[r])), the first term starting the sum
// (kFromZero: +0 starts it, each term then added). Columns are processed kBlock vectors at a time
// with the accumulators in registers, so each source row is read once and nothing but the output
// is written.
template <DType kIn, DType kOut, bool kWeighted, bool kFromZero>
void SumRowsT(void* dst, const void* const* rows, const float* w, int64_t count, int64_t n,
              bool stream, const void* const* ahead, int64_t ahead_count) {
  const DF df;
  constexpr int64_t kBlock = 4;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  const int64_t esize = static_cast<int64_t>(dtype_size(kIn));
  const SumTerms<kWeighted, kFromZero> t{w};
  int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  // bf16 -> bf16 leaves fewer than 2 bf16 vectors (4 fp32 vectors) to the loops below, so their
  // block loop never runs for it.
  if constexpr (kIn == DType::kBF16 && kOut == DType::kBF16)
    i = SumBF16EvenOdd<kWeighted, kFromZero>(static_cast<uint16_t*>(dst), rows, t, count, n, stream,
                                             ahead, ahead_count);
#endif
  for (; i + kBlock * lanes <= n; i += kBlock * lanes) {
    PrefetchBlock(ahead, ahead_count, i * esize, kBlock * lanes * esize);
    VF a0 = t.first(LoadF32<kIn>(df, rows[0], i));
    VF a1 = t.first(LoadF32<kIn>(df, rows[0], i + lanes));
    VF a2 = t.first(LoadF32<kIn>(df, rows[0], i + 2 * lanes));
    VF a3 = t.first(LoadF32<kIn>(df, rows[0], i + 3 * lanes));
    for (int64_t r = 1; r < count; ++r) {
      a0 = hn::Add(a0, t.term(LoadF32<kIn>(df, rows[r], i), r));
      a1 = hn::Add(a1, t.term(LoadF32<kIn>(df, rows[r], i + lanes), r));
      a2 = hn::Add(a2, t.term(LoadF32<kIn>(df, rows[r], i + 2 * lanes), r));
      a3 = hn::Add(a3, t.term(LoadF32<kIn>(df, rows[r], i + 3 * lanes), r));
    }
    StoreF32Pair<kOut>(df, a0, a1, dst, i, stream);
    StoreF32Pair<kOut>(df, a2, a3, dst, i + 2 * lanes, stream);
  }
  for (; i + lanes <= n; i += lanes) {
    VF a = t.first(LoadF32<kIn>(df, rows[0], i));
    for (int64_t r = 1; r < count; ++r) a = hn::Add(a, t.term(LoadF32<kIn>(df, rows[r], i), r));
    StoreF32<kOut>(df, a, dst, i, stream);
  }
  if (i < n) {
    const size_t rest = static_cast<size_t>(n - i);
    VF a = t.first(Tail<kIn>(rows[0], i, rest).load(df));
    for (int64_t r = 1; r < count; ++r)
      a = hn::Add(a, t.term(Tail<kIn>(rows[r], i, rest).load(df), r));
    StoreTail<kOut>(df, a, dst, i, rest);
  }
}

// grad_probs' dot products in the blocked order of convert.h (dot_row_f32): lane l of the
// kDotLanes partial sums is lane l % Lanes of vector l / Lanes, so each lane is one chain of adds
// along the row and the vectors of a group of kDotLanes elements go to kDotLanes / Lanes
// independent chains. kRows rows share g and are walked side by side, kDotBlock elements of each
// in turn: several rows in flight keep more memory requests outstanding than one. g is read in
// its own dtype, one block at a time into registers, by the same pass: its reads overlap those of
// the rows of x (a separate conversion of g first would be a single stream the core waits for).
constexpr size_t kDotLanes = 16;
constexpr int64_t kDotBlock = 4 * kDotLanes;  // 128 bytes of a bf16 row
// 8 rows' accumulators fit AVX-512's 32 registers; 4 on narrower targets (16 registers).
constexpr int kMaxDotRows = HWY_TARGET <= HWY_AVX3 ? 8 : 4;

#if HWY_TARGET != HWY_SCALAR
// True when none of the n bf16 values is Inf or NaN (exponent field all ones).
bool AllFiniteBF16(const void* row, int64_t n) {
  const DU16 du16;
  const auto* p = static_cast<const uint16_t*>(row);
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(du16));
  const VU16 exponent = hn::Set(du16, uint16_t{0x7f80});
  VU16 found = hn::Zero(du16);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes)
    found = hn::Or(
        found, hn::VecFromMask(du16, hn::Eq(hn::And(hn::LoadU(du16, p + i), exponent), exponent)));
  bool finite = hn::AllFalse(du16, hn::MaskFromVec(found));
  for (; i < n && finite; ++i) finite = (p[i] & 0x7f80u) != 0x7f80u;
  return finite;
}

// DotT's blocks where a group of kDotLanes bf16 elements is one vector (8 fp32 lanes: AVX2), g
// and x both bf16: lane l of the 16 is lane l / 2 of the even (l even) or odd accumulator, fed the
// same products in the same order, and moves to acc[r] (lanes 0..7, 8..15) at the end. Returns
// the first element not done (a multiple of kDotBlock).
template <int kRows>
HWY_INLINE int64_t DotBF16EvenOdd(VF (&acc)[kRows][2], const void* g, const void* const* x,
                                  int64_t n, const void* const* ahead, int64_t ahead_count) {
  const DF df;
  const DU16 du16;
  constexpr int64_t kStep = static_cast<int64_t>(kDotLanes);
  VF acc_even[kRows], acc_odd[kRows];
  for (int r = 0; r < kRows; ++r) acc_even[r] = acc_odd[r] = hn::Zero(df);  // +0
  const auto* gp = static_cast<const uint16_t*>(g);
  int64_t i = 0;
  for (; i + kDotBlock <= n; i += kDotBlock) {
    PrefetchBlock(ahead, ahead_count, i * 2, kDotBlock * 2);
#pragma GCC unroll 4
    for (int64_t at = i; at < i + kDotBlock; at += kStep) {
      const VU16 gv = hn::LoadU(du16, gp + at);
      const VF ge = EvenF32(gv), go = OddF32(gv);
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const VU16 xv = hn::LoadU(du16, static_cast<const uint16_t*>(x[r]) + at);
        acc_even[r] = hn::Add(acc_even[r], hn::Mul(ge, EvenF32(xv)));  // the product rounded first
        acc_odd[r] = hn::Add(acc_odd[r], hn::Mul(go, OddF32(xv)));
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    HWY_ALIGN float e[kDotLanes / 2], o[kDotLanes / 2], lanes[kDotLanes];
    hn::Store(acc_even[r], df, e);
    hn::Store(acc_odd[r], df, o);
    for (size_t l = 0; l < kDotLanes / 2; ++l) {
      lanes[2 * l] = e[l];
      lanes[2 * l + 1] = o[l];
    }
    acc[r][0] = hn::Load(df, lanes);
    acc[r][1] = hn::Load(df, lanes + kDotLanes / 2);
  }
  return i;
}

// ScaleRowFromT's bf16 -> bf16 body, two vectors of bf16 at a time (a 64-byte line on AVX2);
// returns the first element not done.
template <bool kQuietNaN>
HWY_INLINE int64_t ScaleBF16EvenOdd(uint16_t* dst, const uint16_t* g, float w, int64_t n,
                                    bool stream) {
  const DU16 du16;
  const VF vw = hn::Set(DF(), w);
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(du16));
  int64_t i = 0;
  for (; i + 2 * lanes <= n; i += 2 * lanes)
    for (int64_t at = i; at < i + 2 * lanes; at += lanes) {
      const VU16 gv = hn::LoadU(du16, g + at);
      Put(PackBF16(RoundedBF16<kQuietNaN>(hn::Mul(EvenF32(gv), vw)),
                   RoundedBF16<kQuietNaN>(hn::Mul(OddF32(gv), vw))),
          du16, dst + at, stream);
    }
  return i;
}
#endif  // HWY_TARGET != HWY_SCALAR

// out[r] = dot_row_f32(fp32(g), x[r]) for kRows rows of dtype kX side by side (g of g_dtype).
template <DType kX, int kRows>
void DotT(float* out, const void* g, DType g_dtype, const void* const* x, int64_t n,
          const void* const* ahead, int64_t ahead_count) {
  const DF df;
  constexpr size_t kLanes = hn::MaxLanes(DF());
  static_assert(kDotLanes % kLanes == 0, "dot_row_f32's 16 lanes must fill whole vectors");
  constexpr size_t kVecs = kDotLanes / kLanes;
  constexpr int64_t lanes = static_cast<int64_t>(kLanes);
  constexpr size_t kBlockVecs = static_cast<size_t>(kDotBlock) / kLanes;
  VF acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (size_t v = 0; v < kVecs; ++v) acc[r][v] = hn::Zero(df);  // +0
  // Element i + c (i a multiple of 16) belongs to lane (i + c) % 16, held by vector
  // (c / Lanes) % kVecs, and reaches it after the elements of that lane before it.
  int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kLanes * 2 == kDotLanes && kX == DType::kBF16) {
    if (g_dtype == DType::kBF16) i = DotBF16EvenOdd<kRows>(acc, g, x, n, ahead, ahead_count);
  }
#endif
  const int64_t xsize = static_cast<int64_t>(dtype_size(kX));
  for (; i + kDotBlock <= n; i += kDotBlock) {
    PrefetchBlock(ahead, ahead_count, i * xsize, kDotBlock * xsize);
    VF gv[kBlockVecs];
    for (size_t v = 0; v < kBlockVecs; ++v) {
      gv[v] = LoadF32As(df, g_dtype, g, i + static_cast<int64_t>(v) * lanes);
    }
    // Unrolled, so that the accumulators stay in registers on AVX-512 (indexed by a loop counter
    // they would live on the stack; narrower targets have too few registers for them anyway).
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 16
      for (size_t v = 0; v < kBlockVecs; ++v) {
        VF& a = acc[r][v % kVecs];
        a = hn::Add(a, hn::Mul(gv[v], LoadF32<kX>(df, x[r], i + static_cast<int64_t>(v) * lanes)));
      }
  }
  for (; i + static_cast<int64_t>(kDotLanes) <= n; i += kDotLanes)
    for (size_t v = 0; v < kVecs; ++v) {
      const int64_t at = i + static_cast<int64_t>(v) * lanes;
      const VF gv = LoadF32As(df, g_dtype, g, at);
      for (int r = 0; r < kRows; ++r)
        acc[r][v] = hn::Add(acc[r][v], hn::Mul(gv, LoadF32<kX>(df, x[r], at)));
    }
  // The last n - i < 16 elements. A partial vector is padded with zeros, whose products (+0)
  // leave every lane unchanged: a lane starts at +0 and a sum rounded to nearest is -0 only when
  // both addends are -0, so no lane ever holds -0, and x + (+0) == x for every other x, NaN
  // included. The missing elements are thus absent from their lanes, as the order says.
  for (size_t v = 0; v < kVecs; ++v) {
    const int64_t at = i + static_cast<int64_t>(v) * lanes;
    if (at >= n) break;
    const size_t rest = static_cast<size_t>(std::min<int64_t>(lanes, n - at));
    const VF gv =
        rest == kLanes ? LoadF32As(df, g_dtype, g, at) : TailF32As(df, g_dtype, g, at, rest);
    for (int r = 0; r < kRows; ++r) {
      const VF xv = rest == kLanes ? LoadF32<kX>(df, x[r], at) : Tail<kX>(x[r], at, rest).load(df);
      acc[r][v] = hn::Add(acc[r][v], hn::Mul(gv, xv));
    }
  }
  for (int r = 0; r < kRows; ++r) {
    HWY_ALIGN float part[kDotLanes];
    for (size_t v = 0; v < kVecs; ++v) hn::Store(acc[r][v], df, part + v * kLanes);
    for (size_t width = kDotLanes / 2; width >= 1; width /= 2)  // the fixed tree: 8, 4, 2, 1
      for (size_t l = 0; l < width; ++l) part[l] = part[l] + part[l + width];
    out[r] = part[0];
  }
}

// dst = round(fp32(g) * w) in kOut (scale_row_f32's bits), g a row of kG. no_nan: g holds no Inf
// or NaN and w is finite, so no product is NaN.
template <DType kG, DType kOut>
void ScaleRowFromT(void* dst, const void* g, float w, int64_t n, bool stream,
                   [[maybe_unused]] bool no_nan) {
  int64_t i = 0;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (kG == DType::kBF16 && kOut == DType::kBF16) {
    auto* d = static_cast<uint16_t*>(dst);
    const auto* s = static_cast<const uint16_t*>(g);
    i = no_nan ? ScaleBF16EvenOdd<false>(d, s, w, n, stream)
               : ScaleBF16EvenOdd<true>(d, s, w, n, stream);
  }
#endif
  if (i == n) return;
  const VF vw = hn::Set(DF(), w);
  Map<kG, kOut>(
      static_cast<const char*>(g) + i * static_cast<int64_t>(dtype_size(kG)),
      static_cast<char*>(dst) + i * static_cast<int64_t>(dtype_size(kOut)), n - i,
      [vw](VF v, VF) { return hn::Mul(v, vw); }, stream);
}

// The entries of a token in two passes: first the dot products, kMaxDotRows rows of x side by
// side (reads only), then each scaled row of dst in turn (writes only, from g, which the first
// pass left in the cache). On a Zen 3 VM one pass reading the rows of x while writing those of
// dst side by side took 1.5-1.7 times as long as these two, in a test of the access pattern alone
// (docs/performance.md): the reads and the non-temporal writes to many rows at once contend.
template <DType kX, DType kOut, bool kScale>
void ScaleDotRowsT(float* out, void* const* dst, const void* g, DType g_dtype, const float* w,
                   const void* const* x, int64_t count, int64_t n, bool stream,
                   const void* const* ahead, int64_t ahead_count) {
  for (int64_t r = 0; r < count; r += kMaxDotRows) {
    // Group r.. prefetches the next call's rows r.. (the last group all that remain).
    const int64_t more = r + kMaxDotRows >= count ? ahead_count : kMaxDotRows;
    const int64_t ahead_here = std::clamp<int64_t>(ahead_count - r, 0, more);
    WithRowCount<kMaxDotRows>(std::min<int64_t>(count - r, kMaxDotRows), [&](auto rows) {
      DotT<kX, decltype(rows)::value>(out + r, g, g_dtype, x + r, n,
                                      ahead_here > 0 ? ahead + r : nullptr, ahead_here);
    });
  }
  if constexpr (kScale) {
    bool g_finite = false;
#if HWY_TARGET != HWY_SCALAR
    if constexpr (kOut == DType::kBF16)  // only the bf16 -> bf16 rows use it
      g_finite = g_dtype == DType::kBF16 && AllFiniteBF16(g, n);
#endif
    for (int64_t r = 0; r < count; ++r)
      WithFloatDType(g_dtype, [&](auto t) {
        ScaleRowFromT<decltype(t)::value, kOut>(dst[r], g, w[r], n, stream,
                                                g_finite && std::isfinite(w[r]));
      });
  }
}

// Run-time dtype -> compile-time dtype.
template <template <DType> class F, typename... Args>
HWY_INLINE void ByDType(DType dtype, Args... args) {
  switch (dtype) {
    case DType::kBF16:
      return F<DType::kBF16>::run(args...);
    case DType::kF16:
      return F<DType::kF16>::run(args...);
    default:
      return F<DType::kF32>::run(args...);
  }
}

template <DType kT>
struct LoadRowF {
  static void run(float* dst, const void* src, int64_t n) { LoadRowT<kT>(dst, src, n); }
};
template <DType kT>
struct StoreRowF {
  static void run(void* dst, const float* src, int64_t n) { StoreRowT<kT>(dst, src, n); }
};
template <DType kT>
struct ScaleRowF {
  static void run(void* dst, const float* src, float w, int64_t n, bool stream) {
    ScaleRowT<kT>(dst, src, w, n, stream);
  }
};
template <DType kT>
struct AxpyRowF {
  static void run(float* acc, float w, const void* src, int64_t n) { AxpyRowT<kT>(acc, w, src, n); }
};
template <DType kT>
struct AddRowF {
  static void run(float* acc, const void* src, int64_t n) { AddRowT<kT>(acc, src, n); }
};
template <DType kX>
struct ScaleDotF {
  template <DType kOut>
  struct To {
    static void run(float* out, void* const* dst, const void* g, DType g_dtype, const float* w,
                    const void* const* x, int64_t count, int64_t n, bool stream,
                    const void* const* ahead, int64_t ahead_count) {
      if (dst != nullptr) {
        ScaleDotRowsT<kX, kOut, true>(out, dst, g, g_dtype, w, x, count, n, stream, ahead,
                                      ahead_count);
      } else {
        ScaleDotRowsT<kX, kOut, false>(out, dst, g, g_dtype, w, x, count, n, stream, ahead,
                                       ahead_count);
      }
    }
  };
};
template <DType kIn>
struct SumRowsF {
  template <DType kOut>
  struct To {
    static void run(void* dst, const void* const* rows, const float* w, int64_t count, int64_t n,
                    bool stream, bool from_zero, const void* const* ahead, int64_t ahead_count) {
      if (w != nullptr && from_zero) {
        SumRowsT<kIn, kOut, true, true>(dst, rows, w, count, n, stream, ahead, ahead_count);
      } else if (w != nullptr) {
        SumRowsT<kIn, kOut, true, false>(dst, rows, w, count, n, stream, ahead, ahead_count);
      } else if (from_zero) {
        SumRowsT<kIn, kOut, false, true>(dst, rows, w, count, n, stream, ahead, ahead_count);
      } else {
        SumRowsT<kIn, kOut, false, false>(dst, rows, w, count, n, stream, ahead, ahead_count);
      }
    }
  };
};

void LoadRow(float* dst, const void* src, DType dtype, int64_t n) {
  ByDType<LoadRowF>(dtype, dst, src, n);
}
void StoreRow(void* dst, DType dtype, const float* src, int64_t n) {
  ByDType<StoreRowF>(dtype, dst, src, n);
}
void ScaleRow(void* dst, DType dtype, const float* src, float w, int64_t n, bool stream) {
  ByDType<ScaleRowF>(dtype, dst, src, w, n, stream);
  if (stream) hwy::FlushStream();
}
// One source row to count destinations, 4 vectors at a time: each block is loaded once and
// stored to every destination, so the destinations are written side by side.
void CopyRowTo(void* const* dst, int64_t count, const void* src, size_t bytes, bool stream) {
  const hn::ScalableTag<uint8_t> d8;
  const size_t lanes = hn::Lanes(d8);
  const auto* in = static_cast<const uint8_t*>(src);
  size_t i = 0;
  for (; i + 4 * lanes <= bytes; i += 4 * lanes) {
    const auto v0 = hn::LoadU(d8, in + i), v1 = hn::LoadU(d8, in + i + lanes);
    const auto v2 = hn::LoadU(d8, in + i + 2 * lanes), v3 = hn::LoadU(d8, in + i + 3 * lanes);
    for (int64_t r = 0; r < count; ++r) {
      auto* out = static_cast<uint8_t*>(dst[r]) + i;
      Put(v0, d8, out, stream);
      Put(v1, d8, out + lanes, stream);
      Put(v2, d8, out + 2 * lanes, stream);
      Put(v3, d8, out + 3 * lanes, stream);
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    auto* out = static_cast<uint8_t*>(dst[r]);
    size_t j = i;
    for (; j + lanes <= bytes; j += lanes) Put(hn::LoadU(d8, in + j), d8, out + j, stream);
    if (j < bytes) std::memcpy(out + j, in + j, bytes - j);
  }
  if (stream) hwy::FlushStream();
}
void AxpyRow(float* acc, float w, const void* src, DType dtype, int64_t n) {
  ByDType<AxpyRowF>(dtype, acc, w, src, n);
}
void AddRow(float* acc, const void* src, DType dtype, int64_t n) {
  ByDType<AddRowF>(dtype, acc, src, n);
}
// dst == null: dot products only (dst_dtype and w unused).
void ScaleDot(float* out, void* const* dst, DType dst_dtype, const void* g, DType g_dtype,
              const float* w, const void* const* x, DType x_dtype, int64_t count, int64_t n,
              bool stream, const void* const* ahead, int64_t ahead_count) {
  switch (x_dtype) {
    case DType::kBF16:
      ByDType<ScaleDotF<DType::kBF16>::To>(dst_dtype, out, dst, g, g_dtype, w, x, count, n, stream,
                                           ahead, ahead_count);
      break;
    case DType::kF16:
      ByDType<ScaleDotF<DType::kF16>::To>(dst_dtype, out, dst, g, g_dtype, w, x, count, n, stream,
                                          ahead, ahead_count);
      break;
    default:
      ByDType<ScaleDotF<DType::kF32>::To>(dst_dtype, out, dst, g, g_dtype, w, x, count, n, stream,
                                          ahead, ahead_count);
      break;
  }
  if (stream) hwy::FlushStream();
}
void SumRows(void* dst, DType dst_dtype, const void* const* rows, const float* w, int64_t count,
             DType src_dtype, int64_t n, bool stream, bool from_zero, const void* const* ahead,
             int64_t ahead_count) {
  switch (src_dtype) {
    case DType::kBF16:
      ByDType<SumRowsF<DType::kBF16>::To>(dst_dtype, dst, rows, w, count, n, stream, from_zero,
                                          ahead, ahead_count);
      break;
    case DType::kF16:
      ByDType<SumRowsF<DType::kF16>::To>(dst_dtype, dst, rows, w, count, n, stream, from_zero,
                                         ahead, ahead_count);
      break;
    default:
      ByDType<SumRowsF<DType::kF32>::To>(dst_dtype, dst, rows, w, count, n, stream, from_zero,
                                         ahead, ahead_count);
      break;
  }
  if (stream) hwy::FlushStream();
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace moe_ep::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace moe_ep::detail {

HWY_EXPORT(LoadRow);
HWY_EXPORT(StoreRow);
HWY_EXPORT(ScaleRow);
HWY_EXPORT(AxpyRow);
HWY_EXPORT(AddRow);
HWY_EXPORT(ScaleDot);
HWY_EXPORT(SumRows);
HWY_EXPORT(CopyRowTo);

namespace {
bool can_stream(const void* dst, bool stream) { return stream && stream_aligned(dst); }
}  // namespace

void load_row_f32(float* dst, const void* src, DType dtype, int64_t n) {
  HWY_DYNAMIC_DISPATCH(LoadRow)(dst, src, dtype, n);
}
void store_row_f32(void* dst, DType dtype, const float* src, int64_t n) {
  HWY_DYNAMIC_DISPATCH(StoreRow)(dst, dtype, src, n);
}
void scale_row_f32(void* dst, DType dtype, const float* src, float w, int64_t n, bool stream) {
  HWY_DYNAMIC_DISPATCH(ScaleRow)(dst, dtype, src, w, n, can_stream(dst, stream));
}
void copy_row(void* dst, const void* src, std::size_t bytes, bool stream) {
  HWY_DYNAMIC_DISPATCH(CopyRowTo)(&dst, 1, src, bytes, can_stream(dst, stream));
}
void copy_row_to(void* const* dst, int64_t count, const void* src, std::size_t bytes, bool stream) {
  for (int64_t r = 0; r < count && stream; ++r) stream = can_stream(dst[r], stream);
  HWY_DYNAMIC_DISPATCH(CopyRowTo)(dst, count, src, bytes, stream);
}
void axpy_row_f32(float* acc, float w, const void* src, DType dtype, int64_t n) {
  HWY_DYNAMIC_DISPATCH(AxpyRow)(acc, w, src, dtype, n);
}
void add_row_f32(float* acc, const void* src, DType dtype, int64_t n) {
  HWY_DYNAMIC_DISPATCH(AddRow)(acc, src, dtype, n);
}
float dot_row_f32(const float* g, const void* x, DType dtype, int64_t n) {
  float out;
  HWY_DYNAMIC_DISPATCH(ScaleDot)
  (&out, nullptr, DType::kF32, g, DType::kF32, nullptr, &x, dtype, 1, n, false, nullptr, 0);
  return out;
}
void scale_dot_rows_f32(float* out, void* const* dst, DType dst_dtype, const void* g, DType g_dtype,
                        const float* w, const void* const* x, DType x_dtype, int64_t count,
                        int64_t n, bool stream, const void* const* ahead, int64_t ahead_count) {
  for (int64_t r = 0; r < count && stream; ++r) stream = can_stream(dst[r], stream);
  HWY_DYNAMIC_DISPATCH(ScaleDot)
  (out, dst, dst_dtype, g, g_dtype, w, x, x_dtype, count, n, stream, ahead, ahead_count);
}
void sum_rows(void* dst, DType dst_dtype, const void* const* rows, const float* weights,
              int64_t count, DType src_dtype, int64_t n, bool stream, bool from_zero,
              const void* const* ahead, int64_t ahead_count) {
  if (count == 0) {
    std::memset(dst, 0, static_cast<std::size_t>(n) * dtype_size(dst_dtype));
    return;
  }
  HWY_DYNAMIC_DISPATCH(SumRows)
  (dst, dst_dtype, rows, weights, count, src_dtype, n, can_stream(dst, stream), from_zero, ahead,
   ahead_count);
}

}  // namespace moe_ep::detail
#endif  // HWY_ONCE
