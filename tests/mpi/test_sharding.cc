// SPEC §5: sharded permute / unpermute and redistribution, on meshes of 1 to 4 ranks (the binary
// runs at np 1, 2, 3, 4). Every rank builds the same global inputs from a fixed seed, places them
// (Replicate, Shard(0), Shard(1)), runs the sharded op, gathers the outputs and compares them with
// the single-process op of moe_ep/permute.h on the global inputs: bitwise, except grad_probs (a
// Partial of per-shard dot products), which must equal the rank-order fp32 sum of the gathered
// pieces bitwise and the single-process value within fp32 summation error.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
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

std::string pname(Placement p) { return p.to_string(); }

// A (rows, h) float tensor of values in [-2, 2) (rounded to dtype), the same on every rank.
Tensor random_rows(DType dtype, int64_t rows, int64_t h, uint64_t seed) {
  Tensor t = Tensor::empty(dtype, {rows, h});
  SplitMix64 rng{seed};
  for (int64_t i = 0; i < rows * h; ++i)
    ref::store(dtype, t.data(), i, static_cast<float>(rng.below(1 << 16)) / 16384.0f - 2.0f);
  return t;
}

Tensor random_indices(DType dtype, int64_t n, int64_t topk, int64_t experts, uint64_t seed) {
  Tensor t = topk == 1 && seed % 2 ? Tensor::empty(dtype, {n}) : Tensor::empty(dtype, {n, topk});
  SplitMix64 rng{seed};
  for (int64_t i = 0; i < n * topk; ++i) {
    const int64_t e = rng.below(experts);
    if (dtype == DType::kI64) {
      t.ptr<int64_t>()[i] = e;
    } else {
      t.ptr<int32_t>()[i] = static_cast<int32_t>(e);
    }
  }
  return t;
}

DTensor place(const Tensor& full, Placement p) {
  return distribute(full.view(), p, mesh()->size(), mesh()->rank());
}

