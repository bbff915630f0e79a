// The dispatch handle (SPEC §7): which rounds it saves, and the mistakes it refuses; and outputs
// written into the caller's memory (DispatchBuffers, CombineInputs::out). That its
// results are the same bits as the SPEC tensors' is checked with every feature in
// test_dispatch_features.cc (FeatureGrid), test_dispatch_quant.cc and test_dispatch_tp.cc.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "mpi/common.h"
#include "transport/communicator.h"
#include "transport/exchange.h"
#include "transport/windows.h"

namespace moe_ep {
namespace {

using test::expect_collective_error;

Communicator* comm() {
  static std::shared_ptr<Communicator> c = Communicator::from_mpi(MPI_COMM_WORLD);
  return c.get();
}

// This rank's tokens: BS = 5, H = 16, K = 3 distinct experts of E = 4 W, bf16.
struct Batch {
  int64_t BS = 5, H = 16, K = 3, E = 0;
  std::vector<uint16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> scales;
  std::vector<uint8_t> mask;
  TensorView x_view() { return TensorView::contiguous(x.data(), DType::kBF16, {BS, H}); }
  TensorView ids_view() { return TensorView::contiguous(ids.data(), DType::kI32, {BS, K}); }
  TensorView scales_view() { return TensorView::contiguous(scales.data(), DType::kF32, {BS, K}); }
  TensorView mask_view() { return TensorView::contiguous(mask.data(), DType::kBool, {BS, K}); }
};

Batch make_batch(uint64_t seed) {
  Batch b;
  const int W = comm()->size();
  b.E = 4 * W;
  test::SplitMix64 rng{seed * 7919 + static_cast<uint64_t>(comm()->rank())};
  for (int64_t i = 0; i < b.BS * b.H; ++i)
    b.x.push_back(float_to_bf16(static_cast<float>(rng.below(200)) / 64.0f - 1.5f));
  for (int64_t i = 0; i < b.BS; ++i) {
    std::vector<int32_t> pool(b.E);
    for (int32_t e = 0; e < b.E; ++e) pool[e] = e;
    for (int64_t k = 0; k < b.K; ++k) {
      std::swap(pool[k], pool[k + rng.below(b.E - k)]);
      b.ids.push_back(pool[k]);
      b.scales.push_back(static_cast<float>(1 + rng.below(8)) / 8.0f);
      b.mask.push_back(rng.below(5) != 0);
    }
  }
  return b;
}

EpConfig config(const Batch& b, Communicator* group = comm()) {
  EpConfig c;
  c.group_ep = group;
  c.ep_world_size = group->size();
  c.ep_rank_id = group->rank();
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

// combine_v2 of dispatch's rows as they came (identity experts), with or without the handle.
CombineInputs combine_inputs(Batch& b, const DispatchOutputs& d, bool handle) {
  CombineInputs in;
  in.expand_x = d.expand_x;
  in.expert_ids = b.ids_view();
  in.expert_scales = b.scales_view();
  if (handle) {
    in.handle = &d.handle;
  } else {
    in.assist_info_for_combine = d.assist_info_for_combine;
    in.ep_send_counts = d.ep_recv_counts;
  }
  return in;
}

// The phases (rounds of messages) `call` makes on this rank.
template <class F>
std::vector<std::string> phases_of(F&& call) {
  std::vector<std::string> trace;
  detail::phase_trace = &trace;
  try {
    call();
  } catch (...) {
    detail::phase_trace = nullptr;
    throw;
  }
  detail::phase_trace = nullptr;
  return trace;
}

bool has(const std::vector<std::string>& v, const char* s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& p : v) s += (s.empty() ? "" : ", ") + p;
  return s;
}

TEST(Handle, SavesTheLayoutRounds) {
  Batch b = make_batch(1);
  DispatchOutputs d;
  const auto plain = phases_of([&] { d = dispatch_v2(dispatch_inputs(b), config(b)); });
  EXPECT_TRUE(has(plain, "counts")) << joined(plain);
  DispatchInputs cached_in = dispatch_inputs(b);
  cached_in.handle = &d.handle;
  DispatchOutputs cached;
  const auto cached_phases = phases_of([&] { cached = dispatch_v2(cached_in, config(b)); });
  EXPECT_FALSE(has(cached_phases, "counts")) << joined(cached_phases);
  EXPECT_FALSE(has(cached_phases, "shm offsets")) << joined(cached_phases);
  EXPECT_TRUE(has(cached_phases, "header")) << joined(cached_phases);
  Tensor x_plain, x_handle;
  const auto without =
      phases_of([&] { x_plain = combine_v2(combine_inputs(b, cached, false), config(b)); });
  EXPECT_TRUE(has(without, "layout back")) << joined(without);
  const auto with =
      phases_of([&] { x_handle = combine_v2(combine_inputs(b, cached, true), config(b)); });
  EXPECT_FALSE(has(with, "layout back")) << joined(with);
  EXPECT_TRUE(has(with, "rows")) << joined(with);
  ASSERT_EQ(x_plain.nbytes(), x_handle.nbytes());
  EXPECT_EQ(std::memcmp(x_plain.data(), x_handle.data(), x_plain.nbytes()), 0);
}

TEST(Handle, OutlivesTheOutputs) {
  Batch b = make_batch(2);
  DispatchHandle h;
  Tensor want;
  {
    const DispatchOutputs d = dispatch_v2(dispatch_inputs(b), config(b));
    h = d.handle;
    want = combine_v2(combine_inputs(b, d, false), config(b));
  }
  DispatchInputs in = dispatch_inputs(b);
  in.handle = &h;
  const DispatchOutputs d = dispatch_v2(in, config(b));
  const Tensor got = combine_v2(combine_inputs(b, d, true), config(b));
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.nbytes()), 0);
}

