// The shared-memory transport (EpConfig::transport "shm") against plain MPI ("mpi"): for a grid
// of configurations, dispatch_v2 + experts + combine_v2 run once with each transport on the same
// inputs, and every output of both ops must be bitwise identical (of expand_x and
// assist_info_for_combine the meaningful prefix, SPEC §1.4). Repeated calls hold earlier
// outputs alive and grow the batch, so slot reuse, the "no free slot" fallback and window growth
// are exercised. Also: the transport must agree across ranks, malformed values are rejected.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
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
  int64_t y_pad = 0;     // otherwise: y's row stride is H + y_pad
  int iters = 3;
  bool hold = false;                 // keep every call's outputs alive until the end
  const char* stream_min = nullptr;  // $MOE_EP_STREAM_MIN_BYTES for the shm calls (null: unset)
  uint64_t seed = 7;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

// Everything one call produced, as bytes.
struct Result {
  std::vector<std::vector<unsigned char>> parts;
  DispatchOutputs held;
  bool in_window = false;  // expand_x lay in this rank's shared-memory window
};

// The first `bytes` bytes of t (all of them when bytes < 0).
std::vector<unsigned char> bytes_of(const Tensor& t, int64_t bytes = -1) {
  if (!t.defined()) return {};
  const auto* p = static_cast<const unsigned char*>(t.data());
  const int64_t n = bytes < 0 ? static_cast<int64_t>(t.nbytes()) : bytes;
  EXPECT_LE(n, static_cast<int64_t>(t.nbytes()));
  return std::vector<unsigned char>(p, p + std::min<int64_t>(n, t.nbytes()));
}

// The dtype and shape of each tensor (undefined: -1), as bytes.
std::vector<unsigned char> shapes_of(const std::vector<const Tensor*>& ts) {
  std::vector<int64_t> v;
  for (const Tensor* t : ts) {
    v.push_back(t->defined() ? static_cast<int64_t>(t->dtype()) : -1);
    v.push_back(t->defined() ? t->ndim() : -1);
    for (int d = 0; t->defined() && d < t->ndim(); ++d) v.push_back(t->size(d));
  }
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  return std::vector<unsigned char>(p, p + v.size() * sizeof(int64_t));
}

bool in_window(const Tensor& t) {
  const auto& ctx = detail::CommInternals::shm(*comm());
  int gen = 0;
  int64_t off = 0;
  return ctx && t.numel() > 0 && ctx->locate(t.data(), static_cast<int64_t>(t.nbytes()), gen, off);
}

