#include "ref/ep_backward_ref.h"

#include <map>
#include <tuple>

#include "ref/numeric.h"

namespace moe_ep::ref {

namespace {

int64_t element_bytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

const unsigned char* row_of(const TensorView& t, int64_t i) {
  return static_cast<const unsigned char*>(t.data) + i * t.strides[0] * element_bytes(t.dtype);
}

bool entry_active(const EpRankInput& r, int64_t i, int64_t k) {
  if (at(r.expert_ids, i, k) == -1) return false;
  if (!r.x_active_mask) return true;
  const TensorView& m = *r.x_active_mask;
  return (m.ndim == 1 ? at(m, i) : at(m, i, k)) != 0;
}

bool token_active(const EpRankInput& r, int64_t i) {
  for (int64_t k = 0; k < r.expert_ids.shape[1]; ++k)
    if (entry_active(r, i, k)) return true;
  return false;
}

// (source rank, token, slot) -> (owner rank, row), from every owner's assist_info.
using Where = std::map<std::tuple<int64_t, int64_t, int64_t>, std::pair<int64_t, int64_t>>;
Where rows_of(const std::vector<EpRankDispatch>& dispatched) {
  Where w;
  for (int64_t d = 0; d < static_cast<int64_t>(dispatched.size()); ++d)
    for (int64_t j = 0; j < dispatched[d].valid; ++j) {
      const int32_t* a = dispatched[d].assist_info.data() + 3 * j;
      w[{a[0], a[1], a[2]}] = {d, j};
    }
  return w;
}

float dot16(const std::vector<float>& g, const std::vector<float>& y) {
  float lane[16] = {};
  for (std::size_t c = 0; c < g.size(); ++c) {
    const float term = g[c] * y[c];
    lane[c % 16] = lane[c % 16] + term;
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] = lane[l] + lane[l + w];
  return lane[0];
}

std::vector<float> row_f32(DType dtype, const unsigned char* p, int64_t H) {
  std::vector<float> v(H);
  for (int64_t h = 0; h < H; ++h) v[h] = load(dtype, p, h);
  return v;
}

}  // namespace

std::vector<std::vector<unsigned char>> dispatch_backward_reference(
    const std::vector<EpRankInput>& ranks, const EpWorld& world,
    const std::vector<EpRankDispatch>& dispatched,
    const std::vector<std::vector<unsigned char>>& grads, int64_t G) {
  const Where where = rows_of(dispatched);
  const int64_t W = static_cast<int64_t>(ranks.size());
  std::vector<std::vector<unsigned char>> out;
  for (int64_t r = 0; r < W; ++r) {
    const EpRankInput& in = ranks[r];
    const DType dtype = in.x.dtype;
    const int64_t BS = in.x.shape[0], H = in.x.shape[1], K = in.expert_ids.shape[1];
    const int64_t row_bytes = H * element_bytes(dtype);
    std::vector<unsigned char> result(BS * row_bytes, 0);
    for (int64_t i = 0; i < BS; ++i) {
      if (!token_active(in, i)) continue;
      // The rows made from token i, in k order then s order: (owner, row).
      std::vector<std::pair<int64_t, int64_t>> terms;
      for (int64_t k = 0; k < K; ++k)
        if (entry_active(in, i, k) && at(in.expert_ids, i, k) < world.E)
          terms.push_back(where.at({r, i, k}));
      for (int64_t s = 0; s < world.Ns; ++s) terms.push_back(where.at({r, i, K + s}));
      std::vector<float> acc(H, 0.0f);
      const int64_t nodes = G > 0 ? W / G : 1;
      for (int64_t node = 0; node < nodes; ++node) {
        std::vector<float> p(H, 0.0f);
        bool any = false;
        for (const auto& [d, j] : terms) {
          if (G > 0 && d / G != node) continue;
          any = true;
          for (int64_t h = 0; h < H; ++h) {
            const float v = load(dtype, grads[d].data() + j * row_bytes, h);
            if (G > 0)
              p[h] = p[h] + v;
            else
              acc[h] = acc[h] + v;
          }
        }
        if (G > 0 && any)
          for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + p[h];
      }
      for (int64_t h = 0; h < H; ++h) store(dtype, result.data() + i * row_bytes, h, acc[h]);
    }
    out.push_back(std::move(result));
  }
  return out;
}

std::vector<CombineBackwardRef> combine_backward_reference(
    const std::vector<EpRankInput>& ranks, const EpWorld& world,
    const std::vector<EpRankDispatch>& dispatched,
    const std::vector<std::vector<unsigned char>>& grad_out, const ExpertFn& expert) {
  const int64_t W = static_cast<int64_t>(ranks.size());
  const int64_t E = world.E, Z = world.Z, C = world.C, Q = world.Q;
  std::vector<CombineBackwardRef> out(W);
  for (int64_t d = 0; d < W; ++d) {  // the owners' rows
    const DType dtype = ranks[d].x.dtype;
    const int64_t H = ranks[d].x.shape[1], K = ranks[d].expert_ids.shape[1];
    const int64_t row_bytes = H * element_bytes(dtype);
    out[d].grad_expand_x.assign(dispatched[d].valid * row_bytes, 0);
    for (int64_t j = 0; j < dispatched[d].valid; ++j) {
      const int32_t* a = dispatched[d].assist_info.data() + 3 * j;
      const unsigned char* g = grad_out[a[0]].data() + a[1] * row_bytes;
      const float w = a[2] < K ? static_cast<float>(at(*ranks[a[0]].expert_scales, a[1], a[2])) : 1;
      for (int64_t h = 0; h < H; ++h) {
        const float v = load(dtype, g, h);
        store(dtype, out[d].grad_expand_x.data() + j * row_bytes, h, a[2] < K ? w * v : v);
      }
    }
  }
  for (int64_t r = 0; r < W; ++r) {  // the sources' grads
    const EpRankInput& in = ranks[r];
    CombineBackwardRef& o = out[r];
    const DType dtype = in.x.dtype;
    const int64_t BS = in.x.shape[0], H = in.x.shape[1], K = in.expert_ids.shape[1];
    const int64_t row_bytes = H * element_bytes(dtype);
    o.grad_expert_scales.assign(BS * K, 0.0f);
    o.grad_shared_expert_x.assign(BS * row_bytes, 0);
    o.grad_ori_x.assign(BS * row_bytes, 0);
    std::vector<float> a1(Q * H, 0.0f), a2(Q * H, 0.0f), v(Q * H, 0.0f);
    std::vector<unsigned char> y(row_bytes);
    for (int64_t i = 0; i < BS; ++i) {
      if (!token_active(in, i)) continue;
      const std::vector<float> g = row_f32(dtype, grad_out[r].data() + i * row_bytes, H);
      std::vector<float> acc(H, 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        if (!entry_active(in, i, k)) continue;
        const auto e = static_cast<int64_t>(at(in.expert_ids, i, k));
        const auto w = static_cast<float>(at(*in.expert_scales, i, k));
        if (e >= E && e < E + Z) continue;  // zero expert
        std::vector<float> val;
        if (e < E) {
          expert(e, dtype, row_of(in.x, i), y.data(), H);
          val = row_f32(dtype, y.data(), H);
        } else if (e < E + Z + C) {
          val = row_f32(dtype, row_of(*in.ori_x, i), H);
          for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + w * g[h];
        } else {
          const int64_t q = e - (E + Z + C);
          val.resize(H);
          for (int64_t h = 0; h < H; ++h) {
            const float ox = load(dtype, row_of(*in.ori_x, i), h);
            const float al1 = load(dtype, row_of(*world.alpha_1, q), h);
            const float al2 = load(dtype, row_of(*world.alpha_2, q), h);
            const float vq = load(dtype, row_of(*world.v, q), h);
            const float t1 = al1 * ox, t2 = al2 * vq;
            val[h] = t1 + t2;
            const float wa = w * al1;
            acc[h] = acc[h] + wa * g[h];
            const float t = w * g[h];
            a1[q * H + h] = a1[q * H + h] + t * ox;
            a2[q * H + h] = a2[q * H + h] + t * vq;
            v[q * H + h] = v[q * H + h] + t * al2;
          }
        }
        o.grad_expert_scales[i * K + k] = dot16(g, val);
      }
      for (int64_t h = 0; h < H; ++h) {
        store(dtype, o.grad_ori_x.data() + i * row_bytes, h, acc[h]);
        store(dtype, o.grad_shared_expert_x.data() + i * row_bytes, h, g[h]);
      }
    }
    auto table = [&](const std::vector<float>& t) {
      std::vector<unsigned char> b(Q * row_bytes);
      for (int64_t j = 0; j < Q * H; ++j) store(dtype, b.data(), j, t[j]);
      return b;
    };
    o.grad_alpha_1 = table(a1);
    o.grad_alpha_2 = table(a2);
    o.grad_v = table(v);
  }
  return out;
}

}  // namespace moe_ep::ref
