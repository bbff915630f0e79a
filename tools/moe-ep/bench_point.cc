#include "bench_point.h"

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <optional>

#include "checks.h"
#include "common.h"
#include "moe_ep/error.h"
#include "numeric.h"

namespace moe_ep_tool::bench {

using moe_ep::DType;
using moe_ep::Error;
using moe_ep::ErrorKind;
using moe_ep::TensorView;

namespace {

// K <= E, E over W ranks, one row and the routing entries within MPI's int counts.
void check_bench_sizes(const BenchOptions& o, const Setup& s) {
  const int64_t E = s.layer.experts, K = s.layer.top_k, H = s.layer.hidden, W = s.W;
  if (K > E) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep bench: --top-k " + std::to_string(K) +
                    " exceeds the number of experts E = " + std::to_string(E));
  }
  if (E % W != 0) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep bench: E = " + std::to_string(E) + " experts cannot be split evenly over " +
                    std::to_string(W) +
                    " ranks (SPEC §1.3: moe_expert_num % ep_world_size == 0); run on a number of "
                    "ranks that divides E, or set --experts");
  }
  const double es = static_cast<double>(moe_ep::dtype_size(s.dtype));
  const double row = static_cast<double>(H) * es;
  if (row > INT_MAX) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep bench: one row is H " + std::to_string(H) + " x " + fmt("%.0f", es) +
                    " B = " + fmt("%.0f", row) +
                    " bytes, more than one MPI message element holds (2^31 - 1); use a smaller "
                    "--hidden");
  }
  const int64_t max_bs = *std::max_element(o.tokens.begin(), o.tokens.end());
  const double entries = static_cast<double>(max_bs) * static_cast<double>(K);
  if (entries * static_cast<double>(W) > INT_MAX) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep bench: --tokens " + std::to_string(max_bs) + " x K " + std::to_string(K) +
                    " x W " + std::to_string(W) +
                    " routing entries exceed 2^31 - 1 (MPI counts); use fewer --tokens");
  }
}

// Per rank: its tokens, dispatch's A = W x BS x min(L, K) rows twice
// (expand_x and the expert outputs) plus the int8 copy, and about eight (BS x K)-row buffers
// (permute, the baselines' send/receive buffers, the combine buffers). Per expert: dispatch_v2's
// counts and offsets and the router's tables (checks.h).
void check_bench_memory(const BenchOptions& o, const Setup& s, int node_ranks) {
  const int64_t E = s.layer.experts, K = s.layer.top_k, H = s.layer.hidden, W = s.W;
  const double row = static_cast<double>(H) * static_cast<double>(moe_ep::dtype_size(s.dtype));
  const int64_t max_bs = *std::max_element(o.tokens.begin(), o.tokens.end());
  const double entries = static_cast<double>(max_bs) * static_cast<double>(K);
  const double A = static_cast<double>(W * max_bs) * static_cast<double>(std::min(s.L, K));
  const double rows_need =
      row * (static_cast<double>(max_bs) + 2.5 * A + 8 * entries) + 4 * A * 128;
  const double experts_need =
      (kDispatchBytesPerExpert + kRouterBytesPerExpert) * static_cast<double>(E);
  const double need = rows_need + experts_need;
  const double physical = static_cast<double>(physical_memory_bytes());
  if (physical > 0 && need * node_ranks > physical) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep bench: --tokens " + std::to_string(max_bs) + " with H " +
                    std::to_string(H) + " and E " + std::to_string(E) + " needs about " +
                    fmt("%.1f", need / 0x1p30) + " GiB per rank x " + std::to_string(node_ranks) +
                    " ranks on this machine (more than its " + fmt("%.1f", physical / 0x1p30) +
                    " GiB; mostly " + (experts_need > rows_need ? "per-expert tables" : "rows") +
                    "); use " +
                    (experts_need > rows_need ? "fewer --experts"
                                              : "fewer --tokens or a smaller --hidden"));
  }
}

void plan_routing_source(const BenchOptions& o, Setup& s) {
  if (s.kind == RoutingKind::kReal) {
    const std::string file = o.routing_file.empty() ? default_routing_file() : o.routing_file;
    RealRoutingSource src{file, o.routing_model.empty() ? s.layer.routing_model : o.routing_model,
                          o.domain, o.layer};
    ExpertDistribution d = load_real_distribution(src, s.layer.experts, s.layer.top_k);
    s.real_p = std::move(d.p);
    s.routing_desc = d.description + " from " + file;
  } else if (s.kind == RoutingKind::kGate) {
    s.routing_desc = "gate (router matrix Wr [H, E] from the seed, logits = x @ Wr, top-k)";
  } else {
    s.routing_desc = "uniform (K distinct experts, each equally likely)";
  }
  if (const std::string groups = describe_groups(s.layer); !groups.empty())
    s.routing_desc += "; " + groups;
}

}  // namespace

Setup plan_bench(const BenchOptions& o, int64_t W, int64_t rank, int node_ranks) {
  Setup s;
  // H: 7168 with the default preset (the target's); shared experts are not benchmarked.
  const std::optional<int64_t> hidden = o.hidden         ? o.hidden
                                        : o.preset_given ? std::nullopt
                                                         : std::optional<int64_t>(kTargetHidden);
  s.layer = layer_of("moe-ep bench", o.preset,
                     {hidden, o.experts, o.top_k, std::nullopt, 0, o.n_group, o.topk_group});
  s.dtype = parse_float_dtype(o.dtype);
  s.kind = o.routing == "gate"      ? RoutingKind::kGate
           : o.routing == "uniform" ? RoutingKind::kUniform
                                    : RoutingKind::kReal;
  s.W = W;
  s.rank = rank;
  check_bench_sizes(o, s);
  s.L = s.layer.experts / W;
  check_bench_memory(o, s, node_ranks);
  plan_routing_source(o, s);
  if (rank == 0) {
    if (!o.csv.empty()) check_writable("--csv", o.csv, "moe-ep bench");
    if (!o.json.empty()) check_writable("--json", o.json, "moe-ep bench");
    if (!o.plot.empty()) check_writable("--plot", o.plot, "moe-ep bench");
  }
  return s;
}

