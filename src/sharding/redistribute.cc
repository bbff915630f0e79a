// Redistribution between placements over point-to-point messages with deadlines
// (transport/exchange.h), and the header agreement of the sharded collectives.
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "base/check.h"
#include "kernels/cpu/convert.h"
#include "sharding/internal.h"
#include "transport/exchange.h"
#include "transport/tags.h"

namespace moe_ep {
namespace detail {

namespace {

// Messages are split into pieces of at most 1 GiB (Exchange takes at most INT_MAX bytes).
constexpr int64_t kMaxMessage = int64_t{1} << 30;

void send_bytes(Exchange& ex, const void* p, int64_t bytes, int peer) {
  for (int64_t off = 0; off < bytes; off += kMaxMessage)
    ex.isend(static_cast<const char*>(p) + off, std::min(kMaxMessage, bytes - off), peer,
             kTagShardData);
}

void recv_bytes(Exchange& ex, void* p, int64_t bytes, int peer) {
  for (int64_t off = 0; off < bytes; off += kMaxMessage)
    ex.irecv(static_cast<char*>(p) + off, std::min(kMaxMessage, bytes - off), peer, kTagShardData);
}

struct ShardHeader {
  static constexpr int kMaxFields = 96;
  int32_t magic = 0x4d4f5348;  // "MOSH"
  int32_t call = 0;
  int32_t ok = 1;
  int32_t kind = 0;
  int32_t nfields = 0;
  int32_t pad = 0;
  int64_t fields[kMaxFields] = {};
  char message[400] = {};
};

const char* call_name(int32_t call) {
  if (call == kCallRedistribute) return "redistribute";
  if (call >= kCallOpBase && call <= kCallOpBase + static_cast<int>(ShardedOp::kUnpermuteGradV2))
    return op_name(static_cast<ShardedOp>(call - kCallOpBase));
  return "an unknown collective";
}

// A contiguous tensor of `shape` in `dtype` (fresh).
Tensor fresh(DType dtype, const std::vector<int64_t>& shape) { return Tensor::empty(dtype, shape); }

std::vector<int64_t> box_shape(const Box& b) {
  return std::vector<int64_t>(b.len.begin(), b.len.begin() + b.ndim);
}

// Whether `region` is one contiguous run of a contiguous tensor holding `box`.
bool contiguous_in(const Box& box, const Box& region) {
  int d = 0;
  while (d < box.ndim && region.len[d] == 1) ++d;  // leading dims of extent 1
  if (d < box.ndim) ++d;                           // the first dim of larger extent: any range
  for (; d < box.ndim; ++d)
    if (region.lo[d] != box.lo[d] || region.len[d] != box.len[d]) return false;
  return true;
}

// Element offset of region.lo inside a contiguous tensor holding `box`.
int64_t offset_in(const Box& box, const Box& region) {
  int64_t off = 0;
  for (int d = 0; d < box.ndim; ++d) off = off * box.len[d] + (region.lo[d] - box.lo[d]);
  return off;
}

// The local piece as a contiguous tensor (a copy only when it is strided).
std::shared_ptr<Tensor> contiguous_local(const DTensor& x, const Box& box) {
  auto t = std::make_shared<Tensor>();
  if (owner_is_local(x)) {
    *t = x.owner;
    return t;
  }
  *t = fresh(x.local.dtype, box_shape(box));
  copy_box(x.local, box, t->view(), box, box);
  return t;
}

// Shard(a) -> Replicate / Shard(b): every rank sends each peer the part of its piece that the
// peer's target box covers.
DTensor move_boxes(const Communicator& mesh, const char* op, const DTensor& x, Placement to) {
  const int n = mesh.size(), me = mesh.rank();
  const DType dt = x.local.dtype;
  const int64_t es = static_cast<int64_t>(dtype_size(dt));
  const Box have = box_of(x.global_shape, x.placement, n, me);
  const Box want = box_of(x.global_shape, to, n, me);
  auto out = std::make_shared<Tensor>(fresh(dt, box_shape(want)));
  // Pieces received into temporaries (regions not contiguous in `out`), unpacked after the wait.
  std::vector<std::pair<Box, std::shared_ptr<Tensor>>> unpack;
  {
    Exchange ex(mesh, op, "redistribute");
    ex.keep_alive(out);
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      const Box region = intersect(box_of(x.global_shape, x.placement, n, p), want);
      if (region.numel() == 0) continue;
      if (contiguous_in(want, region)) {
        recv_bytes(ex, out->ptr<char>() + offset_in(want, region) * es, region.numel() * es, p);
      } else {
        auto tmp = std::make_shared<Tensor>(fresh(dt, box_shape(region)));
        ex.keep_alive(tmp);
        recv_bytes(ex, tmp->data(), region.numel() * es, p);
        unpack.push_back({region, tmp});
      }
    }
    std::shared_ptr<Tensor> whole;  // the whole local piece, packed once
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      const Box region = intersect(have, box_of(x.global_shape, to, n, p));
      if (region.numel() == 0) continue;
      std::shared_ptr<Tensor> pack;
      if (region == have) {
        if (!whole) whole = contiguous_local(x, have);
        pack = whole;
      } else {
        pack = std::make_shared<Tensor>(fresh(dt, box_shape(region)));
        copy_box(x.local, have, pack->view(), region, region);
      }
      ex.keep_alive(pack);
      send_bytes(ex, pack->data(), region.numel() * es, p);
    }
    copy_box(x.local, have, out->view(), want, intersect(have, want));
    ex.wait();
  }
  for (const auto& [region, tmp] : unpack) copy_box(tmp->view(), region, out->view(), want, region);
  return DTensor::from_local(*out, to, x.global_shape);
}

// Sums `parts` (each `count` elements in dtype `src`, rank order) in fp32 and rounds once to `dst`.
void sum_parts(const std::vector<const void*>& parts, DType src, int64_t count, void* out,
               DType dst) {
  constexpr int64_t kBlock = 4096;
  std::vector<float> acc(static_cast<std::size_t>(std::min(count, kBlock)));
  const int64_t ses = static_cast<int64_t>(dtype_size(src));
  const int64_t des = static_cast<int64_t>(dtype_size(dst));
  for (int64_t b = 0; b < count; b += kBlock) {
    const int64_t m = std::min(kBlock, count - b);
    load_row_f32(acc.data(), static_cast<const char*>(parts[0]) + b * ses, src, m);
    for (std::size_t p = 1; p < parts.size(); ++p)
      add_row_f32(acc.data(), static_cast<const char*>(parts[p]) + b * ses, src, m);
    store_row_f32(static_cast<char*>(out) + b * des, dst, acc.data(), m);
  }
}

// Partial -> Shard(d): each rank sums the target piece it owns. Partial -> Replicate: the same
// over element ranges of the flattened tensor, then an all-gather of the rounded ranges.
DTensor reduce(const Communicator& mesh, const char* op, const DTensor& x, Placement to) {
  const int n = mesh.size(), me = mesh.rank();
  const DType src = x.local.dtype, dst = x.global_dtype();
  const int64_t ses = static_cast<int64_t>(dtype_size(src));
  const int64_t des = static_cast<int64_t>(dtype_size(dst));
  const Box all = box_of(x.global_shape, Replicate(), n, me);
  const bool flat = to.is_replicate();
  auto local = contiguous_local(x, all);
  const int64_t numel = all.numel();
  // Rank p's target: an element range (flat) or a box.
  auto range_of = [&](int p) { return shard_range(numel, n, p); };
  auto box_to = [&](int p) { return box_of(x.global_shape, to, n, p); };
  const Box want = flat ? all : box_to(me);
  auto out = std::make_shared<Tensor>(fresh(dst, box_shape(want)));
  const int64_t mine = flat ? range_of(me).length : want.numel();
  // parts[p]: rank p's partial values of my target, contiguous, in src dtype.
  std::vector<const void*> parts(n);
  std::vector<std::shared_ptr<Tensor>> bufs(n);
  {
    Exchange ex(mesh, op, "reduce-scatter");
    ex.keep_alive(out);
    ex.keep_alive(local);
    for (int p = 0; p < n; ++p) {
      if (flat) {
        if (p == me) {
          parts[p] = local->ptr<char>() + range_of(me).offset * ses;
          continue;
        }
        bufs[p] = std::make_shared<Tensor>(fresh(src, {mine}));
      } else {
        bufs[p] = std::make_shared<Tensor>(fresh(src, box_shape(want)));
        if (p == me) {
          copy_box(local->view(), all, bufs[p]->view(), want, want);
          parts[p] = bufs[p]->data();
          continue;
        }
      }
      parts[p] = bufs[p]->data();
      ex.keep_alive(bufs[p]);
      if (mine > 0) recv_bytes(ex, bufs[p]->data(), mine * ses, p);
    }
    for (int q = 0; q < n; ++q) {
      if (q == me) continue;
      if (flat) {
        const ShardRange r = range_of(q);
        if (r.length > 0) send_bytes(ex, local->ptr<char>() + r.offset * ses, r.length * ses, q);
      } else {
        const Box region = box_to(q);
        if (region.numel() == 0) continue;
        auto pack = std::make_shared<Tensor>(fresh(src, box_shape(region)));
        copy_box(local->view(), all, pack->view(), region, region);
        ex.keep_alive(pack);
        send_bytes(ex, pack->data(), region.numel() * ses, q);
      }
    }
    ex.wait();
  }
  char* dst_ptr = out->ptr<char>() + (flat ? range_of(me).offset * des : 0);
  sum_parts(parts, src, mine, dst_ptr, dst);
  if (flat && n > 1) {
    Exchange ex(mesh, op, "all-gather");
    ex.keep_alive(out);
    for (int p = 0; p < n; ++p) {
      const ShardRange r = range_of(p);
      if (p == me || r.length == 0) continue;
      recv_bytes(ex, out->ptr<char>() + r.offset * des, r.length * des, p);
    }
    if (mine > 0)
      for (int q = 0; q < n; ++q)
        if (q != me) send_bytes(ex, dst_ptr, mine * des, q);
    ex.wait();
  }
  return DTensor::from_local(*out, to, x.global_shape);
}

}  // namespace

