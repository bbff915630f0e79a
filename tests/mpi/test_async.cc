// The asynchronous ops (moe_ep/async.h): the same bits as the synchronous forms, several ops in
// flight, sync ops ordered behind started ones, per-source completion, errors out of wait(), and
// the misuses they refuse. The synchronous forms' own results are checked against the reference
// in test_dispatch*.cc; here each async result is compared with its synchronous twin.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "moe_ep/async.h"
#include "moe_ep/backward.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "mpi/common.h"

namespace moe_ep {
namespace {

Communicator* comm() {
  static std::shared_ptr<Communicator> c = Communicator::from_mpi(MPI_COMM_WORLD);
  return c.get();
}

// This rank's tokens: BS tokens of H bf16 values, K = 2 distinct experts of E = 3 W, uneven.
struct Batch {
  int64_t BS = 0, H = 24, K = 2, E = 0;
  std::vector<uint16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> scales;
  TensorView x_view() { return TensorView::contiguous(x.data(), DType::kBF16, {BS, H}); }
  TensorView ids_view() { return TensorView::contiguous(ids.data(), DType::kI32, {BS, K}); }
  TensorView scales_view() { return TensorView::contiguous(scales.data(), DType::kF32, {BS, K}); }
};

Batch make_batch(uint64_t seed, int64_t bs = 6) {
  Batch b;
  b.BS = bs;
  b.E = 3 * comm()->size();
  test::SplitMix64 rng{seed * 104729 + static_cast<uint64_t>(comm()->rank())};
  for (int64_t i = 0; i < b.BS * b.H; ++i)
    b.x.push_back(float_to_bf16(static_cast<float>(rng.below(256)) / 32.0f - 4.0f));
  for (int64_t i = 0; i < b.BS; ++i) {
    const int32_t first = static_cast<int32_t>(rng.below(b.E));
    b.ids.push_back(first);
    b.ids.push_back(static_cast<int32_t>((first + 1 + rng.below(b.E - 1)) % b.E));
    for (int k = 0; k < 2; ++k) b.scales.push_back(static_cast<float>(1 + rng.below(8)) / 8.0f);
  }
  return b;
}

// $MOE_EP_TEST_COMM_ALG (ctest mpi_tests_hierarchy.*): the ops' comm_alg; with "hierarchy" a
// remote source is handed out when its relay's rows have landed (async.h).
EpConfig config(const Batch& b) {
  EpConfig c;
  if (const char* v = std::getenv("MOE_EP_TEST_COMM_ALG")) c.comm_alg = v;
  c.group_ep = comm();
  c.ep_world_size = comm()->size();
  c.ep_rank_id = comm()->rank();
  c.moe_expert_num = b.E;
  return c;
}

DispatchInputs dispatch_inputs(Batch& b) {
  DispatchInputs in;
  in.x = b.x_view();
  in.expert_ids = b.ids_view();
  in.expert_scales = b.scales_view();
  return in;
}

CombineInputs combine_inputs(Batch& b, const DispatchOutputs& d) {
  CombineInputs in;
  in.expand_x = d.expand_x;
  in.expert_ids = b.ids_view();
  in.expert_scales = b.scales_view();
  in.handle = &d.handle;
  return in;
}

int64_t valid_rows(const DispatchOutputs& d) { return d.tp_recv_counts.ptr<int32_t>()[0]; }

void expect_same_dispatch(const DispatchOutputs& got, const DispatchOutputs& want, int64_t H) {
  const int64_t valid = valid_rows(want);
  ASSERT_EQ(valid_rows(got), valid);
  EXPECT_EQ(std::memcmp(got.expand_x.data(), want.expand_x.data(), valid * H * 2), 0);
  EXPECT_EQ(std::memcmp(got.assist_info_for_combine.data(), want.assist_info_for_combine.data(),
                        valid * 3 * 4),
            0);
  EXPECT_EQ(std::memcmp(got.expand_scales.data(), want.expand_scales.data(), valid * 4), 0);
  ASSERT_EQ(got.ep_recv_counts.nbytes(), want.ep_recv_counts.nbytes());
  EXPECT_EQ(std::memcmp(got.ep_recv_counts.data(), want.ep_recv_counts.data(),
                        got.ep_recv_counts.nbytes()),
            0);
}

void expect_same_tensor(const Tensor& got, const Tensor& want) {
  ASSERT_EQ(got.nbytes(), want.nbytes());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.nbytes()), 0);
}

TEST(Async, SameBitsAsTheSynchronousOps) {
  Batch b = make_batch(1);
  const DispatchOutputs want = dispatch_v2(dispatch_inputs(b), config(b));
  const Tensor want_y = combine_v2(combine_inputs(b, want), config(b));
  PendingDispatch pd = dispatch_v2_start(dispatch_inputs(b), config(b));
  const DispatchOutputs got = pd.wait();
  EXPECT_TRUE(pd.test());
  expect_same_dispatch(got, want, b.H);
  Pending<Tensor> pc = combine_v2_start(combine_inputs(b, got), config(b));
  expect_same_tensor(pc.wait(), want_y);
}

