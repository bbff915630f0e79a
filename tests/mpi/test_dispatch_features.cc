// dispatch_v2 / combine_v2 features beyond the plain all-to-all (issue 3): shared-expert ranks
// (SPEC §1.2), x_active_mask (§1.3, §1.6), special experts (§2.2), performance_info (§1.8),
// elastic scale-in (§1.7) and TP (§1.1 step 3, §2). Every rank builds the same global batch from a
// seed and checks its slice against the reference (ref/ep_ref.h), which is W-independent: equality
// at every W is bitwise identity across W.
//
// Every test uses its own Communicator duplicated from MPI_COMM_WORLD (another file's last test
// breaks a communicator of its own). Tests that need more ranks skip on every rank alike.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "moe_ep/backward.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "mpi/common.h"
#include "ref/ep_backward_ref.h"
#include "ref/ep_ref.h"
#include "ref/numeric.h"
#include "ref/quant_ref.h"

namespace moe_ep {
namespace {

using test::values;

using test::world_rank;
using test::world_size;

Communicator* comm() {
  static std::shared_ptr<Communicator> c = Communicator::from_mpi(MPI_COMM_WORLD);
  return c.get();
}

class Features : public ::testing::Test {
 protected:
  void SetUp() override { comm(); }
};

int64_t esize(DType d) { return d == DType::kF32 ? 4 : 2; }

bool same_bytes(const void* a, const void* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}

// The same bits, except that a NaN equals any NaN: a sum with NaN or Inf - Inf terms gives a NaN
// whose sign and payload depend on the operand order of each addition, which SPEC §2.3 does not
// fix (the order of the terms it does).
bool same_values(DType dtype, const void* a, const void* b, std::size_t bytes) {
  if (same_bytes(a, b, bytes)) return true;
  const auto n = static_cast<int64_t>(bytes) / esize(dtype);
  for (int64_t i = 0; i < n; ++i) {
    const float x = ref::load(dtype, a, i), y = ref::load(dtype, b, i);
    const bool same = std::isnan(x) ? std::isnan(y)
                                    : std::memcmp(static_cast<const char*>(a) + i * esize(dtype),
                                                  static_cast<const char*>(b) + i * esize(dtype),
                                                  static_cast<std::size_t>(esize(dtype))) == 0;
    if (!same) return false;
  }
  return true;
}

struct Rng : test::SplitMix64 {
  Rng(uint64_t seed, uint64_t stream)
      : SplitMix64{seed * 0x9e3779b97f4a7c15ull + stream * 0xbf58476d1ce4e5b9ull + 7} {}
  float uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(next() >> 40) / static_cast<float>(1 << 24);
  }
};

enum class Mask { kNone, kOneD, kTwoD };

struct Spec {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t tokens = 24;  // global tokens
  int64_t H = 8;
  int64_t K = 3;
  int64_t E = 12;
  int64_t S = 0, Ns = 1;
  int64_t Z = 0, C = 0, Q = 0;
  Mask mask = Mask::kNone;
  bool uneven = false;       // BS differs across ranks (global_bs given)
  bool shared_x = false;     // pass shared_expert_x
  bool shared_x_3d = false;  // as (2, BS/2, H) when BS is even
  double inactive = 0.0;     // probability of an id -1
  bool nonfinite = false;    // x rows with NaN, +Inf and -Inf elements
  std::string transport;     // EpConfig::transport ("": the default)
  bool quant = false;        // also dispatch_v2 with quant_mode 2 (SPEC §1.5)
  bool smooth = false;       // with smoothing scales
  bool comm_quant = false;   // also combine_v2 with comm_quant_mode 2
  uint64_t seed = 3;
};

// The global batch, held whole by every rank.
struct Batch {
  Spec spec;
  int W = 1;
  int64_t global_bs = 0;
  std::vector<int64_t> bs;
  std::vector<std::vector<unsigned char>> x, sx;
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> scales;
  std::vector<std::vector<uint8_t>> mask;
  std::vector<unsigned char> a1, a2, v;  // (Q, H)
  std::vector<ref::EpRankInput> inputs;
  ref::EpWorld world;
};

Batch make_batch(const Spec& spec, int W) {
  Batch b;
  b.spec = spec;
  b.W = W;
  const int64_t es = esize(spec.dtype), K = spec.K, H = spec.H;
  const int64_t N = spec.E + spec.Z + spec.C + spec.Q;
  b.bs.assign(W, spec.tokens / W);
  b.bs[W - 1] += spec.tokens % W;
  if (spec.uneven && W > 1) {
    b.bs[0] += b.bs[W - 1];  // the last rank has no tokens
    b.bs[W - 1] = 0;
  }
  const int64_t max_bs = *std::max_element(b.bs.begin(), b.bs.end());
  b.global_bs = spec.uneven ? W * max_bs : 0;
  int64_t g = 0;
  for (int r = 0; r < W; ++r) {
    const int64_t BS = b.bs[r];
    b.x.emplace_back(std::max<int64_t>(1, BS * H * es));
    b.sx.emplace_back(std::max<int64_t>(1, BS * H * es));
    b.ids.emplace_back(std::max<int64_t>(1, BS * K));
    b.scales.emplace_back(std::max<int64_t>(1, BS * K));
    b.mask.emplace_back(std::max<int64_t>(1, BS * K), 1);
    for (int64_t i = 0; i < BS; ++i, ++g) {
      Rng rng(spec.seed, static_cast<uint64_t>(g));
      std::vector<int64_t> pool(N);
      for (int64_t e = 0; e < N; ++e) pool[e] = e;
      for (int64_t k = 0; k < K; ++k) {
        std::swap(pool[k], pool[k + rng.below(N - k)]);
        const bool off = spec.inactive > 0 && rng.uniform(0, 1) < spec.inactive;
        b.ids[r][i * K + k] = off ? -1 : static_cast<int32_t>(pool[k]);
        b.scales[r][i * K + k] = rng.uniform(0.125f, 1.5f);
        if (spec.mask == Mask::kTwoD)
          b.mask[r][i * K + k] = (g % 4 == 1 || rng.below(5) == 0) ? 0 : 1;
      }
      // With BS differing, every token must be active (SPEC §1.3): one True per row at least.
      if (spec.mask == Mask::kTwoD && spec.uneven) b.mask[r][i * K + g % K] = 1;
      if (spec.mask == Mask::kOneD) b.mask[r][i] = i < BS - BS / 3 ? 1 : 0;
      for (int64_t h = 0; h < H; ++h) {
        ref::store(spec.dtype, b.x[r].data() + i * H * es, h, rng.uniform(-2, 2));
        ref::store(spec.dtype, b.sx[r].data() + i * H * es, h, rng.uniform(-1, 1));
      }
      if (spec.nonfinite && H > 0 && g % 3 == 0) {
        const float special[] = {std::nanf(""), INFINITY, -INFINITY};
        ref::store(spec.dtype, b.x[r].data() + i * H * es, rng.below(H), special[g / 3 % 3]);
      }
    }
  }
  b.a1.resize(std::max<int64_t>(1, spec.Q * H * es));
  b.a2.resize(b.a1.size());
  b.v.resize(b.a1.size());
  Rng rng(spec.seed, 999999);
  for (int64_t j = 0; j < spec.Q * H; ++j) {
    ref::store(spec.dtype, b.a1.data(), j, rng.uniform(-1, 1));
    ref::store(spec.dtype, b.a2.data(), j, rng.uniform(-1, 1));
    ref::store(spec.dtype, b.v.data(), j, rng.uniform(-3, 3));
  }
  b.world.E = spec.E;
  b.world.S = spec.S;
  b.world.Ns = spec.S > 0 ? spec.Ns : 0;
  b.world.global_bs = b.global_bs;
  b.world.Z = spec.Z, b.world.C = spec.C, b.world.Q = spec.Q;
  if (spec.Q > 0) {
    b.world.alpha_1 = TensorView::contiguous(b.a1.data(), spec.dtype, {spec.Q, H});
    b.world.alpha_2 = TensorView::contiguous(b.a2.data(), spec.dtype, {spec.Q, H});
    b.world.v = TensorView::contiguous(b.v.data(), spec.dtype, {spec.Q, H});
  }
  for (int r = 0; r < W; ++r) {
    const int64_t BS = b.bs[r];
    ref::EpRankInput in;
    in.x = TensorView::contiguous(b.x[r].data(), spec.dtype, {BS, H});
    in.expert_ids = TensorView::contiguous(b.ids[r].data(), DType::kI32, {BS, K});
    in.expert_scales = TensorView::contiguous(b.scales[r].data(), DType::kF32, {BS, K});
    if (spec.mask == Mask::kOneD)
      in.x_active_mask = TensorView::contiguous(b.mask[r].data(), DType::kBool, {BS});
    if (spec.mask == Mask::kTwoD)
      in.x_active_mask = TensorView::contiguous(b.mask[r].data(), DType::kBool, {BS, K});
    if (spec.shared_x) {
      if (spec.shared_x_3d && BS % 2 == 0)
        in.shared_expert_x = TensorView::contiguous(b.sx[r].data(), spec.dtype, {2, BS / 2, H});
      else
        in.shared_expert_x = TensorView::contiguous(b.sx[r].data(), spec.dtype, {BS, H});
    }
    if (spec.C > 0 || spec.Q > 0) in.ori_x = in.x;
    b.inputs.push_back(in);
  }
  return b;
}

// The reference sees shared_expert_x as (BS, H) rows.
std::vector<ref::EpRankInput> ref_inputs(const Batch& b) {
  std::vector<ref::EpRankInput> v = b.inputs;
  for (int r = 0; r < b.W; ++r)
    if (v[r].shared_expert_x)
      v[r].shared_expert_x = TensorView::contiguous(const_cast<unsigned char*>(b.sx[r].data()),
                                                    b.spec.dtype, {b.bs[r], b.spec.H});
  return v;
}

// $MOE_EP_TEST_COMM_ALG (ctest mpi_tests_hierarchy.*, multihost.*) runs the grid with that
// comm_alg; with "hierarchy", combine_v2 is checked against SPEC §3's sum on nodes of G ranks.
std::string comm_alg() {
  const char* v = std::getenv("MOE_EP_TEST_COMM_ALG");
  return v ? v : "";
}
// G: the ranks on this machine, in runs of $MOE_EP_SHM_NODE_RANKS when set (the library's nodes;
// the test's own count). Collective on its first call, which every rank makes in the same test.
int64_t node_ranks(int W) {
  static const int64_t machine = [] {
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int n = 1;
    MPI_Comm_size(node, &n);
    MPI_Comm_free(&node);
    return int64_t{n};
  }();
  const char* v = std::getenv("MOE_EP_SHM_NODE_RANKS");
  return std::min<int64_t>({W, machine, v && *v ? std::atoi(v) : machine});
}

EpConfig config(const Batch& b, Communicator* group = nullptr) {
  EpConfig c;
  c.comm_alg = comm_alg();
  c.group_ep = group ? group : comm();
  c.ep_world_size = b.W;
  c.ep_rank_id = c.group_ep->rank();
  c.moe_expert_num = b.spec.E;
  c.global_bs = b.global_bs;
  c.shared_expert_rank_num = b.spec.S;
  c.shared_expert_num = b.spec.Ns;
  c.zero_expert_num = b.spec.Z;
  c.copy_expert_num = b.spec.C;
  c.const_expert_num = b.spec.Q;
  c.transport = b.spec.transport;
  return c;
}

DispatchInputs dispatch_inputs(const Batch& b, int rank, int64_t type = 1) {
  const ref::EpRankInput& mine = b.inputs[rank];
  DispatchInputs in;
  in.x = mine.x;
  in.expert_ids = mine.expert_ids;
  in.expert_scales = mine.expert_scales;
  in.x_active_mask = mine.x_active_mask;
  in.expert_token_nums_type = type;
  return in;
}

// The shared experts of the tests: shared expert s (id -1 - s) multiplies by (2 + s).
ref::ExpertFn shared_expert() {
  return [](int64_t id, DType dtype, const void* in, void* out, int64_t H) {
    const float factor = 2.0f + static_cast<float>(-1 - id);
    for (int64_t h = 0; h < H; ++h) ref::store(dtype, out, h, ref::load(dtype, in, h) * factor);
  };
}

void check_dispatch(const Batch& b, const DispatchOutputs& out, const ref::EpRankDispatch& want,
                    int64_t type) {
  const int64_t row_bytes = b.spec.H * esize(b.spec.dtype);
  ASSERT_EQ(out.expand_x.size(0), want.A);
  ASSERT_EQ(out.expand_x.size(1), b.spec.H);
  // Only the first `valid` rows of expand_x and 3 * valid entries of assist_info_for_combine are
  // meaningful (SPEC §1.4); dispatch_v2 leaves the rest as it was.
  ASSERT_LE(want.valid, want.A);
  EXPECT_TRUE(same_bytes(out.expand_x.data(), want.expand_x.data(), want.valid * row_bytes))
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

// The experts applied to dispatch's rows: MoE rows through scale_expert(E), shared rows through
// shared_expert(). `rank` / `W` / `S` are of the world the op ran on.
Tensor run_experts(const Batch& b, const DispatchOutputs& out, int64_t rank, int64_t W, int64_t S,
                   int64_t Ns, int64_t E) {
  Tensor y = Tensor::zeros(out.expand_x.dtype(), {out.expand_x.size(0), b.spec.H});
  const int64_t row_bytes = b.spec.H * esize(b.spec.dtype);
  const int32_t* inc = out.ep_recv_counts.ptr<int32_t>();
  const int64_t L = rank < S ? 1 : E / (W - S);
  const ref::ExpertFn moe = ref::scale_expert(E), shared = shared_expert();
  for (int64_t l = 0; l < L; ++l) {
    const int64_t lo = l == 0 ? 0 : inc[l * W - 1], hi = inc[l * W + W - 1];
    for (int64_t j = lo; j < hi; ++j) {
      const unsigned char* in = out.expand_x.ptr<unsigned char>() + j * row_bytes;
      unsigned char* o = y.ptr<unsigned char>() + j * row_bytes;
      if (rank < S)
        shared(-1 - rank / (S / Ns), b.spec.dtype, in, o, b.spec.H);
      else
        moe((rank - S) * L + l, b.spec.dtype, in, o, b.spec.H);
    }
  }
  return y;
}

CombineInputs combine_inputs(const Batch& b, int rank, const DispatchOutputs& out,
                             const Tensor& y) {
  const ref::EpRankInput& mine = b.inputs[rank];
  CombineInputs in;
  in.expand_x = y.view();
  in.expert_ids = mine.expert_ids;
  in.assist_info_for_combine = out.assist_info_for_combine;
  in.ep_send_counts = out.ep_recv_counts;
  in.expert_scales = *mine.expert_scales;
  in.x_active_mask = mine.x_active_mask;
  in.shared_expert_x = mine.shared_expert_x;
  in.ori_x = mine.ori_x;
  in.const_expert_alpha_1 = b.world.alpha_1;
  in.const_expert_alpha_2 = b.world.alpha_2;
  in.const_expert_v = b.world.v;
  return in;
}

uint64_t fnv1a(const void* p, std::size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i)
    h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  return h;
}

// SPEC §7: with the handle of `out` (dispatch_v2 type 1 of b), a cached dispatch gives the same
// outputs bit for bit, and combine_v2 given the handle (no assist_info_for_combine, no
// ep_send_counts) the same sum: once on the experts' outputs in a tensor of their own, once with
// the experts run in place on expand_x (which then lies in the shared-memory window, where the
// peers of this machine read it).
void handle_round_trip(const Batch& b, const DispatchOutputs& out,
                       const std::vector<unsigned char>& combined) {
  const int rank = comm()->rank();
  ASSERT_TRUE(out.handle.defined());
  const auto want = ref::dispatch_reference(ref_inputs(b), b.world);
  DispatchInputs din = dispatch_inputs(b, rank, 1);
  din.handle = &out.handle;
  const DispatchOutputs cached = dispatch_v2(din, config(b));
  SCOPED_TRACE("cached dispatch");
  check_dispatch(b, cached, want[rank], 1);
  const Tensor y = run_experts(b, cached, rank, b.W, b.spec.S, b.spec.Ns, b.spec.E);
  for (bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "combine with the handle, in place" : "combine with the handle");
    if (in_place) std::memcpy(cached.expand_x.data(), y.data(), y.nbytes());
    CombineInputs cin = combine_inputs(b, rank, cached, in_place ? cached.expand_x : y);
    cin.assist_info_for_combine = TensorView{};
    cin.ep_send_counts = TensorView{};
    cin.handle = &cached.handle;
    const Tensor x = combine_v2(cin, config(b));
    ASSERT_EQ(x.nbytes(), combined.size());
    EXPECT_TRUE(same_values(b.spec.dtype, x.data(), combined.data(), x.nbytes()))
        << "combine_v2 with the handle differs from SPEC §2.3 computed by the reference";
  }
}

