// dispatch_v2 / combine_v2 with tensor parallelism (tp_world_size 2, SPEC §1.1 step 3, §1.4, §2)
// under mpiexec at an even world size N >= 2: N / 2 EP ranks per EP group, two EP groups, TP pairs
// of the same EP rank. Two rank groupings: the seed's (world rank r = EP rank r / 2, TP rank r % 2)
// and halves (EP rank r % W, TP rank r / W). Skipped at odd N.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moe_ep/backward.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "mpi/common.h"
#include "ref/ep_backward_ref.h"
#include "ref/ep_ref.h"
#include "ref/numeric.h"

namespace moe_ep {
namespace {

enum class Grouping { kSeed, kHalves };

struct TpWorld {
  int world_rank = 0, N = 0, W = 0, ep_rank = 0, tp_rank = 0;
  std::shared_ptr<Communicator> ep, tp;
};

TpWorld make_world(Grouping g) {
  TpWorld w;
  MPI_Comm_rank(MPI_COMM_WORLD, &w.world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &w.N);
  w.W = w.N / 2;
  w.ep_rank = g == Grouping::kSeed ? w.world_rank / 2 : w.world_rank % w.W;
  w.tp_rank = g == Grouping::kSeed ? w.world_rank % 2 : w.world_rank / w.W;
  MPI_Comm ep = MPI_COMM_NULL, tp = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, w.tp_rank, w.ep_rank, &ep);
  MPI_Comm_split(MPI_COMM_WORLD, w.ep_rank, w.tp_rank, &tp);
  w.ep = Communicator::from_mpi(ep);
  w.tp = Communicator::from_mpi(tp);
  MPI_Comm_free(&ep);
  MPI_Comm_free(&tp);
  return w;
}

bool skip() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n < 2 || n % 2 != 0;
}

// One EP group's global batch: W ranks x BS tokens (bf16), K = min(2, E) distinct ids, E = W.
struct Group {
  int64_t W = 1, BS = 0, H = 8, K = 1, E = 1, global_bs = 0;
  std::vector<std::vector<uint16_t>> x;    // per EP rank, (BS, H) bf16
  std::vector<std::vector<int32_t>> ids;   // per EP rank, (BS, K)
  std::vector<std::vector<float>> scales;  // per EP rank, (BS, K)
  std::vector<ref::EpRankInput> inputs() {
    std::vector<ref::EpRankInput> r(W);
    for (int64_t p = 0; p < W; ++p) {
      r[p].x = TensorView::contiguous(x[p].data(), DType::kBF16, {BS, H});
      r[p].expert_ids = TensorView::contiguous(ids[p].data(), DType::kI32, {BS, K});
      r[p].expert_scales = TensorView::contiguous(scales[p].data(), DType::kF32, {BS, K});
    }
    return r;
  }
};

Group make_group(int64_t W, int64_t BS, int64_t global_bs, uint64_t seed) {
  Group g;
  g.W = W;
  g.BS = BS;
  g.E = W;
  g.K = std::min<int64_t>(2, g.E);
  g.global_bs = global_bs;
  test::SplitMix64 rng{seed};
  for (int64_t p = 0; p < W; ++p) {
    std::vector<uint16_t> x(BS * g.H);
    for (auto& v : x) {
      const float f = static_cast<float>(rng.below(2001) - 1000) / 256.0f;
      ref::store(DType::kBF16, &v, 0, f);
    }
    std::vector<int32_t> ids(BS * g.K);
    std::vector<float> sc(BS * g.K);
    for (int64_t i = 0; i < BS; ++i) {
      const int64_t first = rng.below(g.E);
      for (int64_t k = 0; k < g.K; ++k) {
        ids[i * g.K + k] = static_cast<int32_t>((first + k) % g.E);
        sc[i * g.K + k] = static_cast<float>(rng.below(1000) + 1) / 1024.0f;
      }
    }
    g.x.push_back(std::move(x));
    g.ids.push_back(std::move(ids));
    g.scales.push_back(std::move(sc));
  }
  return g;
}

