#include "run_layer.h"

#include <mpi.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "checks.h"
#include "collective.h"
#include "common.h"
#include "moe_ep/error.h"
#include "rng.h"

namespace moe_ep_tool {

using moe_ep::DType;
using moe_ep::Error;
using moe_ep::ErrorKind;

namespace {

// (count, H) values of const expert tables in dtype: alpha_1 (j = 0), alpha_2 (1), v (2).
std::vector<std::byte> const_table(uint64_t seed, int64_t count, int64_t hidden, int j,
                                   DType dtype) {
  std::vector<std::byte> t(static_cast<size_t>(count * hidden) * moe_ep::dtype_size(dtype));
  for (int64_t q = 0; q < count; ++q) {
    const Counter c(seed, Stream::kConstExpert, static_cast<uint64_t>(3 * q + j));
    for (int64_t h = 0; h < hidden; ++h) {
      moe_ep::store_float(dtype, t.data(), q * hidden + h, c.uniform(h));
    }
  }
  return t;
}

// This rank's generated x_active_mask (SPEC §1.3): 1-D (BS) or 2-D (BS, K) of 0/1.
std::vector<uint8_t> make_mask(const std::string& kind, uint64_t seed, int64_t first, int64_t BS,
                               int64_t K) {
  std::vector<uint8_t> m;
  if (kind == "prefix") {
    const int64_t inactive = (BS + 2) / 4;  // a quarter, rounded
    for (int64_t i = 0; i < BS; ++i) m.push_back(i < BS - inactive ? 1 : 0);
  } else if (kind == "bad-prefix") {
    for (int64_t i = 0; i < BS; ++i) m.push_back(i % 2 == 0 ? 1 : 0);
  } else if (kind == "entries") {
    for (int64_t i = 0; i < BS; ++i) {
      const Counter c(seed, Stream::kActiveMask, static_cast<uint64_t>(first + i));
      for (int64_t k = 0; k < K; ++k) m.push_back(c.unit(static_cast<uint64_t>(k)) >= 0.2 ? 1 : 0);
    }
  }
  return m;
}

// This rank's rows of the loaded file.
void take_file_rows(const Plan& plan, LocalBatch& b) {
  const Batch& file = plan.file;
  const int64_t K = plan.layer.top_k;
  const size_t row_bytes = static_cast<size_t>(plan.layer.hidden) * moe_ep::dtype_size(plan.dtype);
  const int64_t mask_row = plan.mask_dims == 2 ? K : 1;
  b.x.assign(file.x.begin() + static_cast<std::ptrdiff_t>(b.first * row_bytes),
             file.x.begin() + static_cast<std::ptrdiff_t>((b.first + b.BS) * row_bytes));
  std::copy_n(file.expert_ids.begin() + b.first * K, b.BS * K, b.ids.begin());
  std::copy_n(file.expert_scales.begin() + b.first * K, b.BS * K, b.scales.begin());
  if (plan.mask_dims > 0) {
    b.mask.assign(file.x_active_mask.begin() + b.first * mask_row,
                  file.x_active_mask.begin() + (b.first + b.BS) * mask_row);
  }
}

}  // namespace

LocalBatch make_local_batch(const RunOptions& o, Plan& plan, int rank) {
  LocalBatch b;
  const Preset& layer = plan.layer;
  const int64_t H = layer.hidden, K = layer.top_k;
  b.first = plan.first_token(rank);
  b.BS = plan.bs[rank];
  b.ids.resize(static_cast<size_t>(b.BS * K));
  b.scales.resize(static_cast<size_t>(b.BS * K));
  if (plan.loaded()) {
    take_file_rows(plan, b);
    plan.file = Batch{};
  } else {
    b.x = make_tokens(plan.seed, b.first, b.BS, H, plan.dtype);
    Preset router_layer = layer;
    router_layer.experts = layer.experts + plan.Z + plan.C + plan.Q;
    const Router router(router_layer, plan.kind, plan.seed, std::move(plan.real_p));
    const double t0 = now_s();
    router.route(b.first, b.BS, b.x.data(), plan.dtype, b.ids.data(), b.scales.data());
    b.route_s = now_s() - t0;
    b.mask = make_mask(o.mask, plan.seed, b.first, b.BS, K);
  }
  b.alpha_1 = const_table(plan.seed, plan.Q, H, 0, plan.dtype);
  b.alpha_2 = const_table(plan.seed, plan.Q, H, 1, plan.dtype);
  b.const_v = const_table(plan.seed, plan.Q, H, 2, plan.dtype);
  b.slot_ids.resize(b.ids.size());
  plan.redundant.map_rows(b.ids.data(), b.slot_ids.data(), b.first, b.BS, K);
  return b;
}

Layer::Layer(const RunOptions& o, const Plan& plan, const LocalBatch& batch, const Groups& groups)
    : o_(o), plan_(plan), batch_(batch) {
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  ep_rank_ = rank_ / plan.T;
  tp_rank_ = rank_ % plan.T;
  const int64_t BS = batch.BS, H = plan.layer.hidden, K = plan.layer.top_k;
  cfg_.group_ep = groups.ep.get();
  cfg_.ep_world_size = plan.Wep;
  cfg_.ep_rank_id = ep_rank_;
  cfg_.moe_expert_num = plan.layer.experts + plan.R;
  if (plan.T > 1) {
    cfg_.group_tp = groups.tp.get();
    cfg_.tp_world_size = plan.T;
    cfg_.tp_rank_id = tp_rank_;
  }
  cfg_.shared_expert_num = plan.Ns;
  cfg_.shared_expert_rank_num = plan.S;
  cfg_.global_bs = plan.global_bs;
  cfg_.zero_expert_num = plan.Z;
  cfg_.copy_expert_num = plan.C;
  cfg_.const_expert_num = plan.Q;
  cfg_.transport = o.transport;
  cfg_.exact_size = o.exact_size;
  cfg_.comm_alg = o.comm_alg;
  cfg_.partials = o.partials;
  auto view = [](const auto& v, DType dtype, std::initializer_list<int64_t> shape) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    return moe_ep::TensorView::contiguous(const_cast<T*>(v.data()), dtype, shape);
  };
  din_.x = view(batch.x, plan.dtype, {BS, H});
  din_.expert_ids = view(batch.slot_ids, DType::kI32, {BS, K});
  din_.expert_scales = view(batch.scales, DType::kF32, {BS, K});
  if (plan.mask_dims == 1) {
    din_.x_active_mask = view(batch.mask, DType::kBool, {BS});
  } else if (plan.mask_dims == 2) {
    din_.x_active_mask = view(batch.mask, DType::kBool, {BS, K});
  }
  din_.quant_mode = o.quant == "int8" ? 2 : 0;
}