TEST(Handle, OtherExpertIdsAreRefused) {
  Batch b = make_batch(3);
  const DispatchOutputs d = dispatch_v2(dispatch_inputs(b), config(b));
  const int rank = comm()->rank();
  // Rank 0 moves token 1's first entry to an expert the token does not use.
  if (rank == 0) {
    int32_t e = 0;
    while (std::count(b.ids.begin() + b.K, b.ids.begin() + 2 * b.K, e)) ++e;
    b.ids[b.K] = e;
  }
  expect_collective_error([&] { combine_v2(combine_inputs(b, d, true), config(b)); }, rank, 0,
                          ErrorKind::kInvalidArgument,
                          {"expert_ids[1,0]", "differs from the dispatch_v2 of the handle"});
  DispatchInputs in = dispatch_inputs(b);
  in.handle = &d.handle;
  expect_collective_error([&] { dispatch_v2(in, config(b)); }, rank, 0, ErrorKind::kInvalidArgument,
                          {"differs from the dispatch_v2"});
}

// NCCL EP's stale routing map: a cached handle used after the token count shrank is refused on
// every rank (dispatch_v2 and combine_v2), never replayed with the old layout.
TEST(Handle, ShrunkTokenCountIsRefused) {
  Batch b = make_batch(8);
  const DispatchOutputs d = dispatch_v2(dispatch_inputs(b), config(b));
  b.BS = 3;  // the views now cover the first 3 tokens
  DispatchInputs in = dispatch_inputs(b);
  in.handle = &d.handle;
  expect_collective_error([&] { dispatch_v2(in, config(b)); }, comm()->rank(), -1,
                          ErrorKind::kInvalidArgument, {"handle"});
  expect_collective_error([&] { combine_v2(combine_inputs(b, d, true), config(b)); },
                          comm()->rank(), -1, ErrorKind::kInvalidArgument, {"handle"});
}

TEST(Handle, OtherMaskIsRefused) {
  Batch b = make_batch(4);
  DispatchInputs in = dispatch_inputs(b);
  in.x_active_mask = b.mask_view();
  const DispatchOutputs d = dispatch_v2(in, config(b));
  // Every rank leaves the mask out: every rank refuses.
  expect_collective_error([&] { combine_v2(combine_inputs(b, d, true), config(b)); },
                          comm()->rank(), -1, ErrorKind::kInvalidArgument, {"x_active_mask"});
}

