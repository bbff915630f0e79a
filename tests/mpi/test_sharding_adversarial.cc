// SPEC §5, adversarially: the sharded ops and redistribution on the inputs most likely to break
// them. PyTorch DTensor pieces cut by hand (torch.chunk, empty trailing pieces), pieces cut the
// numpy.array_split way (rejected on every rank), the kernel's checks on a rank whose piece is
// empty, strided and padded local pieces, Partial sums whose value depends on the summation
// order, the dtype of a Partial grad_probs, pieces whose owner is larger than the piece,
// arguments that differ on one rank (every rank throws, the mesh stays usable) and a late rank
// (every rank times out). Runs at np 1 to 4.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/error.h"
#include "moe_ep/permute.h"
#include "moe_ep/sharding.h"
#include "moe_ep/tensor.h"
#include "mpi/common.h"
#include "ref/numeric.h"

namespace moe_ep {
namespace {

using test::SplitMix64;

std::shared_ptr<Communicator> mesh() {
  static std::shared_ptr<Communicator> m = Communicator::from_mpi(MPI_COMM_WORLD);
  return m;
}

// A (rows, h) float tensor of values in [-2, 2) (rounded to dtype), the same on every rank.
Tensor random_rows(DType dtype, int64_t rows, int64_t h, uint64_t seed) {
  Tensor t = Tensor::empty(dtype, {rows, h});
  SplitMix64 rng{seed};
  for (int64_t i = 0; i < rows * h; ++i)
    ref::store(dtype, t.data(), i, static_cast<float>(rng.below(1 << 16)) / 16384.0f - 2.0f);
  return t;
}

Tensor random_indices(int64_t n, int64_t topk, int64_t experts, uint64_t seed) {
  Tensor t = Tensor::empty(DType::kI32, {n, topk});
  SplitMix64 rng{seed};
  for (int64_t i = 0; i < n * topk; ++i)
    t.ptr<int32_t>()[i] = static_cast<int32_t>(rng.below(experts));
  return t;
}

DTensor place(const Tensor& full, Placement p) {
  return distribute(full.view(), p, mesh()->size(), mesh()->rank());
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.ndim() != b.ndim()) return false;
  for (int d = 0; d < a.ndim(); ++d)
    if (a.size(d) != b.size(d)) return false;
  return a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Gathers x and compares it with `want` bit for bit.
void expect_gathers_to(const DTensor& x, const Tensor& want, const std::string& what) {
  const Tensor got = full_tensor(*mesh(), x, what.c_str());
  EXPECT_TRUE(same_bits(got, want)) << what << ": gathered result differs";
}

// PyTorch's Shard.local_shard_size_and_offset, written independently of shard_range.
ShardRange torch_chunk(int64_t size, int n, int rank) {
  const int64_t chunk = (size + n - 1) / n;
  const int64_t start = std::min(size, chunk * rank);
  return {start, std::max<int64_t>(0, std::min(size, chunk * (rank + 1)) - chunk * rank)};
}

// A contiguous copy of columns [c0, c0 + w) of a (rows, h) tensor: a piece as DTensor.to_local()
// would hand it over.
Tensor columns(const Tensor& full, int64_t c0, int64_t w) {
  const int64_t rows = full.size(0), h = full.size(1);
  const int64_t es = static_cast<int64_t>(dtype_size(full.dtype()));
  Tensor t = Tensor::empty(full.dtype(), {rows, w});
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(t.ptr<char>() + r * w * es, full.ptr<char>() + (r * h + c0) * es,
                static_cast<std::size_t>(w * es));
  return t;
}

// A copy of a (rows, h) tensor inside a larger buffer: row stride h + pad_row, column stride
// col_stride. `storage` keeps the buffer alive.
TensorView strided_copy(const Tensor& full, int64_t pad_row, int64_t col_stride, Tensor& storage) {
  const int64_t rows = full.size(0), h = full.size(1);
  const int64_t es = static_cast<int64_t>(dtype_size(full.dtype()));
  const int64_t row_stride = h * col_stride + pad_row;
  storage = Tensor::zeros(full.dtype(), {rows + 1, row_stride});
  TensorView v = full.view();
  v.data = storage.ptr<char>() + es;  // not at the buffer's start either
  v.strides[0] = row_stride;
  v.strides[1] = col_stride;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < h; ++c)
      std::memcpy(static_cast<char*>(v.data) + (r * row_stride + c * col_stride) * es,
                  full.ptr<char>() + (r * h + c) * es, static_cast<std::size_t>(es));
  return v;
}

// ---------------------------------------------------------------------------------------------
// PyTorch DTensor pieces.

TEST(ShardingAdversarial, PiecesCutByHandLikePyTorchAreAccepted) {
  // Every rank cuts its piece with PyTorch's formula (not with distribute/shard_range), as a
  // PyTorch front hands over DTensor.to_local(): contiguous, possibly empty.
  const Communicator& m = *mesh();
  const int n = m.size(), me = m.rank();
  for (const int64_t h : {int64_t{1000}, int64_t{10}, int64_t{5}, int64_t{3}, int64_t{6}}) {
    const int64_t N = 6, K = 2;
    const std::string what = "H = " + std::to_string(h) + " np " + std::to_string(n);
    SCOPED_TRACE(what);
    const Tensor tokens = random_rows(DType::kBF16, N, h, 11 + h);
    const Tensor idx = random_indices(N, K, 5, 12 + h);
    const Tensor probs = random_rows(DType::kF32, N, K, 13 + h);
    const Tensor grad_out = random_rows(DType::kBF16, N, h, 14 + h);
    const ShardRange mine = torch_chunk(h, n, me);
    const Tensor tok_piece = columns(tokens, mine.offset, mine.length);
    const auto pr =
        moe_ep::permute({.tokens = tokens, .indices = idx, .num_out_tokens = std::nullopt});
    auto p = sharded::permute(m, {.tokens = DTensor::from_local(tok_piece, Shard(1), {N, h}),
                                  .indices = place(idx, Replicate())});
    EXPECT_EQ(p.choice.index, n > 1 ? 1 : 0);
    EXPECT_EQ(p.permuted_tokens.local.shape[1], n > 1 ? mine.length : h);
    expect_gathers_to(p.permuted_tokens, pr.permuted_tokens, "permuted_tokens");
    const auto want = moe_ep::unpermute_grad({.permuted_tokens = pr.permuted_tokens,
                                              .grad_out = grad_out,
                                              .sorted_indices = pr.sorted_indices,
                                              .probs = probs.view(),
                                              .padded_mode = false,
                                              .restore_shape = std::nullopt});
    const Tensor go_piece = columns(grad_out, mine.offset, mine.length);
    auto g =
        sharded::unpermute_grad(m, {.permuted_tokens = p.permuted_tokens,
                                    .grad_out = DTensor::from_local(go_piece, Shard(1), {N, h}),
                                    .sorted_indices = p.sorted_indices,
                                    .probs = place(probs, Replicate())});
    expect_gathers_to(g.grad_permuted_tokens, want.grad_permuted_tokens, "grad_permuted_tokens");
    ASSERT_TRUE(g.grad_probs.has_value());
    const Tensor gp = full_tensor(m, *g.grad_probs, "grad_probs");
    EXPECT_EQ(gp.dtype(), DType::kF32);
    for (int64_t i = 0; i < N * K; ++i)
      EXPECT_NEAR(gp.ptr<float>()[i], want.grad_probs.ptr<float>()[i],
                  1e-5 * (1 + std::fabs(want.grad_probs.ptr<float>()[i])))
          << i;
  }
}

TEST(ShardingAdversarial, ArraySplitPiecesAreRejectedOnEveryRank) {
  // H = 10: torch.chunk gives 4, 4, 2 (np 3) and 3, 3, 3, 1 (np 4); numpy.array_split 4, 3, 3 and
  // 3, 3, 2, 2. Every rank whose array_split piece is wrong throws its own error, the others
  // kRemote naming the lowest such rank; nobody hangs.
  const Communicator& m = *mesh();
  const int n = m.size(), me = m.rank();
  if (n < 3) GTEST_SKIP() << "array_split and torch.chunk agree for H = 10 on " << n << " ranks";
  const int64_t h = 10, base = h / n, extra = h % n;
  auto split_width = [&](int r) { return base + (r < extra ? 1 : 0); };
  int bad = -1;
  for (int r = 0; r < n && bad < 0; ++r)
    if (split_width(r) != torch_chunk(h, n, r).length) bad = r;
  ASSERT_GE(bad, 0);
  const Tensor tokens = random_rows(DType::kF32, 4, h, 21);
  const Tensor piece = columns(tokens, base * me + std::min<int64_t>(me, extra), split_width(me));
  const int wrong = split_width(me) != torch_chunk(h, n, me).length ? me : bad;
  const std::string needle =
      "tokens local shape [4, " + std::to_string(split_width(wrong)) +
      "] is inconsistent with global shape [4, 10] placed Shard(1) on rank " +
      std::to_string(wrong) + " of " + std::to_string(n) + " (expected [4, " +
      std::to_string(torch_chunk(h, n, wrong).length) + "])";
  test::expect_collective_error(
      [&] {
        redistribute(m, DTensor::from_local(piece, Shard(1), {4, h}), Replicate(), "tokens");
      },
      me, wrong, ErrorKind::kInvalidArgument, {needle});
}

TEST(ShardingAdversarial, ARankWithAnEmptyPieceStillRunsTheKernelsChecks) {
  // H = n - 1: the last rank holds no columns. A bad index must fail on EVERY rank (the kernel's
  // checks do not depend on H), not only on the ranks that hold data.
  const Communicator& m = *mesh();
  const int n = m.size();
  if (n < 2) GTEST_SKIP() << "needs an empty piece";
  const int64_t h = n - 1;
  Tensor permuted = random_rows(DType::kF32, 3, h, 31);
  Tensor sorted = Tensor::empty(DType::kI32, {3});
  for (int i = 0; i < 3; ++i) sorted.ptr<int32_t>()[i] = i == 1 ? 77 : i;
  const DTensor pt = place(permuted, Shard(1));
  EXPECT_EQ(pt.local.shape[1], m.rank() == n - 1 ? 0 : 1);
  for (int op = 0; op < 3; ++op) {
    SCOPED_TRACE("op " + std::to_string(op));
    try {
      if (op == 0) {
        sharded::unpermute(m,
                           {.permuted_tokens = pt, .sorted_indices = place(sorted, Replicate())});
      } else if (op == 1) {
        sharded::permute_grad_v2(m, {.grad_permuted_tokens = pt,
                                     .sorted_indices = place(sorted, Replicate()),
                                     .tokens_rows = 3,
                                     .tokens_dtype = DType::kF32,
                                     .num_topk = 1});
      } else {
        sharded::unpermute_grad_v2(m, {.grad_out = pt,
                                       .sorted_indices = place(sorted, Replicate()),
                                       .permuted_rows = 3,
                                       .permuted_dtype = DType::kF32});
      }
      ADD_FAILURE() << "no error on rank " << m.rank();
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("on rank " + std::to_string(m.rank())),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("77"), std::string::npos) << e.what();
    }
  }
  // The mesh is still usable.
  expect_gathers_to(pt, permuted, "after the kernel errors");
}

