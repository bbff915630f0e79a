// dispatch_v2_backward and combine_v2_backward (SPEC §6): each is the other forward op's route over
// the forward's plan (SPEC §7). dispatch_v2_backward is combine_v2's route with unit weights;
// combine_v2_backward is a cached dispatch of grad_out, then per row the scaled gradient and the
// dot product with y, then one fp32 per row back to its source.
#include "moe_ep/backward.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "base/check.h"
#include "base/numeric.h"
#include "base/parallel.h"
#include "base/threads.h"
#include "core/ep/async_state.h"
#include "core/ep/combine_call.h"
#include "core/ep/config.h"
#include "core/ep/dispatch_call.h"
#include "core/ep/handle.h"
#include "core/ep/header.h"
#include "core/ep/tp.h"
#include "core/validate.h"
#include "kernels/cpu/convert.h"
#include "transport/exchange.h"
#include "transport/tags.h"

namespace moe_ep {

namespace detail {
namespace {

constexpr const char* kDispatchBackward = "dispatch_v2_backward";
constexpr const char* kCombineBackward = "combine_v2_backward";

// The plan of the forward (checks shared by both ops). kInvalidArgument without a defined handle;
// kUnsupported for what the backward does not cover.
const EpPlan& forward_plan(const char* op, const DispatchHandle* handle, const EpConfig& cfg) {
  if (handle == nullptr)
    invalid(op, ": handle is required (the DispatchHandle dispatch_v2 returned): the backward ",
            "moves rows along the forward's layout");
  if (!handle->defined())
    invalid(op, ": handle is not defined (default-made, or of a rank removed by a scale-in)");
  const EpPlan& plan = *HandleInternals::plan(*handle);
  if (plan.quant_mode == 2)
    unsupported(op, ": the handle's dispatch_v2 had quant_mode = 2: its int8 rows have no ",
                "gradient (SPEC §6)");
  if (plan.elastic)
    unsupported(op, ": the handle's dispatch_v2 had elastic_info; the backward ops do not ",
                "support a scale-in");
  (void)cfg;  // checked against the plan by the collective step
  return plan;
}

// Rows of a backward input: (rows >= the forward's valid rows, with tp_world_size 2 its own and
// its TP peer's, H), a float dtype.
void check_grad_rows(const char* op, const char* name, const TensorView& t, const EpPlan& plan) {
  expect_rows(op, name, t);
  const int64_t rows = plan.recv.valid + plan.tp_peer_rows;
  if (t.shape[0] < rows)
    invalid(op, ": ", name, ".shape[0] = ", t.shape[0],
            " is less than the valid rows of the handle's dispatch_v2, ", rows,
            plan.tp_peer_rows > 0 ? " (this rank's and its TP peer's)" : "");
}

// Runs `check`; its error, if any, for the caller_error of the collective call that follows.
template <typename Check>
std::optional<Error> local_error(const std::optional<Error>& caller, Check&& check) {
  if (caller) return caller;
  try {
    check();
  } catch (const Error& e) {
    return e;
  }
  return std::nullopt;
}

// ---- combine_v2_backward ------------------------------------------------------------------

struct CombineBackward {
  const CombineBackwardInputs& in;
  const EpConfig& cfg;
  const EpPlan* plan = nullptr;
  int64_t BS = 0, K = 0, H = 0, E = 0, Z = 0, C = 0, Q = 0;
  DType dtype = DType::kBF16;
  const TensorView* mask() const { return in.x_active_mask ? &*in.x_active_mask : nullptr; }
};

// Everything checked before the collective dispatch of grad_out, so that a bad argument on one
// rank reaches the others through its agreement.
void check_combine_backward(CombineBackward& b) {
  const char* op = kCombineBackward;
  const CombineBackwardInputs& in = b.in;
  b.plan = &forward_plan(op, in.handle, b.cfg);
  check_grad_rows(op, "expand_x", in.expand_x, *b.plan);
  expect_rows(op, "grad_out", in.grad_out);
  expect_ndim(op, "expert_ids", in.expert_ids, 2);
  b.BS = in.expert_ids.shape[0], b.K = in.expert_ids.shape[1], b.H = in.expand_x.shape[1];
  b.dtype = in.expand_x.dtype;
  expect_dtype(op, "grad_out", in.grad_out, {b.dtype});
  expect_size(op, "grad_out", in.grad_out, 0, b.BS, "BS, expert_ids.shape[0]");
  expect_size(op, "grad_out", in.grad_out, 1, b.H, "H, expand_x.shape[1]");
  check_expert_scales(op, in.expert_scales, b.BS, b.K);
  b.E = b.cfg.moe_expert_num, b.Z = b.cfg.zero_expert_num, b.C = b.cfg.copy_expert_num;
  b.Q = b.cfg.const_expert_num;
  if ((b.C > 0 || b.Q > 0) && !in.ori_x)
    invalid(op, ": ori_x is required when ",
            b.C > 0 ? "copy_expert_num = " : "const_expert_num = ", b.C > 0 ? b.C : b.Q, " > 0");
  auto rows_like = [&](const char* name, const TensorView& t, int64_t rows, const char* what) {
    expect_rows(op, name, t);
    expect_dtype(op, name, t, {b.dtype});
    expect_size(op, name, t, 0, rows, what);
    expect_size(op, name, t, 1, b.H, "H, expand_x.shape[1]");
  };
  if (in.ori_x) rows_like("ori_x", *in.ori_x, b.BS, "BS, expert_ids.shape[0]");
  const std::pair<const char*, const std::optional<TensorView>*> consts[] = {
      {"const_expert_alpha_1", &in.const_expert_alpha_1},
      {"const_expert_alpha_2", &in.const_expert_alpha_2},
      {"const_expert_v", &in.const_expert_v}};
  for (const auto& [name, t] : consts) {
    if (b.Q > 0 && !t->has_value())
      invalid(op, ": ", name, " is required when const_expert_num = ", b.Q, " > 0");
    if (t->has_value()) rows_like(name, **t, b.Q, "const_expert_num");
  }
}

// The y rows of this rank's own dispatch rows: expand_x's, or with tp_world_size 2 the pair's sums
// (SPEC §2: rs_out, the rows combine_v2 weighted), formed by the same reduce-scatter.
std::shared_ptr<Tensor> tp_sums(const CombineBackward& b, const DispatchOutputs& g) {
  if (b.cfg.tp_world_size != 2) return nullptr;
  const int32_t* tp = g.tp_recv_counts.ptr<int32_t>();
  const int64_t own = tp[b.cfg.tp_rank_id], peer = tp[1 - b.cfg.tp_rank_id];
  // The rows were checked against the plan before the dispatch step (check_grad_rows).
  MOE_EP_CHECK(b.in.expand_x.shape[0] >= own + peer);
  CombineInputs ci;
  ci.expand_x = b.in.expand_x;
  EpShape sh;
  sh.dtype = b.dtype;
  sh.H = b.H;
  return tp_reduce_scatter(kCombineBackward, b.cfg, ci, sh, own, peer);
}

// The owner's part: grad_expand_x rows from the dispatched grad_out rows `g` (rne(w * g) on a MoE
// rank, g on a shared-expert rank; with tp_world_size 2 the TP peer's rows too) and, per row of
// this rank's own dispatch, dot(g, y) for its source. Rows past the valid ones are 0.
Tensor owner_rows(const CombineBackward& b, const DispatchOutputs& g, std::vector<float>& dots) {
  const int32_t* tp = g.tp_recv_counts.ptr<int32_t>();
  const int64_t R = b.in.expand_x.shape[0], own = b.plan->recv.valid, H = b.H;
  const int64_t valid = b.cfg.tp_world_size == 2 ? int64_t{tp[0]} + tp[1] : own;
  const std::shared_ptr<Tensor> sums = tp_sums(b, g);
  const TensorView ys = sums ? sums->view() : b.in.expand_x;
  const bool shared_rank = b.cfg.ep_rank_id < b.cfg.shared_expert_rank_num;
  const int64_t row_bytes = H * static_cast<int64_t>(dtype_size(b.dtype));
  Tensor out = Tensor::empty(b.dtype, {R, H});
  dots.assign(static_cast<std::size_t>(own), 0.0f);
  const char* grows = g.expand_x.ptr<char>();
  const float* w = g.expand_scales.ptr<float>();
  char* orows = out.ptr<char>();
  parallel(threads_if(valid * H > (1 << 16)), [&] {
#pragma omp for schedule(static)
    for (int64_t j = 0; j < valid; ++j) {
      void* dst = orows + j * row_bytes;
      const char* grow = grows + j * row_bytes;
      if (shared_rank) {
        if (row_bytes > 0) std::memcpy(dst, grow, static_cast<std::size_t>(row_bytes));
        continue;
      }
      // The TP peer's rows: the gradient only (their dots are the peer's).
      float discard = 0;
      const void* y = row_ptr(j < own ? ys : b.in.expand_x, j < own ? j : 0);
      scale_dot_rows_f32(j < own ? &dots[static_cast<std::size_t>(j)] : &discard, &dst, b.dtype,
                         grow, b.dtype, &w[j], &y, b.dtype, 1, H);
    }
  });
  if (R > valid && row_bytes > 0)  // H = 0: no row has memory
    std::memset(orows + valid * row_bytes, 0, static_cast<std::size_t>((R - valid) * row_bytes));
  return out;
}

// Phase "scale grads": each owner sends each source the dot products of its rows, block by block
// (local expert, then the source's entry order: the source's send order to this rank), and each
// source scatters them to grad_expert_scales[i, k] (shared-expert copies have no weight).
void return_dots(const CombineBackward& b, const Communicator& comm, const std::vector<float>& dots,
                 float* grad_scales) {
  const EpPlan& p = *b.plan;
  const int W = comm.size(), me = comm.rank();
  const int64_t L = p.sh.L, KS = p.send.KS;
  Exchange ex(comm, kCombineBackward, "scale grads");
  std::vector<std::shared_ptr<std::vector<float>>> out(static_cast<std::size_t>(W)),
      back(static_cast<std::size_t>(W));
  for (int s = 0; s < W; ++s) {  // as an owner: the rows of source s, in block order
    auto& v = out[s] = std::make_shared<std::vector<float>>();
    for (int64_t l = 0; l < L; ++l) {
      const int64_t blk = l * W + s, first = p.recv.block_offset[blk];
      v->insert(v->end(), dots.begin() + first, dots.begin() + first + p.recv.block_rows[blk]);
    }
    MOE_EP_CHECK(static_cast<int64_t>(v->size()) == p.recv.source_rows[s]);
    ex.keep_alive(v);
    if (s != me && !v->empty()) ex.isend_n(v->data(), v->size(), s, kTagScaleGrads);
  }
  for (int d = 0; d < W; ++d) {  // as a source: the entries it sent rank d
    const int64_t n = p.send.rank_offset[d + 1] - p.send.rank_offset[d];
    if (d == me) {
      back[d] = out[d];
    } else {
      back[d] = std::make_shared<std::vector<float>>(static_cast<std::size_t>(n));
      ex.keep_alive(back[d]);
      if (n > 0) ex.irecv_n(back[d]->data(), n, d, kTagScaleGrads);
    }
  }
  ex.wait();
  for (int d = 0; d < W; ++d) {
    const int64_t first = p.send.rank_offset[d], n = p.send.rank_offset[d + 1] - first;
    MOE_EP_CHECK(static_cast<int64_t>(back[d]->size()) == n);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t flat = p.send.order[first + j], slot = flat % KS;
      if (slot < b.K) grad_scales[flat / KS * b.K + slot] = (*back[d])[j];
    }
  }
}

// Const expert q's value for token i, as combine_v2 forms it (SPEC §2.2) in fp32.
void const_value(const CombineBackward& b, int64_t i, int64_t q, float* c) {
  const CombineBackwardInputs& in = b.in;
  const char* ox = row_ptr(*in.ori_x, i);
  const char* a1 = row_ptr(*in.const_expert_alpha_1, q);
  const char* a2 = row_ptr(*in.const_expert_alpha_2, q);
  const char* v = row_ptr(*in.const_expert_v, q);
  for (int64_t h = 0; h < b.H; ++h) {
    const float t1 = load_f32(a1, b.dtype, h) * load_f32(ox, b.dtype, h);
    const float t2 = load_f32(a2, b.dtype, h) * load_f32(v, b.dtype, h);
    c[h] = t1 + t2;
  }
}

// The source's own part: the special experts' weights' gradients, grad_shared_expert_x,
// grad_ori_x and the const tables' gradients (SPEC §6), token by token in (token, k) order.
void source_grads(const CombineBackward& b, CombineBackwardOutputs& o) {
  const CombineBackwardInputs& in = b.in;
  const int64_t BS = b.BS, K = b.K, H = b.H, E = b.E, Z = b.Z, C = b.C, Q = b.Q;
  const Activity act{&in.expert_ids, b.mask()};
  const bool specials = C > 0 || Q > 0;
  if (in.shared_expert_x) o.grad_shared_expert_x = Tensor::zeros(b.dtype, {BS, H});
  if (specials) o.grad_ori_x = Tensor::empty(b.dtype, {BS, H});
  std::vector<float> a1(static_cast<std::size_t>(Q * H)), a2(a1.size()), vv(a1.size());
  std::vector<float> g(static_cast<std::size_t>(H)), acc(g.size()), c(g.size());
  float* gs = o.grad_expert_scales.ptr<float>();
  const int64_t row_bytes = H * static_cast<int64_t>(dtype_size(b.dtype));
  for (int64_t i = 0; i < BS; ++i) {
    const bool active = act.token(i);
    if (in.shared_expert_x && active && row_bytes > 0)  // H = 0: grad_out's data may be null
      std::memcpy(o.grad_shared_expert_x.ptr<char>() + i * row_bytes, row_ptr(in.grad_out, i),
                  static_cast<std::size_t>(row_bytes));
    if (!specials) continue;
    std::fill(acc.begin(), acc.end(), 0.0f);
    load_row_f32(g.data(), row_ptr(in.grad_out, i), b.dtype, H);
    for (int64_t k = 0; active && k < K; ++k) {
      if (!act.entry(i, k)) continue;
      const int64_t e = index_at(in.expert_ids, i, k);
      if (e < E + Z) continue;  // a MoE expert (its dot came back) or a zero expert
      const float w = float_at(in.expert_scales, i, k);
      if (e < E + Z + C) {  // copy expert: y = ori_x[i]
        gs[i * K + k] = dot_row_f32(g.data(), row_ptr(*in.ori_x, i), b.dtype, H);
        for (int64_t h = 0; h < H; ++h) acc[h] += w * g[h];
        continue;
      }
      const int64_t q = e - (E + Z + C);
      const_value(b, i, q, c.data());
      gs[i * K + k] = dot_row_f32(g.data(), c.data(), DType::kF32, H);
      const char* ox = row_ptr(*in.ori_x, i);
      const char* ra1 = row_ptr(*in.const_expert_alpha_1, q);
      const char* ra2 = row_ptr(*in.const_expert_alpha_2, q);
      const char* rv = row_ptr(*in.const_expert_v, q);
      for (int64_t h = 0; h < H; ++h) {
        const float wa = w * load_f32(ra1, b.dtype, h);
        acc[h] += wa * g[h];
        const float t = w * g[h];
        a1[q * H + h] += t * load_f32(ox, b.dtype, h);
        a2[q * H + h] += t * load_f32(rv, b.dtype, h);
        vv[q * H + h] += t * load_f32(ra2, b.dtype, h);
      }
    }
    store_row_f32(o.grad_ori_x.ptr<char>() + i * row_bytes, b.dtype, acc.data(), H);
  }
  if (Q == 0) return;
  auto table = [&](const std::vector<float>& v) {
    Tensor t = Tensor::empty(b.dtype, {Q, H});
    for (int64_t q = 0; q < Q; ++q)
      store_row_f32(t.ptr<char>() + q * row_bytes, b.dtype, v.data() + q * H, H);
    return t;
  };
  o.grad_const_expert_alpha_1 = table(a1);
  o.grad_const_expert_alpha_2 = table(a2);
  o.grad_const_expert_v = table(vv);
}

}  // namespace
}  // namespace detail