TEST(Handle, EveryRankMustPassTheSameHandle) {
  if (comm()->size() < 2) GTEST_SKIP() << "needs two ranks";
  Batch b = make_batch(5);
  const DispatchOutputs d1 = dispatch_v2(dispatch_inputs(b), config(b));
  const DispatchOutputs d2 = dispatch_v2(dispatch_inputs(b), config(b));
  const int rank = comm()->rank();
  // Only rank 0 passes one.
  CombineInputs some = combine_inputs(b, d2, rank == 0);
  expect_collective_error([&] { combine_v2(some, config(b)); }, rank, -1,
                          ErrorKind::kInvalidArgument,
                          {"the ranks passed different dispatch handles", "(every rank must pass"});
  // Rank 0 passes the first dispatch's, the others the second's.
  DispatchInputs in = dispatch_inputs(b);
  in.handle = rank == 0 ? &d1.handle : &d2.handle;
  expect_collective_error([&] { dispatch_v2(in, config(b)); }, rank, -1,
                          ErrorKind::kInvalidArgument, {"different dispatch handles"});
}

TEST(Handle, UndefinedOrForeignHandleIsRefused) {
  Batch b = make_batch(6);
  const int rank = comm()->rank();
  const DispatchOutputs d = dispatch_v2(dispatch_inputs(b), config(b));
  const DispatchHandle empty;
  EXPECT_FALSE(empty.defined());
  CombineInputs in = combine_inputs(b, d, true);
  if (rank == 0) in.handle = &empty;
  expect_collective_error([&] { combine_v2(in, config(b)); }, rank, 0, ErrorKind::kInvalidArgument,
                          {"handle is given but not defined"});
  // A handle of another communicator over the same ranks.
  auto other = Communicator::from_mpi(MPI_COMM_WORLD);
  const DispatchOutputs od = dispatch_v2(dispatch_inputs(b), config(b, other.get()));
  CombineInputs foreign = combine_inputs(b, d, true);
  if (rank == 0) foreign.handle = &od.handle;
  expect_collective_error([&] { combine_v2(foreign, config(b)); }, rank, 0,
                          ErrorKind::kInvalidArgument, {"belongs to another communicator"});
}

// Every defined output of a and b equal where defined (the valid rows of expand_x, the first
// 3 * valid entries of assist_info_for_combine), and the rest whole.
void expect_same_outputs(const DispatchOutputs& a, const DispatchOutputs& b, int64_t H) {
  const int64_t valid = a.tp_recv_counts.ptr<int32_t>()[0];
  ASSERT_EQ(valid, b.tp_recv_counts.ptr<int32_t>()[0]);
  EXPECT_EQ(std::memcmp(a.expand_x.data(), b.expand_x.data(), valid * H * 2), 0);
  EXPECT_EQ(std::memcmp(a.assist_info_for_combine.data(), b.assist_info_for_combine.data(),
                        valid * 3 * 4),
            0);
  for (auto t : {&DispatchOutputs::ep_recv_counts, &DispatchOutputs::expert_token_nums,
                 &DispatchOutputs::expand_scales}) {
    ASSERT_EQ((a.*t).nbytes(), (b.*t).nbytes());
    EXPECT_EQ(std::memcmp((a.*t).data(), (b.*t).data(), (a.*t).nbytes()), 0);
  }
}

TEST(Outputs, DispatchWritesTheCallersBuffers) {
  Batch b = make_batch(7);
  const DispatchOutputs want = dispatch_v2(dispatch_inputs(b), config(b));
  const DispatchOutputs buffers = dispatch_v2(dispatch_inputs(b), config(b));
  // Scribble over them: every output must be written again.
  std::memset(buffers.expand_scales.data(), 0x7f, buffers.expand_scales.nbytes());
  std::memset(buffers.ep_recv_counts.data(), 0x7f, buffers.ep_recv_counts.nbytes());
  const DispatchBuffers views = buffers_of(buffers);
  DispatchInputs in = dispatch_inputs(b);
  in.out = &views;
  const DispatchOutputs got = dispatch_v2(in, config(b));
  // The previous expand_x is a window slot still held (shm) or ordinary memory (mpi): written
  // in place either way.
  for (auto t : {&DispatchOutputs::expand_x, &DispatchOutputs::assist_info_for_combine,
                 &DispatchOutputs::expand_scales, &DispatchOutputs::ep_recv_counts,
                 &DispatchOutputs::tp_recv_counts, &DispatchOutputs::expert_token_nums})
    EXPECT_EQ((got.*t).data(), (buffers.*t).data());
  expect_same_outputs(got, want, b.H);
  // And combine into the caller's x.
  std::vector<uint16_t> x(static_cast<std::size_t>(b.BS * b.H), 0xffff);
  CombineInputs cin = combine_inputs(b, got, true);
  cin.out = TensorView::contiguous(x.data(), DType::kBF16, {b.BS, b.H});
  const Tensor y = combine_v2(cin, config(b));
  EXPECT_EQ(y.data(), x.data());
  const Tensor y_want = combine_v2(combine_inputs(b, want, false), config(b));
  EXPECT_EQ(std::memcmp(x.data(), y_want.data(), y_want.nbytes()), 0);
}