void agree_sharded(const Communicator& mesh, const char* op, int32_t call, const ArgSummary& mine,
                   const Error* local) {
  const int n = mesh.size(), me = mesh.rank();
  MOE_EP_CHECK(mine.size() <= static_cast<std::size_t>(ShardHeader::kMaxFields));
  auto sent = std::make_shared<ShardHeader>();
  sent->call = call;
  sent->nfields = static_cast<int32_t>(mine.size());
  for (std::size_t i = 0; i < mine.size(); ++i) sent->fields[i] = mine.value(i);
  if (local) {
    sent->ok = 0;
    sent->kind = static_cast<int32_t>(local->kind());
    std::strncpy(sent->message, local->what(), sizeof(sent->message) - 1);
  }
  auto headers = std::make_shared<std::vector<ShardHeader>>(n);
  (*headers)[me] = *sent;
  if (n > 1) {
    Exchange ex(mesh, op, "header");
    ex.keep_alive(headers);
    ex.keep_alive(sent);
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      ex.irecv(&(*headers)[p], sizeof(ShardHeader), p, kTagShardHeader);
      ex.isend(sent.get(), sizeof(ShardHeader), p, kTagShardHeader);
    }
    ex.wait();
  }
  const std::vector<ShardHeader>& h = *headers;
  if (local) throw *local;
  for (int p = 0; p < n; ++p) {
    if (h[p].magic != sent->magic)
      invalid(op, ": rank ", p, " sent a malformed header (is another collective running on ",
              "the same communicator?)");
    if (h[p].call != call)
      invalid(op, ": the ranks called different collectives: rank ", me, " called ",
              call_name(call), ", rank ", p, " called ", call_name(h[p].call),
              " (collectives must be called in the same order on every rank)");
  }
  for (int p = 0; p < n; ++p)
    if (!h[p].ok) {
      const std::string msg(h[p].message, strnlen(h[p].message, sizeof(h[p].message)));
      fail(ErrorKind::kRemote, op, ": rank ", p, " failed: ", msg);
    }
  for (int p = 0; p < n; ++p)
    if (h[p].nfields != sent->nfields)
      invalid(op, ": rank ", p, " passed ", h[p].nfields, " argument fields, rank ", me, " ",
              sent->nfields);
  for (std::size_t i = 0; i < mine.size(); ++i)
    for (int p = 1; p < n; ++p)
      if (h[p].fields[i] != h[0].fields[i])
        invalid(op, ": ", mine.name(i), " differs across ranks: rank 0 has ",
                mine.format(i, h[0].fields[i]), ", rank ", p, " has ",
                mine.format(i, h[p].fields[i]), " (every rank must pass the same value)");
}

