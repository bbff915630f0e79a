// Adversarial tests of dispatch_v2 / combine_v2 (a reviewer's, independent of test_dispatch.cc):
// a layout computed by hand from SPEC §1.4 (W = 2, on a sub-communicator of ranks 0 and 1), the
// SPEC §2.3 summation order, degenerate shapes and strides, interleaved ops, and one bad argument
// on one rank for every check (the bad rank throws naming op, parameter, value and bound; the
// others throw kRemote; the communicator keeps working).
//
// This file may be linked after test_dispatch.cc, whose last test breaks a communicator of its own:
// every test here uses its own Communicator, duplicated from MPI_COMM_WORLD.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "mpi/common.h"
#include "ref/ep_ref.h"

namespace moe_ep {
namespace {

using test::world_rank;
using test::world_size;

// Created by the fixture's SetUp on every rank at the same point (MPI_Comm_dup is collective).
Communicator* comm() {
  static std::shared_ptr<Communicator> c = Communicator::from_mpi(MPI_COMM_WORLD);
  return c.get();
}

class DispatchAdversarial : public ::testing::Test {
 protected:
  void SetUp() override { comm(); }
};
class CombineAdversarial : public DispatchAdversarial {};
class EpLayoutAdversarial : public DispatchAdversarial {};

using test::values;

struct Rng : test::SplitMix64 {
  explicit Rng(uint64_t seed) : SplitMix64{seed * 0x9e3779b97f4a7c15ull + 12345} {}
  float small() { return static_cast<float>(below(17) - 8) / 4.0f; }  // exact in fp32
};

// A global fp32 batch, held whole by every rank (the reference sees all ranks' inputs).
struct Case {
  int W = 1;
  int64_t E = 12, K = 2, H = 4, global_bs = 0;
  std::vector<int64_t> bs;
  std::vector<std::vector<float>> x, sc;
  std::vector<std::vector<int32_t>> ids;

