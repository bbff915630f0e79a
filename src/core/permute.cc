// SPEC §4: token permute / unpermute and their gradients: argument checks, the stable argsort of
// permute, then the row kernels (kernels/cpu/permute.h).
#include "moe_ep/permute.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "base/check.h"
#include "base/threads.h"
#include "core/permute_padded.h"
#include "core/validate.h"
#include "kernels/cpu/permute.h"

namespace moe_ep {
namespace {

using detail::check_float_dtype;
using detail::check_output_size;
using detail::check_same_dtype;
using detail::expect_dtype;
using detail::expect_memory;
using detail::expect_ndim;
using detail::expect_rows;
using detail::expect_shape;
using detail::expect_size;
using detail::expect_tensor;
using detail::index_at;
using detail::invalid;
using detail::kParallelMinWork;
using detail::sorted_at;

// Expert ids and M = N*topK must fit the int32 sorted_indices: values 0 .. 2^31 - 1.
constexpr int64_t kIndexLimit = int64_t{1} << 31;
// Key ranges up to this size are sorted by a counting sort; larger ones by std::stable_sort.
constexpr int64_t kCountingSortMaxKeys = int64_t{1} << 16;
// Below this many entries the counting sort runs on one thread (no per-thread histograms).
constexpr int64_t kParallelSortMinEntries = int64_t{1} << 14;
// Per-thread scratch (permute's sort keys and order) is kept between calls up to this size, so a
// steady stream of calls allocates nothing but its outputs; a larger one-off is released.
constexpr std::size_t kKeepScratchBytes = std::size_t{64} << 20;

template <typename T>
void release_if_large(std::vector<T>& v) {
  if (v.capacity() * sizeof(T) > kKeepScratchBytes) std::vector<T>().swap(v);
}

// M = rows * topk; sorted_indices is int32, so M may not exceed 2^31.
int64_t checked_entries(const char* op, int64_t rows, int64_t topk, const char* what) {
  if (topk > 0 && rows > kIndexLimit / topk)
    invalid(op, ": ", what, " = ", rows, " * ", topk, " exceeds ", kIndexLimit,
            " (sorted_indices is int32)");
  return rows * topk;
}

// indices: (N,) or (N, topK) int32/int64; returns topK.
int64_t check_indices_shape(const char* op, const TensorView& indices, int64_t n) {
  expect_dtype(op, "indices", indices, {DType::kI32, DType::kI64});
  if (indices.ndim != 1 && indices.ndim != 2)
    invalid(op, ": indices.ndim = ", indices.ndim, " must be 1 or 2");
  expect_size(op, "indices", indices, 0, n, "N, tokens.shape[0]");
  const int64_t topk = indices.ndim == 2 ? indices.shape[1] : 1;
  if (topk < 1) invalid(op, ": indices.shape[1] = ", topk, " must be >= 1 (topK)");
  return topk;
}

// probs: (N, topK) bf16/fp16/fp32, any strides; returns topK.
int64_t check_probs(const char* op, const TensorView& probs) {
  expect_tensor(op, "probs", probs, {DType::kBF16, DType::kF16, DType::kF32}, 2);
  if (probs.shape[1] < 1)
    invalid(op, ": probs.shape[1] = ", probs.shape[1], " must be >= 1 (topK)");
  return probs.shape[1];
}

void check_sorted_indices_shape(const char* op, const TensorView& si, int64_t m, const char* what) {
  expect_dtype(op, "sorted_indices", si, {DType::kI32});
  expect_ndim(op, "sorted_indices", si, 1);
  expect_size(op, "sorted_indices", si, 0, m, what);
  expect_memory(op, "sorted_indices", si);
}

// With probs (N, topK) checked (check_probs): M = N*topK, and sorted_indices of shape (M,), whose
// message says where M comes from ("M = N*topK from probs.shape (4, 3)") so that a probs of the
// wrong width is recognisable as such. Returns M.
int64_t check_sorted_indices_for_probs(const char* op, const TensorView& si,
                                       const TensorView& probs) {
  const int64_t m = checked_entries(op, probs.shape[0], probs.shape[1], "N*topK (probs.shape)");
  const bool fits = si.ndim == 1 && si.shape[0] == m;  // else the message is needed
  check_sorted_indices_shape(
      op, si, m,
      fits ? ""
           : ("M = N*topK from probs.shape (" + std::to_string(probs.shape[0]) + ", " +
              std::to_string(probs.shape[1]) + ")")
                 .c_str());
  return m;
}

[[noreturn]] void sorted_out_of_range(const char* op, const TensorView& si, int64_t bound,
                                      const char* bound_what) {
  const int64_t m = si.shape[0];
  for (int64_t j = 0; j < m; ++j) {
    const int64_t s = sorted_at(si, j);
    if (s < 0 || s >= bound)
      invalid(op, ": sorted_indices[", j, "] = ", s, " is outside [0, ", bound, ") (", bound_what,
              ")");
  }
  MOE_EP_CHECK(false);
}

// Every value in [0, bound). Parallel scan; the serial rescan only runs to name the first bad one.
void check_sorted_range(const char* op, const TensorView& si, int64_t bound,
                        const char* bound_what) {
  const int64_t m = si.shape[0];
  bool bad = false;
  const int team = detail::threads_if(m >= kParallelMinWork);
#pragma omp parallel for schedule(static) reduction(|| : bad) num_threads(team)
  for (int64_t j = 0; j < m; ++j) {
    const int64_t s = sorted_at(si, j);
    bad = bad || s < 0 || s >= bound;
  }
  if (bad) sorted_out_of_range(op, si, bound, bound_what);
}

[[noreturn]] void sorted_duplicate(const char* op, const TensorView& si) {
  std::unordered_map<int64_t, int64_t> first_at;
  for (int64_t j = 0; j < si.shape[0]; ++j) {
    const int64_t s = sorted_at(si, j);
    const auto [it, fresh] = first_at.emplace(s, j);
    if (!fresh)
      invalid(op, ": sorted_indices[", j, "] = ", s, " duplicates sorted_indices[", it->second,
              "] (values must be distinct)");
  }
  MOE_EP_CHECK(false);
}

// Every value in [0, bound) and distinct (SPEC §4.2). Returns the set of values as a bitmap of
// `bound` bits, which the gradient reuses to find the rows nothing refers to; when `bound` is so
// much larger than M that the bitmap would dwarf the input, a sort finds repeats instead and the
// returned bitmap is empty.
std::vector<uint64_t> check_sorted_distinct(const char* op, const TensorView& si, int64_t bound,
                                            const char* bound_what) {
  check_sorted_range(op, si, bound, bound_what);
  const int64_t m = si.shape[0];
  if (bound > 64 * m + 65536) {
    std::vector<int32_t> values(static_cast<std::size_t>(m));
    for (int64_t j = 0; j < m; ++j) values[static_cast<std::size_t>(j)] = sorted_at(si, j);
    std::sort(values.begin(), values.end());
    if (std::adjacent_find(values.begin(), values.end()) != values.end()) sorted_duplicate(op, si);
    return {};
  }
  std::vector<uint64_t> seen(static_cast<std::size_t>((bound + 63) / 64), 0);
  for (int64_t j = 0; j < m; ++j) {
    const int64_t s = sorted_at(si, j);
    uint64_t& word = seen[static_cast<std::size_t>(s >> 6)];
    const uint64_t bit = uint64_t{1} << (s & 63);
    if (word & bit) sorted_duplicate(op, si);
    word |= bit;
  }
  return seen;
}

void check_restore_shape(const char* op, const std::optional<std::vector<int64_t>>& restore_shape,
                         int64_t n, int64_t h) {
  if (!restore_shape) return;
  const std::vector<int64_t>& r = *restore_shape;
  if (r.size() == 2 && r[0] == n && r[1] == h) return;
  std::string got = "[";
  for (std::size_t d = 0; d < r.size(); ++d) got += (d ? ", " : "") + std::to_string(r[d]);
  got += "]";
  invalid(op, ": restore_shape = ", got, " must equal [", n, ", ", h, "] (the output shape)");
}

// Stable argsort of keys[0..m) (values in [0, max_key]) into order[0..m) (m <= 2^31, so the
// positions fit int32). hist is scratch.
void stable_argsort(const std::vector<int32_t>& keys, int64_t max_key, std::vector<int32_t>& order,
                    std::vector<int64_t>& hist) {
  const int64_t m = static_cast<int64_t>(keys.size());
  order.resize(static_cast<std::size_t>(m));
  if (m == 0) return;
  const int64_t num_keys = max_key + 1;
  if (num_keys > kCountingSortMaxKeys) {
    std::iota(order.begin(), order.end(), int32_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&keys](int32_t a, int32_t b) { return keys[a] < keys[b]; });
    return;
  }
  // Counting sort over `chunks` contiguous slices of the input: chunk c's entries with key e go
  // after every entry with a smaller key and after chunk c' < c's entries with key e, which is
  // exactly the stable order whatever the chunk count.
  const int64_t chunks =
      m < kParallelSortMinEntries ? 1 : std::min<int64_t>(detail::op_threads(), m / 4096);
  hist.assign(static_cast<std::size_t>(chunks * num_keys), 0);
  const int team = static_cast<int>(chunks);  // one thread per chunk
#pragma omp parallel for schedule(static) num_threads(team)
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t* h = hist.data() + c * num_keys;
    for (int64_t j = c * m / chunks; j < (c + 1) * m / chunks; ++j) ++h[keys[j]];
  }
  int64_t next = 0;
  for (int64_t e = 0; e < num_keys; ++e)
    for (int64_t c = 0; c < chunks; ++c) {
      int64_t& h = hist[static_cast<std::size_t>(c * num_keys + e)];
      const int64_t count = h;
      h = next;
      next += count;
    }
#pragma omp parallel for schedule(static) num_threads(team)
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t* h = hist.data() + c * num_keys;
    for (int64_t j = c * m / chunks; j < (c + 1) * m / chunks; ++j)
      order[h[keys[j]]++] = static_cast<int32_t>(j);
  }
}

