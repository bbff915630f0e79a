#include "core/ep_layout.h"

#include <algorithm>
#include <climits>

#include "base/check.h"
#include "core/validate.h"

namespace moe_ep::detail {

Placement make_placement(int64_t W, int64_t S, int64_t shared_expert_num, int64_t E,
                         int64_t special) {
  Placement p;
  p.W = W;
  p.S = S;
  p.Ns = S > 0 ? shared_expert_num : 0;
  p.E = E;
  p.L = E / (W - S);
  p.special = special;
  return p;
}

namespace {
bool bool_at(const TensorView& t, int64_t i, int64_t j) {
  const int64_t off = i * t.strides[0] + (t.ndim > 1 ? j * t.strides[1] : 0);
  return static_cast<const uint8_t*>(t.data)[off] != 0;
}
}  // namespace

bool Activity::entry(int64_t i, int64_t k) const {
  if (index_at(*ids, i, k) == -1) return false;
  if (mask == nullptr) return true;
  return mask->ndim == 1 ? bool_at(*mask, i, 0) : bool_at(*mask, i, k);
}

bool Activity::token(int64_t i) const {
  for (int64_t k = 0; k < ids->shape[1]; ++k)
    if (entry(i, k)) return true;
  return false;
}

void check_placement(const char* op, int64_t W, int64_t S, int64_t Ns, int64_t E,
                     const char* what) {
  if (W < 1) invalid(op, ": ep_world_size", what, " = ", W, " must be >= 1");
  if (S < 0 || S >= W)
    invalid(op, ": shared_expert_rank_num", what, " = ", S, " is outside [0, ", W,
            ") (ep_world_size)");
  if (Ns < 0 || Ns > 4) invalid(op, ": shared_expert_num = ", Ns, " is outside [0, 4]");
  if (S == 0 && Ns > 1)
    invalid(op, ": shared_expert_num = ", Ns,
            " needs shared_expert_rank_num > 0 and a multiple of it (shared_expert_rank_num", what,
            " = 0; valid: (1, 0), (0, 0), or shared_expert_num > 0 dividing "
            "shared_expert_rank_num)");
  if (S > 0 && Ns == 0)
    invalid(op, ": shared_expert_rank_num", what, " = ", S,
            " needs shared_expert_num > 0 (shared_expert_num = 0)");
  if (S > 0 && S % Ns != 0)
    invalid(op, ": shared_expert_rank_num", what, " = ", S,
            " is not a multiple of shared_expert_num = ", Ns);
  if (E < 1) invalid(op, ": moe_expert_num", what, " = ", E, " must be >= 1");
  if (E >= INT32_MAX) invalid(op, ": moe_expert_num", what, " = ", E, " must be < 2^31 - 1");
  if (E % (W - S) != 0)
    invalid(op, ": moe_expert_num", what, " = ", E,
            " is not a multiple of ep_world_size - shared_expert_rank_num = ", W - S);
}

void check_ep_config(const char* op, const EpConfig& cfg, int comm_rank, int comm_size) {
  if (cfg.ep_world_size < 1) invalid(op, ": ep_world_size = ", cfg.ep_world_size, " must be >= 1");
  if (cfg.ep_world_size != comm_size)
    invalid(op, ": ep_world_size = ", cfg.ep_world_size, " differs from group_ep's size ",
            comm_size);
  if (cfg.ep_rank_id != comm_rank)
    invalid(op, ": ep_rank_id = ", cfg.ep_rank_id, " differs from this rank's rank ", comm_rank,
            " in group_ep (ep_rank_id must be in [0, ", comm_size, ") and equal group_ep's rank)");
  if (cfg.tp_world_size < 0 || cfg.tp_world_size > 2)
    invalid(op, ": tp_world_size = ", cfg.tp_world_size, " is not one of {0, 1, 2}");
  if (cfg.tp_world_size == 2) {
    // SPEC §1.3: a TP pair is group_tp (2 ranks); this rank is tp_rank_id in it.
    if (cfg.group_tp == nullptr) invalid(op, ": group_tp is null with tp_world_size = 2");
    if (cfg.group_tp->size() != 2)
      invalid(op, ": group_tp has ", cfg.group_tp->size(),
              " ranks but tp_world_size = 2 (group_tp must hold exactly the TP pair)");
    if (cfg.tp_rank_id != cfg.group_tp->rank())
      invalid(op, ": tp_rank_id = ", cfg.tp_rank_id, " differs from this rank's rank ",
              cfg.group_tp->rank(), " in group_tp (tp_rank_id must be in [0, 2) and equal ",
              "group_tp's rank)");
  } else if (cfg.tp_rank_id != 0) {
    invalid(op, ": tp_rank_id = ", cfg.tp_rank_id,
            " must be 0 when tp_world_size = ", cfg.tp_world_size);
  }
  if (cfg.expert_shard_type != 0)
    invalid(op, ": expert_shard_type = ", cfg.expert_shard_type, " is not 0 (the only value)");
  check_placement(op, cfg.ep_world_size, cfg.shared_expert_rank_num, cfg.shared_expert_num,
                  cfg.moe_expert_num, "");
  if (cfg.tp_world_size == 2 &&
      cfg.moe_expert_num != cfg.ep_world_size - cfg.shared_expert_rank_num)
    invalid(op, ": moe_expert_num = ", cfg.moe_expert_num,
            " gives L = ", cfg.moe_expert_num / (cfg.ep_world_size - cfg.shared_expert_rank_num),
            " local experts per MoE rank, but tp_world_size = 2 needs L = 1 (moe_expert_num = ",
            "ep_world_size - shared_expert_rank_num = ",
            cfg.ep_world_size - cfg.shared_expert_rank_num, ")");
  if (cfg.comm_alg == "hierarchy")
    unsupported(op, ": comm_alg = \"hierarchy\" is not supported by this build");
  if (!cfg.comm_alg.empty() && cfg.comm_alg != "fullmesh")
    invalid(op, ": comm_alg = \"", cfg.comm_alg,
            "\" is not one of {\"\", \"fullmesh\", \"hierarchy\"}");
  const std::pair<const char*, int64_t> special[] = {{"zero_expert_num", cfg.zero_expert_num},
                                                     {"copy_expert_num", cfg.copy_expert_num},
                                                     {"const_expert_num", cfg.const_expert_num}};
  int64_t total = cfg.moe_expert_num;
  for (const auto& [name, v] : special) {
    if (v < 0) invalid(op, ": ", name, " = ", v, " must be >= 0");
    if (v >= INT32_MAX) invalid(op, ": ", name, " = ", v, " must be < 2^31 - 1");
    total += v;
  }
  if (total >= INT32_MAX)
    invalid(op, ": moe_expert_num + zero_expert_num + copy_expert_num + const_expert_num = ", total,
            " must be < 2^31 - 1");
  if (cfg.global_bs < 0) invalid(op, ": global_bs = ", cfg.global_bs, " must be >= 0");
}

void check_expert_ids(const char* op, const TensorView& ids, int64_t BS, int64_t E,
                      int64_t special) {
  expect_tensor(op, "expert_ids", ids, {DType::kI32}, 2);
  expect_size(op, "expert_ids", ids, 0, BS, "BS, the tokens of this rank");
  const int64_t K = ids.shape[1], N = E + special;
  if (K < 1 || K > N) {
    if (special == 0)
      invalid(op, ": expert_ids.shape[1] = ", K, " (K) is outside [1, ", E, "] (moe_expert_num)");
    invalid(op, ": expert_ids.shape[1] = ", K, " (K) is outside [1, ", N,
            "] (moe_expert_num + zero/copy/const_expert_num)");
  }
  for (int64_t i = 0; i < BS; ++i) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = index_at(ids, i, k);
      if (e == -1) continue;
      if (e < 0 || e >= N) {
        if (special == 0)
          invalid(op, ": expert_ids[", i, ",", k, "] = ", e, " is outside [0, ", E,
                  ") (moe_expert_num; -1 marks an inactive entry)");
        invalid(op, ": expert_ids[", i, ",", k, "] = ", e, " is outside [0, ", N,
                ") (moe_expert_num + zero/copy/const_expert_num; -1 marks an inactive entry)");
      }
      for (int64_t k2 = 0; k2 < k; ++k2)
        if (index_at(ids, i, k2) == e)
          invalid(op, ": expert_ids[", i, ",*] repeats expert ", e, " (slots ", k2, " and ", k,
                  "); the ids of a token must be distinct");
    }
  }
}

