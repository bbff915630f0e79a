// dispatch_v2 (SPEC §1) as named steps, on every rank:
//   1. validate:  this rank's arguments, its send plan (who gets which rows) and its outputs,
//                 failures recorded, not thrown (header.h);
//   2. agree:     the TP pair's handshake, then the header agreement; the shared-memory windows
//                 set up or grown, and where each rank of this machine receives its rows;
//   3. counts:    each destination learns how many rows each source sends per local expert (its
//                 receive plan), and each sender where its blocks land in the windows of the
//                 ranks on its machine. Skipped by a cached dispatch (DispatchInputs::handle);
//   4. rows:      every rank writes the rows for ranks on its machine (and itself) straight into
//                 their expand_x and sends the others one message per block (or, when that saves
//                 enough, each distinct token once), with one message of per-row metadata;
//   5. outputs:   assist_info_for_combine, expand_scales, dynamic_scales from the metadata, the
//                 counts from the plan; the TP all-gather (tp.h).
// The links (transport/link.h) carry the rows: a WindowLink to a peer whose window slot this
// rank writes into, a MessageLink otherwise. docs/design.md follows the data through them.
#include "moe_ep/dispatch.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "base/check.h"
#include "base/env.h"
#include "base/numeric.h"
#include "base/tensor_internals.h"
#include "core/ep/async_state.h"
#include "core/ep/config.h"
#include "core/ep/dispatch_call.h"
#include "core/ep/handle.h"
#include "core/ep/header.h"
#include "core/ep/plan.h"
#include "core/ep/slot.h"
#include "core/ep/tp.h"
#include "core/ep/windows.h"
#include "core/validate.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/scatter.h"
#include "transport/communicator.h"
#include "transport/link.h"
#include "transport/tags.h"
#include "transport/windows.h"