// ---------------------------------------------------------------------------------------------
// Strided pieces.

TEST(ShardingAdversarial, PaddedAndColumnStridedLocalPieces) {
  // Local pieces inside larger buffers (row padding, an offset start) and with strided columns
  // (stride 2: a view of every other element). Redistribution copies any non-negative strides;
  // the ops must give the same result as with contiguous pieces.
  const Communicator& m = *mesh();
  const int64_t N = 5, H = 7, K = 2;
  const Tensor tokens = random_rows(DType::kBF16, N, H, 41);
  const Tensor idx = random_indices(N, K, 4, 42);
  const Tensor probs = random_rows(DType::kBF16, N, K, 43);
  const Tensor grad_out = random_rows(DType::kBF16, N, H, 44);
  const auto pr =
      moe_ep::permute({.tokens = tokens, .indices = idx, .num_out_tokens = std::nullopt});
  const auto want_out = moe_ep::unpermute({.permuted_tokens = pr.permuted_tokens,
                                           .sorted_indices = pr.sorted_indices,
                                           .probs = probs.view(),
                                           .padded_mode = false,
                                           .restore_shape = std::nullopt});
  const auto want_g = moe_ep::unpermute_grad({.permuted_tokens = pr.permuted_tokens,
                                              .grad_out = grad_out,
                                              .sorted_indices = pr.sorted_indices,
                                              .probs = probs.view(),
                                              .padded_mode = false,
                                              .restore_shape = std::nullopt});
  for (const int64_t col_stride : {int64_t{1}, int64_t{2}})
    for (const Placement p : {Replicate(), Shard(0), Shard(1)}) {
      const std::string what = p.to_string() + " col_stride " + std::to_string(col_stride) +
                               " np " + std::to_string(m.size());
      SCOPED_TRACE(what);
      Tensor s1, s2, s3;
      const DTensor t = distribute(strided_copy(tokens, 3, col_stride, s1), p, m.size(), m.rank());
      const DTensor pt =
          distribute(strided_copy(pr.permuted_tokens, 1, col_stride, s2), p, m.size(), m.rank());
      const DTensor go =
          distribute(strided_copy(grad_out, 2, col_stride, s3), p, m.size(), m.rank());
      // Redistribution of the strided pieces.
      for (const Placement to : {Replicate(), Shard(0), Shard(1)})
        expect_gathers_to(redistribute(m, t, to, "tokens"), tokens, "tokens -> " + to.to_string());
      auto r = sharded::permute(m, {.tokens = t, .indices = place(idx, Replicate())});
      expect_gathers_to(r.permuted_tokens, pr.permuted_tokens, "permuted_tokens");
      auto u = sharded::unpermute(m, {.permuted_tokens = pt,
                                      .sorted_indices = place(pr.sorted_indices, Replicate()),
                                      .probs = place(probs, Replicate())});
      expect_gathers_to(u.out, want_out, "unpermute out");
      auto g = sharded::unpermute_grad(m, {.permuted_tokens = pt,
                                           .grad_out = go,
                                           .sorted_indices = place(pr.sorted_indices, Replicate()),
                                           .probs = place(probs, Replicate())});
      expect_gathers_to(g.grad_permuted_tokens, want_g.grad_permuted_tokens,
                        "grad_permuted_tokens");
      ASSERT_TRUE(g.grad_probs.has_value());
      if (g.choice.index == 0) expect_gathers_to(*g.grad_probs, want_g.grad_probs, "grad_probs");
    }
}

