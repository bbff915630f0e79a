// combine_v2 (SPEC §2), the way back of dispatch_v2, as named steps, on every rank:
//   1. validate:  this rank's arguments; its blocks (what it holds for each source) and its send
//                 plan (what comes back to it), from the DispatchHandle, or else from
//                 ep_send_counts and expert_ids; outputs allocated;
//   2. provide:   as the owner of expert outputs: with comm_quant_mode 2 the rows quantised, and
//                 with shared memory the rows published where the peers of this machine read
//                 them (expand_x itself when it lies in this rank's window, else a staging copy);
//                 the TP reduce-scatter first (tp.h);
//   3. agree:     the header agreement, which also tells the peers of this machine where each
//                 rank's rows lie;
//   4. layout:    without a handle only (phase "layout back"): each owner tells each source how
//                 many rows it holds for it per block and where they start, so no receive is ever
//                 shorter than its message and a disagreement with expert_ids is an error;
//   5. rows:      the owners send each source one message per block (and, without a handle,
//                 each row's (token, slot, expert) to check it); sources on the owner's machine
//                 read the rows where they lie instead;
//   6. sum:       SPEC §2.3's weighted sum (combine_sum.h), then phase "shm done".
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
#include "core/ep/combine_call.h"
#include "core/ep/combine_sum.h"
#include "core/ep/config.h"
#include "core/ep/handle.h"
#include "core/ep/header.h"
#include "core/ep/plan.h"
#include "core/ep/slot.h"
#include "core/ep/tp.h"
#include "core/ep/windows.h"
#include "core/validate.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/scatter.h"
#include "moe_ep/dispatch.h"
#include "transport/communicator.h"
#include "transport/link.h"
#include "transport/tags.h"
#include "transport/windows.h"