// The experts applied to the reference's rows of every rank (valid rows): what each owner's
// run_experts gives, for the oracle of the backward.
std::vector<std::vector<unsigned char>> reference_expert_rows(
    const Batch& b, const std::vector<ref::EpRankDispatch>& dispatched) {
  const int64_t row_bytes = b.spec.H * esize(b.spec.dtype);
  const ref::ExpertFn moe = ref::scale_expert(b.spec.E), shared = shared_expert();
  std::vector<std::vector<unsigned char>> rows;
  for (const ref::EpRankDispatch& d : dispatched) {
    rows.emplace_back(std::max<int64_t>(1, d.valid * row_bytes));
    for (int64_t j = 0; j < d.valid; ++j) {
      const int64_t e = d.row_expert[j];
      (e < 0 ? shared : moe)(e, b.spec.dtype, d.expand_x.data() + j * row_bytes,
                             rows.back().data() + j * row_bytes, b.spec.H);
    }
  }
  return rows;
}

// SPEC §6 over the handle of `out` (dispatch_v2 of b) with the experts' outputs y:
// dispatch_v2_backward of grad_expand_x = y, and combine_v2_backward of grad_out = the batch's
// shared_expert_x values, against ref/ep_backward_ref.h bit for bit.
void backward_round_trip(const Batch& b, const DispatchOutputs& out, const Tensor& y) {
  const int rank = comm()->rank();
  const int64_t H = b.spec.H, row_bytes = H * esize(b.spec.dtype), BS = b.bs[rank];
  const auto ins = ref_inputs(b);
  const auto dispatched = ref::dispatch_reference(ins, b.world);
  const int64_t valid = dispatched[rank].valid;
  {
    SCOPED_TRACE("dispatch_v2_backward");
    DispatchBackwardInputs in;
    in.grad_expand_x = y.view();
    in.expert_ids = b.inputs[rank].expert_ids;
    in.x_active_mask = b.inputs[rank].x_active_mask;
    in.handle = &out.handle;
    const Tensor gx = dispatch_v2_backward(in, config(b));
    const int64_t G = comm_alg() == "hierarchy" ? node_ranks(b.W) : 0;
    const auto want = ref::dispatch_backward_reference(ins, b.world, dispatched,
                                                       reference_expert_rows(b, dispatched), G);
    ASSERT_EQ(gx.size(0), BS);
    ASSERT_EQ(gx.nbytes(), want[rank].size());
    EXPECT_TRUE(same_values(b.spec.dtype, gx.data(), want[rank].data(), gx.nbytes()))
        << "grad_x differs from SPEC §6 computed by the reference";
  }
  SCOPED_TRACE("combine_v2_backward");
  std::vector<std::vector<unsigned char>> grad_out;
  for (int r = 0; r < b.W; ++r) grad_out.push_back(b.sx[r]);
  const ref::EpRankInput& mine = b.inputs[rank];
  CombineBackwardInputs in;
  in.grad_out = TensorView::contiguous(grad_out[rank].data(), b.spec.dtype, {BS, H});
  in.expand_x = y.view();
  in.expert_ids = mine.expert_ids;
  in.expert_scales = *mine.expert_scales;
  in.x_active_mask = mine.x_active_mask;
  in.shared_expert_x = b.spec.shared_x;
  in.ori_x = mine.ori_x;
  in.const_expert_alpha_1 = b.world.alpha_1;
  in.const_expert_alpha_2 = b.world.alpha_2;
  in.const_expert_v = b.world.v;
  in.handle = &out.handle;
  const CombineBackwardOutputs g = combine_v2_backward(in, config(b));
  const auto want = ref::combine_backward_reference(ins, b.world, dispatched, grad_out,
                                                    ref::scale_expert(b.spec.E))[rank];
  ASSERT_EQ(g.grad_expand_x.size(0), y.size(0));
  EXPECT_TRUE(same_values(b.spec.dtype, g.grad_expand_x.data(), want.grad_expand_x.data(),
                          valid * row_bytes))
      << "grad_expand_x differs from the reference";
  const std::vector<unsigned char> zeros((y.size(0) - valid) * row_bytes, 0);
  EXPECT_TRUE(same_bytes(g.grad_expand_x.ptr<unsigned char>() + valid * row_bytes, zeros.data(),
                         zeros.size()))
      << "grad_expand_x is not 0 past the valid rows";
  ASSERT_EQ(g.grad_expert_scales.numel(), static_cast<int64_t>(want.grad_expert_scales.size()));
  EXPECT_TRUE(same_values(DType::kF32, g.grad_expert_scales.data(), want.grad_expert_scales.data(),
                          want.grad_expert_scales.size() * 4))
      << "grad_expert_scales differ from the reference";
  EXPECT_EQ(g.grad_shared_expert_x.defined(), b.spec.shared_x);
  if (b.spec.shared_x) {
    EXPECT_TRUE(same_values(b.spec.dtype, g.grad_shared_expert_x.data(),
                            want.grad_shared_expert_x.data(), BS * row_bytes))
        << "grad_shared_expert_x differs";
  }
  EXPECT_EQ(g.grad_ori_x.defined(), b.spec.C > 0 || b.spec.Q > 0);
  if (g.grad_ori_x.defined()) {
    EXPECT_TRUE(
        same_values(b.spec.dtype, g.grad_ori_x.data(), want.grad_ori_x.data(), BS * row_bytes))
        << "grad_ori_x differs";
  }
  if (b.spec.Q > 0) {
    EXPECT_TRUE(same_values(b.spec.dtype, g.grad_const_expert_alpha_1.data(),
                            want.grad_alpha_1.data(), want.grad_alpha_1.size()));
    EXPECT_TRUE(same_values(b.spec.dtype, g.grad_const_expert_alpha_2.data(),
                            want.grad_alpha_2.data(), want.grad_alpha_2.size()));
    EXPECT_TRUE(same_values(b.spec.dtype, g.grad_const_expert_v.data(), want.grad_v.data(),
                            want.grad_v.size()));
  }
}