std::string transport_name(const std::string& flag) {
  if (!flag.empty()) return flag;
  const char* env = std::getenv("MOE_EP_TRANSPORT");
  return env != nullptr && *env != '\0' ? std::string(env) + " ($MOE_EP_TRANSPORT)" : "shm";
}

std::string other_comm_alg(const std::string& comm_alg) {
  return comm_alg == "hierarchy" ? "fullmesh" : "hierarchy";
}

moe_ep::EpConfig make_ep_config(const BenchOptions& options, moe_ep::Communicator& comm,
                                int64_t experts, const std::string& comm_alg) {
  moe_ep::EpConfig cfg;
  cfg.group_ep = &comm;
  cfg.ep_world_size = comm.size();
  cfg.ep_rank_id = comm.rank();
  cfg.moe_expert_num = experts;
  cfg.shared_expert_num = 0;
  cfg.transport = options.transport;
  cfg.comm_alg = comm_alg;
  cfg.partials = options.partials;
  cfg.exact_size = options.exact_size;
  return cfg;
}

TensorView Point::x_view() const {
  return TensorView::contiguous(const_cast<std::byte*>(x()), dtype, {BS, H});
}

TensorView Point::ids_view() const {
  return TensorView::contiguous(const_cast<int32_t*>(ids()), DType::kI32, {BS, K});
}

TensorView Point::scales_view() const {
  return TensorView::contiguous(const_cast<float*>(scales.data()), DType::kF32, {BS, K});
}

void Point::token_row(int64_t g, std::byte* row) const {
  const std::vector<std::byte> r = make_tokens(seed, g, 1, H, dtype);
  std::copy(r.begin(), r.end(), row);
}

moe_ep::DispatchInputs Point::dispatch_inputs() const {
  moe_ep::DispatchInputs din;
  din.x = x_view();
  din.expert_ids = ids_view();
  din.expert_scales = scales_view();
  return din;
}

Point make_point(const BenchOptions& o, const Setup& s, int64_t BS, Watchdog& dog) {
  Point p;
  p.BS = BS;
  p.H = s.layer.hidden;
  p.K = s.layer.top_k;
  p.E = s.layer.experts;
  p.L = s.L;
  p.W = s.W;
  p.rank = s.rank;
  p.dtype = s.dtype;
  p.row_bytes = p.H * static_cast<int64_t>(moe_ep::dtype_size(p.dtype));
  const int64_t W = p.W, K = p.K, L = p.L;
  p.seed = o.seed;
  p.x_local = make_tokens(o.seed, s.rank * BS, BS, p.H, p.dtype);
  std::vector<int32_t> ids(static_cast<size_t>(BS * K));
  p.scales.resize(static_cast<size_t>(BS * K));
  const Router router(s.layer, s.kind, o.seed, s.real_p);
  router.route(s.rank * BS, BS, p.x(), p.dtype, ids.data(), p.scales.data());
  p.ids_all.resize(static_cast<size_t>(W * BS * K));
  guarded(dog, "the routing all-gather", [&] {
    MPI_Allgather(ids.data(), static_cast<int>(BS * K), MPI_INT32_T, p.ids_all.data(),
                  static_cast<int>(BS * K), MPI_INT32_T, MPI_COMM_WORLD);
  });
  std::vector<int32_t> per_expert(static_cast<size_t>(p.E), 0);
  for (const int32_t e : ids) ++per_expert[e];
  p.recv_block.assign(static_cast<size_t>(W * L), 0);
  guarded(dog, "the count all-to-all", [&] {
    MPI_Alltoall(per_expert.data(), static_cast<int>(L), MPI_INT32_T, p.recv_block.data(),
                 static_cast<int>(L), MPI_INT32_T, MPI_COMM_WORLD);
  });
  p.send_rows.assign(W, 0);
  p.recv_rows.assign(W, 0);
  p.send_displ.assign(W, 0);
  p.recv_displ.assign(W, 0);
  for (int64_t d = 0; d < W; ++d) {
    for (int64_t l = 0; l < L; ++l) {
      p.send_rows[d] += per_expert[d * L + l];
      p.recv_rows[d] += p.recv_block[d * L + l];
    }
    if (d > 0) {
      p.send_displ[d] = p.send_displ[d - 1] + p.send_rows[d - 1];
      p.recv_displ[d] = p.recv_displ[d - 1] + p.recv_rows[d - 1];
    }
    if (d != p.rank) {
      p.other_send += p.send_rows[d];
      p.other_recv += p.recv_rows[d];
    }
    p.valid += p.recv_rows[d];
  }
  // Counting sort of the entries by expert (stable: increasing i K + k inside an expert).
  std::vector<int64_t> start(static_cast<size_t>(p.E) + 1, 0);
  for (int64_t e = 0; e < p.E; ++e) start[e + 1] = start[e] + per_expert[e];
  p.order.resize(static_cast<size_t>(BS * K));
  for (int64_t j = 0; j < BS * K; ++j) p.order[start[ids[j]]++] = j;
  return p;
}

}  // namespace moe_ep_tool::bench
