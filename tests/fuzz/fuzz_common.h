// Shared by the libFuzzer targets: the input reader and the one accepted failure.
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <vector>

#include "moe_ep/error.h"
#include "moe_ep/tensor.h"

namespace moe_ep_fuzz {

// Reports a finding and aborts (libFuzzer saves the input as crash-<sha1>).
[[noreturn]] inline void finding(const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::fprintf(stderr, "moe-ep fuzz finding: ");
  std::vfprintf(stderr, format, args);
  std::fprintf(stderr, "\n");
  va_end(args);
  std::abort();
}

// Runs f: returning or throwing moe_ep::Error is fine (Internal excepted: a broken invariant),
// any other exception is a finding.
template <typename F>
void expect_error_or_success(F&& f) {
  try {
    f();
  } catch (const moe_ep::Error& e) {
    if (e.kind() == moe_ep::ErrorKind::kInternal) finding("Internal error: %s", e.what());
  } catch (const std::exception& e) {
    finding("a non-moe_ep exception: %s", e.what());
  } catch (...) {
    finding("a non-std exception");
  }
}

// a * b, or a when that overflows (the harnesses' size hints; the ops see the fuzzer's values).
inline int64_t mul(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_mul_overflow(a, b, &r) ? a : r;
}

// Reads the fuzz input as a stream of small decisions; past the end every read gives 0.
class Input {
 public:
  Input(const uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  bool flag() { return byte() & 1; }
  // A value in [0, n).
  uint32_t below(uint32_t n) { return n == 0 ? 0 : byte() % n; }
  uint64_t u64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(byte()) << (8 * i);
    return v;
  }
  // A size: mostly small ([0, 8)), sometimes an edge (negative, 2^31 +- 1, 2^62, INT64_MAX,
  // INT64_MIN) or any 64-bit value.
  int64_t size() {
    const uint8_t b = byte();
    if (b < 200) return b % 8;
    static constexpr int64_t kEdges[] = {-1,
                                         -2,
                                         (int64_t{1} << 31) - 1,
                                         int64_t{1} << 31,
                                         (int64_t{1} << 31) + 1,
                                         int64_t{1} << 32,
                                         int64_t{1} << 40,
                                         int64_t{1} << 62,
                                         INT64_MAX,
                                         INT64_MIN,
                                         INT64_MAX / 2 + 1,
                                         int64_t{3} << 61};
    constexpr uint8_t kNumEdges = sizeof(kEdges) / sizeof(kEdges[0]);
    if (b < 200 + kNumEdges) return kEdges[b - 200];
    // Not [4096, 2^31 - 1): sizes there can be valid and then cost the O(size) time and memory
    // they ask for (e.g. padded permute_grad's per-token table for N = 2^24 tokens), which is no
    // finding but a slow or out-of-memory one.
    const auto v = static_cast<int64_t>(u64());
    return v >= 4096 && v < INT32_MAX ? v % 4096 : v;
  }
  // Raw bytes for a tensor's elements.
  void fill(void* dst, std::size_t n) {
    auto* out = static_cast<uint8_t*>(dst);
    for (std::size_t i = 0; i < n; ++i) out[i] = byte();
  }
  bool exhausted() const { return pos_ >= size_; }

 private:
  const uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

// Builds the TensorViews of one input and owns their memory. A view is well formed as a view
// (0 <= ndim <= kMaxDims, and `data` covers every element its shape and strides address) unless
// that would take more than kMaxElems elements: then data is null, which the ops must refuse
// whenever they would read it (they may accept it for tensors of which only the shape is used).
// Sizes, strides and dtypes are otherwise the fuzzer's: negative, huge, overflowing or of the
// wrong dtype, the ops must refuse them with a moe_ep::Error.
class Views {
 public:
  static constexpr int64_t kMaxElems = 1 << 12;

  explicit Views(Input& in) : in_(in) {}

