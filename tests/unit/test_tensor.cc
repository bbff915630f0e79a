// TensorView, Tensor, DLPack conversion, errors and the dtype conversions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/convert.h"
#include "moe_ep/error.h"
#include "moe_ep/tensor.h"

namespace moe_ep {
namespace {

TEST(TensorView, ContiguousShapeAndStrides) {
  float buf[24];
  TensorView v = TensorView::contiguous(buf, DType::kF32, {2, 3, 4});
  EXPECT_EQ(v.ndim, 3);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.strides[0], 12);
  EXPECT_EQ(v.strides[1], 4);
  EXPECT_EQ(v.strides[2], 1);
  EXPECT_TRUE(v.is_contiguous());
  v.strides[0] = 13;
  EXPECT_FALSE(v.is_contiguous());
  EXPECT_EQ(v.describe(), "fp32[2, 3, 4] strides [13, 4, 1]");
}

TEST(TensorView, RejectsTooManyDims) {
  try {
    TensorView::contiguous(nullptr, DType::kF32, {1, 1, 1, 1, 1});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("ndim = 5"), std::string::npos) << e.what();
  }
}

TEST(Tensor, EmptyZerosAligned) {
  Tensor t = Tensor::zeros(DType::kBF16, {3, 5});
  ASSERT_TRUE(t.defined());
  EXPECT_EQ(t.nbytes(), 30u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(t.ptr<uint16_t>()[i], 0);
  Tensor e = Tensor::empty(DType::kI64, {0, 7});
  EXPECT_EQ(e.numel(), 0);
  EXPECT_EQ(e.size(1), 7);
  // Small blocks come from malloc, aligned by hand (src/base/block_cache.cc): every size is
  // 64-byte aligned and writable to its end, and is freed whole (AddressSanitizer checks the
  // free and the bounds).
  for (int64_t bytes : {1, 15, 16, 17, 63, 64, 65, 127, 1000, 4096, 100000, (4 << 20) - 1}) {
    std::vector<Tensor> held;
    for (int k = 0; k < 4; ++k) {
      held.push_back(Tensor::empty(DType::kI8, {bytes}));
      EXPECT_EQ(reinterpret_cast<uintptr_t>(held.back().data()) % 64, 0u) << bytes;
      std::memset(held.back().data(), 0x5a, static_cast<std::size_t>(bytes));
    }
  }
}

// Blocks of 4 MiB and more are kept when freed and handed to the next allocation of the same
// rounded size (src/base/block_cache.h): outputs of repeated calls land on mapped pages.
TEST(Tensor, LargeBlocksAreReused) {
  constexpr int64_t kBytes = int64_t{8} << 20;
  const void* first = nullptr;
  {
    Tensor a = Tensor::empty(DType::kI8, {kBytes});
    first = a.data();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(first) % 64, 0u);
    std::memset(a.data(), 1, static_cast<std::size_t>(kBytes));
  }
  Tensor b = Tensor::empty(DType::kI8, {kBytes - 100});  // the same 2 MiB-rounded size
  EXPECT_EQ(b.data(), first);
  const void* second = nullptr;
  {
    Tensor c = Tensor::empty(DType::kI8, {kBytes});  // b holds the kept block: a new one
    EXPECT_NE(c.data(), first);
    second = c.data();
    std::memset(c.data(), 1, static_cast<std::size_t>(kBytes));
  }
  Tensor z = Tensor::zeros(DType::kI8, {kBytes});  // c's block, zeroed by zeros()
  EXPECT_EQ(z.data(), second);
  const auto* p = z.ptr<unsigned char>();
  EXPECT_EQ(p[0] | p[kBytes / 2] | p[kBytes - 1], 0);
}

TEST(DLPack, RoundTripKeepsEverything) {
  int64_t buf[12];
  TensorView v = TensorView::contiguous(buf, DType::kI64, {3, 2});
  v.strides[0] = 4;  // strided rows
  DLTensor t = to_dlpack(v);
  EXPECT_EQ(t.dtype.code, kDLInt);
  EXPECT_EQ(t.dtype.bits, 64);
  TensorView back = from_dlpack(t);
  EXPECT_EQ(back.data, v.data);
  EXPECT_EQ(back.dtype, DType::kI64);
  EXPECT_EQ(back.shape, v.shape);
  EXPECT_EQ(back.strides, v.strides);
  for (DType d : {DType::kBF16, DType::kF16, DType::kF32, DType::kI8, DType::kI32, DType::kBool}) {
    TensorView w = TensorView::contiguous(buf, d, {2});
    DLTensor dl = to_dlpack(w);
    EXPECT_EQ(from_dlpack(dl).dtype, d) << dtype_name(d);
  }
}

TEST(DLPack, NullStridesMeanContiguousAndOffsetIsFolded) {
  float buf[8];
  int64_t shape[2] = {2, 3};
  DLTensor t{};
  t.data = buf;
  t.device = {kDLCPU, 0};
  t.ndim = 2;
  t.dtype = {kDLFloat, 32, 1};
  t.shape = shape;
  t.strides = nullptr;
  t.byte_offset = 8;
  TensorView v = from_dlpack(t);
  EXPECT_EQ(v.data, buf + 2);
  EXPECT_EQ(v.strides[0], 3);
  EXPECT_EQ(v.strides[1], 1);
}