EpConfig config(const TpWorld& w, const Group& g, bool tp) {
  EpConfig c;
  c.group_ep = w.ep.get();
  c.ep_world_size = w.W;
  c.ep_rank_id = w.ep_rank;
  c.moe_expert_num = g.E;
  c.global_bs = g.global_bs;
  if (tp) {
    c.group_tp = w.tp.get();
    c.tp_world_size = 2;
    c.tp_rank_id = w.tp_rank;
  }
  return c;
}

DispatchInputs dispatch_inputs(Group& g, int64_t r) {
  DispatchInputs in;
  in.x = TensorView::contiguous(g.x[r].data(), DType::kBF16, {g.BS, g.H});
  in.expert_ids = TensorView::contiguous(g.ids[r].data(), DType::kI32, {g.BS, g.K});
  in.expert_scales = TensorView::contiguous(g.scales[r].data(), DType::kF32, {g.BS, g.K});
  return in;
}

// Expert outputs for every valid row of a TP rank (L = 1: one expert, this EP rank's).
Tensor run_expert(const DispatchOutputs& d, int64_t e, int64_t H, const ref::ExpertFn& fn) {
  Tensor y = Tensor::zeros(DType::kBF16, {d.expand_x.size(0), H});
  const int64_t valid = d.tp_recv_counts.ptr<int32_t>()[0] + d.tp_recv_counts.ptr<int32_t>()[1];
  for (int64_t j = 0; j < valid; ++j)
    fn(e, DType::kBF16, d.expand_x.ptr<uint16_t>() + j * H, y.ptr<uint16_t>() + j * H, H);
  return y;
}

Tensor combine(Group& g, int64_t r, const DispatchOutputs& d, const Tensor& y, const EpConfig& c,
               bool tp_send_counts = true) {
  CombineInputs in;
  in.expand_x = y;
  in.expert_ids = TensorView::contiguous(g.ids[r].data(), DType::kI32, {g.BS, g.K});
  in.assist_info_for_combine = d.assist_info_for_combine;
  in.ep_send_counts = d.ep_recv_counts;
  in.expert_scales = TensorView::contiguous(g.scales[r].data(), DType::kF32, {g.BS, g.K});
  if (tp_send_counts && c.tp_world_size == 2) in.tp_send_counts = d.tp_recv_counts;
  return combine_v2(in, c);
}

void expect_layout(const DispatchOutputs& d, const ref::EpRankDispatch& want, int tp_rank,
                   int64_t own, int64_t peer) {
  ASSERT_EQ(d.expand_x.size(0), 2 * want.A);
  ASSERT_EQ(d.expand_x.nbytes(), want.expand_x.size());
  // The packed layout: own rows, then the peer's (want.valid = own + peer), then rows that are
  // unspecified (SPEC §1.4: only the valid rows are meaningful); likewise assist_info_for_combine
  // past its first 3 * valid entries. Only those prefixes are compared.
  ASSERT_EQ(want.valid, own + peer);
  const std::size_t row_bytes =
      want.A > 0 ? want.expand_x.size() / static_cast<std::size_t>(2 * want.A) : 0;
  EXPECT_EQ(std::memcmp(d.expand_x.data(), want.expand_x.data(),
                        static_cast<std::size_t>(want.valid) * row_bytes),
            0);
  EXPECT_EQ(test::values<int32_t>(d.ep_recv_counts), want.ep_recv_counts);
  EXPECT_EQ(test::values<int64_t>(d.expert_token_nums), want.expert_token_nums1);
  EXPECT_EQ(d.assist_info_for_combine.numel(), static_cast<int64_t>(want.assist_info.size()));
  EXPECT_EQ(test::values<int32_t>(d.assist_info_for_combine, 3 * want.valid),
            test::prefix(want.assist_info, 3 * want.valid));
  EXPECT_EQ(test::values<float>(d.expand_scales), want.expand_scales);
  ASSERT_EQ(d.tp_recv_counts.numel(), 2);
  EXPECT_EQ(d.tp_recv_counts.ptr<int32_t>()[tp_rank], own);
  EXPECT_EQ(d.tp_recv_counts.ptr<int32_t>()[1 - tp_rank], peer);
}

// Both EP groups' batches; group t is the batch of TP rank t.
struct Case {
  TpWorld w;
  Group g[2];
  std::vector<ref::EpRankDispatch> ref[2];
};