namespace moe_ep::detail {

namespace {

// A (rows, H) tensor of expand_x's dtype: ori_x, const_expert_alpha_1/2, const_expert_v.
void check_rows_like(const char* op, const char* name, const TensorView& t, int64_t rows,
                     const char* rows_what, const EpShape& sh) {
  expect_rows(op, name, t);
  expect_dtype(op, name, t, {sh.dtype});
  expect_size(op, name, t, 0, rows, rows_what);
  expect_size(op, name, t, 1, sh.H, "H, expand_x.shape[1]");
}

void check_shared_expert_x(const char* op, const TensorView& t, const EpShape& sh) {
  expect_dtype(op, "shared_expert_x", t, {sh.dtype});
  if (t.ndim != 2 && t.ndim != 3)
    invalid(op, ": shared_expert_x.ndim = ", t.ndim, " must be 2 (BS, H) or 3 (a, b, H)");
  expect_memory(op, "shared_expert_x", t);
  const int last = t.ndim - 1;
  expect_size(op, "shared_expert_x", t, last, sh.H, "H, expand_x.shape[1]");
  const int64_t rows = t.ndim == 2 ? t.shape[0] : t.shape[0] * t.shape[1];
  if (rows != sh.BS)
    invalid(op, ": shared_expert_x has ", rows, " rows (",
            t.ndim == 2 ? "shape[0]" : "shape[0] * shape[1]", ") but BS = ", sh.BS,
            " (expert_ids.shape[0])");
  if (sh.H > 1 && t.strides[last] != 1)
    unsupported(op, ": shared_expert_x.stride(", last, ") = ", t.strides[last],
                " is not 1 (rows may be strided, each row must be contiguous)");
}

// Step 1a: the tensors of the weighted sum (SPEC §2.1, §2.2).
void check_sum_inputs(Combine& c) {
  const CombineInputs& in = c.in;
  const char* op = c.op;
  const int64_t C = c.unit_terms ? 0 : c.cfg.copy_expert_num,
                Q = c.unit_terms ? 0 : c.cfg.const_expert_num;
  check_expert_scales(op, in.expert_scales, c.sh.BS, c.sh.K);
  if (in.shared_expert_x) check_shared_expert_x(op, *in.shared_expert_x, c.sh);
  if ((C > 0 || Q > 0) && !in.ori_x)
    invalid(op, ": ori_x is required when ",
            C > 0 ? "copy_expert_num = " : "const_expert_num = ", C > 0 ? C : Q, " > 0");
  if (in.ori_x) check_rows_like(op, "ori_x", *in.ori_x, c.sh.BS, "BS, expert_ids.shape[0]", c.sh);
  const std::pair<const char*, const std::optional<TensorView>*> consts[] = {
      {"const_expert_alpha_1", &in.const_expert_alpha_1},
      {"const_expert_alpha_2", &in.const_expert_alpha_2},
      {"const_expert_v", &in.const_expert_v}};
  for (const auto& [name, t] : consts) {
    if (Q > 0 && !t->has_value())
      invalid(op, ": ", name, " is required when const_expert_num = ", Q, " > 0");
    if (t->has_value()) check_rows_like(op, name, **t, Q, "const_expert_num", c.sh);
  }
}

// Step 1b without a handle: this rank's blocks from ep_send_counts (and tp_send_counts), checked
// against assist_info_for_combine; what comes back to it from expert_ids.
void plan_from_tensors(Combine& c) {
  const char* op = c.op;
  const EpShape& sh = c.sh;
  c.own_blocks = combine_blocks(op, c.cfg, c.in, sh, c.tp_peer_rows);
  c.blocks = &c.own_blocks;
  if (c.blocks->valid > sh.A)
    invalid(op, ": ep_send_counts[", sh.W * sh.L - 1, "] = ", c.blocks->valid,
            " exceeds the receive capacity A = ", sh.A, " of this rank");
  const TensorView& ai = c.in.assist_info_for_combine;
  expect_tensor(op, "assist_info_for_combine", ai, {DType::kI32}, 1);
  if (c.cfg.exact_size) {  // 3 * valid entries are read
    if (ai.shape[0] < 3 * c.blocks->valid)
      invalid(op, ": assist_info_for_combine.shape[0] = ", ai.shape[0],
              " is less than 3 * the valid rows = 3 * ", c.blocks->valid, " = ",
              3 * c.blocks->valid, " (exact_size = true; dispatch_v2's output)");
  } else if (const int64_t ai_size = std::max(sh.BS * sh.K, sh.A * 128); ai.shape[0] != ai_size) {
    invalid(op, ": assist_info_for_combine.shape[0] = ", ai.shape[0], " must equal ",
            "max(BS * K, A * 128) = ", ai_size,
            " (dispatch_v2's output; with exact_size = true it has 3 * the valid rows: pass "
            "exact_size = true to combine_v2 as well)");
  }
  // The layout says which source each row goes back to; assist_info must agree.
  for (int64_t b = 0; b < sh.W * sh.L; ++b)
    for (int64_t j = c.blocks->block_offset[b];
         j < c.blocks->block_offset[b] + c.blocks->block_rows[b]; ++j)
      if (index_at(ai, 3 * j) != b % sh.W)
        invalid(op, ": assist_info_for_combine[", 3 * j, "] = ", index_at(ai, 3 * j),
                " (the source rank of row ", j, ") does not match ep_send_counts, which puts row ",
                j, " in a block of source rank ", b % sh.W);
  c.own_back = plan_sends(Activity{&c.in.expert_ids, c.mask}, sh.pl, sh.rank);
  c.back = &c.own_back;
}

// expand_x must hold the valid rows (TP: this rank's, then its peer's).
void check_rows(const Combine& c, int64_t rows) {
  if (c.in.expand_x.shape[0] < rows)
    invalid(c.op, ": expand_x.shape[0] = ", c.in.expand_x.shape[0],
            " is less than the valid rows of the handle's dispatch_v2, ", rows);
}

// Step 1b with a handle: the plan dispatch_v2 made.
void plan_from_handle(Combine& c) {
  if (!c.in.handle->defined()) invalid(c.op, ": handle is given but not defined (default-made)");
  c.plan = HandleInternals::plan(*c.in.handle).get();
  check_plan(c.op, *c.plan, c.cfg, c.in.expert_ids, c.mask, c.hdr.transport, c.world.hash);
  c.blocks = &c.plan->recv;
  c.back = &c.plan->send;
  // With TP the peer's rows come from the TP handshake (the peer's group may route anew).
  c.tp_peer_rows = c.cfg.tp_world_size == 2 ? -1 : 0;
  check_rows(c, c.blocks->valid);
  c.hdr.plan = c.plan->id;
}

// Step 1: the arguments alone, then the plan.
void check_arguments(Combine& c) {
  const CombineInputs& in = c.in;
  const char* op = c.op;
  if (in.caller_error) throw *in.caller_error;
  c.cq = in.comm_quant_mode == 2;
  c.mask = in.x_active_mask ? &*in.x_active_mask : nullptr;
  c.hdr.transport = resolve_transport(op, c.cfg);
  c.hdr.shm_node_ranks = env_shm_node_ranks(op);
  // Checked first: never valid (SPEC §2.1), whatever else this build supports.
  if (in.comm_quant_mode != 0 && in.comm_quant_mode != 2)
    invalid(op, ": comm_quant_mode = ", in.comm_quant_mode, " is not one of {0, 2}");
  if (in.comm_quant_mode == 2 && c.cfg.tp_world_size == 2)
    invalid(op, ": comm_quant_mode = 2 (int8) is not allowed with tp_world_size = 2");
  check_ep_config(op, c.cfg, c.comm.rank(), c.comm.size());
  c.world = resolve_world(op, c.cfg, in.elastic_info);
  c.hdr.elastic = c.world.hash;
  reject_tp_scale_in(op, c.comm, c.cfg, c.world);
  reject_given(op, {{"tp_send_counts", in.tp_send_counts.has_value() && c.cfg.tp_world_size != 2}});
  c.perf = perf_ptr(op, in.performance_info, c.cfg);
  check_hierarchy_scope(op, c.cfg, in.elastic_info.has_value(), c.perf != nullptr);
  expect_rows(op, "expand_x", in.expand_x);
  expect_ndim(op, "expert_ids", in.expert_ids, 2);
  EpShape& sh = c.sh;
  sh = local_shape(c.cfg, c.world, in.expert_ids.shape[0], in.expand_x.shape[1], in.expand_x.dtype);
  check_expert_ids(op, in.expert_ids, sh.BS, sh.E, sh.pl.special);
  sh.K = in.expert_ids.shape[1];
  sh.KS = sh.K + sh.pl.Ns;
  if (c.mask) {
    check_active_mask(op, *c.mask, sh.BS, sh.K);
    c.hdr.all_active = mask_tokens_active(*c.mask) ? 1 : 0;
  }
  check_sum_inputs(c);
  // combine_v2's partials only: dispatch_v2_backward's gradients keep fp32 partials (SPEC §6).
  if (c.cfg.comm_alg == "hierarchy" && c.cfg.partials == "bf16" && !c.unit_terms) {
    c.partials = DType::kBF16;
    if (c.partials != sh.dtype)
      invalid(op, ": partials = \"bf16\" needs bf16 expand_x, got ", dtype_name(sh.dtype),
              " (use \"fp32\")");
  }
  if (c.world.removed) return;  // scaled in: no rank of the world (SPEC §1.7)
  c.W = to_int(sh.W), c.L = to_int(sh.L), c.me = to_int(sh.rank);
  compute_capacity(op, c.cfg.global_bs, sh);
  if (in.handle)
    plan_from_handle(c);
  else
    plan_from_tensors(c);
  if (in.expand_scales) expect_tensor(op, "expand_scales", *in.expand_scales, {DType::kF32}, 1);
}

// The caller's output (CombineInputs::out): (BS, H), expand_x's dtype, contiguous.
void check_out(const Combine& c) {
  const TensorView& v = *c.in.out;
  if (v.dtype != c.sh.dtype || v.ndim != 2 || v.shape[0] != c.sh.BS || v.shape[1] != c.sh.H)
    invalid(c.op, ": out is ", v.describe(), " but this call writes ",
            TensorView::contiguous(nullptr, c.sh.dtype, {c.sh.BS, c.sh.H}).describe(),
            " (BS, H) of expand_x's dtype");
  expect_memory(c.op, "out", v);
  if (!v.is_contiguous()) invalid(c.op, ": out (", v.describe(), ") is not contiguous");
  // Peers may still read expand_x, and the sum reads the rest, while out is written.
  const CombineInputs& in = c.in;
  const std::pair<const char*, const TensorView*> inputs[] = {
      {"expand_x", &in.expand_x},
      {"expert_ids", &in.expert_ids},
      {"expert_scales", &in.expert_scales},
      {"x_active_mask", in.x_active_mask ? &*in.x_active_mask : nullptr},
      {"shared_expert_x", in.shared_expert_x ? &*in.shared_expert_x : nullptr},
      {"ori_x", in.ori_x ? &*in.ori_x : nullptr},
      {"const_expert_alpha_1", in.const_expert_alpha_1 ? &*in.const_expert_alpha_1 : nullptr},
      {"const_expert_alpha_2", in.const_expert_alpha_2 ? &*in.const_expert_alpha_2 : nullptr},
      {"const_expert_v", in.const_expert_v ? &*in.const_expert_v : nullptr}};
  for (const auto& [name, t] : inputs)
    if (t && overlap(v, *t))
      invalid(c.op, ": out shares memory with ", name, " (the output must not overlap an input)");
}

// Step 1c: what the call holds, allocated before the header exchange (see dispatch.cc). With
// shared memory: whether peers can read expand_x where it lies, else a staging slot.
void allocate(Combine& c) {
  const EpShape& sh = c.sh;
  const int64_t valid = c.blocks->valid;
  c.row_bytes = sh.H * static_cast<int64_t>(dtype_size(sh.dtype));
  c.wire_row = c.cq ? sh.H : c.row_bytes;
  c.shm_want = shm_applies(c.hdr.transport, c.cfg, c.world);
  if (c.shm_want) {
    const auto& ctx = CommInternals::shm(c.comm);
    const int64_t esz = static_cast<int64_t>(dtype_size(sh.dtype));
    const int64_t extent =
        valid == 0 ? 0 : (valid - 1) * c.in.expand_x.strides[0] * esz + sh.H * esz;
    c.in_place =
        !c.cq && valid > 0 && ctx && ctx->locate(c.in.expand_x.data, extent, c.in_gen, c.in_off);
    if (!c.in_place && valid > 0) {
      c.stage_bytes = stage_need(valid, c.wire_row, c.cq);
      if (ctx) c.stage = ctx->try_alloc(c.stage_bytes);
      if (!c.stage && (!ctx || ctx->should_grow(c.stage_bytes)))
        c.hdr.shm_grow = 1, c.stage_defer = true;  // as dispatch_v2's slot
    }
  }
  if (c.cq && !c.stage && !c.stage_defer) {
    c.qback = std::make_shared<Tensor>(Tensor::empty(DType::kI8, {valid * sh.H}));
    c.qback_scale = std::make_shared<std::vector<float>>(static_cast<std::size_t>(valid));
  }
  if (c.in.out) {
    check_out(c);
    c.out = TensorInternals::view(*c.in.out);
  } else {
    c.out = Tensor::empty(sh.dtype, {sh.BS, sh.H});
  }
}

// Step 2: the rows this rank sends back, ready where its readers find them: with comm_quant_mode
// 2 quantised (SPEC §1.5 rounding, no smoothing) in row order, into the staging slot or qback;
// without, copied once into the staging slot when expand_x is not in the window. Then where they
// lie (this rank's Where); the stores are fenced before the header that announces them.
Where provide_rows(Combine& c) {
  const int64_t valid = c.blocks->valid;
  if (c.stage) {
    char* s = static_cast<char*>(c.stage->ptr);
    if (c.cq) {
      c.qrows = reinterpret_cast<int8_t*>(s);
      c.qscales = reinterpret_cast<float*>(s + stage_scales_offset(valid, c.wire_row));
    }
  } else if (c.cq && c.qback) {
    c.qrows = c.qback->ptr<int8_t>();
    c.qscales = c.qback_scale->data();
  }
  if (c.cq && c.qrows) {
    QuantizeRowsInt8Args qa;
    qa.op = c.op;
    qa.name = "expand_x";
    qa.rows = valid;
    qa.n = c.sh.H;
    qa.dtype = c.sh.dtype;
    qa.src = c.in.expand_x.data;
    qa.src_stride = c.in.expand_x.strides[0];
    qa.q = c.qrows;
    qa.q_stride = c.sh.H;
    qa.scales = c.qscales;
    quantize_rows_int8(qa);
  } else if (c.stage) {
    std::vector<RowCopy> copies(static_cast<std::size_t>(valid));
    for (int64_t j = 0; j < valid; ++j)
      copies[j] = {row_ptr(c.rows_src(), j), static_cast<char*>(c.stage->ptr) + j * c.row_bytes, j};
    parallel_copy(copies, c.row_bytes);
  }
  Where w;
  if (c.in_place) {
    w.gen = c.in_gen, w.rows = c.in_off, w.stride = c.src_stride();
  } else if (c.stage) {
    w.gen = c.stage->gen, w.rows = c.stage->offset, w.stride = c.wire_row;
    w.extra = c.stage->offset + stage_scales_offset(valid, c.wire_row);
  }
  if (const auto& ctx = CommInternals::shm(c.comm); ctx && w.gen >= 0) ctx->sync();
  return w;
}

// Step 3: the TP reduce-scatter and handshake, the agreement, the route and the windows (a
// staging slot deferred until they grew is taken). Returns nothing on a rank removed by a
// scale-in.
std::optional<Combine::Agreed> agree(Combine& c) {
  if (c.local && c.world.removed) throw *c.local;
  if (c.world.removed) return std::nullopt;
  if (tp_pair(c.cfg)) {
    // SPEC §2: rs_out = ReduceScatterV_TP(expand_x), before the EP header agreement so that a
    // failure within the pair reaches both EP groups.
    const int64_t own = c.blocks ? c.blocks->valid : 0;  // 0 when validation failed before
    const int64_t peer =
        tp_handshake(c.op, c.cfg, c.hdr, c.local, tp_header(c.cfg, c.sh, own, c.tp_peer_rows));
    if (!c.local && c.plan)
      capture(c.hdr, c.local, [&] {
        c.tp_peer_rows = peer;
        check_rows(c, own + peer);
        if (peer > c.sh.A)
          invalid(c.op, ": the TP peer has ", peer,
                  " rows, more than the receive capacity A = ", c.sh.A);
      });
    if (!c.local)
      capture(c.hdr, c.local, [&] {
        c.rs_out = tp_reduce_scatter(c.op, c.cfg, c.in, c.sh, c.blocks->valid, c.tp_peer_rows);
      });
  }
  Where mine;
  if (!c.local) capture(c.hdr, c.local, [&] { mine = provide_rows(c); });
  c.hdr.where = mine;
  Combine::Agreed a;
  a.headers =
      agree_on_headers(c.comm, c.world.peers, c.op, c.hdr, c.local ? &*c.local : nullptr, c.perf);
  check_batch_sizes(c.op, a.headers, c.world.peers, c.cfg.global_bs, "expert_ids.shape[0]");
  check_quant_modes(c.op, a.headers, c.world.peers, "comm_quant_mode");
  a.where.assign(c.W, Where{});
  a.provide.assign(c.W, 0);
  a.read.assign(c.W, 0);
  const int G = relay_nodes(c.comm, c.op, c.cfg, a.headers[0].shm_node_ranks);
  a.route = G > 0 ? relay_combine(G, c.me) : fullmesh_combine();
  if (c.plan && c.plan->G != G)  // $MOE_EP_SHM_NODE_RANKS changed since (same on all ranks)
    invalid(c.op, ": handle: its dispatch_v2 ran on nodes of ", c.plan->G,
            " ranks (0: one node), this call on nodes of ", G,
            " ($MOE_EP_SHM_NODE_RANKS changed); combine with the tensors instead");
  if (!shm_applies(a.headers[0].transport, c.cfg, c.world)) return a;
  MOE_EP_CHECK(c.shm_want);
  a.shm = &ensure_shm(c.comm, c.op, a.headers, c.world.peers, c.stage_bytes);
  if (c.stage_defer) {
    c.stage = a.shm->try_alloc(c.stage_bytes);
    MOE_EP_CHECK(c.stage.has_value());
    mine = provide_rows(c);
  }
  a.where = rows_where(c.comm, c.op, *a.shm, a.headers, c.world.peers, c.me, mine);
  for (int q = 0; q < c.W; ++q) {
    if (q == c.me || a.shm->node_of(c.peers()[q]) < 0) continue;
    a.provide[q] = a.where[c.me].gen >= 0;
    a.read[q] = a.where[q].gen >= 0;
    if (a.read[q]) a.shm->link(c.peers()[q])->acquire();  // its rows, announced by its header
  }
  return a;
}

// Step 4 without a handle (phase "layout back"): every owner tells every other source how many
// rows it holds for it per block (local expert l), and where they start in its expand_x. The
// rows phase sizes its receives by these counts, never by what expert_ids lead this rank to
// expect: MPI rejects a message longer than its receive, and OpenMPI's single-copy path writes
// all of it past the end of the buffer first. A source whose counts disagree with expert_ids
// still takes every row announced (no message is left behind), then raises the error.
void layout_back(const Combine& c, Combine::Layout& k) {
  const int W = c.W, L = c.L, me = c.me;
  const auto& messages = message_links(c.comm);
  std::vector<std::shared_ptr<std::vector<int64_t>>> got(W);
  Exchange ex(c.comm, c.op, "layout back");
  for (int d = 0; d < W; ++d) {
    if (d == me || !c.agreed.route->direct(d)) continue;  // the route moves its rows
    auto mine = std::make_shared<std::vector<int64_t>>(2 * L);
    for (int l = 0; l < L; ++l) {
      (*mine)[l] = c.blocks->block_offset[int64_t{l} * W + d];
      (*mine)[L + l] = c.blocks->block_rows[int64_t{l} * W + d];
    }
    const int64_t ld = c.sh.pl.local_experts(d);
    got[d] = std::make_shared<std::vector<int64_t>>(2 * ld);
    ex.keep_alive(mine);
    ex.keep_alive(got[d]);
    const Link& link = *messages[c.peers()[d]];
    link.expect(ex, got[d]->data(), 2 * ld, kTagCombineLayout);
    link.post(ex, mine->data(), 2 * L, kTagCombineLayout);
  }
  ex.wait();
  if (c.perf) ex.add_recv_wait_us(c.perf);
  for (int d = 0; d < W; ++d) {
    if (d == me || !c.agreed.route->direct(d)) continue;
    const int64_t ld = c.sh.pl.local_experts(d);
    k.first_row[d].assign(got[d]->begin(), got[d]->begin() + ld);
    k.rows_of[d].assign(got[d]->begin() + ld, got[d]->end());
  }
}

// Step 4: per owner, the first row and the rows of each block it holds for this rank (from the
// handle, or phase "layout back"), and whether they are what expert_ids route to it.
Combine::Layout plan_layout(const Combine& c) {
  Combine::Layout k;
  const int W = c.W, me = c.me;
  k.first_row.assign(W, {});
  k.rows_of.assign(W, {});
  if (c.plan) {
    k.first_row = c.plan->block_row;
    k.first_row.resize(W);
  } else {
    layout_back(c, k);
  }
  k.announced.assign(W, 0);
  k.agrees.assign(W, 1);
  for (int d = 0; d < W; ++d) {
    const int64_t ld = c.sh.pl.local_experts(d), base = c.sh.pl.block_base(d);
    if (!c.agreed.route->direct(d)) {  // the route moves its rows
      k.rows_of[d].assign(static_cast<std::size_t>(ld), 0);
      continue;
    }
    if (c.plan || d == me) {
      k.rows_of[d].assign(c.back->counts.begin() + base, c.back->counts.begin() + base + ld);
      if (d == me)
        for (int64_t l = 0; l < ld; ++l) k.rows_of[d][l] = c.blocks->block_rows[l * W + me];
    }
    for (int64_t l = 0; l < ld; ++l) {
      const int64_t rows = k.rows_of[d][l], want = c.back->counts[base + l];
      k.announced[d] += rows;
      if (rows == want) continue;
      k.agrees[d] = 0;
      if (!k.mismatch)
        k.mismatch = Error(
            ErrorKind::kInvalidArgument,
            cat(c.op, ": rank ", c.peers()[d], " sent back ", rows, " rows of expert ",
                c.sh.pl.expert_on(d, l), " but expert_ids on rank ", c.comm.rank(), " route ", want,
                " entries to it: expert_ids and ep_send_counts must be those of the "
                "matching dispatch_v2"));
    }
  }
  return k;
}

// The rows phase's buffers.
struct RowsBack {
  explicit RowsBack(const Combine& c)
      : row_bytes(c.wire_row), meta_bytes(sizeof(BackMeta)), meta_in(c.W), discard(c.W) {}
  const int64_t row_bytes, meta_bytes;
  std::shared_ptr<Tensor> y;  // rows through MPI, in this rank's send order (owner d's at
                              // back->rank_offset[d]), expand_x's dtype or int8
  std::shared_ptr<std::vector<float>> y_scale;  // their int8 scales, in the same order
  std::vector<std::shared_ptr<std::vector<BackMeta>>> meta_in;
  // Rows of an owner whose counts disagree with expert_ids: taken, then discarded.
  std::vector<std::shared_ptr<Tensor>> discard;
};

// (token, slot, expert) of the rows this rank holds for source s, in s's send order.
std::shared_ptr<std::vector<BackMeta>> back_meta(const Combine& c, int s) {
  const TensorView& ai = c.in.assist_info_for_combine;
  auto m = std::make_shared<std::vector<BackMeta>>();
  m->reserve(static_cast<std::size_t>(c.blocks->source_rows[s]));
  for (int l = 0; l < c.L; ++l) {
    const int64_t b = int64_t{l} * c.W + s;
    for (int64_t j = c.blocks->block_offset[b];
         j < c.blocks->block_offset[b] + c.blocks->block_rows[b]; ++j)
      m->push_back(BackMeta{static_cast<int32_t>(index_at(ai, 3 * j + 1)),
                            static_cast<int32_t>(index_at(ai, 3 * j + 2)),
                            static_cast<int32_t>(c.sh.pl.expert_on(c.sh.rank, l))});
  }
  return m;
}

// Step 5a, as a source: the receives from every owner that does not share its rows in place:
// one per block (sized by the owner's own counts), their int8 scales, and without a handle
// their metadata.
void post_receives(const Combine& c, Exchange& ex, RowsBack& rx) {
  const auto& messages = message_links(c.comm);
  bool need_y = false;
  for (int d = 0; d < c.W; ++d)
    need_y |= d != c.me && !c.agreed.read[d] && c.layout.agrees[d] && c.layout.announced[d] > 0;
  const int64_t entries = c.sh.BS * c.sh.KS;
  if (need_y) {
    rx.y =
        std::make_shared<Tensor>(Tensor::empty(c.cq ? DType::kI8 : c.sh.dtype, {entries, c.sh.H}));
    ex.keep_alive(rx.y);
    if (c.cq) rx.y_scale = std::make_shared<std::vector<float>>(entries);
    if (c.cq) ex.keep_alive(rx.y_scale);
  }
  for (int d = 0; d < c.W; ++d) {
    if (d == c.me) continue;
    const Link& from = *messages[c.peers()[d]];
    const int64_t first = c.back->rank_offset[d];
    if (!c.agreed.read[d] && c.layout.announced[d] > 0) {
      char* to = nullptr;
      float* scales = nullptr;
      if (c.layout.agrees[d]) {
        to = rx.y->ptr<char>() + first * c.wire_row;
        if (c.cq) scales = rx.y_scale->data() + first;
      } else {
        rx.discard[d] = std::make_shared<Tensor>(
            Tensor::empty(DType::kI8, {c.layout.announced[d] * (c.wire_row + 4)}));
        ex.keep_alive(rx.discard[d]);
        to = rx.discard[d]->ptr<char>();
        scales = reinterpret_cast<float*>(to + c.layout.announced[d] * c.wire_row);
      }
      for (std::size_t l = 0, at = 0; l < c.layout.rows_of[d].size(); ++l) {
        const int64_t rows = c.layout.rows_of[d][l];
        if (rows > 0) from.get_block(ex, to + at * c.wire_row, rows, rx.row_bytes, kTagCombineRows);
        at += rows;
      }
      if (c.cq) from.expect(ex, scales, c.layout.announced[d], kTagCombineScales);
    }
    if (c.plan || c.layout.announced[d] == 0) continue;
    rx.meta_in[d] = std::make_shared<std::vector<BackMeta>>(c.layout.announced[d]);
    ex.keep_alive(rx.meta_in[d]);
    from.get_block(ex, rx.meta_in[d]->data(), c.layout.announced[d], rx.meta_bytes,
                   kTagCombineMeta);
  }
}

// Step 5b, as an owner: to every source that does not read in place, one contiguous message per
// block (l, s), which OpenMPI moves with its single-copy path: straight from expand_x (or the TP
// sums) when its rows are contiguous, else from the rows in row order (the staging slot, the
// int8 rows, or a packed copy). This rank's own rows are not sent: its sum reads them in place.
void post_sends(const Combine& c, Exchange& ex, const RowsBack& rx) {
  const auto& messages = message_links(c.comm);
  const bool direct = !c.cq && c.src_stride() == c.row_bytes;
  const char* base = c.cq      ? reinterpret_cast<const char*>(c.qrows)
                     : c.stage ? static_cast<const char*>(c.stage->ptr)
                               : nullptr;
  bool any = false;
  for (int s = 0; s < c.W; ++s)
    any |= s != c.me && !c.agreed.provide[s] && c.agreed.route->direct(s) &&
           c.blocks->source_rows[s] > 0;
  if (direct) base = static_cast<const char*>(c.rows_src().data);
  if (!base && any) {
    auto packed = std::make_shared<Tensor>(Tensor::empty(c.sh.dtype, {c.blocks->valid, c.sh.H}));
    std::vector<RowCopy> copies(static_cast<std::size_t>(c.blocks->valid));
    for (int64_t j = 0; j < c.blocks->valid; ++j)
      copies[j] = {row_ptr(c.rows_src(), j), packed->ptr<char>() + j * c.row_bytes, j};
    parallel_copy(copies, c.row_bytes);
    ex.keep_alive(packed);
    base = packed->ptr<char>();
  }
  const int64_t stride = direct ? c.src_stride() : c.wire_row;
  if (c.rs_out) ex.keep_alive(c.rs_out);
  if (c.qback) ex.keep_alive(c.qback);
  if (c.stage) ex.keep_alive(c.stage->token);  // MPI may read it until the wait ends
  for (int s = 0; s < c.W; ++s) {
    if (s == c.me) continue;
    const Link& to = *messages[c.peers()[s]];
    if (!c.agreed.route->direct(s)) continue;  // the route moves its rows
    if (!c.agreed.provide[s] && c.blocks->source_rows[s] > 0) {
      auto scales = std::make_shared<std::vector<float>>();
      for (int l = 0; l < c.L; ++l) {
        const int64_t b = int64_t{l} * c.W + s, rows = c.blocks->block_rows[b];
        if (rows == 0) continue;
        to.put_block(ex, base + c.blocks->block_offset[b] * stride, rows, rx.row_bytes,
                     kTagCombineRows);
        if (c.cq)
          scales->insert(scales->end(), c.qscales + c.blocks->block_offset[b],
                         c.qscales + c.blocks->block_offset[b] + rows);
      }
      if (c.cq) {
        ex.keep_alive(scales);
        to.post(ex, scales->data(), c.blocks->source_rows[s], kTagCombineScales);
      }
    }
    if (c.plan || c.blocks->source_rows[s] == 0) continue;
    auto meta = back_meta(c, s);
    ex.keep_alive(meta);
    to.put_block(ex, meta->data(), c.blocks->source_rows[s], rx.meta_bytes, kTagCombineMeta);
  }
}

// Step 5c: where each y_ik lies (and its int8 scale): in this rank's own rows, an owner's window,
// or y; without a handle, each row's metadata checked against expert_ids first: same (token,
// slot), same expert (a shared expert s is -1 - s).
Combine::Located locate_rows(const Combine& c, const RowsBack& rx) {
  Combine::Located loc;
  const EpShape& sh = c.sh;
  loc.yrow.assign(static_cast<std::size_t>(sh.BS * sh.KS), nullptr);
  if (c.cq) loc.yscale.assign(static_cast<std::size_t>(sh.BS * sh.KS), 0.0f);
  for (int d = 0; d < c.W; ++d) {
    if (!c.agreed.route->direct(d)) continue;  // the route moves its rows
    const int64_t first = c.back->rank_offset[d];
    const int64_t n = c.back->rank_offset[d + 1] - first;
    std::shared_ptr<std::vector<BackMeta>> own;
    const BackMeta* m = nullptr;
    if (!c.plan) {
      if (d == c.me) own = back_meta(c, c.me);
      m = d == c.me ? own->data() : n > 0 ? rx.meta_in[d]->data() : nullptr;
    }
    const Where& w = c.agreed.where[d];
    if (c.agreed.read[d])
      CommInternals::traffic(c.comm).window_bytes[c.peers()[d]] +=
          n * (c.wire_row + (c.cq ? 4 : 0));
    int64_t l = 0, in_block = 0;  // entry j's block l of owner d and its place in it
    for (int64_t j = 0; j < n; ++j, ++in_block) {
      while (in_block == c.layout.rows_of[d][l]) ++l, in_block = 0;
      const int64_t flat = c.back->order[first + j], i = flat / sh.KS, k = flat % sh.KS;
      if (m) {
        const int64_t e = k < sh.K ? index_at(c.in.expert_ids, i, k) : -1 - (k - sh.K);
        if (m[j].token != i || m[j].slot != k || m[j].expert != e)
          invalid(c.op, ": expert_ids[", i, ",", k, "] = ", e, ", but rank ", c.peers()[d],
                  " returned the output of expert ", m[j].expert, " for (token ", m[j].token,
                  ", slot ", m[j].slot,
                  ") at that position: expert_ids (and x_active_mask) must be those of the "
                  "matching dispatch_v2 (same tokens, same order)");
      }
      if (d == c.me) {
        const int64_t row = c.blocks->block_offset[l * c.W + c.me] + in_block;
        loc.yrow[flat] = c.cq ? reinterpret_cast<const char*>(c.qrows) + row * c.wire_row
                              : row_ptr(c.rows_src(), row);
        if (c.cq) loc.yscale[flat] = c.qscales[row];
      } else if (c.agreed.read[d]) {
        const int64_t row = c.layout.first_row[d][l] + in_block;
        const Link& link = *c.agreed.shm->link(c.peers()[d]);
        loc.yrow[flat] = link.place(static_cast<int>(w.gen), w.rows + row * w.stride, c.wire_row);
        if (c.cq)
          std::memcpy(&loc.yscale[flat], link.place(static_cast<int>(w.gen), w.extra + row * 4, 4),
                      4);
      } else {
        loc.yrow[flat] = rx.y->ptr<char>() + (first + j) * c.wire_row;
        if (c.cq) loc.yscale[flat] = (*rx.y_scale)[first + j];
      }
    }
  }
  loc.y_keep = rx.y;  // y and the owners' rows must outlive the sum
  return loc;
}

// Phase "shm done": tells every owner this rank read from that it is done, and waits until
// every reader of this rank's rows is done with them (they may be the caller's expand_x, or
// staging about to be reused). Runs on success and, best effort, on errors after the rows phase.
void finish_reading(Combine& c) {
  if (c.finished || !c.agreed.shm) return;
  c.finished = true;
  Exchange ex(c.comm, c.op, "shm done");
  auto flag = std::make_shared<std::vector<int32_t>>(static_cast<std::size_t>(c.W), 0);
  ex.keep_alive(flag);
  for (int q = 0; q < c.W; ++q) {
    if (q == c.me || !(c.agreed.provide[q] || c.agreed.read[q]))
      continue;  // only peers on this machine
    const Link& link = *c.agreed.shm->link(c.peers()[q]);
    if (c.agreed.provide[q]) link.expect(ex, flag->data() + q, 1, kTagShmDone);
    if (c.agreed.read[q]) link.post(ex, flag->data() + c.me, 1, kTagShmDone);
  }
  ex.wait();
}

// After an error past the header agreement: the owners wait for this rank's "done" before they
// return, so it is sent, best effort (after a timeout the communicator is unusable anyway).
void abandon(Combine& c, const Error& e) {
  if (e.kind() == ErrorKind::kTimeout) return;
  try {
    finish_reading(c);
  } catch (...) {  // the first error is the one to report
  }
}

// Step 5: the rows phase.
Combine::Located move_rows(const Combine& c) {
  Exchange ex(c.comm, c.op, "rows");
  RowsBack rx(c);
  post_receives(c, ex, rx);
  post_sends(c, ex, rx);
  ex.wait();
  if (c.perf) ex.add_recv_wait_us(c.perf);
  if (c.layout.mismatch) throw *c.layout.mismatch;  // every row announced is taken; now the error
  return locate_rows(c, rx);
}

// Step 5: the direct rows, then the route's phases. A mismatch of this rank's own rows (its
// expert_ids are not those of the dispatch) is raised after the route's phases when the route
// still serves the other ranks there (CombineRoute::serves_others), and after its "done" (which
// the readers of its rows on this machine send only at their end).
void move_all_rows(Combine& c, CombineSum& sum) {
  std::optional<Error> source_error;
  try {
    c.located = move_rows(c);
  } catch (const Error& e) {
    if (!c.agreed.route->serves_others() || e.kind() != ErrorKind::kInvalidArgument) {
      abandon(c, e);
      throw;
    }
    source_error = e;
  }
  try {
    c.agreed.route->move_rows(c, sum,
                              !source_error);  // with source_error, its rows are not located
  } catch (const Error& e) {
    abandon(c, e);
    if (!source_error || e.kind() != ErrorKind::kInvalidArgument) throw;
  }
  if (!source_error) return;
  abandon(c, *source_error);
  throw *source_error;
}

// Fullmesh: every rank reached directly; nothing beyond the steps above.
class FullmeshCombine final : public CombineRoute {
 public:
  int ranks_per_node() const override { return 0; }
  bool direct(int) const override { return true; }
  bool serves_others() const override { return false; }
  void move_rows(const Combine&, CombineSum&, bool) override {}
  void sum(const CombineSum& sum) override { combine_sum(sum); }
};

}  // namespace

std::unique_ptr<CombineRoute> fullmesh_combine() { return std::make_unique<FullmeshCombine>(); }

}  // namespace moe_ep::detail

