// The sharded ops of SPEC §5: check, agree, select a strategy, redistribute, run the local op of
// SPEC §4 on this rank's pieces, label the outputs.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "base/check.h"
#include "core/validate.h"
#include "sharding/internal.h"

namespace moe_ep::sharded {

namespace {

using detail::ArgSummary;
using detail::invalid;

struct Input {
  const char* name;
  const DTensor* x;  // null: absent
};

struct Prepared {
  StrategyChoice choice;
  std::vector<DTensor> placed;  // per input, as the chosen strategy places it (empty if absent)
  int64_t hidden = 0;           // H: the global shape[1] of the token-like inputs
  bool sharded() const { return choice.index == 1; }
};

bool is_rows(const std::vector<std::string>& rows, const char* name) {
  for (const std::string& r : rows)
    if (r == name) return true;
  return false;
}

// Token-like inputs (2-D, one H for all): names of `inputs` listed in `rows`.
int64_t check_hidden(const char* op, const std::vector<Input>& inputs,
                     const std::vector<std::string>& rows) {
  int64_t h = -1;
  const char* first = nullptr;
  for (const Input& in : inputs) {
    if (!in.x) continue;
    if (!is_rows(rows, in.name)) continue;
    const std::vector<int64_t>& g = in.x->global_shape;
    if (g.size() != 2)
      invalid(op, ": ", in.name, " global_shape ", detail::shape_str(g), " must be 2-D (rows, H)");
    if (h < 0) {
      h = g[1];
      first = in.name;
    } else if (g[1] != h) {
      invalid(op, ": ", in.name, " global_shape[1] = ", g[1], " must equal ", h, " (H, ", first,
              " global_shape[1])");
    }
  }
  return h < 0 ? 0 : h;
}

void add_restore_shape(ArgSummary& sum, const std::optional<std::vector<int64_t>>& rs) {
  sum.add("restore_shape is given", rs.has_value(), ArgSummary::Kind::kBool);
  sum.add("restore_shape size", rs ? static_cast<int64_t>(rs->size()) : 0);
  for (int i = 0; i < 2; ++i)
    sum.add(detail::cat("restore_shape[", i, "]"),
            rs && static_cast<int>(rs->size()) > i ? (*rs)[i] : 0);
}

// restore_shape is the GLOBAL output shape {N, H}: check H here, hand the kernel {N, local h}.
void check_restore_shape(const char* op, const std::optional<std::vector<int64_t>>& rs, int64_t h) {
  if (!rs) return;
  if (rs->size() != 2 || (*rs)[1] != h)
    invalid(op, ": restore_shape = ", detail::shape_str(*rs), " must be [N, ", h,
            "] (the global output shape)");
}

std::optional<std::vector<int64_t>> local_restore(const std::optional<std::vector<int64_t>>& rs,
                                                  const DTensor& rows_like) {
  if (!rs) return std::nullopt;
  return std::vector<int64_t>{(*rs)[0], rows_like.local.shape[1]};
}

// The common prologue of every sharded op. `checks` runs the op's own cross-argument checks
// (inside the agreement, so a failure on one rank reaches all).
Prepared prepare(const Communicator& mesh, ShardedOp id, const char* op,
                 const std::vector<Input>& inputs, const std::vector<std::string>& rows,
                 const std::function<void(ArgSummary&)>& scalars,
                 const std::function<void(int64_t h)>& checks) {
  const int n = mesh.size(), me = mesh.rank();
  ArgSummary sum;
  for (const Input& in : inputs) sum.add_tensor(in.name, in.x);
  if (scalars) scalars(sum);
  Prepared out;
  std::optional<Error> local;
  try {
    std::map<std::string, TensorSpec> specs;
    for (const Input& in : inputs) {
      if (!in.x) continue;
      detail::check_dtensor(op, in.name, *in.x, n, me);
      specs[in.name] = spec_of(*in.x);
    }
    out.hidden = check_hidden(op, inputs, rows);
    if (checks) checks(out.hidden);
    out.choice = select_strategy(id, specs, n);
  } catch (const Error& e) {
    local = e;
  }
  detail::agree_sharded(mesh, op, detail::kCallOpBase + static_cast<int32_t>(id), sum,
                        local ? &*local : nullptr);
  const std::vector<ArgPlacement>& want = out.choice.strategy.inputs;
  MOE_EP_CHECK(want.size() == inputs.size());
  out.placed.resize(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    MOE_EP_CHECK(want[i].name == inputs[i].name);
    const DTensor* x = inputs[i].x;
    if (!x) continue;
    MOE_EP_CHECK(want[i].placement.has_value());
    const Placement to = *want[i].placement;
    if (want[i].data_read) {
      out.placed[i] = detail::redistribute_agreed(mesh, op, inputs[i].name, *x, to);
      // The local kernels take token-like pieces whose rows are contiguous; a piece with strided
      // columns (any strides are a valid DTensor piece) is copied, so that such a piece never
      // fails on some ranks only (the kernel accepts any stride where a piece is 0 or 1 wide).
      const TensorView& v = out.placed[i].local;
      if (is_rows(rows, inputs[i].name) && v.ndim == 2 && v.shape[1] > 1 && v.strides[1] != 1) {
        DTensor c = out.placed[i];
        c.owner = detail::contiguous_copy(v);
        c.local = c.owner.view();
        out.placed[i] = c;
      }
    } else {
      // Only the shape and dtype are used: a data-less view of the target shape.
      DTensor meta = *x;
      meta.owner = Tensor();
      meta.placement = to;
      meta.local.data = nullptr;
      const std::vector<int64_t> s = local_shape(x->global_shape, to, n, me);
      const std::vector<int64_t> strides = [&] {
        std::vector<int64_t> st(s.size(), 1);
        for (int d = static_cast<int>(s.size()) - 2; d >= 0; --d) st[d] = st[d + 1] * s[d + 1];
        return st;
      }();
      for (std::size_t d = 0; d < s.size(); ++d) {
        meta.local.shape[d] = s[d];
        meta.local.strides[d] = strides[d];
      }
      out.placed[i] = meta;
    }
  }
  return out;
}

// Runs the local op, naming the rank and strategy in its errors.
template <typename F>
auto run_local(const Communicator& mesh, const char* op, const Prepared& p, F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    detail::fail(e.kind(), op, ": on rank ", mesh.rank(), " of ", mesh.size(), " (strategy ",
                 p.choice.strategy.name, ", local pieces): ", e.what());
  }
}

// An output of the local op as a DTensor placed `p`: its global shape is the local one with H
// restored in dim 1 for Shard(1).
DTensor output(const Tensor& t, Placement p, int64_t h) {
  std::vector<int64_t> g(t.view().shape.begin(), t.view().shape.begin() + t.ndim());
  if (p.is_shard(1)) g[1] = h;
  return DTensor::from_local(t, p, std::move(g));
}

Placement out_placement(const Prepared& p, std::size_t i) {
  return *p.choice.strategy.outputs.at(i).placement;
}

// probs as fp32 (exact): the S strategy returns grad_probs as fp32 partial dot products so the
// Partial is rounded once, after the sum over shards.
std::optional<TensorView> probs_for(const Prepared& p, const DTensor* probs, std::size_t i,
                                    Tensor& keep) {
  if (!probs) return std::nullopt;
  const TensorView& v = p.placed[i].local;
  // Only bf16/fp16 (N, topK) probs are widened: anything else (fp32, a wrong dtype or ndim) goes
  // to the kernel as it is, which accepts it or rejects it with the single-process op's message.
  if (!p.sharded() || v.ndim != 2 || (v.dtype != DType::kBF16 && v.dtype != DType::kF16)) return v;
  keep = Tensor::empty(DType::kF32, {v.shape[0], v.shape[1]});
  float* d = keep.ptr<float>();
  for (int64_t r = 0; r < v.shape[0]; ++r)
    for (int64_t k = 0; k < v.shape[1]; ++k) d[r * v.shape[1] + k] = detail::float_at(v, r, k);
  return keep.view();
}

std::optional<DTensor> grad_probs_out(const Prepared& p, const Tensor& g, const DTensor* probs) {
  if (!probs) return std::nullopt;
  DTensor d = DTensor::from_local(g, out_placement(p, 1), probs->global_shape);
  if (p.sharded()) d.dtype = probs->global_dtype();
  return d;
}

}  // namespace