Case make_case(Grouping grouping, int64_t BS0, int64_t BS1, int64_t m, uint64_t seed) {
  Case c;
  c.w = make_world(grouping);
  const int64_t W = c.w.W;
  c.g[0] = make_group(W, BS0, W * m, seed);
  c.g[1] = make_group(W, BS1, W * m, seed + 1000);
  for (int t = 0; t < 2; ++t) c.ref[t] = ref::dispatch_reference(c.g[t].inputs(), W, W * m);
  return c;
}

// SPEC §6 with TP over the handle of `d`: dispatch_v2_backward of the partials y is combine_v2
// with unit weights (the pair's reduce-scatter, then the sum); combine_v2_backward of grad_out =
// each group's x gives this rank's rows and the peer's (rne(w * g) from each group's grad_out)
// and grad_expert_scales against the pair's sums.
void backward_round_trip(Case& c, const DispatchOutputs& d, const Tensor& y,
                         const ref::ExpertFn& p0, const ref::ExpertFn& p1) {
  const TpWorld& w = c.w;
  const int t = w.tp_rank;
  Group& g = c.g[t];
  const EpConfig cfg = config(w, g, true);
  const int64_t H = g.H, row_bytes = H * 2;
  {
    SCOPED_TRACE("dispatch_v2_backward");
    DispatchBackwardInputs in;
    in.grad_expand_x = y;
    in.expert_ids = TensorView::contiguous(g.ids[w.ep_rank].data(), DType::kI32, {g.BS, g.K});
    in.handle = &d.handle;
    const Tensor gx = dispatch_v2_backward(in, cfg);
    Group unit = g;
    for (auto& s : unit.scales) std::fill(s.begin(), s.end(), 1.0f);
    const auto want = ref::combine_reference(unit.inputs(), ref::tp_sum_expert(p0, p1));
    ASSERT_EQ(gx.nbytes(), want[w.ep_rank].size());
    EXPECT_EQ(std::memcmp(gx.data(), want[w.ep_rank].data(), gx.nbytes()), 0);
  }
  SCOPED_TRACE("combine_v2_backward");
  CombineBackwardInputs in;
  in.grad_out = TensorView::contiguous(g.x[w.ep_rank].data(), DType::kBF16, {g.BS, H});
  in.expand_x = y;
  in.expert_ids = TensorView::contiguous(g.ids[w.ep_rank].data(), DType::kI32, {g.BS, g.K});
  in.expert_scales = TensorView::contiguous(g.scales[w.ep_rank].data(), DType::kF32, {g.BS, g.K});
  in.handle = &d.handle;
  const CombineBackwardOutputs o = combine_v2_backward(in, cfg);
  {  // expand_x without the TP peer's rows on the TP rank 0 ranks: refused before any data
     // moves (InvalidArgument there, Remote on every other rank of both EP groups)
    SCOPED_TRACE("combine_v2_backward with expand_x short of the pair's rows");
    const int32_t* tp = d.tp_recv_counts.ptr<int32_t>();
    const bool bad = t == 0 && int64_t{tp[0]} + tp[1] > 0;
    CombineBackwardInputs shorter = in;
    if (bad) shorter.expand_x.shape[0] = int64_t{tp[0]} + tp[1] - 1;
    try {
      combine_v2_backward(shorter, cfg);
      EXPECT_FALSE(bad) << "no error";
    } catch (const Error& e) {
      if (bad)
        EXPECT_NE(std::string(e.what()).find("this rank's and its TP peer's"), std::string::npos)
            << e.what();
      else
        EXPECT_EQ(e.kind(), ErrorKind::kRemote) << e.what();
    }
  }
  std::vector<ref::CombineBackwardRef> want[2];
  for (int u = 0; u < 2; ++u) {
    std::vector<std::vector<unsigned char>> grad_out;
    for (const auto& x : c.g[u].x)
      grad_out.emplace_back(reinterpret_cast<const unsigned char*>(x.data()),
                            reinterpret_cast<const unsigned char*>(x.data() + x.size()));
    ref::EpWorld world;
    world.E = c.g[u].E;
    world.global_bs = c.g[u].global_bs;
    want[u] = ref::combine_backward_reference(c.g[u].inputs(), world, c.ref[u], grad_out,
                                              ref::tp_sum_expert(p0, p1));
  }
  EXPECT_EQ(test::values<float>(o.grad_expert_scales), want[t][w.ep_rank].grad_expert_scales);
  std::vector<unsigned char> rows = want[t][w.ep_rank].grad_expand_x;
  const auto& peer = want[1 - t][w.ep_rank].grad_expand_x;
  rows.insert(rows.end(), peer.begin(), peer.end());
  rows.resize(static_cast<std::size_t>(y.size(0) * row_bytes), 0);
  ASSERT_EQ(o.grad_expand_x.nbytes(), rows.size());
  EXPECT_EQ(std::memcmp(o.grad_expand_x.data(), rows.data(), rows.size()), 0);
}

