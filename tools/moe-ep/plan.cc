#include "plan.h"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "common.h"
#include "moe_ep/error.h"
#include "moe_ep/tensor.h"
#include "numeric.h"
#include "presets.h"
#include "routing.h"

namespace moe_ep_tool {

namespace {

// Bytes per call that each rank sends to ranks of other nodes, per algorithm and op.
struct Traffic {
  std::vector<double> fullmesh_dispatch, hierarchy_dispatch, fullmesh_combine, hierarchy_combine;
  std::vector<double> received_rows;  // dispatch's valid rows per rank
};

struct Model {
  int64_t W, G, T, H, E, K, L;
  double row, quant_row, back_row, partial_row;  // bytes on the wire
};

// One rank's tokens: what it sends to each remote rank (fullmesh) and node (hierarchy).
void count_rank(const Model& m, int64_t r, const int32_t* ids, Traffic& t) {
  std::vector<int64_t> copies(m.W, 0), tokens(m.W, 0), node_copies(m.W / m.G, 0),
      node_tokens(m.W / m.G, 0);
  std::vector<int64_t> seen(m.W, -1), seen_node(m.W / m.G, -1);
  for (int64_t i = 0; i < m.T; ++i)
    for (int64_t k = 0; k < m.K; ++k) {
      const int64_t d = ids[i * m.K + k] / m.L, n = d / m.G;
      t.received_rows[d] += 1;
      if (n == r / m.G) continue;
      ++copies[d];
      ++node_copies[n];
      if (seen[d] != i) seen[d] = i, ++tokens[d];
      if (seen_node[n] != i) seen_node[n] = i, ++node_tokens[n];
    }
  for (int64_t d = 0; d < m.W; ++d) {
    if (copies[d] == 0) continue;
    // Over MPI a token goes to a rank once when that sends at most 3/4 of its copies.
    const int64_t rows = 4 * tokens[d] <= 3 * copies[d] ? tokens[d] : copies[d];
    t.fullmesh_dispatch[r] += rows * m.quant_row + copies[d] * 16.0;
    t.fullmesh_combine[d] += copies[d] * (m.back_row + 12.0);  // the owner sends them back
  }
  for (int64_t n = 0; n < m.W / m.G; ++n) {
    if (node_copies[n] == 0) continue;
    t.hierarchy_dispatch[r] += node_tokens[n] * m.quant_row + node_copies[n] * 28.0;
    t.hierarchy_combine[r] += node_copies[n] * 16.0;  // the weights, to the relay
    t.hierarchy_combine[n * m.G + r % m.G] +=         // the relay's partials and their tokens
        node_tokens[n] * (m.partial_row + 4.0) + 20.0;
  }
}

// "mean / max" of v in MB.
std::string mean_max(const std::vector<double>& v) {
  double sum = 0, top = 0;
  for (const double x : v) sum += x, top = std::max(top, x);
  return fmt("%.3f", sum / static_cast<double>(v.size()) / 1e6) + " / " + fmt("%.3f", top / 1e6);
}

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (const double x : v) sum += x;
  return v.empty() ? 0 : sum / static_cast<double>(v.size());
}

// The busiest node's bytes over its link, ms.
double link_ms(const Model& m, const std::vector<double>& v, double gbit) {
  double top = 0;
  for (int64_t n = 0; n < m.W / m.G; ++n) {
    double node = 0;
    for (int64_t r = n * m.G; r < (n + 1) * m.G; ++r) node += v[r];
    top = std::max(top, node);
  }
  return top * 8 / (gbit * 1e9) * 1e3;
}

}  // namespace

