// SPEC §4.1's padded_mode, Megatron-LM's capacity layout (permute_with_padded_tokens and
// unpermute_with_padded_tokens): indices is a table of token ids, one per capacity slot
// (typically (num_experts, capacity)), and permute is a plain gather of those rows. Its
// sorted_indices is the table itself (int32, in the table's shape, as Megatron-LM's
// sorted_indices = indices); unpermute sums each token's slots back,
// weighted by probs (one weight per slot). Every slot is kept: there is nothing to drop.
//
// Where Megatron-LM is silent or non-deterministic (scatter_add), moe-ep fixes the order: a
// token's slots are summed in increasing slot order, in fp32, as SPEC §4.2's sums are (the first
// term starts the sum, products rounded to fp32, one rounding).
#include "core/permute_padded.h"

#include <algorithm>
#include <string>
#include <vector>

#include "base/check.h"
#include "core/validate.h"
#include "kernels/cpu/permute.h"

namespace moe_ep::detail {
namespace {

// The slot count, like sorted_indices' M, must fit int32.
constexpr int64_t kSlotLimit = int64_t{1} << 31;

// "[2,5]" for entry j of a 2-D (rows, cols) table, "[j]" for a 1-D one.
std::string slot_name(const TensorView& t, int64_t j) {
  std::string s = "[";
  if (t.ndim == 2 && t.shape[1] > 0) {
    s += std::to_string(j / t.shape[1]);
    s += ",";
    s += std::to_string(j % t.shape[1]);
  } else {
    s += std::to_string(j);
  }
  s += "]";
  return s;
}

int64_t element_count(const char* op, const char* name, const TensorView& t) {
  int64_t m = 1;
  for (int d = 0; d < t.ndim; ++d)
    if (__builtin_mul_overflow(m, t.shape[d], &m) || m > kSlotLimit)
      invalid(op, ": ", name, " has more than ", kSlotLimit, " entries (padded_mode)");
  return m;
}

// A table of token ids (indices, or sorted_indices in padded mode): int32/int64, 1-D or 2-D, any
// strides, every value in [0, n). Returns the ids flattened in row-major order.
std::vector<int32_t> token_ids(const char* op, const char* name, const TensorView& t, int64_t n,
                               const char* n_what) {
  expect_dtype(op, name, t, {DType::kI32, DType::kI64});
  if (t.ndim != 1 && t.ndim != 2)
    invalid(op, ": ", name, ".ndim = ", t.ndim,
            " must be 1 or 2 (padded_mode: a table of token ids)");
  expect_memory(op, name, t);
  const int64_t m = element_count(op, name, t);
  const int64_t cols = t.ndim == 2 ? t.shape[1] : 1;
  std::vector<int32_t> ids(static_cast<std::size_t>(m));
  for (int64_t j = 0; j < m; ++j) {
    const int64_t v = index_at(t, j / cols, j % cols);
    if (v < 0 || v >= n)
      invalid(op, ": ", name, slot_name(t, j), " = ", v, " is outside [0, ", n, ") (token ids, ",
              n_what, "; padded_mode)");
    ids[static_cast<std::size_t>(j)] = static_cast<int32_t>(v);
  }
  return ids;
}

// probs in padded mode: one weight per slot, 1-D or 2-D (the shape of indices), bf16/fp16/fp32,
// any strides. Returns the weights as fp32, flattened.
std::vector<float> slot_weights(const char* op, const TensorView& probs, int64_t m,
                                const char* m_what) {
  expect_dtype(op, "probs", probs, {DType::kBF16, DType::kF16, DType::kF32});
  if (probs.ndim != 1 && probs.ndim != 2)
    invalid(op, ": probs.ndim = ", probs.ndim,
            " must be 1 or 2 (padded_mode: one weight per slot)");
  expect_memory(op, "probs", probs);
  const int64_t count = element_count(op, "probs", probs);
  if (count != m)
    invalid(op, ": probs has ", count, " entries, must equal ", m, " (", m_what,
            "; padded_mode: one weight per slot)");
  const int64_t cols = probs.ndim == 2 ? probs.shape[1] : 1;
  std::vector<float> w(static_cast<std::size_t>(m));
  for (int64_t j = 0; j < m; ++j)
    w[static_cast<std::size_t>(j)] = float_at(probs, j / cols, j % cols);
  return w;
}

// The rows of the permuted side must be the slots: one row per token id.
void expect_slot_rows(const char* op, const char* rows_name, int64_t rows, int64_t m,
                      const char* m_what) {
  if (rows != m)
    invalid(op, ": ", rows_name, " = ", rows, " must equal ", m, " (", m_what,
            "; padded_mode: one row per slot)");
}

// restore_shape = [N, H]: required by unpermute (it alone gives N), checked when given elsewhere.
void check_restore_shape(const char* op, const std::vector<int64_t>& r, int64_t h) {
  std::string got = "[";
  for (std::size_t d = 0; d < r.size(); ++d) got += (d ? ", " : "") + std::to_string(r[d]);
  got += "]";
  if (r.size() != 2 || r[0] < 0 || r[1] != h)
    invalid(op, ": restore_shape = ", got, " must be [N, ", h,
            "] with N >= 0 (the output shape; H = ", h, ")");
}

Tensor scatter_sum(const char* op, const TensorView& src, const std::vector<int32_t>& ids,
                   int64_t n, DType out_dtype, const float* w, const char* out_what) {
  const int64_t h = src.shape[1];
  check_output_size(op, out_what, n, h, out_dtype);
  Tensor out = Tensor::empty(out_dtype, {n, h});
  if (n > 0 && h > 0)
    scatter_sum_rows(static_cast<char*>(out.data()), out_dtype, src, ids.data(), n,
                     static_cast<int64_t>(ids.size()), w);
  return out;
}

// unpermute_grad / unpermute_grad_v2 once their tensors are checked: g (N, H); p slots; x read
// only with probs.
UnpermuteGradResult unpermute_grad_common(const char* op, const TensorView& g,
                                          const TensorView& sorted_indices, int64_t p, DType dtype,
                                          const std::optional<TensorView>& probs,
                                          const TensorView* x,
                                          const std::optional<std::vector<int64_t>>& restore_shape,
                                          const char* p_what) {
  const int64_t n = g.shape[0], h = g.shape[1];
  if (restore_shape) {
    check_restore_shape(op, *restore_shape, h);
    if ((*restore_shape)[0] != n)
      invalid(op, ": restore_shape[0] = ", (*restore_shape)[0], " must equal N = ", n,
              " (grad_out.shape[0])");
  }
  const std::vector<int32_t> ids =
      token_ids(op, "sorted_indices", sorted_indices, n, "N = grad_out.shape[0]");
  const int64_t m = static_cast<int64_t>(ids.size());
  expect_slot_rows(op, p_what, p, m, "the entries of sorted_indices");
  std::vector<float> w;
  if (probs) w = slot_weights(op, *probs, m, "the entries of sorted_indices");
  check_output_size(op, "grad_permuted_tokens shape", p, h, dtype);

  UnpermuteGradResult res;
  res.grad_permuted_tokens = Tensor::empty(dtype, {p, h});
  if (probs) {
    std::vector<int64_t> shape(probs->shape.begin(), probs->shape.begin() + probs->ndim);
    res.grad_probs = Tensor::zeros(probs->dtype, shape);  // the dots along H = 0 are +0
  }
  if (h > 0)
    padded_unpermute_grad_rows(static_cast<char*>(res.grad_permuted_tokens.data()), dtype,
                               probs ? res.grad_probs.data() : nullptr,
                               probs ? probs->dtype : dtype, g, ids.data(), m,
                               probs ? w.data() : nullptr, x);
  return res;
}

}  // namespace

PermuteResult permute_padded(const PermuteArgs& args) {
  const char* op = "permute";
  const TensorView& tokens = args.tokens;
  expect_rows(op, "tokens", tokens);
  const int64_t n = tokens.shape[0], h = tokens.shape[1];
  const std::vector<int32_t> ids = token_ids(op, "indices", args.indices, n, "N = tokens.shape[0]");
  const int64_t m = static_cast<int64_t>(ids.size());
  if (args.num_out_tokens && *args.num_out_tokens != 0 && *args.num_out_tokens != m)
    invalid(op, ": num_out_tokens = ", *args.num_out_tokens, " must be None, 0 or ", m,
            " (the entries of indices; padded_mode keeps every slot)");
  check_output_size(op, "permuted_tokens shape (slots, H)", m, h, tokens.dtype);
  PermuteResult res;
  // sorted_indices = indices (SPEC §4.1): the table in its own shape, (num_experts, capacity)
  // for a 2-D table, (M,) for a 1-D one.
  res.sorted_indices = Tensor::empty(
      DType::kI32, std::vector<int64_t>(args.indices.shape.begin(),
                                        args.indices.shape.begin() + args.indices.ndim));
  std::copy(ids.begin(), ids.end(), res.sorted_indices.ptr<int32_t>());
  res.permuted_tokens = Tensor::empty(tokens.dtype, {m, h});
  if (h > 0) gather_rows(static_cast<char*>(res.permuted_tokens.data()), tokens, ids.data(), m);
  return res;
}

Tensor permute_grad_padded(const PermuteGradArgs& args) {
  const char* op = "permute_grad";
  const TensorView& tokens = args.tokens;
  const TensorView& grad = args.grad_permuted_tokens;
  expect_dtype(op, "tokens", tokens, {DType::kBF16, DType::kF16, DType::kF32});
  expect_ndim(op, "tokens", tokens, 2);
  expect_shape(op, "tokens", tokens);
  const int64_t n = tokens.shape[0], h = tokens.shape[1];
  expect_rows(op, "grad_permuted_tokens", grad);
  check_same_dtype(op, "grad_permuted_tokens", grad.dtype, "tokens dtype", tokens.dtype);
  expect_size(op, "grad_permuted_tokens", grad, 1, h, "H, tokens.shape[1]");
  const std::vector<int32_t> ids =
      token_ids(op, "sorted_indices", args.sorted_indices, n, "N = tokens.shape[0]");
  const std::vector<int32_t> table =
      token_ids(op, "indices", args.indices, n, "N = tokens.shape[0]");
  // In padded mode permute's sorted_indices is indices itself (in its shape, or flattened: the
  // entries are compared in row-major order); two different tables mean the caller mixed up two
  // layers' tensors.
  if (table.size() != ids.size())
    invalid(op, ": indices has ", table.size(), " entries, sorted_indices ", ids.size(),
            " (padded_mode: sorted_indices is indices)");
  for (std::size_t j = 0; j < ids.size(); ++j)
    if (table[j] != ids[j])
      invalid(op, ": sorted_indices", slot_name(args.sorted_indices, static_cast<int64_t>(j)),
              " = ", ids[j], " differs from indices",
              slot_name(args.indices, static_cast<int64_t>(j)), " = ", table[j],
              " (padded_mode: sorted_indices is indices)");
  expect_slot_rows(op, "grad_permuted_tokens.shape[0]", grad.shape[0],
                   static_cast<int64_t>(ids.size()), "the entries of sorted_indices");
  return scatter_sum(op, grad, ids, n, tokens.dtype, nullptr, "grad_tokens shape (N, H)");
}

Tensor permute_grad_v2_padded(const PermuteGradV2Args& args) {
  const char* op = "permute_grad_v2";
  const TensorView& grad = args.grad_permuted_tokens;
  expect_rows(op, "grad_permuted_tokens", grad);
  if (args.tokens_rows < 0) invalid(op, ": tokens_rows = ", args.tokens_rows, " must be >= 0");
  if (args.num_topk < 1) invalid(op, ": num_topk = ", args.num_topk, " must be >= 1");
  check_float_dtype(op, "tokens_dtype", args.tokens_dtype);
  check_same_dtype(op, "grad_permuted_tokens", grad.dtype, "tokens_dtype", args.tokens_dtype);
  const std::vector<int32_t> ids =
      token_ids(op, "sorted_indices", args.sorted_indices, args.tokens_rows, "N = tokens_rows");
  expect_slot_rows(op, "grad_permuted_tokens.shape[0]", grad.shape[0],
                   static_cast<int64_t>(ids.size()), "the entries of sorted_indices");
  return scatter_sum(op, grad, ids, args.tokens_rows, args.tokens_dtype, nullptr,
                     "grad_tokens shape (tokens_rows, H)");
}

UnpermuteWithSavedResult unpermute_padded(const char* op, const UnpermuteArgs& args, bool save) {
  const TensorView& x = args.permuted_tokens;
  expect_rows(op, "permuted_tokens", x);
  const int64_t p = x.shape[0], h = x.shape[1];
  if (!args.restore_shape)
    invalid(op, ": restore_shape is missing; padded_mode needs it (its [0] is N, the output rows)");
  check_restore_shape(op, *args.restore_shape, h);
  const int64_t n = (*args.restore_shape)[0];
  const std::vector<int32_t> ids =
      token_ids(op, "sorted_indices", args.sorted_indices, n, "N = restore_shape[0]");
  const int64_t m = static_cast<int64_t>(ids.size());
  expect_slot_rows(op, "permuted_tokens.shape[0]", p, m, "the entries of sorted_indices");
  std::vector<float> w;
  if (args.probs) w = slot_weights(op, *args.probs, m, "the entries of sorted_indices");
  UnpermuteWithSavedResult res;
  if (save) check_output_size(op, "permuted_tokens.shape", p, h, x.dtype);
  res.out = scatter_sum(op, x, ids, n, x.dtype, args.probs ? w.data() : nullptr,
                        "out shape restore_shape");
  if (save) {
    res.permuted_tokens_for_backward = Tensor::empty(x.dtype, {p, h});
    copy_rows(static_cast<char*>(res.permuted_tokens_for_backward.data()), x);
  }
  return res;
}

UnpermuteGradResult unpermute_grad_padded(const UnpermuteGradArgs& args) {
  const char* op = "unpermute_grad";
  const TensorView& g = args.grad_out;
  const TensorView& x = args.permuted_tokens;
  expect_rows(op, "grad_out", g);
  if (args.probs) {
    expect_rows(op, "permuted_tokens", x);
  } else {  // only its shape is used
    expect_dtype(op, "permuted_tokens", x, {DType::kBF16, DType::kF16, DType::kF32});
    expect_ndim(op, "permuted_tokens", x, 2);
    expect_shape(op, "permuted_tokens", x);
  }
  check_same_dtype(op, "grad_out", g.dtype, "permuted_tokens dtype", x.dtype);
  expect_size(op, "permuted_tokens", x, 1, g.shape[1], "H, grad_out.shape[1]");
  return unpermute_grad_common(op, g, args.sorted_indices, x.shape[0], x.dtype, args.probs, &x,
                               args.restore_shape, "permuted_tokens.shape[0]");
}

UnpermuteGradResult unpermute_grad_v2_padded(const UnpermuteGradV2Args& args) {
  const char* op = "unpermute_grad_v2";
  const TensorView& g = args.grad_out;
  expect_rows(op, "grad_out", g);
  if (args.permuted_rows < 0)
    invalid(op, ": permuted_rows = ", args.permuted_rows, " must be >= 0");
  check_float_dtype(op, "permuted_dtype", args.permuted_dtype);
  check_same_dtype(op, "grad_out", g.dtype, "permuted_dtype", args.permuted_dtype);
  if (args.probs && !args.permuted_tokens)
    invalid(op,
            ": permuted_tokens is missing; it is required when probs is given (grad_probs = "
            "dot(grad_out, permuted_tokens))");
  if (args.permuted_tokens) {
    const TensorView& x = *args.permuted_tokens;
    expect_rows(op, "permuted_tokens", x);
    check_same_dtype(op, "permuted_tokens", x.dtype, "permuted_dtype", args.permuted_dtype);
    expect_size(op, "permuted_tokens", x, 0, args.permuted_rows, "P, permuted_rows");
    expect_size(op, "permuted_tokens", x, 1, g.shape[1], "H, grad_out.shape[1]");
  }
  return unpermute_grad_common(op, g, args.sorted_indices, args.permuted_rows, args.permuted_dtype,
                               args.probs, args.probs ? &*args.permuted_tokens : nullptr,
                               args.restore_shape, "permuted_rows");
}

}  // namespace moe_ep::detail
