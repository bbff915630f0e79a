#include "core/ep/combine_sum.h"

#include <algorithm>
#include <vector>

#include "base/numeric.h"
#include "base/parallel.h"
#include "base/threads.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/quant.h"

namespace moe_ep::detail {

const char* shared_row(const TensorView& t, int64_t i) {
  if (t.data == nullptr) return nullptr;  // rows of H = 0 elements (found by tests/fuzz)
  const int64_t es = static_cast<int64_t>(dtype_size(t.dtype));
  const int64_t off = t.ndim == 2
                          ? i * t.strides[0]
                          : (i / t.shape[1]) * t.strides[0] + (i % t.shape[1]) * t.strides[1];
  return static_cast<const char*>(t.data) + off * es;
}

namespace {

// Const expert q's value for token i (SPEC §2.2): c = alpha_1[q] * ori_x[i] + alpha_2[q] * v[q],
// each product rounded to fp32, then the sum.
void const_expert_row(const CombineInputs& in, int64_t i, int64_t q, DType dtype, int64_t H,
                      float* c) {
  const char* ox = row_ptr(*in.ori_x, i);
  const char* a1 = row_ptr(*in.const_expert_alpha_1, q);
  const char* a2 = row_ptr(*in.const_expert_alpha_2, q);
  const char* v = row_ptr(*in.const_expert_v, q);
  for (int64_t h = 0; h < H; ++h) {
    const float t1 = load_f32(a1, dtype, h) * load_f32(ox, dtype, h);
    const float t2 = load_f32(a2, dtype, h) * load_f32(v, dtype, h);
    c[h] = t1 + t2;
  }
}

}  // namespace

void combine_sum(const CombineSum& a) {
  const float* ysc = a.yscale;
  const char* const* yp = a.yrow;
  char* obase = a.out;
  const EpShape& sh = *a.sh;
  const CombineInputs& in = *a.in;
  const int64_t BS = sh.BS, K = sh.K, KS = sh.KS, H = sh.H, E = sh.E, Ns = sh.pl.Ns;
  const int64_t Z = a.zero, C = a.copy, Q = a.consts;
  const bool cq = a.yscale != nullptr;
  const int64_t row_bytes = H * static_cast<int64_t>(dtype_size(sh.dtype));
  const DType dtype = sh.dtype;
  const Activity act{&in.expert_ids, a.mask};
  // Rows of H = 0 elements: nothing to sum, and the caller's output may have no data (found by
  // tests/fuzz: sum_rows zeroed 0 bytes at null, UBSan).
  if (H == 0) return;
  // No const expert and no int8 rows: every term is w * a row of dtype (1 for the unweighted
  // ones, fl(1 * y) == y), so a token's sum is one sum_rows from +0, all its rows read side by
  // side with the accumulators in registers, bitwise the loop below.
  const bool by_rows = !cq && Q == 0;
  parallel(threads_if(BS * H > (1 << 16)), [&] {
    std::vector<float> acc(static_cast<std::size_t>(H)), c(static_cast<std::size_t>(H));
    std::vector<const void*> rows(static_cast<std::size_t>(KS + 1)), next(rows.size());
    std::vector<float> ws(static_cast<std::size_t>(KS + 1)), next_ws(ws.size());
    // Token i's terms in the SPEC §2.3 order: rows r[0..n) and their weights w; returns n.
    auto terms = [&](int64_t i, const void** r, float* w) {
      int64_t n = 0;
      if (i >= BS || !act.token(i)) return n;
      for (int64_t k = 0; k < K; ++k) {
        if (!act.entry(i, k)) continue;
        const int64_t e = index_at(in.expert_ids, i, k);
        if (e >= E && e < E + Z) continue;                      // zero expert
        r[n] = e < E ? yp[i * KS + k] : row_ptr(*in.ori_x, i);  // else copy expert
        w[n++] = float_at(in.expert_scales, i, k);
      }
      for (int64_t s = 0; s < Ns; ++s) r[n] = yp[i * KS + K + s], w[n++] = 1;
      if (in.shared_expert_x) r[n] = shared_row(*in.shared_expert_x, i), w[n++] = 1;
      return n;
    };
#pragma omp for schedule(static)
    for (int64_t i = 0; i < BS; ++i) {
      if (by_rows) {
        // Token i + 1's rows are prefetched during token i's sum (sum_rows' ahead).
        const int64_t n = terms(i, rows.data(), ws.data());
        const int64_t ahead = terms(i + 1, next.data(), next_ws.data());
        sum_rows(obase + i * row_bytes, dtype, rows.data(), ws.data(), n, dtype, H, false, true,
                 next.data(), ahead);
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (act.token(i)) {
        for (int64_t k = 0; k < K; ++k) {
          if (!act.entry(i, k)) continue;
          const int64_t e = index_at(in.expert_ids, i, k);
          const float w = float_at(in.expert_scales, i, k);
          if (e < E) {
            if (cq)  // SPEC §2.3 with comm_quant_mode 2: the dequantised row
              axpy_row_int8(acc.data(), w, reinterpret_cast<const int8_t*>(yp[i * KS + k]),
                            ysc[i * KS + k], H);
            else
              axpy_row_f32(acc.data(), w, yp[i * KS + k], dtype, H);
          } else if (e < E + Z) {
            // zero expert: contributes nothing
          } else if (e < E + Z + C) {
            axpy_row_f32(acc.data(), w, row_ptr(*in.ori_x, i), dtype, H);
          } else {
            const_expert_row(in, i, e - (E + Z + C), dtype, H, c.data());
            axpy_row_f32(acc.data(), w, c.data(), DType::kF32, H);
          }
        }
        for (int64_t s = 0; s < Ns; ++s)
          if (cq)  // acc + fl(1 * y) == acc + y: the unweighted add
            axpy_row_int8(acc.data(), 1.0f, reinterpret_cast<const int8_t*>(yp[i * KS + K + s]),
                          ysc[i * KS + K + s], H);
          else
            add_row_f32(acc.data(), yp[i * KS + K + s], dtype, H);
        if (in.shared_expert_x)
          add_row_f32(acc.data(), shared_row(*in.shared_expert_x, i), dtype, H);
      }
      store_row_f32(obase + i * row_bytes, dtype, acc.data(), H);
    }
  });
}

void relay_partial(float* p, const PartialTerm* terms, int64_t n, DType dtype, bool int8,
                   int64_t H) {
  std::fill(p, p + H, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    const PartialTerm& x = terms[t];
    if (int8)  // acc + fl(1 * y) == acc + y for a shared expert
      axpy_row_int8(p, x.shared ? 1.0f : x.weight, reinterpret_cast<const int8_t*>(x.row), x.scale,
                    H);
    else if (x.shared)
      add_row_f32(p, x.row, dtype, H);
    else
      axpy_row_f32(p, x.weight, x.row, dtype, H);
  }
}

namespace {

// Token i's partial for this rank's own node (see NodePartials): its terms on the node and the
// special experts, added to p (which starts at 0).
void own_node_partial(const CombineSum& a, const NodePartials& np, int64_t i, float* p, float* c) {
  const EpShape& sh = *a.sh;
  const CombineInputs& in = *a.in;
  const Placement& pl = sh.pl;
  const int64_t K = sh.K, KS = sh.KS, H = sh.H, E = sh.E, Z = a.zero, C = a.copy;
  const Activity act{&in.expert_ids, a.mask};
  const bool cq = a.yscale != nullptr;
  const DType dtype = sh.dtype;
  std::fill(p, p + H, 0.0f);
  for (int64_t k = 0; k < K; ++k) {
    if (!act.entry(i, k)) continue;
    const int64_t e = index_at(in.expert_ids, i, k);
    const float w = float_at(in.expert_scales, i, k);
    if (e < E) {
      if ((pl.S + e / pl.L) / np.G != np.node) continue;  // another node's
      if (cq)
        axpy_row_int8(p, w, reinterpret_cast<const int8_t*>(a.yrow[i * KS + k]),
                      a.yscale[i * KS + k], H);
      else
        axpy_row_f32(p, w, a.yrow[i * KS + k], dtype, H);
    } else if (e < E + Z) {
      // zero expert: contributes nothing
    } else if (e < E + Z + C) {
      axpy_row_f32(p, w, row_ptr(*in.ori_x, i), dtype, H);
    } else {
      const_expert_row(in, i, e - (E + Z + C), dtype, H, c);
      axpy_row_f32(p, w, c, DType::kF32, H);
    }
  }
  for (int64_t s = 0; s < pl.Ns; ++s) {
    if (pl.shared_dest(np.rank, s) / np.G != np.node) continue;
    if (cq)
      axpy_row_int8(p, 1.0f, reinterpret_cast<const int8_t*>(a.yrow[i * KS + K + s]),
                    a.yscale[i * KS + K + s], H);
    else
      add_row_f32(p, a.yrow[i * KS + K + s], dtype, H);
  }
}

}  // namespace

void own_node_partials(const CombineSum& a, const NodePartials& np, int64_t first, int64_t last,
                       float* own) {
  const int64_t H = a.sh->H;
  const Activity act{&a.in->expert_ids, a.mask};
  // Threads by the whole batch, not the slice (a slice alone may be below the threshold).
  parallel(threads_if(a.sh->BS * H > (1 << 16)), [&] {
    std::vector<float> c(static_cast<std::size_t>(H));
#pragma omp for schedule(static)
    for (int64_t i = first; i < last; ++i)
      if (act.token(i)) own_node_partial(a, np, i, own + i * H, c.data());
  });
}

void combine_sum_nodes(const CombineSum& a, const NodePartials& np) {
  const EpShape& sh = *a.sh;
  const CombineInputs& in = *a.in;
  const int64_t BS = sh.BS, H = sh.H, N = static_cast<int64_t>(np.tokens.size());
  const int64_t row_bytes = H * static_cast<int64_t>(dtype_size(sh.dtype));
  const int64_t pbytes = static_cast<int64_t>(dtype_size(np.dtype));
  const Activity act{&in.expert_ids, a.mask};
  // where[n][i]: token i's partial among node n's, or -1.
  std::vector<std::vector<int32_t>> where(static_cast<std::size_t>(N));
  for (int64_t n = 0; n < N; ++n) {
    if (n == np.node) continue;
    where[n].assign(static_cast<std::size_t>(BS), -1);
    const std::vector<int32_t>& t = *np.tokens[n];
    for (std::size_t j = 0; j < t.size(); ++j) where[n][t[j]] = static_cast<int32_t>(j);
  }
  parallel(threads_if(BS * H > (1 << 16)), [&] {
    std::vector<float> acc(static_cast<std::size_t>(H)), p(acc.size()), c(acc.size());
#pragma omp for schedule(static)
    for (int64_t i = 0; i < BS; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (act.token(i)) {
        for (int64_t n = 0; n < N; ++n) {
          if (n == np.node) {
            const float* own = np.own ? np.own + i * H : p.data();
            if (!np.own) own_node_partial(a, np, i, p.data(), c.data());
            add_row_f32(acc.data(), own, DType::kF32, H);
            continue;
          }
          const int32_t j = where[n][i];
          if (j < 0) continue;
          if (np.int8)
            axpy_row_int8(acc.data(), 1.0f, reinterpret_cast<const int8_t*>(np.rows[n]) + j * H,
                          np.scales[n][j], H);
          else
            add_row_f32(acc.data(), np.rows[n] + int64_t{j} * H * pbytes, np.dtype, H);
        }
        if (in.shared_expert_x)
          add_row_f32(acc.data(), shared_row(*in.shared_expert_x, i), sh.dtype, H);
      }
      store_row_f32(a.out + i * row_bytes, sh.dtype, acc.data(), H);
    }
  });
}

}  // namespace moe_ep::detail