  ref::EpRankInput view(int r) const {
    ref::EpRankInput in;
    in.x = TensorView::contiguous(const_cast<float*>(x[r].data()), DType::kF32, {bs[r], H});
    in.expert_ids =
        TensorView::contiguous(const_cast<int32_t*>(ids[r].data()), DType::kI32, {bs[r], K});
    in.expert_scales =
        TensorView::contiguous(const_cast<float*>(sc[r].data()), DType::kF32, {bs[r], K});
    return in;
  }
  std::vector<ref::EpRankInput> views() const {
    std::vector<ref::EpRankInput> v;
    for (int r = 0; r < W; ++r) v.push_back(view(r));
    return v;
  }
};

Case make_case(int W, int64_t E, int64_t K, int64_t H, std::vector<int64_t> bs, int64_t global_bs,
               uint64_t seed, int inactive_pct = 0) {
  Case c;
  c.W = W, c.E = E, c.K = K, c.H = H, c.global_bs = global_bs, c.bs = std::move(bs);
  Rng rng(seed);
  for (int r = 0; r < W; ++r) {
    const int64_t n = c.bs[r];
    c.x.emplace_back(std::max<int64_t>(1, n * H));
    c.ids.emplace_back(std::max<int64_t>(1, n * K));
    c.sc.emplace_back(std::max<int64_t>(1, n * K));
    for (auto& v : c.x[r]) v = rng.small();
    for (int64_t i = 0; i < n; ++i) {
      std::vector<int32_t> pool(E);
      for (int64_t e = 0; e < E; ++e) pool[e] = static_cast<int32_t>(e);
      for (int64_t k = 0; k < K; ++k) {
        std::swap(pool[k], pool[k + rng.below(E - k)]);
        const bool off = rng.below(100) < inactive_pct;
        c.ids[r][i * K + k] = off ? -1 : pool[k];
        c.sc[r][i * K + k] = 0.25f * static_cast<float>(1 + rng.below(8));
      }
    }
  }
  return c;
}

Case default_case(uint64_t seed = 5) {
  const int W = world_size();
  return make_case(W, 12, 2, 4, std::vector<int64_t>(W, 4), 0, seed);
}

EpConfig config(const Case& c, Communicator* group = nullptr) {
  EpConfig cfg;
  cfg.group_ep = group ? group : comm();
  cfg.ep_world_size = c.W;
  cfg.ep_rank_id = cfg.group_ep->rank();
  cfg.moe_expert_num = c.E;
  cfg.global_bs = c.global_bs;
  return cfg;
}

DispatchInputs dispatch_inputs(const Case& c, int rank, int64_t type = 1) {
  const ref::EpRankInput v = c.view(rank);
  DispatchInputs in;
  in.x = v.x;
  in.expert_ids = v.expert_ids;
  in.expert_scales = v.expert_scales;
  in.expert_token_nums_type = type;
  return in;
}

void expect_matches_reference(const DispatchOutputs& out, const ref::EpRankDispatch& want,
                              int64_t H, int64_t type) {
  ASSERT_EQ(out.expand_x.ndim(), 2);
  ASSERT_EQ(out.expand_x.size(0), want.A);
  ASSERT_EQ(out.expand_x.size(1), H);
  ASSERT_EQ(out.expand_x.nbytes(), want.expand_x.size());
  // Only the first `valid` rows of expand_x and 3 * valid entries of assist_info_for_combine are
  // meaningful (SPEC §1.4); dispatch_v2 leaves the rest as it was.
  ASSERT_LE(want.valid, want.A);
  const std::size_t row_bytes = want.A > 0 ? want.expand_x.size() / want.A : 0;
  const std::size_t valid_bytes = static_cast<std::size_t>(want.valid) * row_bytes;
  EXPECT_TRUE(valid_bytes == 0 ||
              std::memcmp(out.expand_x.data(), want.expand_x.data(), valid_bytes) == 0)
      << "expand_x differs from the reference";
  EXPECT_EQ(values<int32_t>(out.ep_recv_counts), want.ep_recv_counts);
  EXPECT_EQ(values<int64_t>(out.expert_token_nums),
            type == 0 ? want.expert_token_nums0 : want.expert_token_nums1);
  EXPECT_EQ(out.assist_info_for_combine.numel(), static_cast<int64_t>(want.assist_info.size()));
  EXPECT_EQ(values<int32_t>(out.assist_info_for_combine, 3 * want.valid),
            test::prefix(want.assist_info, 3 * want.valid));
  EXPECT_EQ(values<float>(out.expand_scales), want.expand_scales);
  ASSERT_EQ(out.tp_recv_counts.numel(), 1);
  EXPECT_EQ(out.tp_recv_counts.ptr<int32_t>()[0], want.valid);
}

// The experts applied to dispatch's rows (fp32), found from ep_recv_counts.
Tensor run_experts(const DispatchOutputs& out, int rank, int64_t W, int64_t L, int64_t H,
                   const ref::ExpertFn& expert) {
  Tensor y = Tensor::zeros(DType::kF32, {out.expand_x.size(0), H});
  const int32_t* inc = out.ep_recv_counts.ptr<int32_t>();
  for (int64_t l = 0; l < L; ++l) {
    const int64_t lo = l == 0 ? 0 : inc[l * W - 1], hi = inc[l * W + W - 1];
    for (int64_t j = lo; j < hi; ++j)
      expert(rank * L + l, DType::kF32, out.expand_x.ptr<float>() + j * H, y.ptr<float>() + j * H,
             H);
  }
  return y;
}

CombineInputs combine_inputs(const Case& c, int rank, const DispatchOutputs& out, const Tensor& y) {
  const ref::EpRankInput v = c.view(rank);
  CombineInputs in;
  in.expand_x = y.view();
  in.expert_ids = v.expert_ids;
  in.assist_info_for_combine = out.assist_info_for_combine;
  in.ep_send_counts = out.ep_recv_counts;
  in.expert_scales = *v.expert_scales;
  return in;
}

// dispatch (both types) and combine on comm(), all checked against ref/.
void round_trip(const Case& c) {
  const int rank = comm()->rank();
  const auto want = ref::dispatch_reference(c.views(), c.E, c.global_bs);
  for (int64_t type : {0, 1}) {
    SCOPED_TRACE("expert_token_nums_type " + std::to_string(type));
    const DispatchOutputs out = dispatch_v2(dispatch_inputs(c, rank, type), config(c));
    expect_matches_reference(out, want[rank], c.H, type);
    const ref::ExpertFn expert = ref::scale_expert(c.E);
    const Tensor y = run_experts(out, rank, c.W, c.E / c.W, c.H, expert);
    const Tensor x = combine_v2(combine_inputs(c, rank, out, y), config(c));
    const auto combined = ref::combine_reference(c.views(), expert);
    ASSERT_EQ(x.size(0), c.bs[rank]);
    ASSERT_EQ(x.size(1), c.H);
    ASSERT_EQ(x.nbytes(), combined[rank].size());
    EXPECT_TRUE(combined[rank].empty() ||
                std::memcmp(x.data(), combined[rank].data(), x.nbytes()) == 0)
        << "combine_v2 differs from the reference";
  }
}

void good_round_trip() {
  SCOPED_TRACE("round trip after the error");
  round_trip(default_case(77));
}

// `bad` < 0: every rank throws `kind`; else rank `bad` throws `kind` and the others kRemote.
void expect_error(const std::function<void()>& call, int bad, ErrorKind kind,
                  const std::vector<std::string>& needles) {
  test::expect_collective_error(call, comm()->rank(), bad, kind, needles);
  good_round_trip();
}

// ---------------------------------------------------------------------------------------------
// SPEC §1.4 computed by hand, W = 2 (ranks 0 and 1 of a sub-communicator; other ranks idle).
//   E = 4 (L = 2: rank 0 hosts experts 0, 1; rank 1 hosts 2, 3), K = 2, H = 2, fp32,
//   rank 0 BS = 3, rank 1 BS = 1, global_bs = 8 (m = 4 > max BS): G = 8, A = 8 * min(2, 2) = 16.
//   rank 0: t0 ids (1, 0) x (1, 2) scales (0.5, 0.25)
//           t1 ids (-1, 1) x (3, 4) scales (9, 0.75)
//           t2 ids (0, 3) x (5, 6) scales (1.5, 2.5)
//   rank 1: t0 ids (1, -1) x (7, 8) scales (3, 7)
// Rank 0 receives, (local expert, source) blocks in expert-major order:
//   (e0, s0): r0t0 slot 1, r0t2 slot 0; (e0, s1): none; (e1, s0): r0t0 slot 0, r0t1 slot 1;
//   (e1, s1): r1t0 slot 0  -> ep_recv_counts [2, 2, 4, 5], expert_token_nums [2, 3] / [2, 5].
// Rank 1 receives (e2, *): none; (e3, s0): r0t2 slot 1 -> [0, 0, 1, 1], [0, 1] / [0, 1].
// Expert e multiplies by e + 1; combine (SPEC §2.3):
//   r0t0 = 0.5*2*(1,2) + 0.25*1*(1,2) = (1.25, 2.5); r0t1 = 0.75*2*(3,4) = (4.5, 6);
//   r0t2 = 1.5*1*(5,6) + 2.5*4*(5,6) = (57.5, 69); r1t0 = 3*2*(7,8) = (42, 48).
TEST_F(EpLayoutAdversarial, HandComputedW2) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const int wr = world_rank();
  MPI_Comm sub = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, wr < 2 ? 0 : MPI_UNDEFINED, wr, &sub);
  if (wr < 2) {
    auto group = Communicator::from_mpi(sub);
    MPI_Comm_free(&sub);
    Case c;
    c.W = 2, c.E = 4, c.K = 2, c.H = 2, c.global_bs = 8, c.bs = {3, 1};
    c.x = {{1, 2, 3, 4, 5, 6}, {7, 8}};
    c.ids = {{1, 0, -1, 1, 0, 3}, {1, -1}};
    c.sc = {{0.5f, 0.25f, 9, 0.75f, 1.5f, 2.5f}, {3, 7}};
    struct Want {
      std::vector<float> rows;  // valid rows, H = 2
      std::vector<int32_t> assist, counts;
      std::vector<int64_t> nums0, nums1;
      std::vector<float> scales, combined;
    };
    const Want want[2] = {
        {{1, 2, 5, 6, 1, 2, 3, 4, 7, 8},
         {0, 0, 1, 0, 2, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0},
         {2, 2, 4, 5},
         {2, 5},
         {2, 3},
         {0.25f, 1.5f, 0.5f, 0.75f, 3.0f},
         {1.25f, 2.5f, 4.5f, 6.0f, 57.5f, 69.0f}},
        {{5, 6}, {0, 2, 1}, {0, 0, 1, 1}, {0, 1}, {0, 1}, {2.5f}, {42.0f, 48.0f}},
    };
    const Want& w = want[wr];
    const int64_t A = 16;
    for (int64_t type : {0, 1}) {
      SCOPED_TRACE("expert_token_nums_type " + std::to_string(type));
      const DispatchOutputs out = dispatch_v2(dispatch_inputs(c, wr, type), config(c, group.get()));
      ASSERT_EQ(out.expand_x.size(0), A);
      ASSERT_EQ(out.expand_x.size(1), 2);
      // The valid rows and their assist triples; the rest is unspecified (SPEC §1.4).
      const int64_t valid = static_cast<int64_t>(w.rows.size() / 2);
      EXPECT_EQ(values<float>(out.expand_x, valid * 2), w.rows);
      ASSERT_EQ(static_cast<int64_t>(w.assist.size()), 3 * valid);
      EXPECT_EQ(out.assist_info_for_combine.numel(), std::max<int64_t>(c.bs[wr] * 2, A * 128));
      EXPECT_EQ(values<int32_t>(out.assist_info_for_combine, 3 * valid), w.assist);
      EXPECT_EQ(values<int32_t>(out.ep_recv_counts), w.counts);
      EXPECT_EQ(values<int64_t>(out.expert_token_nums), type == 0 ? w.nums0 : w.nums1);
      std::vector<float> scales = w.scales;
      scales.resize(A, 0.0f);
      EXPECT_EQ(values<float>(out.expand_scales), scales);
      ASSERT_EQ(out.tp_recv_counts.numel(), 1);
      EXPECT_EQ(out.tp_recv_counts.ptr<int32_t>()[0], static_cast<int32_t>(w.rows.size() / 2));
      // The reference must agree with the hand computation too.
      const auto ref_out = ref::dispatch_reference(c.views(), c.E, c.global_bs);
      expect_matches_reference(out, ref_out[wr], c.H, type);

      const auto times_id_plus_1 = [](int64_t e, DType, const void* in, void* o, int64_t H) {
        for (int64_t h = 0; h < H; ++h)
          static_cast<float*>(o)[h] = static_cast<const float*>(in)[h] * static_cast<float>(e + 1);
      };
      const Tensor y = run_experts(out, wr, 2, 2, 2, times_id_plus_1);
      const Tensor x = combine_v2(combine_inputs(c, wr, out, y), config(c, group.get()));
      EXPECT_EQ(values<float>(x), w.combined);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// SPEC §2.3: acc += w_k * y_k in slot order k = 0, 1, 2, whatever rank or block each row came
// from. y = 1e8, 1, -1e8 (x = 1 times the expert's factor): (1e8 + 1) - 1e8 = 0 in fp32, while
// the expert order (-1e8 + 1e8) + 1 would give 1.
TEST_F(EpLayoutAdversarial, SummationOrderIsSlotOrder) {
  const int W = world_size(), rank = world_rank();
  Case c = make_case(W, 3 * W, 3, 2, std::vector<int64_t>(W, 2), 0, 1);
  const int32_t big = static_cast<int32_t>(3 * W - 1), one = 0, neg = static_cast<int32_t>(W);
  for (int r = 0; r < W; ++r) {
    for (auto& v : c.x[r]) v = 1.0f;
    for (int64_t i = 0; i < 2; ++i) {
      c.ids[r][i * 3 + 0] = big, c.ids[r][i * 3 + 1] = one, c.ids[r][i * 3 + 2] = neg;
      for (int64_t k = 0; k < 3; ++k) c.sc[r][i * 3 + k] = 1.0f;
    }
  }
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(c, rank), config(c));
  const auto factor = [big, neg](int64_t e, DType, const void* in, void* o, int64_t H) {
    const float f = e == big ? 1e8f : e == neg ? -1e8f : 1.0f;
    for (int64_t h = 0; h < H; ++h)
      static_cast<float*>(o)[h] = static_cast<const float*>(in)[h] * f;
  };
  const Tensor y = run_experts(out, rank, W, 3, 2, factor);
  const Tensor x = combine_v2(combine_inputs(c, rank, out, y), config(c));
  EXPECT_EQ(values<float>(x), std::vector<float>(4, 0.0f));
}

// Only rank 0 has tokens; global_bs = W * BS0 exactly (the bound, not above it).
TEST_F(EpLayoutAdversarial, OnlyRankZeroHasTokensGlobalBsAtBound) {
  const int W = world_size();
  std::vector<int64_t> bs(W, 0);
  bs[0] = 5;
  Case c = make_case(W, 4 * W, 3, 4, bs, W * 5, 11, 20);
  round_trip(c);
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(c, world_rank()), config(c));
  EXPECT_EQ(out.expand_x.size(0), W * 5 * 3);  // A = G * min(L, K) = 5W * 3
  EXPECT_EQ(out.assist_info_for_combine.numel(), W * 5 * 3 * 128);
}

// Every entry -1 on every rank: nothing moves, combine gives zeros.
TEST_F(EpLayoutAdversarial, EverythingInactive) {
  const int W = world_size(), rank = world_rank();
  Case c = make_case(W, 12, 2, 4, std::vector<int64_t>(W, 3), 0, 3);
  for (auto& v : c.ids) std::fill(v.begin(), v.end(), -1);
  round_trip(c);
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(c, rank), config(c));
  EXPECT_EQ(out.tp_recv_counts.ptr<int32_t>()[0], 0);
  EXPECT_EQ(values<int32_t>(out.ep_recv_counts), std::vector<int32_t>(12, 0));
}