namespace moe_ep::detail {

namespace {

// scales (SPEC §1.3): fp32 (Ns + E, H) when shared-expert ranks host Ns experts, else (E, H),
// contiguous; quant_mode 2 only. Row Ns + e smooths MoE expert e, row s shared expert s.
void check_smooth_scales(const char* op, const TensorView& t, const EpShape& sh) {
  expect_tensor(op, "scales", t, {DType::kF32}, 2);
  expect_size(op, "scales", t, 0, sh.pl.Ns + sh.E,
              sh.pl.Ns > 0 ? "shared_expert_num + moe_expert_num" : "moe_expert_num");
  expect_size(op, "scales", t, 1, sh.H, "H, x.shape[1]");
  if ((t.shape[1] > 1 && t.strides[1] != 1) || (t.shape[0] > 1 && t.strides[0] != t.shape[1]))
    invalid(op, ": scales must be contiguous (strides (", t.strides[0], ", ", t.strides[1],
            ") for shape (", t.shape[0], ", ", t.shape[1], "))");
}

// The bytes of contiguous smoothing scales, hashed: with comm_alg "hierarchy" a relay quantises
// the copies it makes with its own scales, so every rank must hold the same (checked after the
// header agreement; one pass over (Ns + E) * H floats).
uint64_t smooth_hash(const TensorView& t) {
  const auto* p = static_cast<const unsigned char*>(t.data);
  const int64_t n = t.shape[0] * t.shape[1] * 4;
  uint64_t h = 0x9e3779b97f4a7c15ull, word = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::memcpy(&word, p + i, 8);
    h = (h ^ word) * 0xff51afd7ed558ccdull;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h | 1;  // never 0 (0: no scales)
}

// Step 1a: the arguments alone (no allocation).
void check_arguments(Dispatch& c) {
  const DispatchInputs& in = c.in;
  const char* op = c.op;
  if (in.caller_error) throw *in.caller_error;
  c.quant = in.quant_mode == 2;
  c.hdr.transport = resolve_transport(op, c.cfg);
  c.stream_min = env_stream_min_bytes(op);
  c.hdr.shm_node_ranks = env_shm_node_ranks(op);
  check_ep_config(op, c.cfg, c.comm.rank(), c.comm.size());
  c.world = resolve_world(op, c.cfg, in.elastic_info);
  c.hdr.elastic = c.world.hash;
  reject_tp_scale_in(op, c.comm, c.cfg, c.world);
  if (in.quant_mode != 0 && in.quant_mode != 2)
    invalid(op, ": quant_mode = ", in.quant_mode, " is not one of {0, 2}");
  if (in.scales && in.quant_mode != 2)
    invalid(op, ": scales (smoothing factors) are given but quant_mode = ", in.quant_mode,
            "; they apply to quant_mode 2 (int8) only");
  if (in.expert_token_nums_type != 0 && in.expert_token_nums_type != 1)
    invalid(op, ": expert_token_nums_type = ", in.expert_token_nums_type, " is not one of {0, 1}");
  c.perf = perf_ptr(op, in.performance_info, c.cfg);
  check_hierarchy_scope(op, c.cfg, in.elastic_info.has_value(), c.perf != nullptr);
  expect_rows(op, "x", in.x);
  EpShape& sh = c.sh;
  sh = local_shape(c.cfg, c.world, in.x.shape[0], in.x.shape[1], in.x.dtype);
  check_expert_ids(op, in.expert_ids, sh.BS, sh.E, sh.pl.special);
  sh.K = in.expert_ids.shape[1];
  sh.KS = sh.K + sh.pl.Ns;
  if (in.x_active_mask) {
    check_active_mask(op, *in.x_active_mask, sh.BS, sh.K);
    c.hdr.all_active = mask_tokens_active(*in.x_active_mask) ? 1 : 0;
  }
  if (in.expert_scales) check_expert_scales(op, *in.expert_scales, sh.BS, sh.K);
  if (in.scales) check_smooth_scales(op, *in.scales, sh);
  if (in.scales && c.cfg.comm_alg == "hierarchy") c.hdr.smooth_hash = smooth_hash(*in.scales);
  if (c.world.removed) return;  // scaled in: no rank of the world (SPEC §1.7)
  c.W = to_int(sh.W), c.L = to_int(sh.L), c.me = to_int(sh.rank);
  c.out_row_bytes = c.quant ? sh.H : sh.H * static_cast<int64_t>(dtype_size(sh.dtype));
  compute_capacity(op, c.cfg.global_bs, sh);
  if (in.handle != nullptr) {
    if (!in.handle->defined()) invalid(op, ": handle is given but not defined (default-made)");
    c.cached = HandleInternals::plan(*in.handle).get();
    check_plan(op, *c.cached, c.cfg, in.expert_ids, in.x_active_mask ? &*in.x_active_mask : nullptr,
               c.hdr.transport, c.world.hash);
    // A plan whose tokens travel once per MPI destination needs rows that are the same for every
    // copy; a plan without such merges suits any call.
    const bool merges = std::any_of(c.cached->distinct.begin(), c.cached->distinct.end(),
                                    [](const auto& u) { return !u.empty(); });
    if (merges && !(sh.H > 0 && !(c.quant && in.scales)))
      invalid(op, ": handle: its dispatch_v2 sent some tokens once per destination, which ",
              sh.H == 0 ? "H = 0 (x.shape[1])"
                        : "quant_mode 2 with smoothing scales (each copy has its own bytes)",
              " does not allow; dispatch without the handle");
    c.hdr.plan = c.cached->id;
  }
}

// An output: the caller's view `given` (DispatchInputs::out) after checking it, or allocated.
// Rows past the valid ones of expand_scales and dynamic_scales are documented as 0: zeroed.
// `at_least` (EpConfig::exact_size, outputs sized by rows): the view may hold more rows than the
// call writes; the output views its first ones.
Tensor output(const char* name, const std::optional<TensorView>* given, DType dtype,
              const std::vector<int64_t>& shape, bool zero, bool at_least = false) {
  if (given == nullptr || !given->has_value()) {
    return zero ? Tensor::zeros(dtype, shape) : Tensor::empty(dtype, shape);
  }
  const TensorView& v = **given;
  const TensorView want = TensorView::contiguous(nullptr, dtype, shape);
  bool same = v.dtype == dtype && v.ndim == want.ndim;
  for (int d = 0; same && d < v.ndim; ++d)
    same = d == 0 && at_least ? v.shape[d] >= want.shape[d] : v.shape[d] == want.shape[d];
  if (!same)
    invalid("dispatch_v2: out.", name, " is ", v.describe(), " but this call writes ",
            want.describe(),
            at_least ? " (exact_size = true: the rows this rank receives; a buffer may hold more)"
                     : " (sizes: dispatch_workspace)");
  expect_memory("dispatch_v2", name, v);
  if (!v.is_contiguous())
    invalid("dispatch_v2: out.", name, " (", v.describe(), ") is not contiguous");
  Tensor t = TensorInternals::view(at_least ? TensorView::contiguous(v.data, dtype, shape) : v);
  if (zero && t.nbytes() > 0) std::memset(t.data(), 0, t.nbytes());
  return t;
}

// expand_x: a window slot (the caller's, when it is one still held; else a new one, or one
// deferred until the window grows), else the caller's memory, else allocated.
void allocate_expand_x(Dispatch& c, DType dtype, int64_t rows) {
  const std::optional<TensorView>* given = c.in.out ? &c.in.out->expand_x : nullptr;
  const bool exact = c.cfg.exact_size;
  if (given && given->has_value()) output("expand_x", given, dtype, {rows, c.sh.H}, false, exact);
  if (c.shm_want) {
    const auto& ctx = CommInternals::shm(c.comm);
    if (ctx && given && given->has_value()) c.slot = ctx->adopt((*given)->data, c.slot_need);
    if (!c.slot && ctx) c.slot = ctx->try_alloc(c.slot_need);
    // No window yet, or Windows::should_grow (one too small, or full within a bound): all
    // ranks of the machine grow it after the agreement. Otherwise: MPI for this call.
    if (!c.slot && (!ctx || ctx->should_grow(c.slot_need))) c.hdr.shm_grow = 1, c.shm_defer = true;
    const bool adopted = c.slot && given && given->has_value() && c.slot->ptr == (*given)->data;
    if (given && given->has_value() && !adopted) {
      if (c.slot || c.shm_defer) {
        c.copy_to = exact ? TensorView::contiguous((*given)->data, dtype, {rows, c.sh.H}) : **given;
      } else {
        c.out.expand_x = output("expand_x", given, dtype, {rows, c.sh.H}, false, exact);
        return;
      }
    }
  }
  if (c.slot)
    c.out.expand_x = TensorInternals::wrap(c.slot->token, c.slot->ptr, dtype, {rows, c.sh.H});
  else if (!c.shm_defer)
    c.out.expand_x = output("expand_x", given, dtype, {rows, c.sh.H}, false, exact);
}

// The caller's buffers (DispatchInputs::out) must not overlap an input or each other: peers
// store into expand_x while this rank still reads x.
void check_buffers(const Dispatch& c) {
  const DispatchInputs& in = c.in;
  const DispatchBuffers& b = *in.out;
  if (b.dynamic_scales && !c.quant)
    invalid(c.op, ": out.dynamic_scales is given but quant_mode = ", in.quant_mode,
            " has no dynamic_scales");
  const std::pair<const char*, const std::optional<TensorView>*> bufs[] = {
      {"expand_x", &b.expand_x},
      {"dynamic_scales", &b.dynamic_scales},
      {"assist_info_for_combine", &b.assist_info_for_combine},
      {"expert_token_nums", &b.expert_token_nums},
      {"ep_recv_counts", &b.ep_recv_counts},
      {"tp_recv_counts", &b.tp_recv_counts},
      {"expand_scales", &b.expand_scales}};
  const std::pair<const char*, const TensorView*> inputs[] = {
      {"x", &in.x},
      {"expert_ids", &in.expert_ids},
      {"expert_scales", in.expert_scales ? &*in.expert_scales : nullptr},
      {"scales", in.scales ? &*in.scales : nullptr},
      {"x_active_mask", in.x_active_mask ? &*in.x_active_mask : nullptr}};
  for (std::size_t i = 0; i < std::size(bufs); ++i) {
    if (!bufs[i].second->has_value()) continue;
    const TensorView& v = **bufs[i].second;
    for (const auto& [name, t] : inputs)
      if (t && overlap(v, *t))
        invalid(c.op, ": out.", bufs[i].first, " shares memory with ", name,
                " (an output must not overlap an input)");
    for (std::size_t j = 0; j < i; ++j)
      if (bufs[j].second->has_value() && overlap(v, **bufs[j].second))
        invalid(c.op, ": out.", bufs[i].first, " shares memory with out.", bufs[j].first);
  }
}

// The outputs whose sizes count rows: expand_x (a window slot, the caller's memory, or
// allocated), dynamic_scales, assist_info_for_combine and expand_scales. `rows`: max(1,T)*A
// (SPEC §1.4), or with EpConfig::exact_size the rows this call receives, known from the counts
// (or the handle's plan).
void allocate_rows(Dispatch& c, int64_t rows) {
  const EpShape& sh = c.sh;
  const bool exact = c.cfg.exact_size;
  const DType out_dtype = c.quant ? DType::kI8 : sh.dtype;
  c.out_rows = rows;
  c.expand_bytes = rows * sh.H * static_cast<int64_t>(dtype_size(out_dtype));
  c.slot_need = dispatch_slot_need(c.expand_bytes, rows);
  allocate_expand_x(c, out_dtype, rows);
  const DispatchBuffers* b = c.in.out;
  if (c.quant)
    c.out.dynamic_scales = output("dynamic_scales", b ? &b->dynamic_scales : nullptr, DType::kF32,
                                  {rows}, true, exact);
  // Only the first 3 * valid entries are written (SPEC §1.4: opaque, only those are read).
  c.out.assist_info_for_combine =
      output("assist_info_for_combine", b ? &b->assist_info_for_combine : nullptr, DType::kI32,
             {exact ? 3 * rows : std::max(sh.BS * sh.K, sh.A * 128)}, false, exact);
  c.out.expand_scales =
      output("expand_scales", b ? &b->expand_scales : nullptr, DType::kF32, {rows}, true, exact);
}

// Step 1b: the send plan and the outputs, allocated before the header exchange, so that an
// allocation failure on one rank is reported to every rank instead of leaving them waiting.
// With EpConfig::exact_size and no handle, the outputs sized by rows wait for the counts
// (agree_on_sizes).
void allocate(Dispatch& c) {
  const EpShape& sh = c.sh;
  if (!c.cached) {
    c.plan = std::make_shared<EpPlan>();
    const Activity act{&c.in.expert_ids, c.in.x_active_mask ? &*c.in.x_active_mask : nullptr};
    c.plan->send = plan_sends(act, sh.pl, sh.rank);
  }
  const SendPlan& send = c.cached ? c.cached->send : c.plan->send;
  const int64_t T = std::max<int64_t>(1, c.cfg.tp_world_size);
  c.shm_want = shm_applies(c.hdr.transport, c.cfg, c.world);
  if (c.in.out) check_buffers(c);
  c.sized_late = c.cfg.exact_size && !c.cached;
  if (!c.sized_late)
    allocate_rows(c, c.cfg.exact_size ? c.cached->recv.valid : tp_rows(c.cfg, sh.A));
  const DispatchBuffers* b = c.in.out;
  if (c.quant) {
    const int64_t n = static_cast<int64_t>(send.order.size());
    // With shm the int8 rows for peers on this machine are written straight into their
    // expand_x; the send buffer is allocated later, only if some peer needs MPI.
    if (!c.shm_want) c.qsend = std::make_shared<Tensor>(Tensor::empty(DType::kI8, {n * sh.H}));
    c.qsend_scale = std::make_shared<std::vector<float>>(static_cast<std::size_t>(n));
  }
  c.out.ep_recv_counts = output("ep_recv_counts", b ? &b->ep_recv_counts : nullptr, DType::kI32,
                                {sh.W * sh.L * T}, false);
  c.out.tp_recv_counts =
      output("tp_recv_counts", b ? &b->tp_recv_counts : nullptr, DType::kI32, {T}, false);
  c.out.expert_token_nums =
      output("expert_token_nums", b ? &b->expert_token_nums : nullptr, DType::kI64, {sh.L}, false);
}

// This rank's slot as its header tells the peers on its machine.
Where slot_where(const Dispatch& c) {
  Where w;
  if (!c.slot) return w;
  w.gen = c.slot->gen;
  w.rows = c.slot->offset;
  w.extra = c.slot->offset + dispatch_meta_offset(c.expand_bytes);
  w.capacity = c.out_rows;
  return w;
}

// Scaled in (SPEC §1.7): this rank takes no part; its outputs are empty.
DispatchOutputs removed_outputs(const Dispatch& c) {
  DispatchOutputs out;
  out.expand_x = Tensor::zeros(c.quant ? DType::kI8 : c.sh.dtype, {0, c.sh.H});
  if (c.quant) out.dynamic_scales = Tensor::zeros(DType::kF32, {0});
  out.assist_info_for_combine = Tensor::zeros(DType::kI32, {0});
  out.expand_scales = Tensor::zeros(DType::kF32, {0});
  out.expert_token_nums = Tensor::zeros(DType::kI64, {0});
  out.ep_recv_counts = Tensor::zeros(DType::kI32, {0});
  out.tp_recv_counts = Tensor::zeros(DType::kI32, {1});
  return out;
}

// expand_x's slot, deferred until the windows grew (shm_defer): there is room now.
void take_deferred_slot(Dispatch& c, Windows& shm) {
  c.slot = shm.try_alloc(c.slot_need);
  MOE_EP_CHECK(c.slot.has_value());
  c.out.expand_x = TensorInternals::wrap(c.slot->token, c.slot->ptr,
                                         c.quant ? DType::kI8 : c.sh.dtype, {c.out_rows, c.sh.H});
}

// Step 2: the agreement; then the route and the windows (a slot deferred until they grew is
// taken). Returns nothing on a rank removed by a scale-in.
std::optional<Dispatch::Agreed> agree(Dispatch& c) {
  if (c.world.removed && !c.local) return std::nullopt;
  if (c.local && c.world.removed) throw *c.local;
  if (tp_pair(c.cfg)) tp_handshake(c.op, c.cfg, c.hdr, c.local, tp_header(c.cfg, c.sh, -1, -1));
  c.hdr.where = slot_where(c);
  Dispatch::Agreed a;
  a.headers =
      agree_on_headers(c.comm, c.world.peers, c.op, c.hdr, c.local ? &*c.local : nullptr, c.perf);
  check_batch_sizes(c.op, a.headers, c.world.peers, c.cfg.global_bs, "x.shape[0]");
  check_quant_modes(c.op, a.headers, c.world.peers, "quant_mode");
  a.where.assign(c.W, Where{});
  const int G = relay_nodes(c.comm, c.op, c.cfg, a.headers[0].shm_node_ranks);
  a.route = G > 0 ? relay_dispatch(G, c.me) : fullmesh_dispatch();
  for (int q = 1; G > 0 && q < c.W; ++q)
    if (a.headers[q].smooth_hash != a.headers[0].smooth_hash)
      invalid(c.op, ": scales (smoothing factors) differ between rank ", c.peers()[0], " and rank ",
              c.peers()[q],
              ": with comm_alg = \"hierarchy\" every rank must pass the same (a relay "
              "quantises the copies it makes with its own)");
  if (c.cached && c.cached->G != G)  // $MOE_EP_SHM_NODE_RANKS changed since (same on all ranks)
    invalid(c.op, ": handle: its dispatch_v2 ran on nodes of ", c.cached->G,
            " ranks (0: one node), this call on nodes of ", G,
            " ($MOE_EP_SHM_NODE_RANKS changed); dispatch without the handle");
  if (!shm_applies(a.headers[0].transport, c.cfg, c.world)) return a;
  MOE_EP_CHECK(c.shm_want);
  a.shm = &ensure_shm(c.comm, c.op, a.headers, c.world.peers, c.slot_need);
  if (c.shm_defer) take_deferred_slot(c, *a.shm);
  a.where = rows_where(c.comm, c.op, *a.shm, a.headers, c.world.peers, c.me, slot_where(c));
  return a;
}

// Step 3a: over plain MPI a token goes to a peer once, however many of its experts live there,
// and the peer copies it to each (docs/design.md, dispatch_v2 step 4), when that sends at most
// 3/4 of the rows; not to peers on this machine (reached through shared memory: one copy
// already), nor when quant_mode 2 with smoothing scales gives each copy its own bytes.
// distinct[d]: the send-order entry of each token's first copy to d, in send order (the order the
// tokens travel in, which the receiver finds again in the metadata); empty where d gets every
// copy. Returns, per destination, the rows on the wire.
std::vector<int32_t> plan_merges(const Dispatch& c) {
  EpPlan& p = *c.plan;
  const EpShape& sh = c.sh;
  p.may_merge = sh.H > 0 && !(c.quant && c.in.scales);
  p.distinct.assign(c.W, {});
  std::vector<int32_t> distinct_count(c.W, 0);
  std::vector<int32_t> seen(p.may_merge ? static_cast<std::size_t>(sh.BS) : 0, -1);
  for (int d = 0; d < c.W; ++d) {
    const int64_t first = p.send.rank_offset[d], n = p.send.rank_offset[d + 1] - first;
    distinct_count[d] = static_cast<int32_t>(n);
    if (!p.may_merge || d == c.me || (c.agreed.shm && c.agreed.shm->node_of(c.peers()[d]) >= 0) ||
        !c.agreed.route->direct(d))
      continue;
    std::vector<int64_t>& u = p.distinct[d];
    for (int64_t j = first; j < first + n; ++j) {
      const int64_t i = p.send.order[j] / sh.KS;
      if (seen[i] != d) seen[i] = d, u.push_back(j);
    }
    if (4 * static_cast<int64_t>(u.size()) > 3 * n) {
      u.clear();  // too little to merge for the receiver's extra copy of every row
      continue;
    }
    distinct_count[d] = static_cast<int32_t>(u.size());
  }
  return distinct_count;
}

// Receiver d's rows must fit its slot (`capacity` rows; -1: not known yet), before any lands.
void check_slot_rows(const Dispatch& c, int d, int64_t rows, int64_t capacity) {
  if (capacity >= 0 && rows > capacity)
    fail(ErrorKind::kInternal, c.op, ": rank ", c.peers()[d], " would receive ", rows,
         " rows in a slot of ", capacity, " (please report this bug)");
}

// The first row, in receiver d's expand_x, of each block this rank sends it, from the counts of
// every source for d's local experts (`counts_of(s, l)`): block (l, me) follows d's blocks of its
// local experts before l (from every source), then the blocks of l from the sources before this
// rank (SPEC §1.4's expert-major order). Also checks that d's rows fit its slot (`capacity`),
// before any row lands past it, and sets `total` to them.
template <class CountsOf>
std::vector<int64_t> rows_at(const Dispatch& c, int d, CountsOf counts_of, int64_t capacity,
                             int64_t& total) {
  const int64_t ld = c.sh.pl.local_experts(d);
  std::vector<int64_t> o(static_cast<std::size_t>(ld), 0);
  int64_t before = 0;  // rows of d's blocks of local experts < l
  for (int64_t l = 0; l < ld; ++l) {
    int64_t at = before;
    for (int s = 0; s < c.W; ++s) {
      const int64_t n = counts_of(s, l);
      if (s < c.me) at += n;
      before += n;
    }
    o[l] = at;
  }
  check_slot_rows(c, d, before, capacity);
  total = before;
  return o;
}

// Step 3b, every rank of the op on this rank's machine: an all-gather of each rank's whole count
// vector. Each sender then knows where its rows go in every receiver's window, and no round of
// offsets follows (docs/performance.md, "Small calls"). Returns the rows each destination receives.
std::vector<int64_t> gather_counts(const Dispatch& c, std::vector<int32_t>& from_source) {
  EpPlan& p = *c.plan;
  const int W = c.W, L = c.L, me = c.me;
  const int64_t T = c.sh.pl.blocks();
  auto shared = std::make_shared<std::vector<int32_t>>(static_cast<std::size_t>(W * T));
  std::copy(p.send.counts.begin(), p.send.counts.end(), shared->data() + me * T);
  {
    Exchange ex(c.comm, c.op, "counts");
    ex.keep_alive(shared);
    for (int q = 0; q < W; ++q) {
      if (q == me) continue;
      ex.irecv_n(shared->data() + q * T, T, c.peers()[q], kTagCounts);
      ex.isend_n(shared->data() + me * T, T, c.peers()[q], kTagCounts);
    }
    ex.wait();
    if (c.perf) ex.add_recv_wait_us(c.perf);
  }
  const int64_t base = c.sh.pl.block_base(me);
  p.distinct_from.assign(W, 0);
  for (int q = 0; q < W; ++q) {
    int64_t rows = 0;
    for (int l = 0; l < L; ++l) rows += from_source[q * L + l] = (*shared)[q * T + base + l];
    MOE_EP_CHECK(rows <= INT32_MAX);
    p.distinct_from[q] = static_cast<int32_t>(rows);  // shared memory: no merged tokens
  }
  p.block_row.assign(W, {});
  std::vector<int64_t> dest_rows(W, -1);
  for (int d = 0; d < W; ++d) {
    const int64_t db = c.sh.pl.block_base(d);
    const int64_t cap = c.agreed.where[d].gen >= 0 ? c.agreed.where[d].capacity : -1;
    p.block_row[d] = rows_at(
        c, d, [&](int s, int64_t l) { return int64_t{(*shared)[s * T + db + l]}; }, cap,
        dest_rows[d]);
  }
  return dest_rows;
}

// Step 3b across machines: rank d learns how many rows each source sends for each of its local
// experts, then how many distinct tokens among them travel by MPI (the entry after them), then
// the route's entries.
void send_counts(const Dispatch& c, const std::vector<int32_t>& distinct_count,
                 std::vector<int32_t>& from_source) {
  EpPlan& p = *c.plan;
  const int W = c.W, L = c.L;
  auto counts_out = std::make_shared<std::vector<int32_t>>();
  // A source's message: L counts, then its distinct tokens, then the route's entries.
  const int extra = 1 + c.agreed.route->count_entries();
  const int64_t per = int64_t{L} + extra;
  auto counts_in = std::make_shared<std::vector<int32_t>>(W * per, 0);
  for (int d = 0; d < W; ++d) {
    const auto* n = p.send.counts.data() + c.sh.pl.block_base(d);
    counts_out->insert(counts_out->end(), n, n + c.sh.pl.local_experts(d));
    counts_out->push_back(distinct_count[d]);
    c.agreed.route->put_counts(c, d, *counts_out);
  }
  {
    Exchange ex(c.comm, c.op, "counts");
    ex.keep_alive(counts_out);
    ex.keep_alive(counts_in);
    for (int q = 0; q < W; ++q)
      ex.irecv_n(counts_in->data() + q * per, per, c.peers()[q], kTagCounts);
    for (int d = 0, at = 0; d < W; ++d) {
      const int n = to_int(c.sh.pl.local_experts(d)) + extra;
      ex.isend_n(counts_out->data() + at, n, c.peers()[d], kTagCounts);
      at += n;
    }
    ex.wait();
    if (c.perf) ex.add_recv_wait_us(c.perf);
  }
  p.distinct_from.assign(W, 0);
  for (int q = 0; q < W; ++q) {
    std::copy_n(counts_in->data() + q * per, L, from_source.data() + int64_t{q} * L);
    p.distinct_from[q] = (*counts_in)[q * per + L];
    c.agreed.route->take_counts(c, q, counts_in->data() + q * per + L + 1);
  }
}

// Step 3c across machines, shared memory: each receiver on this machine tells each sender on it
// where, in its expand_x, that sender's block of each local expert starts (phase "shm offsets"),
// and where the blocks of the sources the route has the sender write start: one run of L entries
// per source (DispatchRoute::block_runs).
void send_block_rows(const Dispatch& c) {
  EpPlan& p = *c.plan;
  const int W = c.W, L = c.L, N = c.agreed.route->block_runs(W), own = c.agreed.route->own_run();
  p.block_row.assign(W, {});
  Exchange ex(c.comm, c.op, "shm offsets");
  std::vector<std::shared_ptr<std::vector<int64_t>>> in_rows(W), out_rows(W);
  for (int q = 0; q < W; ++q) {
    if (c.agreed.shm->node_of(c.peers()[q]) < 0 || q == c.me) continue;
    out_rows[q] = std::make_shared<std::vector<int64_t>>(int64_t{N} * L);
    for (int m = 0; m < N; ++m) {
      const int s = c.agreed.route->block_source(m, q);
      for (int l = 0; l < L; ++l) (*out_rows[q])[m * L + l] = p.recv.block_offset[l * W + s];
    }
    const int64_t lq = c.sh.pl.local_experts(q);
    in_rows[q] = std::make_shared<std::vector<int64_t>>(N * lq);
    ex.keep_alive(out_rows[q]);
    ex.keep_alive(in_rows[q]);
    ex.irecv_n(in_rows[q]->data(), N * lq, c.peers()[q], kTagShmOffsets);
    ex.isend_n(out_rows[q]->data(), N * L, c.peers()[q], kTagShmOffsets);
  }
  ex.wait();
  if (c.perf) ex.add_recv_wait_us(c.perf);
  for (int q = 0; q < W; ++q) {
    if (!in_rows[q]) continue;
    const int64_t lq = c.sh.pl.local_experts(q);
    p.block_row[q].assign(in_rows[q]->begin() + own * lq, in_rows[q]->begin() + (own + 1) * lq);
    c.agreed.route->keep_block_rows(p, q, std::move(*in_rows[q]));
  }
}

// Step 3: the receive plan (and, for a new plan, the merges and where this rank's blocks land).
Dispatch::Counted plan_receives(const Dispatch& c) {
  Dispatch::Counted k;
  k.p = c.cached ? c.cached : c.plan.get();
  if (c.cached) return k;
  EpPlan& p = *c.plan;
  const std::vector<int32_t> distinct_count = plan_merges(c);
  c.agreed.route->plan_sends(c);
  const bool one_node =
      c.agreed.shm != nullptr && std::all_of(c.peers().begin(), c.peers().end(),
                                             [&](int r) { return c.agreed.shm->node_of(r) >= 0; });
  std::vector<int32_t> from_source(static_cast<std::size_t>(c.W * c.L));
  if (one_node)
    k.dest_rows = gather_counts(c, from_source);
  else
    send_counts(c, distinct_count, from_source);
  p.recv = plan_recvs_from_counts(from_source, c.W, c.L);
  MOE_EP_CHECK(p.recv.valid <= c.sh.A);
  for (int q = 0; q < c.W; ++q)
    if (p.distinct_from[q] < 0 || p.distinct_from[q] > p.recv.source_rows[q] ||
        (p.distinct_from[q] == 0 && p.recv.source_rows[q] > 0))
      fail(ErrorKind::kInternal, c.op, ": rank ", c.peers()[q], " announced ", p.distinct_from[q],
           " distinct tokens for its ", p.recv.source_rows[q], " rows (please report this bug)");
  if (c.agreed.shm && !one_node) send_block_rows(c);
  return k;
}

// Step 3d, EpConfig::exact_size without a handle (phase "exact sizes"): the outputs sized by
// rows are allocated now that the counts give this rank's rows, then every rank agrees once more,
// as in step 2: a failure here (memory, or a caller's buffer too small) reaches every rank, and
// the header says where this rank's slot lies, or asks for a window generation (the agreement's
// usual shm_grow). Then the slots are placed as in step 2 and checked against the counts.
void agree_on_sizes(Dispatch& c) {
  c.hdr.where = Where{};
  c.hdr.shm_grow = 0;
  capture(c.hdr, c.local, [&] { allocate_rows(c, c.counted.p->recv.valid); });
  c.hdr.where = slot_where(c);
  const std::vector<OpHeader> headers = agree_on_headers(
      c.comm, c.world.peers, c.op, c.hdr, c.local ? &*c.local : nullptr, c.perf, "exact sizes");
  if (!c.agreed.shm) return;
  c.agreed.shm = &ensure_shm(c.comm, c.op, headers, c.world.peers, c.slot_need);
  if (c.shm_defer) take_deferred_slot(c, *c.agreed.shm);
  c.agreed.where =
      rows_where(c.comm, c.op, *c.agreed.shm, headers, c.world.peers, c.me, slot_where(c));
  for (int d = 0; d < c.W && !c.counted.dest_rows.empty(); ++d)
    check_slot_rows(c, d, c.counted.dest_rows[d],
                    c.agreed.where[d].gen >= 0 ? c.agreed.where[d].capacity : -1);
}

// The link each destination's rows take this call: into its window when it has a slot (a
// receiver without one, its windows full of outputs still held, takes this call by MPI), else
// messages; and from which sources rows land in this rank's window.
Dispatch::RowLinks choose_links(const Dispatch& c) {
  const auto& messages = message_links(c.comm);
  Dispatch::RowLinks k;
  k.to.assign(c.W, nullptr);
  k.window_from.assign(c.W, 0);
  for (int d = 0; d < c.W; ++d) {
    const int g = c.peers()[d];
    const bool window = c.agreed.shm && c.agreed.shm->node_of(g) >= 0;
    if (!c.agreed.route->direct(d)) {  // the route moves its rows
      k.window_from[d] = c.slot.has_value() && c.agreed.route->carrier(d) != c.me;
      continue;
    }
    if (window) k.window_from[d] = c.slot.has_value() && d != c.me;
    if (d == c.me) continue;
    k.to[d] = window && c.agreed.where[d].gen >= 0 ? c.agreed.shm->link(g) : messages[g].get();
    k.any_message_to |= !k.to[d]->addressable();
  }
  return k;
}

// quant_mode 2 (SPEC §1.5): the int8 rows of send-order entries, each smoothed by its expert's
// row of scales (Ns + e for MoE expert e, s for shared expert s). Without scales every copy of a
// token quantises to the same bytes, so rows are queued and each token quantised once for all
// its destinations, in the same pass as their stores (parallel_quantize); with scales each copy
// is quantised on its own, at once.
struct Quantiser {
  const Dispatch& c;
  QuantizeRowsInt8Args args;
  std::vector<int32_t> src_index, smooth_index;
  std::vector<QuantCopy> queued;