DTensor redistribute_agreed(const Communicator& mesh, const char* op, const char* name,
                            const DTensor& x, Placement to) {
  const int n = mesh.size(), me = mesh.rank();
  const Placement from = x.placement;
  if (to.is_partial()) {
    if (from.is_partial()) return x;
    unsupported(op, ": ", name, " ", from.to_string(), " -> Partial(sum) is not supported");
  }
  if (to.is_shard()) {
    const int ndim = static_cast<int>(x.global_shape.size());
    if (to.dim < 0 || to.dim >= ndim)
      invalid(op, ": ", name, " target placement ", to.to_string(), " is outside dims [0, ", ndim,
              ") of the ", ndim, "-D tensor (global_shape ", shape_str(x.global_shape), ")");
  }
  if (from == to && !from.is_partial()) return x;
  if (from.is_partial()) {
    if (n == 1 && to.is_replicate() && x.local.dtype == x.global_dtype()) {
      DTensor r = x;
      r.placement = to;
      return r;
    }
    return reduce(mesh, op, x, to);
  }
  if (from.is_replicate() || n == 1) {
    // A local slice: a view into x.local (on one rank every placement holds everything).
    const Box have = box_of(x.global_shape, from, n, me);
    const Box want = box_of(x.global_shape, to, n, me);
    DTensor r = x;
    r.placement = to;
    TensorView v = x.local;
    int64_t off = 0;
    for (int d = 0; d < v.ndim; ++d) {
      off += (want.lo[d] - have.lo[d]) * v.strides[d];
      v.shape[d] = want.len[d];
    }
    if (want.numel() > 0)
      v.data = static_cast<char*>(v.data) + off * static_cast<int64_t>(dtype_size(v.dtype));
    r.local = v;
    return r;
  }
  return move_boxes(mesh, op, x, to);
}

}  // namespace detail