Result run(const Case& c, const std::string& transport, int iter) {
  const int W = test::world_size(), rank = test::world_rank();
  const int64_t S = W > c.S ? c.S : 0;
  const int64_t E = (W - S) * c.L, special = c.Z + c.C + c.Q;
  const int64_t K = std::min(c.K, E + special);
  const int64_t base = c.BS + iter * c.grow;
  int64_t BS = base;
  if (c.uneven) BS = rank == W - 1 && W > 1 ? 0 : base + 2 * rank;
  const int64_t max_bs = c.uneven ? base + 2 * (W - 1) : base;
  test::SplitMix64 rng{c.seed * 1000003 + static_cast<uint64_t>(iter) * 7919 +
                       static_cast<uint64_t>(rank) * 104729};
  auto uniform = [&] { return static_cast<float>(rng.below(2001) - 1000) / 250.0f; };

  Tensor x = Tensor::empty(c.dtype, {BS, c.H});
  for (int64_t i = 0; i < BS * c.H; ++i) ref::store(c.dtype, x.data(), i, uniform());
  Tensor ids = Tensor::empty(DType::kI32, {BS, K});
  Tensor scales = Tensor::empty(DType::kF32, {BS, K});
  for (int64_t i = 0; i < BS; ++i) {
    std::vector<int32_t> pool(static_cast<std::size_t>(E + special));
    for (std::size_t e = 0; e < pool.size(); ++e) pool[e] = static_cast<int32_t>(e);
    for (int64_t k = 0; k < K; ++k) {  // distinct ids: a partial shuffle
      const int64_t j = k + rng.below(static_cast<int64_t>(pool.size()) - k);
      std::swap(pool[k], pool[j]);
    }
    if (c.skew && std::find(pool.begin() + 1, pool.begin() + K, 0) == pool.begin() + K) pool[0] = 0;
    for (int64_t k = 0; k < K; ++k) {
      int32_t id = pool[k];
      if (c.inactive > 0 && rng.below(1000) < c.inactive * 1000) id = -1;
      ids.ptr<int32_t>()[i * K + k] = id;
      scales.ptr<float>()[i * K + k] = uniform();
    }
  }
  Tensor mask;
  if (c.mask == 1) {
    mask = Tensor::empty(DType::kBool, {BS});
    for (int64_t i = 0; i < BS; ++i) mask.ptr<bool>()[i] = i < BS - BS / 3;
  } else if (c.mask == 2) {
    mask = Tensor::empty(DType::kBool, {BS, K});
    for (int64_t i = 0; i < BS * K; ++i) mask.ptr<bool>()[i] = rng.below(5) != 0;
  }

  EpConfig cfg;
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
  cfg.transport = transport;

  DispatchInputs din;
  din.x = x;
  din.expert_ids = ids;
  din.expert_scales = scales.view();
  if (mask.defined()) din.x_active_mask = mask.view();
  din.quant_mode = c.quant ? 2 : 0;
  Tensor smooth;
  if (c.smooth) {
    const int64_t rows = (S > 0 ? cfg.shared_expert_num : 0) + E;
    smooth = Tensor::empty(DType::kF32, {rows, c.H});
    for (int64_t i = 0; i < rows * c.H; ++i)
      smooth.ptr<float>()[i] = 0.5f + static_cast<float>(rng.below(64)) / 32.0f;
    din.scales = smooth.view();
  }
  Result r;
  if (c.stream_min != nullptr && transport == "shm")
    setenv("MOE_EP_STREAM_MIN_BYTES", c.stream_min, 1);
  DispatchOutputs d = dispatch_v2(din, cfg);
  unsetenv("MOE_EP_STREAM_MIN_BYTES");
  r.in_window = in_window(d.expand_x);
  // A window slot starts on a page boundary, whatever address MPI gave the segment.
  if (r.in_window) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(d.expand_x.data()) % 4096, 0u);
  }
  // Only the first `valid` rows of expand_x and 3 * valid entries of assist_info_for_combine are
  // meaningful (SPEC §1.4; the rest is whatever the memory held, and differs between the
  // transports' buffers), so only those prefixes are compared; every shape is compared whole.
  const int64_t n_counts = d.ep_recv_counts.numel();
  const int64_t valid = n_counts > 0 ? d.ep_recv_counts.ptr<int32_t>()[n_counts - 1] : 0;
  const int64_t rows = d.expand_x.size(0);
  EXPECT_LE(valid, rows);
  const std::vector<const Tensor*> outs = {
      &d.expand_x,          &d.dynamic_scales, &d.assist_info_for_combine,
      &d.expert_token_nums, &d.ep_recv_counts, &d.tp_recv_counts,
      &d.expand_scales};
  r.parts.push_back(shapes_of(outs));
  for (const Tensor* t : outs) {
    int64_t bytes = -1;
    if (t == &d.expand_x) bytes = rows > 0 ? valid * static_cast<int64_t>(t->nbytes()) / rows : 0;
    if (t == &d.assist_info_for_combine) bytes = 3 * valid * static_cast<int64_t>(sizeof(int32_t));
    r.parts.push_back(bytes_of(*t, bytes));
  }

  // The experts, on the valid rows: row j of expand_x times (1 + (j % 5) / 8), in fp32, rounded
  // to the dtype (int8 rows dequantised with their dynamic scale first). y's other rows are
  // zeros, or, in place, whatever expand_x holds there: combine_v2 must not read them.
  const bool in_place = c.in_place && !c.quant;
  const int64_t stride = in_place ? c.H : c.H + c.y_pad;
  Tensor y = in_place ? d.expand_x : Tensor::zeros(c.dtype, {rows, stride});
  for (int64_t j = 0; j < std::min(valid, rows); ++j)
    for (int64_t h = 0; h < c.H; ++h) {
      const float v = c.quant ? static_cast<float>(d.expand_x.ptr<int8_t>()[j * c.H + h]) *
                                    d.dynamic_scales.ptr<float>()[j]
                              : ref::load(c.dtype, d.expand_x.data(), j * c.H + h);
      ref::store(c.dtype, y.data(), j * stride + h, v * (1.0f + static_cast<float>(j % 5) / 8.0f));
    }
  CombineInputs cin;
  cin.expand_x = y.view();
  cin.expand_x.shape[1] = c.H;
  cin.expert_ids = ids;
  cin.assist_info_for_combine = d.assist_info_for_combine;
  cin.ep_send_counts = d.ep_recv_counts;
  cin.expert_scales = scales;
  if (mask.defined()) cin.x_active_mask = mask.view();
  cin.comm_quant_mode = c.cq ? 2 : 0;
  Tensor sx, ori, a1, a2, v;
  if (c.shared_x) {
    sx = Tensor::empty(c.dtype, {BS, c.H});
    for (int64_t i = 0; i < BS * c.H; ++i) ref::store(c.dtype, sx.data(), i, uniform());
    cin.shared_expert_x = sx.view();
  }
  if (c.C > 0 || c.Q > 0) cin.ori_x = x.view();
  if (c.Q > 0) {
    for (Tensor* t : {&a1, &a2, &v}) {
      *t = Tensor::empty(c.dtype, {c.Q, c.H});
      for (int64_t i = 0; i < c.Q * c.H; ++i) ref::store(c.dtype, t->data(), i, uniform());
    }
    cin.const_expert_alpha_1 = a1.view();
    cin.const_expert_alpha_2 = a2.view();
    cin.const_expert_v = v.view();
  }
  r.parts.push_back(bytes_of(combine_v2(cin, cfg)));
  if (c.hold) r.held = d;
  return r;
}