  explicit Quantiser(const Dispatch& call) : c(call) {
    if (!c.quant) return;
    const EpShape& sh = c.sh;
    const SendPlan& send = c.send();
    args.op = c.op;
    args.name = "x";
    args.n = sh.H;
    args.dtype = sh.dtype;
    args.src = c.in.x.data;
    args.src_stride = c.in.x.strides[0];
    args.q_stride = sh.H;
    if (!c.in.scales) return;
    const int64_t n = static_cast<int64_t>(send.order.size());
    src_index.resize(static_cast<std::size_t>(n));
    smooth_index.resize(static_cast<std::size_t>(n));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = send.order[j] / sh.KS, k = send.order[j] % sh.KS;
      src_index[j] = static_cast<int32_t>(i);
      smooth_index[j] =
          static_cast<int32_t>(k < sh.K ? sh.pl.Ns + index_at(c.in.expert_ids, i, k) : k - sh.K);
    }
    args.smooth = c.in.scales->ptr<float>();
    args.smooth_stride = sh.H;
  }
  // The int8 rows of send-order entries [first, first + n) to q, their scales to qsend_scale.
  void rows(int64_t first, int64_t n, int8_t* q) {
    if (n == 0) return;
    if (!c.in.scales) {
      for (int64_t r = 0; r < n; ++r) {
        const int64_t i = c.send().order[first + r] / c.sh.KS;
        queue(i, reinterpret_cast<char*>(q) + r * c.sh.H, first + r);
      }
      return;
    }
    QuantizeRowsInt8Args a = args;
    a.rows = n;
    a.src_index = src_index.data() + first;
    a.smooth_index = smooth_index.data() + first;
    a.q = q;
    a.scales = c.qsend_scale->data() + first;
    quantize_rows_int8(a);
  }
  // Token i's row, quantised into dst by flush(); its scale goes to entry j.
  void queue(int64_t i, char* dst, int64_t j) {
    queued.push_back({c.sh.H > 0 ? c.x_row(i) : nullptr, dst, i, j});
  }
  void flush(bool stream) {
    parallel_quantize(queued, c.sh.H, c.sh.dtype, c.qsend_scale->data(), stream);
    queued.clear();
  }
};

// Step 4a, quant_mode 2: the int8 rows for MPI destinations, into the send buffer in send order.
// A merged destination's distinct tokens are quantised to the front of its range, each token's
// scale to its first copy's entry, then to its other copies'.
void quantise_for_messages(const Dispatch& c, Quantiser& qz) {
  const SendPlan& send = c.send();
  const int64_t H = c.sh.H;
  for (int d = 0; d < c.W; ++d) {
    if (!c.links.to[d] || c.links.to[d]->addressable()) continue;
    int8_t* q = c.qsend->ptr<int8_t>() + send.rank_offset[d] * H;
    const std::vector<int64_t>& u = c.counted.p->distinct[d];
    if (u.empty()) {
      qz.rows(send.rank_offset[d], send.rank_offset[d + 1] - send.rank_offset[d], q);
      continue;
    }
    for (std::size_t t = 0; t < u.size(); ++t)
      qz.queue(send.order[u[t]] / c.sh.KS, reinterpret_cast<char*>(q + static_cast<int64_t>(t) * H),
               u[t]);
  }
  qz.flush(false);                  // MPI's send buffer, read at once
  std::vector<int64_t> first_copy;  // [token]: its first copy's entry (d being filled)
  for (int d = 0; d < c.W; ++d) {
    if (!c.links.to[d] || c.links.to[d]->addressable() || c.counted.p->distinct[d].empty())
      continue;
    first_copy.resize(static_cast<std::size_t>(c.sh.BS));
    for (const int64_t j : c.counted.p->distinct[d]) first_copy[send.order[j] / c.sh.KS] = j;
    for (int64_t j = send.rank_offset[d]; j < send.rank_offset[d + 1]; ++j)
      (*c.qsend_scale)[j] = (*c.qsend_scale)[first_copy[send.order[j] / c.sh.KS]];
  }
}

// Step 4b: the receives. From a source through messages: one per non-empty block (l, s), straight
// into place (messages of one sender with one tag arrive in the order sent), or its distinct
// tokens into a buffer of their own, then its metadata; from a source writing into this rank's
// window: its announcement.
void post_receives(const Dispatch& c, Exchange& ex, RowsPhase& rx) {
  const auto& messages = message_links(c.comm);
  const RecvPlan& recv = c.recv();
  for (int s = 0; s < c.W; ++s) {
    if (s == c.me || !c.agreed.route->direct(s)) continue;  // own rows copied into place
    const Link& from = *messages[c.peers()[s]];
    if (c.links.window_from[s]) {
      c.agreed.shm->link(c.peers()[s])->expect_announce(ex, rx.announced->data() + s, kTagMeta);
      continue;
    }
    if (c.counted.p->distinct_from[s] < recv.source_rows[s]) {
      rx.merged_in[s] = std::make_shared<Tensor>(
          Tensor::empty(DType::kI8, {int64_t{c.counted.p->distinct_from[s]} * c.out_row_bytes}));
      ex.keep_alive(rx.merged_in[s]);
      from.get_block(ex, rx.merged_in[s]->data(), c.counted.p->distinct_from[s], rx.row_bytes,
                     kTagRows);
    } else {
      for (int l = 0; l < c.L; ++l) {
        const int64_t b = int64_t{l} * c.W + s;
        if (recv.block_rows[b] > 0)
          from.get_block(ex, c.out.expand_x.ptr<char>() + recv.block_offset[b] * c.out_row_bytes,
                         recv.block_rows[b], rx.row_bytes, kTagRows);
      }
    }
    rx.meta_in[s] = std::make_shared<std::vector<RowMeta>>(recv.source_rows[s]);
    ex.keep_alive(rx.meta_in[s]);
    from.get_block(ex, rx.meta_in[s]->data(), recv.source_rows[s], rx.meta_bytes, kTagMeta);
  }
}

// Step 4c: the rows for message destinations, in send order (qsend's int8 rows, or x's rows
// packed by one parallel copy, so that every message is contiguous), posted as one message per
// non-empty (destination, local expert) run of the send order, in expert order, or one message
// of a merged destination's distinct tokens.
void post_sends(const Dispatch& c, Exchange& ex, const RowsPhase& rx) {
  if (!c.links.any_message_to) return;
  const SendPlan& send = c.send();
  const int64_t rows = static_cast<int64_t>(send.order.size()), rb = c.out_row_bytes;
  std::shared_ptr<Tensor> packed;
  if (c.quant) {
    packed = std::make_shared<Tensor>(
        TensorInternals::wrap(c.qsend, c.qsend->data(), DType::kI8, {rows, c.sh.H}));
  } else {
    packed = std::make_shared<Tensor>(Tensor::empty(c.sh.dtype, {rows, c.sh.H}));
    std::vector<RowCopy> pack;
    for (int d = 0; d < c.W; ++d) {
      if (!c.links.to[d] || c.links.to[d]->addressable()) continue;
      char* to_d = packed->ptr<char>() + send.rank_offset[d] * rb;
      const std::vector<int64_t>& u = c.counted.p->distinct[d];
      for (std::size_t t = 0; t < u.size(); ++t) {  // merged: each distinct token once
        const int64_t i = send.order[u[t]] / c.sh.KS;
        pack.push_back({c.x_row(i), to_d + static_cast<int64_t>(t) * rb, i});
      }
      if (!u.empty()) continue;
      for (int64_t j = send.rank_offset[d]; j < send.rank_offset[d + 1]; ++j)
        pack.push_back({c.x_row(send.order[j] / c.sh.KS), packed->ptr<char>() + j * rb,
                        send.order[j] / c.sh.KS});
    }
    parallel_copy(pack, rb);
  }
  ex.keep_alive(packed);
  for (int d = 0; d < c.W; ++d) {
    if (!c.links.to[d] || c.links.to[d]->addressable()) continue;
    const int64_t first = send.rank_offset[d];
    if (!c.counted.p->distinct[d].empty()) {
      c.links.to[d]->put_block(ex, packed->ptr<char>() + first * rb,
                               static_cast<int64_t>(c.counted.p->distinct[d].size()), rx.row_bytes,
                               kTagRows);
      continue;
    }
    for (int64_t l = 0, j = first; l < c.sh.pl.local_experts(d); ++l) {
      const int64_t n = send.counts[c.sh.pl.block_base(d) + l];
      if (n > 0)
        c.links.to[d]->put_block(ex, packed->ptr<char>() + j * rb, n, rx.row_bytes, kTagRows);
      j += n;
    }
  }
}

// Step 4d: rows this rank writes itself, into the windows of peers on its machine and into its
// own expand_x: each (destination, local expert) run of the send order is contiguous there; rows
// are copied in parallel (the one copy), int8 rows quantised there (once per token without
// smoothing scales). Stores bypass the cache when this rank writes at least stream_min bytes
// ($MOE_EP_STREAM_MIN_BYTES): such a store needs no read of the destination line first and
// evicts nothing, which made large dispatches about 1.6x faster, while below it the rows stay
// in cache for whoever reads them next (docs/performance.md).
void store_in_place(const Dispatch& c, Quantiser& qz) {
  const SendPlan& send = c.send();
  const int64_t rb = c.out_row_bytes;
  std::vector<RowCopy> copies;
  for (int d = 0; d < c.W; ++d) {
    if ((c.links.to[d] && !c.links.to[d]->addressable()) || !c.agreed.route->direct(d)) continue;
    int64_t j = send.rank_offset[d];
    for (int64_t l = 0; l < c.sh.pl.local_experts(d); ++l) {
      const int64_t n = send.counts[c.sh.pl.block_base(d) + l];
      char* dst = c.links.to[d]
                      ? c.links.to[d]->place(
                            static_cast<int>(c.agreed.where[d].gen),
                            c.agreed.where[d].rows + c.counted.p->block_row[d][l] * rb, n * rb)
                      : c.out.expand_x.ptr<char>() + c.recv().block_offset[l * c.W + c.me] * rb;
      if (c.quant) {
        qz.rows(j, n, reinterpret_cast<int8_t*>(dst));
      } else {
        for (int64_t r = 0; r < n; ++r) {
          const int64_t i = send.order[j + r] / c.sh.KS;
          copies.push_back({c.x_row(i), dst + r * rb, i});
        }
      }
      j += n;
    }
    MOE_EP_CHECK(j == send.rank_offset[d + 1]);
  }
  Traffic& traffic = CommInternals::traffic(c.comm);
  for (int d = 0; d < c.W; ++d)
    if (c.links.to[d] && c.links.to[d]->addressable())
      traffic.window_bytes[c.peers()[d]] += (send.rank_offset[d + 1] - send.rank_offset[d]) *
                                            (rb + static_cast<int64_t>(sizeof(RowMeta)));
  parallel_copy(copies, rb, static_cast<int64_t>(copies.size()) * rb >= c.stream_min);
  if (c.quant) qz.flush(static_cast<int64_t>(qz.queued.size()) * c.sh.H >= c.stream_min);
}

// Step 4e: the metadata of every row sent, (token, slot, expert_scale, int8 scale), in send
// order: stored next to the rows in a window, then announced by its count, or sent as one
// message. Shared-expert copies (slot >= K) carry no weight: expand_scales 0.
void send_metadata(const Dispatch& c, Exchange& ex, RowsPhase& rx) {
  const SendPlan& send = c.send();
  const EpShape& sh = c.sh;
  for (int d = 0; d < c.W; ++d) {
    if (!c.agreed.route->direct(d)) continue;  // the route sends its metadata
    const int64_t first = send.rank_offset[d], n = send.rank_offset[d + 1] - first;
    rx.meta_out[d] = std::make_shared<std::vector<RowMeta>>(n);
    ex.keep_alive(rx.meta_out[d]);
    RowMeta* m = rx.meta_out[d]->data();
    for (int64_t j = 0; j < n; ++j) {
      const int64_t flat = send.order[first + j], i = flat / sh.KS, k = flat % sh.KS;
      m[j] = RowMeta{static_cast<int32_t>(i), static_cast<int32_t>(k),
                     c.in.expert_scales && k < sh.K ? float_at(*c.in.expert_scales, i, k) : 0.0f,
                     c.quant ? (*c.qsend_scale)[first + j] : 0.0f};
    }
    if (!c.links.to[d]) continue;
    if (!c.links.to[d]->addressable()) {
      c.links.to[d]->put_block(ex, m, n, rx.meta_bytes, kTagMeta);
      continue;
    }
    for (int64_t l = 0, j = 0; l < sh.pl.local_experts(d); ++l) {  // next to its rows
      const int64_t rows = send.counts[sh.pl.block_base(d) + l];
      const int64_t bytes = rows * static_cast<int64_t>(sizeof(RowMeta));
      if (rows > 0)
        std::memcpy(c.links.to[d]->place(static_cast<int>(c.agreed.where[d].gen),
                                         c.agreed.where[d].extra + c.counted.p->block_row[d][l] *
                                                                       int64_t{sizeof(RowMeta)},
                                         bytes),
                    m + j, static_cast<std::size_t>(bytes));
      j += rows;
    }
    (*rx.announced)[c.W + d] = n;
    c.links.to[d]->announce(ex, rx.announced->data() + c.W + d, kTagMeta);
  }
}

// Step 4g: a merged source's rows, each copied to its place from the source's distinct tokens,
// which came in the order the metadata (in send order) first names them.
void spread_merged(const Dispatch& c, const RowsPhase& rx, int s) {
  const RecvPlan& recv = c.recv();
  std::vector<RowCopy> spread;
  const int64_t bs = c.agreed.headers[s].BS;
  std::vector<int32_t> at(static_cast<std::size_t>(bs), -1);  // [token]: its distinct row, or -1
  int32_t next = 0;
  const RowMeta* m = rx.meta_in[s]->data();
  const char* base = rx.merged_in[s]->ptr<char>();
  for (int l = 0; l < c.L; ++l) {
    const int64_t b = int64_t{l} * c.W + s;
    for (int64_t j = recv.block_offset[b]; j < recv.block_offset[b] + recv.block_rows[b];
         ++j, ++m) {
      if (m->token < 0 || m->token >= bs)
        fail(ErrorKind::kInternal, c.op, ": rank ", c.peers()[s], " sent token ", m->token,
             " of its ", bs, " (please report this bug)");
      int32_t& t = at[static_cast<std::size_t>(m->token)];
      if (t < 0) t = next++;
      spread.push_back({base + int64_t{t} * c.out_row_bytes,
                        c.out.expand_x.ptr<char>() + j * c.out_row_bytes, t});
    }
  }
  if (next != c.counted.p->distinct_from[s])
    fail(ErrorKind::kInternal, c.op, ": rank ", c.peers()[s], " sent ",
         c.counted.p->distinct_from[s], " distinct tokens, its rows' metadata names ", next,
         " (please report this bug)");
  parallel_copy(spread, c.out_row_bytes,
                static_cast<int64_t>(spread.size()) * c.out_row_bytes >= c.stream_min);
}

// Step 4h: assist_info_for_combine, expand_scales and dynamic_scales of every row received from
// source s, from its metadata: in this rank's window for a source that wrote there, else its
// message (this rank's own: what it built), in the source's send order.
void fill_row_info(const Dispatch& c, const RowsPhase& rx, int s) {
  const RecvPlan& recv = c.recv();
  int32_t* assist = c.out.assist_info_for_combine.ptr<int32_t>();
  float* scales = c.out.expand_scales.ptr<float>();
  float* dyn = c.quant ? c.out.dynamic_scales.ptr<float>() : nullptr;
  const auto* window_meta =
      c.slot ? reinterpret_cast<const RowMeta*>(static_cast<char*>(c.slot->ptr) +
                                                dispatch_meta_offset(c.expand_bytes))
             : nullptr;
  const RowMeta* next = c.links.window_from[s] ? nullptr
                        : s == c.me            ? rx.meta_out[s]->data()
                                               : rx.meta_in[s]->data();
  for (int l = 0; l < c.L; ++l) {
    const int64_t b = int64_t{l} * c.W + s;
    const RowMeta* m = c.links.window_from[s] ? window_meta + recv.block_offset[b] : next;
    if (!c.links.window_from[s]) next += recv.block_rows[b];
    for (int64_t j = recv.block_offset[b]; j < recv.block_offset[b] + recv.block_rows[b];
         ++j, ++m) {
      assist[3 * j] = s;
      assist[3 * j + 1] = m->token;
      assist[3 * j + 2] = m->slot;
      scales[j] = m->scale;
      if (dyn) dyn[j] = m->qscale;
    }
  }
}

// Per-source completion (an asynchronous dispatch whose rows land in expand_x itself): each
// source's rows are finished (announced window rows checked, merged rows spread, row info filled)
// as soon as the last receive from its carrier (DispatchRoute::carrier: the source, or the relay
// that brings them) completes, and handed to the caller (PendingDispatch::wait_source) while later
// sources are still in flight. This rank's own rows, and those it relays to itself, are in place
// before the wait. The bytes are those of the path below.
void land_each_source(const Dispatch& c, Exchange& ex, RowsPhase& rx) {
  const RecvPlan& recv = c.recv();
  const DispatchRoute& route = *c.agreed.route;
  std::vector<int> source_of(static_cast<std::size_t>(c.comm.size()), -1);
  std::vector<std::vector<int>> carried(static_cast<std::size_t>(c.W));
  for (int s = 0; s < c.W; ++s) {
    source_of[static_cast<std::size_t>(c.peers()[s])] = s;
    carried[route.carrier(s)].push_back(s);
  }
  auto land = [&](int s) {
    if (c.links.window_from[s] && route.direct(s)) {
      c.agreed.shm->link(c.peers()[s])->acquire();
      check_announced(c, s, (*rx.announced)[s], recv.source_rows[s], "");
    }
    if (rx.merged_in[s]) spread_merged(c, rx, s);
    fill_row_info(c, rx, s);
    SourceRows rows;
    rows.source = s;
    for (int l = 0; l < c.L; ++l) {
      rows.offsets.push_back(recv.block_offset[int64_t{l} * c.W + s]);
      rows.rows.push_back(recv.block_rows[int64_t{l} * c.W + s]);
    }
    rows.expand_x = c.out.expand_x;
    rows.dynamic_scales = c.out.dynamic_scales;
    rows.expand_scales = c.out.expand_scales;
    rows.assist_info_for_combine = c.out.assist_info_for_combine;
    c.async->source_ready(std::move(rows));
  };
  auto land_carried = [&](int q) {
    if (q != c.me) route.check_carried(c, rx, q);
    for (const int s : carried[q]) land(s);
  };
  for (int q = 0; q < c.W; ++q)  // this rank included: it receives nothing from itself
    if (ex.receives_from(c.peers()[q]) == 0) land_carried(q);
  ex.wait([&](int peer) { land_carried(source_of[static_cast<std::size_t>(peer)]); });
  if (c.perf) ex.add_recv_wait_us(c.perf);
}

// Step 4, quant_mode 2: the int8 rows' send buffer, when some destination takes messages and
// allocate() left it to this step (with shared memory most rows are quantised in place).
void allocate_send_buffer(Dispatch& c) {
  if (c.quant && c.links.any_message_to && !c.qsend)
    c.qsend = std::make_shared<Tensor>(
        Tensor::empty(DType::kI8, {static_cast<int64_t>(c.send().order.size()) * c.sh.H}));
}

// Step 4: the rows phase. With shared memory the sender writes the rows and their metadata
// itself, then sends their count, which announces them (a message of 8 bytes instead of 16 per
// row: such a message of a few thousand rows went through MPI's rendezvous, which stalled about
// 0.25 ms in half the calls).
void move_rows(const Dispatch& c) {
  Quantiser qz(c);
  if (c.quant) quantise_for_messages(c, qz);
  c.agreed.route->before_rows(c);
  Exchange ex(c.comm, c.op, "rows");
  ex.keep_alive(std::make_shared<Tensor>(c.out.expand_x));
  if (c.qsend) ex.keep_alive(c.qsend);
  RowsPhase rx(c);
  ex.keep_alive(rx.announced);
  post_receives(c, ex, rx);
  c.agreed.route->post_receives(c, ex, rx);
  post_sends(c, ex, rx);
  c.agreed.route->post_sends(c, ex, rx);
  store_in_place(c, qz);
  send_metadata(c, ex, rx);
  if (c.async && !c.copy_to) {
    land_each_source(c, ex, rx);
    return;
  }
  ex.wait();
  if (c.perf) ex.add_recv_wait_us(c.perf);
  for (int s = 0; s < c.W; ++s) {
    if (!c.links.window_from[s] || !c.agreed.route->direct(s)) continue;
    c.agreed.shm->link(c.peers()[s])
        ->acquire();  // the peer's rows and metadata, announced, are visible
    check_announced(c, s, (*rx.announced)[s], c.recv().source_rows[s], "");
  }
  for (int q = 0; q < c.W; ++q)
    if (q != c.me) c.agreed.route->check_carried(c, rx, q);
  for (int s = 0; s < c.W; ++s) {
    if (rx.merged_in[s]) spread_merged(c, rx, s);
    fill_row_info(c, rx, s);
  }
}

// Step 5: the counts of the plan, the TP all-gather (SPEC §1.1 step 3), the caller's expand_x,
// the handle.
void finish(Dispatch& c) {
  const RecvPlan& recv = c.recv();
  std::copy(recv.inclusive.begin(), recv.inclusive.end(), c.out.ep_recv_counts.ptr<int32_t>());
  int64_t running = 0;
  for (int l = 0; l < c.L; ++l) {
    int64_t rows = 0;
    for (int s = 0; s < c.W; ++s) rows += recv.block_rows[l * c.W + s];
    running += rows;
    c.out.expert_token_nums.ptr<int64_t>()[l] = c.in.expert_token_nums_type == 0 ? running : rows;
  }
  c.out.tp_recv_counts.ptr<int32_t>()[0] = static_cast<int32_t>(recv.valid);
  if (c.cfg.tp_world_size == 2) tp_all_gather(c.op, c.cfg, c.sh, recv.valid, c.out);
  if (c.copy_to) {  // shared memory only, so no TP rows
    Tensor to = TensorInternals::view(*c.copy_to);
    if (recv.valid > 0 && c.out_row_bytes > 0)  // H = 0: to's data may be null
      std::memcpy(to.data(), c.out.expand_x.data(),
                  static_cast<std::size_t>(recv.valid * c.out_row_bytes));
    c.out.expand_x = to;
  }
  if (c.cached) {
    c.out.handle = *c.in.handle;
    return;
  }
  EpPlan& p = *c.plan;
  p.comm_serial = CommInternals::serial(c.comm);
  p.tp_serial = c.cfg.group_tp ? CommInternals::serial(*c.cfg.group_tp) : 0;
  p.cfg = c.cfg;
  p.world_hash = c.world.hash;
  p.quant_mode = c.in.quant_mode;
  p.elastic = c.in.elastic_info.has_value();
  if (c.cfg.tp_world_size == 2)
    p.tp_peer_rows = c.out.tp_recv_counts.ptr<int32_t>()[1 - c.cfg.tp_rank_id];
  p.transport = c.agreed.headers[0].transport;
  p.sh = c.sh;
  p.G = c.agreed.route->ranks_per_node();
  keep_routing(p, c.in.expert_ids, c.in.x_active_mask ? &*c.in.x_active_mask : nullptr);
  c.out.handle = HandleInternals::make(c.plan);
}

}  // namespace