template <typename F>
auto Layer::with_file_rows(F&& op) {
  if (!plan_.loaded()) return op();
  try {
    return op();
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::kRemote) throw;
    throw Error(e.kind(),
                std::string(e.what()) + " " +
                    file_rows_context(e.what(), rank_, batch_.first, batch_.BS, o_.load_routing));
  }
}

moe_ep::DispatchOutputs Layer::dispatch() {
  cfg_.group_ep->reset_traffic();
  auto d = with_file_rows([&] { return moe_ep::dispatch_v2(din_, cfg_); });
  if (dispatch_traffic_.message_bytes.empty()) dispatch_traffic_ = cfg_.group_ep->traffic();
  return d;
}

moe_ep::Tensor Layer::combine(const moe_ep::DispatchOutputs& d) {
  const int64_t BS = batch_.BS, H = plan_.layer.hidden, Q = plan_.Q;
  const DType dtype = plan_.dtype;
  moe_ep::CombineInputs cin = combine_inputs(din_, d, expert_out_, plan_.T > 1);
  if (!shared_x_.empty()) {
    cin.shared_expert_x = moe_ep::TensorView::contiguous(shared_x_.data(), dtype, {BS, H});
  }
  if ((plan_.C > 0 || Q > 0) && !o_.debug_omit_ori_x) cin.ori_x = din_.x;
  if (Q > 0) {
    auto table = [&](const std::vector<std::byte>& t) {
      return moe_ep::TensorView::contiguous(const_cast<std::byte*>(t.data()), dtype, {Q, H});
    };
    cin.const_expert_alpha_1 = table(batch_.alpha_1);
    cin.const_expert_alpha_2 = table(batch_.alpha_2);
    cin.const_expert_v = table(batch_.const_v);
  }
  cin.comm_quant_mode = o_.comm_quant == "int8" ? 2 : 0;
  cfg_.group_ep->reset_traffic();
  auto out = with_file_rows([&] { return moe_ep::combine_v2(cin, cfg_); });
  if (combine_traffic_.message_bytes.empty()) combine_traffic_ = cfg_.group_ep->traffic();
  return out;
}

