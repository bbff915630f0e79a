#include "kernels/cpu/permute.h"

#include <omp.h>

#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/numeric.h"
#include "base/threads.h"
#include "kernels/cpu/convert.h"

namespace moe_ep::detail {

void permute_rows(int32_t* si, char* out, const TensorView& tokens, const int32_t* order, int64_t m,
                  int64_t rows, int64_t topk) {
  const int sort_team = threads_if(m >= kParallelMinWork);
#pragma omp parallel for schedule(static) num_threads(sort_team)
  for (int64_t pos = 0; pos < m; ++pos) si[order[pos]] = static_cast<int32_t>(pos);
  const int64_t h = tokens.shape[1];
  if (h == 0) return;
  const int64_t row_bytes = h * static_cast<int64_t>(dtype_size(tokens.dtype));
  const bool stream = rows * row_bytes >= kStreamMinBytes;
  const int team = threads_if(rows > 1 && rows * row_bytes >= kParallelMinWork);
#pragma omp parallel for schedule(static) num_threads(team)
  for (int64_t pos = 0; pos < rows; ++pos)
    copy_row(out + pos * row_bytes, row_ptr(tokens, order[pos] / topk),
             static_cast<std::size_t>(row_bytes), stream);
}

namespace {

// Per-thread scratch of a parallel region: `per_thread` elements for each of `team` threads, made
// before the region. An exception cannot leave an OpenMP region (it ends the process with
// std::terminate), so a buffer sized by the caller's input (topK) is allocated here, where
// std::bad_alloc and std::length_error reach the caller; the binding names the op.
template <class T>
class Scratch {
 public:
  // groups * per_thread elements for each thread.
  Scratch(int team, int64_t per_thread, int groups = 1)
      : per_(elements(1, per_thread, groups)), data_(elements(team, per_thread, groups)) {}
  // This thread's part; one thread of the region per part (team <= the region's num_threads).
  T* mine() { return data_.data() + per_ * static_cast<std::size_t>(omp_get_thread_num()); }

 private:
  static std::size_t elements(int team, int64_t per_thread, int groups) {
    const auto t = static_cast<std::size_t>(team < 1 ? 1 : team) * static_cast<std::size_t>(groups);
    const auto p = static_cast<std::size_t>(per_thread < 0 ? 0 : per_thread);
    if (p != 0 && t > std::numeric_limits<std::size_t>::max() / sizeof(T) / p)
      throw std::length_error("per-thread scratch of " + std::to_string(t) + " x " +
                              std::to_string(p) + " elements overflows size_t");
    return t * p;
  }
  std::size_t per_;
  std::vector<T> data_;
};

// out[i] = sum over k (in k order) of w(i, k) * src[S[i*topk+k]] for the entries with
// S < src.shape[0], for i in [0, n); unweighted when probs is null. sum_rows reads the present rows
// once, with the fp32 accumulators in registers: the first present term starts the sum, each
// product is rounded to fp32 before it is added, the sum is rounded once to out_dtype, and a row
// without terms is 0. `out` is contiguous (n, h = src.shape[1]) and h > 0.
void reduce_rows(char* out, DType out_dtype, const TensorView& src, const TensorView& si, int64_t n,
                 int64_t topk, const TensorView* probs) {
  // No tokens: nothing to sum, and topK, which then bounds no data, must not size the buffers
  // below (found by tests/fuzz: topK = 2^31 with N = 0 asked for 8 GiB per thread).
  if (n == 0) return;
  const int64_t rows = src.shape[0], h = src.shape[1];
  const std::size_t out_row_bytes = static_cast<std::size_t>(h) * dtype_size(out_dtype);
  const bool stream = n * static_cast<int64_t>(out_row_bytes) >= kStreamMinBytes;
  const int team = threads_if(n > 1 && n * topk * h >= kParallelMinWork);
  // The present rows of token i and their weights, and those of token i + 1 (its rows are
  // prefetched during token i's pass): two of each per thread.
  Scratch<const void*> term_scratch(team, topk, 2);
  Scratch<float> w_scratch(team, probs ? topk : 0, 2);
#pragma omp parallel num_threads(team)
  {
    const void** const terms = term_scratch.mine();
    const void** const next = terms + topk;
    float* const w = w_scratch.mine();
    float* const next_w = probs ? w + topk : w;
    auto present = [&](int64_t i, const void** t, float* wt) {
      int64_t count = 0;
      for (int64_t k = 0; k < topk && i < n; ++k) {
        const int64_t s = sorted_at(si, i * topk + k);
        if (s >= rows) continue;
        if (probs) wt[count] = float_at(*probs, i, k);
        t[count++] = row_ptr(src, s);
      }
      return count;
    };
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t count = present(i, terms, w);
      const int64_t ahead = present(i + 1, next, next_w);
      sum_rows(out + i * static_cast<int64_t>(out_row_bytes), out_dtype, terms, probs ? w : nullptr,
               count, src.dtype, h, stream, false, next, ahead);
    }
  }
}

}  // namespace

