// Row kernels of convert.h with Highway: compiled once per x86 target (SSSE3, SSE4, AVX2,
// AVX-512, AVX-512 with the DL extensions, and the portable fallback) and dispatched at run time
// to the best one the CPU supports.
//
// Every kernel vectorises across the element dimension only, so each element sees exactly the
// operations the scalar definition gives it, in the same order: an fp32 product is rounded
// before it is added (Mul then Add, never MulAdd; -ffp-contract=off keeps the compiler from
// fusing them), sums run in the row (k) order, and one rounding to nearest even ends them. The
// bits are therefore those of the scalar code and of ref/, on every target. dot_rows is the
// exception that proves the rule: its sum runs along the elements, so only its products are
// vectorised and the sums stay sequential (up to 16 rows at once, one lane each: DotQuads).
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

// dst = round(sum over r (in r order) of w[r] * fp32(rows[r])), the first term starting the sum.
// Columns are processed kBlock vectors at a time with the accumulators in registers, so each
// source row is read once and nothing but the output is written.
template <DType kIn, DType kOut, bool kWeighted>
void SumRowsT(void* dst, const void* const* rows, const float* w, int64_t count, int64_t n,
              bool stream) {
  const DF df;
  constexpr int64_t kBlock = 4;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  auto term = [&](const VF& x, int64_t r) {
    if constexpr (kWeighted) return hn::Mul(hn::Set(df, w[r]), x);
    return x;
  };
  int64_t i = 0;
  for (; i + kBlock * lanes <= n; i += kBlock * lanes) {
    VF a0 = term(LoadF32<kIn>(df, rows[0], i), 0);
    VF a1 = term(LoadF32<kIn>(df, rows[0], i + lanes), 0);
    VF a2 = term(LoadF32<kIn>(df, rows[0], i + 2 * lanes), 0);
    VF a3 = term(LoadF32<kIn>(df, rows[0], i + 3 * lanes), 0);
    for (int64_t r = 1; r < count; ++r) {
      a0 = hn::Add(a0, term(LoadF32<kIn>(df, rows[r], i), r));
      a1 = hn::Add(a1, term(LoadF32<kIn>(df, rows[r], i + lanes), r));
      a2 = hn::Add(a2, term(LoadF32<kIn>(df, rows[r], i + 2 * lanes), r));
      a3 = hn::Add(a3, term(LoadF32<kIn>(df, rows[r], i + 3 * lanes), r));
    }
    StoreF32<kOut>(df, a0, dst, i, stream);
    StoreF32<kOut>(df, a1, dst, i + lanes, stream);
    StoreF32<kOut>(df, a2, dst, i + 2 * lanes, stream);
    StoreF32<kOut>(df, a3, dst, i + 3 * lanes, stream);
  }
  for (; i + lanes <= n; i += lanes) {
    VF a = term(LoadF32<kIn>(df, rows[0], i), 0);
    for (int64_t r = 1; r < count; ++r) a = hn::Add(a, term(LoadF32<kIn>(df, rows[r], i), r));
    StoreF32<kOut>(df, a, dst, i, stream);
  }
  if (i < n) {
    const size_t rest = static_cast<size_t>(n - i);
    VF a = term(Tail<kIn>(rows[0], i, rest).load(df), 0);
    for (int64_t r = 1; r < count; ++r)
      a = hn::Add(a, term(Tail<kIn>(rows[r], i, rest).load(df), r));
    StoreTail<kOut>(df, a, dst, i, rest);
  }
}

// out[r] = g_r[0]*x_r[0] + g_r[1]*x_r[1] + ... in element order, for up to 4*kQuads rows at once.
// The sums are sequential, so the only parallelism is across rows: the products of a block of
// columns are computed a vector at a time and stored interleaved by groups of four rows
// (buf[q][c][j] = product of row 4q+j at column c), and then kQuads four-lane vectors, one lane
// per row, accumulate column after column: kQuads independent chains of one add per column.
template <DType kT, int kQuads>
void DotQuads(float* out, const float* const* g, const void* const* rows, int64_t count,
              int64_t n) {
  constexpr int kRows = 4 * kQuads;
  constexpr int64_t kCols = 256;
  const DF df;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df));
  const float* gp[kRows];
  const void* xp[kRows];
  for (int r = 0; r < kRows; ++r) {  // padding rows repeat row 0; their results are dropped
    gp[r] = g[r < count ? r : 0];
    xp[r] = rows[r < count ? r : 0];
  }
  HWY_ALIGN float buf[kQuads][kCols * 4];