void Layer::run_experts(const moe_ep::DispatchOutputs& d, PhaseTimes* times) {
  // Row segments of expand_x and their expert (the logical id of a routed slot, or E + s for
  // shared expert s; so a replica computes exactly its expert): this rank's blocks (SPEC §1.4
  // order), then with TP the peer's rows (L = 1: the same expert).
  const Plan& p = plan_;
  const int64_t E = p.layer.experts, H = p.layer.hidden, Wep = p.Wep;
  const bool shared_rank = ep_rank_ < p.S;
  const int64_t per_shared = p.S > 0 ? p.S / p.Ns : 1;
  const int64_t Lr = shared_rank ? 1 : p.L;
  const size_t row_bytes = static_cast<size_t>(H) * moe_ep::dtype_size(p.dtype);
  const int32_t* recv = d.ep_recv_counts.ptr<int32_t>();
  struct Segment {
    int64_t begin, end, expert;
  };
  std::vector<Segment> segments;
  const int64_t own_rows = Wep * Lr > 0 ? recv[Wep * Lr - 1] : 0;
  for (int64_t j = 0; j < Lr; ++j) {
    const int64_t begin = j == 0 ? 0 : recv[j * Wep - 1];
    const int64_t end = recv[(j + 1) * Wep - 1];
    const int64_t expert =
        shared_rank ? E + ep_rank_ / per_shared : p.redundant.logical((ep_rank_ - p.S) * p.L + j);
    segments.push_back({begin, end, expert});
  }
  if (p.T > 1) {
    const int64_t peer_rows = d.tp_recv_counts.ptr<int32_t>()[1 - tp_rank_];
    segments.push_back({own_rows, own_rows + peer_rows, segments.front().expert});
  }
  expert_out_ = moe_ep::Tensor::zeros(p.dtype, {d.expand_x.size(0), H});
  ExpertBank bank(p.fn, p.seed, E, H, p.layer.ffn, tp_rank_, p.T);
  ExpertBank shared_bank(p.fn, p.seed, E, H, p.layer.ffn);
  std::vector<float> deq;
  const double t0 = now_s();
  for (const Segment& sg : segments) {
    const int64_t rows = sg.end - sg.begin;
    if (rows <= 0) continue;
    std::byte* out = static_cast<std::byte*>(expert_out_.data()) + sg.begin * row_bytes;
    if (din_.quant_mode == 2) {
      // The experts read the dequantised rows: fp32(q) * dynamic_scales[row].
      const int8_t* q = d.expand_x.ptr<int8_t>() + sg.begin * H;
      const float* dyn = d.dynamic_scales.ptr<float>() + sg.begin;
      deq.resize(static_cast<size_t>(rows * H));
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < H; ++h) deq[r * H + h] = static_cast<float>(q[r * H + h]) * dyn[r];
      }
      bank.forward(sg.expert, deq.data(), DType::kF32, out, p.dtype, rows);
    } else {
      bank.forward(sg.expert,
                   static_cast<const std::byte*>(d.expand_x.data()) + sg.begin * row_bytes, p.dtype,
                   out, p.dtype, rows);
    }
  }
  if (p.S == 0 && p.Ns > 0) {  // the shared expert on every rank: shared_expert_x
    shared_x_.resize(static_cast<size_t>(batch_.BS) * row_bytes);
    shared_bank.forward(E, batch_.x.data(), p.dtype, shared_x_.data(), p.dtype, batch_.BS);
  }
  times->generate_s = bank.generate_seconds() + shared_bank.generate_seconds();
  times->experts_s = now_s() - t0 - times->generate_s;
}