void round_trip(Grouping grouping, uint64_t seed) {
  Case c = make_case(grouping, 5, 3, 5, seed);
  const TpWorld& w = c.w;
  const int t = w.tp_rank;
  Group& g = c.g[t];
  const EpConfig cfg = config(w, g, true);
  DispatchOutputs d = dispatch_v2(dispatch_inputs(g, w.ep_rank), cfg);
  const ref::EpRankDispatch& own = c.ref[t][w.ep_rank];
  const ref::EpRankDispatch& peer = c.ref[1 - t][w.ep_rank];
  expect_layout(d, ref::tp_layout(own, peer, w.W), t, own.valid, peer.valid);

  // Partials on both TP ranks, summed in fp32 in tp order.
  const ref::ExpertFn p0 = ref::scale_expert(g.E);
  const ref::ExpertFn p1 = [](int64_t e, DType dtype, const void* in, void* out, int64_t H) {
    for (int64_t h = 0; h < H; ++h)
      ref::store(dtype, out, h,
                 ref::load(dtype, in, h) * (0.375f - 0.125f * static_cast<float>(e)));
  };
  Tensor y = run_expert(d, w.ep_rank, g.H, t == 0 ? p0 : p1);
  Tensor out = combine(g, w.ep_rank, d, y, cfg);
  const auto want = ref::combine_reference(g.inputs(), ref::tp_sum_expert(p0, p1));
  ASSERT_EQ(out.nbytes(), want[w.ep_rank].size());
  EXPECT_EQ(std::memcmp(out.data(), want[w.ep_rank].data(), out.nbytes()), 0);

  // SPEC §7 with TP: a cached dispatch gives the same layout, and combine given its handle (no
  // assist_info_for_combine, ep_send_counts or tp_send_counts) the same sum.
  DispatchInputs cached_in = dispatch_inputs(g, w.ep_rank);
  cached_in.handle = &d.handle;
  DispatchOutputs cached = dispatch_v2(cached_in, cfg);
  expect_layout(cached, ref::tp_layout(own, peer, w.W), t, own.valid, peer.valid);
  Tensor yc = run_expert(cached, w.ep_rank, g.H, t == 0 ? p0 : p1);
  CombineInputs hin;
  hin.expand_x = yc;
  hin.expert_ids = TensorView::contiguous(g.ids[w.ep_rank].data(), DType::kI32, {g.BS, g.K});
  hin.expert_scales = TensorView::contiguous(g.scales[w.ep_rank].data(), DType::kF32, {g.BS, g.K});
  hin.handle = &cached.handle;
  Tensor out_h = combine_v2(hin, cfg);
  ASSERT_EQ(out_h.nbytes(), want[w.ep_rank].size());
  EXPECT_EQ(std::memcmp(out_h.data(), want[w.ep_rank].data(), out_h.nbytes()), 0);
  backward_round_trip(c, d, y, p0, p1);
}

