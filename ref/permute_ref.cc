#include "ref/permute_ref.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "ref/numeric.h"

namespace moe_ep::ref {

namespace {

// Element (i, j) of a float view, any strides, as fp32.
float value(const TensorView& t, int64_t i, int64_t j) {
  return load(t.dtype, t.data, i * t.strides[0] + j * t.strides[1]);
}

// Element i (1-D) or (i, j) (2-D) of an int32/int64 view, any strides.
int64_t integer(const TensorView& t, int64_t i, int64_t j = 0) {
  int64_t offset = i * t.strides[0];
  if (t.ndim == 2) offset += j * t.strides[1];
  if (t.dtype == DType::kI64) return static_cast<const int64_t*>(t.data)[offset];
  return static_cast<const int32_t*>(t.data)[offset];
}

// A running fp32 sum that the first term starts.
struct Sum {
  bool any = false;
  float total = 0.0f;
  void add(float term) {
    total = any ? total + term : term;
    any = true;
  }
};

// Entry p of a 1-D or 2-D view in row-major order.
int64_t flat_integer(const TensorView& t, int64_t p) {
  if (t.ndim == 1) return integer(t, p);
  return integer(t, p / t.shape[1], p % t.shape[1]);
}
float flat_value(const TensorView& t, int64_t p) {
  if (t.ndim == 1) return load(t.dtype, t.data, p * t.strides[0]);
  return value(t, p / t.shape[1], p % t.shape[1]);
}
int64_t entries(const TensorView& t) { return t.ndim == 1 ? t.shape[0] : t.shape[0] * t.shape[1]; }

// grad_probs' dot products (permute.h): 16 partial sums from +0, lane l adding the products of
// elements l, l+16, ... in order, then a fixed tree: lane[l] += lane[l+w] for w = 8, 4, 2, 1.
constexpr int64_t kDotLanes = 16;

}  // namespace

PermuteRefResult permute(const TensorView& tokens, const TensorView& indices,
                         std::optional<int64_t> num_out_tokens) {
  const int64_t n = tokens.shape[0], h = tokens.shape[1];
  const int64_t topk = indices.ndim == 2 ? indices.shape[1] : 1;
  const int64_t m = n * topk;

  // (expert id, entry j) pairs, stably sorted by expert id.
  std::vector<std::pair<int64_t, int64_t>> entries;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = 0; k < topk; ++k) entries.emplace_back(integer(indices, t, k), t * topk + k);
  std::stable_sort(entries.begin(), entries.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });

  int64_t rows = m;
  if (num_out_tokens.has_value() && *num_out_tokens > 0) rows = std::min(*num_out_tokens, m);
  if (num_out_tokens.has_value() && *num_out_tokens < 0) rows = m + *num_out_tokens;

  PermuteRefResult r;
  r.sorted_indices = Tensor::zeros(DType::kI32, {m});
  r.permuted_tokens = Tensor::zeros(tokens.dtype, {rows, h});
  for (int64_t p = 0; p < m; ++p) {
    const int64_t j = entries[p].second;
    r.sorted_indices.ptr<int32_t>()[j] = static_cast<int32_t>(p);
    if (p < rows)
      for (int64_t c = 0; c < h; ++c)
        store(tokens.dtype, r.permuted_tokens.data(), p * h + c, value(tokens, j / topk, c));
  }
  return r;
}

Tensor permute_grad(const TensorView& grad_permuted_tokens, const TensorView& sorted_indices,
                    int64_t tokens_rows, int64_t num_topk, DType tokens_dtype) {
  const int64_t rows = grad_permuted_tokens.shape[0], h = grad_permuted_tokens.shape[1];
  Tensor out = Tensor::zeros(tokens_dtype, {tokens_rows, h});
  for (int64_t i = 0; i < tokens_rows; ++i)
    for (int64_t c = 0; c < h; ++c) {
      Sum sum;
      for (int64_t k = 0; k < num_topk; ++k) {
        const int64_t s = integer(sorted_indices, i * num_topk + k);
        if (s < rows) sum.add(value(grad_permuted_tokens, s, c));
      }
      store(tokens_dtype, out.data(), i * h + c, sum.total);
    }
  return out;
}

Tensor unpermute(const TensorView& permuted_tokens, const TensorView& sorted_indices,
                 const std::optional<TensorView>& probs) {
  const int64_t p_rows = permuted_tokens.shape[0], h = permuted_tokens.shape[1];
  const int64_t m = sorted_indices.shape[0];
  const int64_t n = probs ? probs->shape[0] : m;
  const int64_t topk = probs ? probs->shape[1] : 1;
  const DType dtype = permuted_tokens.dtype;
  Tensor out = Tensor::zeros(dtype, {n, h});
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < h; ++c) {
      if (!probs) {  // no reduction: out[i] = permuted[S[i]], or 0 when dropped
        const int64_t s = integer(sorted_indices, i);
        store(dtype, out.data(), i * h + c, s < p_rows ? value(permuted_tokens, s, c) : 0.0f);
        continue;
      }
      Sum sum;
      for (int64_t k = 0; k < topk; ++k) {
        const int64_t s = integer(sorted_indices, i * topk + k);
        if (s >= p_rows) continue;
        const float term = value(*probs, i, k) * value(permuted_tokens, s, c);
        sum.add(term);
      }
      store(dtype, out.data(), i * h + c, sum.total);
    }
  return out;
}

