#include "ref/ep_ref.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "ref/numeric.h"

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

}  // namespace

std::vector<EpRankDispatch> dispatch_reference(const std::vector<EpRankInput>& ranks, int64_t E,
                                               int64_t global_bs) {
  const int64_t W = static_cast<int64_t>(ranks.size());
  if (W == 0 || E % W != 0) throw std::invalid_argument("dispatch_reference: E % W != 0");
  const int64_t L = E / W;
  const DType dtype = ranks[0].x.dtype;
  const int64_t H = ranks[0].x.shape[1];
  const int64_t K = ranks[0].expert_ids.shape[1];
  const int64_t row_bytes = H * element_bytes(dtype);
  int64_t max_bs = 0;
  for (const auto& r : ranks) max_bs = std::max(max_bs, r.x.shape[0]);
  const int64_t G = global_bs > 0 ? global_bs : ranks[0].x.shape[0] * W;
  const int64_t A = G * std::min(L, K);

  // Concatenate every rank's entries in (rank, token, slot) order, then sort stably by expert.
  std::vector<Entry> all;
  for (int64_t s = 0; s < W; ++s)
    for (int64_t i = 0; i < ranks[s].x.shape[0]; ++i)
      for (int64_t k = 0; k < K; ++k) {
        const auto e = static_cast<int64_t>(at(ranks[s].expert_ids, i, k));
        if (e != -1) all.push_back({s, i, k, e});
      }
  std::stable_sort(all.begin(), all.end(),
                   [](const Entry& a, const Entry& b) { return a.expert < b.expert; });

  std::vector<EpRankDispatch> out(W);
  for (int64_t r = 0; r < W; ++r) {
    EpRankDispatch& o = out[r];
    const int64_t BS = ranks[r].x.shape[0];
    o.A = A;
    o.expand_x.assign(A * row_bytes, 0);
    o.assist_info.assign(std::max(BS * K, A * 128), 0);
    o.expand_scales.assign(A, 0.0f);
    std::vector<int64_t> block(W * L, 0);  // rows of (local expert l, source s) at l*W + s
    for (const Entry& en : all) {
      if (en.expert / L != r) continue;  // MoE expert e lives on rank e / L
      const int64_t j = o.valid++;
      const EpRankInput& src = ranks[en.rank];
      if (row_bytes > 0)
        std::memcpy(o.expand_x.data() + j * row_bytes, row_of(src.x, en.token), row_bytes);
      o.assist_info[3 * j] = static_cast<int32_t>(en.rank);
      o.assist_info[3 * j + 1] = static_cast<int32_t>(en.token);
      o.assist_info[3 * j + 2] = static_cast<int32_t>(en.slot);
      if (src.expert_scales)
        o.expand_scales[j] = static_cast<float>(at(*src.expert_scales, en.token, en.slot));
      o.row_expert.push_back(en.expert);
      ++block[(en.expert % L) * W + en.rank];
    }
    int64_t run = 0;
    for (int64_t b = 0; b < W * L; ++b) {
      run += block[b];
      o.ep_recv_counts.push_back(static_cast<int32_t>(run));
    }
    int64_t sum = 0;
    for (int64_t l = 0; l < L; ++l) {
      int64_t n = 0;
      for (int64_t s = 0; s < W; ++s) n += block[l * W + s];
      sum += n;
      o.expert_token_nums1.push_back(n);
      o.expert_token_nums0.push_back(sum);
    }
  }
  return out;
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
                                                          const ExpertFn& expert) {
  std::vector<std::vector<unsigned char>> out;
  for (const EpRankInput& r : ranks) {
    const DType dtype = r.x.dtype;
    const int64_t BS = r.x.shape[0], H = r.x.shape[1], K = r.expert_ids.shape[1];
    const int64_t row_bytes = H * element_bytes(dtype);
    std::vector<unsigned char> result(BS * row_bytes, 0);
    std::vector<unsigned char> y(row_bytes);
    for (int64_t i = 0; i < BS; ++i) {
      std::vector<float> acc(H, 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const auto e = static_cast<int64_t>(at(r.expert_ids, i, k));
        if (e == -1) continue;
        expert(e, dtype, row_of(r.x, i), y.data(), H);
        const auto w = static_cast<float>(at(*r.expert_scales, i, k));
        for (int64_t h = 0; h < H; ++h) {
          const float product = w * load(dtype, y.data(), h);
          acc[h] = acc[h] + product;
        }
      }
      for (int64_t h = 0; h < H; ++h) store(dtype, result.data() + i * row_bytes, h, acc[h]);
    }
    out.push_back(std::move(result));
  }
  return out;
}

}  // namespace moe_ep::ref