// A contiguous copy of any strided view.
Tensor local_copy(const TensorView& v) {
  const std::vector<int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
  Tensor t = Tensor::empty(v.dtype, shape);
  const int64_t es = static_cast<int64_t>(dtype_size(v.dtype));
  std::vector<int64_t> idx(static_cast<std::size_t>(v.ndim), 0);
  for (int64_t e = 0; e < t.numel(); ++e) {
    int64_t off = 0;
    for (int d = 0; d < v.ndim; ++d) off += idx[d] * v.strides[d];
    std::memcpy(t.ptr<char>() + e * es, static_cast<const char*>(v.data) + off * es,
                static_cast<std::size_t>(es));
    for (int d = v.ndim - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
  return t;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.ndim() != b.ndim()) return false;
  for (int d = 0; d < a.ndim(); ++d)
    if (a.size(d) != b.size(d)) return false;
  return a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Gathers x and compares it with `want` bit for bit; also checks the placement and global shape.
void expect_full(const DTensor& x, const Tensor& want, Placement placement,
                 const std::string& what) {
  EXPECT_EQ(pname(x.placement), pname(placement)) << what;
  std::vector<int64_t> shape(want.view().shape.begin(), want.view().shape.begin() + want.ndim());
  EXPECT_EQ(x.global_shape, shape) << what;
  const Tensor got = full_tensor(*mesh(), x, what.c_str());
  EXPECT_TRUE(same_bits(got, want))
      << what << ": gathered result differs from the single-process op";
}

// Checks the strategy an op chose and returns it. R when the token-like inputs are Replicate, on
// one rank or empty (both cost 0; the tie goes to R); S when they are Shard(1) and hold data (free
// for S, an all-gather for R). From Shard(0) it depends on the sizes (an all-to-all for S, an
// all-gather for R: with uneven or empty pieces they can tie, e.g. H = 1), so only the cost rule's
// own bookkeeping is checked there (the rule itself: tests/unit/test_sharding_rules.cc).
int checked_strategy(const StrategyChoice& c, Placement tokens, int64_t numel) {
  if (mesh()->size() == 1 || tokens.is_replicate() || numel == 0) {
    EXPECT_EQ(c.index, 0) << "expected R";
  } else if (tokens.is_shard(1)) {
    EXPECT_EQ(c.index, 1) << "expected S";
  }
  EXPECT_EQ(c.strategy.name, c.index ? "S" : "R");
  int64_t sum = 0;
  for (const Redistribution& d : c.redistributions) sum += d.recv_bytes;
  EXPECT_EQ(c.cost_bytes, sum);
  return c.index;
}

Placement hidden(int strategy) { return strategy ? Shard(1) : Replicate(); }

// grad_probs from the sharded op against the single-process one.
void expect_grad_probs(const std::optional<DTensor>& got, const Tensor& want, int strategy,
                       const Tensor& grad_out, const Tensor& permuted, const Tensor& sorted,
                       const std::string& what) {
  if (!want.defined()) {
    EXPECT_FALSE(got.has_value()) << what << ": grad_probs must be absent without probs";
    return;
  }
  ASSERT_TRUE(got.has_value()) << what;
  if (strategy == 0) {
    expect_full(*got, want, Replicate(), what + " grad_probs");
    return;
  }
  const int n = mesh()->size();
  EXPECT_EQ(pname(got->placement), "Partial(sum)") << what;
  EXPECT_EQ(got->local.dtype, DType::kF32) << what;
  EXPECT_EQ(got->global_dtype(), want.dtype()) << what;
  // The pieces, gathered with plain MPI, summed in rank order in fp32 and rounded once.
  const int64_t cnt = want.numel();
  std::vector<float> mine(got->local.ptr<float>(), got->local.ptr<float>() + cnt);
  std::vector<float> all(static_cast<std::size_t>(cnt * n));
  MPI_Allgather(mine.data(), static_cast<int>(cnt), MPI_FLOAT, all.data(), static_cast<int>(cnt),
                MPI_FLOAT, MPI_COMM_WORLD);
  Tensor summed = Tensor::empty(want.dtype(), {want.size(0), want.size(1)});
  for (int64_t i = 0; i < cnt; ++i) {
    float acc = all[i];
    for (int r = 1; r < n; ++r) acc += all[r * cnt + i];
    ref::store(want.dtype(), summed.data(), i, acc);
  }
  const Tensor reduced = full_tensor(*mesh(), *got, "grad_probs");
  EXPECT_TRUE(same_bits(reduced, summed))
      << what << ": Partial -> Replicate is not the rank-order sum";
  // Within fp32 summation error of the single-process dot product (then one rounding).
  const int64_t topk = want.size(1), h = grad_out.size(1);
  const double out_eps = want.dtype() == DType::kBF16  ? 1.0 / 128
                         : want.dtype() == DType::kF16 ? 1.0 / 1024
                                                       : 0.0;
  for (int64_t i = 0; i < want.size(0); ++i)
    for (int64_t k = 0; k < topk; ++k) {
      const int64_t s = sorted.ptr<int32_t>()[i * topk + k];
      double mag = 0;
      if (s < permuted.size(0))
        for (int64_t c = 0; c < h; ++c)
          mag += std::fabs(ref::at(grad_out.view(), i, c) * ref::at(permuted.view(), s, c));
      const double a = ref::at(reduced.view(), i, k), b = ref::at(want.view(), i, k);
      const double tol = 4.0 * h * 1.2e-7 * mag + out_eps * std::fabs(b) + 1e-30;
      EXPECT_LE(std::fabs(a - b), tol)
          << what << ": grad_probs[" << i << "," << k << "] = " << a << ", single-process " << b;
    }
}

struct Case {
  DType dtype;
  int64_t n, h, topk;
  std::optional<int64_t> num_out_tokens;
  DType index_dtype = DType::kI32;
};

std::string case_name(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " N=" + std::to_string(c.n) +
         " H=" + std::to_string(c.h) + " topK=" + std::to_string(c.topk) +
         " num_out_tokens=" + (c.num_out_tokens ? std::to_string(*c.num_out_tokens) : "None");
}

const Placement kPlacements[] = {Replicate(), Shard(0), Shard(1)};

std::vector<Case> cases() {
  return {
      {DType::kBF16, 6, 12, 2, std::nullopt},    // H divisible by 1..4
      {DType::kF32, 5, 10, 2, -3, DType::kI64},  // H = 10: 3, 3, 3, 1 (np 4), 4, 4, 2 (np 3)
      {DType::kF16, 7, 3, 1, 4},                 // H < mesh size at np 4: an empty shard
      {DType::kBF16, 0, 9, 2, std::nullopt},     // no tokens
      {DType::kF32, 9, 1000, 3, -2},             // wide rows: 334, 334, 332 on 3 ranks
      // Uneven torch.chunk pieces with EMPTY trailing shards at np 4 (and np 3 / np 2):
      {DType::kBF16, 5, 5, 2, std::nullopt},    // H, N = 5: 2, 2, 1, 0
      {DType::kF32, 3, 6, 1, -1, DType::kI64},  // H = 6: 2, 2, 2, 0; N = 3: 1, 1, 1, 0
      {DType::kF16, 2, 1, 2, std::nullopt},     // H = 1: 1, 0, 0, 0; N = 2: 1, 1, 0, 0
  };
}

TEST(Sharding, EveryOpEveryPlacementMatchesTheSingleProcessOp) {
  const Communicator& m = *mesh();
  uint64_t seed = 1;
  for (const Case& c : cases()) {
    const int64_t experts = 5, m_entries = c.n * c.topk;
    const Tensor tokens = random_rows(c.dtype, c.n, c.h, seed++);
    const Tensor indices = random_indices(c.index_dtype, c.n, c.topk, experts, seed++);
    const Tensor probs =
        random_rows(c.dtype == DType::kF16 ? DType::kF32 : c.dtype, c.n, c.topk, seed++);
    // The single-process ops on the global inputs.
    const moe_ep::PermuteResult pr =
        moe_ep::permute({.tokens = tokens, .indices = indices, .num_out_tokens = c.num_out_tokens});
    const Tensor& sorted = pr.sorted_indices;
    const int64_t rows = pr.permuted_tokens.size(0);
    const Tensor grad_permuted = random_rows(c.dtype, rows, c.h, seed++);
    const Tensor grad_out = random_rows(c.dtype, c.n, c.h, seed++);
    const Tensor grad_out_m = random_rows(c.dtype, m_entries, c.h, seed++);  // without probs
    const Tensor& permuted = pr.permuted_tokens;

    for (int pi = 0; pi < 3; ++pi)
      for (int qi = 0; qi < 2; ++qi) {
        const Placement p = kPlacements[pi], q = kPlacements[qi];
        const Placement pp = kPlacements[(pi + qi) % 3];  // probs
        const int64_t numel = c.n * c.h;
        const std::string what = case_name(c) + " tokens " + pname(p) + " indices " + pname(q) +
                                 " probs " + pname(pp) + " np " + std::to_string(m.size());
        SCOPED_TRACE(what);
        // permute
        {
          auto r = sharded::permute(m, {.tokens = place(tokens, p),
                                        .indices = place(indices, q),
                                        .num_out_tokens = c.num_out_tokens});
          const int st = checked_strategy(r.choice, p, numel);
          expect_full(r.permuted_tokens, pr.permuted_tokens, hidden(st), "permuted_tokens");
          expect_full(r.sorted_indices, sorted, Replicate(), "sorted_indices");
        }
        // permute_grad and permute_grad_v2
        {
          const Tensor want = moe_ep::permute_grad({.tokens = tokens,
                                                    .grad_permuted_tokens = grad_permuted,
                                                    .indices = indices,
                                                    .sorted_indices = sorted});
          auto r = sharded::permute_grad(m, {.tokens = place(tokens, p),
                                             .grad_permuted_tokens = place(grad_permuted, p),
                                             .indices = place(indices, q),
                                             .sorted_indices = place(sorted, q)});
          const int st = checked_strategy(r.choice, p, numel);
          for (const Redistribution& d : r.choice.redistributions)
            EXPECT_NE(d.arg, "tokens") << "permute_grad reads only tokens' shape";
          expect_full(r.grad_tokens, want, hidden(st), "permute_grad grad_tokens");
          auto r2 = sharded::permute_grad_v2(m, {.grad_permuted_tokens = place(grad_permuted, p),
                                                 .sorted_indices = place(sorted, q),
                                                 .tokens_rows = c.n,
                                                 .tokens_dtype = c.dtype,
                                                 .num_topk = c.topk});
          expect_full(r2.grad_tokens, want, hidden(checked_strategy(r2.choice, p, numel)),
                      "permute_grad_v2 grad_tokens");
        }
        for (const bool with_probs : {true, false}) {
          const std::string w = with_probs ? " with probs" : " without probs";
          std::optional<TensorView> lp;
          std::optional<DTensor> dp;
          if (with_probs) {
            lp = probs.view();
            dp = place(probs, pp);
          }
          // unpermute and unpermute_with_saved
          const Tensor want = moe_ep::unpermute({.permuted_tokens = permuted,
                                                 .sorted_indices = sorted,
                                                 .probs = lp,
                                                 .padded_mode = false,
                                                 .restore_shape = std::nullopt});
          const int64_t out_rows = want.size(0);
          auto r = sharded::unpermute(m, {.permuted_tokens = place(permuted, p),
                                          .sorted_indices = place(sorted, q),
                                          .probs = dp,
                                          .restore_shape = std::vector<int64_t>{out_rows, c.h}});
          const int st = checked_strategy(r.choice, p, numel);
          expect_full(r.out, want, hidden(st), "unpermute out" + w);
          auto rs = sharded::unpermute_with_saved(m, {.permuted_tokens = place(permuted, p),
                                                      .sorted_indices = place(sorted, q),
                                                      .probs = dp});
          const int sts = checked_strategy(rs.choice, p, numel);
          expect_full(rs.out, want, hidden(sts), "unpermute_with_saved out" + w);
          expect_full(rs.permuted_tokens_for_backward, permuted, hidden(sts),
                      "unpermute_with_saved permuted_tokens_for_backward" + w);
          // unpermute_grad and unpermute_grad_v2
          const Tensor& go = with_probs ? grad_out : grad_out_m;
          const moe_ep::UnpermuteGradResult wg =
              moe_ep::unpermute_grad({.permuted_tokens = permuted,
                                      .grad_out = go,
                                      .sorted_indices = sorted,
                                      .probs = lp,
                                      .padded_mode = false,
                                      .restore_shape = std::nullopt});
          auto g = sharded::unpermute_grad(m, {.permuted_tokens = place(permuted, p),
                                               .grad_out = place(go, p),
                                               .sorted_indices = place(sorted, q),
                                               .probs = dp});
          const int stg = checked_strategy(g.choice, p, numel);
          expect_full(g.grad_permuted_tokens, wg.grad_permuted_tokens, hidden(stg),
                      "unpermute_grad grad_permuted_tokens" + w);
          expect_grad_probs(g.grad_probs, wg.grad_probs, stg, go, permuted, sorted,
                            "unpermute_grad" + w);
          for (const bool give_permuted : {true, false}) {
            if (with_probs && !give_permuted) continue;
            std::optional<DTensor> dperm;
            if (give_permuted) dperm = place(permuted, p);
            auto g2 = sharded::unpermute_grad_v2(m, {.grad_out = place(go, p),
                                                     .sorted_indices = place(sorted, q),
                                                     .permuted_rows = rows,
                                                     .permuted_dtype = c.dtype,
                                                     .probs = dp,
                                                     .permuted_tokens = dperm});
            const int st2 = checked_strategy(g2.choice, p, numel);
            expect_full(g2.grad_permuted_tokens, wg.grad_permuted_tokens, hidden(st2),
                        "unpermute_grad_v2 grad_permuted_tokens" + w);
            expect_grad_probs(g2.grad_probs, wg.grad_probs, st2, go, permuted, sorted,
                              "unpermute_grad_v2" + w);
          }
        }
      }
  }
}

TEST(Sharding, GradProbsPartialIsFp32AndSumsToTheFullValue) {
  // A case built so the per-shard dot products cancel: the fp32 partials must not be rounded to
  // bf16 before the sum (that would lose the small remainder).
  const Communicator& m = *mesh();
  const int64_t h = 8;
  Tensor permuted = Tensor::empty(DType::kBF16, {1, h});
  Tensor grad_out = Tensor::empty(DType::kBF16, {1, h});
  for (int64_t c = 0; c < h; ++c) {
    ref::store(DType::kBF16, permuted.data(), c, c < h / 2 ? 256.0f : -256.0f);
    ref::store(DType::kBF16, grad_out.data(), c, c == 0 ? 1.0078125f : 1.0f);
  }
  Tensor sorted = Tensor::empty(DType::kI32, {1});
  sorted.ptr<int32_t>()[0] = 0;
  Tensor probs = Tensor::empty(DType::kBF16, {1, 1});
  ref::store(DType::kBF16, probs.data(), 0, 1.0f);
  const auto want = moe_ep::unpermute_grad({.permuted_tokens = permuted,
                                            .grad_out = grad_out,
                                            .sorted_indices = sorted,
                                            .probs = probs.view(),
                                            .padded_mode = false,
                                            .restore_shape = std::nullopt});
  auto g = sharded::unpermute_grad(m, {.permuted_tokens = place(permuted, Shard(1)),
                                       .grad_out = place(grad_out, Shard(1)),
                                       .sorted_indices = place(sorted, Replicate()),
                                       .probs = place(probs, Replicate())});
  const Tensor full = full_tensor(m, *g.grad_probs);
  EXPECT_EQ(ref::at(full.view(), 0, 0), 2.0);  // 256 * 2^-7
  EXPECT_TRUE(same_bits(full, want.grad_probs));
}

// padded_mode (SPEC §4.1, Megatron's capacity layout) under both strategies: the gathered outputs
// equal the single-process op's; grad_probs (the table's shape) is Partial under S, and its sum is
// within fp32 summation error of the single-process dot product.
TEST(Sharding, PaddedModeUnderBothStrategies) {
  const Communicator& m = *mesh();
  const int64_t n = 6, h = 10, e = 3, c = 4;
  const Tensor tokens = random_rows(DType::kF32, n, h, 31);
  const Tensor y = random_rows(DType::kF32, e * c, h, 32);
  const Tensor grad_out = random_rows(DType::kF32, n, h, 33);
  const Tensor probs = random_rows(DType::kF32, e, c, 34);
  Tensor table = Tensor::empty(DType::kI64, {e, c});
  SplitMix64 rng{35};
  for (int64_t i = 0; i < e * c; ++i) table.ptr<int64_t>()[i] = rng.below(n - 1);
  const PermuteResult wp = moe_ep::permute({.tokens = tokens.view(),
                                            .indices = table.view(),
                                            .num_out_tokens = std::nullopt,
                                            .padded_mode = true});
  const Tensor wu = moe_ep::unpermute({.permuted_tokens = y.view(),
                                       .sorted_indices = table.view(),
                                       .probs = probs.view(),
                                       .padded_mode = true,
                                       .restore_shape = std::vector<int64_t>{n, h}});
  const moe_ep::UnpermuteGradResult wg = moe_ep::unpermute_grad({.permuted_tokens = y.view(),
                                                                 .grad_out = grad_out.view(),
                                                                 .sorted_indices = table.view(),
                                                                 .probs = probs.view(),
                                                                 .padded_mode = true,
                                                                 .restore_shape = std::nullopt});
  for (const Placement p : {Replicate(), Shard(1)}) {
    SCOPED_TRACE(pname(p));
    const Placement r = Replicate();
    auto rp = sharded::permute(
        m, {.tokens = place(tokens, p), .indices = place(table, r), .padded_mode = true});
    const int st = checked_strategy(rp.choice, p, tokens.numel());
    expect_full(rp.permuted_tokens, wp.permuted_tokens, hidden(st), "padded permute");
    expect_full(rp.sorted_indices, wp.sorted_indices, r, "padded permute sorted_indices");
    auto ru = sharded::unpermute(m, {.permuted_tokens = place(y, p),
                                     .sorted_indices = place(table, r),
                                     .probs = place(probs, r),
                                     .padded_mode = true,
                                     .restore_shape = std::vector<int64_t>{n, h}});
    expect_full(ru.out, wu, hidden(checked_strategy(ru.choice, p, y.numel())), "padded unpermute");
    auto rg = sharded::unpermute_grad(m, {.permuted_tokens = place(y, p),
                                          .grad_out = place(grad_out, p),
                                          .sorted_indices = place(table, r),
                                          .probs = place(probs, r),
                                          .padded_mode = true});
    const int sg = checked_strategy(rg.choice, p, y.numel());
    expect_full(rg.grad_permuted_tokens, wg.grad_permuted_tokens, hidden(sg),
                "padded unpermute_grad grad_permuted_tokens");
    ASSERT_TRUE(rg.grad_probs.has_value());
    EXPECT_EQ(pname(rg.grad_probs->placement), sg ? "Partial(sum)" : "Replicate");
    const Tensor got = full_tensor(m, *rg.grad_probs, "grad_probs");
    ASSERT_EQ(got.ndim(), 2);
    ASSERT_EQ(got.size(0), e);
    ASSERT_EQ(got.size(1), c);
    for (int64_t i = 0; i < e * c; ++i) {
      const double a = got.ptr<float>()[i], b = wg.grad_probs.ptr<float>()[i];
      EXPECT_LE(std::fabs(a - b), sg ? 1e-5 * (1 + std::fabs(b)) : 0.0) << "grad_probs " << i;
    }
  }
}

TEST(Sharding, PartialGradOutIsReduceScatteredToStrategyS) {
  // grad_out arrives as a Partial (e.g. from a row-parallel layer): rank 0 holds the values, the
  // others zeros, so the sum is exact and the result must equal the single-process op bitwise.
  const Communicator& m = *mesh();
  const int64_t n = 6, h = 10, topk = 2;
  const Tensor tokens = random_rows(DType::kBF16, n, h, 501);
  const Tensor idx = random_indices(DType::kI32, n, topk, 4, 502);
  const Tensor probs = random_rows(DType::kBF16, n, topk, 503);
  const Tensor grad_out = random_rows(DType::kBF16, n, h, 504);
  const auto pr = moe_ep::permute({.tokens = tokens, .indices = idx, .num_out_tokens = -1});
  const auto want = moe_ep::unpermute_grad({.permuted_tokens = pr.permuted_tokens,
                                            .grad_out = grad_out,
                                            .sorted_indices = pr.sorted_indices,
                                            .probs = probs.view(),
                                            .padded_mode = false,
                                            .restore_shape = std::nullopt});
  const Tensor mine = m.rank() == 0 ? grad_out : Tensor::zeros(DType::kBF16, {n, h});
  auto g = sharded::unpermute_grad(m, {.permuted_tokens = place(pr.permuted_tokens, Replicate()),
                                       .grad_out = DTensor::from_local(mine, Partial(), {n, h}),
                                       .sorted_indices = place(pr.sorted_indices, Replicate()),
                                       .probs = place(probs, Replicate())});
  const int st = m.size() > 1 ? 1 : 0;
  EXPECT_EQ(g.choice.index, st);
  expect_full(g.grad_permuted_tokens, want.grad_permuted_tokens, hidden(st),
              "grad_permuted_tokens from a Partial grad_out");
  expect_grad_probs(g.grad_probs, want.grad_probs, st, grad_out, pr.permuted_tokens,
                    pr.sorted_indices, "grad_probs from a Partial grad_out");
}

// ---------------------------------------------------------------------------------------------
// Redistribution.

TEST(Sharding, RedistributeBetweenReplicateAndShards) {
  const Communicator& m = *mesh();
  uint64_t seed = 100;
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{7, 10},
                                         {3, 2},
                                         {0, 5},
                                         {11},
                                         {4, 1000},
                                         {2, 3, 5},
                                         // empty trailing pieces (torch.chunk) at np 3 / 4:
                                         {5, 3},
                                         {3, 5},
                                         {6, 1},
                                         {1, 6, 2},
                                         {2},
                                         {9, 2, 1}}) {
    for (DType dt : {DType::kBF16, DType::kF32, DType::kI64}) {
      Tensor full = Tensor::empty(dt, shape);
      SplitMix64 rng{seed++};
      for (std::size_t b = 0; b < full.nbytes(); ++b)
        static_cast<uint8_t*>(full.data())[b] = static_cast<uint8_t>(rng.next());
      const int nd = static_cast<int>(shape.size());
      std::vector<Placement> ps = {Replicate()};
      for (int d = 0; d < nd; ++d) ps.push_back(Shard(d));
      for (Placement from : ps)
        for (Placement to : ps) {
          const std::string what = "shape " + std::to_string(shape[0]) + " ndim " +
                                   std::to_string(nd) + " " + dtype_name(dt) + " " + pname(from) +
                                   " -> " + pname(to);
          const DTensor x = place(full, from);
          const DTensor y = redistribute(m, x, to, "x");
          EXPECT_EQ(pname(y.placement), pname(to)) << what;
          EXPECT_EQ(y.global_shape, shape) << what;
          const DTensor want = place(full, to);
          ASSERT_EQ(y.local.ndim, nd) << what;
          EXPECT_TRUE(same_bits(local_copy(y.local), local_copy(want.local)))
              << what << ": local piece differs from the slice of the full tensor";
          EXPECT_TRUE(same_bits(full_tensor(m, y, "y"), full)) << what;
        }
    }
  }
}