// The same float, a NaN equal to any NaN (a quantised row with a NaN or Inf has a NaN scale).
bool same_float(float a, float b) {
  return std::isnan(a) ? std::isnan(b) : std::memcmp(&a, &b, sizeof(float)) == 0;
}

// SPEC §1.5: dispatch_v2 with quant_mode 2 (smoothing scales when the spec asks) has the layout of
// quant_mode 0 and, per valid row, the reference row quantised by ref/quant_ref.h with the
// smoothing row of its expert (Ns + e for MoE expert e, s for shared expert s); past the valid
// rows dynamic_scales is 0. A cached dispatch with its handle gives the same bits.
void quant_dispatch_round(const Batch& b, const ref::EpRankDispatch& want) {
  const int rank = comm()->rank();
  const int64_t H = b.spec.H, Ns = b.world.Ns, row_bytes = H * esize(b.spec.dtype);
  std::vector<float> smooth(static_cast<std::size_t>((Ns + b.spec.E) * H));
  Rng rng(b.spec.seed, 424242);
  for (float& f : smooth) f = rng.uniform(0.25f, 4.0f);
  DispatchInputs in = dispatch_inputs(b, rank, 1);
  in.quant_mode = 2;
  if (b.spec.smooth)
    in.scales = TensorView::contiguous(smooth.data(), DType::kF32, {Ns + b.spec.E, H});
  const DispatchOutputs first = dispatch_v2(in, config(b));
  in.handle = &first.handle;
  const DispatchOutputs cached = dispatch_v2(in, config(b));
  for (const DispatchOutputs* out : {&first, &cached}) {
    SCOPED_TRACE(out == &first ? "quant_mode 2" : "quant_mode 2, cached");
    ASSERT_EQ(out->expand_x.dtype(), DType::kI8);
    ASSERT_EQ(out->expand_x.size(0), want.A);
    ASSERT_EQ(out->dynamic_scales.numel(), want.A);
    EXPECT_EQ(values<int32_t>(out->ep_recv_counts), want.ep_recv_counts);
    EXPECT_EQ(values<int64_t>(out->expert_token_nums), want.expert_token_nums1);
    EXPECT_EQ(values<int32_t>(out->assist_info_for_combine, 3 * want.valid),
              test::prefix(want.assist_info, 3 * want.valid));
    EXPECT_EQ(values<float>(out->expand_scales), want.expand_scales);
    const float* dyn = out->dynamic_scales.ptr<float>();
    std::vector<int8_t> q(static_cast<std::size_t>(H));
    for (int64_t j = 0; j < want.A; ++j) {
      float scale = 0.0f;
      std::fill(q.begin(), q.end(), int8_t{0});
      if (j < want.valid) {
        const int64_t e = want.row_expert[j];
        const float* row = b.spec.smooth ? smooth.data() + (e >= 0 ? Ns + e : -1 - e) * H : nullptr;
        scale = ref::quantize_row_int8(b.spec.dtype, want.expand_x.data() + j * row_bytes, row, H,
                                       q.data());
      }
      const bool rows = j >= want.valid || same_bytes(out->expand_x.ptr<int8_t>() + j * H, q.data(),
                                                      static_cast<std::size_t>(H));
      ASSERT_TRUE(rows && same_float(dyn[j], scale))
          << "quantised row " << j << " of " << want.valid << " differs from the reference";
    }
  }
}

// SPEC §2.3 with comm_quant_mode 2: the rows travel back as int8 and are summed dequantised;
// without the handle and with it, the same bits as the reference's comm_quant sum.
void comm_quant_combine_round(const Batch& b, const DispatchOutputs& out, const Tensor& y) {
  const int rank = comm()->rank();
  const auto want = ref::combine_reference(ref_inputs(b), b.world, ref::scale_expert(b.spec.E),
                                           shared_expert(), true)[rank];
  for (bool handle : {false, true}) {
    SCOPED_TRACE(handle ? "comm_quant_mode 2 with the handle" : "comm_quant_mode 2");
    CombineInputs cin = combine_inputs(b, rank, out, y);
    cin.comm_quant_mode = 2;
    if (handle) {
      cin.handle = &out.handle;
      cin.assist_info_for_combine = TensorView{};
      cin.ep_send_counts = TensorView{};
    }
    const Tensor x = combine_v2(cin, config(b));
    ASSERT_EQ(x.nbytes(), want.size());
    EXPECT_TRUE(same_values(b.spec.dtype, x.data(), want.data(), x.nbytes()))
        << "combine_v2 with comm_quant_mode 2 differs from the reference";
  }
}

// dispatch (both types), the experts, combine: everything against the reference; then the
// quantised modes the spec asks for.
void round_trip(const Batch& b) {
  const int rank = comm()->rank();
  const auto want = ref::dispatch_reference(ref_inputs(b), b.world);
  DispatchOutputs out;
  for (int64_t type : {0, 1}) {
    SCOPED_TRACE("expert_token_nums_type " + std::to_string(type));
    out = dispatch_v2(dispatch_inputs(b, rank, type), config(b));
    check_dispatch(b, out, want[rank], type);
  }
  const Tensor y = run_experts(b, out, rank, b.W, b.spec.S, b.spec.Ns, b.spec.E);
  const Tensor x = combine_v2(combine_inputs(b, rank, out, y), config(b));
  const auto combined =
      comm_alg() == "hierarchy"
          ? ref::combine_reference_hierarchy(ref_inputs(b), b.world, ref::scale_expert(b.spec.E),
                                             shared_expert(), node_ranks(b.W))
          : ref::combine_reference(ref_inputs(b), b.world, ref::scale_expert(b.spec.E),
                                   shared_expert());
  ASSERT_EQ(x.size(0), b.bs[rank]);
  ASSERT_EQ(x.nbytes(), combined[rank].size());
  EXPECT_TRUE(same_values(b.spec.dtype, x.data(), combined[rank].data(), x.nbytes()))
      << "combine_v2 differs from SPEC §2.3 computed by the reference";
  handle_round_trip(b, out, combined[rank]);
  backward_round_trip(b, out, y);
  if (b.spec.quant) quant_dispatch_round(b, want[rank]);
  if (b.spec.comm_quant) comm_quant_combine_round(b, out, y);
  if (rank == 0 && b.spec.name.rfind("stress_", 0) != 0) {  // the stress run is quiet
    uint64_t h = 1469598103934665603ull;
    for (const auto& part : combined) h ^= fnv1a(part.data(), part.size()) + (h << 6);
    std::printf("[ %s ] W=%d reference combine hash %016llx\n", b.spec.name.c_str(), b.W,
                static_cast<unsigned long long>(h));
  }
}

bool runnable(const Spec& s, int W) {
  if (s.S >= W) return false;
  return s.E % (W - s.S) == 0;
}

class FeatureGrid : public ::testing::TestWithParam<Spec> {
 protected:
  void SetUp() override { comm(); }
};

TEST_P(FeatureGrid, MatchesReference) {
  const Spec& s = GetParam();
  if (!runnable(s, world_size())) GTEST_SKIP() << "needs more ranks";
  round_trip(make_batch(s, world_size()));
}

std::vector<Spec> grid() {
  std::vector<Spec> v;
  auto add = [&](std::string name, auto&& f) {
    Spec s;
    s.name = std::move(name);
    f(s);
    v.push_back(s);
  };
  add("shared_S1", [](Spec& s) { s.S = 1, s.Ns = 1; });
  add("shared_S2_Ns1", [](Spec& s) { s.S = 2, s.Ns = 1, s.E = 6; });
  add("shared_S2_Ns2_fp32", [](Spec& s) { s.S = 2, s.Ns = 2, s.E = 6, s.dtype = DType::kF32; });
  add("shared_S3_Ns1_uneven", [](Spec& s) { s.S = 3, s.Ns = 1, s.E = 5, s.uneven = true; });
  add("shared_S1_inactive_ids", [](Spec& s) { s.S = 1, s.inactive = 0.4; });
  add("mask_1d", [](Spec& s) { s.mask = Mask::kOneD; });
  add("mask_2d", [](Spec& s) { s.mask = Mask::kTwoD, s.inactive = 0.2; });
  add("mask_2d_shared", [](Spec& s) { s.mask = Mask::kTwoD, s.S = 1; });
  add("mask_1d_shared_fp16", [](Spec& s) { s.mask = Mask::kOneD, s.S = 1, s.dtype = DType::kF16; });
  add("special_zero_copy_const", [](Spec& s) { s.Z = 1, s.C = 1, s.Q = 2; });
  add("special_only_const_fp32", [](Spec& s) { s.Q = 3, s.dtype = DType::kF32, s.K = 4; });
  add("special_with_shared_mask",
      [](Spec& s) { s.Z = 2, s.C = 1, s.Q = 1, s.S = 1, s.mask = Mask::kTwoD; });
  // No const expert: combine_v2 sums each token's rows in one sum_rows (zero experts skipped,
  // copy experts' ori_x rows, shared experts and shared_expert_x with weight 1).
  add("special_zero_copy_no_const", [](Spec& s) { s.Z = 1, s.C = 1; });
  add("special_zero_copy_shared_mask_x", [](Spec& s) {
    s.Z = 2, s.C = 1, s.S = 1, s.mask = Mask::kTwoD, s.shared_x = true, s.dtype = DType::kF16;
  });
  add("shared_expert_x_2d", [](Spec& s) { s.shared_x = true; });
  add("shared_expert_x_3d_with_S1",
      [](Spec& s) { s.shared_x = true, s.shared_x_3d = true, s.S = 1; });
  // SPEC §3's acceptance case at W = 6 as 3 nodes x 2 ranks (and at W = 4, 3): shared-expert
  // ranks, a 2-D mask, -1 ids, the last rank without tokens.
  add("shared_S2_mask_2d_inactive_uneven", [](Spec& s) {
    s.S = 2, s.Ns = 1, s.E = 8, s.mask = Mask::kTwoD, s.inactive = 0.2, s.uneven = true;
  });
  add("everything_uneven",
      [](Spec& s) { s.Z = 1, s.C = 1, s.Q = 1, s.S = 1, s.shared_x = true, s.uneven = true; });
  return v;
}

