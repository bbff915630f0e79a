#include "kernels/cpu/quant.h"

#include <cstring>
#include <limits>

#include "core/check.h"
#include "kernels/cpu/convert.h"

namespace moe_ep::detail {

namespace {

constexpr float kQMax = 127.0f;
// Adding and subtracting 1.5 * 2^23 rounds an fp32 of magnitude below 2^22 to the nearest integer,
// ties to even (the default rounding mode), using only vectorisable adds.
constexpr float kRoundMagic = 12582912.0f;
// Tiny rows (127 / amax overflows) are scaled up by 2^64 first; see quant.h.
constexpr float kTinyUp = 0x1p64f;
constexpr float kTinyDown = 0x1p-64f;
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;

inline uint32_t abs_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u & kAbsMask;
}

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The bit pattern of max_i |xf[i]|. For non-negative floats the integer order of the bit patterns
// is the numeric order, and NaNs (> 0x7f800000) sort above Inf (== 0x7f800000) above every finite
// value, so one integer max both finds amax and flags non-finite rows, whatever the lane order.
template <bool kSmooth, typename Load>
uint32_t amax_bits(const float* __restrict smooth, int64_t n, Load load) {
  uint32_t m = 0;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) {
    float xf = load(i);
    if constexpr (kSmooth) xf = xf * smooth[i];
    const uint32_t b = abs_bits(xf);
    m = b > m ? b : m;
  }
  return m;
}

// q[i] = clamp(rne((xf[i] * pre) * s)); pre is 1 (exact) or 2^64 (exact on tiny rows).
template <bool kSmooth, typename Load>
void quantize_pass(const float* __restrict smooth, int64_t n, float pre, float s,
                   int8_t* __restrict q, Load load) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float xf = load(i);
    if constexpr (kSmooth) xf = xf * smooth[i];
    const float p = (xf * pre) * s;
    float r = (p + kRoundMagic) - kRoundMagic;  // |p| < 127.5, far below 2^22
    r = r < -kQMax ? -kQMax : r;
    r = r > kQMax ? kQMax : r;
    q[i] = static_cast<int8_t>(static_cast<int32_t>(r));
  }
}

template <bool kSmooth, typename Load>
float quantize_impl(const float* smooth, int64_t n, int8_t* q, Load load) {
  const uint32_t mb = amax_bits<kSmooth>(smooth, n, load);
  if (mb == 0 || mb >= kInfBits) {
    if (n > 0) std::memset(q, 0, static_cast<std::size_t>(n));
    return mb == 0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  const float amax = from_bits(mb);
  float s = kQMax / amax;
  float pre = 1.0f;
  if (s > std::numeric_limits<float>::max()) {  // 127 / amax overflowed: amax < ~3.7e-37
    pre = kTinyUp;
    s = kQMax / (amax * kTinyUp);
  }
  quantize_pass<kSmooth>(smooth, n, pre, s, q, load);
  const float inv = 1.0f / s;
  return pre == 1.0f ? inv : inv * kTinyDown;
}

template <typename Load>
float quantize_dispatch_smooth(const float* smooth, int64_t n, int8_t* q, Load load) {
  return smooth != nullptr ? quantize_impl<true>(smooth, n, q, load)
                           : quantize_impl<false>(smooth, n, q, load);
}

}  // namespace

float quantize_row_int8(const void* src, DType dtype, const float* smooth, int64_t n, int8_t* q) {
  MOE_EP_CHECK(n >= 0);
  MOE_EP_CHECK(n == 0 || (src != nullptr && q != nullptr));
  switch (dtype) {
    case DType::kBF16: {
      const auto* x = static_cast<const uint16_t*>(src);
      return quantize_dispatch_smooth(smooth, n, q, [x](int64_t i) { return bf16_to_f32(x[i]); });
    }
    case DType::kF16: {
      const auto* x = static_cast<const uint16_t*>(src);
      return quantize_dispatch_smooth(smooth, n, q, [x](int64_t i) { return f16_to_f32(x[i]); });
    }
    case DType::kF32: {
      const auto* x = static_cast<const float*>(src);
      return quantize_dispatch_smooth(smooth, n, q, [x](int64_t i) { return x[i]; });
    }
    default:
      fail(ErrorKind::kInternal, "quantize_row_int8: dtype ", dtype_name(dtype),
           " is not bf16, fp16 or fp32 (please report this bug)");
  }
}

void axpy_row_int8(float* __restrict acc, float w, const int8_t* __restrict q, float scale,
                   int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float y = static_cast<float>(q[i]) * scale;  // the dequantised value, rounded to fp32
    const float p = w * y;                             // rounded again: -ffp-contract=off
    acc[i] += p;
  }
}

void dequantize_row_int8(const int8_t* __restrict q, float scale, int64_t n,
                         float* __restrict out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(q[i]) * scale;
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
  // Rows are independent, so any split gives the same bits; small jobs stay on one thread.
#pragma omp parallel for schedule(static) if (a.rows > 1 && a.rows * a.n >= (int64_t{1} << 15))
  for (int64_t r = 0; r < a.rows; ++r) {
    const void* x = a.n > 0 ? src + src_row(r) * a.src_stride * esize : nullptr;
    const float* sm = a.smooth != nullptr ? a.smooth + smooth_row(r) * a.smooth_stride : nullptr;
    int8_t* qr = a.n > 0 ? a.q + r * a.q_stride : nullptr;
    a.scales[r] = quantize_row_int8(x, a.dtype, sm, a.n, qr);
  }
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