PermuteResult permute(const Communicator& mesh, const PermuteArgs& args) {
  const char* op = "sharded::permute";
  const std::vector<Input> in = {{"tokens", &args.tokens}, {"indices", &args.indices}};
  const Prepared p = prepare(
      mesh, ShardedOp::kPermute, op, in, {"tokens"},
      [&](ArgSummary& s) {
        s.add("num_out_tokens is given", args.num_out_tokens.has_value(), ArgSummary::Kind::kBool);
        s.add("num_out_tokens", args.num_out_tokens.value_or(0));
        s.add("padded_mode", args.padded_mode, ArgSummary::Kind::kBool);
      },
      nullptr);
  moe_ep::PermuteResult r = run_local(mesh, op, p, [&] {
    return moe_ep::permute({.tokens = p.placed[0].local,
                            .indices = p.placed[1].local,
                            .num_out_tokens = args.num_out_tokens,
                            .padded_mode = args.padded_mode});
  });
  return {output(r.permuted_tokens, out_placement(p, 0), p.hidden),
          output(r.sorted_indices, out_placement(p, 1), p.hidden), p.choice};
}

GradTokensResult permute_grad(const Communicator& mesh, const PermuteGradArgs& args) {
  const char* op = "sharded::permute_grad";
  const std::vector<Input> in = {{"tokens", &args.tokens},
                                 {"grad_permuted_tokens", &args.grad_permuted_tokens},
                                 {"indices", &args.indices},
                                 {"sorted_indices", &args.sorted_indices}};
  const Prepared p = prepare(
      mesh, ShardedOp::kPermuteGrad, op, in, {"tokens", "grad_permuted_tokens"},
      [&](ArgSummary& s) { s.add("padded_mode", args.padded_mode, ArgSummary::Kind::kBool); },
      nullptr);
  Tensor g = run_local(mesh, op, p, [&] {
    return moe_ep::permute_grad({.tokens = p.placed[0].local,
                                 .grad_permuted_tokens = p.placed[1].local,
                                 .indices = p.placed[2].local,
                                 .sorted_indices = p.placed[3].local,
                                 .padded_mode = args.padded_mode});
  });
  return {output(g, out_placement(p, 0), p.hidden), p.choice};
}