DTensor redistribute(const Communicator& mesh, const DTensor& x, Placement to, const char* name) {
  const char* op = "redistribute";
  detail::ArgSummary sum;
  sum.add_tensor(name, &x);
  sum.add("target placement", static_cast<int64_t>(to.kind) * 256 + to.dim,
          detail::ArgSummary::Kind::kPlacement);
  std::optional<Error> local;
  try {
    detail::check_dtensor(op, name, x, mesh.size(), mesh.rank());
    if (to.is_shard() && (to.dim < 0 || to.dim >= static_cast<int>(x.global_shape.size())))
      detail::invalid(op, ": ", name, " target placement ", to.to_string(), " is outside dims [0, ",
                      x.global_shape.size(), ") of the ", x.global_shape.size(), "-D tensor");
    if (to.is_partial() && !x.placement.is_partial())
      detail::unsupported(op, ": ", name, " ", x.placement.to_string(),
                          " -> Partial(sum) is not supported");
  } catch (const Error& e) {
    local = e;
  }
  detail::agree_sharded(mesh, op, detail::kCallRedistribute, sum, local ? &*local : nullptr);
  return detail::redistribute_agreed(mesh, op, name, x, to);
}

Tensor full_tensor(const Communicator& mesh, const DTensor& x, const char* name) {
  DTensor r = redistribute(mesh, x, Replicate(), name);
  if (detail::owner_is_local(r)) return r.owner;
  return detail::contiguous_copy(r.local);
}

}  // namespace moe_ep