#if HWY_TARGET == HWY_SCALAR
  float acc[kQuads][4] = {};
#else
  const hn::FixedTag<float, 4> d4;
  hn::Vec<decltype(d4)> acc[kQuads];
  for (int q = 0; q < kQuads; ++q) acc[q] = hn::Zero(d4);
#endif
  for (int64_t c0 = 0; c0 < n; c0 += kCols) {
    const int64_t len = n - c0 < kCols ? n - c0 : kCols;
    for (int q = 0; q < kQuads; ++q) {
      const float* const* gq = gp + 4 * q;
      const void* const* xq = xp + 4 * q;
      int64_t c = 0;
      for (; c + lanes <= len; c += lanes) {
        const int64_t at = c0 + c;
        hn::StoreInterleaved4(hn::Mul(hn::LoadU(df, gq[0] + at), LoadF32<kT>(df, xq[0], at)),
                              hn::Mul(hn::LoadU(df, gq[1] + at), LoadF32<kT>(df, xq[1], at)),
                              hn::Mul(hn::LoadU(df, gq[2] + at), LoadF32<kT>(df, xq[2], at)),
                              hn::Mul(hn::LoadU(df, gq[3] + at), LoadF32<kT>(df, xq[3], at)), df,
                              buf[q] + 4 * c);
      }
      if (c < len) {
        const size_t rest = static_cast<size_t>(len - c);
        VF p[4];
        for (int j = 0; j < 4; ++j) {
          const VF gt = Tail<DType::kF32>(gq[j], c0 + c, rest).load(df);
          p[j] = hn::Mul(gt, Tail<kT>(xq[j], c0 + c, rest).load(df));
        }
        HWY_ALIGN float tmp[4 * hn::MaxLanes(df)];
        hn::StoreInterleaved4(p[0], p[1], p[2], p[3], df, tmp);
        std::memcpy(buf[q] + 4 * c, tmp, 4 * rest * sizeof(float));
      }
    }
    int64_t c = 0;
#if HWY_TARGET == HWY_SCALAR
    if (c0 == 0) {  // the first product starts each sum (an empty sum would be +0, not -0)
      for (int q = 0; q < kQuads; ++q)
        for (int j = 0; j < 4; ++j) acc[q][j] = buf[q][j];
      c = 1;
    }
    for (; c < len; ++c)
      for (int q = 0; q < kQuads; ++q)
        for (int j = 0; j < 4; ++j) acc[q][j] += buf[q][4 * c + j];
  }
  for (int r = 0; r < count; ++r) out[r] = n > 0 ? acc[r / 4][r % 4] : 0.0f;
#else
    if (c0 == 0) {  // the first product starts each sum (an empty sum would be +0, not -0)
      for (int q = 0; q < kQuads; ++q) acc[q] = hn::Load(d4, buf[q]);
      c = 1;
    }
    for (; c < len; ++c)
      for (int q = 0; q < kQuads; ++q) acc[q] = hn::Add(acc[q], hn::Load(d4, buf[q] + 4 * c));
  }
  HWY_ALIGN float res[kRows];
  for (int q = 0; q < kQuads; ++q) hn::Store(acc[q], d4, res + 4 * q);
  for (int r = 0; r < count; ++r) out[r] = n > 0 ? res[r] : 0.0f;
#endif
}

