// dispatch_v2 with comm_alg "hierarchy" across nodes (SPEC §3): the relay's part. A source sends
// each token bound to another node once, to its relay there (the rank of that node with the
// source's local index, its "rail" peer), with the routing of every copy; the relay writes the
// copies into the expand_x of the ranks of its node (its own included) in SPEC §1.4's order, with
// their metadata, so the receivers' outputs are bitwise those of fullmesh. Rows for the source's
// own node take the fullmesh steps (dispatch.cc). Every transfer is a message posted before any
// wait: a relay never waits on one source while another waits on it.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "base/check.h"
#include "base/tensor_internals.h"
#include "core/ep/dispatch_call.h"
#include "core/ep/route.h"
#include "core/ep/slot.h"
#include "kernels/cpu/quant.h"
#include "kernels/cpu/scatter.h"
#include "transport/communicator.h"
#include "transport/link.h"
#include "transport/tags.h"
#include "transport/windows.h"

namespace moe_ep::detail {

namespace {

// One copy a relay makes: a token (its row `pos` among those the source sent), where it goes
// (rank, local expert) and what RowMeta carries.
struct RelayMeta {
  int32_t pos, token, slot, dest, local;
  float scale, qscale;
};

// What each relayed source sent this relay: its tokens' rows and the copies to make.
struct RelayIn {
  int64_t wire_row = 0;                       // bytes of a row as it crossed
  std::vector<std::shared_ptr<Tensor>> rows;  // per world rank (null: it relays nothing here)
  std::vector<std::shared_ptr<std::vector<RelayMeta>>> meta;  // in the source's send order
};

void plan_relay_sends(const Nodes& nd, const Dispatch& c) {
  EpPlan& p = *c.plan;
  const int N = nd.count(c.W);
  p.node_tokens.assign(N, {});
  p.relay_tokens.assign(c.W, 0);
  p.relay_entries.assign(c.W, 0);
  p.relay_block_row.assign(c.W, {});
  std::vector<int32_t> seen(static_cast<std::size_t>(c.sh.BS), -1);
  for (int n = 0; n < N; ++n) {
    if (n == nd.node()) continue;  // own node: the fullmesh steps
    std::vector<int32_t>& tokens = p.node_tokens[n];
    for (int64_t j = p.send.rank_offset[n * nd.G]; j < p.send.rank_offset[(n + 1) * nd.G]; ++j) {
      const int64_t i = p.send.order[j] / c.sh.KS;
      if (seen[i] != n) seen[i] = n, tokens.push_back(static_cast<int32_t>(i));
    }
    std::sort(tokens.begin(), tokens.end());
  }
}

// Quantising `rows` rows of x (SPEC §1.5), row r read at src + src_index[r] * src_stride elements
// (x's dtype), written at q + r * H with its scale to scales[r]; no smoothing.
QuantizeRowsInt8Args x_rows_int8(const Dispatch& c, int64_t rows, const void* src,
                                 int64_t src_stride, const int32_t* src_index, int8_t* q,
                                 float* scales) {
  QuantizeRowsInt8Args a;
  a.op = c.op;
  a.name = "x";
  a.rows = rows;
  a.n = c.sh.H;
  a.dtype = c.sh.dtype;
  a.src = src;
  a.src_stride = src_stride;
  a.src_index = src_index;
  a.q = q;
  a.q_stride = c.sh.H;
  a.scales = scales;
  return a;
}

// The rows of `tokens`, as they cross: x's rows, or (quant_mode 2 without smoothing scales, SPEC
// §3) each token's int8 row once, its scale to qscale.
std::shared_ptr<Tensor> pack_tokens(const Dispatch& c, const std::vector<int32_t>& tokens,
                                    int64_t wire_row, bool int8_wire, std::vector<float>& qscale) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  auto rows = std::make_shared<Tensor>(Tensor::empty(DType::kI8, {T * wire_row}));
  if (int8_wire) {
    qscale.resize(static_cast<std::size_t>(T));
    QuantizeRowsInt8Args a = x_rows_int8(c, T, c.in.x.data, c.in.x.strides[0], tokens.data(),
                                         rows->ptr<int8_t>(), qscale.data());
    quantize_rows_int8(a);
    return rows;
  }
  std::vector<RowCopy> copies(static_cast<std::size_t>(T));
  for (int64_t t = 0; t < T; ++t)
    copies[t] = {c.x_row(tokens[t]), rows->ptr<char>() + t * wire_row, tokens[t]};
  parallel_copy(copies, wire_row);
  return rows;
}

// The copies of this rank's tokens for node n, in send order (destination, local expert, flat).
std::shared_ptr<std::vector<RelayMeta>> relay_meta(const Nodes& nd, const Dispatch& c, int n,
                                                   const std::vector<int32_t>& tokens,
                                                   const std::vector<float>& qscale) {
  const SendPlan& send = c.send();
  std::vector<int32_t> pos(static_cast<std::size_t>(c.sh.BS), -1);
  for (std::size_t t = 0; t < tokens.size(); ++t) pos[tokens[t]] = static_cast<int32_t>(t);
  auto meta = std::make_shared<std::vector<RelayMeta>>();
  for (int d = n * nd.G; d < (n + 1) * nd.G; ++d) {
    int64_t j = send.rank_offset[d];
    for (int64_t l = 0; l < c.sh.pl.local_experts(d); ++l) {
      const int64_t rows = send.counts[c.sh.pl.block_base(d) + l];
      for (int64_t r = 0; r < rows; ++r, ++j) {
        const int64_t flat = send.order[j], i = flat / c.sh.KS, k = flat % c.sh.KS;
        const float w =
            c.in.expert_scales && k < c.sh.K ? float_at(*c.in.expert_scales, i, k) : 0.0f;
        meta->push_back(RelayMeta{pos[i], static_cast<int32_t>(i), static_cast<int32_t>(k), d,
                                  static_cast<int32_t>(l), w,
                                  qscale.empty() ? 0.0f : qscale[pos[i]]});
      }
    }
  }
  return meta;
}

// A relayed source's copies must be for this node, grouped by rank then local expert, and name
// rows it sent.
void check_relay_meta(const Nodes& nd, const Dispatch& c, int s, const RelayIn& in) {
  const std::vector<RelayMeta>& meta = *in.meta[s];
  const int node = nd.node();
  int64_t last = -1;
  for (const RelayMeta& m : meta) {
    const int64_t key = int64_t{m.dest} * (c.sh.pl.blocks() + 1) + m.local;  // (rank, expert)
    if (m.dest / nd.G != node || m.local < 0 || m.local >= c.sh.pl.local_experts(m.dest) ||
        m.pos < 0 || m.pos >= c.counted.p->relay_tokens[s] || key < last)
      fail(ErrorKind::kInternal, c.op, ": rank ", c.peers()[s], " sent rank ", c.comm.rank(),
           " a copy for rank ", m.dest, ", local expert ", m.local, ", token row ", m.pos,
           " it cannot relay (please report this bug)");
    last = key;
  }
}

std::shared_ptr<RelayIn> exchange_relay(const Nodes& nd, const Dispatch& c) {
  const EpPlan& p = *c.counted.p;
  const bool int8_wire = c.quant && !c.in.scales;
  auto in = std::make_shared<RelayIn>();
  in->wire_row = int8_wire ? c.sh.H : c.sh.H * static_cast<int64_t>(dtype_size(c.sh.dtype));
  in->rows.resize(c.W);
  in->meta.resize(c.W);
  const auto& messages = message_links(c.comm);
  const int64_t row_bytes = in->wire_row, meta_bytes = sizeof(RelayMeta);
  Exchange ex(c.comm, c.op, "relay");
  for (int s = 0; s < c.W; ++s) {
    if (p.relay_tokens[s] == 0) continue;
    in->rows[s] = std::make_shared<Tensor>(
        Tensor::empty(DType::kI8, {int64_t{p.relay_tokens[s]} * in->wire_row}));
    in->meta[s] = std::make_shared<std::vector<RelayMeta>>(p.relay_entries[s]);
    ex.keep_alive(in->rows[s]);
    ex.keep_alive(in->meta[s]);
    const Link& from = *messages[c.peers()[s]];
    from.get_block(ex, in->rows[s]->data(), p.relay_tokens[s], row_bytes, kTagRelayRows);
    from.get_block(ex, in->meta[s]->data(), p.relay_entries[s], meta_bytes, kTagRelayMeta);
  }
  for (int n = 0; n < nd.count(c.W); ++n) {
    const std::vector<int32_t>& tokens = p.node_tokens[n];
    if (tokens.empty()) continue;
    std::vector<float> qscale;
    auto rows = pack_tokens(c, tokens, in->wire_row, int8_wire, qscale);
    auto meta = relay_meta(nd, c, n, tokens, qscale);
    ex.keep_alive(rows);
    ex.keep_alive(meta);
    const Link& to = *messages[c.peers()[nd.relay_on(n)]];
    to.put_block(ex, rows->data(), static_cast<int64_t>(tokens.size()), row_bytes, kTagRelayRows);
    to.put_block(ex, meta->data(), static_cast<int64_t>(meta->size()), meta_bytes, kTagRelayMeta);
  }
  ex.wait();
  if (c.plan) c.plan->relay_routes.assign(c.W, {});
  for (int s = 0; s < c.W; ++s) {
    if (!in->meta[s]) continue;
    check_relay_meta(nd, c, s, *in);
    if (!c.plan) continue;
    std::vector<int32_t>& routes = c.plan->relay_routes[s];
    for (const RelayMeta& m : *in->meta[s])
      routes.insert(routes.end(), {m.token, m.slot, m.dest, m.local});
  }
  return in;
}

void post_relayed_receives(const Nodes& nd, const Dispatch& c, Exchange& ex, RowsPhase& rx) {
  const auto& messages = message_links(c.comm);
  const RecvPlan& recv = c.recv();
  for (int s = 0; s < c.W; ++s) {
    if (!nd.relayed(s) || c.links.window_from[s]) continue;  // window: announced below
    rx.meta_in[s] = std::make_shared<std::vector<RowMeta>>(recv.source_rows[s]);
    ex.keep_alive(rx.meta_in[s]);
    if (nd.relay_of(s) == c.me || recv.source_rows[s] == 0) continue;  // relay_copies / nothing
    const Link& from = *messages[c.peers()[nd.relay_of(s)]];
    for (int l = 0; l < c.L; ++l) {
      const int64_t b = int64_t{l} * c.W + s;
      if (recv.block_rows[b] > 0)
        from.get_block(ex, c.out.expand_x.ptr<char>() + recv.block_offset[b] * c.out_row_bytes,
                       recv.block_rows[b], rx.row_bytes, kTagRelayRows);
    }
    from.get_block(ex, rx.meta_in[s]->data(), recv.source_rows[s], rx.meta_bytes, kTagRelayMeta);
  }
  if (!c.slot) return;
  for (int q = nd.first(); q < nd.first() + nd.G; ++q)  // every other relay here
    if (q != c.me)
      c.agreed.shm->link(c.peers()[q])
          ->expect_announce(ex, rx.announced->data() + 2 * c.W + q, kTagRelayMeta);
}

// Every copy of source s's tokens, in its send order, copy j to dst[j] (out_row_bytes each): the
// row as it crossed, or (quant_mode 2 with smoothing scales) quantised here with its expert's
// row of this rank's scales (SPEC §3), its scale to qscale[j].
void make_copies(const Dispatch& c, const RelayIn& in, int s, const std::vector<char*>& dst,
                 std::vector<float>& qscale) {
  const std::vector<RelayMeta>& meta = *in.meta[s];
  const int64_t n = static_cast<int64_t>(meta.size());
  if (c.quant && c.in.scales) {
    std::vector<int32_t> src(static_cast<std::size_t>(n)), smooth(src.size());
    for (int64_t j = 0; j < n; ++j) {
      const RelayMeta& m = meta[j];
      src[j] = m.pos;
      smooth[j] = static_cast<int32_t>(
          m.slot < c.sh.K ? c.sh.pl.Ns + c.sh.pl.expert_on(m.dest, m.local) : m.slot - c.sh.K);
    }
    qscale.resize(static_cast<std::size_t>(n));
    for (int64_t j = 0; j < n;) {  // one call per run of contiguous destinations (a block)
      int64_t end = j + 1;
      while (end < n && dst[end] == dst[end - 1] + c.out_row_bytes) ++end;
      QuantizeRowsInt8Args a = x_rows_int8(c, end - j, in.rows[s]->data(), c.sh.H, src.data() + j,
                                           reinterpret_cast<int8_t*>(dst[j]), qscale.data() + j);
      a.smooth = c.in.scales->ptr<float>();
      a.smooth_stride = c.sh.H;
      a.smooth_index = smooth.data() + j;
      quantize_rows_int8(a);
      j = end;
    }
    return;
  }
  std::vector<RowCopy> copies(static_cast<std::size_t>(n));
  for (int64_t j = 0; j < n; ++j)
    copies[j] = {in.rows[s]->ptr<char>() + meta[j].pos * in.wire_row, dst[j], meta[j].pos};
  parallel_copy(copies, c.out_row_bytes);
}

// Where the relay puts the copies of one source: straight into the receivers' windows (and its
// own expand_x), or, for a receiver without a window slot this call, into `staged` for messages.
struct CopyPlan {
  std::vector<char*> dst;          // per copy
  std::shared_ptr<Tensor> staged;  // the copies for message receivers, in send order
  std::vector<int64_t> staged_at;  // per copy: its row in staged (-1: not staged)
};

// Copies [j, end) of source s's are for rank d: one run per block (l, s), in block order.
template <typename Each>
void for_each_block(const std::vector<RelayMeta>& meta, int64_t j, int64_t end, Each each) {
  for (int64_t r = j; r < end;) {
    int64_t stop = r;
    while (stop < end && meta[stop].local == meta[r].local) ++stop;
    each(r, stop, meta[r].local);
    r = stop;
  }
}

bool window_to(const Dispatch& c, int d) { return d != c.me && c.agreed.where[d].gen >= 0; }

CopyPlan plan_copies(const Nodes& nd, const Dispatch& c, int s,
                     const std::vector<RelayMeta>& meta) {
  const int64_t n = static_cast<int64_t>(meta.size()), rb = c.out_row_bytes, m = s / nd.G;
  CopyPlan cp;
  cp.dst.resize(static_cast<std::size_t>(n));
  cp.staged_at.assign(static_cast<std::size_t>(n), -1);
  int64_t staged = 0;
  for (int64_t j = 0; j < n; ++j)
    if (meta[j].dest != c.me && !window_to(c, meta[j].dest)) cp.staged_at[j] = staged++;
  if (staged > 0) cp.staged = std::make_shared<Tensor>(Tensor::empty(DType::kI8, {staged * rb}));
  for (int64_t j = 0; j < n; ++j) {
    const int d = meta[j].dest;
    int64_t end = j;
    while (end < n && meta[end].dest == d) ++end;
    for_each_block(meta, j, end, [&](int64_t r, int64_t stop, int32_t l) {
      for (int64_t q = r; q < stop; ++q) {
        if (cp.staged_at[q] >= 0) {
          cp.dst[q] = cp.staged->ptr<char>() + cp.staged_at[q] * rb;
        } else if (d == c.me) {
          const int64_t b = int64_t{l} * c.W + s;
          MOE_EP_CHECK(c.recv().block_rows[b] == stop - r);
          cp.dst[q] = c.out.expand_x.ptr<char>() + (c.recv().block_offset[b] + q - r) * rb;
        } else {
          const int64_t row =
              c.counted.p->relay_block_row[d][m * c.sh.pl.local_experts(d) + l] + q - r;
          cp.dst[q] = c.agreed.shm->link(c.peers()[d])
                          ->place(static_cast<int>(c.agreed.where[d].gen),
                                  c.agreed.where[d].rows + row * rb, rb);
        }
      }
    });
    j = end - 1;
  }
  return cp;
}

// The copies [j, end) of source s for rank d (not this rank), after their rows: into d's window
// next to them, then counted for the announcement; or messages of the rows and the metadata.
void send_relayed(const Nodes& nd, const Dispatch& c, Exchange& ex, RowsPhase& rx, int s,
                  const CopyPlan& cp, const std::vector<RelayMeta>& meta, int64_t j, int64_t end,
                  std::shared_ptr<std::vector<RowMeta>> rows_meta) {
  const int d = meta[j].dest;
  const int64_t m = s / nd.G;
  if (!window_to(c, d)) {
    for_each_block(meta, j, end, [&](int64_t r, int64_t stop, int32_t) {
      message_links(c.comm)[c.peers()[d]]->put_block(
          ex, cp.staged->ptr<char>() + cp.staged_at[r] * c.out_row_bytes, stop - r, rx.row_bytes,
          kTagRelayRows);
    });
    ex.keep_alive(rows_meta);
    message_links(c.comm)[c.peers()[d]]->put_block(ex, rows_meta->data(), end - j, rx.meta_bytes,
                                                   kTagRelayMeta);
    return;
  }
  const Link& link = *c.agreed.shm->link(c.peers()[d]);
  for_each_block(meta, j, end, [&](int64_t r, int64_t stop, int32_t l) {
    const int64_t row = c.counted.p->relay_block_row[d][m * c.sh.pl.local_experts(d) + l];
    const int64_t bytes = (stop - r) * static_cast<int64_t>(sizeof(RowMeta));
    std::memcpy(link.place(static_cast<int>(c.agreed.where[d].gen),
                           c.agreed.where[d].extra + row * int64_t{sizeof(RowMeta)}, bytes),
                rows_meta->data() + (r - j), static_cast<std::size_t>(bytes));
  });
  (*rx.announced)[3 * c.W + d] += end - j;
  CommInternals::traffic(c.comm).window_bytes[c.peers()[d]] +=
      (end - j) * (c.out_row_bytes + static_cast<int64_t>(sizeof(RowMeta)));
}

void relay_copies(const Nodes& nd, const Dispatch& c, Exchange& ex, RowsPhase& rx,
                  const RelayIn& in) {
  for (int s = 0; s < c.W; ++s) {
    if (!in.meta[s]) continue;
    const std::vector<RelayMeta>& meta = *in.meta[s];
    const int64_t n = static_cast<int64_t>(meta.size());
    CopyPlan cp = plan_copies(nd, c, s, meta);
    if (cp.staged) ex.keep_alive(cp.staged);
    std::vector<float> qscale;
    make_copies(c, in, s, cp.dst, qscale);
    // Per rank of this node: its copies are one run of the send order, its local experts' blocks
    // runs inside it, in the order of that rank's blocks (l, s).
    for (int64_t j = 0; j < n;) {
      const int d = meta[j].dest;
      int64_t end = j;
      while (end < n && meta[end].dest == d) ++end;
      auto rows_meta = d == c.me ? rx.meta_in[s] : std::make_shared<std::vector<RowMeta>>();
      if (d == c.me && static_cast<int64_t>(rows_meta->size()) != end - j)
        fail(ErrorKind::kInternal, c.op, ": rank ", c.peers()[s], " relays ", end - j,
             " rows to rank ", c.comm.rank(), ", its counts said ", rows_meta->size(),
             " (please report this bug)");
      rows_meta->resize(static_cast<std::size_t>(end - j));
      for (int64_t r = j; r < end; ++r) {
        const RelayMeta& m = meta[r];
        (*rows_meta)[r - j] =
            RowMeta{m.token, m.slot, m.scale, qscale.empty() ? m.qscale : qscale[r]};
      }
      if (d != c.me) send_relayed(nd, c, ex, rx, s, cp, meta, j, end, rows_meta);
      j = end;
    }
  }
  for (int d = nd.first(); d < nd.first() + nd.G; ++d)  // every receiver here
    if (window_to(c, d))
      c.agreed.shm->link(c.peers()[d])
          ->announce(ex, rx.announced->data() + 3 * c.W + d, kTagRelayMeta);
}

// The relays of comm_alg "hierarchy" across nodes of nd.G ranks.
class RelayDispatch final : public DispatchRoute {
 public:
  explicit RelayDispatch(Nodes nd) : nd_(nd) {}
  int ranks_per_node() const override { return nd_.G; }
  bool direct(int d) const override { return !nd_.relayed(d); }
  void plan_sends(const Dispatch& c) const override { plan_relay_sends(nd_, c); }
  // The tokens and copies this rank relays through d (0, 0 unless d is its relay on d's node).
  int count_entries() const override { return 2; }
  void put_counts(const Dispatch& c, int d, std::vector<int32_t>& out) const override {
    const int n = d / nd_.G;
    const bool relay = nd_.relayed(d) && d == nd_.relay_on(n);
    const SendPlan& send = c.plan->send;
    out.push_back(relay ? static_cast<int32_t>(c.plan->node_tokens[n].size()) : 0);
    out.push_back(relay ? static_cast<int32_t>(send.rank_offset[(n + 1) * nd_.G] -
                                               send.rank_offset[n * nd_.G])
                        : 0);
  }
  void take_counts(const Dispatch& c, int q, const int32_t* entries) const override {
    EpPlan& p = *c.plan;
    p.relay_tokens[q] = entries[0];
    p.relay_entries[q] = entries[1];
    if (p.relay_tokens[q] < 0 || p.relay_entries[q] < p.relay_tokens[q] ||
        (p.relay_tokens[q] > 0 && !(nd_.relayed(q) && nd_.relay_of(q) == c.me)))
      fail(ErrorKind::kInternal, c.op, ": rank ", c.peers()[q], " relays ", p.relay_tokens[q],
           " tokens (", p.relay_entries[q], " copies) through rank ", c.comm.rank(),
           " (please report this bug)");
  }
  // Per node m, the source there with the peer's index in its node (on this node: the peer).
  int block_runs(int W) const override { return nd_.count(W); }
  int block_source(int m, int q) const override { return m * nd_.G + q % nd_.G; }
  int own_run() const override { return nd_.node(); }
  void keep_block_rows(EpPlan& p, int q, std::vector<int64_t>&& runs) const override {
    p.relay_block_row[q] = std::move(runs);
  }
  void before_rows(const Dispatch& c) override { in_ = exchange_relay(nd_, c); }
  void post_receives(const Dispatch& c, Exchange& ex, RowsPhase& rx) const override {
    post_relayed_receives(nd_, c, ex, rx);
  }
  // The relayed sources' rows are copied out here (the messages keep what they send).
  void post_sends(const Dispatch& c, Exchange& ex, RowsPhase& rx) override {
    relay_copies(nd_, c, ex, rx, *in_);
    in_.reset();
  }
  // A relayed source's rows come from its relay on this node (this rank: in place already).
  int carrier(int s) const override { return nd_.relayed(s) ? nd_.relay_of(s) : s; }
  // A relay q of this node announces the rows it wrote into this rank's window for the sources
  // it relays (post_relayed_receives); they are visible after its announcement.
  void check_carried(const Dispatch& c, const RowsPhase& rx, int q) const override {
    if (!c.slot || nd_.relayed(q)) return;
    int64_t counted = 0;
    for (int s = 0; s < c.W; ++s)
      if (c.links.window_from[s] && nd_.relayed(s) && nd_.relay_of(s) == q)
        counted += c.recv().source_rows[s];
    c.agreed.shm->link(c.peers()[q])->acquire();
    check_announced(c, q, (*rx.announced)[2 * c.W + q], counted, " relayed");
  }

 private:
  const Nodes nd_;
  std::shared_ptr<RelayIn> in_;  // what the relayed sources sent this rank (before_rows)
};

}  // namespace

std::unique_ptr<DispatchRoute> relay_dispatch(int G, int me) {
  return std::make_unique<RelayDispatch>(Nodes{G, me});
}

}  // namespace moe_ep::detail