// All ranks BS = 0 with global_bs = 0: A = 0, empty outputs, still collective.
TEST_F(EpLayoutAdversarial, NoTokensAnywhere) {
  const int W = world_size();
  round_trip(make_case(W, 12, 2, 4, std::vector<int64_t>(W, 0), 0, 3));
}

// SPEC §1.4: only the first `valid` rows of expand_x (and 3 * valid entries of
// assist_info_for_combine) are meaningful; dispatch_v2 does not clear the rest, which keeps
// whatever the memory held. Nothing may depend on that tail. With each transport, on a
// communicator of its own: a first call with many valid rows, whose expand_x and
// assist_info_for_combine are then poisoned (NaN rows, 0xa5a5a5a5 entries) and released; then a
// second call with other routing, fewer valid rows and the same capacity A, which gets that memory
// back (both outputs are over the block cache's 4 MiB threshold, base/block_cache.h; with "shm"
// expand_x takes the same slot of the new window). Its valid prefix must equal the reference
// bitwise, and combine_v2 over it (the expert outputs NaN past the valid rows, the assist tail
// poisoned) must equal the reference bitwise: a read past the valid rows would show.
TEST_F(EpLayoutAdversarial, StaleTailIsNeverRead) {
  const int W = world_size(), rank = world_rank();
  if (12 % W != 0) GTEST_SKIP() << "E = 12 experts over W ranks";
  const int64_t E = 12, K = 8, H = 160, L = E / W;
  // global_bs = W * m with A = W * m * min(L, K) >= 8192 rows: assist_info_for_combine (A * 128
  // int32) and expand_x (A * H fp32) are at least 4 MiB each.
  const int64_t per_m = W * std::min(L, K), m = (8192 + per_m - 1) / per_m;
  const std::vector<int64_t> bs(W, 12);
  const Case many = make_case(W, E, K, H, bs, W * m, 41);
  const Case few = make_case(W, E, K, H, bs, W * m, 42, /*inactive_pct=*/70);
  const auto want_many = ref::dispatch_reference(many.views(), E, W * m);
  const auto want_few = ref::dispatch_reference(few.views(), E, W * m);
  const int64_t A = want_few[rank].A, valid = want_few[rank].valid;
  ASSERT_EQ(want_many[rank].A, A);
  ASSERT_GE(A, 8192);
  ASSERT_LT(valid, want_many[rank].valid);
  const ref::ExpertFn expert = ref::scale_expert(E);
  const auto combined = ref::combine_reference(few.views(), expert);
  constexpr unsigned char kPoisonX = 0xff;  // every fp32 row element NaN
  constexpr unsigned char kPoisonAssist = 0xa5;
  for (const char* transport : {"mpi", "shm"}) {
    SCOPED_TRACE(std::string("transport ") + transport);
    auto group = Communicator::from_mpi(MPI_COMM_WORLD);  // with "shm": a new window
    EpConfig cfg = config(many, group.get());
    cfg.transport = transport;
    const void* first_x = nullptr;
    const void* first_assist = nullptr;
    {
      DispatchOutputs first = dispatch_v2(dispatch_inputs(many, rank), cfg);
      expect_matches_reference(first, want_many[rank], H, 1);
      first_x = first.expand_x.data();
      first_assist = first.assist_info_for_combine.data();
      std::memset(first.expand_x.data(), kPoisonX, first.expand_x.nbytes());
      std::memset(first.assist_info_for_combine.data(), kPoisonAssist,
                  first.assist_info_for_combine.nbytes());
    }
    DispatchOutputs second = dispatch_v2(dispatch_inputs(few, rank), cfg);
    // The premise: the second call's outputs lie in the first call's poisoned memory.
    EXPECT_EQ(second.expand_x.data(), first_x)
        << "expand_x does not reuse the first call's memory: the test no longer sees stale rows";
    EXPECT_EQ(second.assist_info_for_combine.data(), first_assist)
        << "assist_info_for_combine does not reuse the first call's memory";
    expect_matches_reference(second, want_few[rank], H, 1);
    ASSERT_EQ(second.expand_x.size(0), A);
    int64_t stale = 0;  // rows past the valid ones still holding the poison (for the log)
    const auto* rows = second.expand_x.ptr<unsigned char>();
    for (int64_t j = valid; j < A; ++j)
      stale += std::all_of(rows + j * H * 4, rows + (j + 1) * H * 4,
                           [](unsigned char c) { return c == kPoisonX; });
    if (rank == 0)
      std::printf("[ %s ] rank 0: %lld valid rows, %lld of the %lld rows after them stale\n",
                  transport, static_cast<long long>(valid), static_cast<long long>(stale),
                  static_cast<long long>(A - valid));
    // combine_v2 over the second call: the experts' outputs on the valid rows, NaN after them;
    // the assist entries past 3 * valid poisoned whatever the memory held.
    Tensor y = run_experts(second, rank, W, L, H, expert);
    std::memset(y.ptr<float>() + valid * H, kPoisonX,
                static_cast<std::size_t>((A - valid) * H) * sizeof(float));
    int32_t* assist = second.assist_info_for_combine.ptr<int32_t>();
    std::memset(assist + 3 * valid, kPoisonAssist,
                static_cast<std::size_t>(second.assist_info_for_combine.numel() - 3 * valid) *
                    sizeof(int32_t));
    const Tensor x = combine_v2(combine_inputs(few, rank, second, y), cfg);
    ASSERT_EQ(x.size(0), few.bs[rank]);
    ASSERT_EQ(x.size(1), H);
    ASSERT_EQ(x.nbytes(), combined[rank].size());
    EXPECT_EQ(std::memcmp(x.data(), combined[rank].data(), x.nbytes()), 0)
        << "combine_v2 over the second call differs from the reference";
  }
}