void check_active_mask(const char* op, const TensorView& m, int64_t BS, int64_t K) {
  expect_dtype(op, "x_active_mask", m, {DType::kBool});
  if (m.ndim != 1 && m.ndim != 2)
    invalid(op, ": x_active_mask.ndim = ", m.ndim, " must be 1 (BS,) or 2 (BS, K)");
  expect_memory(op, "x_active_mask", m);
  expect_size(op, "x_active_mask", m, 0, BS, "BS, expert_ids.shape[0]");
  if (m.ndim == 2) {
    expect_size(op, "x_active_mask", m, 1, K, "K, expert_ids.shape[1]");
    return;
  }
  int64_t first_false = -1;
  for (int64_t i = 0; i < BS; ++i) {
    const bool v = bool_at(m, i, 0);
    if (!v && first_false < 0) first_false = i;
    if (v && first_false >= 0)
      invalid(op, ": x_active_mask[", i, "] = true follows x_active_mask[", first_false,
              "] = false (a 1-D mask must hold all Trues before all Falses)");
  }
}

bool mask_all_true(const TensorView& m) {
  const int64_t rows = m.shape[0], cols = m.ndim == 2 ? m.shape[1] : 1;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      if (!bool_at(m, i, j)) return false;
  return true;
}

void check_expert_scales(const char* op, const TensorView& s, int64_t BS, int64_t K) {
  expect_tensor(op, "expert_scales", s, {DType::kF32}, 2);
  expect_size(op, "expert_scales", s, 0, BS, "BS, expert_ids.shape[0]");
  expect_size(op, "expert_scales", s, 1, K, "K, expert_ids.shape[1]");
}