// ---------------------------------------------------------------------------------------------
// Partial.

// Rank r's value of element i of a Partial built so that the fp32 sum depends on the order:
// rank 0 adds 2^24, the others 1 or -2^24 in turn (2^24 + 1 rounds back to 2^24).
float order_sensitive(int r, int64_t i) {
  if (r == 0) return 16777216.0f * ((i % 2) ? 1.0f : -1.0f);
  if (r % 2 == 1) return 1.0f + static_cast<float>(i % 3);
  return 16777216.0f * ((i % 2) ? -1.0f : 1.0f);
}

TEST(ShardingAdversarial, PartialSumsInRankOrderWhateverTheTarget) {
  const Communicator& m = *mesh();
  const int n = m.size(), me = m.rank();
  for (const DType global : {DType::kF32, DType::kBF16, DType::kF16})
    for (const auto& shape : std::vector<std::vector<int64_t>>{{2, 3}, {5, 1}, {1, 1}, {3, 9}}) {
      const int64_t numel = shape[0] * shape[1];
      Tensor mine = Tensor::empty(DType::kF32, shape);
      for (int64_t i = 0; i < numel; ++i) mine.ptr<float>()[i] = order_sensitive(me, i);
      DTensor x = DTensor::from_local(mine, Partial(), shape);
      x.dtype = global;
      Tensor want = Tensor::empty(global, shape);
      for (int64_t i = 0; i < numel; ++i) {
        float acc = order_sensitive(0, i);
        for (int r = 1; r < n; ++r) acc += order_sensitive(r, i);
        ref::store(global, want.data(), i, acc);
      }
      const std::string what = std::string(dtype_name(global)) + " [" + std::to_string(shape[0]) +
                               ", " + std::to_string(shape[1]) + "]";
      SCOPED_TRACE(what);
      for (const Placement to : {Replicate(), Shard(0), Shard(1)}) {
        const DTensor y = redistribute(m, x, to, "x");
        EXPECT_EQ(y.local.dtype, global) << to.to_string();
        EXPECT_EQ(y.global_dtype(), global) << to.to_string();
        expect_gathers_to(y, want, "Partial -> " + to.to_string());
      }
    }
}

