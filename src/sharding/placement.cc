// Placements, shard ranges, DTensor checks and boxes.
#include <algorithm>
#include <cstring>
#include <sstream>

#include "base/check.h"
#include "sharding/internal.h"

namespace moe_ep {

using detail::cat;
using detail::invalid;

std::string Placement::to_string() const {
  switch (kind) {
    case Kind::kReplicate:
      return "Replicate";
    case Kind::kShard:
      return cat("Shard(", dim, ")");
    case Kind::kPartial:
      return "Partial(sum)";
  }
  return "?";
}

ShardRange shard_range(int64_t size, int mesh_size, int rank) {
  if (size < 0) invalid("shard_range: size = ", size, " is negative");
  if (mesh_size < 1) invalid("shard_range: mesh_size = ", mesh_size, " must be >= 1");
  if (rank < 0 || rank >= mesh_size)
    invalid("shard_range: rank = ", rank, " is outside [0, ", mesh_size, ")");
  // PyTorch DTensor's Shard (torch.chunk; Shard.local_shard_size_and_offset): every rank gets
  // chunk = ceil(size / n) elements until the data runs out, so the last non-empty piece is short
  // and trailing ranks may be empty; offsets are rank * chunk clamped to size. Written so that no
  // intermediate overflows for any size (chunk * rank <= size - 1 where it is evaluated).
  const int64_t chunk = size / mesh_size + (size % mesh_size != 0 ? 1 : 0);
  if (chunk == 0 || rank > (size - 1) / chunk) return {size, 0};
  const int64_t off = chunk * rank;
  return {off, std::min(chunk, size - off)};
}

std::vector<int64_t> local_shape(const std::vector<int64_t>& global_shape, Placement placement,
                                 int mesh_size, int rank) {
  const int ndim = static_cast<int>(global_shape.size());
  for (int d = 0; d < ndim; ++d)
    if (global_shape[d] < 0)
      invalid("local_shape: global_shape[", d, "] = ", global_shape[d], " is negative");
  std::vector<int64_t> out = global_shape;
  if (placement.is_shard()) {
    if (placement.dim < 0 || placement.dim >= ndim)
      invalid("local_shape: placement ", placement.to_string(), " is outside dims [0, ", ndim,
              ") of the ", ndim, "-D tensor");
    out[placement.dim] = shard_range(global_shape[placement.dim], mesh_size, rank).length;
  }
  return out;
}

DTensor DTensor::from_local(const TensorView& local, Placement placement,
                            std::vector<int64_t> global_shape) {
  DTensor t;
  t.local = local;
  t.placement = placement;
  t.global_shape = std::move(global_shape);
  return t;
}

DTensor DTensor::from_local(const Tensor& local, Placement placement,
                            std::vector<int64_t> global_shape) {
  DTensor t = from_local(local.view(), placement, std::move(global_shape));
  t.owner = local;
  return t;
}

namespace {

// A view of the part `region` of `v`, which holds `box`.
TensorView sub_view(const TensorView& v, const detail::Box& box, const detail::Box& region) {
  TensorView out = v;
  int64_t off = 0;
  for (int d = 0; d < v.ndim; ++d) {
    off += (region.lo[d] - box.lo[d]) * v.strides[d];
    out.shape[d] = region.len[d];
  }
  if (region.numel() > 0 && v.data != nullptr)
    out.data = static_cast<char*>(v.data) + off * static_cast<int64_t>(dtype_size(v.dtype));
  return out;
}

}  // namespace

DTensor distribute(const TensorView& full, Placement placement, int mesh_size, int rank) {
  const char* op = "distribute";
  if (full.ndim < 1 || full.ndim > kMaxDims)
    invalid(op, ": full.ndim = ", full.ndim, " is outside [1, ", kMaxDims, "]");
  if (placement.is_partial())
    detail::unsupported(op, ": placement Partial(sum) cannot be made from a full tensor");
  std::vector<int64_t> shape(full.shape.begin(), full.shape.begin() + full.ndim);
  if (placement.is_shard() && (placement.dim < 0 || placement.dim >= full.ndim))
    invalid(op, ": placement ", placement.to_string(), " is outside dims [0, ", full.ndim,
            ") of the ", full.ndim, "-D tensor full");
  const detail::Box all = detail::box_of(shape, Replicate(), mesh_size, rank);
  const detail::Box mine = detail::box_of(shape, placement, mesh_size, rank);
  return DTensor::from_local(sub_view(full, all, mine), placement, shape);
}

namespace detail {

int64_t Box::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= len[d];
  return n;
}

Box box_of(const std::vector<int64_t>& global_shape, Placement p, int mesh_size, int rank) {
  Box b;
  b.ndim = static_cast<int>(global_shape.size());
  MOE_EP_CHECK(b.ndim <= kMaxDims);
  for (int d = 0; d < b.ndim; ++d) b.len[d] = global_shape[d];
  if (p.is_shard()) {
    MOE_EP_CHECK(p.dim >= 0 && p.dim < b.ndim);
    const ShardRange r = shard_range(global_shape[p.dim], mesh_size, rank);
    b.lo[p.dim] = r.offset;
    b.len[p.dim] = r.length;
  }
  return b;
}

Box intersect(const Box& a, const Box& b) {
  MOE_EP_CHECK(a.ndim == b.ndim);
  Box r;
  r.ndim = a.ndim;
  for (int d = 0; d < a.ndim; ++d) {
    const int64_t lo = std::max(a.lo[d], b.lo[d]);
    const int64_t hi = std::min(a.lo[d] + a.len[d], b.lo[d] + b.len[d]);
    r.lo[d] = lo;
    r.len[d] = std::max<int64_t>(0, hi - lo);
  }
  return r;
}

void copy_box(const TensorView& src, const Box& src_box, const TensorView& dst, const Box& dst_box,
              const Box& region) {
  MOE_EP_CHECK(src.dtype == dst.dtype && src.ndim == region.ndim && dst.ndim == region.ndim);
  if (region.numel() == 0) return;
  const int64_t es = static_cast<int64_t>(dtype_size(src.dtype));
  // Normalise to 4 dims (leading dims of size 1).
  std::array<int64_t, kMaxDims> len{}, ss{}, ds{};
  int64_t soff = 0, doff = 0;
  const int pad = kMaxDims - region.ndim;
  for (int d = 0; d < kMaxDims; ++d) {
    len[d] = 1;
    ss[d] = ds[d] = 0;
  }
  for (int d = 0; d < region.ndim; ++d) {
    len[pad + d] = region.len[d];
    ss[pad + d] = src.strides[d];
    ds[pad + d] = dst.strides[d];
    soff += (region.lo[d] - src_box.lo[d]) * src.strides[d];
    doff += (region.lo[d] - dst_box.lo[d]) * dst.strides[d];
  }
  const auto* s0 = static_cast<const char*>(src.data) + soff * es;
  auto* d0 = static_cast<char*>(dst.data) + doff * es;
  const bool runs = (ss[3] == 1 || len[3] == 1) && (ds[3] == 1 || len[3] == 1);
  for (int64_t i = 0; i < len[0]; ++i)
    for (int64_t j = 0; j < len[1]; ++j)
      for (int64_t k = 0; k < len[2]; ++k) {
        const char* s = s0 + (i * ss[0] + j * ss[1] + k * ss[2]) * es;
        char* d = d0 + (i * ds[0] + j * ds[1] + k * ds[2]) * es;
        if (runs) {
          std::memcpy(d, s, static_cast<std::size_t>(len[3] * es));
        } else {
          for (int64_t l = 0; l < len[3]; ++l)
            std::memcpy(d + l * ds[3] * es, s + l * ss[3] * es, static_cast<std::size_t>(es));
        }
      }
}

bool owner_is_local(const DTensor& x) {
  const TensorView& o = x.owner.view();
  if (!x.owner.defined() || o.data != x.local.data || o.dtype != x.local.dtype ||
      o.ndim != x.local.ndim || !x.local.is_contiguous())
    return false;
  for (int d = 0; d < o.ndim; ++d)
    if (o.shape[d] != x.local.shape[d]) return false;
  return true;
}

Tensor contiguous_copy(const TensorView& v) {
  const std::vector<int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
  Tensor t = Tensor::empty(v.dtype, shape);
  const Box all = box_of(shape, Replicate(), 1, 0);
  copy_box(v, all, t.view(), all, all);
  return t;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

void check_dtensor(const char* op, const char* name, const DTensor& x, int mesh_size, int rank) {
  const int ndim = static_cast<int>(x.global_shape.size());
  if (ndim < 1 || ndim > kMaxDims)
    invalid(op, ": ", name, " global_shape ", shape_str(x.global_shape), " has ", ndim,
            " dims, outside [1, ", kMaxDims, "]");
  for (int d = 0; d < ndim; ++d)
    if (x.global_shape[d] < 0)
      invalid(op, ": ", name, " global_shape[", d, "] = ", x.global_shape[d], " is negative");
  const Placement p = x.placement;
  if (p.is_shard() && (p.dim < 0 || p.dim >= ndim))
    invalid(op, ": ", name, " placement ", p.to_string(), " is outside dims [0, ", ndim,
            ") of the ", ndim, "-D tensor (global_shape ", shape_str(x.global_shape), ")");
  if (x.local.ndim != ndim)
    invalid(op, ": ", name, " local ndim = ", x.local.ndim, " must equal ", ndim,
            " (the ndim of global_shape ", shape_str(x.global_shape), ")");
  const std::vector<int64_t> want = local_shape(x.global_shape, p, mesh_size, rank);
  const std::vector<int64_t> got(x.local.shape.begin(), x.local.shape.begin() + ndim);
  if (got != want)
    invalid(op, ": ", name, " local shape ", shape_str(got), " is inconsistent with global shape ",
            shape_str(x.global_shape), " placed ", p.to_string(), " on rank ", rank, " of ",
            mesh_size, " (expected ", shape_str(want), ")");
  for (int d = 0; d < ndim; ++d)
    if (x.local.strides[d] < 0)
      detail::unsupported(op, ": ", name, " local stride(", d, ") = ", x.local.strides[d],
                          " is negative");
  if (x.local.data == nullptr && x.local.numel() > 0)
    invalid(op, ": ", name, " local piece has ", x.local.numel(), " elements but data is null");
  const DType g = x.global_dtype();
  const bool is_float = g == DType::kBF16 || g == DType::kF16 || g == DType::kF32;
  if (p.is_partial() && !is_float)
    invalid(op, ": ", name, " placement Partial(sum) needs a float dtype, not ", dtype_name(g));
  if (x.local.dtype != g && !(p.is_partial() && x.local.dtype == DType::kF32))
    invalid(op, ": ", name, " local dtype ", dtype_name(x.local.dtype), " must equal its dtype ",
            dtype_name(g), " (only a float Partial may hold fp32 pieces)");
}

void ArgSummary::add(const std::string& name, int64_t value, Kind kind) {
  names_.push_back(name);
  values_.push_back(value);
  kinds_.push_back(kind);
}

void ArgSummary::add_tensor(const std::string& name, const DTensor* x) {
  add(name + " is given", x != nullptr, Kind::kBool);
  const int ndim = x ? static_cast<int>(x->global_shape.size()) : 0;
  add(name + " placement", x ? static_cast<int64_t>(x->placement.kind) * 256 + x->placement.dim : 0,
      Kind::kPlacement);
  add(name + " ndim (global_shape)", ndim);
  for (int d = 0; d < kMaxDims; ++d)
    add(cat(name, " global_shape[", d, "]"), x && d < ndim ? x->global_shape[d] : 0);
  add(name + " dtype", x ? static_cast<int64_t>(x->global_dtype()) : 0, Kind::kDType);
  add(name + " local dtype", x ? static_cast<int64_t>(x->local.dtype) : 0, Kind::kDType);
}

std::string ArgSummary::format(std::size_t i, int64_t v) const {
  switch (kinds_[i]) {
    case Kind::kBool:
      return v ? "true" : "false";
    case Kind::kDType:
      return v >= 0 && v <= static_cast<int64_t>(DType::kBool) ? dtype_name(static_cast<DType>(v))
                                                               : cat("dtype code ", v);
    case Kind::kPlacement: {
      Placement p;
      p.kind = static_cast<Placement::Kind>(v / 256);
      p.dim = static_cast<int>(v % 256);
      return p.to_string();
    }
    case Kind::kInt:
      break;
  }
  return cat(v);
}

}  // namespace detail
}  // namespace moe_ep