class ShmVsMpi : public ::testing::TestWithParam<Case> {};

TEST_P(ShmVsMpi, BitwiseEqual) {
  const Case& c = GetParam();
  const char* names[] = {"dispatch_v2's output shapes",
                         "expand_x (valid rows)",
                         "dynamic_scales",
                         "assist_info_for_combine (3 * valid entries)",
                         "expert_token_nums",
                         "ep_recv_counts",
                         "tp_recv_counts",
                         "expand_scales",
                         "combine_v2 output"};
  std::vector<Result> kept;  // c.hold: every call's outputs stay alive
  int windowed = 0;
  for (int it = 0; it < c.iters; ++it) {
    SCOPED_TRACE("call " + std::to_string(it));
    Result m = run(c, "mpi", it);
    Result s = run(c, "shm", it);
    EXPECT_FALSE(m.in_window);
    windowed += s.in_window;
    ASSERT_EQ(m.parts.size(), s.parts.size());
    for (std::size_t p = 0; p < m.parts.size(); ++p)
      EXPECT_TRUE(m.parts[p] == s.parts[p]) << names[p] << " differs between transports";
    if (c.hold) {
      kept.push_back(std::move(m));
      kept.push_back(std::move(s));
    }
  }
  // The shared-memory path was taken (not a silent MPI fallback) at least on the first call.
  EXPECT_GT(windowed, 0);
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
  add("bs1", [](Case& c) { c.BS = 1, c.grow = 0; });
  add("uneven_global_bs", [](Case& c) { c.uneven = true; });
  add("skewed", [](Case& c) { c.skew = true, c.K = 3; });
  add("inactive_ids", [](Case& c) { c.inactive = 0.3; });
  add("mask_1d", [](Case& c) { c.mask = 1; });
  add("mask_2d", [](Case& c) { c.mask = 2, c.K = 4; });
  add("quant", [](Case& c) { c.quant = true; });
  add("quant_smooth_shared", [](Case& c) { c.quant = c.smooth = true, c.S = 1; });
  add("comm_quant", [](Case& c) { c.cq = true, c.K = 4; });
  add("comm_quant_out_of_place", [](Case& c) { c.cq = true, c.in_place = false, c.y_pad = 3; });
  add("shared_rank", [](Case& c) { c.S = 1, c.K = 2; });
  add("shared_rank_mask", [](Case& c) { c.S = 1, c.mask = 2; });
  add("shared_x", [](Case& c) { c.shared_x = true; });
  add("special_experts", [](Case& c) { c.Z = 1, c.C = 1, c.Q = 2, c.K = 4; });
  add("out_of_place_strided", [](Case& c) { c.in_place = false, c.y_pad = 5; });
  add("hold_and_grow", [](Case& c) { c.hold = true, c.iters = 5, c.grow = 9; });
  add("hold_quant", [](Case& c) { c.hold = true, c.quant = true, c.iters = 4; });
  add("large_rows", [](Case& c) { c.H = 1040, c.K = 4, c.BS = 33, c.iters = 2; });
  // Several MiB of rows per call, with rows on and off 64-byte boundaries (H 4096, 4099).
  add("big_rows", [](Case& c) { c.H = 4096, c.K = 4, c.BS = 160, c.iters = 2, c.grow = 8; });
  add("big_rows_unaligned_out_of_place",
      [](Case& c) { c.H = 4099, c.K = 4, c.BS = 160, c.iters = 1, c.in_place = false; });
  add("big_quant", [](Case& c) { c.H = 8192, c.K = 4, c.BS = 160, c.iters = 1, c.quant = true; });
  // Non-temporal window stores ($MOE_EP_STREAM_MIN_BYTES 0: every call), on rows on and off
  // 64-byte boundaries (bf16 H 64 and 4096: 128 B and 8 KiB rows; H 4099 and 24: not), int8
  // rows of 64 B and 8 KiB (and 4099: not), with and without tails past the last full vectors.
  add("stream_bf16",
      [](Case& c) { c.H = 4096, c.K = 4, c.BS = 40, c.iters = 2, c.stream_min = "0"; });
  add("stream_bf16_small_rows", [](Case& c) { c.H = 64, c.K = 8, c.L = 4, c.stream_min = "0"; });
  add("stream_unaligned",
      [](Case& c) { c.H = 4099, c.K = 4, c.BS = 40, c.iters = 1, c.stream_min = "0"; });
  add("stream_tiny_rows", [](Case& c) { c.stream_min = "0"; });
  add("stream_quant", [](Case& c) {
    c.H = 8192, c.K = 4, c.BS = 40, c.iters = 2, c.quant = true, c.stream_min = "0";
  });
  add("stream_quant_small_rows",
      [](Case& c) { c.H = 64, c.K = 8, c.L = 4, c.quant = true, c.stream_min = "0"; });
  add("stream_quant_unaligned", [](Case& c) {
    c.H = 4099, c.K = 4, c.BS = 40, c.iters = 1, c.quant = true, c.stream_min = "0";
  });
  add("stream_hold_quant",
      [](Case& c) { c.H = 192, c.hold = true, c.quant = true, c.iters = 4, c.stream_min = "1"; });
  return g;
}