INSTANTIATE_TEST_SUITE_P(Issue3, FeatureGrid, ::testing::ValuesIn(grid()),
                         [](const ::testing::TestParamInfo<Spec>& i) { return i.param.name; });

// A long verified stress run (issue 23 item 6): each round draws a feature mix (shared-expert
// ranks, special experts, masks, -1 ids, a rank without tokens, shared_expert_x), a size, a dtype,
// a transport and non-finite x rows, and runs round_trip (dispatch_v2 of both count types, the
// scale experts, combine_v2, the handle's replay, the backward ops) against the reference. Rounds:
// $MOE_EP_STRESS_ROUNDS (default 30), from $MOE_EP_STRESS_SEED (default 1); every rank draws the
// same. The first failing round stops the run and names its spec.
Spec stress_spec(test::SplitMix64& rng, int W, uint64_t round) {
  Spec s;
  s.name = "stress_" + std::to_string(round);
  s.seed = rng.next();
  const DType dtypes[] = {DType::kBF16, DType::kF16, DType::kF32};
  s.dtype = dtypes[rng.below(3)];
  s.H = 1 + static_cast<int64_t>(rng.below(rng.below(4) == 0 ? 300 : 40));
  s.S = rng.below(3) == 0 ? static_cast<int64_t>(rng.below(std::min(W, 3))) : 0;
  s.Ns = s.S > 1 && rng.below(2) == 0 ? s.S : 1;
  s.E = (W - s.S) * static_cast<int64_t>(1 + rng.below(5));
  if (rng.below(3) == 0) {
    s.Z = static_cast<int64_t>(rng.below(3));
    s.C = static_cast<int64_t>(rng.below(3));
    s.Q = static_cast<int64_t>(rng.below(3));
  }
  s.K = 1 + static_cast<int64_t>(rng.below(std::min<uint64_t>(8, s.E)));
  s.tokens = static_cast<int64_t>(rng.below(4) == 0 ? 0 : rng.below(16 * W + 1));
  s.uneven = rng.below(3) == 0;
  if (!s.uneven) s.tokens -= s.tokens % W;  // the same BS on every rank without global_bs
  const Mask masks[] = {Mask::kNone, Mask::kOneD, Mask::kTwoD};
  s.mask = masks[rng.below(3)];
  if (s.uneven && s.mask == Mask::kOneD) s.mask = Mask::kNone;  // SPEC §1.3: all active
  s.inactive = rng.below(2) == 0 ? 0.0 : 0.3;
  s.shared_x = rng.below(4) == 0;
  s.shared_x_3d = s.shared_x && rng.below(2) == 0;
  s.nonfinite = rng.below(4) == 0;
  s.transport = rng.below(2) == 0 ? "shm" : "mpi";
  s.quant = rng.below(3) == 0;
  s.smooth = s.quant && rng.below(2) == 0;
  // Under hierarchy on several nodes the int8 partials have their own sum (checked within its
  // bound by Hierarchy.CombineWithinSpecBoundAndDeterministic), not this reference's.
  s.comm_quant = rng.below(3) == 0 && (comm_alg() != "hierarchy" || node_ranks(W) == W);
  return s;
}

std::string describe(const Spec& s) {
  const char* mask = s.mask == Mask::kNone ? "none" : s.mask == Mask::kOneD ? "1d" : "2d";
  return s.name + ": dtype " + dtype_name(s.dtype) + ", H " + std::to_string(s.H) + ", tokens " +
         std::to_string(s.tokens) + ", K " + std::to_string(s.K) + ", E " + std::to_string(s.E) +
         ", S " + std::to_string(s.S) + ", Ns " + std::to_string(s.Ns) + ", Z/C/Q " +
         std::to_string(s.Z) + "/" + std::to_string(s.C) + "/" + std::to_string(s.Q) + ", mask " +
         mask + ", uneven " + std::to_string(s.uneven) + ", inactive " +
         std::to_string(s.inactive) + ", shared_x " + std::to_string(s.shared_x) + ", nonfinite " +
         std::to_string(s.nonfinite) + ", transport " + s.transport + ", quant " +
         std::to_string(s.quant) + ", smooth " + std::to_string(s.smooth) + ", comm_quant " +
         std::to_string(s.comm_quant) + ", seed " + std::to_string(s.seed);
}

uint64_t env_count(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

TEST(Stress, RandomRoundTripsMatchTheReference) {
  comm();
  const int W = world_size();
  const uint64_t rounds = env_count("MOE_EP_STRESS_ROUNDS", 30);
  test::SplitMix64 rng{env_count("MOE_EP_STRESS_SEED", 1)};
  const auto start = std::chrono::steady_clock::now();
  uint64_t done = 0, quant = 0, comm_quant = 0;
  for (uint64_t round = 0; round < rounds; ++round) {
    const Spec s = stress_spec(rng, W, round);
    if (!runnable(s, W)) continue;
    ++done, quant += s.quant, comm_quant += s.comm_quant;
    SCOPED_TRACE(describe(s));
    round_trip(make_batch(s, W));
    // Every rank stops at the same round (a failure on one rank is not seen by the others).
    int failed = ::testing::Test::HasFailure() ? 1 : 0, any = 0;
    MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (any) {
      ADD_FAILURE() << "stress round " << round << " failed on some rank: " << describe(s);
      break;
    }
  }
  if (world_rank() == 0)
    std::printf(
        "[ stress ] W=%d %llu verified round trips (%llu with quant_mode 2, %llu with "
        "comm_quant_mode 2) in %.1f s\n",
        W, static_cast<unsigned long long>(done), static_cast<unsigned long long>(quant),
        static_cast<unsigned long long>(comm_quant),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
}

// A hosted shared expert (S = 1) gives the same bits as passing its output as shared_expert_x
// (S = 0, Ns = 1): both are added unweighted after the K terms.
TEST_F(Features, HostedSharedExpertEqualsSharedExpertX) {
  const int W = world_size(), rank = world_rank();
  if (W < 2) GTEST_SKIP() << "needs two ranks";
  Spec s;
  s.name = "hosted";
  s.S = 1;
  s.E = 12;  // divisible by W - 1 and by W for W = 2..4
  Batch hosted = make_batch(s, W);
  const auto want = ref::dispatch_reference(ref_inputs(hosted), hosted.world);
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(hosted, rank), config(hosted));
  const Tensor y = run_experts(hosted, out, rank, W, 1, 1, s.E);
  const Tensor x1 = combine_v2(combine_inputs(hosted, rank, out, y), config(hosted));

  Spec s0 = s;
  s0.S = 0;
  s0.shared_x = true;
  Batch plain = make_batch(s0, W);
  // shared_expert_x := the shared expert's output on this rank's tokens.
  const int64_t row_bytes = s.H * esize(s.dtype);
  for (int64_t i = 0; i < plain.bs[rank]; ++i)
    shared_expert()(-1, s.dtype, plain.x[rank].data() + i * row_bytes,
                    plain.sx[rank].data() + i * row_bytes, s.H);
  EpConfig c0 = config(plain);
  const DispatchOutputs out0 = dispatch_v2(dispatch_inputs(plain, rank), c0);
  const Tensor y0 = run_experts(plain, out0, rank, W, 0, 1, s.E);
  const Tensor x0 = combine_v2(combine_inputs(plain, rank, out0, y0), c0);
  ASSERT_EQ(x0.nbytes(), x1.nbytes());
  EXPECT_TRUE(same_bytes(x0.data(), x1.data(), x0.nbytes()));
}

// ---------------------------------------------------------------------------------------------
// SPEC §1.4 by hand, shared-expert rank layout: W = 2 (ranks 0, 1 of a sub-communicator),
// S = 1, Ns = 1, E = 2 (rank 1 hosts experts 0 and 1, L = 2), K = 1, H = 2, fp32, global_bs = 4.
//   rank 0: t0 id 1 x (1, 2) w 0.5;  t1 id 0 x (3, 4) w 0.25
//   rank 1: t0 id 1 x (5, 6) w 2
// Shared rank 0 (A = (4/2) * ceil(2/1) = 4): block source 0: r0t0, r0t1; block source 1: r1t0,
//   all slot K + 0 = 1 -> ep_recv_counts [2, 3], expert_token_nums [3].
// MoE rank 1 (A = 4 * min(2, 1) = 4): (e0, s0) r0t1; (e0, s1) none; (e1, s0) r0t0; (e1, s1) r1t0
//   -> ep_recv_counts [1, 1, 2, 3], expert_token_nums [1, 2].
// Experts: MoE e multiplies by e + 1, the shared expert by 10:
//   r0t0 = 0.5*2*(1,2) + 10*(1,2) = (11, 22); r0t1 = 0.25*1*(3,4) + (30,40) = (30.75, 41);
//   r1t0 = 2*2*(5,6) + (50,60) = (70, 84).
TEST_F(Features, HandComputedSharedExpertRankLayout) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const int wr = world_rank();
  MPI_Comm sub;
  MPI_Comm_split(MPI_COMM_WORLD, wr < 2 ? 0 : MPI_UNDEFINED, wr, &sub);
  if (wr >= 2) return;
  auto group = Communicator::from_mpi(sub);
  MPI_Comm_free(&sub);
  std::vector<float> x = wr == 0 ? std::vector<float>{1, 2, 3, 4} : std::vector<float>{5, 6};
  std::vector<int32_t> ids = wr == 0 ? std::vector<int32_t>{1, 0} : std::vector<int32_t>{1};
  std::vector<float> w = wr == 0 ? std::vector<float>{0.5f, 0.25f} : std::vector<float>{2};
  const int64_t BS = wr == 0 ? 2 : 1;
  EpConfig cfg;
  cfg.group_ep = group.get();
  cfg.ep_world_size = 2;
  cfg.ep_rank_id = wr;
  cfg.moe_expert_num = 2;
  cfg.shared_expert_rank_num = 1;
  cfg.shared_expert_num = 1;
  cfg.global_bs = 4;
  DispatchInputs in;
  in.x = TensorView::contiguous(x.data(), DType::kF32, {BS, 2});
  in.expert_ids = TensorView::contiguous(ids.data(), DType::kI32, {BS, 1});
  in.expert_scales = TensorView::contiguous(w.data(), DType::kF32, {BS, 1});
  const DispatchOutputs out = dispatch_v2(in, cfg);
  ASSERT_EQ(out.expand_x.size(0), 4);
  // Three valid rows on either rank: only they (and their 9 assist entries) are meaningful, the
  // fourth row is unspecified (SPEC §1.4).
  const std::vector<float> ex = values<float>(out.expand_x, 6);
  const std::vector<int32_t> ai = values<int32_t>(out.assist_info_for_combine, 9);
  if (wr == 0) {
    EXPECT_EQ(values<int32_t>(out.ep_recv_counts), (std::vector<int32_t>{2, 3}));
    EXPECT_EQ(values<int64_t>(out.expert_token_nums), (std::vector<int64_t>{3}));
    EXPECT_EQ(ex, (std::vector<float>{1, 2, 3, 4, 5, 6}));
    EXPECT_EQ(ai, (std::vector<int32_t>{0, 0, 1, 0, 1, 1, 1, 0, 1}));
  } else {
    EXPECT_EQ(values<int32_t>(out.ep_recv_counts), (std::vector<int32_t>{1, 1, 2, 3}));
    EXPECT_EQ(values<int64_t>(out.expert_token_nums), (std::vector<int64_t>{1, 2}));
    EXPECT_EQ(ex, (std::vector<float>{3, 4, 1, 2, 5, 6}));
    EXPECT_EQ(ai, (std::vector<int32_t>{0, 1, 0, 0, 0, 0, 1, 0, 0}));
    EXPECT_EQ(values<float>(out.expand_scales), (std::vector<float>{0.25f, 0.5f, 2, 0}));
  }
  // The experts.
  Tensor y = Tensor::zeros(DType::kF32, {4, 2});
  const float factor_rank1[3] = {1, 2, 2};  // rows: e0, e1, e1
  for (int j = 0; j < 3; ++j)
    for (int h = 0; h < 2; ++h)
      y.ptr<float>()[j * 2 + h] = ex[j * 2 + h] * (wr == 0 ? 10.0f : factor_rank1[j]);
  CombineInputs cin;
  cin.expand_x = y.view();
  cin.expert_ids = in.expert_ids;
  cin.assist_info_for_combine = out.assist_info_for_combine;
  cin.ep_send_counts = out.ep_recv_counts;
  cin.expert_scales = *in.expert_scales;
  const Tensor r = combine_v2(cin, cfg);
  if (wr == 0)
    EXPECT_EQ(values<float>(r), (std::vector<float>{11, 22, 30.75f, 41}));
  else
    EXPECT_EQ(values<float>(r), (std::vector<float>{70, 84}));
}