GradTokensResult permute_grad_v2(const Communicator& mesh, const PermuteGradV2Args& args) {
  const char* op = "sharded::permute_grad_v2";
  const std::vector<Input> in = {{"grad_permuted_tokens", &args.grad_permuted_tokens},
                                 {"sorted_indices", &args.sorted_indices}};
  const Prepared p = prepare(
      mesh, ShardedOp::kPermuteGradV2, op, in, {"grad_permuted_tokens"},
      [&](ArgSummary& s) {
        s.add("tokens_rows", args.tokens_rows);
        s.add("tokens_dtype", static_cast<int64_t>(args.tokens_dtype), ArgSummary::Kind::kDType);
        s.add("num_topk", args.num_topk);
        s.add("padded_mode", args.padded_mode, ArgSummary::Kind::kBool);
      },
      nullptr);
  Tensor g = run_local(mesh, op, p, [&] {
    return moe_ep::permute_grad_v2({.grad_permuted_tokens = p.placed[0].local,
                                    .sorted_indices = p.placed[1].local,
                                    .tokens_rows = args.tokens_rows,
                                    .tokens_dtype = args.tokens_dtype,
                                    .num_topk = args.num_topk,
                                    .padded_mode = args.padded_mode});
  });
  return {output(g, out_placement(p, 0), p.hidden), p.choice};
}

namespace {

Prepared prepare_unpermute(const Communicator& mesh, ShardedOp id, const char* op,
                           const UnpermuteArgs& args) {
  const std::vector<Input> in = {{"permuted_tokens", &args.permuted_tokens},
                                 {"sorted_indices", &args.sorted_indices},
                                 {"probs", args.probs ? &*args.probs : nullptr}};
  return prepare(
      mesh, id, op, in, {"permuted_tokens"},
      [&](ArgSummary& s) {
        s.add("padded_mode", args.padded_mode, ArgSummary::Kind::kBool);
        add_restore_shape(s, args.restore_shape);
      },
      [&](int64_t h) { check_restore_shape(op, args.restore_shape, h); });
}

moe_ep::UnpermuteArgs local_unpermute(const Prepared& p, const UnpermuteArgs& args) {
  moe_ep::UnpermuteArgs a{.permuted_tokens = p.placed[0].local,
                          .sorted_indices = p.placed[1].local,
                          .probs = std::nullopt,
                          .padded_mode = args.padded_mode,
                          .restore_shape = local_restore(args.restore_shape, p.placed[0])};
  if (args.probs) a.probs = p.placed[2].local;
  return a;
}

}  // namespace

UnpermuteResult unpermute(const Communicator& mesh, const UnpermuteArgs& args) {
  const char* op = "sharded::unpermute";
  const Prepared p = prepare_unpermute(mesh, ShardedOp::kUnpermute, op, args);
  Tensor out = run_local(mesh, op, p, [&] { return moe_ep::unpermute(local_unpermute(p, args)); });
  return {output(out, out_placement(p, 0), p.hidden), p.choice};
}