TEST(Outputs, ExpandXInOrdinaryMemory) {
  Batch b = make_batch(8);
  const DispatchOutputs want = dispatch_v2(dispatch_inputs(b), config(b));
  std::vector<uint16_t> rows(static_cast<std::size_t>(want.expand_x.numel()));
  DispatchBuffers views;
  views.expand_x = TensorView::contiguous(rows.data(), DType::kBF16,
                                          {want.expand_x.size(0), want.expand_x.size(1)});
  DispatchInputs in = dispatch_inputs(b);
  in.out = &views;
  const DispatchOutputs got = dispatch_v2(in, config(b));
  EXPECT_EQ(got.expand_x.data(), rows.data());
  expect_same_outputs(got, want, b.H);
}

// A serving loop: outputs, handle and window slot reused, every call the same bits, and no new
// shared-memory slot after the first calls.
TEST(Outputs, ServingLoopReusesEverything) {
  Batch b = make_batch(9);
  const DispatchOutputs first = dispatch_v2(dispatch_inputs(b), config(b));
  const Tensor want = combine_v2(combine_inputs(b, first, false), config(b));
  const DispatchBuffers views = buffers_of(first);
  std::vector<uint16_t> x(static_cast<std::size_t>(b.BS * b.H));
  DispatchInputs in = dispatch_inputs(b);
  in.out = &views;
  in.handle = &first.handle;
  int64_t slots = -1;
  for (int call = 0; call < 5; ++call) {
    const DispatchOutputs d = dispatch_v2(in, config(b));
    CombineInputs cin = combine_inputs(b, d, true);
    cin.out = TensorView::contiguous(x.data(), DType::kBF16, {b.BS, b.H});
    combine_v2(cin, config(b));
    EXPECT_EQ(std::memcmp(x.data(), want.data(), want.nbytes()), 0) << "call " << call;
    const auto& shm = detail::CommInternals::shm(*comm());
    if (!shm) continue;
    if (call == 1) slots = shm->slots_allocated();
    if (call > 1) {
      EXPECT_EQ(shm->slots_allocated(), slots) << "call " << call;
    }
  }
}

TEST(Outputs, WrongBuffersAreRefused) {
  Batch b = make_batch(10);
  const DispatchOutputs d = dispatch_v2(dispatch_inputs(b), config(b));
  std::vector<float> small(static_cast<std::size_t>(d.expand_scales.numel() + 1));
  DispatchBuffers views;
  views.expand_scales =
      TensorView::contiguous(small.data(), DType::kF32, {static_cast<int64_t>(small.size())});
  DispatchInputs in = dispatch_inputs(b);
  const int rank = comm()->rank();
  if (rank == 0) in.out = &views;
  expect_collective_error([&] { dispatch_v2(in, config(b)); }, rank, 0, ErrorKind::kInvalidArgument,
                          {"out.expand_scales is fp32[", "but this call writes fp32["});
  std::vector<uint16_t> x(static_cast<std::size_t>(b.BS * b.H));
  CombineInputs cin = combine_inputs(b, d, false);
  if (rank == 0) cin.out = TensorView::contiguous(x.data(), DType::kF16, {b.BS, b.H});
  expect_collective_error([&] { combine_v2(cin, config(b)); }, rank, 0, ErrorKind::kInvalidArgument,
                          {"combine_v2: out is fp16["});
}