namespace {

Tensor run_dispatch_backward(const DispatchBackwardInputs& in, const EpConfig& cfg) {
  using namespace detail;
  const char* op = kDispatchBackward;
  CombineInputs ci;
  ci.caller_error = local_error(in.caller_error, [&] {
    check_grad_rows(op, "grad_expand_x", in.grad_expand_x, forward_plan(op, in.handle, cfg));
  });
  ci.expand_x = in.grad_expand_x;
  ci.expert_ids = in.expert_ids;
  ci.x_active_mask = in.x_active_mask;
  ci.handle = in.handle;
  // Unit weights: fl(1 * y) == y, so the sum is that of the rows.
  const TensorView& ids = in.expert_ids;
  const int64_t BS = ids.ndim == 2 ? std::max<int64_t>(0, ids.shape[0]) : 0;
  const int64_t K = ids.ndim == 2 ? std::max<int64_t>(0, ids.shape[1]) : 0;
  Tensor ones = Tensor::empty(DType::kF32, {BS, K});
  std::fill(ones.ptr<float>(), ones.ptr<float>() + BS * K, 1.0f);
  ci.expert_scales = ones.view();
  return run_combine(ci, cfg, op, kOpDispatchBackward, true);
}

CombineBackwardOutputs run_combine_backward(const CombineBackwardInputs& in, const EpConfig& cfg) {
  using namespace detail;
  CombineBackward b{in, cfg};
  DispatchInputs di;
  di.caller_error = local_error(in.caller_error, [&] { check_combine_backward(b); });
  di.x = in.grad_out;
  di.expert_ids = in.expert_ids;
  di.expert_scales = in.expert_scales;
  di.x_active_mask = in.x_active_mask;
  di.handle = in.handle;
  const DispatchOutputs g = run_dispatch(di, cfg, kCombineBackward, kOpCombineBackward);
  CombineBackwardOutputs o;
  std::vector<float> dots;
  o.grad_expand_x = owner_rows(b, g, dots);
  o.grad_expert_scales = Tensor::zeros(DType::kF32, {b.BS, b.K});
  return_dots(b, *cfg.group_ep, dots, o.grad_expert_scales.ptr<float>());
  source_grads(b, o);
  return o;
}

}  // namespace

Tensor dispatch_v2_backward(const DispatchBackwardInputs& in, const EpConfig& cfg) {
  detail::wait_for_started_ops(cfg);
  return run_dispatch_backward(in, cfg);
}

CombineBackwardOutputs combine_v2_backward(const CombineBackwardInputs& in, const EpConfig& cfg) {
  detail::wait_for_started_ops(cfg);
  return run_combine_backward(in, cfg);
}

}  // namespace moe_ep
