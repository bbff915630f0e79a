// combine_v2 with comm_alg "hierarchy" across nodes (SPEC §3): the relays. Each owner hands the
// rows it holds for a source of another node to that source's relay on its own node; the relay
// sums them per (token, node) with the source's weights and sends one partial row per token
// back. Three phases, every message posted before the phase's wait (no relay waits on one
// source while another waits on it):
//   "relay weights":  each source sends each relay its entries there (token, slot, expert,
//                     weight) in flat order; each owner tells each relay of its node where the
//                     blocks it holds for each source the relay serves lie in its expand_x;
//   "relay rows":     the relays read those rows where they lie, in the owners' windows (an
//                     owner without one sends them); without the handle's routes each owner
//                     sends each row's (token, slot, expert);
//   "relay partials": each relay checks every row against the weights, sums, and sends each
//                     source its partials (fp32, rounded once to EpConfig::partials' dtype, or int8
//                     with comm_quant_mode 2), with the tokens they belong to or what disagreed.
// The source adds them in node order (combine_sum_nodes).
#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "base/check.h"
#include "base/numeric.h"
#include "base/parallel.h"
#include "base/tensor_internals.h"
#include "base/threads.h"
#include "core/ep/combine_call.h"
#include "core/ep/combine_sum.h"
#include "core/ep/route.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/scatter.h"
#include "transport/communicator.h"
#include "transport/exchange.h"
#include "transport/link.h"
#include "transport/tags.h"
#include "transport/windows.h"