TEST(ShardingAdversarial, StridedPartialPieces) {
  const Communicator& m = *mesh();
  const int n = m.size();
  const Tensor full = random_rows(DType::kBF16, 4, 6, 51 + static_cast<uint64_t>(m.rank()));
  Tensor storage;
  const TensorView v = strided_copy(full, 5, 2, storage);
  const DTensor x = DTensor::from_local(v, Partial(), {4, 6});
  Tensor want = Tensor::empty(DType::kBF16, {4, 6});
  for (int64_t i = 0; i < 24; ++i) {
    float acc = 0;
    for (int r = 0; r < n; ++r) {
      const Tensor pr = random_rows(DType::kBF16, 4, 6, 51 + static_cast<uint64_t>(r));
      acc = r == 0 ? ref::load(DType::kBF16, pr.data(), i)
                   : acc + ref::load(DType::kBF16, pr.data(), i);
    }
    ref::store(DType::kBF16, want.data(), i, acc);
  }
  for (const Placement to : {Replicate(), Shard(0), Shard(1)})
    expect_gathers_to(redistribute(m, x, to, "x"), want, "strided Partial -> " + to.to_string());
}

TEST(ShardingAdversarial, PartialTokensAndProbsGoIntoTheOps) {
  // tokens Partial with fp32 pieces of a bf16 tensor, probs Partial with fp32 pieces of an fp32
  // tensor: the ops reduce them (rank order, one rounding) and then equal the single-process ops
  // on the reduced tensors.
  const Communicator& m = *mesh();
  const int n = m.size(), me = m.rank();
  const int64_t N = 5, H = 6, K = 2;
  auto piece = [&](int r, int64_t rows, int64_t cols, uint64_t seed) {
    return random_rows(DType::kF32, rows, cols, seed + 97 * static_cast<uint64_t>(r));
  };
  auto reduced = [&](DType dt, int64_t rows, int64_t cols, uint64_t seed) {
    Tensor t = Tensor::empty(dt, {rows, cols});
    for (int64_t i = 0; i < rows * cols; ++i) {
      float acc = piece(0, rows, cols, seed).ptr<float>()[i];
      for (int r = 1; r < n; ++r) acc += piece(r, rows, cols, seed).ptr<float>()[i];
      ref::store(dt, t.data(), i, acc);
    }
    return t;
  };
  const Tensor tokens = reduced(DType::kBF16, N, H, 61);
  const Tensor probs = reduced(DType::kF32, N, K, 62);
  const Tensor idx = random_indices(N, K, 4, 63);
  DTensor tp = DTensor::from_local(piece(me, N, H, 61), Partial(), {N, H});
  tp.dtype = DType::kBF16;
  const DTensor pp = DTensor::from_local(piece(me, N, K, 62), Partial(), {N, K});
  const auto pr =
      moe_ep::permute({.tokens = tokens, .indices = idx, .num_out_tokens = std::nullopt});
  auto r = sharded::permute(m, {.tokens = tp, .indices = place(idx, Replicate())});
  EXPECT_EQ(r.choice.index, n > 1 ? 1 : 0);  // reduce-scatter beats all-reduce
  expect_gathers_to(r.permuted_tokens, pr.permuted_tokens, "permuted_tokens from Partial tokens");
  const Tensor want = moe_ep::unpermute({.permuted_tokens = pr.permuted_tokens,
                                         .sorted_indices = pr.sorted_indices,
                                         .probs = probs.view(),
                                         .padded_mode = false,
                                         .restore_shape = std::nullopt});
  auto u = sharded::unpermute(
      m, {.permuted_tokens = r.permuted_tokens, .sorted_indices = r.sorted_indices, .probs = pp});
  expect_gathers_to(u.out, want, "unpermute with Partial probs");
}