// grad_tokens[i] = sum over k of grad[S[i*topk+k]] for S < R (SPEC §4.3), shared by permute_grad
// and permute_grad_v2 after validation.
Tensor permute_grad_kernel(const char* op, const TensorView& grad, const TensorView& si, int64_t n,
                           int64_t topk, DType out_dtype) {
  const int64_t h = grad.shape[1];
  check_output_size(op, "grad_tokens shape (tokens_rows, H)", n, h, out_dtype);
  Tensor out = Tensor::empty(out_dtype, {n, h});
  if (h == 0 || n == 0) return out;
  detail::permute_grad_rows(static_cast<char*>(out.data()), out_dtype, grad, si, n, topk);
  return out;
}

// The checks unpermute_grad and unpermute_grad_v2 share once q's tensors, n, h, p and dtype are
// set: probs (N, topK) gives topK (1 without probs), sorted_indices has M = N*topK distinct values
// in [0, max(P, M)). Sets q.topk and q.seen. `out_what` and `bound_what` name P in messages.
void check_unpermute_grad_entries(const char* op, detail::UnpermuteGradProblem& q,
                                  const std::optional<std::vector<int64_t>>& restore_shape,
                                  const char* out_what, const char* bound_what) {
  const TensorView& si = *q.sorted_indices;
  int64_t m = q.n;
  if (q.probs) {
    q.topk = check_probs(op, *q.probs);
    expect_size(op, "probs", *q.probs, 0, q.n, "N, grad_out.shape[0]");
    m = check_sorted_indices_for_probs(op, si, *q.probs);
  } else {
    check_sorted_indices_shape(op, si, q.n, "N = grad_out.shape[0]; topK = 1 without probs");
  }
  check_restore_shape(op, restore_shape, q.n, q.h);
  check_output_size(op, out_what, q.p, q.h, q.dtype);
  q.seen = check_sorted_distinct(op, si, std::max(q.p, m), bound_what);
}