void unpermute_rows(char* out, const TensorView& src, const TensorView& si, int64_t n, int64_t topk,
                    const TensorView* probs) {
  if (probs) {
    reduce_rows(out, src.dtype, src, si, n, topk, probs);
    return;
  }
  // A pure gather: bit copies, zeros for dropped entries.
  const int64_t p = src.shape[0];
  const int64_t row_bytes = src.shape[1] * static_cast<int64_t>(dtype_size(src.dtype));
  const int team = threads_if(n > 1 && n * row_bytes >= kParallelMinWork);
#pragma omp parallel for schedule(static) num_threads(team)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = sorted_at(si, i);
    if (s < p) {
      copy_row(out + i * row_bytes, row_ptr(src, s), static_cast<std::size_t>(row_bytes),
               n * row_bytes >= kStreamMinBytes);
    } else {
      std::memset(out + i * row_bytes, 0, static_cast<std::size_t>(row_bytes));
    }
  }
}

void permute_grad_rows(char* out, DType out_dtype, const TensorView& grad, const TensorView& si,
                       int64_t n, int64_t topk) {
  reduce_rows(out, out_dtype, grad, si, n, topk, nullptr);
}

void copy_rows(char* dst, const TensorView& src) {
  const int64_t p = src.shape[0];
  const int64_t row_bytes = src.shape[1] * static_cast<int64_t>(dtype_size(src.dtype));
  if (row_bytes == 0) return;
  const int team = threads_if(p > 1 && p * row_bytes >= kParallelMinWork);
#pragma omp parallel for schedule(static) num_threads(team)
  for (int64_t s = 0; s < p; ++s)
    copy_row(dst + s * row_bytes, row_ptr(src, s), static_cast<std::size_t>(row_bytes),
             p * row_bytes >= kStreamMinBytes);
}

UnpermuteGradResult unpermute_grad_rows(const UnpermuteGradProblem& q) {
  const int64_t n = q.n, h = q.h, topk = q.topk, p = q.p;
  const TensorView& g = *q.grad_out;
  const TensorView& si = *q.sorted_indices;
  UnpermuteGradResult res;
  res.grad_permuted_tokens = Tensor::empty(q.dtype, {p, h});
  const int64_t row_bytes = h * static_cast<int64_t>(dtype_size(q.dtype));
  const bool stream = p * row_bytes >= kStreamMinBytes;
  char* const gp = static_cast<char*>(res.grad_permuted_tokens.data());
  if (q.probs) res.grad_probs = Tensor::empty(q.probs->dtype, {n, topk});

  // Rows nothing refers to are 0 (SPEC §4.3 Decision); the others are written once below. Without
  // a bitmap every row is zeroed first.
  const int zero_team = threads_if(p > 1 && p * row_bytes >= kParallelMinWork);
#pragma omp parallel for schedule(static) num_threads(zero_team)
  for (int64_t s = 0; s < (row_bytes > 0 ? p : 0); ++s)
    if (q.seen.empty() || !bit_set(q.seen, s))
      std::memset(gp + s * row_bytes, 0, static_cast<std::size_t>(row_bytes));

  if (n == 0) return res;  // no tokens: as reduce_rows, topK must not size the buffers below
  if (!q.probs) {
    if (h == 0) return res;
    const int team = threads_if(n > 1 && n * row_bytes >= kParallelMinWork);
#pragma omp parallel for schedule(static) num_threads(team)
    for (int64_t j = 0; j < n; ++j) {
      const int64_t s = sorted_at(si, j);
      if (s < p)
        copy_row(gp + s * row_bytes, row_ptr(g, j), static_cast<std::size_t>(row_bytes), stream);
    }
    return res;
  }

  const TensorView& probs = *q.probs;
  const TensorView& x = *q.permuted_tokens;
  void* const gprobs = res.grad_probs.data();
  // One token at a time: its present entries' dot products with grad_out's row (each permuted
  // row read once, in the order permute.h fixes), then their scaled copies of grad_out's row
  // (grad_permuted), by scale_dot_rows_f32.
  const int team = threads_if(n > 1 && n * topk * h >= kParallelMinWork);
  // Per thread: w and dots; dst; rows and next; entry (Scratch: allocated before the region).
  Scratch<float> f_scratch(team, topk, 2);
  Scratch<void*> dst_scratch(team, topk);
  Scratch<const void*> row_scratch(team, topk, 2);
  Scratch<int64_t> entry_scratch(team, topk);
#pragma omp parallel num_threads(team)
  {
    float* const w = f_scratch.mine();
    float* const dots = w + topk;
    void** const dst = dst_scratch.mine();
    const void** const rows = row_scratch.mine();
    const void** const next = rows + topk;
    int64_t* const entry = entry_scratch.mine();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      std::size_t count = 0;
      for (int64_t k = 0; k < topk; ++k) {
        const int64_t j = i * topk + k;
        const int64_t s = sorted_at(si, j);
        if (s >= p) {
          store_f32(gprobs, probs.dtype, j, 0.0f);
          continue;
        }
        dst[count] = gp + s * row_bytes;
        w[count] = float_at(probs, i, k);
        rows[count] = row_ptr(x, s);
        entry[count++] = j;
      }
      if (count == 0) continue;
      // Token i + 1's permuted rows, prefetched during token i's pass.
      int64_t ahead = 0;
      for (int64_t k = 0; k < topk && i + 1 < n; ++k) {
        const int64_t s = sorted_at(si, (i + 1) * topk + k);
        if (s < p) next[static_cast<std::size_t>(ahead++)] = row_ptr(x, s);
      }
      scale_dot_rows_f32(dots, dst, q.dtype, row_ptr(g, i), g.dtype, w, rows, x.dtype,
                         static_cast<int64_t>(count), h, stream, next, ahead);
      for (std::size_t c = 0; c < count; ++c) store_f32(gprobs, probs.dtype, entry[c], dots[c]);
    }
  }
  return res;
}

