#include "core/ep/plan.h"

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
