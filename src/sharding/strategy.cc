// SPEC §5: the strategy table, the redistribution cost and the selection rule.
#include <algorithm>
#include <limits>

#include "base/check.h"
#include "sharding/internal.h"

namespace moe_ep {

using detail::cat;
using detail::invalid;

const char* op_name(ShardedOp op) {
  switch (op) {
    case ShardedOp::kPermute:
      return "permute";
    case ShardedOp::kPermuteGrad:
      return "permute_grad";
    case ShardedOp::kPermuteGradV2:
      return "permute_grad_v2";
    case ShardedOp::kUnpermute:
      return "unpermute";
    case ShardedOp::kUnpermuteWithSaved:
      return "unpermute_with_saved";
    case ShardedOp::kUnpermuteGrad:
      return "unpermute_grad";
    case ShardedOp::kUnpermuteGradV2:
      return "unpermute_grad_v2";
  }
  return "?";
}

std::vector<Strategy> strategies(ShardedOp op, bool has_probs, bool has_permuted_tokens) {
  using P = std::optional<Placement>;
  const P none = std::nullopt;
  std::vector<Strategy> out;
  // hidden: the placement of the token-like tensors (Replicate for R, Shard(1) for S).
  for (const bool s : {false, true}) {
    const Placement hidden = s ? Shard(1) : Replicate();
    const P probs = has_probs ? P(Replicate()) : none;
    const P grad_probs = has_probs ? P(s ? Partial() : Replicate()) : none;
    Strategy st;
    st.name.assign(1, s ? 'S' : 'R');  // (assign of a literal trips GCC 12 -Wrestrict)
    switch (op) {
      case ShardedOp::kPermute:
        st.inputs = {{"tokens", hidden}, {"indices", Replicate()}};
        st.outputs = {{"permuted_tokens", hidden}, {"sorted_indices", Replicate()}};
        break;
      case ShardedOp::kPermuteGrad:
        st.inputs = {{"tokens", hidden, false},
                     {"grad_permuted_tokens", hidden},
                     {"indices", Replicate()},
                     {"sorted_indices", Replicate()}};
        st.outputs = {{"grad_tokens", hidden}};
        break;
      case ShardedOp::kPermuteGradV2:
        st.inputs = {{"grad_permuted_tokens", hidden}, {"sorted_indices", Replicate()}};
        st.outputs = {{"grad_tokens", hidden}};
        break;
      case ShardedOp::kUnpermute:
      case ShardedOp::kUnpermuteWithSaved:
        st.inputs = {
            {"permuted_tokens", hidden}, {"sorted_indices", Replicate()}, {"probs", probs}};
        st.outputs = {{"out", hidden}};
        if (op == ShardedOp::kUnpermuteWithSaved)
          st.outputs.push_back({"permuted_tokens_for_backward", hidden});
        break;
      case ShardedOp::kUnpermuteGrad:
        st.inputs = {{"permuted_tokens", hidden, has_probs},
                     {"grad_out", hidden},
                     {"sorted_indices", Replicate()},
                     {"probs", probs}};
        st.outputs = {{"grad_permuted_tokens", hidden}, {"grad_probs", grad_probs}};
        break;
      case ShardedOp::kUnpermuteGradV2:
        if (has_probs && !has_permuted_tokens)
          invalid("unpermute_grad_v2: permuted_tokens is required when probs is given");
        st.inputs = {{"grad_out", hidden},
                     {"sorted_indices", Replicate()},
                     {"probs", probs},
                     {"permuted_tokens", has_permuted_tokens ? P(hidden) : none, has_probs}};
        st.outputs = {{"grad_permuted_tokens", hidden}, {"grad_probs", grad_probs}};
        break;
    }
    out.push_back(std::move(st));
  }
  return out;
}

TensorSpec spec_of(const DTensor& x) {
  return {x.global_shape, x.global_dtype(), x.placement, x.local.dtype};
}

namespace {

void check_spec(const char* what, const TensorSpec& x, Placement to, int n) {
  const int ndim = static_cast<int>(x.global_shape.size());
  if (n < 1) invalid(what, ": mesh_size = ", n, " must be >= 1");
  if (ndim < 1 || ndim > kMaxDims)
    invalid(what, ": global_shape ", detail::shape_str(x.global_shape), " has ", ndim,
            " dims, outside [1, ", kMaxDims, "]");
  for (int d = 0; d < ndim; ++d)
    if (x.global_shape[d] < 0)
      invalid(what, ": global_shape[", d, "] = ", x.global_shape[d], " is negative");
  for (const Placement& p : {x.placement, to})
    if (p.is_shard() && (p.dim < 0 || p.dim >= ndim))
      invalid(what, ": placement ", p.to_string(), " is outside dims [0, ", ndim, ") of the ", ndim,
              "-D tensor");
}

}  // namespace

int64_t redistribute_cost(const TensorSpec& x, Placement to, int n) {
  check_spec("redistribute_cost", x, to, n);
  const Placement from = x.placement;
  if (to.is_partial()) {
    if (from.is_partial()) return 0;
    detail::unsupported("redistribute_cost: ", from.to_string(),
                        " -> Partial(sum) is not supported");
  }
  if (from == to || from.is_replicate() || n == 1) return 0;
  const int64_t es = static_cast<int64_t>(dtype_size(x.dtype));
  const int64_t les = static_cast<int64_t>(dtype_size(x.local_dtype ? *x.local_dtype : x.dtype));
  int64_t numel = 1;
  for (int64_t s : x.global_shape) numel *= s;
  int64_t worst = 0;
  for (int r = 0; r < n; ++r) {
    const detail::Box target = detail::box_of(x.global_shape, to, n, r);
    int64_t bytes = 0;
    if (from.is_partial()) {
      if (to.is_replicate()) {
        const int64_t e = shard_range(numel, n, r).length;
        bytes = (n - 1) * e * les + (numel - e) * es;
      } else {
        bytes = (n - 1) * target.numel() * les;
      }
    } else {
      const detail::Box have = detail::box_of(x.global_shape, from, n, r);
      bytes = (target.numel() - detail::intersect(have, target).numel()) * es;
    }
    worst = std::max(worst, bytes);
  }
  return worst;
}

StrategyChoice select_strategy(ShardedOp op, const std::map<std::string, TensorSpec>& inputs,
                               int mesh_size) {
  const char* name = op_name(op);
  const bool has_probs = inputs.count("probs") > 0;
  const bool has_permuted = inputs.count("permuted_tokens") > 0;
  const std::vector<Strategy> all = strategies(op, has_probs, has_permuted);
  for (const auto& [arg, spec] : inputs) {
    (void)spec;
    bool known = false;
    for (const ArgPlacement& a : all[0].inputs) known = known || (a.name == arg && a.placement);
    if (!known) invalid(name, ": select_strategy: unknown argument '", arg, "'");
  }
  for (const ArgPlacement& a : all[0].inputs)
    if (a.placement && inputs.count(a.name) == 0)
      invalid(name, ": select_strategy: argument '", a.name, "' is missing");
  StrategyChoice best;
  int64_t best_cost = std::numeric_limits<int64_t>::max();
  for (std::size_t i = 0; i < all.size(); ++i) {
    StrategyChoice c;
    c.index = static_cast<int>(i);
    c.strategy = all[i];
    for (const ArgPlacement& a : all[i].inputs) {
      if (!a.placement) continue;
      const TensorSpec& spec = inputs.at(a.name);
      const int64_t bytes = redistribute_cost(spec, *a.placement, mesh_size);
      if (!a.data_read || spec.placement == *a.placement) continue;
      c.redistributions.push_back({a.name, spec.placement, *a.placement, bytes});
      c.cost_bytes += bytes;
    }
    if (c.cost_bytes < best_cost) {
      best_cost = c.cost_bytes;
      best = std::move(c);
    }
  }
  return best;
}

}  // namespace moe_ep