TEST(ShardingAdversarial, GradProbsIsAPartialOfFp32PiecesInProbsDtype) {
  // fp16 probs with bf16 activations: strategy S returns fp32 pieces labelled fp16; reducing them
  // to any placement (Shard(0) with N < n leaves ranks without rows) gives fp16, rounded once.
  const Communicator& m = *mesh();
  const int n = m.size();
  const int64_t N = 2, H = 9, K = 3;
  const Tensor permuted = random_rows(DType::kBF16, N * K, H, 71);
  const Tensor grad_out = random_rows(DType::kBF16, N, H, 72);
  const Tensor probs = random_rows(DType::kF16, N, K, 73);
  Tensor sorted = Tensor::empty(DType::kI32, {N * K});
  for (int64_t i = 0; i < N * K; ++i)
    sorted.ptr<int32_t>()[i] = static_cast<int32_t>(N * K - 1 - i);
  auto g = sharded::unpermute_grad(m, {.permuted_tokens = place(permuted, Shard(1)),
                                       .grad_out = place(grad_out, Shard(1)),
                                       .sorted_indices = place(sorted, Replicate()),
                                       .probs = place(probs, Replicate())});
  ASSERT_TRUE(g.grad_probs.has_value());
  const DTensor& gp = *g.grad_probs;
  EXPECT_EQ(gp.global_dtype(), DType::kF16);
  EXPECT_EQ(gp.local.dtype, n > 1 ? DType::kF32 : DType::kF16);
  EXPECT_EQ(spec_of(gp).dtype, DType::kF16);
  // The expected value: the rank-order sum of the fp32 pieces, rounded once.
  const int64_t cnt = N * K;
  std::vector<float> all(static_cast<std::size_t>(cnt * n));
  Tensor mine32 = Tensor::empty(DType::kF32, {N, K});
  for (int64_t i = 0; i < cnt; ++i)
    mine32.ptr<float>()[i] = ref::load(gp.local.dtype, gp.local.data, i);
  MPI_Allgather(mine32.data(), static_cast<int>(cnt), MPI_FLOAT, all.data(), static_cast<int>(cnt),
                MPI_FLOAT, MPI_COMM_WORLD);
  Tensor want = Tensor::empty(DType::kF16, {N, K});
  for (int64_t i = 0; i < cnt; ++i) {
    float acc = all[i];
    for (int r = 1; r < n; ++r) acc += all[r * cnt + i];
    ref::store(DType::kF16, want.data(), i, acc);
  }
  for (const Placement to : {Replicate(), Shard(0), Shard(1)}) {
    const DTensor y = redistribute(m, gp, to, "grad_probs");
    EXPECT_EQ(y.local.dtype, DType::kF16) << to.to_string();
    expect_gathers_to(y, want, "grad_probs -> " + to.to_string());
  }
}