template <DType kT>
void DotRowsT(float* out, const float* const* g, const void* const* rows, int64_t count,
              int64_t n) {
  for (int64_t r = 0; r < count; r += 16) {
    const int64_t c = count - r < 16 ? count - r : 16;
    switch ((c + 3) / 4) {
      case 1:
        DotQuads<kT, 1>(out + r, g + r, rows + r, c, n);
        break;
      case 2:
        DotQuads<kT, 2>(out + r, g + r, rows + r, c, n);
        break;
      case 3:
        DotQuads<kT, 3>(out + r, g + r, rows + r, c, n);
        break;
      default:
        DotQuads<kT, 4>(out + r, g + r, rows + r, c, n);
        break;
    }
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
template <DType kT>
struct DotRowsF {
  static void run(float* out, const float* const* g, const void* const* rows, int64_t count,
                  int64_t n) {
    DotRowsT<kT>(out, g, rows, count, n);
  }
};
template <DType kIn>
struct SumRowsF {
  template <DType kOut>
  struct To {
    static void run(void* dst, const void* const* rows, const float* w, int64_t count, int64_t n,
                    bool stream) {
      if (w != nullptr) {
        SumRowsT<kIn, kOut, true>(dst, rows, w, count, n, stream);
      } else {
        SumRowsT<kIn, kOut, false>(dst, rows, w, count, n, stream);
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
void CopyRow(void* dst, const void* src, size_t bytes, bool stream) {
  const hn::ScalableTag<uint8_t> d8;
  const size_t lanes = hn::Lanes(d8);
  auto* out = static_cast<uint8_t*>(dst);
  const auto* in = static_cast<const uint8_t*>(src);
  size_t i = 0;
  for (; i + 4 * lanes <= bytes; i += 4 * lanes) {
    const auto v0 = hn::LoadU(d8, in + i), v1 = hn::LoadU(d8, in + i + lanes);
    const auto v2 = hn::LoadU(d8, in + i + 2 * lanes), v3 = hn::LoadU(d8, in + i + 3 * lanes);
    Put(v0, d8, out + i, stream);
    Put(v1, d8, out + i + lanes, stream);
    Put(v2, d8, out + i + 2 * lanes, stream);
    Put(v3, d8, out + i + 3 * lanes, stream);
  }
  for (; i + lanes <= bytes; i += lanes) Put(hn::LoadU(d8, in + i), d8, out + i, stream);
  if (i < bytes) std::memcpy(out + i, in + i, bytes - i);
  if (stream) hwy::FlushStream();
}
void AxpyRow(float* acc, float w, const void* src, DType dtype, int64_t n) {
  ByDType<AxpyRowF>(dtype, acc, w, src, n);
}
void AddRow(float* acc, const void* src, DType dtype, int64_t n) {
  ByDType<AddRowF>(dtype, acc, src, n);
}
void DotRows(float* out, const float* const* g, const void* const* rows, int64_t count, DType dtype,
             int64_t n) {
  ByDType<DotRowsF>(dtype, out, g, rows, count, n);
}
void SumRows(void* dst, DType dst_dtype, const void* const* rows, const float* w, int64_t count,
             DType src_dtype, int64_t n, bool stream) {
  switch (src_dtype) {
    case DType::kBF16:
      ByDType<SumRowsF<DType::kBF16>::To>(dst_dtype, dst, rows, w, count, n, stream);
      break;
    case DType::kF16:
      ByDType<SumRowsF<DType::kF16>::To>(dst_dtype, dst, rows, w, count, n, stream);
      break;
    default:
      ByDType<SumRowsF<DType::kF32>::To>(dst_dtype, dst, rows, w, count, n, stream);
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
HWY_EXPORT(DotRows);
HWY_EXPORT(SumRows);
HWY_EXPORT(CopyRow);

namespace {
// Non-temporal stores need addresses aligned to the vector; a row that starts on a 64-byte
// boundary gives every full vector of it such an address.
bool can_stream(const void* dst, bool stream) {
  return stream && reinterpret_cast<uintptr_t>(dst) % 64 == 0;
}
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
  HWY_DYNAMIC_DISPATCH(CopyRow)(dst, src, bytes, can_stream(dst, stream));
}
void axpy_row_f32(float* acc, float w, const void* src, DType dtype, int64_t n) {
  HWY_DYNAMIC_DISPATCH(AxpyRow)(acc, w, src, dtype, n);
}
void add_row_f32(float* acc, const void* src, DType dtype, int64_t n) {
  HWY_DYNAMIC_DISPATCH(AddRow)(acc, src, dtype, n);
}
void dot_rows_f32(float* out, const float* const* g, const void* const* rows, int64_t count,
                  DType dtype, int64_t n) {
  HWY_DYNAMIC_DISPATCH(DotRows)(out, g, rows, count, dtype, n);
}
void sum_rows(void* dst, DType dst_dtype, const void* const* rows, const float* weights,
              int64_t count, DType src_dtype, int64_t n, bool stream) {
  if (count == 0) {
    std::memset(dst, 0, static_cast<std::size_t>(n) * dtype_size(dst_dtype));
    return;
  }
  HWY_DYNAMIC_DISPATCH(SumRows)
  (dst, dst_dtype, rows, weights, count, src_dtype, n, can_stream(dst, stream));
}

}  // namespace moe_ep::detail
#endif  // HWY_ONCE
