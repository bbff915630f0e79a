// EpConfig::exact_size against the default (SPEC §1.4's worst-case sizes, A rows): for a grid of
// configurations, dispatch_v2 + experts + combine_v2 run in both modes on the same inputs, and
// every output must be bitwise the default's on the valid rows (the meaningful prefix of
// expand_x, dynamic_scales, assist_info_for_combine and expand_scales, the whole of the others),
// the combine_v2 output bit for bit, and the exact shapes those of the rows received: expand_x
// (valid, H), dynamic_scales and expand_scales (valid,), assist_info_for_combine (3 * valid,).
// Also through the DispatchHandle (a cached dispatch, combine with the handle), with the caller's
// buffers (DispatchInputs::out), and the errors: modes that differ across ranks, buffers too
// small, tp_world_size 2, a combine_v2 whose mode is not its dispatch's. The default mode is
// checked against the SPEC reference elsewhere (test_dispatch*.cc, test_transport_shm.cc).
// $MOE_EP_TEST_COMM_ALG runs the grid with that comm_alg (ctest *_exact_size_hierarchy*);
// $MOE_EP_TRANSPORT and $MOE_EP_SHM_NODE_RANKS (the other mpi_tests_* runs) pick the paths.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "mpi/common.h"
#include "ref/numeric.h"
#include "transport/communicator.h"
#include "transport/windows.h"