int plan_command(const PlanOptions& o) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const Preset layer = layer_of("moe-ep plan", o.preset,
                                {o.hidden, o.experts, o.top_k, {}, 0, o.n_group, o.topk_group});
  const int64_t W = o.ranks, G = o.ranks_per_node, E = layer.experts;
  if (W % G != 0)
    throw moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument,
                        "moe-ep plan: --ranks " + std::to_string(W) +
                            " is not a multiple of --ranks-per-node " + std::to_string(G));
  if (E % W != 0)
    throw moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument,
                        "moe-ep plan: " + std::to_string(E) + " experts do not divide over " +
                            std::to_string(W) + " ranks (SPEC §1.2: E % W == 0); use --experts");
  const moe_ep::DType dtype = parse_float_dtype(o.dtype);
  if (const std::string why = partials_misfit(o.partials, o.dtype); !why.empty())
    throw moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument, "moe-ep plan: " + why);
  Model m{W, G, o.tokens, layer.hidden, E, layer.top_k, E / W, 0, 0, 0, 0};
  m.row = static_cast<double>(m.H * static_cast<int64_t>(moe_ep::dtype_size(dtype)));
  m.quant_row = o.quant == "int8" ? static_cast<double>(m.H) : m.row;  // scale: in the metadata
  m.back_row = o.comm_quant == "int8" ? static_cast<double>(m.H + 4) : m.row;
  m.partial_row = o.comm_quant == "int8" ? static_cast<double>(m.H + 4)
                  : o.partials == "fp32" ? 4.0 * m.H
                                         : m.row;

  std::vector<double> p;
  std::string routing = "uniform";
  if (o.routing == "real") {
    const std::string file = o.routing_file.empty() ? default_routing_file() : o.routing_file;
    ExpertDistribution d = load_real_distribution(
        {file, o.routing_model.empty() ? layer.routing_model : o.routing_model, o.domain, o.layer},
        E, m.K);
    p = std::move(d.p);
    routing = d.description;
  }
  const Router router(layer, o.routing == "real" ? RoutingKind::kReal : RoutingKind::kUniform,
                      o.seed, p);
  Traffic t;
  for (auto* v : {&t.fullmesh_dispatch, &t.hierarchy_dispatch, &t.fullmesh_combine,
                  &t.hierarchy_combine, &t.received_rows})
    v->assign(static_cast<std::size_t>(W), 0.0);
  std::vector<int32_t> ids(static_cast<std::size_t>(m.T * m.K));
  std::vector<float> scales(ids.size());
  for (int64_t r = 0; r < W; ++r) {  // global tokens [r T, (r + 1) T), as moe-ep run splits them
    router.route(r * m.T, m.T, nullptr, dtype, ids.data(), scales.data());
    count_rank(m, r, ids.data(), t);
  }
  if (rank != 0) return 0;
  std::printf(
      "moe-ep plan: %s (H %lld, %lld experts, top-%lld, %s), W %lld = %lld nodes x %lld "
      "ranks, %lld tokens per rank, dispatch %s, combine %s, partials %s\n",
      layer.name.c_str(), (long long)m.H, (long long)E, (long long)m.K, o.dtype.c_str(),
      (long long)W, (long long)(W / G), (long long)G, (long long)m.T, o.quant.c_str(),
      o.comm_quant.c_str(), o.comm_quant == "int8" ? "int8" : o.partials.c_str());
  print_wrapped("routing: " + routing + ", seed " + std::to_string(o.seed), 2);
  if (layer.group_limited()) {
    const int64_t S = E / layer.n_group, node = G * m.L;  // experts per group, per node
    print_wrapped(
        describe_groups(layer) + "; " +
            (S == node       ? std::string("a group is a node's experts")
             : S % node == 0 ? "a group spans " + std::to_string(S / node) + " nodes"
             : node % S == 0 ? "a node holds " + std::to_string(node / S) + " groups"
                             : "groups straddle nodes (" + std::to_string(S) +
                                   " experts per group, " + std::to_string(node) + " per node)"),
        2);
  } else if (!layer.groups_dropped.empty()) {
    print_wrapped(describe_groups(layer), 2);
  }
  std::printf("bytes each rank sends to other nodes per call, MB (mean / max over ranks):\n");
  std::printf("  %-10s %-22s %-22s %s\n", "op", "fullmesh", "hierarchy", "hierarchy/fullmesh");
  const double rd = mean(t.hierarchy_dispatch) / std::max(1.0, mean(t.fullmesh_dispatch));
  const double rc = mean(t.hierarchy_combine) / std::max(1.0, mean(t.fullmesh_combine));
  std::printf("  %-10s %-22s %-22s %.3f\n", "dispatch", mean_max(t.fullmesh_dispatch).c_str(),
              mean_max(t.hierarchy_dispatch).c_str(), rd);
  std::printf("  %-10s %-22s %-22s %.3f\n", "combine", mean_max(t.fullmesh_combine).c_str(),
              mean_max(t.hierarchy_combine).c_str(), rc);
  std::printf("time of those bytes on a %g Gbit/s link per node (the busiest node), ms:\n",
              o.link_gbit);
  std::printf(
      "  dispatch %.3f fullmesh, %.3f hierarchy; combine %.3f fullmesh, %.3f hierarchy\n",
      link_ms(m, t.fullmesh_dispatch, o.link_gbit), link_ms(m, t.hierarchy_dispatch, o.link_gbit),
      link_ms(m, t.fullmesh_combine, o.link_gbit), link_ms(m, t.hierarchy_combine, o.link_gbit));
  // SPEC §1.4: A = global_bs x min(L, K) rows; expand_x, expand_scales, assist_info (A x 128).
  const double A = static_cast<double>(W * m.T * std::min(m.L, m.K));
  const double out_row = m.quant_row + 4;
  double top = 0;
  for (const double v : t.received_rows) top = std::max(top, v);
  print_wrapped("dispatch_v2 outputs per rank, MB: " +
                    fmt("%.1f", (A * out_row + std::max(A * 128, double(m.T * m.K)) * 4) / 1e6) +
                    " sized for SPEC §1.4's worst case (A = W x BS x min(L, K) = " +
                    fmt("%.0f", A) + " rows, assist_info A x 128); the rows received need " +
                    fmt("%.1f", mean(t.received_rows) * (out_row + 12) / 1e6) + " (mean), " +
                    fmt("%.1f", top * (out_row + 12) / 1e6) + " (max)",
                2);
  print_wrapped(
      "counted: rows and their per-row metadata as the library sends them (fullmesh: "
      "a token once per remote rank when that saves a quarter, 16 B per copy; back 12 "
      "B per row; hierarchy: a token once per remote node, 28 B per copy; weights 16 B "
      "per entry; a partial per (token, node)); headers and counts (under 1 KB per "
      "peer) are not",
      2);
  std::printf("inter-node byte ratio hierarchy/fullmesh: dispatch %.3f, combine %.3f\n", rd, rc);
  std::fflush(stdout);
  return 0;
}

}  // namespace moe_ep_tool
