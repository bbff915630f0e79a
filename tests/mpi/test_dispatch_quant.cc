// dispatch_v2 quant_mode 2 and combine_v2 comm_quant_mode 2 (SPEC §1.5, §2.1, §2.3) under mpiexec
// at W = 1..4. Every rank builds the same global batch; the expected int8 rows and dynamic scales
// come from ref/quant_ref.h applied to the rows of the reference layout (ref/ep_ref.h), bitwise.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "mpi/common.h"
#include "ref/ep_ref.h"
#include "ref/numeric.h"
#include "ref/quant_ref.h"

namespace moe_ep {
namespace {

std::shared_ptr<Communicator> comm() {
  static const std::shared_ptr<Communicator> c = Communicator::from_mpi(MPI_COMM_WORLD);
  return c;
}
int world_rank() { return comm()->rank(); }
int world_size() { return comm()->size(); }

int64_t esize(DType d) { return d == DType::kF32 ? 4 : 2; }

struct Spec {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t S = 0, Ns = 1;  // shared-expert ranks and shared experts
  int64_t L = 2;          // MoE experts per MoE rank
  int64_t BS = 6, H = 24, K = 3;
  bool smooth = false;  // pass scales
  uint64_t seed = 7;
};

// The global batch (every rank holds all of it); inputs[r] views rank r's part.
struct Batch {
  Spec spec;
  int W = 1;
  int64_t E = 0, K = 0, Ns = 0;  // Ns: hosted shared experts (0 when S = 0)
  std::vector<std::vector<unsigned char>> x;
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> weights;
  std::vector<float> smooth;  // (Ns + E, H)
  std::vector<ref::EpRankInput> inputs;
  ref::EpWorld world;
};

Batch make_batch(const Spec& spec, int W) {
  Batch b;
  b.spec = spec;
  b.W = W;
  b.E = (W - spec.S) * spec.L;
  b.K = std::min(spec.K, b.E);
  b.Ns = spec.S > 0 ? spec.Ns : 0;
  const int64_t H = spec.H, BS = spec.BS, K = b.K, es = esize(spec.dtype);
  test::SplitMix64 rng{spec.seed};
  auto uniform = [&](float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(rng.next() >> 40) / static_cast<float>(1 << 24);
  };
  for (int r = 0; r < W; ++r) {
    b.x.emplace_back(BS * H * es);
    b.ids.emplace_back(BS * K);
    b.weights.emplace_back(BS * K);
    for (int64_t i = 0; i < BS; ++i) {
      // Rows of different magnitudes; token 1 of every rank is all zero (scale 0).
      const float mag = i == 1 ? 0.0f : std::ldexp(1.0f, static_cast<int>(i % 5) * 3 - 6);
      for (int64_t h = 0; h < H; ++h)
        ref::store(spec.dtype, b.x[r].data(), i * H + h, mag * uniform(-2, 2));
      std::vector<int32_t> pool(b.E);
      for (int64_t e = 0; e < b.E; ++e) pool[e] = static_cast<int32_t>(e);
      for (int64_t k = 0; k < K; ++k) std::swap(pool[k], pool[k + rng.below(b.E - k)]);
      for (int64_t k = 0; k < K; ++k) {
        // Token 4 has an inactive entry; token 5 is inactive (no shared copies either).
        const bool off = (i == 4 && k == K - 1 && K > 1) || i == 5;
        b.ids[r][i * K + k] = off ? -1 : pool[k];
        b.weights[r][i * K + k] = uniform(0.125f, 1.5f);
      }
    }
  }
  b.smooth.resize((b.Ns + b.E) * H);
  for (float& s : b.smooth) s = uniform(0.25f, 4.0f);
  for (int r = 0; r < W; ++r) {
    ref::EpRankInput in;
    in.x = TensorView::contiguous(b.x[r].data(), spec.dtype, {BS, H});
    in.expert_ids = TensorView::contiguous(b.ids[r].data(), DType::kI32, {BS, K});
    in.expert_scales = TensorView::contiguous(b.weights[r].data(), DType::kF32, {BS, K});
    b.inputs.push_back(in);
  }
  b.world.E = b.E;
  b.world.S = spec.S;
  b.world.Ns = b.Ns;
  return b;
}

EpConfig config(const Batch& b) {
  EpConfig c;
  c.group_ep = comm().get();
  c.ep_world_size = b.W;
  c.ep_rank_id = world_rank();
  c.moe_expert_num = b.E;
  c.shared_expert_rank_num = b.spec.S;
  c.shared_expert_num = b.spec.Ns;
  return c;
}

DispatchInputs dispatch_inputs(Batch& b, int64_t quant_mode) {
  const ref::EpRankInput& mine = b.inputs[world_rank()];
  DispatchInputs in;
  in.x = mine.x;
  in.expert_ids = mine.expert_ids;
  in.expert_scales = mine.expert_scales;
  in.quant_mode = quant_mode;
  if (b.spec.smooth)
    in.scales = TensorView::contiguous(b.smooth.data(), DType::kF32, {b.Ns + b.E, b.spec.H});
  return in;
}

// The worlds this W allows: no shared-expert ranks; S = 1 (Ns = 1); S = 2 with Ns = 2.
std::vector<Spec> specs() {
  const int W = world_size();
  std::vector<Spec> out;
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32})
    for (bool smooth : {false, true})
      for (int64_t S : {0, 1, 2}) {
        if (S >= W) continue;
        Spec s;
        s.dtype = dt;
        s.smooth = smooth;
        s.S = S;
        s.Ns = S == 2 ? 2 : 1;
        s.name = std::string(dtype_name(dt)) + (smooth ? " smooth" : "") +
                 " S=" + std::to_string(S) + " Ns=" + std::to_string(s.Ns);
        out.push_back(s);
      }
  return out;
}