namespace moe_ep {
namespace {

Communicator* comm() {
  static std::shared_ptr<Communicator> c = Communicator::from_mpi(MPI_COMM_WORLD);
  return c.get();
}

std::string comm_alg() {
  const char* v = std::getenv("MOE_EP_TEST_COMM_ALG");
  return v ? v : "";
}

struct Case {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t H = 24;
  int64_t K = 2;
  int64_t L = 3;          // experts per MoE rank
  int64_t BS = 9;         // tokens per rank at the first call (odd)
  int64_t grow = 4;       // tokens added per call
  bool uneven = false;    // BS differs across ranks (global_bs given; last rank 0 tokens)
  bool skew = false;      // slot 0 of every token goes to expert 0
  double inactive = 0.0;  // probability of an id -1
  int mask = 0;           // 0 none, 1 1-D prefix, 2 2-D random
  bool quant = false;     // quant_mode 2
  bool smooth = false;    // with smoothing scales
  bool cq = false;        // comm_quant_mode 2
  int64_t S = 0, Ns = 1;  // shared-expert ranks (S > 0 needs W > S)
  bool shared_x = false;  // shared_expert_x given
  int64_t Z = 0, C = 0, Q = 0;
  bool in_place = true;  // experts write into dispatch's expand_x (when not int8)
  int iters = 2;
  bool hold = false;  // keep every call's outputs alive until the end
  uint64_t seed = 11;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// One rank's inputs of a call, the same in both modes.
struct Inputs {
  Tensor x, ids, scales, mask, smooth, sx, a1, a2, v;
  EpConfig cfg;
  DispatchInputs din;
};

Inputs make_inputs(const Case& c, int iter) {
  const int W = test::world_size(), rank = test::world_rank();
  const int64_t S = W > c.S ? c.S : 0;
  const int64_t E = (W - S) * c.L, special = c.Z + c.C + c.Q;
  const int64_t K = std::min(c.K, E + special);
  const int64_t base = c.BS + iter * c.grow;
  const int64_t BS = c.uneven ? (rank == W - 1 && W > 1 ? 0 : base + 2 * rank) : base;
  const int64_t max_bs = c.uneven ? base + 2 * (W - 1) : base;
  test::SplitMix64 rng{c.seed * 1000003 + static_cast<uint64_t>(iter) * 7919 +
                       static_cast<uint64_t>(rank) * 104729};
  auto uniform = [&] { return static_cast<float>(rng.below(2001) - 1000) / 250.0f; };
  Inputs in;
  in.x = Tensor::empty(c.dtype, {BS, c.H});
  for (int64_t i = 0; i < BS * c.H; ++i) ref::store(c.dtype, in.x.data(), i, uniform());
  in.ids = Tensor::empty(DType::kI32, {BS, K});
  in.scales = Tensor::empty(DType::kF32, {BS, K});
  for (int64_t i = 0; i < BS; ++i) {
    std::vector<int32_t> pool(static_cast<std::size_t>(E + special));
    for (std::size_t e = 0; e < pool.size(); ++e) pool[e] = static_cast<int32_t>(e);
    for (int64_t k = 0; k < K; ++k)  // distinct ids: a partial shuffle
      std::swap(pool[k], pool[k + rng.below(static_cast<int64_t>(pool.size()) - k)]);
    if (c.skew && std::find(pool.begin() + 1, pool.begin() + K, 0) == pool.begin() + K) pool[0] = 0;
    for (int64_t k = 0; k < K; ++k) {
      const bool off = c.inactive > 0 && rng.below(1000) < c.inactive * 1000;
      in.ids.ptr<int32_t>()[i * K + k] = off ? -1 : pool[k];
      in.scales.ptr<float>()[i * K + k] = uniform();
    }
  }
  if (c.mask == 1) {
    in.mask = Tensor::empty(DType::kBool, {BS});
    for (int64_t i = 0; i < BS; ++i) in.mask.ptr<bool>()[i] = i < BS - BS / 3;
  } else if (c.mask == 2) {
    in.mask = Tensor::empty(DType::kBool, {BS, K});
    for (int64_t i = 0; i < BS * K; ++i) in.mask.ptr<bool>()[i] = rng.below(5) != 0;
  }
  EpConfig& cfg = in.cfg;
  cfg.group_ep = comm();
  cfg.ep_world_size = W;
  cfg.ep_rank_id = rank;
  cfg.moe_expert_num = E;
  cfg.shared_expert_rank_num = S;
  cfg.shared_expert_num = S > 0 ? c.Ns : (c.S > 0 ? 0 : 1);
  cfg.global_bs = c.uneven ? W * max_bs : 0;
  cfg.zero_expert_num = c.Z;
  cfg.copy_expert_num = c.C;
  cfg.const_expert_num = c.Q;
  cfg.comm_alg = comm_alg();
  in.din.x = in.x;
  in.din.expert_ids = in.ids;
  in.din.expert_scales = in.scales.view();
  if (in.mask.defined()) in.din.x_active_mask = in.mask.view();
  in.din.quant_mode = c.quant ? 2 : 0;
  if (c.smooth) {  // the same on every rank (comm_alg "hierarchy" requires it)
    test::SplitMix64 same{c.seed * 31 + static_cast<uint64_t>(iter)};
    const int64_t rows = (S > 0 ? cfg.shared_expert_num : 0) + E;
    in.smooth = Tensor::empty(DType::kF32, {rows, c.H});
    for (int64_t i = 0; i < rows * c.H; ++i)
      in.smooth.ptr<float>()[i] = 0.5f + static_cast<float>(same.below(64)) / 32.0f;
    in.din.scales = in.smooth.view();
  }
  if (c.shared_x) {
    in.sx = Tensor::empty(c.dtype, {BS, c.H});
    for (int64_t i = 0; i < BS * c.H; ++i) ref::store(c.dtype, in.sx.data(), i, uniform());
  }
  for (Tensor* t : {&in.a1, &in.a2, &in.v}) {
    *t = Tensor::empty(c.dtype, {c.Q, c.H});
    for (int64_t i = 0; i < c.Q * c.H; ++i) ref::store(c.dtype, t->data(), i, uniform());
  }
  return in;
}

// Whether the calls use the shared-memory transport ($MOE_EP_TRANSPORT, EpConfig::transport "").
bool shm_transport() {
  const char* t = std::getenv("MOE_EP_TRANSPORT");
  return t == nullptr || *t == '\0' || std::string(t) == "shm";
}

bool in_window(const Tensor& t) {
  const auto& ctx = detail::CommInternals::shm(*comm());
  int gen = 0;
  int64_t off = 0;
  return ctx && t.numel() > 0 && ctx->locate(t.data(), static_cast<int64_t>(t.nbytes()), gen, off);
}

int64_t valid_rows(const DispatchOutputs& d) {
  const int64_t n = d.ep_recv_counts.numel();
  return n > 0 ? d.ep_recv_counts.ptr<int32_t>()[n - 1] : 0;
}

// The first `n` elements of t as bytes (all of them when n < 0; nothing when undefined).
std::vector<unsigned char> bytes_of(const Tensor& t, int64_t n = -1) {
  if (!t.defined()) return {};
  const int64_t es = static_cast<int64_t>(dtype_size(t.dtype()));
  const int64_t count = n < 0 ? t.numel() : n;
  EXPECT_LE(count, t.numel());
  const auto* p = static_cast<const unsigned char*>(t.data());
  return std::vector<unsigned char>(p, p + std::min(count, t.numel()) * es);
}

// What both modes must agree on, bitwise: the valid rows of the row outputs, the whole of the
// others.
std::vector<std::vector<unsigned char>> meaningful(const DispatchOutputs& d) {
  const int64_t valid = valid_rows(d), H = d.expand_x.ndim() == 2 ? d.expand_x.size(1) : 0;
  return {bytes_of(d.expand_x, valid * H),
          bytes_of(d.dynamic_scales, d.dynamic_scales.defined() ? valid : 0),
          bytes_of(d.assist_info_for_combine, 3 * valid),
          bytes_of(d.expert_token_nums),
          bytes_of(d.ep_recv_counts),
          bytes_of(d.tp_recv_counts),
          bytes_of(d.expand_scales, valid)};
}

const char* const kPartNames[] = {"expand_x (valid rows)",
                                  "dynamic_scales (valid rows)",
                                  "assist_info_for_combine (3 * valid)",
                                  "expert_token_nums",
                                  "ep_recv_counts",
                                  "tp_recv_counts",
                                  "expand_scales (valid rows)"};

// Row outputs sized to `rows` (exact_size) or the default's worst case A (SPEC §1.4).
void expect_shapes(const DispatchOutputs& d, const Inputs& in, bool exact, const Case& c) {
  const DispatchWorkspace ws =
      dispatch_workspace(in.cfg, in.x.size(0), c.H, in.ids.size(1), c.dtype, in.din.quant_mode);
  const int64_t valid = valid_rows(d), rows = exact ? valid : ws.recv_rows;
  EXPECT_LE(valid, ws.recv_rows);
  ASSERT_EQ(d.expand_x.ndim(), 2);
  EXPECT_EQ(d.expand_x.size(0), rows);
  EXPECT_EQ(d.expand_x.size(1), c.H);
  EXPECT_EQ(d.expand_x.dtype(), c.quant ? DType::kI8 : c.dtype);
  EXPECT_EQ(d.dynamic_scales.defined(), c.quant);
  EXPECT_EQ(d.dynamic_scales.defined() ? d.dynamic_scales.numel() : -1, c.quant ? rows : -1);
  EXPECT_EQ(d.expand_scales.numel(), rows);
  const int64_t bsk = in.x.size(0) * in.ids.size(1);
  EXPECT_EQ(d.assist_info_for_combine.numel(),
            exact ? 3 * valid : std::max(bsk, ws.recv_rows * 128));
}

// The experts on the valid rows: row j times (1 + (j % 5) / 8), in fp32, rounded to the dtype
// (int8 rows dequantised first); in place on expand_x, or into a tensor shaped like it.
Tensor run_experts(const Case& c, const DispatchOutputs& d) {
  const bool in_place = c.in_place && !c.quant;
  const int64_t rows = d.expand_x.size(0), valid = valid_rows(d);
  Tensor y = in_place ? d.expand_x : Tensor::zeros(c.dtype, {rows, c.H});
  for (int64_t j = 0; j < valid; ++j)
    for (int64_t h = 0; h < c.H; ++h) {
      const float v = c.quant ? static_cast<float>(d.expand_x.ptr<int8_t>()[j * c.H + h]) *
                                    d.dynamic_scales.ptr<float>()[j]
                              : ref::load(c.dtype, d.expand_x.data(), j * c.H + h);
      ref::store(c.dtype, y.data(), j * c.H + h, v * (1.0f + static_cast<float>(j % 5) / 8.0f));
    }
  return y;
}

CombineInputs combine_inputs(const Case& c, const Inputs& in, const DispatchOutputs& d,
                             const Tensor& y) {
  CombineInputs cin;
  cin.expand_x = y.view();
  cin.expert_ids = in.ids;
  cin.assist_info_for_combine = d.assist_info_for_combine;
  cin.ep_send_counts = d.ep_recv_counts;
  cin.expert_scales = in.scales;
  if (in.mask.defined()) cin.x_active_mask = in.mask.view();
  cin.comm_quant_mode = c.cq ? 2 : 0;
  if (c.shared_x) cin.shared_expert_x = in.sx.view();
  if (c.C > 0 || c.Q > 0) cin.ori_x = in.x.view();
  if (c.Q > 0) {
    cin.const_expert_alpha_1 = in.a1.view();
    cin.const_expert_alpha_2 = in.a2.view();
    cin.const_expert_v = in.v.view();
  }
  return cin;
}

// One mode's call: dispatch_v2, the experts, combine_v2; then through the handle, a cached
// dispatch_v2 and a combine_v2 given the handle (no assist_info_for_combine, no ep_send_counts).
struct Result {
  DispatchOutputs d, cached;
  std::vector<std::vector<unsigned char>> parts, cached_parts;  // meaningful(), before the experts
  std::vector<unsigned char> combined, combined_with_handle;
};

Result run(const Case& c, const Inputs& base, bool exact) {
  Inputs in = base;
  in.cfg.exact_size = exact;
  Result r;
  r.d = dispatch_v2(in.din, in.cfg);
  r.parts = meaningful(r.d);
  {
    SCOPED_TRACE(exact ? "exact_size" : "default");
    expect_shapes(r.d, in, exact, c);
  }
  Tensor y = run_experts(c, r.d);
  r.combined = bytes_of(combine_v2(combine_inputs(c, in, r.d, y), in.cfg));
  DispatchInputs cached_in = in.din;
  cached_in.handle = &r.d.handle;
  r.cached = dispatch_v2(cached_in, in.cfg);
  r.cached_parts = meaningful(r.cached);
  {
    SCOPED_TRACE(exact ? "exact_size, cached dispatch" : "default, cached dispatch");
    expect_shapes(r.cached, in, exact, c);
  }
  y = run_experts(c, r.cached);
  CombineInputs cin = combine_inputs(c, in, r.cached, y);
  cin.assist_info_for_combine = TensorView{};
  cin.ep_send_counts = TensorView{};
  cin.handle = &r.cached.handle;
  r.combined_with_handle = bytes_of(combine_v2(cin, in.cfg));
  return r;
}

class ExactSizeVsDefault : public ::testing::TestWithParam<Case> {};

TEST_P(ExactSizeVsDefault, BitwiseOnTheValidRows) {
  const Case& c = GetParam();
  std::vector<Result> kept;        // c.hold: every call's outputs stay alive
  int received = 0, windowed = 0;  // exact_size calls with rows here; their expand_x in a window
  for (int it = 0; it < c.iters; ++it) {
    SCOPED_TRACE("call " + std::to_string(it));
    const Inputs in = make_inputs(c, it);
    Result def = run(c, in, false);
    Result exact = run(c, in, true);
    const auto& want = def.parts;
    ASSERT_EQ(want.size(), std::size(kPartNames));
    for (std::size_t p = 0; p < want.size(); ++p) {
      EXPECT_TRUE(exact.parts[p] == want[p]) << kPartNames[p] << " differs from the default's";
      EXPECT_TRUE(exact.cached_parts[p] == want[p])
          << kPartNames[p] << " of the cached dispatch differs from the default's";
    }
    EXPECT_TRUE(def.cached_parts == want) << "the default mode's cached dispatch differs";
    EXPECT_TRUE(exact.combined == def.combined) << "combine_v2 differs from the default mode's";
    EXPECT_TRUE(exact.combined_with_handle == def.combined)
        << "combine_v2 with the handle differs from the default mode's";
    EXPECT_TRUE(def.combined_with_handle == def.combined);
    received += valid_rows(exact.d) > 0;
    windowed += in_window(exact.d.expand_x);
    if (c.hold) {
      kept.push_back(std::move(def));
      kept.push_back(std::move(exact));
    }
  }
  // The exact slots are shared-memory slots (not a silent MPI fallback), at least at first.
  if (shm_transport() && test::world_size() > 1 && received > 0) {
    EXPECT_GT(windowed, 0);
  }
}

std::vector<Case> grid() {
  std::vector<Case> g;
  auto add = [&](std::string name, auto&& tweak) {
    Case c;
    c.name = std::move(name);
    tweak(c);
    g.push_back(c);
  };
  add("bf16_K2", [](Case&) {});
  add("fp16_K8_L4", [](Case& c) { c.dtype = DType::kF16, c.K = 8, c.L = 4; });
  add("fp32_K1_L1", [](Case& c) { c.dtype = DType::kF32, c.K = 1, c.L = 1; });
  add("bs0_then_1", [](Case& c) { c.BS = 0, c.grow = 1; });
  add("uneven_global_bs", [](Case& c) { c.uneven = true; });
  add("skewed", [](Case& c) { c.skew = true, c.K = 3; });
  add("inactive_ids", [](Case& c) { c.inactive = 0.3; });
  add("mask_1d", [](Case& c) { c.mask = 1; });
  add("mask_2d", [](Case& c) { c.mask = 2, c.K = 4; });
  add("quant", [](Case& c) { c.quant = true; });
  add("quant_smooth_shared", [](Case& c) { c.quant = c.smooth = true, c.S = 1; });
  add("comm_quant", [](Case& c) { c.cq = true, c.K = 4; });
  add("shared_rank_mask", [](Case& c) { c.S = 1, c.mask = 2; });
  add("shared_ranks_2_uneven", [](Case& c) { c.S = 2, c.Ns = 2, c.uneven = true; });
  add("shared_x_special_experts", [](Case& c) { c.shared_x = true, c.Z = 1, c.C = 1, c.Q = 2; });
  add("out_of_place", [](Case& c) { c.in_place = false; });
  add("hold_and_grow", [](Case& c) { c.hold = true, c.iters = 4, c.grow = 9; });
  add("big_rows", [](Case& c) { c.H = 4096, c.K = 4, c.BS = 64, c.iters = 1; });
  return g;
}

INSTANTIATE_TEST_SUITE_P(ExactSize, ExactSizeVsDefault, ::testing::ValuesIn(grid()),
                         [](const auto& info) { return info.param.name; });

// Every token of every rank goes to every rank (E = W, K = W): rank r receives W * BS rows.
Inputs all_to_all_inputs(int64_t BS, int64_t H) {
  Case c;
  c.L = 1;
  c.K = test::world_size();
  c.BS = BS;
  c.H = H;
  return make_inputs(c, 0);
}

TEST(ExactSize, DiffersAcrossRanks) {
  if (test::world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  Inputs in = all_to_all_inputs(3, 8);
  EpConfig mixed = in.cfg;
  mixed.exact_size = test::world_rank() == 1;
  const std::string differ = "exact_size differs across ranks: rank 0 has false, rank 1 has true";
  test::expect_collective_error([&] { dispatch_v2(in.din, mixed); }, test::world_rank(), -1,
                                ErrorKind::kInvalidArgument, {"dispatch_v2: " + differ});
  // combine_v2 with the handle reads no assist_info_for_combine: every rank's own checks pass,
  // and the header agreement finds the values differ.
  in.cfg.exact_size = true;
  const DispatchOutputs d = dispatch_v2(in.din, in.cfg);
  CombineInputs cin;
  cin.expand_x = d.expand_x;
  cin.expert_ids = in.ids;
  cin.expert_scales = in.scales;
  cin.handle = &d.handle;
  test::expect_collective_error([&] { combine_v2(cin, mixed); }, test::world_rank(), -1,
                                ErrorKind::kInvalidArgument, {"combine_v2: " + differ});
}

// The caller's buffers hold fewer rows than one rank receives: that rank raises after the counts
// phase, the others kRemote naming it, in the same call (phase "exact sizes"); then the same
// communicator works. Larger buffers are taken, the outputs view their first rows.
TEST(ExactSize, CallerBuffers) {
  const int W = test::world_size(), rank = test::world_rank(), bad = W - 1;
  Inputs in = all_to_all_inputs(4, 16);
  in.cfg.exact_size = true;
  const int64_t rows = W * int64_t{4};  // every rank receives every token of every rank
  const DispatchOutputs want = dispatch_v2(in.din, in.cfg);
  ASSERT_EQ(valid_rows(want), rows);
  const auto want_parts = meaningful(want);
  // Larger by 5 rows (assist_info_for_combine by 15 entries), in plain memory.
  Tensor x = Tensor::empty(DType::kBF16, {rows + 5, 16}),
         ai = Tensor::empty(DType::kI32, {3 * rows + 15});
  Tensor sc = Tensor::empty(DType::kF32, {rows + 5});
  DispatchBuffers b;
  b.expand_x = x.view();
  b.assist_info_for_combine = ai.view();
  b.expand_scales = sc.view();
  DispatchInputs din = in.din;
  din.out = &b;
  const DispatchOutputs got = dispatch_v2(din, in.cfg);
  EXPECT_EQ(got.expand_x.data(), x.data());
  EXPECT_EQ(got.expand_x.size(0), rows);
  EXPECT_EQ(got.assist_info_for_combine.data(), ai.data());
  EXPECT_EQ(got.assist_info_for_combine.numel(), 3 * rows);
  EXPECT_EQ(got.expand_scales.data(), sc.data());
  EXPECT_EQ(got.expand_scales.numel(), rows);
  EXPECT_EQ(meaningful(got), want_parts);
  // The serving loop: the first call's outputs as the buffers (expand_x a window slot, written
  // in place with shared memory), scribbled over first so that the call must write them.
  DispatchBuffers again = buffers_of(want);
  for (const Tensor* t : {&want.expand_x, &want.assist_info_for_combine, &want.expand_scales})
    std::memset(t->data(), 0xa5, t->nbytes());
  din.out = &again;
  const DispatchOutputs reused = dispatch_v2(din, in.cfg);
  EXPECT_EQ(reused.expand_x.data(), want.expand_x.data());
  EXPECT_EQ(meaningful(reused), want_parts);
  // Too small on one rank.
  Tensor small = Tensor::empty(DType::kBF16, {rank == bad ? rows - 1 : rows, 16});
  DispatchBuffers s;
  s.expand_x = small.view();
  din.out = &s;
  test::expect_collective_error([&] { dispatch_v2(din, in.cfg); }, rank, bad,
                                ErrorKind::kInvalidArgument,
                                {"out.expand_x is", "exact_size = true"});
  din.out = nullptr;
  EXPECT_EQ(meaningful(dispatch_v2(din, in.cfg)), want_parts);  // still in step
}

// A handle from a default-mode dispatch serves an exact_size cached dispatch (and vice versa):
// the plan is the same; only the outputs' sizes follow the call's mode.
TEST(ExactSize, HandleAcrossModes) {
  Inputs in = all_to_all_inputs(5, 8);
  const DispatchOutputs def = dispatch_v2(in.din, in.cfg);
  EpConfig exact = in.cfg;
  exact.exact_size = true;
  DispatchInputs din = in.din;
  din.handle = &def.handle;
  const DispatchOutputs cached = dispatch_v2(din, exact);
  EXPECT_EQ(cached.expand_x.size(0), valid_rows(def));
  EXPECT_EQ(meaningful(cached), meaningful(def));
  const DispatchOutputs e = dispatch_v2(in.din, exact);
  din.handle = &e.handle;
  const DispatchOutputs back = dispatch_v2(din, in.cfg);
  EXPECT_EQ(back.expand_x.size(0), def.expand_x.size(0));
  EXPECT_EQ(meaningful(back), meaningful(def));
}

// combine_v2's assist_info_for_combine: the default mode needs SPEC's size (an exact one is
// refused, naming exact_size), exact_size at least 3 * valid entries (a shorter one refused).
TEST(ExactSize, CombineAssistInfoSize) {
  const int W = test::world_size(), rank = test::world_rank(), bad = W - 1;
  Inputs in = all_to_all_inputs(3, 8);
  in.cfg.exact_size = true;
  const DispatchOutputs d = dispatch_v2(in.din, in.cfg);
  CombineInputs cin;
  cin.expand_x = d.expand_x;
  cin.expert_ids = in.ids;
  cin.assist_info_for_combine = d.assist_info_for_combine;
  cin.ep_send_counts = d.ep_recv_counts;
  cin.expert_scales = in.scales;
  EpConfig def = in.cfg;
  def.exact_size = false;
  test::expect_collective_error([&] { combine_v2(cin, def); }, rank, -1,
                                ErrorKind::kInvalidArgument,
                                {"combine_v2: assist_info_for_combine.shape[0] = ",
                                 "pass exact_size = true to combine_v2 as well"});
  const int64_t valid = valid_rows(d);
  if (rank == bad) cin.assist_info_for_combine.shape[0] = 3 * valid - 1;
  test::expect_collective_error(
      [&] { combine_v2(cin, in.cfg); }, rank, bad, ErrorKind::kInvalidArgument,
      {"combine_v2: assist_info_for_combine.shape[0] = " + std::to_string(3 * valid - 1) +
       " is less than 3 * the valid rows"});
}

// tp_world_size 2 is not supported with exact_size: kUnsupported on every rank, from both ops
// and the size query, naming both.
TEST(ExactSize, TensorParallelIsUnsupported) {
  const int N = test::world_size(), wr = test::world_rank();
  if (N < 2 || N % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  MPI_Comm ep = MPI_COMM_NULL, tp = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, wr % 2, wr / 2, &ep);
  MPI_Comm_split(MPI_COMM_WORLD, wr / 2, wr % 2, &tp);
  auto ep_comm = Communicator::from_mpi(ep), tp_comm = Communicator::from_mpi(tp);
  MPI_Comm_free(&ep);
  MPI_Comm_free(&tp);
  EpConfig cfg;
  cfg.group_ep = ep_comm.get();
  cfg.ep_world_size = N / 2;
  cfg.ep_rank_id = wr / 2;
  cfg.moe_expert_num = N / 2;
  cfg.group_tp = tp_comm.get();
  cfg.tp_world_size = 2;
  cfg.tp_rank_id = wr % 2;
  cfg.exact_size = true;
  std::vector<uint16_t> x(2 * 8, 0);
  std::vector<int32_t> ids = {0, 0};
  std::vector<float> w = {1, 1};
  DispatchInputs din;
  din.x = TensorView::contiguous(x.data(), DType::kBF16, {2, 8});
  din.expert_ids = TensorView::contiguous(ids.data(), DType::kI32, {2, 1});
  const std::vector<std::string> needles = {"exact_size = true does not support tp_world_size = 2"};
  test::expect_collective_error([&] { dispatch_v2(din, cfg); }, wr, -1, ErrorKind::kUnsupported,
                                needles);
  CombineInputs cin;
  cin.expand_x = din.x;
  cin.expert_ids = din.expert_ids;
  cin.expert_scales = TensorView::contiguous(w.data(), DType::kF32, {2, 1});
  test::expect_collective_error([&] { combine_v2(cin, cfg); }, wr, -1, ErrorKind::kUnsupported,
                                needles);
  test::expect_collective_error([&] { dispatch_workspace(cfg, 2, 8, 1, DType::kBF16); }, wr, -1,
                                ErrorKind::kUnsupported, needles);
}

// dispatch_workspace with exact_size: the worst case a call may take (its valid rows, at most A),
// assist_info_for_combine at 3 entries per row instead of max(BS * K, A * 128).
TEST(ExactSize, WorkspaceIsTheWorstCase) {
  Inputs in = all_to_all_inputs(4, 16);
  const DispatchWorkspace def = dispatch_workspace(in.cfg, 4, 16, in.ids.size(1), DType::kBF16);
  in.cfg.exact_size = true;
  const DispatchWorkspace ex = dispatch_workspace(in.cfg, 4, 16, in.ids.size(1), DType::kBF16);
  const int64_t A = def.recv_rows, W = test::world_size();
  EXPECT_EQ(ex.recv_rows, A);
  EXPECT_EQ(ex.expand_x_bytes, def.expand_x_bytes);
  EXPECT_EQ(ex.shm_slot_bytes, def.shm_slot_bytes);
  EXPECT_EQ(def.other_outputs_bytes - ex.other_outputs_bytes,
            (std::max<int64_t>(4 * W, A * 128) - 3 * A) * 4);
}

}  // namespace
}  // namespace moe_ep