  // A view that is mostly of `dtype` and `ndim` (the fuzzer may pick others), its sizes from
  // Input::size() unless `dims` gives them (entries < 0 in `dims`: from the input).
  moe_ep::TensorView make(moe_ep::DType dtype, int ndim, std::vector<int64_t> dims = {}) {
    moe_ep::TensorView v;
    const uint8_t d = in_.byte();
    v.dtype = d < 224 ? dtype : static_cast<moe_ep::DType>(d % 7);
    const uint8_t n = in_.byte();
    v.ndim = n < 224 ? ndim : n % (moe_ep::kMaxDims + 1);
    for (int i = 0; i < v.ndim; ++i) {
      const int64_t given = i < static_cast<int>(dims.size()) ? dims[i] : -1;
      v.shape[i] = given >= 0 && in_.byte() < 224 ? given : in_.size();
    }
    // Contiguous strides unless the fuzzer asks for its own.
    int64_t stride = 1;
    const bool own_strides = in_.byte() >= 224;
    for (int i = v.ndim - 1; i >= 0; --i) {
      v.strides[i] = own_strides ? in_.size() : stride;
      if (__builtin_mul_overflow(stride, v.shape[i] > 0 ? v.shape[i] : 1, &stride)) stride = 1;
    }
    back(v);
    return v;
  }

  // Fills integer view v's elements with ids in [lo, lo + span) (or anything, for a few).
  void fill_ids(const moe_ep::TensorView& v, int64_t lo, int64_t span) {
    for_each(v, [&](void* p) {
      const uint8_t b = in_.byte();
      const int64_t id = b < 240 && span > 0 ? lo + b % span : static_cast<int8_t>(b) * 1000003;
      store_int(v.dtype, p, id);
    });
  }
  // Fills v with a permutation of [0, numel) (a valid sorted_indices), shuffled by the input.
  void fill_permutation(const moe_ep::TensorView& v) {
    std::vector<int64_t> perm;
    for_each(v, [&](void*) { perm.push_back(static_cast<int64_t>(perm.size())); });
    for (std::size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[in_.byte() % i]);
    std::size_t j = 0;
    for_each(v, [&](void* p) { store_int(v.dtype, p, perm[j++]); });
  }

 private:
  // Gives v memory for every element it addresses (offsets from the smallest to the largest),
  // filled from the input, or null when its sizes are negative or too large.
  void back(moe_ep::TensorView& v) {
    int64_t lo = 0, hi = 0, numel = 1;
    for (int i = 0; i < v.ndim; ++i) {
      if (v.shape[i] < 0) return;  // refused by the ops; data stays null
      if (__builtin_mul_overflow(numel, v.shape[i], &numel)) return;
    }
    if (numel == 0 || numel > kMaxElems) return;
    for (int i = 0; i < v.ndim; ++i) {
      int64_t span;
      if (__builtin_mul_overflow(v.shape[i] - 1, v.strides[i], &span)) return;
      if (__builtin_add_overflow(span < 0 ? lo : hi, span, span < 0 ? &lo : &hi)) return;
    }
    int64_t extent;  // hi - lo: lo <= 0 <= hi
    if (__builtin_sub_overflow(hi, lo, &extent) || extent >= 4 * kMaxElems) return;
    const std::size_t esize = moe_ep::dtype_size(v.dtype);
    auto buf = std::make_unique<unsigned char[]>(static_cast<std::size_t>(extent + 1) * esize);
    in_.fill(buf.get(), static_cast<std::size_t>(extent + 1) * esize);
    v.data = buf.get() + static_cast<std::size_t>(-lo) * esize;
    buffers_.push_back(std::move(buf));
  }

  template <typename F>
  static void for_each(const moe_ep::TensorView& v, F&& f) {
    if (v.data == nullptr) return;
    int64_t idx[moe_ep::kMaxDims] = {};
    int64_t numel = 1;
    for (int i = 0; i < v.ndim; ++i) numel *= v.shape[i];
    const std::size_t esize = moe_ep::dtype_size(v.dtype);
    for (int64_t e = 0; e < numel; ++e) {
      int64_t off = 0;
      for (int i = 0; i < v.ndim; ++i) off += idx[i] * v.strides[i];
      f(static_cast<unsigned char*>(v.data) + off * static_cast<int64_t>(esize));
      for (int i = v.ndim - 1; i >= 0; --i) {
        if (++idx[i] < v.shape[i]) break;
        idx[i] = 0;
      }
    }
  }
  static void store_int(moe_ep::DType dtype, void* p, int64_t value) {
    if (dtype == moe_ep::DType::kI32) {
      const auto v32 = static_cast<int32_t>(value);
      std::memcpy(p, &v32, 4);
    } else if (dtype == moe_ep::DType::kI64) {
      std::memcpy(p, &value, 8);
    }
  }

  Input& in_;
  std::vector<std::unique_ptr<unsigned char[]>> buffers_;
};

}  // namespace moe_ep_fuzz