INSTANTIATE_TEST_SUITE_P(Transport, ShmVsMpi, ::testing::ValuesIn(grid()),
                         [](const auto& info) { return info.param.name; });

// A small valid call; `tweak` edits this rank's config.
void small_call(const std::function<void(EpConfig&)>& tweak, bool bad_id = false) {
  const int W = test::world_size(), rank = test::world_rank();
  Tensor x = Tensor::zeros(DType::kBF16, {4, 8});
  Tensor ids = Tensor::empty(DType::kI32, {4, 1});
  for (int i = 0; i < 4; ++i) ids.ptr<int32_t>()[i] = i % W;
  if (bad_id) ids.ptr<int32_t>()[2] = 999;
  EpConfig cfg;
  cfg.group_ep = comm();
  cfg.ep_world_size = W;
  cfg.ep_rank_id = rank;
  cfg.moe_expert_num = W;
  tweak(cfg);
  DispatchInputs din;
  din.x = x;
  din.expert_ids = ids;
  dispatch_v2(din, cfg);
}

TEST(Transport, DiffersAcrossRanks) {
  if (test::world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  test::expect_collective_error(
      [] {
        small_call([](EpConfig& c) { c.transport = test::world_rank() == 1 ? "mpi" : "shm"; });
      },
      test::world_rank(), -1, ErrorKind::kInvalidArgument,
      {"dispatch_v2: transport differs across ranks", "\"shm\"", "\"mpi\""});
  small_call([](EpConfig&) {});  // the communicator is still usable
}

TEST(Transport, MalformedValue) {
  const int bad = test::world_size() - 1;
  test::expect_collective_error(
      [&] {
        small_call([&](EpConfig& c) {
          if (test::world_rank() == bad) c.transport = "SHM";
        });
      },
      test::world_rank(), bad, ErrorKind::kInvalidArgument,
      {"transport = \"SHM\" is not one of \"\", \"mpi\", \"shm\""});
}

TEST(Transport, MalformedEnvironment) {
  const int bad = 0;
  if (test::world_rank() == bad) setenv("MOE_EP_TRANSPORT", "tcp", 1);
  test::expect_collective_error([] { small_call([](EpConfig&) {}); }, test::world_rank(), bad,
                                ErrorKind::kInvalidArgument,
                                {"MOE_EP_TRANSPORT = \"tcp\" (used because transport is \"\")"});
  unsetenv("MOE_EP_TRANSPORT");
  // The environment fills only an empty field: "mpi" on every rank, whatever it says.
  if (test::world_rank() == bad) setenv("MOE_EP_TRANSPORT", "tcp", 1);
  small_call([](EpConfig& c) { c.transport = "mpi"; });
  unsetenv("MOE_EP_TRANSPORT");
}

// Outputs held across calls: a window big enough but full grows (a new generation) while this
// rank's windows map less than Windows::kFullGrowthFactor (4) times its largest request;
// beyond that a call receives through MPI. Same inputs every call, so every output is the same.
TEST(Transport, FullWindowGrowsWithinABound) {
  auto c = Communicator::from_mpi(MPI_COMM_WORLD);
  const int W = test::world_size(), rank = test::world_rank();
  const int64_t BS = 64, H = 4096;  // a request of W * 128 rows of 8 KiB: over 1 MiB
  Tensor x = Tensor::empty(DType::kBF16, {BS, H});
  for (int64_t i = 0; i < BS * H; ++i) ref::store(DType::kBF16, x.data(), i, float(i % 251) - 125);
  Tensor ids = Tensor::empty(DType::kI32, {BS, 2});
  for (int64_t i = 0; i < BS; ++i)
    for (int64_t k = 0; k < 2; ++k)
      ids.ptr<int32_t>()[i * 2 + k] = static_cast<int32_t>((i + k) % (2 * W));
  EpConfig cfg;
  cfg.group_ep = c.get();
  cfg.ep_world_size = W;
  cfg.ep_rank_id = rank;
  cfg.moe_expert_num = 2 * W;
  cfg.transport = "shm";
  DispatchInputs din;
  din.x = x;
  din.expert_ids = ids;
  auto located = [&](const Tensor& t) {
    const auto& ctx = detail::CommInternals::shm(*c);
    int gen = -1;
    int64_t off = 0;
    return ctx && ctx->locate(t.data(), static_cast<int64_t>(t.nbytes()), gen, off) ? gen : -1;
  };
  std::vector<DispatchOutputs> held;
  // The first window holds two (twice the request); the full one grows to a second generation
  // holding two more (4 x the request mapped); the fifth finds both full and the bound reached.
  const int want_gen[] = {0, 0, 1, 1, -1};
  for (int call = 0; call < 5; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    held.push_back(dispatch_v2(din, cfg));
    EXPECT_EQ(located(held.back().expand_x), want_gen[call]);
    const int64_t valid = held.back().ep_recv_counts.ptr<int32_t>()[W * 2 - 1];
    EXPECT_EQ(valid, held.front().ep_recv_counts.ptr<int32_t>()[W * 2 - 1]);
    EXPECT_EQ(std::memcmp(held.back().expand_x.data(), held.front().expand_x.data(),
                          static_cast<std::size_t>(valid * H * 2)),
              0);
  }
  // Released slots of the first generation are used again (older generations are searched too).
  held.erase(held.begin(), held.begin() + 2);
  held.push_back(dispatch_v2(din, cfg));
  EXPECT_EQ(located(held.back().expand_x), 0);
}

// The routing and inputs of the growth tests: BS tokens of H = 4096 (8 KiB rows), top-2 of 2W
// experts, the same every call, so that every call's outputs are the same.
struct GrowthInputs {
  std::shared_ptr<Communicator> comm = Communicator::from_mpi(MPI_COMM_WORLD);
  static constexpr int64_t kBS = 64, kH = 4096, kK = 2;
  Tensor x, ids, scales;
  EpConfig cfg;
  GrowthInputs() {
    const int W = test::world_size(), rank = test::world_rank();
    x = Tensor::empty(DType::kBF16, {kBS, kH});
    for (int64_t i = 0; i < kBS * kH; ++i)
      ref::store(DType::kBF16, x.data(), i, float((i + rank) % 251) - 125);
    ids = Tensor::empty(DType::kI32, {kBS, kK});
    scales = Tensor::empty(DType::kF32, {kBS, kK});
    for (int64_t i = 0; i < kBS; ++i)
      for (int64_t k = 0; k < kK; ++k) {
        ids.ptr<int32_t>()[i * kK + k] = static_cast<int32_t>((i + k) % (2 * W));
        scales.ptr<float>()[i * kK + k] = 0.25f + static_cast<float>((i * 3 + k) % 7) / 8.0f;
      }
    cfg.group_ep = comm.get();
    cfg.ep_world_size = W;
    cfg.ep_rank_id = rank;
    cfg.moe_expert_num = 2 * W;
    cfg.transport = "shm";
    // ctest mpi_tests_hierarchy.*: the relays' windows and, for the holder without a slot,
    // their messages.
    if (const char* alg = std::getenv("MOE_EP_TEST_COMM_ALG")) cfg.comm_alg = alg;
  }
  DispatchOutputs dispatch() const {
    DispatchInputs din;
    din.x = x;
    din.expert_ids = ids;
    din.expert_scales = scales.view();
    return dispatch_v2(din, cfg);
  }
  // combine_v2 of y (the experts' outputs) for dispatch output d, over `transport`.
  Tensor combine(const DispatchOutputs& d, const Tensor& y, int comm_quant_mode,
                 const std::string& transport) const {
    CombineInputs cin;
    cin.expand_x = y;
    cin.expert_ids = ids;
    cin.assist_info_for_combine = d.assist_info_for_combine;
    cin.ep_send_counts = d.ep_recv_counts;
    cin.expert_scales = scales;
    cin.comm_quant_mode = comm_quant_mode;
    EpConfig c = cfg;
    c.transport = transport;
    return combine_v2(cin, c);
  }
  const detail::Windows& shm() const { return *detail::CommInternals::shm(*comm); }
  // The generation whose window holds t, or -1.
  int located(const Tensor& t) const {
    const auto& ctx = detail::CommInternals::shm(*comm);
    int gen = -1;
    int64_t off = 0;
    return ctx && ctx->locate(t.data(), static_cast<int64_t>(t.nbytes()), gen, off) ? gen : -1;
  }
};

int64_t valid_rows(const DispatchOutputs& d) {
  const int64_t n = d.ep_recv_counts.numel();
  return n > 0 ? d.ep_recv_counts.ptr<int32_t>()[n - 1] : 0;
}

Tensor copy_of(const Tensor& t) {
  std::vector<int64_t> shape;
  for (int d = 0; d < t.ndim(); ++d) shape.push_back(t.size(d));
  Tensor c = Tensor::empty(t.dtype(), shape);
  std::memcpy(c.data(), t.data(), t.nbytes());
  return c;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// combine_v2 with expand_x outside the window copies the valid rows (comm_quant_mode 2: their
// int8 form) into a slot of its own. With the window full of held dispatch outputs, that slot
// comes from a new generation, and the result is bitwise the plain MPI path's.
class CombineStaging : public ::testing::TestWithParam<int> {};

TEST_P(CombineStaging, GrowsAFullWindowAndMatchesMpi) {
  const int comm_quant_mode = GetParam();
  GrowthInputs in;
  // The first window holds two dispatch outputs (FullWindowGrowsWithinABound).
  std::vector<DispatchOutputs> held = {in.dispatch(), in.dispatch()};
  ASSERT_NE(detail::CommInternals::shm(*in.comm), nullptr);
  ASSERT_EQ(in.shm().generations(), 1);
  const DispatchOutputs& d = held.back();
  const int64_t valid = valid_rows(d), H = GrowthInputs::kH;
  ASSERT_GT(valid, 0);
  // The experts' outputs, in a tensor of their own: row j of expand_x times (1 + (j % 3) / 4).
  Tensor y = Tensor::zeros(DType::kBF16, {d.expand_x.size(0), H});
  for (int64_t j = 0; j < valid; ++j)
    for (int64_t h = 0; h < H; ++h)
      ref::store(DType::kBF16, y.data(), j * H + h,
                 ref::load(DType::kBF16, d.expand_x.data(), j * H + h) *
                     (1.0f + static_cast<float>(j % 3) / 4.0f));
  const int64_t mapped = in.shm().mapped(), slots = in.shm().slots_allocated();
  const Tensor got = in.combine(d, y, comm_quant_mode, "shm");
  EXPECT_EQ(in.shm().generations(), 2);
  EXPECT_GT(in.shm().mapped(), mapped);
  EXPECT_EQ(in.shm().slots_allocated(), slots + 1);  // the rows went through a staging slot
  const Tensor want = in.combine(d, y, comm_quant_mode, "mpi");
  EXPECT_TRUE(same_bytes(got, want));
  // The staging slot was released with the call: the next one stages in the same generation.
  EXPECT_TRUE(same_bytes(in.combine(d, y, comm_quant_mode, "shm"), want));
  EXPECT_EQ(in.shm().generations(), 2);
  EXPECT_EQ(in.shm().slots_allocated(), slots + 2);
}

INSTANTIATE_TEST_SUITE_P(Transport, CombineStaging, ::testing::Values(0, 2),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "comm_quant_mode_" + std::to_string(i.param);
                         });

// Only rank 0 holds its outputs: its window fills, it asks for growth, and every rank of the
// machine adds a segment in the same call (MPI_Win_allocate_shared is collective); from the fifth
// call rank 0 receives through MPI while the others still use shared memory. Every call's
// dispatch and combine outputs must equal the first call's, and every rank of rank 0's machine
// ends with the two generations.
TEST(Transport, UnevenHoldingKeepsRanksInStep) {
  GrowthInputs in;
  const bool holder = test::world_rank() == 0;
  std::vector<DispatchOutputs> held;
  DispatchOutputs first;
  Tensor first_out;
  for (int call = 0; call < 6; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    DispatchOutputs d = in.dispatch();
    const int64_t valid = valid_rows(d);
    if (call == 0) {
      first = d;
      first.expand_x = copy_of(d.expand_x);  // the experts below overwrite call 0's
    } else {
      EXPECT_EQ(valid, valid_rows(first));
      EXPECT_EQ(std::memcmp(d.expand_x.data(), first.expand_x.data(),
                            static_cast<std::size_t>(valid * GrowthInputs::kH * 2)),
                0);
      EXPECT_EQ(std::memcmp(d.assist_info_for_combine.data(), first.assist_info_for_combine.data(),
                            static_cast<std::size_t>(3 * valid) * sizeof(int32_t)),
                0);  // its meaningful prefix (SPEC §1.4)
    }
    // The experts: expand_x doubled in place (exact in bf16), then combined from the window.
    for (int64_t i = 0; i < valid * GrowthInputs::kH; ++i)
      ref::store(DType::kBF16, d.expand_x.data(), i,
                 2.0f * ref::load(DType::kBF16, d.expand_x.data(), i));
    Tensor out = in.combine(d, d.expand_x, 0, "shm");
    if (call == 0) {
      first_out = out;
      Tensor again = in.combine(d, d.expand_x, 0, "mpi");
      EXPECT_TRUE(same_bytes(out, again));
    } else {
      EXPECT_TRUE(same_bytes(out, first_out));
    }
    // The holder: generations 0, 0, 1, 1, then MPI (-1); the others always shared memory.
    constexpr int kHolderGen[] = {0, 0, 1, 1, -1, -1};
    const int gen = in.located(d.expand_x);
    if (holder)
      EXPECT_EQ(gen, kHolderGen[call]);
    else
      EXPECT_GE(gen, 0);
    if (holder) held.push_back(std::move(d));
  }
  // The holder's window grew once (calls 0-1 in generation 0, 2-3 in generation 1, then MPI),
  // and so did every other rank's on its machine; a rank on another one (MOE_EP_SHM_NODE_RANKS)
  // never grew.
  EXPECT_EQ(in.shm().generations(), in.shm().node_of(0) >= 0 ? 2 : 1);
}

TEST(Transport, MalformedStreamThreshold) {
  const int bad = test::world_size() - 1;
  for (const char* v : {"-1", "16MiB", "", "99999999999999999999"}) {
    SCOPED_TRACE(v);
    if (*v == '\0') {  // empty: the default, no error
      if (test::world_rank() == bad) setenv("MOE_EP_STREAM_MIN_BYTES", v, 1);
      small_call([](EpConfig&) {});
      unsetenv("MOE_EP_STREAM_MIN_BYTES");
      continue;
    }
    if (test::world_rank() == bad) setenv("MOE_EP_STREAM_MIN_BYTES", v, 1);
    test::expect_collective_error([] { small_call([](EpConfig&) {}); }, test::world_rank(), bad,
                                  ErrorKind::kInvalidArgument,
                                  {std::string("dispatch_v2: MOE_EP_STREAM_MIN_BYTES = \"") + v +
                                   "\" is not a byte count (an integer in [0, 2^63 - 1])"});
    unsetenv("MOE_EP_STREAM_MIN_BYTES");
  }
  small_call([](EpConfig&) {});  // the communicator is still usable
}

// $MOE_EP_SHM_NODE_RANKS (testing multi-machine paths on one machine): a malformed value on one
// rank fails the call on every rank before any collective, naming the variable and its range.
TEST(Transport, MalformedNodeRanks) {
  const char* given = std::getenv("MOE_EP_SHM_NODE_RANKS");  // set by mpi_tests_two_nodes
  const std::string saved = given != nullptr ? given : "";
  const int bad = test::world_size() - 1;
  for (const char* v : {"0", "-2", "two", "2x", "99999999999"}) {
    SCOPED_TRACE(v);
    if (test::world_rank() == bad) setenv("MOE_EP_SHM_NODE_RANKS", v, 1);
    test::expect_collective_error(
        [] { small_call([](EpConfig&) {}); }, test::world_rank(), bad, ErrorKind::kInvalidArgument,
        {std::string("dispatch_v2: MOE_EP_SHM_NODE_RANKS = \"") + v +
         "\" is not a rank count (an integer in [1, 2^31 - 1]; unset: the whole machine)"});
    if (given != nullptr)
      setenv("MOE_EP_SHM_NODE_RANKS", saved.c_str(), 1);
    else
      unsetenv("MOE_EP_SHM_NODE_RANKS");
  }
  // Valid but different values would split the machine differently on different ranks: the
  // header agreement rejects them on every rank, before any collective.
  if (test::world_size() >= 2) {
    if (test::world_rank() == 1) setenv("MOE_EP_SHM_NODE_RANKS", saved == "3" ? "4" : "3", 1);
    test::expect_collective_error([] { small_call([](EpConfig&) {}); }, test::world_rank(), -1,
                                  ErrorKind::kInvalidArgument,
                                  {"dispatch_v2: MOE_EP_SHM_NODE_RANKS differs across ranks"});
    if (given != nullptr)
      setenv("MOE_EP_SHM_NODE_RANKS", saved.c_str(), 1);
    else
      unsetenv("MOE_EP_SHM_NODE_RANKS");
  }
  small_call([](EpConfig&) {});  // the communicator is still usable
}

// A bad argument on one rank, after the shared-memory path is set up: the others get kRemote.
TEST(Transport, BadArgumentOnOneRankWithShm) {
  small_call([](EpConfig& c) { c.transport = "shm"; });
  const int bad = test::world_size() - 1;
  test::expect_collective_error(
      [&] { small_call([](EpConfig& c) { c.transport = "shm"; }, test::world_rank() == bad); },
      test::world_rank(), bad, ErrorKind::kInvalidArgument, {"expert_ids[2,0] = 999"});
  small_call([](EpConfig& c) { c.transport = "shm"; });
}

}  // namespace
}  // namespace moe_ep