// ---------------------------------------------------------------------------------------------
// Validation: the bad rank throws naming op, parameter, value and bound; the others kRemote.

void expect_error(const std::function<void()>& call, int bad, ErrorKind kind,
                  const std::vector<std::string>& needles) {
  test::expect_collective_error(call, comm()->rank(), bad, kind, needles);
}

Spec small_spec() {
  Spec s;
  s.name = "errors";
  s.tokens = 4 * world_size();  // BS = 4 everywhere
  s.dtype = DType::kF32;
  return s;
}

TEST_F(Features, MaskOneDTrueAfterFalse) {
  Batch b = make_batch(small_spec(), world_size());
  const int rank = world_rank(), bad = world_size() - 1;
  std::vector<uint8_t> mask = {1, 0, 1, 1};
  DispatchInputs in = dispatch_inputs(b, rank);
  if (rank == bad) in.x_active_mask = TensorView::contiguous(mask.data(), DType::kBool, {4});
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"dispatch_v2: x_active_mask[2] = true follows x_active_mask[1] = false"});
}

TEST_F(Features, MaskTwoDWrongShape) {
  Batch b = make_batch(small_spec(), world_size());
  const int rank = world_rank(), bad = 0;
  std::vector<uint8_t> mask(8, 1);
  DispatchInputs in = dispatch_inputs(b, rank);
  if (rank == bad) in.x_active_mask = TensorView::contiguous(mask.data(), DType::kBool, {4, 2});
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"dispatch_v2: x_active_mask.shape[1] = 2 must equal 3"});
}

TEST_F(Features, MaskWrongDtypeInCombine) {
  Batch b = make_batch(small_spec(), world_size());
  const int rank = world_rank(), bad = world_size() - 1;
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(b, rank), config(b));
  const Tensor y = run_experts(b, out, rank, b.W, 0, 1, b.spec.E);
  CombineInputs in = combine_inputs(b, rank, out, y);
  std::vector<float> mask(4, 1.0f);
  if (rank == bad) in.x_active_mask = TensorView::contiguous(mask.data(), DType::kF32, {4});
  expect_error([&] { combine_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"combine_v2: x_active_mask dtype fp32 is not one of {bool}"});
}

// BS differs across ranks: every token must be active (SPEC §1.3); all ranks throw.
TEST_F(Features, MaskFalseWhileBatchSizesDiffer) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  Spec s = small_spec();
  s.uneven = true;
  s.mask = Mask::kOneD;
  Batch b = make_batch(s, world_size());
  expect_error([&] { dispatch_v2(dispatch_inputs(b, world_rank()), config(b)); }, -1,
               ErrorKind::kInvalidArgument,
               {"dispatch_v2: x_active_mask on rank 0 makes a token inactive", "while BS differs",
                "every token must be active"});
}

// The same with an all-True mask is fine.
TEST_F(Features, AllTrueMaskWhileBatchSizesDiffer) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  Spec s = small_spec();
  s.uneven = true;
  Batch b = make_batch(s, world_size());
  std::vector<uint8_t> mask(std::max<int64_t>(1, b.bs[world_rank()]), 1);
  b.inputs[world_rank()].x_active_mask =
      TensorView::contiguous(mask.data(), DType::kBool, {b.bs[world_rank()]});
  round_trip(b);
}

// A 2-D all-False row sends the token nowhere, not even to the shared experts: the shared rank's
// rows (ep_recv_counts on rank 0) do not include it, and its combine output is 0.
TEST_F(Features, AllFalseRowGoesNowhere) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  Spec s = small_spec();
  s.S = 1;
  s.mask = Mask::kTwoD;
  Batch b = make_batch(s, world_size());
  if (12 % (b.W - 1) != 0) GTEST_SKIP();
  const int rank = world_rank();
  for (int r = 0; r < b.W; ++r) std::fill(b.mask[r].begin(), b.mask[r].end(), 1);
  std::fill(b.mask[1].begin() + 3, b.mask[1].begin() + 6, 0);  // rank 1, token 1
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(b, rank), config(b));
  if (rank == 0) {
    // Rank 0 (the only shared-expert rank) gets every rank's active tokens: 4 per rank but 3
    // from rank 1.
    std::vector<int32_t> want;
    for (int r = 0, run = 0; r < b.W; ++r) want.push_back(run += r == 1 ? 3 : 4);
    EXPECT_EQ(values<int32_t>(out.ep_recv_counts), want);
  }
  const Tensor y = run_experts(b, out, rank, b.W, 1, 1, b.spec.E);
  const Tensor x = combine_v2(combine_inputs(b, rank, out, y), config(b));
  if (rank == 1) {
    for (int64_t h = 0; h < b.spec.H; ++h) EXPECT_EQ(x.ptr<float>()[b.spec.H + h], 0.0f);
  }
  const auto want =
      ref::combine_reference(ref_inputs(b), b.world, ref::scale_expert(b.spec.E), shared_expert());
  EXPECT_TRUE(same_bytes(x.data(), want[rank].data(), x.nbytes()));
}

Spec special_spec() {
  Spec s = small_spec();
  s.C = 1;
  s.Q = 2;
  return s;
}

struct SpecialCombine {
  Batch b;
  DispatchOutputs out;
  Tensor y;
};

SpecialCombine special_dispatched() {
  SpecialCombine c{make_batch(special_spec(), world_size()), {}, {}};
  const int rank = world_rank();
  c.out = dispatch_v2(dispatch_inputs(c.b, rank), config(c.b));
  c.y = run_experts(c.b, c.out, rank, c.b.W, 0, 1, c.b.spec.E);
  return c;
}

TEST_F(Features, OriXRequiredForCopyExperts) {
  SpecialCombine c = special_dispatched();
  const int rank = world_rank(), bad = world_size() - 1;
  CombineInputs in = combine_inputs(c.b, rank, c.out, c.y);
  if (rank == bad) in.ori_x.reset();
  expect_error([&] { combine_v2(in, config(c.b)); }, bad, ErrorKind::kInvalidArgument,
               {"combine_v2: ori_x is required when copy_expert_num = 1 > 0"});
}

TEST_F(Features, ConstAlphaRequired) {
  SpecialCombine c = special_dispatched();
  const int rank = world_rank(), bad = 0;
  CombineInputs in = combine_inputs(c.b, rank, c.out, c.y);
  if (rank == bad) in.const_expert_alpha_2.reset();
  expect_error([&] { combine_v2(in, config(c.b)); }, bad, ErrorKind::kInvalidArgument,
               {"combine_v2: const_expert_alpha_2 is required when const_expert_num = 2 > 0"});
}

TEST_F(Features, ConstVWrongShapeAndDtype) {
  SpecialCombine c = special_dispatched();
  const int rank = world_rank(), bad = world_size() - 1;
  {
    CombineInputs in = combine_inputs(c.b, rank, c.out, c.y);
    if (rank == bad) in.const_expert_v->shape[0] = 1;
    expect_error([&] { combine_v2(in, config(c.b)); }, bad, ErrorKind::kInvalidArgument,
                 {"combine_v2: const_expert_v.shape[0] = 1 must equal 2 (const_expert_num)"});
  }
  {
    CombineInputs in = combine_inputs(c.b, rank, c.out, c.y);
    std::vector<uint16_t> bf(2 * c.b.spec.H, 0);
    if (rank == bad)
      in.const_expert_alpha_1 = TensorView::contiguous(bf.data(), DType::kBF16, {2, c.b.spec.H});
    expect_error([&] { combine_v2(in, config(c.b)); }, bad, ErrorKind::kInvalidArgument,
                 {"combine_v2: const_expert_alpha_1 dtype bf16 is not one of {fp32}"});
  }
  {
    CombineInputs in = combine_inputs(c.b, rank, c.out, c.y);
    if (rank == bad) in.ori_x->shape[1] = c.b.spec.H - 1;
    expect_error([&] { combine_v2(in, config(c.b)); }, bad, ErrorKind::kInvalidArgument,
                 {"combine_v2: ori_x.shape[1] = 7 must equal 8 (H, expand_x.shape[1])"});
  }
}

TEST_F(Features, SpecialExpertIdOutOfRange) {
  Batch b = make_batch(special_spec(), world_size());  // E + Z + C + Q = 15
  const int rank = world_rank(), bad = world_size() - 1;
  if (rank == bad) b.ids[rank][1] = 15;
  expect_error([&] { dispatch_v2(dispatch_inputs(b, rank), config(b)); }, bad,
               ErrorKind::kInvalidArgument,
               {"dispatch_v2: expert_ids[0,1] = 15 is outside [0, 15) (moe_expert_num + "
                "zero/copy/const_expert_num"});
}