UnpermuteWithSavedResult unpermute_impl(const char* op, const UnpermuteArgs& args, bool save) {
  if (args.padded_mode) return detail::unpermute_padded(op, args, save);
  const TensorView& x = args.permuted_tokens;
  const TensorView& si = args.sorted_indices;
  expect_rows(op, "permuted_tokens", x);
  const int64_t p = x.shape[0], h = x.shape[1];
  int64_t n = 0, topk = 1, m = 0;
  if (args.probs) {
    topk = check_probs(op, *args.probs);
    n = args.probs->shape[0];
    m = check_sorted_indices_for_probs(op, si, *args.probs);
  } else {  // topK = 1: N = M = sorted_indices.shape[0] (read only after the ndim check passes)
    m = n = si.shape[0];
    check_sorted_indices_shape(op, si, m, "M");
  }
  check_restore_shape(op, args.restore_shape, n, h);
  check_sorted_distinct(op, si, std::max(p, m), "max(P, M), P = permuted_tokens.shape[0]");

  check_output_size(op, "out shape (N, H)", n, h, x.dtype);
  if (save) check_output_size(op, "permuted_tokens.shape", p, h, x.dtype);
  UnpermuteWithSavedResult res;
  res.out = Tensor::empty(x.dtype, {n, h});
  if (save) {
    res.permuted_tokens_for_backward = Tensor::empty(x.dtype, {p, h});
    detail::copy_rows(static_cast<char*>(res.permuted_tokens_for_backward.data()), x);
  }
  if (h == 0) return res;
  detail::unpermute_rows(static_cast<char*>(res.out.data()), x, si, n, topk,
                         args.probs ? &*args.probs : nullptr);
  return res;
}

}  // namespace