void check_announced(const Dispatch& c, int s, int64_t announced, int64_t counted,
                     const char* what) {
  if (announced != counted)
    fail(ErrorKind::kInternal, c.op, ": rank ", c.peers()[s], " announced ", announced, what,
         " rows in shared memory, the counts said ", counted, " (please report this bug)");
}

namespace {

// Fullmesh: every rank reached directly; nothing beyond the steps above.
class FullmeshDispatch final : public DispatchRoute {
 public:
  int ranks_per_node() const override { return 0; }
  bool direct(int) const override { return true; }
  void plan_sends(const Dispatch&) const override {}
  int count_entries() const override { return 0; }
  void put_counts(const Dispatch&, int, std::vector<int32_t>&) const override {}
  void take_counts(const Dispatch&, int, const int32_t*) const override {}
  int block_runs(int) const override { return 1; }
  int block_source(int, int q) const override { return q; }
  int own_run() const override { return 0; }
  void keep_block_rows(EpPlan&, int, std::vector<int64_t>&&) const override {}
  void before_rows(const Dispatch&) override {}
  void post_receives(const Dispatch&, Exchange&, RowsPhase&) const override {}
  void post_sends(const Dispatch&, Exchange&, RowsPhase&) override {}
  int carrier(int s) const override { return s; }
  void check_carried(const Dispatch&, const RowsPhase&, int) const override {}
};

}  // namespace