// K == E (every expert) and L == 1 (W experts), K > L.
TEST_F(EpLayoutAdversarial, TopKEqualsExpertNum) {
  const int W = world_size();
  round_trip(make_case(W, W, W, 3, std::vector<int64_t>(W, 3), 0, 8, 10));
}

// H = 0: zero-byte rows (a degenerate size the SPEC does not exclude) must work (the quant_mode 2
// part below: or be a clean Error), never a crash or a hang. (ref/ cannot run H = 0: its memcpy
// into an empty vector passes null, UBSan stops; so the layout is compared with the H = 1
// reference.)
TEST_F(EpLayoutAdversarial, ZeroHiddenSize) {
  const int W = world_size(), rank = world_rank();
  Case c = make_case(W, 12, 2, 1, std::vector<int64_t>(W, 3), 0, 4, 10);
  const auto want = ref::dispatch_reference(c.views(), c.E, 0);
  Case c0 = c;
  c0.H = 0;
  try {
    const DispatchOutputs out = dispatch_v2(dispatch_inputs(c0, rank), config(c0));
    EXPECT_EQ(out.expand_x.size(0), want[rank].A);
    EXPECT_EQ(out.expand_x.size(1), 0);
    EXPECT_EQ(values<int32_t>(out.ep_recv_counts), want[rank].ep_recv_counts);
    // The first 3 * valid entries (SPEC §1.4: the rest is unspecified).
    EXPECT_EQ(out.assist_info_for_combine.numel(),
              static_cast<int64_t>(want[rank].assist_info.size()));
    EXPECT_EQ(values<int32_t>(out.assist_info_for_combine, 3 * want[rank].valid),
              test::prefix(want[rank].assist_info, 3 * want[rank].valid));
    const Tensor y = Tensor::zeros(DType::kF32, {out.expand_x.size(0), 0});
    const Tensor x = combine_v2(combine_inputs(c0, rank, out, y), config(c0));
    EXPECT_EQ(x.size(0), 3);
    EXPECT_EQ(x.size(1), 0);
  } catch (const Error& e) {
    ADD_FAILURE() << "H = 0 must be supported: " << e.what();
  }
  // quant_mode 2: empty int8 rows, each with the scale of an empty row (+0; SPEC §1.5's zero row).
  try {
    DispatchInputs in = dispatch_inputs(c0, rank);
    in.quant_mode = 2;
    const DispatchOutputs out = dispatch_v2(in, config(c0));
    EXPECT_EQ(out.expand_x.dtype(), DType::kI8);
    EXPECT_EQ(out.expand_x.size(1), 0);
    EXPECT_EQ(values<int32_t>(out.ep_recv_counts), want[rank].ep_recv_counts);
    const std::vector<float> scales = values<float>(out.dynamic_scales, want[rank].valid);
    EXPECT_EQ(scales, std::vector<float>(static_cast<std::size_t>(want[rank].valid), 0.0f));
    // And back as int8 rows (comm_quant_mode 2): empty rows again.
    const Tensor y = Tensor::zeros(DType::kF32, {out.expand_x.size(0), 0});
    CombineInputs cin = combine_inputs(c0, rank, out, y);
    cin.comm_quant_mode = 2;
    const Tensor x = combine_v2(cin, config(c0));
    EXPECT_EQ(x.size(0), 3);
    EXPECT_EQ(x.size(1), 0);
  } catch (const Error& e) {
    ADD_FAILURE() << "H = 0 with int8 rows must be supported: " << e.what();
  }
  good_round_trip();
}

// Strides: x rows aliased (stride(0) = 0) and overlapping (stride(0) = 1 < H), expert_ids and
// expert_scales column-major (strides {1, BS}); combine's expand_x rows overlapping-free padded.
TEST_F(EpLayoutAdversarial, ExoticStrides) {
  const int W = world_size(), rank = world_rank();
  Case c = make_case(W, 12, 3, 4, std::vector<int64_t>(W, 4), 0, 21, 15);
  for (int64_t x_stride : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE("x stride(0) = " + std::to_string(x_stride));
    // Column-major copies of ids and scales.
    std::vector<std::vector<int32_t>> ids_t(W);
    std::vector<std::vector<float>> sc_t(W), x_big(W);
    std::vector<ref::EpRankInput> views = c.views();
    for (int r = 0; r < W; ++r) {
      const int64_t BS = c.bs[r], K = c.K;
      ids_t[r].resize(BS * K), sc_t[r].resize(BS * K);
      for (int64_t i = 0; i < BS; ++i)
        for (int64_t k = 0; k < K; ++k) {
          ids_t[r][k * BS + i] = c.ids[r][i * K + k];
          sc_t[r][k * BS + i] = c.sc[r][i * K + k];
        }
      x_big[r].assign(BS * c.H + c.H, 0.0f);
      for (std::size_t j = 0; j < x_big[r].size(); ++j) x_big[r][j] = 0.5f * static_cast<float>(j);
      views[r].x.data = x_big[r].data();
      views[r].x.strides[0] = x_stride;
      views[r].expert_ids.data = ids_t[r].data();
      views[r].expert_ids.strides = {1, BS};
      views[r].expert_scales->data = sc_t[r].data();
      views[r].expert_scales->strides = {1, BS};
    }
    const auto want = ref::dispatch_reference(views, c.E, 0);
    DispatchInputs in;
    in.x = views[rank].x;
    in.expert_ids = views[rank].expert_ids;
    in.expert_scales = views[rank].expert_scales;
    const DispatchOutputs out = dispatch_v2(in, config(c));
    expect_matches_reference(out, want[rank], c.H, 1);
    const ref::ExpertFn expert = ref::scale_expert(c.E);
    const Tensor y = run_experts(out, rank, W, c.E / W, c.H, expert);
    CombineInputs ci;
    ci.expand_x = y.view();
    ci.expert_ids = views[rank].expert_ids;
    ci.expert_scales = *views[rank].expert_scales;
    ci.assist_info_for_combine = out.assist_info_for_combine;
    ci.ep_send_counts = out.ep_recv_counts;
    const Tensor x = combine_v2(ci, config(c));
    const auto combined = ref::combine_reference(views, expert);
    ASSERT_EQ(x.nbytes(), combined[rank].size());
    EXPECT_TRUE(combined[rank].empty() ||
                std::memcmp(x.data(), combined[rank].data(), x.nbytes()) == 0);
  }
}