void compute_capacity(const char* op, int64_t global_bs, EpShape& sh) {
  if (global_bs > 0) {
    if (global_bs % sh.W != 0)
      invalid(op, ": global_bs = ", global_bs, " is not a multiple of ep_world_size = ", sh.W);
    sh.G = global_bs;
  } else {
    sh.G = sh.BS * sh.W;
  }
  // Every product below stays far from 2^63: each factor is checked against int32 first.
  if (sh.G > INT32_MAX)
    unsupported(op, ": G = ", sh.G, " tokens (global_bs, or BS * ep_world_size) exceeds int32");
  if (sh.BS * sh.K > INT32_MAX)
    unsupported(op, ": BS * K = ", sh.BS, " * ", sh.K, " = ", sh.BS * sh.K,
                " entries exceed int32 (assist_info_for_combine is int32)");
  if (sh.rank < sh.pl.S) {
    const int64_t per = sh.pl.S / sh.pl.Ns, senders = (sh.W + per - 1) / per;
    sh.A = sh.G / sh.W * senders;
    if (sh.A > INT32_MAX)
      unsupported(op, ": the receive capacity A = (G / W) * ceil(W / (S / Ns)) = ", sh.G / sh.W,
                  " * ", senders, " = ", sh.A, " exceeds int32 (ep_recv_counts)");
  } else {
    sh.A = sh.G * std::min(sh.L, sh.K);
    if (sh.A > INT32_MAX)
      unsupported(op, ": the receive capacity A = G * min(L, K) = ", sh.G, " * ",
                  std::min(sh.L, sh.K), " = ", sh.A, " exceeds int32 (ep_recv_counts)");
  }
  const int64_t row_bytes = sh.H * static_cast<int64_t>(dtype_size(sh.dtype));
  if (row_bytes > INT_MAX)
    unsupported(op, ": one row of H = ", sh.H, " ", dtype_name(sh.dtype), " elements is ",
                row_bytes, " bytes, more than an MPI count (INT_MAX)");
}