TEST(DLPack, StridesThatAddressNothingAreNormalised) {
  float buf[8];
  int64_t shape[2] = {4, 1};
  int64_t strides[2] = {2, 0};  // PyTorch exports x[:, :1] of a (4, 2) tensor like this
  DLTensor t{};
  t.data = buf;
  t.device = {kDLCPU, 0};
  t.ndim = 2;
  t.dtype = {kDLFloat, 32, 1};
  t.shape = shape;
  t.strides = strides;
  TensorView v = from_dlpack(t);
  EXPECT_EQ(v.strides[0], 2);  // a real stride is kept
  EXPECT_EQ(v.strides[1], 1);  // size 1: contiguous
  shape[0] = 0;
  shape[1] = 5;
  strides[0] = 0;
  strides[1] = 0;
  v = from_dlpack(t);  // no elements: every stride contiguous
  EXPECT_EQ(v.strides[0], 5);
  EXPECT_EQ(v.strides[1], 1);
  shape[0] = 3;
  strides[1] = -1;
  try {
    from_dlpack(t, "x");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("x stride[1] = -1 is negative"), std::string::npos)
        << e.what();
  }
}

TEST(DLPack, RejectsUnsupported) {
  float buf[2];
  int64_t shape[1] = {2};
  DLTensor t{};
  t.data = buf;
  t.device = {kDLCUDA, 0};
  t.ndim = 1;
  t.dtype = {kDLFloat, 32, 1};
  t.shape = shape;
  EXPECT_THROW(from_dlpack(t, "x"), Error);
  t.device = {kDLCPU, 0};
  t.dtype = {kDLFloat, 64, 1};
  try {
    from_dlpack(t, "x");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("from_dlpack: x dtype float64 (DLPack code 2, bits 64) "
                                         "is not one of bf16"),
              std::string::npos)
        << e.what();
  }
}

TEST(DLPack, ManagedKeepsStorageAlive) {
  DLManagedTensor* m = nullptr;
  {
    Tensor t = Tensor::empty(DType::kF32, {4});
    for (int i = 0; i < 4; ++i) t.ptr<float>()[i] = static_cast<float>(i);
    m = t.to_dlpack_managed();
  }
  EXPECT_EQ(static_cast<float*>(m->dl_tensor.data)[3], 3.0f);
  EXPECT_EQ(m->dl_tensor.shape[0], 4);
  m->deleter(m);
}

TEST(Convert, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 lies exactly between bf16 1.0 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(detail::f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3*2^-8 lies between 1 + 2^-7 (odd mantissa) and 1 + 2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(detail::f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(detail::bf16_to_f32(0x3f82), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isnan(
      detail::bf16_to_f32(detail::f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(detail::bf16_to_f32(detail::f32_to_bf16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
}

TEST(Convert, Fp16RoundsToNearestEven) {
  // fp16 has 10 mantissa bits: 1 + 2^-11 ties to 1.0.
  EXPECT_EQ(detail::f16_to_f32(detail::f32_to_f16(1.0f + std::ldexp(1.0f, -11))), 1.0f);
  EXPECT_EQ(detail::f16_to_f32(detail::f32_to_f16(65504.0f)), 65504.0f);
  EXPECT_EQ(detail::f32_to_f16(-2.0f), 0xc000);
}

TEST(Error, KindNames) {
  EXPECT_STREQ(error_kind_name(ErrorKind::kTimeout), "Timeout");
  Error e(ErrorKind::kRemote, "rank 2: boom");
  EXPECT_EQ(e.kind(), ErrorKind::kRemote);
  EXPECT_STREQ(e.what(), "rank 2: boom");
}

}  // namespace
}  // namespace moe_ep

#include "ref/numeric.h"

namespace moe_ep {
namespace {

// The kernels' conversions agree with the reference's independent ones on many values.
TEST(Convert, MatchesReferenceRounding) {
  uint32_t state = 12345;
  for (int n = 0; n < 200000; ++n) {
    state = state * 1664525u + 1013904223u;
    float f;
    uint32_t bits = state;
    std::memcpy(&f, &bits, 4);
    if (std::isnan(f)) continue;
    uint16_t b = detail::f32_to_bf16(f);
    EXPECT_EQ(ref::load(DType::kBF16, &b, 0), ref::round_to(DType::kBF16, f)) << f;
    uint16_t h = detail::f32_to_f16(f);
    const float rh = ref::round_to(DType::kF16, f);
    EXPECT_EQ(ref::load(DType::kF16, &h, 0), rh) << f;
    uint16_t h2 = 0;
    ref::store(DType::kF16, &h2, 0, f);
    EXPECT_EQ(h2, h) << f;
    if (::testing::Test::HasFailure()) break;
  }
}

}  // namespace
}  // namespace moe_ep

namespace moe_ep {
namespace {

// The public element conversions (tensor.h) round like the reference, and the dtype-generic
// load_float / store_float refuse non-float dtypes.
TEST(Convert, PublicConversionsMatchReference) {
  uint32_t state = 777;
  for (int n = 0; n < 50000; ++n) {
    state = state * 1664525u + 1013904223u;
    float f;
    std::memcpy(&f, &state, 4);
    if (std::isnan(f)) continue;
    EXPECT_EQ(bf16_to_float(float_to_bf16(f)), ref::round_to(DType::kBF16, f)) << f;
    EXPECT_EQ(fp16_to_float(float_to_fp16(f)), ref::round_to(DType::kF16, f)) << f;
    for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
      uint32_t cell[2] = {0, 0};
      store_float(dt, cell, 1, f);
      EXPECT_EQ(load_float(dt, cell, 1), ref::round_to(dt, f)) << f << " " << dtype_name(dt);
      EXPECT_EQ(ref::load(dt, cell, 1), ref::round_to(dt, f)) << f << " " << dtype_name(dt);
    }
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  int32_t i = 0;
  try {
    load_float(DType::kI32, &i, 0);
    FAIL() << "load_float accepted int32";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_STREQ(e.what(), "load_float: dtype int32 is not one of {bf16, fp16, fp32}");
  }
  EXPECT_THROW(store_float(DType::kI8, &i, 0, 1.0f), Error);
}

}  // namespace
}  // namespace moe_ep
