#include "kernels/cpu/convert.h"

namespace moe_ep::detail {

namespace {
template <typename Load>
void axpy_impl(float* __restrict acc, float w, int64_t n, Load load) {
  for (int64_t i = 0; i < n; ++i) {
    const float p = w * load(i);  // rounded to fp32 here: -ffp-contract=off keeps it separate
    acc[i] += p;
  }
}
}  // namespace

void axpy_row_f32(float* acc, float w, const void* src, DType dtype, int64_t n) {
  switch (dtype) {
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      axpy_impl(acc, w, n, [s](int64_t i) { return bf16_to_f32(s[i]); });
      break;
    }
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      axpy_impl(acc, w, n, [s](int64_t i) { return f16_to_f32(s[i]); });
      break;
    }
    default: {
      const auto* s = static_cast<const float*>(src);
      axpy_impl(acc, w, n, [s](int64_t i) { return s[i]; });
      break;
    }
  }
}

void add_row_f32(float* acc, const void* src, DType dtype, int64_t n) {
  switch (dtype) {
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) acc[i] += bf16_to_f32(s[i]);
      break;
    }
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) acc[i] += f16_to_f32(s[i]);
      break;
    }
    default: {
      const auto* s = static_cast<const float*>(src);
      for (int64_t i = 0; i < n; ++i) acc[i] += s[i];
      break;
    }
  }
}

void store_row_f32(void* dst, DType dtype, const float* src, int64_t n) {
  switch (dtype) {
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
      break;
    }
    case DType::kF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
      break;
    }
    default: {
      auto* d = static_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = src[i];
      break;
    }
  }
}

void load_row_f32(float* dst, const void* src, DType dtype, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_f32(src, dtype, i);
}

}  // namespace moe_ep::detail