TEST_F(Features, TopKAboveAllExperts) {
  Spec s = small_spec();
  s.E = 12;
  s.K = 3;
  Batch b = make_batch(s, world_size());
  EpConfig cfg = config(b);
  cfg.moe_expert_num = 12;
  std::vector<int32_t> ids(4 * 14, -1);
  DispatchInputs in = dispatch_inputs(b, world_rank());
  in.expert_ids = TensorView::contiguous(ids.data(), DType::kI32, {4, 14});
  in.expert_scales.reset();
  cfg.zero_expert_num = 1;
  expect_error([&] { dispatch_v2(in, cfg); }, -1, ErrorKind::kInvalidArgument,
               {"dispatch_v2: expert_ids.shape[1] = 14 (K) is outside [1, 13]"});
}

TEST_F(Features, SharedExpertCombinations) {
  Batch b = make_batch(small_spec(), world_size());
  const int rank = world_rank(), bad = 0, W = world_size();
  EpConfig cfg = config(b);
  if (W >= 3) {
    if (rank == bad) cfg.shared_expert_rank_num = 2, cfg.shared_expert_num = 3;
    expect_error([&] { dispatch_v2(dispatch_inputs(b, rank), cfg); }, bad,
                 ErrorKind::kInvalidArgument,
                 {"dispatch_v2: shared_expert_rank_num = 2 is not a multiple of "
                  "shared_expert_num = 3"});
  }
  cfg = config(b);
  if (rank == bad) cfg.shared_expert_num = 0, cfg.shared_expert_rank_num = 0;
  // (0, 0) is valid; on one rank only it disagrees with the others' (1, 0).
  if (W > 1)
    expect_error([&] { dispatch_v2(dispatch_inputs(b, rank), cfg); }, -1,
                 ErrorKind::kInvalidArgument, {"shared_expert_num differs across ranks"});
}

TEST_F(Features, SharedExpertXWrongShape) {
  Batch b = make_batch(small_spec(), world_size());
  const int rank = world_rank(), bad = world_size() - 1;
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(b, rank), config(b));
  const Tensor y = run_experts(b, out, rank, b.W, 0, 1, b.spec.E);
  CombineInputs in = combine_inputs(b, rank, out, y);
  if (rank == bad)
    in.shared_expert_x = TensorView::contiguous(b.sx[rank].data(), DType::kF32, {3, 1, 8});
  expect_error([&] { combine_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"combine_v2: shared_expert_x has 3 rows (shape[0] * shape[1]) but BS = 4"});
}

// ---------------------------------------------------------------------------------------------
// performance_info (SPEC §1.8): added to, never zeroed; rank 0 arrives 100 ms late, so every other
// rank records at least 50 ms of waiting for rank 0.
TEST_F(Features, PerformanceInfoAddsWaits) {
  const int rank = world_rank(), W = world_size();
  Batch b = make_batch(small_spec(), W);
  std::vector<int64_t> perf(W, 1000000);
  DispatchInputs in = dispatch_inputs(b, rank);
  in.performance_info = TensorView::contiguous(perf.data(), DType::kI64, {W});
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const DispatchOutputs out = dispatch_v2(in, config(b));
  for (int p = 0; p < W; ++p) EXPECT_GE(perf[p], 1000000) << "performance_info[" << p << "]";
  if (rank != 0) {
    EXPECT_GE(perf[0], 1000000 + 50000) << "the wait for late rank 0";
  }
  const std::vector<int64_t> after_dispatch = perf;
  const Tensor y = run_experts(b, out, rank, b.W, 0, 1, b.spec.E);
  CombineInputs cin = combine_inputs(b, rank, out, y);
  cin.performance_info = TensorView::contiguous(perf.data(), DType::kI64, {W});
  combine_v2(cin, config(b));
  for (int p = 0; p < W; ++p) EXPECT_GE(perf[p], after_dispatch[p]);
}

TEST_F(Features, PerformanceInfoWrongSize) {
  const int rank = world_rank(), W = world_size(), bad = W - 1;
  Batch b = make_batch(small_spec(), W);
  std::vector<int64_t> perf(W + 1, 0);
  DispatchInputs in = dispatch_inputs(b, rank);
  if (rank == bad) in.performance_info = TensorView::contiguous(perf.data(), DType::kI64, {W + 1});
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"dispatch_v2: performance_info.shape[0] = " + std::to_string(W + 1) +
                " must equal " + std::to_string(W) + " (ep_world_size)"});
}

// ---------------------------------------------------------------------------------------------
// elastic_info (SPEC §1.7): old rank 1 is removed; the survivors' results equal a fresh run on the
// smaller world (the reference of W - 1 ranks); the removed rank gets empty outputs.
std::vector<int32_t> scale_in_table(int W, int removed, int64_t newS, int64_t newE) {
  std::vector<int32_t> t = {1, W - (removed >= 0 ? 1 : 0), static_cast<int32_t>(newS),
                            static_cast<int32_t>(newE)};
  std::vector<int32_t> back;
  for (int o = 0, n = 0; o < W; ++o) {
    t.push_back(o == removed ? -1 : n++);
    if (o != removed) back.push_back(o);
  }
  back.resize(W, -1);
  t.insert(t.end(), back.begin(), back.end());
  return t;
}

void scale_in_round_trip(int64_t newS) {
  const int W = world_size(), rank = world_rank(), removed = 1;
  Spec s;
  s.name = "scale_in";
  s.E = 12;
  s.S = newS;
  s.mask = Mask::kTwoD;
  Batch small = make_batch(s, W - 1);  // the smaller world's batch, started fresh
  std::vector<int32_t> table = scale_in_table(W, removed, newS, 12);
  const TensorView tv = TensorView::contiguous(table.data(), DType::kI32, {4 + 2 * W});
  EpConfig cfg = config(small);
  cfg.ep_world_size = W;
  cfg.ep_rank_id = rank;
  cfg.shared_expert_rank_num = 0;  // the old world's
  const int nr = table[4 + rank];
  std::vector<float> dummy_x(8, 1.0f);
  std::vector<int32_t> dummy_ids = {0, 1, 2};
  DispatchInputs in;
  if (nr >= 0) {
    in = dispatch_inputs(small, nr);
  } else {
    in.x = TensorView::contiguous(dummy_x.data(), DType::kBF16, {1, 8});
    in.expert_ids = TensorView::contiguous(dummy_ids.data(), DType::kI32, {1, 3});
  }
  in.elastic_info = tv;
  const DispatchOutputs out = dispatch_v2(in, cfg);
  if (nr < 0) {
    EXPECT_EQ(out.expand_x.size(0), 0);
    EXPECT_EQ(out.ep_recv_counts.numel(), 0);
    EXPECT_EQ(out.expert_token_nums.numel(), 0);
    CombineInputs cin;
    cin.expand_x = out.expand_x;
    cin.expert_ids = in.expert_ids;
    std::vector<float> w(3, 1.0f);
    cin.expert_scales = TensorView::contiguous(w.data(), DType::kF32, {1, 3});
    cin.assist_info_for_combine = out.assist_info_for_combine;
    cin.ep_send_counts = out.ep_recv_counts;
    cin.elastic_info = tv;
    const Tensor x = combine_v2(cin, cfg);
    ASSERT_EQ(x.size(0), 1);
    for (int64_t h = 0; h < 8; ++h) EXPECT_EQ(ref::load(DType::kBF16, x.data(), h), 0.0f);
    return;
  }
  const auto want = ref::dispatch_reference(ref_inputs(small), small.world);
  check_dispatch(small, out, want[nr], 1);
  const Tensor y = run_experts(small, out, nr, W - 1, newS, 1, 12);
  CombineInputs cin = combine_inputs(small, nr, out, y);
  cin.elastic_info = tv;
  const Tensor x = combine_v2(cin, cfg);
  const auto combined = ref::combine_reference(ref_inputs(small), small.world,
                                               ref::scale_expert(12), shared_expert());
  ASSERT_EQ(x.nbytes(), combined[nr].size());
  EXPECT_TRUE(same_bytes(x.data(), combined[nr].data(), x.nbytes()))
      << "survivor's combine differs from a fresh run on the smaller world";
}

TEST_F(Features, ScaleInEqualsFreshSmallerWorld) {
  if (world_size() < 3) GTEST_SKIP() << "needs three ranks";
  scale_in_round_trip(0);
}

TEST_F(Features, ScaleInWithSharedExpertRank) {
  if (world_size() < 3 || 12 % (world_size() - 2) != 0) GTEST_SKIP() << "needs three ranks";
  scale_in_round_trip(1);
}

// Without scale-in (is_scaled_down = 0) the table is not used; a bad flag is an error.
TEST_F(Features, ElasticFlagOutOfRange) {
  const int W = world_size(), rank = world_rank(), bad = W - 1;
  Batch b = make_batch(small_spec(), W);
  std::vector<int32_t> table(4 + 2 * W, 0);
  if (rank == bad) table[0] = 2;
  DispatchInputs in = dispatch_inputs(b, rank);
  in.elastic_info = TensorView::contiguous(table.data(), DType::kI32, {4 + 2 * W});
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"dispatch_v2: elastic_info[0] = 2 (is_scaled_down) is not one of {0, 1}"});
  round_trip(b);  // is_scaled_down = 0 everywhere: a plain run
}

TEST_F(Features, ElasticTableInconsistentOnOneRank) {
  const int W = world_size(), rank = world_rank(), bad = 0;
  Batch b = make_batch(small_spec(), W);
  std::vector<int32_t> table(4 + 2 * W, 0);
  if (rank == bad) {
    table = scale_in_table(W, -1, 0, 12);  // nobody removed
    table[4 + W] = W > 1 ? 1 : 5;          // new->old no longer the inverse
  }
  DispatchInputs in = dispatch_inputs(b, rank);
  in.elastic_info = TensorView::contiguous(table.data(), DType::kI32, {4 + 2 * W});
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"dispatch_v2: elastic_info[" + std::to_string(4 + W) + "] = ",
                "(old rank of new rank 0) must be 0"});
}

// ---------------------------------------------------------------------------------------------
// comm_alg "hierarchy" (SPEC §3) beside fullmesh on the same batch: dispatch bitwise equal,
// combine within SPEC §3's bound and deterministic. Nodes are runs of $MOE_EP_SHM_NODE_RANKS
// ranks (ctest mpi_tests_hierarchy.*, mpi_tests_two_nodes); without it every rank is on one node
// and the two algorithms must agree bit for bit.

class Hierarchy : public Features {};