// Each received row j of the reference layout quantised with ref/quant_ref (smoothing row Ns + e
// for MoE expert e, s for shared expert s): expand_x and dynamic_scales bitwise; beyond the valid
// rows dynamic_scales is zero and expand_x unspecified (SPEC §1.4: only the valid rows are
// meaningful), so there only dynamic_scales is checked.
TEST(DispatchQuant, MatchesReferenceBitwise) {
  for (const Spec& spec : specs()) {
    SCOPED_TRACE(spec.name);
    Batch b = make_batch(spec, world_size());
    const int rank = world_rank();
    const std::vector<ref::EpRankDispatch> want = ref::dispatch_reference(b.inputs, b.world);
    const ref::EpRankDispatch& w = want[rank];
    const DispatchOutputs first = dispatch_v2(dispatch_inputs(b, 2), config(b));
    // A cached dispatch (SPEC §7) with the handle of the first: these outputs, the same bits.
    DispatchInputs cached = dispatch_inputs(b, 2);
    cached.handle = &first.handle;
    const DispatchOutputs out = dispatch_v2(cached, config(b));
    EXPECT_EQ(std::memcmp(out.expand_x.data(), first.expand_x.data(), w.valid * spec.H), 0);
    const int64_t H = spec.H, es = esize(spec.dtype);
    ASSERT_EQ(out.expand_x.dtype(), DType::kI8);
    ASSERT_EQ(out.expand_x.ndim(), 2);
    ASSERT_EQ(out.expand_x.size(0), w.A);
    ASSERT_EQ(out.expand_x.size(1), H);
    ASSERT_TRUE(out.dynamic_scales.defined());
    ASSERT_EQ(out.dynamic_scales.dtype(), DType::kF32);
    ASSERT_EQ(out.dynamic_scales.numel(), w.A);
    // The layout is that of quant_mode 0.
    EXPECT_EQ(test::values<int32_t>(out.ep_recv_counts), w.ep_recv_counts);
    // The first 3 * valid entries of assist_info_for_combine (the rest is unspecified).
    EXPECT_EQ(out.assist_info_for_combine.numel(), static_cast<int64_t>(w.assist_info.size()));
    EXPECT_EQ(test::values<int32_t>(out.assist_info_for_combine, 3 * w.valid),
              test::prefix(w.assist_info, 3 * w.valid));
    EXPECT_EQ(test::values<float>(out.expand_scales), w.expand_scales);
    const int8_t* q = out.expand_x.ptr<int8_t>();
    const float* dyn = out.dynamic_scales.ptr<float>();
    std::vector<int8_t> eq(H);
    int bad = 0;
    for (int64_t j = 0; j < w.A && bad < 5; ++j) {
      float es_scale = 0.0f;
      std::fill(eq.begin(), eq.end(), int8_t{0});
      if (j < w.valid) {
        const int64_t src = w.assist_info[3 * j], tok = w.assist_info[3 * j + 1];
        const int64_t e = w.row_expert[j];
        const float* smooth =
            spec.smooth ? b.smooth.data() + (e >= 0 ? b.Ns + e : -1 - e) * H : nullptr;
        es_scale = ref::quantize_row_int8(spec.dtype, b.x[src].data() + tok * H * es, smooth, H,
                                          eq.data());
      }
      const bool same = (j >= w.valid || std::memcmp(q + j * H, eq.data(), H) == 0) &&
                        std::memcmp(dyn + j, &es_scale, sizeof(float)) == 0;
      if (!same) {
        ++bad;
        ADD_FAILURE() << "rank " << rank << " row " << j << " (valid " << w.valid
                      << "): dynamic_scales " << dyn[j] << " want " << es_scale;
      }
    }
  }
}