void expect_fails_like_single_process(const Communicator& m, const Tensor& permuted,
                                      const Tensor& grad_out, const Tensor& sorted,
                                      const Tensor& probs) {
  std::string single;
  ErrorKind kind = ErrorKind::kInternal;
  try {
    moe_ep::unpermute_grad({.permuted_tokens = permuted,
                            .grad_out = grad_out,
                            .sorted_indices = sorted,
                            .probs = probs.view(),
                            .padded_mode = false,
                            .restore_shape = std::nullopt});
    ADD_FAILURE() << "the single-process op accepts these probs";
  } catch (const Error& e) {
    single = e.what();
    kind = e.kind();
  }
  try {
    sharded::unpermute_grad(m, {.permuted_tokens = place(permuted, Shard(1)),
                                .grad_out = place(grad_out, Shard(1)),
                                .sorted_indices = place(sorted, Replicate()),
                                .probs = place(probs, Replicate())});
    ADD_FAILURE() << "no error on rank " << m.rank();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string(e.what()).find(single), std::string::npos)
        << e.what() << "\nsingle-process: " << single;
  }
}

TEST(ShardingAdversarial, BadProbsFailLikeTheSingleProcessOp) {
  // 1-D probs and int32 probs under strategy S: the same error as the single-process op, on every
  // rank (not a confusing one from widening probs to fp32 first, nor an int tensor accepted).
  const Communicator& m = *mesh();
  const int64_t N = 4, H = 8;
  const Tensor permuted = random_rows(DType::kBF16, N, H, 81);
  const Tensor grad_out = random_rows(DType::kBF16, N, H, 82);
  Tensor sorted = Tensor::empty(DType::kI32, {N});
  for (int64_t i = 0; i < N; ++i) sorted.ptr<int32_t>()[i] = static_cast<int32_t>(i);
  for (const bool one_d : {true, false}) {
    SCOPED_TRACE(one_d ? "1-D bf16 probs" : "int32 probs");
    Tensor probs = one_d ? Tensor::zeros(DType::kBF16, {N}) : Tensor::zeros(DType::kI32, {N, 1});
    expect_fails_like_single_process(m, permuted, grad_out, sorted, probs);
  }
}
// ---------------------------------------------------------------------------------------------
// Owners and aliases.