// SPEC §6: the backward ops need the forward's handle; a bad argument on one rank reaches the
// others through the agreement (kRemote naming it), so no rank waits for its deadline.
TEST_F(Features, BackwardWithoutHandleOnOneRank) {
  const Batch b = make_batch(small_spec(), world_size());
  const int rank = world_rank(), bad = world_size() - 1;
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(b, rank), config(b));
  DispatchBackwardInputs in;
  in.grad_expand_x = out.expand_x;
  in.expert_ids = b.inputs[rank].expert_ids;
  in.handle = rank == bad ? nullptr : &out.handle;
  expect_error([&] { dispatch_v2_backward(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"dispatch_v2_backward: handle is required"});
}

TEST_F(Features, CombineBackwardGradOutWrongShapeOnOneRank) {
  const Batch b = make_batch(small_spec(), world_size());
  const int rank = world_rank(), bad = world_size() - 1;
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(b, rank), config(b));
  std::vector<float> g(5 * b.spec.H, 1.0f);
  CombineBackwardInputs in;
  in.grad_out = TensorView::contiguous(g.data(), DType::kF32, {rank == bad ? 5 : 4, b.spec.H});
  in.expand_x = out.expand_x;
  in.expert_ids = b.inputs[rank].expert_ids;
  in.expert_scales = *b.inputs[rank].expert_scales;
  in.handle = &out.handle;
  expect_error([&] { combine_v2_backward(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"combine_v2_backward: grad_out.shape[0] = 5 must equal 4"});
}

// SPEC §6: int8 rows have no gradient; a quant_mode 2 handle is refused on every rank, before
// any data moves.
TEST_F(Features, BackwardOfQuantisedDispatchIsUnsupported) {
  const Batch b = make_batch(small_spec(), world_size());
  const int rank = world_rank();
  DispatchInputs din = dispatch_inputs(b, rank);
  din.quant_mode = 2;
  const DispatchOutputs out = dispatch_v2(din, config(b));
  Tensor grad = Tensor::zeros(DType::kF32, {out.expand_x.size(0), b.spec.H});
  DispatchBackwardInputs in;
  in.grad_expand_x = grad;
  in.expert_ids = b.inputs[rank].expert_ids;
  in.handle = &out.handle;
  test::expect_collective_error([&] { dispatch_v2_backward(in, config(b)); }, rank, -1,
                                ErrorKind::kUnsupported, {"quant_mode = 2"});
}

// Calling a backward op where another rank calls the forward one is named on every rank.
TEST_F(Features, BackwardAgainstForwardIsNamed) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const Batch b = make_batch(small_spec(), world_size());
  const int rank = world_rank();
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(b, rank), config(b));
  try {
    if (rank == 0) {
      DispatchBackwardInputs in;
      in.grad_expand_x = out.expand_x;
      in.expert_ids = b.inputs[rank].expert_ids;
      in.handle = &out.handle;
      dispatch_v2_backward(in, config(b));
    } else {
      CombineInputs in = combine_inputs(b, rank, out, out.expand_x);
      in.handle = &out.handle;
      combine_v2(in, config(b));
    }
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("dispatch_v2_backward"), std::string::npos) << e.what();
  }
}

EpConfig with_alg(EpConfig c, const char* alg) {
  c.comm_alg = alg;
  return c;
}

Spec hierarchy_spec(DType dtype) {
  Spec s;
  s.name = "hierarchy";
  s.dtype = dtype;
  s.tokens = 48;  // W = 1..6 divide it
  s.H = 32;
  s.K = 4;
  s.E = 12;
  s.seed = 11;
  return s;
}

void expect_same_dispatch(const DispatchOutputs& f, const DispatchOutputs& h) {
  const int64_t valid = f.tp_recv_counts.ptr<int32_t>()[0];
  ASSERT_EQ(h.tp_recv_counts.ptr<int32_t>()[0], valid);
  const int64_t row = f.expand_x.nbytes() / std::max<int64_t>(1, f.expand_x.size(0));
  EXPECT_TRUE(same_bytes(f.expand_x.data(), h.expand_x.data(), valid * row)) << "expand_x";
  EXPECT_EQ(values<int32_t>(f.ep_recv_counts), values<int32_t>(h.ep_recv_counts));
  EXPECT_EQ(values<int64_t>(f.expert_token_nums), values<int64_t>(h.expert_token_nums));
  EXPECT_EQ(values<int32_t>(f.assist_info_for_combine, 3 * valid),
            values<int32_t>(h.assist_info_for_combine, 3 * valid));
  EXPECT_EQ(values<float>(f.expand_scales, valid), values<float>(h.expand_scales, valid));
  if (f.dynamic_scales.defined()) {
    EXPECT_EQ(values<float>(f.dynamic_scales, valid), values<float>(h.dynamic_scales, valid));
  }
}

// dispatch_v2's valid outputs are those of fullmesh, bit for bit (SPEC §3), with shared experts,
// and quant_mode 2 with and without smoothing scales (the int8 row crosses once, or the relay
// quantises each copy).
TEST_F(Hierarchy, DispatchIsBitwiseFullmesh) {
  const int W = world_size(), rank = world_rank();
  if (W % node_ranks(W) != 0) GTEST_SKIP() << "nodes of unequal size";
  for (int quant : {0, 2, 3}) {  // 3: quant_mode 2 with smoothing scales
    for (int64_t S : {0, 1}) {
      for (int64_t E : {12, 48}) {  // 48: more local experts than ranks
        Spec s = hierarchy_spec(DType::kBF16);
        s.S = S;
        s.E = E;
        if (!runnable(s, W)) continue;
        SCOPED_TRACE("quant " + std::to_string(quant) + ", S " + std::to_string(S) + ", E " +
                     std::to_string(E));
        Batch b = make_batch(s, W);
        DispatchInputs in = dispatch_inputs(b, rank);
        std::vector<float> smooth(static_cast<std::size_t>((S > 0 ? 1 : 0) + s.E) * s.H);
        for (std::size_t j = 0; j < smooth.size(); ++j) smooth[j] = 0.5f + float(j % 7) * 0.25f;
        if (quant >= 2) in.quant_mode = 2;
        if (quant == 3)
          in.scales = TensorView::contiguous(smooth.data(), DType::kF32,
                                             {static_cast<int64_t>(smooth.size()) / s.H, s.H});
        const DispatchOutputs f = dispatch_v2(in, with_alg(config(b), "fullmesh"));
        const DispatchOutputs h = dispatch_v2(in, with_alg(config(b), "hierarchy"));
        expect_same_dispatch(f, h);
        in.handle = &h.handle;  // a cached dispatch takes the relays too
        expect_same_dispatch(f, dispatch_v2(in, with_alg(config(b), "hierarchy")));
      }
    }
  }
}

// fp32: |acc_h - acc_f| <= (K + Ns) * 2^-24 * sum |terms| (SPEC §3); two runs give the same bits;
// with two nodes or more the sums differ somewhere (the relays' partials are in use), on one node
// nowhere. comm_quant_mode 2: the partials cross as int8, within the int8 steps of the rows.
TEST_F(Hierarchy, CombineWithinSpecBoundAndDeterministic) {
  const int W = world_size(), rank = world_rank();
  if (W % node_ranks(W) != 0) GTEST_SKIP() << "nodes of unequal size";
  const bool several = W / node_ranks(W) >= 2;
  Spec s = hierarchy_spec(DType::kF32);
  s.S = W >= 2 && 12 % (W - 1) == 0 ? 1 : 0;  // a shared-expert rank where the placement allows
  Batch b = make_batch(s, W);
  const DispatchOutputs out =
      dispatch_v2(dispatch_inputs(b, rank), with_alg(config(b), "fullmesh"));
  const Tensor y = run_experts(b, out, rank, W, s.S, s.Ns, s.E);
  for (int64_t cq : {0, 2}) {
    SCOPED_TRACE("comm_quant_mode " + std::to_string(cq));
    CombineInputs cin = combine_inputs(b, rank, out, y);
    cin.comm_quant_mode = cq;
    const Tensor f = combine_v2(cin, with_alg(config(b), "fullmesh"));
    const Tensor h = combine_v2(cin, with_alg(config(b), "hierarchy"));
    const Tensor h2 = combine_v2(cin, with_alg(config(b), "hierarchy"));
    ASSERT_TRUE(same_bytes(h.data(), h2.data(), h.nbytes())) << "not deterministic";
    const std::vector<float> vf = values<float>(f), vh = values<float>(h);
    const float* x = reinterpret_cast<const float*>(b.x[rank].data());
    const int32_t* ids = b.ids[rank].data();
    const float* w = b.scales[rank].data();
    int64_t differ = 0;
    for (int64_t i = 0; i < b.bs[rank]; ++i)
      for (int64_t j = 0; j < s.H; ++j) {
        double terms = 0;  // sum |w * y| + the shared expert (2 x) of the token's terms
        for (int64_t k = 0; k < s.K; ++k)
          terms += std::fabs(double(w[i * s.K + k]) * x[i * s.H + j] *
                             (1.0 + double(ids[i * s.K + k]) / s.E));
        terms += s.S > 0 ? 2.0 * std::fabs(x[i * s.H + j]) : 0.0;
        const double bound =
            cq == 0 ? (s.K + 1) * std::ldexp(1.0, -24) * terms * 1.001 : 4.0 * terms / 127.0;
        const double d = std::fabs(double(vh[i * s.H + j]) - vf[i * s.H + j]);
        EXPECT_LE(d, bound) << "token " << i << ", h " << j;
        differ += d > 0;
      }
    if (cq == 0) {
      int64_t all = differ;
      MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
      // (Two partials of a token re-associate nothing when one is a lone term: a shared expert.)
      if (several && s.S == 0) {
        EXPECT_GT(all, 0) << "no sum re-associated: the relays' partials were not used";
      }
      if (!several) {
        EXPECT_EQ(all, 0) << "one node: hierarchy must be fullmesh";
      }
    }
  }
}