namespace moe_ep {

namespace detail {

Tensor run_combine(const CombineInputs& in, const EpConfig& cfg, const char* op, int32_t code,
                   bool unit_terms) {
  Combine c(in, cfg, require_comm(op, cfg));
  c.op = op;
  c.unit_terms = unit_terms;
  c.hdr = base_header(code, cfg, in.expert_ids, in.expand_x, in.expert_ids, in.comm_quant_mode);
  capture(c.hdr, c.local, [&] {
    check_arguments(c);
    if (!c.world.removed) allocate(c);
  });
  std::optional<Combine::Agreed> agreed = agree(c);
  if (!agreed) {  // removed by a scale-in (SPEC §1.7): no part, zeros
    if (!in.out) return Tensor::zeros(c.sh.dtype, {c.sh.BS, c.sh.H});
    check_out(c);
    Tensor out = TensorInternals::view(*in.out);
    if (out.nbytes() > 0) std::memset(out.data(), 0, out.nbytes());
    return out;
  }
  c.agreed = std::move(*agreed);
  c.layout = plan_layout(c);
  CombineSum sum;
  sum.in = &in;
  sum.mask = c.mask;
  sum.sh = &c.sh;
  // Unit terms: every special expert is a zero expert (dispatch sent it nothing to give back).
  sum.zero = unit_terms ? c.sh.pl.special : cfg.zero_expert_num;
  sum.copy = unit_terms ? 0 : cfg.copy_expert_num;
  sum.consts = unit_terms ? 0 : cfg.const_expert_num;
  sum.out = c.out.ptr<char>();
  move_all_rows(c, sum);
  sum.yrow = c.located.yrow.data();
  sum.yscale = c.cq ? c.located.yscale.data() : nullptr;
  c.agreed.route->sum(sum);
  finish_reading(c);
  return c.out;
}

}  // namespace detail

Tensor combine_v2(const CombineInputs& in, const EpConfig& cfg) {
  detail::wait_for_started_ops(cfg);
  return detail::run_combine(in, cfg, "combine_v2", detail::kOpCombine, false);
}

}  // namespace moe_ep