TEST(ShardingAdversarial, AnOwnerLargerThanTheLocalPiece) {
  // A DTensor may keep alive a buffer larger than its piece (e.g. a flat storage whose start the
  // piece views). Redistribution and full_tensor must use the piece, not the owner's shape.
  const Communicator& m = *mesh();
  const int64_t rows = 3, cols = 4;
  const Tensor full = random_rows(DType::kF32, rows, cols, 91);
  Tensor flat = Tensor::empty(DType::kF32, {rows * cols + 7});
  std::memcpy(flat.data(), full.data(), full.nbytes());
  DTensor rep = DTensor::from_local(flat, Replicate(), {rows, cols});
  rep.local = full.view();
  rep.local.data = flat.data();
  const Tensor got = full_tensor(m, rep, "rep");
  EXPECT_TRUE(same_bits(got, full)) << "full_tensor of a Replicate whose owner is larger";
  for (const Placement to : {Shard(0), Shard(1)})
    expect_gathers_to(redistribute(m, rep, to, "rep"), full, "Replicate -> " + to.to_string());
  // A Partial whose owner is a flat buffer: rank 0 holds the values, the others zeros.
  Tensor pflat = Tensor::zeros(DType::kF32, {rows * cols + 5});
  if (m.rank() == 0) std::memcpy(pflat.data(), full.data(), full.nbytes());
  DTensor part = DTensor::from_local(pflat, Partial(), {rows, cols});
  part.local = full.view();
  part.local.data = pflat.data();
  for (const Placement to : {Replicate(), Shard(0), Shard(1)})
    expect_gathers_to(redistribute(m, part, to, "part"), full, "Partial -> " + to.to_string());
}

// ---------------------------------------------------------------------------------------------
// Arguments that differ on one rank: every rank throws kInvalidArgument, nobody hangs, and the
// header exchange completed, so the mesh stays usable.

TEST(ShardingAdversarial, ArgumentsDifferingOnOneRankThrowEverywhere) {
  const Communicator& m = *mesh();
  const int n = m.size(), me = m.rank(), last = n - 1;
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  const bool odd = me == last;
  const int64_t N = 4, H = 10;
  const Tensor tokens = random_rows(DType::kF32, N, H, 101);
  const Tensor tokens_bf = random_rows(DType::kBF16, N, H, 101);
  const Tensor wide = random_rows(DType::kF32, N, H + 1, 102);
  const Tensor idx = random_indices(N, 1, 3, 103);
  const Tensor probs = random_rows(DType::kF32, N, 1, 104);
  const auto pr =
      moe_ep::permute({.tokens = tokens, .indices = idx, .num_out_tokens = std::nullopt});
  const DTensor pt = place(pr.permuted_tokens, Shard(1));
  const DTensor si = place(pr.sorted_indices, Replicate());
  struct Probe {
    std::string name;
    std::function<void()> call;
    std::string needle;
  };
  const std::string rl = "rank " + std::to_string(last) + " has ";
  const std::vector<Probe> probes = {
      {"num_out_tokens",
       [&] {
         sharded::permute(m, {.tokens = place(tokens, Shard(1)),
                              .indices = place(idx, Replicate()),
                              .num_out_tokens = odd ? std::optional<int64_t>(2) : std::nullopt});
       },
       "num_out_tokens is given differs across ranks: rank 0 has false, " + rl + "true"},
      {"num_topk",
       [&] {
         sharded::permute_grad_v2(m, {.grad_permuted_tokens = pt,
                                      .sorted_indices = si,
                                      .tokens_rows = N,
                                      .tokens_dtype = DType::kF32,
                                      .num_topk = odd ? 2 : 1});
       },
       "num_topk differs across ranks: rank 0 has 1, " + rl + "2"},
      {"probs on one rank",
       [&] {
         std::optional<DTensor> p;
         if (!odd) p = place(probs, Replicate());
         sharded::unpermute(m, {.permuted_tokens = pt, .sorted_indices = si, .probs = p});
       },
       "probs is given differs across ranks: rank 0 has true, " + rl + "false"},
      {"restore_shape",
       [&] {
         sharded::unpermute(m, {.permuted_tokens = pt,
                                .sorted_indices = si,
                                .restore_shape = std::vector<int64_t>{odd ? N + 1 : N, H}});
       },
       "restore_shape[0] differs across ranks"},
      {"target placement",
       [&] { redistribute(m, place(tokens, Shard(1)), odd ? Shard(0) : Replicate(), "x"); },
       "target placement differs across ranks: rank 0 has Replicate, " + rl + "Shard(0)"},
      {"dtype",
       [&] { redistribute(m, place(odd ? tokens_bf : tokens, Shard(1)), Replicate(), "x"); },
       "x dtype differs across ranks: rank 0 has fp32, " + rl + "bf16"},
      {"global shape",
       [&] { redistribute(m, place(odd ? wide : tokens, Shard(1)), Replicate(), "x"); },
       "x global_shape[1] differs across ranks: rank 0 has 10, " + rl + "11"},
      {"Partial pieces' dtype",
       [&] {
         DTensor x = DTensor::from_local(odd ? tokens : tokens_bf, Partial(), {N, H});
         x.dtype = DType::kBF16;
         redistribute(m, x, Replicate(), "x");
       },
       "x local dtype differs across ranks: rank 0 has bf16, " + rl + "fp32"},
      {"different collectives",
       [&] {
         if (odd) {
           redistribute(m, place(tokens, Shard(1)), Replicate(), "x");
         } else {
           sharded::permute(
               m, {.tokens = place(tokens, Shard(1)), .indices = place(idx, Replicate())});
         }
       },
       "the ranks called different collectives"},
  };
  for (const Probe& p : probes) {
    SCOPED_TRACE(p.name);
    test::expect_collective_error(p.call, me, -1, ErrorKind::kInvalidArgument, {p.needle});
    expect_gathers_to(place(tokens, Shard(1)), tokens, "the mesh after " + p.name);
  }
}