TEST(DispatchTp, HandMadeLayout) {
  if (skip()) GTEST_SKIP() << "needs an even world size";
  // BS 2 on TP rank 0's group, 3 on rank 1's, global_bs = 4 W, K = 1 when W = 1.
  Case c = make_case(Grouping::kSeed, 2, 3, 4, 7);
  const TpWorld& w = c.w;
  const int t = w.tp_rank;
  DispatchOutputs d = dispatch_v2(dispatch_inputs(c.g[t], w.ep_rank), config(w, c.g[t], true));
  const ref::EpRankDispatch& own = c.ref[t][w.ep_rank];
  const ref::EpRankDispatch& peer = c.ref[1 - t][w.ep_rank];
  expect_layout(d, ref::tp_layout(own, peer, w.W), t, own.valid, peer.valid);
  if (w.W == 1) {
    // Written out: every token goes to expert 0 (the only one).
    EXPECT_EQ(test::values<int32_t>(d.tp_recv_counts), (std::vector<int32_t>{2, 3}));
    EXPECT_EQ(test::values<int32_t>(d.ep_recv_counts), (std::vector<int32_t>{t == 0 ? 2 : 3, 5}));
    EXPECT_EQ(test::values<int64_t>(d.expert_token_nums), (std::vector<int64_t>{5}));
    EXPECT_EQ(d.expand_x.size(0), 8);
    const std::vector<int32_t> assist = test::values<int32_t>(d.assist_info_for_combine, 15);
    const std::vector<int32_t> tokens =
        t == 0 ? std::vector<int32_t>{0, 1, 0, 1, 2} : std::vector<int32_t>{0, 1, 2, 0, 1};
    for (int j = 0; j < 5; ++j) EXPECT_EQ(assist[3 * j + 1], tokens[j]) << "row " << j;
    const Group& og = c.g[t];
    const Group& pg = c.g[1 - t];
    const int64_t own_n = t == 0 ? 2 : 3;
    // Own rows, then the peer's; rows 5..7 are unspecified (SPEC §1.4) and not compared.
    for (int64_t j = 0; j < 5; ++j) {
      const uint16_t* row = d.expand_x.ptr<uint16_t>() + j * og.H;
      std::vector<uint16_t> want;
      if (j < own_n)
        want.assign(og.x[0].begin() + j * og.H, og.x[0].begin() + (j + 1) * og.H);
      else
        want.assign(pg.x[0].begin() + (j - own_n) * og.H, pg.x[0].begin() + (j - own_n + 1) * og.H);
      EXPECT_EQ(std::vector<uint16_t>(row, row + og.H), want) << "row " << j;
    }
  }
}

TEST(DispatchTp, RoundTripSeedGrouping) {
  if (skip()) GTEST_SKIP() << "needs an even world size";
  round_trip(Grouping::kSeed, 11);
}

TEST(DispatchTp, RoundTripHalvesGrouping) {
  if (skip()) GTEST_SKIP() << "needs an even world size";
  round_trip(Grouping::kHalves, 12);
}

// T = 1 on each EP group vs T = 2 with the scale expert on TP rank 0 and zeros on TP rank 1: the
// same bits.
TEST(DispatchTp, CrossTBitwise) {
  if (skip()) GTEST_SKIP() << "needs an even world size";
  for (Grouping grouping : {Grouping::kSeed, Grouping::kHalves}) {
    Case c = make_case(grouping, 6, 6, 6, 21);
    const TpWorld& w = c.w;
    const int t = w.tp_rank;
    Group& g = c.g[t];
    const ref::ExpertFn scale = ref::scale_expert(g.E);
    const ref::ExpertFn zero = [](int64_t, DType dtype, const void*, void* out, int64_t H) {
      std::memset(out, 0, static_cast<std::size_t>(H) * (dtype == DType::kF32 ? 4 : 2));
    };
    const EpConfig c1 = config(w, g, false);
    DispatchOutputs d1 = dispatch_v2(dispatch_inputs(g, w.ep_rank), c1);
    Tensor y1 = Tensor::zeros(DType::kBF16, {d1.expand_x.size(0), g.H});
    for (int64_t j = 0; j < d1.tp_recv_counts.ptr<int32_t>()[0]; ++j)
      scale(w.ep_rank, DType::kBF16, d1.expand_x.ptr<uint16_t>() + j * g.H,
            y1.ptr<uint16_t>() + j * g.H, g.H);
    Tensor out1 = combine(g, w.ep_rank, d1, y1, c1);

    const EpConfig c2 = config(w, g, true);
    DispatchOutputs d2 = dispatch_v2(dispatch_inputs(g, w.ep_rank), c2);
    Tensor y2 = run_expert(d2, w.ep_rank, g.H, t == 0 ? scale : zero);
    Tensor out2 = combine(g, w.ep_rank, d2, y2, c2, /*tp_send_counts=*/false);
    ASSERT_EQ(out1.nbytes(), out2.nbytes());
    EXPECT_EQ(std::memcmp(out1.data(), out2.data(), out1.nbytes()), 0);
    const auto want = ref::combine_reference(g.inputs(), scale);
    EXPECT_EQ(std::memcmp(out2.data(), want[w.ep_rank].data(), out2.nbytes()), 0);
  }
}