// The expert of the tests on a row of fp32 values: fl(v * (1 + e/E)) rounded to `dtype`; shared
// expert s is e = -1 - s (as ref::combine_reference calls it).
float expert_value(int64_t e, int64_t E, float v) {
  return v * (1.0f + static_cast<float>(e) / static_cast<float>(E));
}

// Runs the experts on dispatch's rows: expand_x (x's dtype) or, quantised, fl(q * dyn) in fp32.
Tensor run_experts(const Batch& b, const DispatchOutputs& d, bool quant) {
  const Spec& spec = b.spec;
  const int64_t H = spec.H, rank = world_rank(), W = b.W;
  const int64_t L = rank < spec.S ? 1 : spec.L;
  Tensor y = Tensor::zeros(spec.dtype, {d.expand_x.size(0), H});
  const int32_t* inc = d.ep_recv_counts.ptr<int32_t>();
  int64_t row = 0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t e = rank < spec.S ? -1 - rank / (spec.S / spec.Ns) : (rank - spec.S) * L + l;
    for (; row < inc[l * W + W - 1]; ++row)
      for (int64_t h = 0; h < H; ++h) {
        const float v = quant ? static_cast<float>(d.expand_x.ptr<int8_t>()[row * H + h]) *
                                    d.dynamic_scales.ptr<float>()[row]
                              : ref::load(spec.dtype, d.expand_x.data(), row * H + h);
        ref::store(spec.dtype, y.data(), row * H + h, expert_value(e, b.E, v));
      }
  }
  return y;
}

CombineInputs combine_inputs(Batch& b, const DispatchOutputs& d, const Tensor& y) {
  const ref::EpRankInput& mine = b.inputs[world_rank()];
  CombineInputs in;
  in.expand_x = y;
  in.expert_ids = mine.expert_ids;
  in.assist_info_for_combine = d.assist_info_for_combine;
  in.ep_send_counts = d.ep_recv_counts;
  in.expert_scales = *mine.expert_scales;
  return in;
}

// comm_quant_mode 2 against SPEC §2.3 evaluated with ref/quant_ref on the expert outputs: each
// y_ik quantised (no smoothing), acc += w * fl(q * scale) in k order, then the shared experts.
TEST(DispatchQuant, CombineCommQuantBitwise) {
  for (Spec spec : specs()) {
    if (spec.smooth) continue;
    SCOPED_TRACE(spec.name);
    Batch b = make_batch(spec, world_size());
    const int rank = world_rank();
    const DispatchOutputs d = dispatch_v2(dispatch_inputs(b, 0), config(b));
    const Tensor y = run_experts(b, d, false);
    CombineInputs cin = combine_inputs(b, d, y);
    cin.comm_quant_mode = 2;
    const Tensor out = combine_v2(cin, config(b));
    // With the handle (SPEC §7: no layout round, no per-row metadata; the int8 scales travel on
    // their own): the same bits.
    CombineInputs hin = combine_inputs(b, d, y);
    hin.comm_quant_mode = 2;
    hin.handle = &d.handle;
    hin.assist_info_for_combine = TensorView{};
    hin.ep_send_counts = TensorView{};
    const Tensor out_h = combine_v2(hin, config(b));
    ASSERT_EQ(out_h.nbytes(), out.nbytes());
    EXPECT_EQ(std::memcmp(out_h.data(), out.data(), out.nbytes()), 0)
        << "comm_quant_mode 2 with the handle differs from without";
    const int64_t H = spec.H, K = b.K, es = esize(spec.dtype);
    ASSERT_EQ(out.dtype(), spec.dtype);
    ASSERT_EQ(out.size(0), spec.BS);
    const unsigned char* x = b.x[rank].data();
    std::vector<float> acc(H);
    std::vector<unsigned char> yr(H * es), want(H * es);
    std::vector<int8_t> q(H);
    auto add = [&](int64_t e, int64_t i, float w) {
      for (int64_t h = 0; h < H; ++h)
        ref::store(spec.dtype, yr.data(), h,
                   expert_value(e, b.E, ref::load(spec.dtype, x, i * H + h)));
      const float sc = ref::quantize_row_int8(spec.dtype, yr.data(), nullptr, H, q.data());
      ref::axpy_row_int8(acc.data(), w, q.data(), sc, H);
    };
    for (int64_t i = 0; i < spec.BS; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      bool active = false;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = b.ids[rank][i * K + k];
        if (e < 0) continue;
        active = true;
        add(e, i, b.weights[rank][i * K + k]);
      }
      for (int64_t s = 0; active && s < b.Ns; ++s) add(-1 - s, i, 1.0f);
      for (int64_t h = 0; h < H; ++h) ref::store(spec.dtype, want.data(), h, acc[h]);
      EXPECT_EQ(std::memcmp(out.ptr<unsigned char>() + i * H * es, want.data(), H * es), 0)
          << "rank " << rank << " token " << i;
    }
  }
}