// Each rank's partial values of a (rows, cols) Partial: deterministic per rank, so every rank can
// compute the expected sum.
Tensor partial_piece(DType local, int64_t rows, int64_t cols, int rank) {
  return random_rows(local, rows, cols, 1000 + static_cast<uint64_t>(rank));
}

TEST(Sharding, PartialReducesInRankOrderAndRoundsOnce) {
  const Communicator& m = *mesh();
  const int n = m.size();
  for (DType local : {DType::kF32, DType::kBF16}) {
    for (const auto& [rows, cols] :
         std::vector<std::pair<int64_t, int64_t>>{{5, 3}, {1, 7}, {0, 4}, {3, 5}, {1, 1}, {2, 6}}) {
      const DType dt = DType::kBF16;
      Tensor mine = partial_piece(local, rows, cols, m.rank());
      DTensor x = DTensor::from_local(mine, Partial(), {rows, cols});
      x.dtype = dt;
      // Expected: fp32 sum in rank order, one rounding to bf16.
      Tensor want = Tensor::empty(dt, {rows, cols});
      for (int64_t i = 0; i < rows * cols; ++i) {
        float acc = 0;
        for (int r = 0; r < n; ++r) {
          const Tensor pr = partial_piece(local, rows, cols, r);
          const float v = ref::load(local, pr.data(), i);
          acc = r == 0 ? v : acc + v;
        }
        ref::store(dt, want.data(), i, acc);
      }
      const std::string what = std::string("Partial ") + dtype_name(local) + " pieces, shape [" +
                               std::to_string(rows) + ", " + std::to_string(cols) + "]";
      const DTensor rep = redistribute(m, x, Replicate(), "x");
      EXPECT_EQ(rep.local.dtype, dt) << what;
      EXPECT_TRUE(same_bits(full_tensor(m, rep), want)) << what << " -> Replicate";
      for (int d : {0, 1}) {
        const DTensor s = redistribute(m, x, Shard(d), "x");
        EXPECT_EQ(pname(s.placement), pname(Shard(d))) << what;
        EXPECT_TRUE(same_bits(full_tensor(m, s), want)) << what << " -> Shard(" << d << ")";
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Errors: every rank throws, none hangs.

TEST(Sharding, PlacementOutsideTheTensorsDims) {
  const Communicator& m = *mesh();
  Tensor t = random_rows(DType::kF32, 4, 6, 7);
  DTensor x = place(t, Replicate());
  x.placement = Shard(2);
  test::expect_collective_error([&] { redistribute(m, x, Replicate(), "tokens"); }, m.rank(), -1,
                                ErrorKind::kInvalidArgument,
                                {"redistribute: tokens placement Shard(2) is outside dims [0, 2)"});
  test::expect_collective_error([&] { redistribute(m, place(t, Replicate()), Shard(2), "tokens"); },
                                m.rank(), -1, ErrorKind::kInvalidArgument,
                                {"target placement Shard(2) is outside dims [0, 2)"});
  Tensor idx = random_indices(DType::kI32, 4, 1, 3, 5);
  test::expect_collective_error(
      [&] { sharded::permute(m, {.tokens = x, .indices = place(idx, Replicate())}); }, m.rank(), -1,
      ErrorKind::kInvalidArgument, {"sharded::permute: tokens placement Shard(2)"});
}

TEST(Sharding, LocalShapeInconsistentWithGlobalShapeOnOneRank) {
  const Communicator& m = *mesh();
  const int bad = m.size() - 1;
  Tensor t = random_rows(DType::kF32, 4, 10, 7);
  DTensor x = place(t, Shard(1));
  if (m.rank() == bad) x.local.shape[1] += 1;
  test::expect_collective_error(
      [&] { redistribute(m, x, Replicate(), "tokens"); }, m.rank(), bad,
      ErrorKind::kInvalidArgument,
      {"tokens local shape", "is inconsistent with global shape [4, 10]"});
}

TEST(Sharding, ArgumentsThatDifferAcrossRanks) {
  const Communicator& m = *mesh();
  if (m.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  Tensor t = random_rows(DType::kF32, 4, 10, 7);
  // Rank 1 calls with Shard(0), the others with Shard(1).
  DTensor x = place(t, m.rank() == 1 ? Shard(0) : Shard(1));
  test::expect_collective_error([&] { redistribute(m, x, Replicate(), "tokens"); }, m.rank(), -1,
                                ErrorKind::kInvalidArgument,
                                {"tokens placement differs across ranks: rank 0 has Shard(1), "
                                 "rank 1 has Shard(0)"});
}

TEST(Sharding, OpChecksCrossArgumentShapes) {
  const Communicator& m = *mesh();
  Tensor tokens = random_rows(DType::kF32, 4, 10, 7);
  Tensor grad = random_rows(DType::kF32, 4, 11, 8);
  Tensor idx = random_indices(DType::kI32, 4, 1, 3, 5);
  const auto pr =
      moe_ep::permute({.tokens = tokens, .indices = idx, .num_out_tokens = std::nullopt});
  test::expect_collective_error(
      [&] {
        sharded::permute_grad(m, {.tokens = place(tokens, Shard(1)),
                                  .grad_permuted_tokens = place(grad, Shard(1)),
                                  .indices = place(idx, Replicate()),
                                  .sorted_indices = place(pr.sorted_indices, Replicate())});
      },
      m.rank(), -1, ErrorKind::kInvalidArgument,
      {"sharded::permute_grad: grad_permuted_tokens global_shape[1] = 11 must equal 10"});
  test::expect_collective_error(
      [&] {
        sharded::unpermute(m, {.permuted_tokens = place(pr.permuted_tokens, Shard(1)),
                               .sorted_indices = place(pr.sorted_indices, Replicate()),
                               .restore_shape = std::vector<int64_t>{4, 3}});
      },
      m.rank(), -1, ErrorKind::kInvalidArgument,
      {"sharded::unpermute: restore_shape = [4, 3] must be [N, 10]"});
  // A Partial index tensor.
  DTensor si = place(pr.sorted_indices, Replicate());
  si.placement = Partial();
  test::expect_collective_error(
      [&] {
        sharded::unpermute(
            m, {.permuted_tokens = place(pr.permuted_tokens, Shard(1)), .sorted_indices = si});
      },
      m.rank(), -1, ErrorKind::kInvalidArgument,
      {"sorted_indices placement Partial(sum) needs a float dtype, not int32"});
}

TEST(Sharding, LocalKernelErrorsNameRankAndStrategy) {
  const Communicator& m = *mesh();
  Tensor permuted = random_rows(DType::kF32, 3, 10, 7);
  Tensor sorted = Tensor::empty(DType::kI32, {3});
  for (int i = 0; i < 3; ++i) sorted.ptr<int32_t>()[i] = i == 2 ? 99 : i;  // 99 is out of range
  try {
    sharded::unpermute(m, {.permuted_tokens = place(permuted, Shard(1)),
                           .sorted_indices = place(sorted, Replicate())});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << msg;
    EXPECT_NE(msg.find("sharded::unpermute: on rank " + std::to_string(m.rank())),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("unpermute: sorted_indices[2] = 99"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace moe_ep