TEST(Outputs, OverlapsAndLayoutsAreRefused) {
  Batch b = make_batch(11);
  const int rank = comm()->rank();
  const DispatchOutputs d = dispatch_v2(dispatch_inputs(b), config(b));
  // combine_v2 writing into its own expand_x (peers may still read it).
  CombineInputs cin = combine_inputs(b, d, true);
  if (rank == 0) cin.out = TensorView::contiguous(d.expand_x.data(), DType::kBF16, {b.BS, b.H});
  expect_collective_error([&] { combine_v2(cin, config(b)); }, rank, 0, ErrorKind::kInvalidArgument,
                          {"combine_v2: out shares memory with expand_x"});
  // A dispatch buffer over x, two buffers over one another, a strided one, dynamic_scales
  // without quant_mode 2.
  std::vector<float> scales_mem(static_cast<std::size_t>(2 * d.expand_scales.numel()));
  std::vector<DispatchBuffers> bad(4);
  bad[0].expand_x = TensorView::contiguous(b.x.data(), DType::kBF16, {0, b.H});
  bad[0].expand_x->shape[0] = d.expand_x.size(0);  // the right shape, over x
  bad[1].expand_scales =
      TensorView::contiguous(scales_mem.data(), DType::kF32, {d.expand_scales.numel()});
  bad[1].assist_info_for_combine = d.assist_info_for_combine.view();
  bad[1].ep_recv_counts =
      TensorView::contiguous(scales_mem.data() + 1, DType::kI32, {d.ep_recv_counts.numel()});
  bad[2].expand_scales =
      TensorView::contiguous(scales_mem.data(), DType::kF32, {d.expand_scales.numel()});
  bad[2].expand_scales->strides[0] = 2;
  bad[3].dynamic_scales = bad[1].expand_scales;
  const char* want[] = {"out.expand_x shares memory with x",
                        "out.expand_scales shares memory with out.ep_recv_counts",
                        "out.expand_scales (fp32[",
                        "out.dynamic_scales is given but quant_mode = 0"};
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(want[i]);
    DispatchInputs in = dispatch_inputs(b);
    if (rank == 0) in.out = &bad[i];
    expect_collective_error([&] { dispatch_v2(in, config(b)); }, rank, 0,
                            ErrorKind::kInvalidArgument, {want[i]});
  }
}

TEST(Handle, MergedTokensRefuseSmoothingScales) {
  if (comm()->size() < 2) GTEST_SKIP() << "needs two ranks (merges are for other ranks)";
  Batch b = make_batch(12);
  EpConfig cfg = config(b);
  cfg.transport = "mpi";  // merges happen over MPI only
  const DispatchOutputs d = dispatch_v2(dispatch_inputs(b), cfg);
  std::vector<float> smooth(static_cast<std::size_t>(b.E * b.H), 1.0f);
  DispatchInputs in = dispatch_inputs(b);
  in.handle = &d.handle;
  in.quant_mode = 2;
  in.scales = TensorView::contiguous(smooth.data(), DType::kF32, {b.E, b.H});
  // Whether this rank's plan merged any token depends on its routing: then it refuses, and the
  // others name it; ranks without merges accept. Every rank sees the same outcome.
  try {
    dispatch_v2(in, cfg);
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(msg.find("sent some tokens once per destination, which quant_mode 2 with "
                         "smoothing scales") != std::string::npos ||
                e.kind() == ErrorKind::kRemote)
        << msg;
    return;
  }
  ADD_FAILURE() << "no rank merged a token: the test's routing does not exercise the check";
}

TEST(Handle, ADestroyedCommunicatorsHandleIsRefused) {
  Batch b = make_batch(13);
  DispatchHandle stale;
  {
    auto old = Communicator::from_mpi(MPI_COMM_WORLD);
    stale = dispatch_v2(dispatch_inputs(b), config(b, old.get())).handle;
  }
  auto fresh = Communicator::from_mpi(MPI_COMM_WORLD);
  const DispatchOutputs d = dispatch_v2(dispatch_inputs(b), config(b, fresh.get()));
  CombineInputs cin = combine_inputs(b, d, true);
  cin.handle = &stale;
  expect_collective_error([&] { combine_v2(cin, config(b, fresh.get())); }, comm()->rank(), -1,
                          ErrorKind::kInvalidArgument, {"belongs to another communicator"});
}

}  // namespace
}  // namespace moe_ep
