#include "ref/ep_ref.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "ref/numeric.h"
#include "ref/quant_ref.h"

namespace moe_ep::ref {

namespace {

int64_t element_bytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

// Start of row i of a 2-D view.
const unsigned char* row_of(const TensorView& t, int64_t i) {
  return static_cast<const unsigned char*>(t.data) + i * t.strides[0] * element_bytes(t.dtype);
}

// One (token, slot) entry of the global batch.
struct Entry {
  int64_t rank, token, slot, expert;
};

// Entry (i, k) takes part: its id is not -1 and the mask (if any) allows it.
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

}  // namespace

std::vector<EpRankDispatch> dispatch_reference(const std::vector<EpRankInput>& ranks,
                                               const EpWorld& world) {
  const int64_t W = static_cast<int64_t>(ranks.size());
  const int64_t E = world.E, S = world.S, Ns = world.Ns;
  if (W == 0 || S >= W || E % (W - S) != 0 || (S > 0 && (Ns == 0 || S % Ns != 0)))
    throw std::invalid_argument("dispatch_reference: bad world");
  const int64_t L = E / (W - S);
  const DType dtype = ranks[0].x.dtype;
  const int64_t H = ranks[0].x.shape[1];
  const int64_t K = ranks[0].expert_ids.shape[1];
  const int64_t row_bytes = H * element_bytes(dtype);
  const int64_t G = world.global_bs > 0 ? world.global_bs : ranks[0].x.shape[0] * W;

  // MoE experts: concatenate every rank's entries in (rank, token, slot) order, then sort stably
  // by expert id. Special experts (id >= E) are not sent.
  std::vector<Entry> all;
  for (int64_t s = 0; s < W; ++s)
    for (int64_t i = 0; i < ranks[s].x.shape[0]; ++i)
      for (int64_t k = 0; k < K; ++k) {
        const auto e = static_cast<int64_t>(at(ranks[s].expert_ids, i, k));
        if (entry_active(ranks[s], i, k) && e < E) all.push_back({s, i, k, e});
      }
  std::stable_sort(all.begin(), all.end(),
                   [](const Entry& a, const Entry& b) { return a.expert < b.expert; });

  std::vector<EpRankDispatch> out(W);
  for (int64_t r = 0; r < W; ++r) {
    EpRankDispatch& o = out[r];
    const int64_t BS = ranks[r].x.shape[0];
    const bool shared_rank = r < S;
    const int64_t Lr = shared_rank ? 1 : L;
    if (shared_rank) {
      const int64_t per = S / Ns;
      o.A = G / W * ((W + per - 1) / per);
    } else {
      o.A = G * std::min(L, K);
    }
    o.expand_x.assign(o.A * row_bytes, 0);
    o.assist_info.assign(std::max(BS * K, o.A * 128), 0);
    o.expand_scales.assign(o.A, 0.0f);
    std::vector<int64_t> block(W * Lr, 0);  // rows of (local expert l, source s) at l*W + s
    auto put = [&](int64_t src, int64_t token, int64_t slot, int64_t expert, int64_t l) {
      const int64_t j = o.valid++;
      const EpRankInput& in = ranks[src];
      if (row_bytes > 0)
        std::memcpy(o.expand_x.data() + j * row_bytes, row_of(in.x, token), row_bytes);
      o.assist_info[3 * j] = static_cast<int32_t>(src);
      o.assist_info[3 * j + 1] = static_cast<int32_t>(token);
      o.assist_info[3 * j + 2] = static_cast<int32_t>(slot);
      if (in.expert_scales && slot < K)
        o.expand_scales[j] = static_cast<float>(at(*in.expert_scales, token, slot));
      o.row_expert.push_back(expert);
      ++block[l * W + src];
    };
    if (shared_rank) {
      // One block per source rank, in rank order: the sender's active tokens for the shared
      // expert this rank hosts, in token order.
      const int64_t per = S / Ns, s = r / per;
      for (int64_t src = 0; src < W; ++src) {
        if (src % per + s * per != r) continue;
        for (int64_t i = 0; i < ranks[src].x.shape[0]; ++i)
          if (token_active(ranks[src], i)) put(src, i, K + s, -1 - s, 0);
      }
    } else {
      for (const Entry& en : all)
        if (S + en.expert / L == r) put(en.rank, en.token, en.slot, en.expert, en.expert % L);
    }
    int64_t run = 0;
    for (int64_t b = 0; b < W * Lr; ++b) {
      run += block[b];
      o.ep_recv_counts.push_back(static_cast<int32_t>(run));
    }
    int64_t sum = 0;
    for (int64_t l = 0; l < Lr; ++l) {
      int64_t n = 0;
      for (int64_t s = 0; s < W; ++s) n += block[l * W + s];
      sum += n;
      o.expert_token_nums1.push_back(n);
      o.expert_token_nums0.push_back(sum);
    }
  }
  return out;
}

std::vector<EpRankDispatch> dispatch_reference(const std::vector<EpRankInput>& ranks, int64_t E,
                                               int64_t global_bs) {
  EpWorld w;
  w.E = E;
  w.global_bs = global_bs;
  return dispatch_reference(ranks, w);
}

EpRankDispatch tp_layout(const EpRankDispatch& own, const EpRankDispatch& peer, int64_t W) {
  if (static_cast<int64_t>(own.ep_recv_counts.size()) != W ||
      static_cast<int64_t>(peer.ep_recv_counts.size()) != W || own.A != peer.A)
    throw std::invalid_argument("tp_layout: needs L = 1 and the same A on both ranks");
  EpRankDispatch o;
  o.A = own.A;
  o.valid = own.valid + peer.valid;
  const int64_t row_bytes = own.A > 0 ? static_cast<int64_t>(own.expand_x.size()) / own.A : 0;
  o.expand_x.assign(2 * own.A * row_bytes, 0);
  std::memcpy(o.expand_x.data(), own.expand_x.data(), own.valid * row_bytes);
  if (peer.valid > 0)
    std::memcpy(o.expand_x.data() + own.valid * row_bytes, peer.expand_x.data(),
                peer.valid * row_bytes);
  o.ep_recv_counts = own.ep_recv_counts;
  for (int32_t c : peer.ep_recv_counts)
    o.ep_recv_counts.push_back(static_cast<int32_t>(own.valid + c));
  o.expert_token_nums0 = {o.valid};
  o.expert_token_nums1 = {o.valid};
  o.assist_info = own.assist_info;
  std::fill(o.assist_info.begin() + 3 * own.valid, o.assist_info.end(), 0);
  for (int64_t j = 0; j < 3 * peer.valid; ++j)
    o.assist_info[3 * own.valid + j] = peer.assist_info[j];
  o.expand_scales.assign(2 * own.A, 0.0f);
  for (int64_t j = 0; j < own.valid; ++j) o.expand_scales[j] = own.expand_scales[j];
  for (int64_t j = 0; j < peer.valid; ++j) o.expand_scales[own.valid + j] = peer.expand_scales[j];
  o.row_expert = own.row_expert;
  o.row_expert.insert(o.row_expert.end(), peer.row_expert.begin(), peer.row_expert.end());
  return o;
}

ExpertFn tp_sum_expert(ExpertFn part0, ExpertFn part1) {
  return [part0, part1](int64_t e, DType dtype, const void* in, void* out, int64_t H) {
    const int64_t bytes = H * element_bytes(dtype);
    std::vector<unsigned char> y0(bytes), y1(bytes);
    part0(e, dtype, in, y0.data(), H);
    part1(e, dtype, in, y1.data(), H);
    for (int64_t h = 0; h < H; ++h) {
      const float sum = load(dtype, y0.data(), h) + load(dtype, y1.data(), h);
      store(dtype, out, h, sum);
    }
  };
}

ExpertFn scale_expert(int64_t E) {
  return [E](int64_t e, DType dtype, const void* in, void* out, int64_t H) {
    const float factor = 1.0f + static_cast<float>(e) / static_cast<float>(E);
    for (int64_t h = 0; h < H; ++h) {
      const float v = load(dtype, in, h) * factor;
      store(dtype, out, h, v);
    }
  };
}

std::vector<std::vector<unsigned char>> combine_reference(const std::vector<EpRankInput>& ranks,
                                                          const EpWorld& world,
                                                          const ExpertFn& expert,
                                                          const ExpertFn& shared, bool comm_quant) {
  std::vector<std::vector<unsigned char>> out;
  const int64_t E = world.E, Z = world.Z, C = world.C;
  for (const EpRankInput& r : ranks) {
    const DType dtype = r.x.dtype;
    const int64_t BS = r.x.shape[0], H = r.x.shape[1], K = r.expert_ids.shape[1];
    const int64_t row_bytes = H * element_bytes(dtype);
    std::vector<unsigned char> result(BS * row_bytes, 0);
    std::vector<unsigned char> y(row_bytes);
    std::vector<float> yf(H);
    std::vector<int8_t> q(H);
    // yf = the row y as the sum receives it: fp32(y), or dequantised with comm_quant.
    auto received = [&] {
      if (comm_quant) {
        dequantize_row_int8(q.data(), quantize_row_int8(dtype, y.data(), nullptr, H, q.data()), H,
                            yf.data());
      } else {
        for (int64_t h = 0; h < H; ++h) yf[h] = load(dtype, y.data(), h);
      }
    };
    for (int64_t i = 0; i < BS; ++i) {
      if (!token_active(r, i)) continue;  // inactive tokens give 0
      std::vector<float> acc(H, 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        if (!entry_active(r, i, k)) continue;
        const auto e = static_cast<int64_t>(at(r.expert_ids, i, k));
        const auto w = static_cast<float>(at(*r.expert_scales, i, k));
        if (e >= E && e < E + Z) continue;  // zero expert
        for (int64_t h = 0; h < H; ++h) {
          float value;
          if (e < E) {
            if (h == 0) {
              expert(e, dtype, row_of(r.x, i), y.data(), H);
              received();
            }
            value = yf[h];
          } else if (e < E + Z + C) {
            value = load(dtype, row_of(*r.ori_x, i), h);
          } else {
            const int64_t q = e - (E + Z + C);
            const float t1 =
                load(dtype, row_of(*world.alpha_1, q), h) * load(dtype, row_of(*r.ori_x, i), h);
            const float t2 =
                load(dtype, row_of(*world.alpha_2, q), h) * load(dtype, row_of(*world.v, q), h);
            value = t1 + t2;
          }
          const float product = w * value;
          acc[h] = acc[h] + product;
        }
      }
      for (int64_t s = 0; s < world.Ns; ++s) {
        shared(-1 - s, dtype, row_of(r.x, i), y.data(), H);
        received();
        for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + yf[h];
      }
      if (r.shared_expert_x)
        for (int64_t h = 0; h < H; ++h)
          acc[h] = acc[h] + load(dtype, row_of(*r.shared_expert_x, i), h);
      for (int64_t h = 0; h < H; ++h) store(dtype, result.data() + i * row_bytes, h, acc[h]);
    }
    out.push_back(std::move(result));
  }
  return out;
}

std::vector<std::vector<unsigned char>> combine_reference(const std::vector<EpRankInput>& ranks,
                                                          const ExpertFn& expert) {
  EpWorld w;
  w.E = 1 << 30;  // every id is a MoE expert
  return combine_reference(ranks, w, expert, expert);
}

std::vector<std::vector<unsigned char>> combine_reference_hierarchy(
    const std::vector<EpRankInput>& ranks, const EpWorld& world, const ExpertFn& expert,
    const ExpertFn& shared, int64_t G) {
  std::vector<std::vector<unsigned char>> out;
  const int64_t W = static_cast<int64_t>(ranks.size()), E = world.E, Z = world.Z, C = world.C;
  const int64_t S = world.S, Ns = world.Ns, per_rank = E / (W - S);
  for (int64_t rank = 0; rank < W; ++rank) {
    const EpRankInput& r = ranks[rank];
    const DType dtype = r.x.dtype;
    const int64_t BS = r.x.shape[0], H = r.x.shape[1], K = r.expert_ids.shape[1];
    const int64_t row_bytes = H * element_bytes(dtype);
    std::vector<unsigned char> result(BS * row_bytes, 0);
    std::vector<unsigned char> y(row_bytes);
    for (int64_t i = 0; i < BS; ++i) {
      if (!token_active(r, i)) continue;
      std::vector<float> acc(H, 0.0f);
      for (int64_t node = 0; node < W / G; ++node) {
        std::vector<float> p(H, 0.0f);
        bool any = false;
        for (int64_t k = 0; k < K; ++k) {
          if (!entry_active(r, i, k)) continue;
          const auto e = static_cast<int64_t>(at(r.expert_ids, i, k));
          const int64_t host_node = e < E ? (S + e / per_rank) / G : rank / G;
          if (host_node != node) continue;
          any = true;
          const auto w = static_cast<float>(at(*r.expert_scales, i, k));
          if (e >= E && e < E + Z) continue;  // zero expert
          if (e < E) expert(e, dtype, row_of(r.x, i), y.data(), H);
          for (int64_t h = 0; h < H; ++h) {
            float value;
            if (e < E) {
              value = load(dtype, y.data(), h);
            } else if (e < E + Z + C) {
              value = load(dtype, row_of(*r.ori_x, i), h);
            } else {
              const int64_t q = e - (E + Z + C);
              const float t1 =
                  load(dtype, row_of(*world.alpha_1, q), h) * load(dtype, row_of(*r.ori_x, i), h);
              const float t2 =
                  load(dtype, row_of(*world.alpha_2, q), h) * load(dtype, row_of(*world.v, q), h);
              value = t1 + t2;
            }
            const float product = w * value;
            p[h] = p[h] + product;
          }
        }
        for (int64_t s = 0; s < Ns; ++s) {
          const int64_t host = rank % (S / Ns) + s * (S / Ns);
          if (host / G != node) continue;
          any = true;
          shared(-1 - s, dtype, row_of(r.x, i), y.data(), H);
          for (int64_t h = 0; h < H; ++h) p[h] = p[h] + load(dtype, y.data(), h);
        }
        if (any)
          for (int64_t h = 0; h < H; ++h) acc[h] = acc[h] + p[h];
      }
      if (r.shared_expert_x)
        for (int64_t h = 0; h < H; ++h)
          acc[h] = acc[h] + load(dtype, row_of(*r.shared_expert_x, i), h);
      for (int64_t h = 0; h < H; ++h) store(dtype, result.data() + i * row_bytes, h, acc[h]);
    }
    out.push_back(std::move(result));
  }
  return out;
}

}  // namespace moe_ep::ref