// combine_v2's expand_x may hold just the valid rows (A' = valid < A).
TEST_F(CombineAdversarial, ExpandXExactlyValidRows) {
  const int rank = world_rank();
  const Case c = default_case(9);
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(c, rank), config(c));
  const ref::ExpertFn expert = ref::scale_expert(c.E);
  const Tensor y = run_experts(out, rank, c.W, c.E / c.W, c.H, expert);
  CombineInputs in = combine_inputs(c, rank, out, y);
  in.expand_x.shape[0] = out.tp_recv_counts.ptr<int32_t>()[0];
  const Tensor x = combine_v2(in, config(c));
  const auto combined = ref::combine_reference(c.views(), expert);
  EXPECT_EQ(std::memcmp(x.data(), combined[rank].data(), x.nbytes()), 0);
}

// Two dispatches in flight, combined in reverse order: no state leaks between ops.
TEST_F(CombineAdversarial, InterleavedOps) {
  const int rank = world_rank(), W = world_size();
  const Case a = default_case(31);
  const Case b = make_case(W, 12, 3, 4, std::vector<int64_t>(W, 6), 0, 32, 10);
  const DispatchOutputs oa = dispatch_v2(dispatch_inputs(a, rank), config(a));
  const DispatchOutputs ob = dispatch_v2(dispatch_inputs(b, rank), config(b));
  const ref::ExpertFn expert = ref::scale_expert(12);
  const Tensor ya = run_experts(oa, rank, W, 12 / W, 4, expert);
  const Tensor yb = run_experts(ob, rank, W, 12 / W, 4, expert);
  const Tensor xb = combine_v2(combine_inputs(b, rank, ob, yb), config(b));
  const Tensor xa = combine_v2(combine_inputs(a, rank, oa, ya), config(a));
  const auto wa = ref::combine_reference(a.views(), expert);
  const auto wb = ref::combine_reference(b.views(), expert);
  EXPECT_EQ(std::memcmp(xa.data(), wa[rank].data(), xa.nbytes()), 0);
  EXPECT_EQ(std::memcmp(xb.data(), wb[rank].data(), xb.nbytes()), 0);
}

// dispatch.h: combine_v2's expert_ids must be "the same as given to dispatch_v2 (other ids:
// Error(kInvalidArgument) on this rank)". Here one rank moves an entry to another, unused expert
// on the SAME destination rank, so every per-rank row count still matches: the rows come back in
// the right number but are the wrong expert's output for a different (token, slot).
// Expected: kInvalidArgument on the changed rank (combine_v2 checks the expert, token and slot
// each returned row carries, not just per-peer row totals).
TEST_F(CombineAdversarial, ExpertIdsChangedWithinDestinationRankAreDetected) {
  const int rank = world_rank(), W = world_size();
  // K = 1, L = 12 / W >= 3: token 0 goes to expert e; the change keeps the destination rank.
  Case c = make_case(W, 12, 1, 4, std::vector<int64_t>(W, 4), 0, 41);
  const int64_t L = 12 / W;
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(c, rank), config(c));
  const ref::ExpertFn expert = ref::scale_expert(c.E);
  const Tensor y = run_experts(out, rank, W, L, c.H, expert);
  const int bad = 0;  // rank 0: its failures are printed
  std::vector<int32_t> ids = c.ids[rank];
  // Move token 0's expert to the next one of the same rank (K = 1: no repeat possible).
  const int32_t e = ids[0];
  ids[0] = static_cast<int32_t>((e / L) * L + (e % L + 1) % L);
  CombineInputs in = combine_inputs(c, rank, out, y);
  if (rank == bad) in.expert_ids.data = ids.data();
  try {
    combine_v2(in, config(c));
    if (rank == bad) ADD_FAILURE() << "combine_v2 accepted expert_ids that differ from dispatch's";
  } catch (const Error& err) {
    EXPECT_EQ(rank, bad) << err.what();
    EXPECT_EQ(err.kind(), ErrorKind::kInvalidArgument) << err.what();
  }
  good_round_trip();
}

// Same class: rank-local token order permuted (tokens 0 and 1 swap their rows of expert_ids and
// expert_scales): every count matches, the result rows come back for the wrong tokens.
TEST_F(CombineAdversarial, TokensPermutedBeforeCombineAreDetected) {
  const int rank = world_rank(), W = world_size();
  Case c = make_case(W, 12, 2, 4, std::vector<int64_t>(W, 4), 0, 43);
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(c, rank), config(c));
  const ref::ExpertFn expert = ref::scale_expert(c.E);
  const Tensor y = run_experts(out, rank, W, 12 / W, c.H, expert);
  const int bad = 0;
  std::vector<int32_t> ids = c.ids[rank];
  std::vector<float> sc = c.sc[rank];
  std::swap_ranges(ids.begin(), ids.begin() + 2, ids.begin() + 2);
  std::swap_ranges(sc.begin(), sc.begin() + 2, sc.begin() + 2);
  const bool differs = !std::equal(ids.begin(), ids.end(), c.ids[rank].begin());
  CombineInputs in = combine_inputs(c, rank, out, y);
  if (rank == bad) in.expert_ids.data = ids.data(), in.expert_scales.data = sc.data();
  try {
    combine_v2(in, config(c));
    if (rank == bad && differs)
      ADD_FAILURE() << "combine_v2 accepted expert_ids that differ from dispatch's";
  } catch (const Error& err) {
    EXPECT_EQ(rank, bad) << err.what();
    EXPECT_EQ(err.kind(), ErrorKind::kInvalidArgument) << err.what();
  }
  good_round_trip();
}

// ---------------------------------------------------------------------------------------------
// One bad argument on one rank (the last): that rank's error names op, parameter, value, bound.

struct DispatchCase {
  std::string name;
  std::function<void(DispatchInputs&, EpConfig&, std::vector<unsigned char>& scratch)> mutate;
  ErrorKind kind;
  std::vector<std::string> needles;
};