void Layer::count_received(const moe_ep::DispatchOutputs& d) {
  const int64_t Wep = plan_.Wep, Lr = ep_rank_ < plan_.S ? 1 : plan_.L;
  const int32_t* recv = d.ep_recv_counts.ptr<int32_t>();
  valid_ = Wep * Lr > 0 ? recv[Wep * Lr - 1] : 0;
  if (plan_.T > 1) valid_ += d.tp_recv_counts.ptr<int32_t>()[1 - tp_rank_];
  received_other_ = 0;
  for (int64_t j = 0; j < Lr; ++j) {
    for (int64_t s = 0; s < Wep; ++s) {
      const int64_t b = j * Wep + s;
      if (s != ep_rank_) received_other_ += recv[b] - (b == 0 ? 0 : recv[b - 1]);
    }
  }
}

int64_t Layer::sent_other_rows() const {
  const Plan& p = plan_;
  const int64_t K = p.layer.top_k, E = p.layer.experts;
  const int64_t per_shared = p.S > 0 ? p.S / p.Ns : 1;
  const int64_t mask_row = p.mask_dims == 2 ? K : 1;
  int64_t sent = 0;
  for (int64_t i = 0; i < batch_.BS; ++i) {
    bool any = false;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = batch_.slot_ids[i * K + k];
      const bool active =
          e >= 0 && (p.mask_dims == 0 || batch_.mask[i * mask_row + (p.mask_dims == 2 ? k : 0)]);
      if (!active) continue;
      any = true;
      if (e < E + p.R && p.S + e / p.L != ep_rank_) sent += 1;
    }
    for (int64_t s = 0; any && p.S > 0 && s < p.Ns; ++s) {
      if (ep_rank_ % per_shared + s * per_shared != ep_rank_) sent += 1;
    }
  }
  return sent;
}

moe_ep::Tensor Layer::forward(PhaseTimes* times, Progress& progress) {
  progress.phase("dispatch_v2");
  barrier_idle("the barrier before dispatch_v2");
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = now_s();
  moe_ep::DispatchOutputs d = dispatch();
  times->dispatch_s = now_s() - t0;
  count_received(d);

  progress.phase(std::string("the local experts (") + expert_fn_name(plan_.fn) + ")");
  run_experts(d, times);

  progress.phase("combine_v2");
  barrier_idle("the barrier before combine_v2");
  MPI_Barrier(MPI_COMM_WORLD);
  t0 = now_s();
  moe_ep::Tensor out = combine(d);
  times->combine_s = now_s() - t0;
  return out;
}

void Layer::repeat(int n, std::vector<double>* dispatch_s, std::vector<double>* combine_s) {
  dispatch_s->assign(static_cast<size_t>(n), 0.0);
  combine_s->assign(static_cast<size_t>(n), 0.0);
  for (int i = 0; i < n; ++i) {
    barrier_idle("the barrier before a warm dispatch_v2");
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = now_s();
    const moe_ep::DispatchOutputs d = dispatch();
    (*dispatch_s)[i] = now_s() - t0;
    barrier_idle("the barrier before a warm combine_v2");
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = now_s();
    const moe_ep::Tensor out = combine(d);
    (*combine_s)[i] = now_s() - t0;
  }
}

}  // namespace moe_ep_tool