// Every rank throws; `bad_world_rank` < 0: every rank throws `kind`; else that rank throws `kind`
// and the others kRemote. Every message contains `needle`. Then a good round trip.
void expect_tp_error(const std::function<void()>& call, int bad_world_rank, ErrorKind kind,
                     const std::string& needle) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    call();
    ADD_FAILURE() << "no error thrown on rank " << rank;
  } catch (const Error& e) {
    const ErrorKind want = bad_world_rank < 0 || rank == bad_world_rank ? kind : ErrorKind::kRemote;
    EXPECT_STREQ(error_kind_name(e.kind()), error_kind_name(want)) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  round_trip(Grouping::kSeed, 31);
}

TEST(DispatchTpErrors, MoreThanOneLocalExpert) {
  if (skip()) GTEST_SKIP() << "needs an even world size";
  Case c = make_case(Grouping::kSeed, 4, 4, 4, 41);
  Group& g = c.g[c.w.tp_rank];
  EpConfig cfg = config(c.w, g, true);
  cfg.moe_expert_num = 2 * c.w.W;  // L = 2
  expect_tp_error([&] { dispatch_v2(dispatch_inputs(g, c.w.ep_rank), cfg); }, -1,
                  ErrorKind::kInvalidArgument,
                  "moe_expert_num = " + std::to_string(2 * c.w.W) + " gives L = 2");
}

TEST(DispatchTpErrors, MissingGroupTp) {
  if (skip()) GTEST_SKIP() << "needs an even world size";
  Case c = make_case(Grouping::kSeed, 4, 4, 4, 42);
  Group& g = c.g[c.w.tp_rank];
  EpConfig cfg = config(c.w, g, true);
  cfg.group_tp = nullptr;
  expect_tp_error([&] { dispatch_v2(dispatch_inputs(g, c.w.ep_rank), cfg); }, -1,
                  ErrorKind::kInvalidArgument, "group_tp is null with tp_world_size = 2");
}

TEST(DispatchTpErrors, TpRankIdMismatchOnOneRank) {
  if (skip()) GTEST_SKIP() << "needs an even world size";
  Case c = make_case(Grouping::kSeed, 4, 4, 4, 43);
  Group& g = c.g[c.w.tp_rank];
  EpConfig cfg = config(c.w, g, true);
  if (c.w.world_rank == 1) cfg.tp_rank_id = 0;  // TP rank 1 in group_tp
  expect_tp_error([&] { dispatch_v2(dispatch_inputs(g, c.w.ep_rank), cfg); }, 1,
                  ErrorKind::kInvalidArgument, "tp_rank_id = 0 differs");
}

TEST(DispatchTpErrors, CommQuantWithTp) {
  if (skip()) GTEST_SKIP() << "needs an even world size";
  Case c = make_case(Grouping::kSeed, 4, 4, 4, 44);
  Group& g = c.g[c.w.tp_rank];
  const EpConfig cfg = config(c.w, g, true);
  DispatchOutputs d = dispatch_v2(dispatch_inputs(g, c.w.ep_rank), cfg);
  Tensor y = run_expert(d, c.w.ep_rank, g.H, ref::scale_expert(g.E));
  CombineInputs in;
  in.expand_x = y;
  in.expert_ids = TensorView::contiguous(g.ids[c.w.ep_rank].data(), DType::kI32, {g.BS, g.K});
  in.assist_info_for_combine = d.assist_info_for_combine;
  in.ep_send_counts = d.ep_recv_counts;
  in.expert_scales = TensorView::contiguous(g.scales[c.w.ep_rank].data(), DType::kF32, {g.BS, g.K});
  in.comm_quant_mode = 2;
  expect_tp_error([&] { combine_v2(in, cfg); }, -1, ErrorKind::kInvalidArgument,
                  "comm_quant_mode = 2 (int8) is not allowed with tp_world_size = 2");
}

}  // namespace
}  // namespace moe_ep