std::vector<DispatchCase> dispatch_cases() {
  const int W = world_size();
  const std::string w = std::to_string(W);
  using In = DispatchInputs;
  using Cfg = EpConfig;
  using S = std::vector<unsigned char>;
  const ErrorKind kI = ErrorKind::kInvalidArgument, kU = ErrorKind::kUnsupported;
  std::vector<DispatchCase> v = {
      {"x_dtype_int32",
       [](In& in, Cfg&, S&) { in.x.dtype = DType::kI32; },
       kI,
       {"dispatch_v2: x dtype int32 is not one of {bf16, fp16, fp32}"}},
      {"x_ndim_1",
       [](In& in, Cfg&, S&) { in.x.ndim = 1; },
       kI,
       {"dispatch_v2: x.ndim = 1 must be 2"}},
      {"x_ndim_3",
       [](In& in, Cfg&, S&) { in.x.ndim = 3, in.x.shape[2] = 1, in.x.strides[2] = 1; },
       kI,
       {"dispatch_v2: x.ndim = 3 must be 2"}},
      {"x_col_stride_2",
       [](In& in, Cfg&, S&) { in.x.strides[1] = 2, in.x.shape[1] = 2; },
       kU,
       {"dispatch_v2: x.stride(1) = 2 is not 1"}},
      {"x_negative_row_stride",
       [](In& in, Cfg&, S&) { in.x.strides[0] = -4; },
       kU,
       {"dispatch_v2: x.stride(0) = -4 is negative"}},
      {"x_null_data",
       [](In& in, Cfg&, S&) { in.x.data = nullptr; },
       kI,
       {"dispatch_v2: x has 16 elements but data is null"}},
      {"ids_dtype_int64",
       [](In& in, Cfg&, S&) { in.expert_ids.dtype = DType::kI64; },
       kI,
       {"dispatch_v2: expert_ids dtype int64 is not one of {int32}"}},
      {"ids_ndim_1",
       [](In& in, Cfg&, S&) { in.expert_ids.ndim = 1; },
       kI,
       {"dispatch_v2: expert_ids.ndim = 1 must be 2"}},
      {"ids_K_0",
       [](In& in, Cfg&, S&) { in.expert_ids.shape[1] = 0; },
       kI,
       {"dispatch_v2: expert_ids.shape[1] = 0 (K) is outside [1, 12]"}},
      {"ids_K_above_E",
       [](In& in, Cfg&, S& s) {
         s.assign(4 * 13 * 4, 0);
         in.expert_ids = TensorView::contiguous(s.data(), DType::kI32, {4, 13});
       },
       kI,
       {"dispatch_v2: expert_ids.shape[1] = 13 (K) is outside [1, 12]"}},
      {"id_equals_E",
       [](In& in, Cfg&, S&) { in.expert_ids.ptr<int32_t>()[3] = 12; },
       kI,
       {"dispatch_v2: expert_ids[1,1] = 12 is outside [0, 12)"}},
      {"id_int_min",
       [](In& in, Cfg&, S&) { in.expert_ids.ptr<int32_t>()[2] = INT32_MIN; },
       kI,
       {"dispatch_v2: expert_ids[1,0] = -2147483648 is outside [0, 12)"}},
      {"repeat_after_inactive",
       [](In& in, Cfg&, S&) {
         int32_t* p = in.expert_ids.ptr<int32_t>();
         p[0] = -1;  // row 0 (-1, 5) is fine: -1 is not a repeat
         p[4] = 5, p[5] = 5;
       },
       kI,
       {"dispatch_v2: expert_ids[2,*] repeats expert 5 (slots 0 and 1)"}},
      {"scales_dtype_bf16",
       [](In& in, Cfg&, S&) { in.expert_scales->dtype = DType::kBF16; },
       kI,
       {"dispatch_v2: expert_scales dtype bf16 is not one of {fp32}"}},
      {"scales_K_plus_1",
       [](In& in, Cfg&, S&) { in.expert_scales->shape[1] = 3; },
       kI,
       {"dispatch_v2: expert_scales.shape[1] = 3 must equal 2"}},
      {"scales_negative_stride",
       [](In& in, Cfg&, S&) { in.expert_scales->strides[0] = -2; },
       kU,
       {"dispatch_v2: expert_scales.stride(0) = -2 is negative"}},
      {"token_nums_type_2",
       [](In& in, Cfg&, S&) { in.expert_token_nums_type = 2; },
       kI,
       {"dispatch_v2: expert_token_nums_type = 2 is not one of {0, 1}"}},
      {"token_nums_type_neg",
       [](In& in, Cfg&, S&) { in.expert_token_nums_type = -1; },
       kI,
       {"dispatch_v2: expert_token_nums_type = -1 is not one of {0, 1}"}},
      {"quant_mode_1",
       [](In& in, Cfg&, S&) { in.quant_mode = 1; },
       kI,
       {"dispatch_v2: quant_mode = 1 is not one of {0, 2}"}},
      {"scales_given",
       [](In& in, Cfg&, S&) { in.scales = in.x; },
       kI,
       {"dispatch_v2: scales (smoothing factors) are given but quant_mode = 0"}},
      {"elastic_info_2d",
       [](In& in, Cfg&, S&) { in.elastic_info = in.expert_ids; },
       kI,
       {"dispatch_v2: elastic_info.ndim = 2 must be 1"}},
      {"performance_info_int32",
       [](In& in, Cfg&, S&) { in.performance_info = in.expert_ids; },
       kI,
       {"dispatch_v2: performance_info dtype int32 is not one of {int64}"}},
      {"ep_world_size_0",
       [](In&, Cfg& c, S&) { c.ep_world_size = 0; },
       kI,
       {"dispatch_v2: ep_world_size = 0 must be >= 1"}},
      {"ep_world_size_plus_1",
       [](In&, Cfg& c, S&) { c.ep_world_size += 1; },
       kI,
       {"dispatch_v2: ep_world_size = " + std::to_string(W + 1) + " differs from group_ep's size " +
        w}},
      {"ep_rank_id_neg",
       [](In&, Cfg& c, S&) { c.ep_rank_id = -1; },
       kI,
       {"dispatch_v2: ep_rank_id = -1 differs from this rank's rank"}},
      {"ep_rank_id_W",
       [W](In&, Cfg& c, S&) { c.ep_rank_id = W; },
       kI,
       {"dispatch_v2: ep_rank_id = " + w + " differs from this rank's rank"}},
      {"moe_expert_num_0",
       [](In&, Cfg& c, S&) { c.moe_expert_num = 0; },
       kI,
       {"dispatch_v2: moe_expert_num = 0 must be >= 1"}},
      {"moe_expert_num_neg",
       [W](In&, Cfg& c, S&) { c.moe_expert_num = -12 * W; },
       kI,
       {"dispatch_v2: moe_expert_num = " + std::to_string(-12 * W) + " must be >= 1"}},
      {"moe_expert_num_2pow31",
       [W](In&, Cfg& c, S&) { c.moe_expert_num = W * (int64_t{1} << 31); },
       kI,
       {"dispatch_v2: moe_expert_num = " + std::to_string(W * (int64_t{1} << 31)) +
        " must be < 2^31 - 1"}},
      {"tp_world_size_3",
       [](In&, Cfg& c, S&) { c.tp_world_size = 3; },
       kI,
       {"dispatch_v2: tp_world_size = 3 is not one of {0, 1, 2}"}},
      {"tp_world_size_neg",
       [](In&, Cfg& c, S&) { c.tp_world_size = -1; },
       kI,
       {"dispatch_v2: tp_world_size = -1 is not one of {0, 1, 2}"}},
      {"tp_rank_id_1",
       [](In&, Cfg& c, S&) { c.tp_rank_id = 1; },
       kI,
       {"dispatch_v2: tp_rank_id = 1 must be 0"}},
      {"expert_shard_type_1",
       [](In&, Cfg& c, S&) { c.expert_shard_type = 1; },
       kI,
       {"dispatch_v2: expert_shard_type = 1 is not 0"}},
      {"shared_expert_num_5",
       [](In&, Cfg& c, S&) { c.shared_expert_num = 5; },
       kI,
       {"dispatch_v2: shared_expert_num = 5 is outside [0, 4]"}},
      {"shared_expert_num_neg",
       [](In&, Cfg& c, S&) { c.shared_expert_num = -1; },
       kI,
       {"dispatch_v2: shared_expert_num = -1 is outside [0, 4]"}},
      {"shared_expert_num_2_S_0",
       [](In&, Cfg& c, S&) { c.shared_expert_num = 2; },
       kI,
       {"dispatch_v2: shared_expert_num = 2 needs shared_expert_rank_num > 0"}},
      {"shared_expert_rank_num_neg",
       [](In&, Cfg& c, S&) { c.shared_expert_rank_num = -1; },
       kI,
       {"dispatch_v2: shared_expert_rank_num = -1 is outside [0, " + w + ")"}},
      {"shared_expert_rank_num_W",
       [W](In&, Cfg& c, S&) { c.shared_expert_rank_num = W; },
       kI,
       {"dispatch_v2: shared_expert_rank_num = " + w + " is outside [0, " + w + ")"}},
      {"comm_alg_ring",
       [](In&, Cfg& c, S&) { c.comm_alg = "ring"; },
       kI,
       {"dispatch_v2: comm_alg = \"ring\" is not one of"}},
      {"comm_alg_case",
       [](In&, Cfg& c, S&) { c.comm_alg = "FullMesh"; },
       kI,
       {"dispatch_v2: comm_alg = \"FullMesh\" is not one of"}},
      {"comm_alg_hierarchy_performance_info",
       [W](In& in, Cfg& c, S& s) {
         c.comm_alg = "hierarchy";
         s.assign(static_cast<std::size_t>(8 * W), 0);
         in.performance_info = TensorView::contiguous(s.data(), DType::kI64, {W});
       },
       kU,
       {"dispatch_v2: performance_info is not supported with comm_alg = \"hierarchy\""}},
      {"zero_expert_num_neg",
       [](In&, Cfg& c, S&) { c.zero_expert_num = -1; },
       kI,
       {"dispatch_v2: zero_expert_num = -1 must be >= 0"}},
      {"copy_expert_num_2pow31",
       [](In&, Cfg& c, S&) { c.copy_expert_num = int64_t{1} << 31; },
       kI,
       {"dispatch_v2: copy_expert_num = 2147483648 must be < 2^31 - 1"}},
      {"special_total_2pow31",
       [](In&, Cfg& c, S&) { c.const_expert_num = INT32_MAX - 12; },
       kI,
       {"dispatch_v2: moe_expert_num + zero_expert_num + copy_expert_num + const_expert_num = " +
        std::to_string(int64_t{INT32_MAX}) + " must be < 2^31 - 1"}},
      {"global_bs_neg",
       [W](In&, Cfg& c, S&) { c.global_bs = -4 * W; },
       kI,
       {"dispatch_v2: global_bs = " + std::to_string(-4 * W) + " must be >= 0"}},
      {"global_bs_2pow31",
       [W](In&, Cfg& c, S&) { c.global_bs = W * (int64_t{1} << 31); },
       kU,
       {"dispatch_v2: ", std::to_string(W * (int64_t{1} << 31)), "int32"}},
      {"capacity_above_int32",
       [W](In&, Cfg& c, S&) { c.global_bs = W * (int64_t{INT32_MAX} / W); },
       kU,
       {"dispatch_v2: the receive capacity A = G * min(L, K) = ", "exceeds int32"}},
  };
  if (W > 1) {
    v.push_back({"shared_expert_rank_num_1_without_shared_experts",
                 [](In&, Cfg& c, S&) { c.shared_expert_rank_num = 1, c.shared_expert_num = 0; },
                 kI,
                 {"dispatch_v2: shared_expert_rank_num = 1 needs shared_expert_num > 0"}});
    v.push_back({"global_bs_not_multiple",
                 [W](In&, Cfg& c, S&) { c.global_bs = 4 * W + 1; },
                 kI,
                 {"dispatch_v2: global_bs = " + std::to_string(4 * W + 1) +
                  " is not a multiple of ep_world_size = " + w}});
  }
  return v;
}