// combine(experts(dispatch(x))) with both quantisations, fp32, against the unquantised reference
// within quant.h's bound: per term, the dispatch error (amax|x_i| / 254 (1 + 2^-14) + 2^-143)
// carried through the expert factor c, plus the combine error of the row it returned, plus the
// usual fp32 rounding of the sum.
TEST(DispatchQuant, EndToEndWithinBound) {
  for (Spec spec : specs()) {
    if (spec.dtype != DType::kF32 || spec.smooth) continue;
    SCOPED_TRACE(spec.name);
    Batch b = make_batch(spec, world_size());
    const int rank = world_rank();
    const DispatchOutputs d = dispatch_v2(dispatch_inputs(b, 2), config(b));
    const Tensor y = run_experts(b, d, true);
    CombineInputs cin = combine_inputs(b, d, y);
    cin.comm_quant_mode = 2;
    const Tensor out = combine_v2(cin, config(b));
    const ref::ExpertFn fn = ref::scale_expert(b.E);
    const auto want = ref::combine_reference(b.inputs, b.world, fn, fn);
    const int64_t H = spec.H, K = b.K;
    const float* got = out.ptr<float>();
    const float* exp = reinterpret_cast<const float*>(want[rank].data());
    const float* x = reinterpret_cast<const float*>(b.x[rank].data());
    for (int64_t i = 0; i < spec.BS; ++i) {
      double amax = 0;
      for (int64_t h = 0; h < H; ++h) amax = std::max(amax, std::fabs(double{x[i * H + h]}));
      double bound = 0, mass = 0;
      auto term = [&](int64_t e, double w) {
        const double c = std::fabs(1.0 + static_cast<double>(e) / static_cast<double>(b.E));
        const double dx = c * ref::quant_error_bound(amax) * (1 + 0x1p-20);
        const double ymax = c * amax + dx;  // the largest |y| the expert returned
        bound += std::fabs(w) * (dx + ref::quant_error_bound(ymax) + 0x1p-22 * ymax);
        mass += std::fabs(w) * ymax;
      };
      bool active = false;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = b.ids[rank][i * K + k];
        if (e < 0) continue;
        active = true;
        term(e, b.weights[rank][i * K + k]);
      }
      for (int64_t s = 0; active && s < b.Ns; ++s) term(-1 - s, 1.0);
      bound += 2 * (K + b.Ns + 1) * 0x1p-24 * mass;  // fp32 accumulation and rounding, both sides
      for (int64_t h = 0; h < H; ++h) {
        const double err = std::fabs(double{got[i * H + h]} - double{exp[i * H + h]});
        EXPECT_LE(err, bound) << "rank " << rank << " token " << i << " h " << h << " got "
                              << got[i * H + h] << " want " << exp[i * H + h];
        if (!active) {
          EXPECT_EQ(got[i * H + h], 0.0f);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Errors: the bad rank throws naming the argument; the others kRemote.

void expect_error(const std::function<void()>& call, int bad, ErrorKind kind,
                  const std::vector<std::string>& needles) {
  test::expect_collective_error(call, world_rank(), bad, kind, needles);
}

Spec error_spec() {
  Spec s;
  s.dtype = DType::kF32;
  s.S = world_size() > 1 ? 1 : 0;
  return s;
}

TEST(DispatchQuant, ScalesWithQuantModeZero) {
  Batch b = make_batch(error_spec(), world_size());
  const int bad = world_size() - 1;
  DispatchInputs in = dispatch_inputs(b, 0);
  if (world_rank() == bad)
    in.scales = TensorView::contiguous(b.smooth.data(), DType::kF32, {b.Ns + b.E, b.spec.H});
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"dispatch_v2: scales", "quant_mode = 0"});
}

TEST(DispatchQuant, ScalesShape) {
  Batch b = make_batch(error_spec(), world_size());
  const int bad = world_size() - 1;
  const int64_t H = b.spec.H, rows = b.Ns + b.E;
  std::vector<float> big((rows + 1) * (H + 1), 1.0f);
  DispatchInputs in = dispatch_inputs(b, 2);
  // S > 0: the Ns shared rows are missing; S = 0: one row too many.
  const int64_t wrong = b.Ns > 0 ? b.E : b.E + 1;
  if (world_rank() == bad) in.scales = TensorView::contiguous(big.data(), DType::kF32, {wrong, H});
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"scales.shape[0] = " + std::to_string(wrong), std::to_string(rows)});
  in = dispatch_inputs(b, 2);
  if (world_rank() == bad)
    in.scales = TensorView::contiguous(big.data(), DType::kF32, {rows, H + 1});
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"scales.shape[1]"});
  in = dispatch_inputs(b, 2);
  if (world_rank() == bad) in.scales = TensorView::contiguous(big.data(), DType::kF32, {rows});
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"scales.ndim"});
  in = dispatch_inputs(b, 2);
  if (world_rank() == bad) {
    TensorView t = TensorView::contiguous(big.data(), DType::kF32, {rows, H});
    t.strides[0] = H + 1;
    in.scales = t;
  }
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"scales must be contiguous"});
}