PermuteResult permute(const PermuteArgs& args) {
  if (args.padded_mode) return detail::permute_padded(args);
  const char* op = "permute";
  const TensorView& tokens = args.tokens;
  const TensorView& indices = args.indices;
  expect_rows(op, "tokens", tokens);
  const int64_t n = tokens.shape[0], h = tokens.shape[1];
  const int64_t topk = check_indices_shape(op, indices, n);
  expect_memory(op, "indices", indices);
  const int64_t m = checked_entries(op, n, topk, "M = N*topK");

  int64_t rows = m;
  if (args.num_out_tokens) {
    const int64_t want = *args.num_out_tokens;
    if (want < -m)
      invalid(op, ": num_out_tokens = ", want, " is below -M = ", -m,
              " (M = N*topK; a negative value drops that many rows)");
    rows = want > 0 ? std::min(want, m) : m + want;
  }

  // Flatten the expert ids (entry j = token*topK + k) and check them in one parallel pass. The
  // scratch vectors are per thread and kept between calls (see kKeepScratchBytes).
  // (References, not the thread_local objects, are used inside the parallel regions: there each
  // thread would name its own.)
  thread_local std::vector<int32_t> tl_keys, tl_order;
  thread_local std::vector<int64_t> tl_hist;
  std::vector<int32_t>& keys = tl_keys;
  std::vector<int32_t>& order = tl_order;
  std::vector<int64_t>& hist = tl_hist;
  keys.resize(static_cast<std::size_t>(m));
  bool bad = false;
  int64_t max_key = 0;
  const int team = detail::threads_if(m >= kParallelMinWork);
#pragma omp parallel for schedule(static) reduction(||                   \
                                                    : bad) reduction(max \
                                                                     : max_key) num_threads(team)
  for (int64_t j = 0; j < m; ++j) {
    const int64_t e = index_at(indices, j / topk, j % topk);
    const bool ok = e >= 0 && e < kIndexLimit;
    bad = bad || !ok;
    keys[static_cast<std::size_t>(j)] = ok ? static_cast<int32_t>(e) : 0;
    max_key = std::max(max_key, ok ? e : 0);
  }
  if (bad) {
    for (int64_t j = 0; j < m; ++j) {
      const int64_t e = index_at(indices, j / topk, j % topk);
      if (e >= 0 && e < kIndexLimit) continue;
      if (indices.ndim == 2)
        invalid(op, ": indices[", j / topk, ",", j % topk, "] = ", e, " is outside [0, ",
                kIndexLimit, ")");
      invalid(op, ": indices[", j, "] = ", e, " is outside [0, ", kIndexLimit, ")");
    }
  }

  stable_argsort(keys, max_key, order, hist);

  check_output_size(op, "permuted_tokens shape (rows, H)", rows, h, tokens.dtype);
  PermuteResult res;
  res.sorted_indices = Tensor::empty(DType::kI32, {m});
  res.permuted_tokens = Tensor::empty(tokens.dtype, {rows, h});
  detail::permute_rows(res.sorted_indices.ptr<int32_t>(),
                       static_cast<char*>(res.permuted_tokens.data()), tokens, order.data(), m,
                       rows, topk);
  release_if_large(keys);
  release_if_large(order);
  release_if_large(hist);
  return res;
}

Tensor permute_grad(const PermuteGradArgs& args) {
  if (args.padded_mode) return detail::permute_grad_padded(args);
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
  const int64_t topk = check_indices_shape(op, args.indices, n);
  const int64_t m = checked_entries(op, n, topk, "M = N*topK");
  check_sorted_indices_shape(op, args.sorted_indices, m, "M = N*topK");
  check_sorted_range(op, args.sorted_indices, std::max(grad.shape[0], m),
                     "max(R, M), R = grad_permuted_tokens.shape[0]");
  return permute_grad_kernel(op, grad, args.sorted_indices, n, topk, tokens.dtype);
}