void gather_rows(char* out, const TensorView& src, const int32_t* ids, int64_t m) {
  const int64_t row_bytes = src.shape[1] * static_cast<int64_t>(dtype_size(src.dtype));
  const bool stream = m * row_bytes >= kStreamMinBytes;
  const int team = threads_if(m > 1 && m * row_bytes >= kParallelMinWork);
#pragma omp parallel for schedule(static) num_threads(team)
  for (int64_t p = 0; p < m; ++p)
    copy_row(out + p * row_bytes, row_ptr(src, ids[p]), static_cast<std::size_t>(row_bytes),
             stream);
}

void scatter_sum_rows(char* out, DType out_dtype, const TensorView& src, const int32_t* ids,
                      int64_t n, int64_t m, const float* w) {
  // The slots of each token in increasing p (a counting sort by token): slots[first[t] ..
  // first[t + 1]). Each output row is then one sum_rows over its token's slots, written by one
  // thread, so the bits do not depend on the thread count.
  std::vector<int64_t> first(static_cast<std::size_t>(n) + 1, 0);
  for (int64_t p = 0; p < m; ++p) ++first[static_cast<std::size_t>(ids[p]) + 1];
  for (int64_t t = 0; t < n; ++t) first[t + 1] += first[t];
  std::vector<int32_t> slots(static_cast<std::size_t>(m));
  std::vector<int64_t> fill(first.begin(), first.end() - 1);
  for (int64_t p = 0; p < m; ++p) slots[fill[ids[p]]++] = static_cast<int32_t>(p);

  const int64_t h = src.shape[1];
  const std::size_t out_row_bytes = static_cast<std::size_t>(h) * dtype_size(out_dtype);
  const bool stream = n * static_cast<int64_t>(out_row_bytes) >= kStreamMinBytes;
  const int team = threads_if(n > 1 && (n + m) * h >= kParallelMinWork);
#pragma omp parallel num_threads(team)
  {
    std::vector<const void*> rows;
    std::vector<float> weights;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n; ++t) {
      const int64_t count = first[t + 1] - first[t];
      rows.resize(static_cast<std::size_t>(count));
      weights.resize(w ? static_cast<std::size_t>(count) : 0);
      for (int64_t c = 0; c < count; ++c) {
        const int32_t p = slots[static_cast<std::size_t>(first[t] + c)];
        rows[static_cast<std::size_t>(c)] = row_ptr(src, p);
        if (w) weights[static_cast<std::size_t>(c)] = w[p];
      }
      sum_rows(out + t * static_cast<int64_t>(out_row_bytes), out_dtype, rows.data(),
               w ? weights.data() : nullptr, count, src.dtype, h, stream);
    }
  }
}

void padded_unpermute_grad_rows(char* gp, DType dtype, void* grad_probs, DType probs_dtype,
                                const TensorView& g, const int32_t* ids, int64_t m, const float* w,
                                const TensorView* x) {
  const int64_t h = g.shape[1];
  const int64_t row_bytes = h * static_cast<int64_t>(dtype_size(dtype));
  const bool stream = m * row_bytes >= kStreamMinBytes;
  const int team = threads_if(m > 1 && m * h >= kParallelMinWork);
#pragma omp parallel for schedule(static) num_threads(team)
  for (int64_t p = 0; p < m; ++p) {
    const char* grow = row_ptr(g, ids[p]);
    char* dst = gp + p * row_bytes;
    if (!w) {
      copy_row(dst, grow, static_cast<std::size_t>(row_bytes), stream);
      continue;
    }
    float dot = 0.0f;
    void* dsts[1] = {dst};
    const void* xrows[1] = {row_ptr(*x, p)};
    scale_dot_rows_f32(&dot, dsts, dtype, grow, g.dtype, &w[p], xrows, x->dtype, 1, h, stream);
    store_f32(grad_probs, probs_dtype, p, dot);
  }
}

}  // namespace moe_ep::detail