TEST(DispatchQuant, ScalesDtype) {
  Batch b = make_batch(error_spec(), world_size());
  const int bad = 0;
  std::vector<uint16_t> half((b.Ns + b.E) * b.spec.H);
  DispatchInputs in = dispatch_inputs(b, 2);
  if (world_rank() == bad)
    in.scales = TensorView::contiguous(half.data(), DType::kBF16, {b.Ns + b.E, b.spec.H});
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument, {"scales"});
}

TEST(DispatchQuant, BadModes) {
  Batch b = make_batch(error_spec(), world_size());
  DispatchInputs in = dispatch_inputs(b, 1);
  expect_error([&] { dispatch_v2(in, config(b)); }, -1, ErrorKind::kInvalidArgument,
               {"quant_mode = 1 is not one of {0, 2}"});
  const DispatchOutputs d = dispatch_v2(dispatch_inputs(b, 0), config(b));
  const Tensor y = run_experts(b, d, false);
  CombineInputs cin = combine_inputs(b, d, y);
  cin.comm_quant_mode = 1;
  expect_error([&] { combine_v2(cin, config(b)); }, -1, ErrorKind::kInvalidArgument,
               {"comm_quant_mode = 1 is not one of {0, 2}"});
}

// SPEC §2.1: comm_quant_mode 2 is not allowed with tp_world_size 2. It is an InvalidArgument
// whatever this build supports for TP, so it is reported before any TP check.
TEST(DispatchQuant, CommQuantWithTpTwo) {
  Batch b = make_batch(error_spec(), world_size());
  const DispatchOutputs d = dispatch_v2(dispatch_inputs(b, 0), config(b));
  const Tensor y = run_experts(b, d, false);
  CombineInputs cin = combine_inputs(b, d, y);
  cin.comm_quant_mode = 2;
  EpConfig cfg = config(b);
  cfg.tp_world_size = 2;
  cfg.tp_rank_id = 0;
  cfg.group_tp = comm().get();
  expect_error([&] { combine_v2(cin, cfg); }, -1, ErrorKind::kInvalidArgument,
               {"combine_v2: comm_quant_mode = 2", "tp_world_size = 2"});
  // The communicator is still usable: a normal combine afterwards.
  cin.comm_quant_mode = 0;
  EXPECT_NO_THROW(combine_v2(cin, config(b)));
}

}  // namespace
}  // namespace moe_ep