namespace moe_ep::detail {

namespace {

// One entry of a source on the relay's node, as the source sends it: the relay's checks and the
// weight of its row (0 for a shared expert, which is added unweighted).
struct RelayEntry {
  int32_t token, slot, expert;
  float weight;
};

// What a relay found wrong with a source's rows (status 0: nothing): [status, token, slot, the
// expert of the row it got (-1 - s for shared expert s; kNone for no row), the expert wanted].
constexpr int kStatusWords = 5;
constexpr int32_t kNone = INT32_MIN;

// The relays' state across the three phases, as a relay and as a source.
struct Relay {
  Nodes nd;
  int N = 0, node = 0;
  // As a source: per node, its entries there (empty for its own node).
  std::vector<std::shared_ptr<std::vector<RelayEntry>>> out_weights;
  // As a relay, per world rank it serves (null otherwise): the source's entries on this node.
  std::vector<std::shared_ptr<std::vector<RelayEntry>>> weights;
  // Per owner of this node (local index g): where the blocks (l, s) it holds for the source s
  // of node m this relay serves lie in its expand_x, first rows at [m * L_d + l], rows at
  // [(N + m) * L_d + l]; its rows for the source of node m, at counts[g][m]; then those rows in
  // (m, local expert, row) order: the row of each in its expand_x (at[g], when this relay reads
  // them in place: its own, or in the owner's window), or the rows it sent; their scales (sent)
  // and checks.
  std::vector<std::shared_ptr<std::vector<int64_t>>> layout;
  std::vector<std::vector<int64_t>> counts, at;
  std::vector<std::shared_ptr<Tensor>> rows;
  std::vector<std::shared_ptr<std::vector<float>>> scales;
  std::vector<std::shared_ptr<std::vector<BackMeta>>> meta;
  // As a source, per node: its tokens with a term there (increasing; empty for its own node),
  // and the node's partial sums of them: fp32 rows (or EpConfig::partials' dtype), or int8 rows
  // and their scales (comm_quant_mode 2).
  std::vector<std::vector<int32_t>> node_tokens;
  std::vector<std::shared_ptr<Tensor>> partials;
  std::vector<std::shared_ptr<std::vector<float>>> partial_scales;
  // Run while the partials are on the wire (this node's own partials), given a function that
  // lets MPI progress between its slices; empty: nothing.
  std::function<void(const std::function<void()>& progress)> meanwhile;
};

const char* own_row(const Combine& c, int64_t j) {
  return c.cq ? reinterpret_cast<const char*>(c.qrows) + j * c.wire_row : row_ptr(c.rows_src(), j);
}

// Phase "relay weights", a source's part: its entries on node n in flat order.
std::shared_ptr<std::vector<RelayEntry>> entries_on(const Combine& c, Relay& r, int n) {
  const SendPlan& back = *c.back;
  const EpShape& sh = c.sh;
  std::vector<int64_t> flats(back.order.begin() + back.rank_offset[n * r.nd.G],
                             back.order.begin() + back.rank_offset[(n + 1) * r.nd.G]);
  std::sort(flats.begin(), flats.end());
  auto out = std::make_shared<std::vector<RelayEntry>>();
  std::vector<int32_t>& tokens = r.node_tokens[n];
  for (const int64_t flat : flats) {
    const int64_t i = flat / sh.KS, k = flat % sh.KS;
    const int64_t e = k < sh.K ? index_at(c.in.expert_ids, i, k) : -1 - (k - sh.K);
    out->push_back(RelayEntry{static_cast<int32_t>(i), static_cast<int32_t>(k),
                              static_cast<int32_t>(e),
                              k < sh.K ? float_at(c.in.expert_scales, i, k) : 0.0f});
    if (tokens.empty() || tokens.back() != i) tokens.push_back(static_cast<int32_t>(i));
  }
  return out;
}

// Where the blocks this rank holds for the sources relay `g` of its node serves lie
// (Relay::layout).
std::shared_ptr<std::vector<int64_t>> layout_for_relay(const Combine& c, const Relay& r, int g,
                                                       int N) {
  const int64_t L = c.L;
  auto v = std::make_shared<std::vector<int64_t>>(static_cast<std::size_t>(2 * N * L), 0);
  for (int m = 0; m < N; ++m) {
    if (m == r.node) continue;
    for (int64_t l = 0; l < L; ++l) {
      const int64_t b = l * c.W + m * r.nd.G + g;
      (*v)[m * L + l] = c.blocks->block_offset[b];
      (*v)[(N + m) * L + l] = c.blocks->block_rows[b];
    }
  }
  return v;
}

// The owner of local index g: its rows per source node, and their rows in its expand_x.
void read_layout(const Combine& c, Relay& r, int g) {
  const int d = r.node * r.nd.G + g;
  const int64_t ld = c.sh.pl.local_experts(d);
  const std::vector<int64_t>& v = *r.layout[g];
  r.counts[g].assign(static_cast<std::size_t>(r.N), 0);
  const bool in_place = d == c.me || c.agreed.read[d];
  for (int m = 0; m < r.N; ++m)
    for (int64_t l = 0; l < ld; ++l) {
      const int64_t first = v[m * ld + l], rows = v[(r.N + m) * ld + l];
      // (A row outside the owner's window raises in Link::place.)
      if (rows < 0 || first < 0 || (d == c.me && first + rows > c.blocks->valid))
        fail(ErrorKind::kInternal, c.op, ": rank ", c.peers()[d], " holds rows [", first, ", ",
             first + rows, ") for a relayed source (please report this bug)");
      r.counts[g][m] += rows;
      if (in_place)
        for (int64_t j = first; j < first + rows; ++j) r.at[g].push_back(j);
    }
}

void exchange_weights(const Combine& c, Relay& r) {
  const auto& messages = message_links(c.comm);
  constexpr int64_t entry = sizeof(RelayEntry);
  Exchange ex(c.comm, c.op, "relay weights");
  std::vector<int> recv_index(static_cast<std::size_t>(c.W), -1);
  int posted = 0;
  for (int s = 0; s < c.W; ++s) {  // as a relay: the weights of every source it serves
    if (!r.nd.relayed(s) || r.nd.relay_of(s) != c.me) continue;
    r.weights[s] = std::make_shared<std::vector<RelayEntry>>(
        static_cast<std::size_t>(c.agreed.headers[s].BS * c.sh.KS));  // at most; the message says
    ex.keep_alive(r.weights[s]);
    messages[c.peers()[s]]->get_block(ex, r.weights[s]->data(),
                                      static_cast<int64_t>(r.weights[s]->size()), entry,
                                      kTagRelayWeights);
    recv_index[s] = posted++;
  }
  for (int g = 0; g < r.nd.G; ++g) {  // as a relay: each owner's layout; as an owner: its own
    const int d = r.node * r.nd.G + g;
    if (d == c.me) {
      r.layout[g] = layout_for_relay(c, r, c.me % r.nd.G, r.N);
      continue;
    }
    const int n = to_int(2 * r.N * c.sh.pl.local_experts(d));
    r.layout[g] = std::make_shared<std::vector<int64_t>>(static_cast<std::size_t>(n));
    ex.keep_alive(r.layout[g]);
    messages[c.peers()[d]]->expect(ex, r.layout[g]->data(), n, kTagRelayCounts);
    ++posted;
    auto mine = layout_for_relay(c, r, g, r.N);
    ex.keep_alive(mine);
    messages[c.peers()[d]]->post(ex, mine->data(), 2 * r.N * c.L, kTagRelayCounts);
  }
  for (int n = 0; n < r.N; ++n) {  // as a source
    if (n == r.node) continue;
    r.out_weights[n] = entries_on(c, r, n);
    ex.keep_alive(r.out_weights[n]);
    messages[c.peers()[r.nd.relay_on(n)]]->put_block(ex, r.out_weights[n]->data(),
                                                     static_cast<int64_t>(r.out_weights[n]->size()),
                                                     entry, kTagRelayWeights);
  }
  ex.wait();
  for (int s = 0; s < c.W; ++s) {
    if (recv_index[s] < 0) continue;
    const int64_t bytes = ex.received_bytes(recv_index[s]);
    MOE_EP_CHECK(bytes % entry == 0);
    r.weights[s]->resize(static_cast<std::size_t>(bytes / entry));
  }
  for (int g = 0; g < r.nd.G; ++g) read_layout(c, r, g);
}

// Phase "relay rows", an owner's part for relay g: how many rows it holds for g's sources; in
// (source node, local expert, row) order, their checks (token, slot, expert) without the
// handle's routes, and, when `rows_too` (g reads nothing in place here), the rows and their int8
// scales. (Counted, not derived from the bytes: H may be 0.)
int64_t pack_for_relay(const Combine& c, int g, const Relay& r, bool rows_too,
                       std::shared_ptr<Tensor>& rows, std::shared_ptr<std::vector<float>>& scales,
                       std::shared_ptr<std::vector<BackMeta>>& meta) {
  int64_t total = 0;
  for (int m = 0; m < r.N; ++m)
    if (m != r.node) total += c.blocks->source_rows[m * r.nd.G + g];
  if (rows_too) rows = std::make_shared<Tensor>(Tensor::empty(DType::kI8, {total * c.wire_row}));
  if (rows_too && c.cq) scales = std::make_shared<std::vector<float>>();
  if (!c.plan) meta = std::make_shared<std::vector<BackMeta>>();
  std::vector<RowCopy> copies;
  const TensorView& ai = c.in.assist_info_for_combine;
  for (int m = 0; m < r.N; ++m) {
    if (m == r.node) continue;
    const int s = m * r.nd.G + g;
    for (int l = 0; l < c.L; ++l) {
      const int64_t b = int64_t{l} * c.W + s;
      for (int64_t j = c.blocks->block_offset[b];
           j < c.blocks->block_offset[b] + c.blocks->block_rows[b]; ++j) {
        const int64_t at = static_cast<int64_t>(copies.size());
        if (rows) copies.push_back({own_row(c, j), rows->ptr<char>() + at * c.wire_row, j});
        if (scales) scales->push_back(c.qscales[j]);
        if (meta)
          meta->push_back(BackMeta{static_cast<int32_t>(index_at(ai, 3 * j + 1)),
                                   static_cast<int32_t>(index_at(ai, 3 * j + 2)),
                                   static_cast<int32_t>(c.sh.pl.expert_on(c.sh.rank, l))});
      }
    }
  }
  parallel_copy(copies, c.wire_row);
  return total;
}

void exchange_rows(const Combine& c, Relay& r) {
  const auto& messages = message_links(c.comm);
  const int64_t row_bytes = c.wire_row, meta_bytes = sizeof(BackMeta);
  Exchange ex(c.comm, c.op, "relay rows");
  for (int g = 0; g < r.nd.G; ++g) {
    const int d = r.node * r.nd.G + g;
    const bool in_place = d == c.me || c.agreed.read[d];  // as a relay: where owner d's rows lie
    std::shared_ptr<Tensor> rows;                         // as an owner: what it sends relay g
    std::shared_ptr<std::vector<float>> scales;
    std::shared_ptr<std::vector<BackMeta>> meta;
    if (d == c.me) {  // as an owner for itself as a relay: the checks, in place
      pack_for_relay(c, g, r, false, rows, scales, r.meta[g]);
      continue;
    }
    int64_t in_rows = 0;  // as a relay: from owner d
    for (const int64_t v : r.counts[g]) in_rows += v;
    const Link& link = *messages[c.peers()[d]];
    if (in_rows > 0 && !in_place) {
      r.rows[g] = std::make_shared<Tensor>(Tensor::empty(DType::kI8, {in_rows * c.wire_row}));
      ex.keep_alive(r.rows[g]);
      link.get_block(ex, r.rows[g]->data(), in_rows, row_bytes, kTagRelayBack);
      if (c.cq) {
        r.scales[g] = std::make_shared<std::vector<float>>(static_cast<std::size_t>(in_rows));
        ex.keep_alive(r.scales[g]);
        link.expect(ex, r.scales[g]->data(), in_rows, kTagRelayBack);
      }
    }
    if (in_rows > 0 && !c.plan) {
      r.meta[g] = std::make_shared<std::vector<BackMeta>>(static_cast<std::size_t>(in_rows));
      ex.keep_alive(r.meta[g]);
      link.get_block(ex, r.meta[g]->data(), in_rows, meta_bytes, kTagRelayBack);
    }
    const int64_t out_rows = pack_for_relay(c, g, r, !c.agreed.provide[d], rows, scales, meta);
    if (out_rows == 0) continue;
    if (rows) {
      ex.keep_alive(rows);
      link.put_block(ex, rows->data(), out_rows, row_bytes, kTagRelayBack);
    }
    if (scales) {
      ex.keep_alive(scales);
      link.post(ex, scales->data(), out_rows, kTagRelayBack);
    }
    if (meta) {
      ex.keep_alive(meta);
      link.put_block(ex, meta->data(), out_rows, meta_bytes, kTagRelayBack);
    }
  }
  ex.wait();
}

// Owner g's j-th row for the relay's sources and its int8 scale: where it lies, or as it came.
struct OwnerRows {
  const Combine& c;
  const Relay& r;
  Traffic& traffic;
  const char* row(int g, int64_t j) const {
    if (r.rows[g]) return r.rows[g]->ptr<char>() + j * c.wire_row;
    const int d = r.node * r.nd.G + g;
    const int64_t at = r.at[g][j];
    if (d == c.me) return own_row(c, at);
    const Where& w = c.agreed.where[d];
    traffic.window_bytes[c.peers()[d]] += c.wire_row + (c.cq ? 4 : 0);
    return c.agreed.shm->link(c.peers()[d])
        ->place(static_cast<int>(w.gen), w.rows + at * w.stride, c.wire_row);
  }
  float scale(int g, int64_t j) const {
    if (!c.cq) return 0.0f;
    if (r.scales[g]) return (*r.scales[g])[j];
    const int d = r.node * r.nd.G + g;
    const int64_t at = r.at[g][j];
    if (d == c.me) return c.qscales[at];
    float v;
    std::memcpy(
        &v,
        c.agreed.shm->link(c.peers()[d])
            ->place(static_cast<int>(c.agreed.where[d].gen), c.agreed.where[d].extra + at * 4, 4),
        4);
    return v;
  }
};

// The rows source s's entries on this node name, checked: [token * KS + slot] -> the term
// (null row: none came). Returns the first disagreement as a status (all 0: none).
std::vector<int32_t> gather_terms(const Combine& c, const Relay& r, int s,
                                  std::vector<PartialTerm>& terms) {
  const int64_t KS = c.sh.KS, bs = c.agreed.headers[s].BS, m = s / r.nd.G;
  std::vector<PartialTerm> at(static_cast<std::size_t>(bs * KS), PartialTerm{nullptr, 0, 0, false});
  const OwnerRows rows{c, r, CommInternals::traffic(c.comm)};
  std::vector<int32_t> expert(at.size(), kNone);
  std::vector<int32_t> status(kStatusWords, 0);
  auto bad = [&](int64_t token, int64_t slot, int32_t got, int32_t want) {
    if (status[0] == 0) status = {1, int32_t(token), int32_t(slot), got, want};
  };
  const std::vector<int32_t>* routes = c.plan && s < static_cast<int>(c.plan->relay_routes.size())
                                           ? &c.plan->relay_routes[s]
                                           : nullptr;
  for (int g = 0; g < r.nd.G; ++g) {
    const int d = r.node * r.nd.G + g;
    int64_t j = 0;  // owner g's rows for s start after those of earlier source nodes
    for (int mm = 0; mm < m; ++mm)
      if (mm != r.node) j += r.counts[g][mm];
    const int64_t n = r.counts[g][m];
    // With the handle: owner d's rows for s are the copies for d, in order.
    int64_t route = 0;
    for (int64_t q = 0; q < n; ++q, ++j) {
      int32_t token, slot, e;
      if (r.meta[g]) {
        const BackMeta& b = (*r.meta[g])[j];
        token = b.token, slot = b.slot, e = b.expert;
      } else {
        while (route * 4 < static_cast<int64_t>(routes->size()) && (*routes)[route * 4 + 2] != d)
          ++route;
        MOE_EP_CHECK(route * 4 < static_cast<int64_t>(routes->size()));
        token = (*routes)[route * 4], slot = (*routes)[route * 4 + 1];
        e = static_cast<int32_t>(c.sh.pl.expert_on(d, (*routes)[route * 4 + 3]));
        ++route;
      }
      if (token < 0 || token >= bs || slot < 0 || slot >= KS) {
        bad(token, slot, e, kNone);
        continue;
      }
      const int64_t key = int64_t{token} * KS + slot;
      if (at[key].row) bad(token, slot, e, expert[key]);
      at[key] = PartialTerm{rows.row(g, j), 0, rows.scale(g, j), slot >= c.sh.K};
      expert[key] = e;
    }
  }
  int64_t used = 0;
  for (const RelayEntry& w : *r.weights[s]) {
    const int64_t key = int64_t{w.token} * KS + w.slot;
    if (w.token < 0 || w.token >= bs || w.slot < 0 || w.slot >= KS) {
      bad(w.token, w.slot, kNone, w.expert);
      continue;
    }
    if (!at[key].row || expert[key] != w.expert) {
      bad(w.token, w.slot, expert[key], w.expert);
      continue;
    }
    ++used;
    terms.push_back(at[key]);
    terms.back().weight = w.weight;
  }
  int64_t got = 0;
  for (const PartialTerm& t : at) got += t.row != nullptr;
  if (status[0] == 0 && got != used)  // a row no entry of the source names
    for (std::size_t key = 0; key < at.size(); ++key)
      if (at[key].row &&
          std::none_of(r.weights[s]->begin(), r.weights[s]->end(), [&](const RelayEntry& w) {
            return int64_t{w.token} * KS + w.slot == static_cast<int64_t>(key);
          })) {
        bad(static_cast<int64_t>(key) / KS, static_cast<int64_t>(key) % KS, expert[key], kNone);
        break;
      }
  return status;
}

// A relay's partials for source s: one per token of its entries, in their order, computed and
// sent in chunks of kChunkBytes, so the first is on the wire while the next is summed. A chunk
// stays below OpenMPI's TCP eager limit (btl_tcp_eager_limit, 64 KB with its header): a larger
// message waits for the receiver's rendezvous reply, which queues behind the partials flowing
// the other way on the same link. Measured on 2 hosts x 2 ranks at 1 Gbit/s (docs/
// performance.md, "Across machines"): combine p50 41 ms with 60 KB chunks, 64 ms with 256 KB.
constexpr int64_t kChunkBytes = 60 << 10;
// A partial row's bytes: int8, or EpConfig::partials' dtype.
int64_t partial_row(const Combine& c) {
  return c.cq ? c.sh.H : c.sh.H * static_cast<int64_t>(dtype_size(c.partials));
}
int64_t chunk_tokens(const Combine& c) {
  const int64_t prow = partial_row(c);
  return prow > 0 ? std::max<int64_t>(1, kChunkBytes / prow) : INT32_MAX;
}

struct Partials {
  std::shared_ptr<std::vector<int32_t>> status;  // kStatusWords, then the tokens
  std::vector<PartialTerm> terms;
  std::vector<int64_t> first;  // each token's first term, then the end
  int64_t tokens() const { return static_cast<int64_t>(first.size()) - 1; }
};

Partials plan_partials(const Combine& c, const Relay& r, int s) {
  Partials p;
  std::vector<int32_t> status = gather_terms(c, r, s, p.terms);
  const std::vector<RelayEntry>& w = *r.weights[s];
  std::vector<int32_t> tokens;
  for (std::size_t j = 0; j < w.size(); ++j)
    if (tokens.empty() || tokens.back() != w[j].token)
      tokens.push_back(w[j].token), p.first.push_back(static_cast<int64_t>(j));
  p.first.push_back(static_cast<int64_t>(w.size()));
  p.status = std::make_shared<std::vector<int32_t>>(status);
  p.status->insert(p.status->end(), tokens.begin(), tokens.end());
  if (status[0] != 0) p.terms.clear();  // nothing to sum: the source raises
  return p;
}

// Tokens [t0, t1) of the partials into `to` (fp32; int8 with its scales at `scales`; or rounded
// once to EpConfig::partials' dtype): zero rows when a check failed.
void sum_partials(const Combine& c, const Partials& p, int64_t t0, int64_t t1, char* to,
                  float* scales) {
  const int64_t T = t1 - t0, H = c.sh.H;
  const bool round = !c.cq && c.partials != DType::kF32;
  Tensor f32 = c.cq || round ? Tensor::zeros(DType::kF32, {T, H}) : Tensor();
  float* out = f32.defined() ? f32.ptr<float>() : reinterpret_cast<float*>(to);
  if (!f32.defined() && T * H > 0) std::memset(out, 0, static_cast<std::size_t>(T * H * 4));
  if (!p.terms.empty())
    // Threads by the source's tokens, not the chunk's (a chunk alone is below the threshold).
    parallel(threads_if(p.tokens() * H > (1 << 16)), [&] {
#pragma omp for schedule(static)
      for (int64_t t = t0; t < t1; ++t)
        relay_partial(out + (t - t0) * H, p.terms.data() + p.first[t], p.first[t + 1] - p.first[t],
                      c.sh.dtype, c.cq, H);
    });
  if (round) {  // one rounding to nearest even, as the output's
    const int64_t rb = H * static_cast<int64_t>(dtype_size(c.partials));
    for (int64_t t = 0; t < T; ++t) store_row_f32(to + t * rb, c.partials, out + t * H, H);
    return;
  }
  if (!c.cq) return;
  QuantizeRowsInt8Args a;
  a.op = c.op;
  a.name = "the relay's partial sums";
  a.rows = T;
  a.n = H;
  a.dtype = DType::kF32;
  a.src = out;
  a.src_stride = H;
  a.q = reinterpret_cast<int8_t*>(to);
  a.q_stride = H;
  a.scales = scales;
  quantize_rows_int8(a);
}

// The source's check of what relay `n` found, and of the tokens of its partials.
void check_partials(const Combine& c, const Relay& r, int n, const std::vector<int32_t>& status) {
  const int relay = c.peers()[r.nd.relay_on(n)];
  auto expert = [](int32_t e) { return e == kNone ? std::string("none") : std::to_string(e); };
  if (status[0] != 0)
    invalid(c.op, ": rank ", relay, ", the relay of rank ", c.comm.rank(), "'s tokens on node ", n,
            ", found for (token ", status[1], ", slot ", status[2], ") the row of expert ",
            expert(status[3]), " where expert_ids route it to expert ", expert(status[4]),
            ": expert_ids (and x_active_mask) must be those of the matching dispatch_v2 (same "
            "tokens, same order)");
  const std::vector<int32_t>& want = r.node_tokens[n];
  if (!std::equal(want.begin(), want.end(), status.begin() + kStatusWords))
    fail(ErrorKind::kInternal, c.op, ": rank ", relay, " sent the partials of other tokens than ",
         "rank ", c.comm.rank(), " has on node ", n, " (please report this bug)");
}

void exchange_partials(const Combine& c, Relay& r) {
  const auto& messages = message_links(c.comm);
  const int64_t prow = partial_row(c), chunk = chunk_tokens(c);
  const int64_t row_bytes = prow;
  Exchange ex(c.comm, c.op, "relay partials");
  std::vector<std::shared_ptr<std::vector<int32_t>>> status(static_cast<std::size_t>(r.N));
  for (int n = 0; n < r.N; ++n) {  // as a source
    if (n == r.node) continue;
    const int64_t T = static_cast<int64_t>(r.node_tokens[n].size());
    const Link& from = *messages[c.peers()[r.nd.relay_on(n)]];
    status[n] = std::make_shared<std::vector<int32_t>>(static_cast<std::size_t>(kStatusWords + T));
    ex.keep_alive(status[n]);
    from.expect(ex, status[n]->data(), kStatusWords + T, kTagRelayStatus);
    if (T == 0) continue;
    r.partials[n] = std::make_shared<Tensor>(Tensor::empty(DType::kI8, {T * prow}));
    ex.keep_alive(r.partials[n]);
    if (c.cq)
      r.partial_scales[n] = std::make_shared<std::vector<float>>(static_cast<std::size_t>(T));
    if (c.cq) ex.keep_alive(r.partial_scales[n]);
    for (int64_t t = 0; t < T; t += chunk) {
      const int64_t k = std::min(chunk, T - t);
      from.get_block(ex, r.partials[n]->ptr<char>() + t * prow, k, row_bytes, kTagRelayPartial);
      if (c.cq) from.expect(ex, r.partial_scales[n]->data() + t, k, kTagRelayPartial);
    }
  }
  for (int s = 0; s < c.W; ++s) {  // as a relay
    if (!r.weights[s]) continue;
    const Partials p = plan_partials(c, r, s);
    const Link& to = *messages[c.peers()[s]];
    const int64_t T = p.tokens();
    ex.keep_alive(p.status);
    to.post(ex, p.status->data(), kStatusWords + T, kTagRelayStatus);
    if (T == 0) continue;
    auto rows = std::make_shared<Tensor>(Tensor::empty(DType::kI8, {T * prow}));
    auto scales = std::make_shared<std::vector<float>>(static_cast<std::size_t>(c.cq ? T : 0));
    ex.keep_alive(rows);
    ex.keep_alive(scales);
    for (int64_t t = 0; t < T; t += chunk) {
      const int64_t k = std::min(chunk, T - t);
      sum_partials(c, p, t, t + k, rows->ptr<char>() + t * prow,
                   c.cq ? scales->data() + t : nullptr);
      to.put_block(ex, rows->ptr<char>() + t * prow, k, row_bytes, kTagRelayPartial);
      if (c.cq) to.post(ex, scales->data() + t, k, kTagRelayPartial);
      ex.progress();
    }
  }
  if (r.meanwhile) r.meanwhile([&] { ex.progress(); });
  ex.wait();
  for (int n = 0; n < r.N; ++n)
    if (status[n]) check_partials(c, r, n, *status[n]);
}

// The phases, given the relays' state with its nodes set.
void relay_partials(const Combine& c, Relay& r) {
  r.N = r.nd.count(c.W);
  r.node = r.nd.node();
  r.out_weights.resize(static_cast<std::size_t>(r.N));
  r.weights.resize(static_cast<std::size_t>(c.W));
  r.layout.resize(static_cast<std::size_t>(r.nd.G));
  r.counts.resize(r.layout.size());
  r.at.resize(r.layout.size());
  r.rows.resize(r.counts.size());
  r.scales.resize(r.counts.size());
  r.meta.resize(r.counts.size());
  r.node_tokens.assign(static_cast<std::size_t>(r.N), {});
  r.partials.assign(static_cast<std::size_t>(r.N), nullptr);
  r.partial_scales.assign(static_cast<std::size_t>(r.N), nullptr);
  exchange_weights(c, r);
  exchange_rows(c, r);
  exchange_partials(c, r);
}

// The relays of comm_alg "hierarchy" across nodes of nd.G ranks: this node's own terms summed
// while the other nodes' partials travel, then everything added in node order.
class RelayCombine final : public CombineRoute {
 public:
  explicit RelayCombine(Nodes nd) : nd_(nd) {}
  int ranks_per_node() const override { return nd_.G; }
  bool direct(int d) const override { return !nd_.relayed(d); }
  bool serves_others() const override { return true; }
  // The phases' state lives for them alone; the partials (and their tokens) stay for the sum.
  void move_rows(const Combine& c, CombineSum& sum, bool located) override {
    np_.G = nd_.G;
    np_.node = nd_.node();
    np_.int8 = c.cq;
    np_.dtype = c.partials;
    np_.rank = c.me;
    Relay r;
    r.nd = nd_;
    if (located)
      r.meanwhile = [&](const std::function<void()>& progress) {
        sum.yrow = c.located.yrow.data();
        sum.yscale = c.cq ? c.located.yscale.data() : nullptr;
        const int64_t H = c.sh.H,
                      slice = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(H, 1));
        own_.resize(static_cast<std::size_t>(c.sh.BS * H));
        for (int64_t i = 0; i < c.sh.BS; i += slice) {
          own_node_partials(sum, np_, i, std::min(c.sh.BS, i + slice), own_.data());
          progress();
        }
        np_.own = own_.data();
      };
    relay_partials(c, r);
    node_tokens_ = std::move(r.node_tokens);
    partials_ = std::move(r.partials);
    partial_scales_ = std::move(r.partial_scales);
  }
  void sum(const CombineSum& sum) override {
    for (std::size_t n = 0; n < node_tokens_.size(); ++n) {
      np_.tokens.push_back(&node_tokens_[n]);
      np_.rows.push_back(partials_[n] ? partials_[n]->ptr<char>() : nullptr);
      np_.scales.push_back(partial_scales_[n] ? partial_scales_[n]->data() : nullptr);
    }
    combine_sum_nodes(sum, np_);
  }

 private:
  const Nodes nd_;
  NodePartials np_;
  std::vector<float> own_;  // this node's partials, summed while the others' travel
  // Per node: this rank's tokens there and their partial sums (Relay's, kept for the sum).
  std::vector<std::vector<int32_t>> node_tokens_;
  std::vector<std::shared_ptr<Tensor>> partials_;
  std::vector<std::shared_ptr<std::vector<float>>> partial_scales_;
};

}  // namespace

std::unique_ptr<CombineRoute> relay_combine(int G, int me) {
  return std::make_unique<RelayCombine>(Nodes{G, me});
}

}  // namespace moe_ep::detail