// Two micro-batches in flight at once, as an overlapped MoE layer runs them; a synchronous call
// between them runs after the started ones.
TEST(Async, SeveralOpsInFlightKeepTheirOrder) {
  Batch b1 = make_batch(2), b2 = make_batch(3, 9), b3 = make_batch(4, 1);
  const DispatchOutputs w1 = dispatch_v2(dispatch_inputs(b1), config(b1));
  const DispatchOutputs w2 = dispatch_v2(dispatch_inputs(b2), config(b2));
  const DispatchOutputs w3 = dispatch_v2(dispatch_inputs(b3), config(b3));
  const Tensor y1 = combine_v2(combine_inputs(b1, w1), config(b1));
  const Tensor y2 = combine_v2(combine_inputs(b2, w2), config(b2));
  PendingDispatch p1 = dispatch_v2_start(dispatch_inputs(b1), config(b1));
  PendingDispatch p2 = dispatch_v2_start(dispatch_inputs(b2), config(b2));
  const DispatchOutputs g3 = dispatch_v2(dispatch_inputs(b3), config(b3));  // behind p1, p2
  EXPECT_TRUE(p1.test());
  EXPECT_TRUE(p2.test());
  expect_same_dispatch(g3, w3, b3.H);
  const DispatchOutputs g1 = p1.wait();
  Pending<Tensor> c1 = combine_v2_start(combine_inputs(b1, g1), config(b1));
  const DispatchOutputs g2 = p2.wait();
  Pending<Tensor> c2 = combine_v2_start(combine_inputs(b2, g2), config(b2));
  expect_same_tensor(c2.wait(), y2);
  expect_same_tensor(c1.wait(), y1);
  expect_same_dispatch(g1, w1, b1.H);
  expect_same_dispatch(g2, w2, b2.H);
}

// Every source is handed out once, with the block layout of ep_recv_counts, and its rows are
// already the final ones when it is handed out.
TEST(Async, EachSourceLandsOnceWithItsRows) {
  for (const char* transport : {"shm", "mpi"}) {
    SCOPED_TRACE(transport);
    Batch b = make_batch(5, 7);
    EpConfig cfg = config(b);
    cfg.transport = transport;
    const DispatchOutputs want = dispatch_v2(dispatch_inputs(b), cfg);
    const int W = comm()->size();
    const int64_t L = want.expert_token_nums.numel();
    const int32_t* inclusive = want.ep_recv_counts.ptr<int32_t>();
    PendingDispatch p = dispatch_v2_start(dispatch_inputs(b), cfg);
    std::set<int64_t> seen;
    while (std::optional<SourceRows> s = p.wait_source()) {
      ASSERT_TRUE(s->source >= 0 && s->source < W) << s->source;
      EXPECT_TRUE(seen.insert(s->source).second) << "source " << s->source << " twice";
      ASSERT_EQ(static_cast<int64_t>(s->rows.size()), L);
      for (int64_t l = 0; l < L; ++l) {
        const int64_t blk = l * W + s->source;
        const int64_t end = inclusive[blk], n = end - (blk > 0 ? inclusive[blk - 1] : 0);
        EXPECT_EQ(s->rows[l], n);
        EXPECT_EQ(s->offsets[l], end - n);
        const int64_t bytes = n * b.H * 2, at = (end - n) * b.H * 2;
        EXPECT_EQ(std::memcmp(s->expand_x.ptr<char>() + at, want.expand_x.ptr<char>() + at,
                              static_cast<std::size_t>(bytes)),
                  0)
            << "source " << s->source << " expert " << l;
        // Their expand_scales and assist_info_for_combine entries are written too.
        EXPECT_EQ(std::memcmp(s->expand_scales.ptr<float>() + (end - n),
                              want.expand_scales.ptr<float>() + (end - n),
                              static_cast<std::size_t>(n) * 4),
                  0);
        for (int64_t j = end - n; j < end; ++j)
          EXPECT_EQ(s->assist_info_for_combine.ptr<int32_t>()[3 * j], s->source) << "row " << j;
      }
    }
    EXPECT_EQ(static_cast<int>(seen.size()), W);
    const DispatchOutputs got = p.wait();
    expect_same_dispatch(got, want, b.H);
    EXPECT_FALSE(p.wait_source().has_value());
  }
}