UnpermuteGradRefResult unpermute_grad(const TensorView& grad_out, const TensorView& sorted_indices,
                                      int64_t permuted_rows, DType permuted_dtype,
                                      const std::optional<TensorView>& probs,
                                      const std::optional<TensorView>& permuted_tokens) {
  const int64_t n = grad_out.shape[0], h = grad_out.shape[1];
  const int64_t topk = probs ? probs->shape[1] : 1;
  UnpermuteGradRefResult r;
  r.grad_permuted_tokens = Tensor::zeros(permuted_dtype, {permuted_rows, h});  // unreferenced: 0
  if (probs) r.grad_probs = Tensor::zeros(probs->dtype, {n, topk});

  for (int64_t j = 0; j < n * topk; ++j) {
    const int64_t i = j / topk, k = j % topk;
    const int64_t s = integer(sorted_indices, j);
    if (s >= permuted_rows) {
      if (probs) store(probs->dtype, r.grad_probs.data(), j, 0.0f);
      continue;
    }
    for (int64_t c = 0; c < h; ++c) {
      const float g = value(grad_out, i, c);
      const float v = probs ? g * value(*probs, i, k) : g;
      store(permuted_dtype, r.grad_permuted_tokens.data(), s * h + c, v);
    }
    if (probs) {
      float lane[kDotLanes] = {};  // +0
      for (int64_t c = 0; c < h; ++c) {
        const float term = value(grad_out, i, c) * value(*permuted_tokens, s, c);
        lane[c % kDotLanes] = lane[c % kDotLanes] + term;
      }
      for (int64_t w = kDotLanes / 2; w >= 1; w /= 2)
        for (int64_t l = 0; l < w; ++l) lane[l] = lane[l] + lane[l + w];
      store(probs->dtype, r.grad_probs.data(), j, lane[0]);
    }
  }
  return r;
}

PermuteRefResult permute_padded(const TensorView& tokens, const TensorView& table) {
  const int64_t m = entries(table), h = tokens.shape[1];
  PermuteRefResult r;
  r.sorted_indices = Tensor::zeros(
      DType::kI32, std::vector<int64_t>(table.shape.begin(), table.shape.begin() + table.ndim));
  r.permuted_tokens = Tensor::zeros(tokens.dtype, {m, h});
  for (int64_t p = 0; p < m; ++p) {
    const int64_t t = flat_integer(table, p);
    r.sorted_indices.ptr<int32_t>()[p] = static_cast<int32_t>(t);
    for (int64_t c = 0; c < h; ++c)
      store(tokens.dtype, r.permuted_tokens.data(), p * h + c, value(tokens, t, c));
  }
  return r;
}

Tensor scatter_padded(const TensorView& src, const TensorView& table,
                      const std::optional<TensorView>& probs, int64_t n, DType out_dtype) {
  const int64_t m = entries(table), h = src.shape[1];
  Tensor out = Tensor::zeros(out_dtype, {n, h});
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < h; ++c) {
      Sum sum;
      for (int64_t p = 0; p < m; ++p) {
        if (flat_integer(table, p) != t) continue;
        sum.add(probs ? flat_value(*probs, p) * value(src, p, c) : value(src, p, c));
      }
      store(out_dtype, out.data(), t * h + c, sum.total);
    }
  return out;
}

UnpermuteGradRefResult unpermute_grad_padded(const TensorView& grad_out, const TensorView& table,
                                             DType permuted_dtype,
                                             const std::optional<TensorView>& probs,
                                             const std::optional<TensorView>& permuted_tokens) {
  const int64_t m = entries(table), h = grad_out.shape[1];
  UnpermuteGradRefResult r;
  r.grad_permuted_tokens = Tensor::zeros(permuted_dtype, {m, h});
  if (probs) {
    std::vector<int64_t> shape(probs->shape.begin(), probs->shape.begin() + probs->ndim);
    r.grad_probs = Tensor::zeros(probs->dtype, shape);
  }
  for (int64_t p = 0; p < m; ++p) {
    const int64_t t = flat_integer(table, p);
    for (int64_t c = 0; c < h; ++c) {
      const float g = value(grad_out, t, c);
      store(permuted_dtype, r.grad_permuted_tokens.data(), p * h + c,
            probs ? g * flat_value(*probs, p) : g);
    }
    if (!probs) continue;
    float lane[kDotLanes] = {};
    for (int64_t c = 0; c < h; ++c) {
      const float term = value(grad_out, t, c) * value(*permuted_tokens, p, c);
      lane[c % kDotLanes] = lane[c % kDotLanes] + term;
    }
    for (int64_t w = kDotLanes / 2; w >= 1; w /= 2)
      for (int64_t l = 0; l < w; ++l) lane[l] = lane[l] + lane[l + w];
    store(probs->dtype, r.grad_probs.data(), p, lane[0]);
  }
  return r;
}

}  // namespace moe_ep::ref