SendPlan plan_sends(const Activity& act, const Placement& pl, int64_t rank) {
  const TensorView& ids = *act.ids;
  const int64_t BS = ids.shape[0], K = ids.shape[1], KS = K + pl.Ns, nb = pl.blocks();
  SendPlan p;
  p.KS = KS;
  p.counts.assign(nb, 0);
  // Counting sort by block (destination rank, local expert), stable in the flat index. `visit`
  // calls f(flat, block) for every entry sent, in increasing flat order.
  auto visit = [&](auto&& f) {
    for (int64_t i = 0; i < BS; ++i) {
      bool any = false;
      for (int64_t k = 0; k < K; ++k) {
        if (!act.entry(i, k)) continue;
        any = true;
        const int64_t e = index_at(ids, i, k);
        if (e < pl.E) f(i * KS + k, pl.S + e);  // special experts (e >= E) stay here
      }
      if (!any) continue;
      for (int64_t s = 0; s < pl.Ns; ++s) f(i * KS + K + s, pl.shared_dest(rank, s));
    }
  };
  visit([&](int64_t, int64_t b) { ++p.counts[b]; });
  std::vector<int64_t> start(nb + 1, 0);
  for (int64_t b = 0; b < nb; ++b) start[b + 1] = start[b] + p.counts[b];
  p.order.resize(start[nb]);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  visit([&](int64_t flat, int64_t b) { p.order[next[b]++] = flat; });
  p.rank_offset.resize(pl.W + 1);
  for (int64_t d = 0; d < pl.W; ++d) p.rank_offset[d] = start[pl.block_base(d)];
  p.rank_offset[pl.W] = start[nb];
  // Self-check: within a block the flat indices increase.
  for (int64_t b = 0; b < nb; ++b) {
    MOE_EP_DCHECK(next[b] == start[b + 1]);
    for (int64_t j = start[b] + 1; j < start[b + 1]; ++j)
      MOE_EP_DCHECK(p.order[j - 1] < p.order[j]);
  }
  return p;
}

namespace {
RecvPlan finish_recv_plan(std::vector<int32_t> rows_ls, int64_t W, int64_t L) {
  RecvPlan p;
  p.block_rows = std::move(rows_ls);
  p.inclusive.resize(W * L);
  p.block_offset.resize(W * L);
  p.source_rows.assign(W, 0);
  int64_t run = 0;
  for (int64_t b = 0; b < W * L; ++b) {
    p.block_offset[b] = run;
    run += p.block_rows[b];
    p.inclusive[b] = static_cast<int32_t>(run);
    p.source_rows[b % W] += p.block_rows[b];
  }
  p.valid = run;
  MOE_EP_DCHECK(std::is_sorted(p.inclusive.begin(), p.inclusive.end()));
  return p;
}
}  // namespace

RecvPlan plan_recvs_from_counts(const std::vector<int32_t>& from_source, int64_t W, int64_t L) {
  std::vector<int32_t> rows(W * L);
  int64_t total = 0;
  for (int64_t s = 0; s < W; ++s)
    for (int64_t l = 0; l < L; ++l) {
      const int32_t c = from_source[s * L + l];
      MOE_EP_CHECK(c >= 0);
      rows[l * W + s] = c;
      total += c;
    }
  MOE_EP_CHECK(total <= INT32_MAX);
  return finish_recv_plan(std::move(rows), W, L);
}

RecvPlan plan_recvs_from_inclusive(const char* op, const TensorView& c, int64_t W, int64_t L,
                                   int64_t capacity) {
  expect_tensor(op, "ep_send_counts", c, {DType::kI32}, 1);
  if (c.shape[0] != W * L)
    invalid(op, ": ep_send_counts.shape[0] = ", c.shape[0], " must equal ep_world_size * L = ", W,
            " * ", L, " = ", W * L, " (dispatch_v2's ep_recv_counts)");
  std::vector<int32_t> rows(W * L);
  int64_t prev = 0;
  for (int64_t b = 0; b < W * L; ++b) {
    const int64_t v = index_at(c, b);
    if (v < prev)
      invalid(op, ": ep_send_counts[", b, "] = ", v, " is less than ",
              b == 0 ? "0" : cat("ep_send_counts[", b - 1, "] = ", prev),
              " (an inclusive running sum is non-decreasing)");
    rows[b] = static_cast<int32_t>(v - prev);
    prev = v;
  }
  if (prev > capacity)
    invalid(op, ": expand_x.shape[0] = ", capacity, " is less than the valid rows ",
            "ep_send_counts[", W * L - 1, "] = ", prev);
  return finish_recv_plan(std::move(rows), W, L);
}

}  // namespace moe_ep::detail