TEST(Async, BackwardFormsMatch) {
  Batch b = make_batch(6);
  const DispatchOutputs d = dispatch_v2(dispatch_inputs(b), config(b));
  DispatchBackwardInputs dbi;
  dbi.grad_expand_x = d.expand_x;
  dbi.expert_ids = b.ids_view();
  dbi.handle = &d.handle;
  const Tensor want_dx = dispatch_v2_backward(dbi, config(b));
  CombineBackwardInputs cbi;
  cbi.grad_out = b.x_view();
  cbi.expand_x = d.expand_x;
  cbi.expert_ids = b.ids_view();
  cbi.expert_scales = b.scales_view();
  cbi.handle = &d.handle;
  const CombineBackwardOutputs want_c = combine_v2_backward(cbi, config(b));
  Pending<Tensor> pdx = dispatch_v2_backward_start(dbi, config(b));
  Pending<CombineBackwardOutputs> pc = combine_v2_backward_start(cbi, config(b));
  const CombineBackwardOutputs got_c = pc.wait();
  expect_same_tensor(pdx.wait(), want_dx);
  const int64_t valid = valid_rows(d);
  EXPECT_EQ(std::memcmp(got_c.grad_expand_x.data(), want_c.grad_expand_x.data(), valid * b.H * 2),
            0);
  expect_same_tensor(got_c.grad_expert_scales, want_c.grad_expert_scales);
}

// An argument error comes out of wait() on every rank: the bad rank's own, RemoteError elsewhere.
TEST(Async, ErrorsComeOutOfWait) {
  const int bad = comm()->size() - 1;
  Batch b = make_batch(7);
  if (comm()->rank() == bad) b.ids[0] = static_cast<int32_t>(b.E + 5);
  test::expect_collective_error(
      [&] {
        PendingDispatch p = dispatch_v2_start(dispatch_inputs(b), config(b));
        p.wait();
      },
      comm()->rank(), comm()->size() > 1 ? bad : -1, ErrorKind::kInvalidArgument, {"dispatch_v2"});
  // The communicator is still usable: an argument error is agreed before any row moves.
  Batch ok = make_batch(8);
  const DispatchOutputs want = dispatch_v2(dispatch_inputs(ok), config(ok));
  PendingDispatch p = dispatch_v2_start(dispatch_inputs(ok), config(ok));
  expect_same_dispatch(p.wait(), want, ok.H);
}

TEST(Async, MisusesAreRefused) {
  Batch b = make_batch(9);
  PendingDispatch p = dispatch_v2_start(dispatch_inputs(b), config(b));
  p.wait();
  auto message_of = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(message_of([&] { p.wait(); }).find("already called"), std::string::npos);
  PendingDispatch none;
  EXPECT_FALSE(none.valid());
  EXPECT_FALSE(none.test());
  EXPECT_NE(message_of([&] { none.wait(); }).find("holds no op"), std::string::npos);
  EXPECT_NE(message_of([&] { none.wait_source(); }).find("holds no op"), std::string::npos);
  EpConfig no_group = config(b);
  no_group.group_ep = nullptr;
  EXPECT_NE(message_of([&] {
              dispatch_v2_start(dispatch_inputs(b), no_group);
            }).find("dispatch_v2_start: group_ep is null"),
            std::string::npos);
  EpConfig tp = config(b);
  tp.tp_world_size = 2;
  try {
    dispatch_v2_start(dispatch_inputs(b), tp);
    ADD_FAILURE() << "tp_world_size 2 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("tp_world_size 2"), std::string::npos) << e.what();
  }
}

// Pendings dropped without wait() and the communicator destroyed with ops still queued: the
// destructor waits for them (the inputs outlive it here), and a new communicator works.
TEST(Async, DestroyingTheCommunicatorWaitsForItsOps) {
  Batch b = make_batch(11), b2 = make_batch(12, 3);
  const DispatchOutputs want = dispatch_v2(dispatch_inputs(b2), config(b2));
  for (int round = 0; round < 2; ++round) {
    auto c = Communicator::from_mpi(MPI_COMM_WORLD);
    EpConfig cfg = config(b);
    cfg.group_ep = c.get();
    for (int i = 0; i < 3; ++i) dispatch_v2_start(dispatch_inputs(b), cfg);  // dropped at once
    if (round == 1) {  // a synchronous op queued behind them first
      EpConfig cfg2 = config(b2);
      cfg2.group_ep = c.get();
      expect_same_dispatch(dispatch_v2(dispatch_inputs(b2), cfg2), want, b2.H);
    }
  }
}

// A peer that never joins: wait() ends by the deadline with the timeout naming it.
TEST(Async, ALatePeerTimesOutInWait) {
  if (comm()->size() < 2) GTEST_SKIP() << "needs two ranks";
  MPI_Comm own;
  MPI_Comm_dup(MPI_COMM_WORLD, &own);
  {
    auto c = Communicator::from_mpi(own, {.timeout_s = 0.5});
    if (c->rank() == 0) {
      Batch b = make_batch(10);
      EpConfig cfg = config(b);
      cfg.group_ep = c.get();
      PendingDispatch p = dispatch_v2_start(dispatch_inputs(b), cfg);
      try {
        p.wait();
        ADD_FAILURE() << "no timeout";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kTimeout) << e.what();
        EXPECT_NE(std::string(e.what()).find("waiting for rank(s) 1"), std::string::npos)
            << e.what();
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  MPI_Comm_free(&own);
}

}  // namespace
}  // namespace moe_ep