Tensor permute_grad_v2(const PermuteGradV2Args& args) {
  if (args.padded_mode) return detail::permute_grad_v2_padded(args);
  const char* op = "permute_grad_v2";
  const TensorView& grad = args.grad_permuted_tokens;
  expect_rows(op, "grad_permuted_tokens", grad);
  if (args.tokens_rows < 0) invalid(op, ": tokens_rows = ", args.tokens_rows, " must be >= 0");
  if (args.num_topk < 1) invalid(op, ": num_topk = ", args.num_topk, " must be >= 1");
  check_float_dtype(op, "tokens_dtype", args.tokens_dtype);
  check_same_dtype(op, "grad_permuted_tokens", grad.dtype, "tokens_dtype", args.tokens_dtype);
  const int64_t m = checked_entries(op, args.tokens_rows, args.num_topk, "tokens_rows*num_topk");
  check_sorted_indices_shape(op, args.sorted_indices, m, "M = tokens_rows*num_topk");
  check_sorted_range(op, args.sorted_indices, std::max(grad.shape[0], m),
                     "max(R, M), R = grad_permuted_tokens.shape[0]");
  return permute_grad_kernel(op, grad, args.sorted_indices, args.tokens_rows, args.num_topk,
                             args.tokens_dtype);
}

Tensor unpermute(const UnpermuteArgs& args) { return unpermute_impl("unpermute", args, false).out; }

UnpermuteWithSavedResult unpermute_with_saved(const UnpermuteArgs& args) {
  return unpermute_impl("unpermute_with_saved", args, true);
}

UnpermuteGradResult unpermute_grad(const UnpermuteGradArgs& args) {
  if (args.padded_mode) return detail::unpermute_grad_padded(args);
  const char* op = "unpermute_grad";
  const TensorView& g = args.grad_out;
  const TensorView& x = args.permuted_tokens;
  const TensorView& si = args.sorted_indices;
  expect_rows(op, "grad_out", g);
  const int64_t n = g.shape[0], h = g.shape[1];
  if (args.probs) {
    expect_rows(op, "permuted_tokens", x);
  } else {  // only its shape is used
    expect_dtype(op, "permuted_tokens", x, {DType::kBF16, DType::kF16, DType::kF32});
    expect_ndim(op, "permuted_tokens", x, 2);
    expect_shape(op, "permuted_tokens", x);
  }
  check_same_dtype(op, "grad_out", g.dtype, "permuted_tokens dtype", x.dtype);
  expect_size(op, "permuted_tokens", x, 1, h, "H, grad_out.shape[1]");
  const TensorView* probs = args.probs ? &*args.probs : nullptr;
  detail::UnpermuteGradProblem q{&g,         &si,     probs, probs ? &x : nullptr, n, h, 1,
                                 x.shape[0], x.dtype, {}};
  check_unpermute_grad_entries(op, q, args.restore_shape, "permuted_tokens.shape",
                               "max(P, M), P = permuted_tokens.shape[0]");
  return detail::unpermute_grad_rows(q);
}

UnpermuteGradResult unpermute_grad_v2(const UnpermuteGradV2Args& args) {
  if (args.padded_mode) return detail::unpermute_grad_v2_padded(args);
  const char* op = "unpermute_grad_v2";
  const TensorView& g = args.grad_out;
  const TensorView& si = args.sorted_indices;
  expect_rows(op, "grad_out", g);
  const int64_t n = g.shape[0], h = g.shape[1];
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
    expect_size(op, "permuted_tokens", x, 1, h, "H, grad_out.shape[1]");
  }
  const TensorView* probs = args.probs ? &*args.probs : nullptr;
  const TensorView* x = probs ? &*args.permuted_tokens : nullptr;
  detail::UnpermuteGradProblem q{
      &g, &si, probs, x, n, h, 1, args.permuted_rows, args.permuted_dtype, {}};
  check_unpermute_grad_entries(op, q, args.restore_shape, "(permuted_rows, H)",
                               "max(P, M), P = permuted_rows");
  return detail::unpermute_grad_rows(q);
}

}  // namespace moe_ep