// EpConfig::partials = "bf16" (SPEC §3, "Partials"): against fp32 partials the sum moves by at
// most 2^-8 |p| per remote node's partial p (p itself at most (1 + u) sum |terms| of the rounded
// y), plus each output's own final rounding; deterministic; different somewhere with two nodes or
// more (the rounded partials are in use), bitwise fp32 partials' on one node. bf16 partials with
// fp16 expand_x, "fp16", another value, or values that differ across ranks: errors on every rank.
TEST_F(Hierarchy, Bf16PartialsWithinBound) {
  const int W = world_size(), rank = world_rank();
  if (W % node_ranks(W) != 0) GTEST_SKIP() << "nodes of unequal size";
  const bool several = W / node_ranks(W) >= 2;
  const double u = std::ldexp(1.0, -8);
  auto layer = [&](DType dt, Spec& s) {
    s = hierarchy_spec(dt);
    s.S = W >= 2 && 12 % (W - 1) == 0 ? 1 : 0;
  };
  Spec s;
  layer(DType::kBF16, s);
  Batch b = make_batch(s, W);
  const DispatchOutputs out =
      dispatch_v2(dispatch_inputs(b, rank), with_alg(config(b), "fullmesh"));
  const Tensor y = run_experts(b, out, rank, W, s.S, s.Ns, s.E);
  const CombineInputs cin = combine_inputs(b, rank, out, y);
  const EpConfig fp32 = with_alg(config(b), "hierarchy");
  EpConfig low = fp32;
  low.partials = "bf16";
  const Tensor a = combine_v2(cin, fp32), h = combine_v2(cin, low), h2 = combine_v2(cin, low);
  const Tensor f = combine_v2(cin, with_alg(config(b), "fullmesh"));
  ASSERT_TRUE(same_bytes(h.data(), h2.data(), h.nbytes())) << "not deterministic";
  const void* x = b.x[rank].data();
  const int32_t* ids = b.ids[rank].data();
  const float* w = b.scales[rank].data();
  int64_t differ = 0;
  for (int64_t i = 0; i < b.bs[rank]; ++i)
    for (int64_t j = 0; j < s.H; ++j) {
      const double xv = load_float(DType::kBF16, x, i * s.H + j);
      double terms = 0;  // sum |w * y| + the shared expert (2 x) of the token's terms
      for (int64_t k = 0; k < s.K; ++k)
        terms += std::fabs(double(w[i * s.K + k]) * xv * (1.0 + double(ids[i * s.K + k]) / s.E));
      terms = (terms + (s.S > 0 ? 2.0 * std::fabs(xv) : 0.0)) * (1 + u);  // y rounded to bf16
      const double fp32_sums = (s.K + 1) * std::ldexp(1.0, -24) * terms;
      const double va = load_float(DType::kBF16, a.data(), i * s.H + j);
      const double vf = load_float(DType::kBF16, f.data(), i * s.H + j);
      const double vh = load_float(DType::kBF16, h.data(), i * s.H + j);
      // Against fp32 partials (same sums, the partials rounded) and against fullmesh (SPEC §3's
      // bound plus the partials'), each output rounded once more on its own.
      EXPECT_LE(std::fabs(vh - va),
                (u * terms + fp32_sums) * 1.01 + u * (std::fabs(va) + std::fabs(vh)))
          << "token " << i << ", h " << j;
      EXPECT_LE(std::fabs(vh - vf),
                (u * terms + 2 * fp32_sums) * 1.01 + u * (std::fabs(vf) + std::fabs(vh)))
          << "token " << i << ", h " << j;
      differ += vh != va;
    }
  int64_t all = differ;
  MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  if (several && s.S == 0) {
    EXPECT_GT(all, 0) << "no partial rounded: the partials were not sent in bf16";
  }
  if (!several) {
    EXPECT_EQ(all, 0) << "one node: no partials cross";
  }
  if (W < 2) return;  // the checks below name rank 1
  EpConfig bad = fp32;
  bad.partials = "fp16";
  expect_error([&] { combine_v2(cin, bad); }, -1, ErrorKind::kUnsupported,
               {"combine_v2: partials = \"fp16\" is not supported: a partial beyond fp16's range"});
  bad.partials = "int4";
  expect_error([&] { combine_v2(cin, bad); }, -1, ErrorKind::kInvalidArgument,
               {"combine_v2: partials = \"int4\" is not one of {\"\", \"fp32\", \"bf16\"}"});
  const EpConfig mixed = rank == 0 ? low : fp32;
  expect_error(
      [&] { combine_v2(cin, mixed); }, -1, ErrorKind::kInvalidArgument,
      {"combine_v2: partials differs across ranks: rank 0 has \"bf16\", rank 1 has \"fp32\""});
  // dispatch_v2 does not read partials: a config that differs there is fine.
  dispatch_v2(dispatch_inputs(b, rank), rank == 0 ? low : fp32);
  Spec s16;
  layer(DType::kF16, s16);
  Batch b16 = make_batch(s16, W);
  const DispatchOutputs out16 =
      dispatch_v2(dispatch_inputs(b16, rank), with_alg(config(b16), "fullmesh"));
  const Tensor y16 = run_experts(b16, out16, rank, W, s16.S, s16.Ns, s16.E);
  EpConfig low16 = with_alg(config(b16), "hierarchy");
  low16.partials = "bf16";
  expect_error([&] { combine_v2(combine_inputs(b16, rank, out16, y16), low16); }, -1,
               ErrorKind::kInvalidArgument,
               {"combine_v2: partials = \"bf16\" needs bf16 expand_x, got fp16 (use \"fp32\")"});
}

// SPEC §3's scope: elastic_info and performance_info are refused naming "hierarchy", on every
// rank.
TEST_F(Hierarchy, ElasticAndPerformanceInfoAreUnsupported) {
  const int W = world_size(), rank = world_rank();
  Batch b = make_batch(small_spec(), W);
  std::vector<int32_t> table(4 + 2 * W, 0);
  std::vector<int64_t> perf(W, 0);
  DispatchInputs in = dispatch_inputs(b, rank);
  in.elastic_info = TensorView::contiguous(table.data(), DType::kI32, {4 + 2 * W});
  expect_error([&] { dispatch_v2(in, with_alg(config(b), "hierarchy")); }, -1,
               ErrorKind::kUnsupported,
               {"dispatch_v2: elastic_info is not supported with comm_alg = \"hierarchy\""});
  in.elastic_info.reset();
  in.performance_info = TensorView::contiguous(perf.data(), DType::kI64, {W});
  expect_error([&] { dispatch_v2(in, with_alg(config(b), "hierarchy")); }, -1,
               ErrorKind::kUnsupported,
               {"dispatch_v2: performance_info is not supported with comm_alg = \"hierarchy\""});
}

// A relay quantises with its own smoothing scales: ranks passing different ones are refused on
// every rank (across nodes only; on one node hierarchy is fullmesh, where each source uses its
// own).
TEST_F(Hierarchy, DifferentSmoothingScalesAreRefused) {
  const int W = world_size(), rank = world_rank();
  if (W % node_ranks(W) != 0 || W / node_ranks(W) < 2) GTEST_SKIP() << "needs two nodes";
  Spec s = hierarchy_spec(DType::kBF16);
  Batch b = make_batch(s, W);
  std::vector<float> smooth(static_cast<std::size_t>(s.E * s.H), 1.0f);
  if (rank == W - 1) smooth[5] = 2.0f;
  DispatchInputs in = dispatch_inputs(b, rank);
  in.quant_mode = 2;
  in.scales = TensorView::contiguous(smooth.data(), DType::kF32, {s.E, s.H});
  expect_error([&] { dispatch_v2(in, with_alg(config(b), "hierarchy")); }, -1,
               ErrorKind::kInvalidArgument,
               {"dispatch_v2: scales (smoothing factors) differ between rank 0 and rank " +
                std::to_string(W - 1)});
}

// H = 0 (rows of no bytes) moves no row but must still complete every phase, with the handle and
// without, comm_quant_mode 0 and 2: the relays count rows, not bytes.
TEST_F(Hierarchy, ZeroHiddenSizeCompletes) {
  const int W = world_size(), rank = world_rank();
  if (W % node_ranks(W) != 0) GTEST_SKIP() << "nodes of unequal size";
  Spec s = hierarchy_spec(DType::kBF16);
  s.H = 0;
  Batch b = make_batch(s, W);
  const DispatchOutputs out =
      dispatch_v2(dispatch_inputs(b, rank), with_alg(config(b), "hierarchy"));
  EXPECT_EQ(out.expand_x.size(1), 0);
  for (int64_t cq : {0, 2})
    for (bool handle : {false, true}) {
      CombineInputs cin = combine_inputs(b, rank, out, out.expand_x);
      cin.comm_quant_mode = cq;
      if (handle) cin.handle = &out.handle;
      const Tensor x = combine_v2(cin, with_alg(config(b), "hierarchy"));
      EXPECT_EQ(x.size(0), b.bs[rank]);
      EXPECT_EQ(x.size(1), 0);
    }
}

// Nodes of unequal size (W = 3 as runs of 2 ranks) are refused on every rank.
TEST_F(Hierarchy, UnequalNodesAreRefused) {
  const int W = world_size(), rank = world_rank();
  if (W % node_ranks(W) == 0) GTEST_SKIP() << "nodes of equal size";
  Batch b = make_batch(small_spec(), W);
  expect_error([&] { dispatch_v2(dispatch_inputs(b, rank), with_alg(config(b), "hierarchy")); }, -1,
               ErrorKind::kInvalidArgument,
               {"dispatch_v2: comm_alg \"hierarchy\" needs nodes of equal size"});
}

// A handle carries its algorithm: combine_v2 with the other one is refused on every rank.
TEST_F(Hierarchy, HandleOfTheOtherAlgorithmIsRefused) {
  const int W = world_size(), rank = world_rank();
  Batch b = make_batch(small_spec(), W);
  const DispatchOutputs out = dispatch_v2(dispatch_inputs(b, rank), with_alg(config(b), ""));
  CombineInputs cin = combine_inputs(b, rank, out, out.expand_x);
  cin.handle = &out.handle;
  expect_error([&] { combine_v2(cin, with_alg(config(b), "hierarchy")); }, -1,
               ErrorKind::kInvalidArgument,
               {"combine_v2: comm_alg = \"hierarchy\" differs from the \"fullmesh\" of the "
                "dispatch_v2 that made the handle"});
}

// expert_ids changed between dispatch and combine on one rank: that rank alone raises, naming
// the mismatch (found by the relay of another node, or by the owners of its own); the others'
// results stand.
TEST_F(Hierarchy, CombineWithOtherExpertIdsIsAnErrorOnTheSourceOnly) {
  const int W = world_size(), rank = world_rank();
  if (W / node_ranks(W) < 2) GTEST_SKIP() << "needs two nodes";
  Spec s = hierarchy_spec(DType::kF32);
  Batch b = make_batch(s, W);
  const DispatchOutputs out =
      dispatch_v2(dispatch_inputs(b, rank), with_alg(config(b), "hierarchy"));
  const Tensor y = run_experts(b, out, rank, W, s.S, s.Ns, s.E);
  std::vector<int32_t> ids = b.ids[rank];
  for (int64_t i = 0; rank == 0 && i < b.bs[0]; ++i)  // every id of rank 0 moved to a neighbour
    for (int64_t k = 0; k < s.K; ++k) ids[i * s.K + k] = (ids[i * s.K + k] + 1) % s.E;
  CombineInputs cin = combine_inputs(b, rank, out, y);
  cin.expert_ids = TensorView::contiguous(ids.data(), DType::kI32, {b.bs[rank], s.K});
  try {
    combine_v2(cin, with_alg(config(b), "hierarchy"));
    EXPECT_NE(rank, 0) << "rank 0 combined with other expert_ids";
  } catch (const Error& e) {
    EXPECT_EQ(rank, 0) << e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("must be those of the matching dispatch_v2"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace moe_ep