TEST_F(DispatchAdversarial, EveryBadArgumentOnOneRank) {
  const int W = world_size(), rank = world_rank(), bad = W - 1;
  for (const DispatchCase& dc : dispatch_cases()) {
    SCOPED_TRACE(dc.name);
    Case c = default_case(13);                       // BS = 4, K = 2, H = 4, E = 12
    for (auto& ids : c.ids) ids[0] = 3, ids[1] = 5;  // row 0 known: (3, 5)
    DispatchInputs in = dispatch_inputs(c, rank);
    EpConfig cfg = config(c);
    std::vector<unsigned char> scratch;
    if (rank == bad) dc.mutate(in, cfg, scratch);
    expect_error([&] { dispatch_v2(in, cfg); }, bad, dc.kind, dc.needles);
  }
}

struct CombineCase {
  std::string name;
  std::function<void(CombineInputs&, EpConfig&, std::vector<int32_t>& scratch, int64_t A)> mutate;
  ErrorKind kind;
  std::vector<std::string> needles;
};

std::vector<CombineCase> combine_cases() {
  using In = CombineInputs;
  using Cfg = EpConfig;
  using S = std::vector<int32_t>;
  const ErrorKind kI = ErrorKind::kInvalidArgument, kU = ErrorKind::kUnsupported;
  return {
      {"send_counts_negative_first",
       [](In& in, Cfg&, S& s, int64_t) {
         s.assign(in.ep_send_counts.ptr<int32_t>(),
                  in.ep_send_counts.ptr<int32_t>() + in.ep_send_counts.shape[0]);
         s[0] = -1;
         in.ep_send_counts.data = s.data();
       },
       kI,
       {"combine_v2: ep_send_counts[0] = -1 is less than 0"}},
      {"send_counts_decreasing",
       [](In& in, Cfg&, S& s, int64_t) {
         const int64_t n = in.ep_send_counts.shape[0];
         s.assign(in.ep_send_counts.ptr<int32_t>(), in.ep_send_counts.ptr<int32_t>() + n);
         s[n - 1] = s[n - 2] - 1;
         in.ep_send_counts.data = s.data();
       },
       kI,
       {"combine_v2: ep_send_counts[11] = ", "is less than ep_send_counts[10] = "}},
      {"send_counts_dtype_int64",
       [](In& in, Cfg&, S&, int64_t) { in.ep_send_counts.dtype = DType::kI64; },
       kI,
       {"combine_v2: ep_send_counts dtype int64 is not one of {int32}"}},
      {"send_counts_2d",
       [](In& in, Cfg&, S&, int64_t) {
         in.ep_send_counts.ndim = 2, in.ep_send_counts.shape[1] = 1;
       },
       kI,
       {"combine_v2: ep_send_counts.ndim = 2 must be 1"}},
      {"send_counts_above_capacity",
       [](In& in, Cfg&, S& s, int64_t A) {
         const int64_t n = in.ep_send_counts.shape[0];
         s.assign(in.ep_send_counts.ptr<int32_t>(), in.ep_send_counts.ptr<int32_t>() + n);
         s[n - 1] = static_cast<int32_t>(A + 1);
         in.ep_send_counts.data = s.data();
         in.expand_x.shape[0] = A + 2;  // the test's y has A + 2 rows
       },
       kI,
       {"combine_v2: ep_send_counts[11] = ", "exceeds the receive capacity A = "}},
      {"assist_dtype_int64",
       [](In& in, Cfg&, S&, int64_t) { in.assist_info_for_combine.dtype = DType::kI64; },
       kI,
       {"combine_v2: assist_info_for_combine dtype int64 is not one of {int32}"}},
      {"assist_ndim_2",
       [](In& in, Cfg&, S&, int64_t) {
         in.assist_info_for_combine.ndim = 2, in.assist_info_for_combine.shape[1] = 1;
       },
       kI,
       {"combine_v2: assist_info_for_combine.ndim = 2 must be 1"}},
      {"assist_null",
       [](In& in, Cfg&, S&, int64_t) { in.assist_info_for_combine.data = nullptr; },
       kI,
       {"combine_v2: assist_info_for_combine has ", "elements but data is null"}},
      {"expand_x_dtype_int32",
       [](In& in, Cfg&, S&, int64_t) { in.expand_x.dtype = DType::kI32; },
       kI,
       {"combine_v2: expand_x dtype int32 is not one of {bf16, fp16, fp32}"}},
      {"expand_x_col_stride",
       [](In& in, Cfg&, S&, int64_t) { in.expand_x.strides[1] = 2, in.expand_x.shape[1] = 2; },
       kU,
       {"combine_v2: expand_x.stride(1) = 2 is not 1"}},
      {"expand_x_null",
       [](In& in, Cfg&, S&, int64_t) { in.expand_x.data = nullptr; },
       kI,
       {"combine_v2: expand_x has ", "elements but data is null"}},
      {"ids_out_of_range",
       [](In& in, Cfg&, S& s, int64_t) {
         s.assign(in.expert_ids.ptr<int32_t>(), in.expert_ids.ptr<int32_t>() + 8);
         s[7] = 999;
         in.expert_ids.data = s.data();
       },
       kI,
       {"combine_v2: expert_ids[3,1] = 999 is outside [0, 12)"}},
      {"ids_dtype_int64",
       [](In& in, Cfg&, S&, int64_t) { in.expert_ids.dtype = DType::kI64; },
       kI,
       {"combine_v2: expert_ids dtype int64 is not one of {int32}"}},
      {"scales_rows",
       [](In& in, Cfg&, S&, int64_t) { in.expert_scales.shape[0] = 3; },
       kI,
       {"combine_v2: expert_scales.shape[0] = 3 must equal 4"}},
      {"scales_cols",
       [](In& in, Cfg&, S&, int64_t) { in.expert_scales.shape[1] = 1; },
       kI,
       {"combine_v2: expert_scales.shape[1] = 1 must equal 2"}},
      {"comm_quant_mode_1",
       [](In& in, Cfg&, S&, int64_t) { in.comm_quant_mode = 1; },
       kI,
       {"combine_v2: comm_quant_mode = 1 is not one of {0, 2}"}},
      {"tp_send_counts_given",
       [](In& in, Cfg&, S&, int64_t) { in.tp_send_counts = in.ep_send_counts; },
       kU,
       {"combine_v2: tp_send_counts is not supported"}},
      {"shared_expert_x_rows",
       [](In& in, Cfg&, S&, int64_t) { in.shared_expert_x = in.expand_x; },
       kI,
       {"combine_v2: shared_expert_x has ", " rows (shape[0]) but BS = 4"}},
      {"ori_x_rows",
       [](In& in, Cfg&, S&, int64_t) { in.ori_x = in.expand_x; },
       kI,
       {"combine_v2: ori_x.shape[0] = ", "must equal 4"}},
      {"const_expert_v_rows_without_const_experts",
       [](In& in, Cfg&, S&, int64_t) { in.const_expert_v = in.expand_x; },
       kI,
       {"combine_v2: const_expert_v.shape[0] = ", "must equal 0"}},
      {"ep_rank_id_wrong",
       [](In&, Cfg& c, S&, int64_t) { c.ep_rank_id += 100; },
       kI,
       {"combine_v2: ep_rank_id = "}},
      {"global_bs_neg",
       [](In&, Cfg& c, S&, int64_t) { c.global_bs = -1; },
       kI,
       {"combine_v2: global_bs = -1 must be >= 0"}},
  };
}