TEST(ShardingAdversarial, ABadPieceOnTheRankWithAnEmptyPiece) {
  // H = n - 1: the last rank should hold (4, 0) and passes (4, 1): it throws, the others kRemote.
  const Communicator& m = *mesh();
  const int n = m.size(), last = n - 1;
  if (n < 2) GTEST_SKIP() << "needs an empty piece";
  const int64_t h = n - 1;
  const Tensor tokens = random_rows(DType::kF32, 4, h, 111);
  const Tensor one = random_rows(DType::kF32, 4, 1, 112);
  DTensor x = place(tokens, Shard(1));
  if (m.rank() == last) x = DTensor::from_local(one, Shard(1), {4, h});
  test::expect_collective_error(
      [&] { redistribute(m, x, Replicate(), "tokens"); }, m.rank(), last,
      ErrorKind::kInvalidArgument,
      {"tokens local shape [4, 1] is inconsistent with global shape [4, " + std::to_string(h) +
       "] placed Shard(1) on rank " + std::to_string(last) + " of " + std::to_string(n) +
       " (expected [4, 0])"});
  // Null data with elements, on one rank.
  DTensor y = place(tokens, Shard(1));
  if (m.rank() == 0) y.local.data = nullptr;
  test::expect_collective_error([&] { redistribute(m, y, Replicate(), "tokens"); }, m.rank(), 0,
                                ErrorKind::kInvalidArgument, {"data is null"});
}

// A rank that arrives after the others' deadline: every rank throws kTimeout (the others in the
// header phase, the late one in the data phase), on a communicator of its own. Runs last.
TEST(ShardingAdversarial, ZzLateRankEveryoneTimesOut) {
  const int n = mesh()->size(), me = mesh()->rank();
  if (n < 2) GTEST_SKIP() << "needs a late rank";
  CommOptions opt;
  opt.timeout_s = 0.5;
  auto own = Communicator::from_mpi(MPI_COMM_WORLD, opt);
  const Tensor tokens = random_rows(DType::kF32, 4, 10, 121);
  if (me == n - 1) std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    redistribute(*own, distribute(tokens.view(), Shard(1), n, me), Replicate(), "tokens");
    ADD_FAILURE() << "no timeout on rank " << me;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("timed out after 0.5 s"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace moe_ep