UnpermuteWithSavedResult unpermute_with_saved(const Communicator& mesh, const UnpermuteArgs& args) {
  const char* op = "sharded::unpermute_with_saved";
  const Prepared p = prepare_unpermute(mesh, ShardedOp::kUnpermuteWithSaved, op, args);
  moe_ep::UnpermuteWithSavedResult r = run_local(
      mesh, op, p, [&] { return moe_ep::unpermute_with_saved(local_unpermute(p, args)); });
  return {output(r.out, out_placement(p, 0), p.hidden),
          output(r.permuted_tokens_for_backward, out_placement(p, 1), p.hidden), p.choice};
}

UnpermuteGradResult unpermute_grad(const Communicator& mesh, const UnpermuteGradArgs& args) {
  const char* op = "sharded::unpermute_grad";
  const DTensor* probs = args.probs ? &*args.probs : nullptr;
  const std::vector<Input> in = {{"permuted_tokens", &args.permuted_tokens},
                                 {"grad_out", &args.grad_out},
                                 {"sorted_indices", &args.sorted_indices},
                                 {"probs", probs}};
  const Prepared p = prepare(
      mesh, ShardedOp::kUnpermuteGrad, op, in, {"permuted_tokens", "grad_out"},
      [&](ArgSummary& s) {
        s.add("padded_mode", args.padded_mode, ArgSummary::Kind::kBool);
        add_restore_shape(s, args.restore_shape);
      },
      [&](int64_t h) { check_restore_shape(op, args.restore_shape, h); });
  Tensor probs32;
  moe_ep::UnpermuteGradResult r = run_local(mesh, op, p, [&] {
    return moe_ep::unpermute_grad(
        {.permuted_tokens = p.placed[0].local,
         .grad_out = p.placed[1].local,
         .sorted_indices = p.placed[2].local,
         .probs = probs_for(p, probs, 3, probs32),
         .padded_mode = args.padded_mode,
         .restore_shape = local_restore(args.restore_shape, p.placed[1])});
  });
  return {output(r.grad_permuted_tokens, out_placement(p, 0), p.hidden),
          grad_probs_out(p, r.grad_probs, probs), p.choice};
}

UnpermuteGradResult unpermute_grad_v2(const Communicator& mesh, const UnpermuteGradV2Args& args) {
  const char* op = "sharded::unpermute_grad_v2";
  const DTensor* probs = args.probs ? &*args.probs : nullptr;
  const DTensor* permuted = args.permuted_tokens ? &*args.permuted_tokens : nullptr;
  const std::vector<Input> in = {{"grad_out", &args.grad_out},
                                 {"sorted_indices", &args.sorted_indices},
                                 {"probs", probs},
                                 {"permuted_tokens", permuted}};
  const Prepared p = prepare(
      mesh, ShardedOp::kUnpermuteGradV2, op, in, {"grad_out", "permuted_tokens"},
      [&](ArgSummary& s) {
        s.add("permuted_rows", args.permuted_rows);
        s.add("permuted_dtype", static_cast<int64_t>(args.permuted_dtype),
              ArgSummary::Kind::kDType);
        s.add("padded_mode", args.padded_mode, ArgSummary::Kind::kBool);
        add_restore_shape(s, args.restore_shape);
      },
      [&](int64_t h) {
        check_restore_shape(op, args.restore_shape, h);
        if (probs && !permuted) invalid(op, ": permuted_tokens is required when probs is given");
        if (permuted) {
          // Checked here on the global shape: without probs the local op never sees it.
          if (permuted->global_shape[0] != args.permuted_rows)
            invalid(op, ": permuted_tokens global_shape[0] = ", permuted->global_shape[0],
                    " must equal ", args.permuted_rows, " (P, permuted_rows)");
          if (permuted->global_dtype() != args.permuted_dtype)
            invalid(op, ": permuted_tokens dtype ", dtype_name(permuted->global_dtype()),
                    " must equal permuted_dtype ", dtype_name(args.permuted_dtype));
        }
      });
  Tensor probs32;
  moe_ep::UnpermuteGradResult r = run_local(mesh, op, p, [&] {
    moe_ep::UnpermuteGradV2Args a{.grad_out = p.placed[0].local,
                                  .sorted_indices = p.placed[1].local,
                                  .permuted_rows = args.permuted_rows,
                                  .permuted_dtype = args.permuted_dtype,
                                  .probs = probs_for(p, probs, 2, probs32),
                                  .padded_mode = args.padded_mode,
                                  .restore_shape = local_restore(args.restore_shape, p.placed[0]),
                                  .permuted_tokens = std::nullopt};
    if (probs) a.permuted_tokens = p.placed[3].local;
    return moe_ep::unpermute_grad_v2(a);
  });
  return {output(r.grad_permuted_tokens, out_placement(p, 0), p.hidden),
          grad_probs_out(p, r.grad_probs, probs), p.choice};
}

}  // namespace moe_ep::sharded