TEST_F(CombineAdversarial, EveryBadArgumentOnOneRank) {
  const int W = world_size(), rank = world_rank(), bad = W - 1;
  if (12 % W != 0) GTEST_SKIP();
  Case c = default_case(17);  // BS = 4, K = 2, H = 4, E = 12 (W * L = 12)
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(c, rank), config(c));
  const int64_t A = out.expand_x.size(0);
  const ref::ExpertFn expert = ref::scale_expert(c.E);
  const Tensor y0 = run_experts(out, rank, W, 12 / W, c.H, expert);
  Tensor y = Tensor::zeros(DType::kF32, {A + 2, c.H});  // room for send_counts_above_capacity
  std::memcpy(y.data(), y0.data(), y0.nbytes());
  for (const CombineCase& cc : combine_cases()) {
    SCOPED_TRACE(cc.name);
    CombineInputs in = combine_inputs(c, rank, out, y0);
    in.expand_x.data = y.data();
    EpConfig cfg = config(c);
    std::vector<int32_t> scratch;
    if (rank == bad) cc.mutate(in, cfg, scratch, A);
    expect_error([&] { combine_v2(in, cfg); }, bad, cc.kind, cc.needles);
  }
}

// One row over INT_MAX bytes (an MPI count): kUnsupported on every rank, no allocation, no
// overflow. BS = 0 everywhere, so no memory is needed.
TEST_F(DispatchAdversarial, RowOverIntMaxBytes) {
  const int W = world_size();
  Case c = make_case(W, 12, 2, 0, std::vector<int64_t>(W, 0), 0, 1);
  DispatchInputs in = dispatch_inputs(c, world_rank());
  in.x.shape[1] = int64_t{1} << 30;
  expect_error([&] { dispatch_v2(in, config(c)); }, -1, ErrorKind::kUnsupported,
               {"dispatch_v2: one row of H = 1073741824 fp32 elements is 4294967296 bytes"});
}

// Two bad ranks with different errors: each throws its own, the good ranks report the lowest.
TEST_F(DispatchAdversarial, TwoBadRanksGoodRanksReportLowest) {
  const int W = world_size(), rank = world_rank();
  if (W < 3) GTEST_SKIP() << "needs two bad ranks and a good one";
  Case c = default_case(19);
  DispatchInputs in = dispatch_inputs(c, rank);
  EpConfig cfg = config(c);
  if (rank == 1) in.quant_mode = 7;
  if (rank == 2) in.expert_token_nums_type = 9;
  try {
    dispatch_v2(in, cfg);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    if (rank == 1) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << m;
      EXPECT_NE(m.find("quant_mode = 7"), std::string::npos) << m;
    } else if (rank == 2) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << m;
      EXPECT_NE(m.find("expert_token_nums_type = 9"), std::string::npos) << m;
    } else {
      EXPECT_EQ(e.kind(), ErrorKind::kRemote) << m;
      EXPECT_NE(m.find("rank 1 failed: dispatch_v2: quant_mode = 7"), std::string::npos) << m;
    }
  }
  good_round_trip();
}

// A rank disagreeing only on comm_alg spelling ("" vs "fullmesh") is fine; the two mean the same.
TEST_F(DispatchAdversarial, CommAlgEmptyEqualsFullmesh) {
  Case c = default_case(23);
  EpConfig cfg = config(c);
  if (world_rank() % 2 == 1) cfg.comm_alg = "fullmesh";
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(c, world_rank()), cfg);
  const auto want = ref::dispatch_reference(c.views(), c.E, 0);
  expect_matches_reference(out, want[world_rank()], c.H, 1);
}

// A rank that arrives late (after the others' deadline): every rank throws kTimeout (nobody
// hangs), on a communicator of its own. Must run last in this file.
TEST_F(DispatchAdversarial, ZzLateRankEveryoneTimesOut) {
  const int W = world_size(), rank = world_rank();
  if (W < 2) GTEST_SKIP() << "needs a late rank";
  CommOptions opt;
  opt.timeout_s = 0.5;
  auto own = Communicator::from_mpi(MPI_COMM_WORLD, opt);
  Case c = default_case(29);
  if (rank == W - 1) std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    dispatch_v2(dispatch_inputs(c, rank), config(c, own.get()));
    ADD_FAILURE() << "no timeout on rank " << rank;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("timed out after 0.5 s"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace moe_ep