std::unique_ptr<DispatchRoute> fullmesh_dispatch() { return std::make_unique<FullmeshDispatch>(); }

}  // namespace moe_ep::detail

namespace moe_ep {

DispatchBuffers buffers_of(const DispatchOutputs& o) {
  DispatchBuffers b;
  auto view = [](const Tensor& t) {
    return t.defined() ? std::optional<TensorView>(t.view()) : std::nullopt;
  };
  b.expand_x = view(o.expand_x);
  b.dynamic_scales = view(o.dynamic_scales);
  b.assist_info_for_combine = view(o.assist_info_for_combine);
  b.expert_token_nums = view(o.expert_token_nums);
  b.ep_recv_counts = view(o.ep_recv_counts);
  b.tp_recv_counts = view(o.tp_recv_counts);
  b.expand_scales = view(o.expand_scales);
  return b;
}

namespace detail {

DispatchOutputs run_dispatch(const DispatchInputs& in, const EpConfig& cfg, const char* op,
                             int32_t code, AsyncState* async) {
  Dispatch c(in, cfg, require_comm(op, cfg));
  c.op = op;
  c.async = async;
  const uint64_t id = next_plan_id(c.comm);
  c.hdr = base_header(code, cfg, in.x, in.x, in.expert_ids, in.quant_mode);
  capture(c.hdr, c.local, [&] {
    check_arguments(c);
    if (!c.world.removed) allocate(c);
  });
  std::optional<Dispatch::Agreed> agreed = agree(c);
  if (!agreed) return removed_outputs(c);
  c.agreed = std::move(*agreed);
  c.counted = plan_receives(c);
  if (c.plan) c.plan->id = id;
  if (c.sized_late) agree_on_sizes(c);
  c.links = choose_links(c);
  allocate_send_buffer(c);
  move_rows(c);
  finish(c);
  return std::move(c.out);
}

}  // namespace detail

DispatchOutputs dispatch_v2(const DispatchInputs& in, const EpConfig& cfg) {
  detail::wait_for_started_ops(cfg);
  return detail::run_dispatch(in, cfg, "dispatch_v2", detail::kOpDispatch);
}

}  // namespace moe_ep
