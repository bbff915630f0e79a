#include "run.h"

#include <cblas.h>
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "checks.h"
#include "collective.h"
#include "common.h"
#include "moe_ep/comm.h"
#include "moe_ep/error.h"
#include "nodes.h"
#include "progress.h"
#include "reference.h"
#include "run_layer.h"
#include "run_plan.h"
#include "run_report.h"

namespace moe_ep_tool {

using moe_ep::Error;

namespace {

// A communicator split from MPI_COMM_WORLD.
MPI_Comm split_world(int color, int key) {
  MPI_Comm c;
  MPI_Comm_split(MPI_COMM_WORLD, color, key, &c);
  return c;
}

// The EP and TP groups. As in Ascend's example: EP group i = {x T + i}, TP group i = {T i + x}.
Groups make_groups(const RunOptions& o, int rank) {
  const int T = static_cast<int>(o.tp);
  Groups g;
  if (T == 1) {
    g.ep = moe_ep::Communicator::from_mpi(MPI_COMM_WORLD, {o.timeout_s});
    return g;
  }
  MPI_Comm ep = split_world(rank % T, rank / T), tp = split_world(rank / T, rank % T);
  g.ep = moe_ep::Communicator::from_mpi(ep, {o.timeout_s});
  g.tp = moe_ep::Communicator::from_mpi(tp, {o.timeout_s});
  MPI_Comm_free(&ep);
  MPI_Comm_free(&tp);
  return g;
}

// Runs `write`; an Error it throws is thrown again with "moe-ep run: <flag>: " in front, so a
// failed write names the option that asked for it.
template <typename F>
void with_flag(const char* flag, F&& write) {
  try {
    write();
  } catch (const Error& e) {
    throw Error(e.kind(), std::string("moe-ep run: ") + flag + ": " + e.what());
  }
}

// Collective: the global batch on rank 0 (for --save-routing and the reference).
Batch gather_batch(const Plan& plan, const LocalBatch& b) {
  Batch global;
  global.tokens = plan.N;
  global.hidden = plan.layer.hidden;
  global.top_k = plan.layer.top_k;
  global.dtype = plan.dtype;
  global.x = gather_bytes(b.x.data(), b.x.size(), "the gather of x");
  global.expert_ids = gather_values(b.ids, "the gather of expert_ids");
  global.expert_scales = gather_values(b.scales, "the gather of expert_scales");
  global.tokens_per_rank = plan.bs;
  global.mask_dims = plan.mask_dims;
  if (plan.mask_dims > 0) global.x_active_mask = gather_values(b.mask, "the gather of the mask");
  global.metadata = {{"moe_expert_num", std::to_string(plan.layer.experts)},
                     {"zero_expert_num", std::to_string(plan.Z)},
                     {"copy_expert_num", std::to_string(plan.C)},
                     {"const_expert_num", std::to_string(plan.Q)},
                     {"preset", plan.layer.name},
                     {"routing", unmarked(plan.routing_desc)}};
  if (plan.mask_dims > 0) global.metadata["mask"] = plan.mask_desc;
  if (plan.batch_seed) global.metadata["seed"] = std::to_string(*plan.batch_seed);
  return global;
}

// Rank 0: the dense reference of the global batch, compared with the gathered output.
CheckResult check_output(const Plan& p, const RunOptions& o, const Batch& global,
                         const LocalBatch& b, const std::vector<std::byte>& output) {
  const int64_t E = p.layer.experts, H = p.layer.hidden;
  ExpertBank ref_bank(p.fn, p.seed, E, H, p.layer.ffn);
  LayerSpec spec;
  spec.experts = E;
  spec.zero = p.Z;
  spec.copy = p.C;
  spec.constant = p.Q;
  spec.shared = p.Ns;
  spec.alpha_1 = b.alpha_1;
  spec.alpha_2 = b.alpha_2;
  spec.const_v = b.const_v;
  spec.quant = o.quant == "int8";
  spec.comm_quant = o.comm_quant == "int8";
  spec.hierarchy = o.comm_alg == "hierarchy";
  spec.low_partials = spec.hierarchy && o.partials != "fp32";
  spec.shared_local = p.S == 0 && p.Ns > 0;
  const Reference ref = dense_reference(global, spec, p.fn, ref_bank);
  return compare_outputs(output, ref, p.dtype, p.fn);
}

// What rank 0 needs from every rank after the layer.
struct Gathered {
  std::vector<RankStats> stats;
  WarmTimes warm;
  std::vector<std::byte> output;
};

// Collective: the layer's cold call, its warm repeats, and what rank 0 needs of them.
Gathered run_layer(const RunOptions& o, const Plan& plan, const LocalBatch& batch,
                   const Groups& groups, const std::vector<int>& leaders, Progress& progress) {
  Layer layer(o, plan, batch, groups);
  PhaseTimes t;
  const moe_ep::Tensor out = layer.forward(&t, progress);
  const int n = static_cast<int>(o.warm_repeats);
  std::vector<double> warm_dispatch, warm_combine;
  if (n > 0) {
    progress.phase(std::to_string(n) + " warm repeats of dispatch_v2 + combine_v2");
    layer.repeat(n, &warm_dispatch, &warm_combine);
  }
  progress.phase("gathering the results on rank 0");
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const auto world_rank_of = [&](int64_t e) { return layer.world_rank_of(e); };
  const NodeBytes d = split_traffic(layer.dispatch_traffic(), world_rank_of, leaders, rank);
  const NodeBytes c = split_traffic(layer.combine_traffic(), world_rank_of, leaders, rank);
  const RankStats mine{batch.route_s,
                       t.dispatch_s,
                       t.experts_s,
                       t.generate_s,
                       t.combine_s,
                       static_cast<double>(layer.valid_rows()),
                       static_cast<double>(layer.sent_other_rows()),
                       static_cast<double>(layer.received_other_rows()),
                       d.inter,
                       d.intra,
                       c.inter,
                       c.intra};
  Gathered g;
  g.stats = gather_values(std::vector<RankStats>{mine}, "the gather of the statistics");
  g.warm = median_of_max(gather_values(warm_dispatch, "the gather of the warm times"),
                         gather_values(warm_combine, "the gather of the warm times"), n);
  g.output = gather_bytes(out.data(), out.nbytes(), "the gather of the output");
  return g;
}

}  // namespace

int run_command(const RunOptions& o) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const int64_t W = world;
  // One BLAS thread per rank unless asked otherwise: ranks already fill the cores.
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) openblas_set_num_threads(1);

  // $MOE_EP_* first, agreed on (one rank reports a value every rank shares), before the first
  // collective that reads them.
  const EnvironmentCheck env = check_environment_here(o.timeout_s, o.transport);
  set_wait_context("moe-ep run", env.timeout_s);
  agree_on_error(env.error, "checking the environment");
  // The groups first, collectively, so that their deadline also bounds the tool's own waits.
  const Groups groups = make_groups(o, rank);
  set_wait_context("moe-ep run", groups.ep->timeout_s());

  Progress progress(Progress::parse(o.progress), rank == 0, "moe-ep run");
  progress.phase("planning the run");
  const std::vector<int> node_ranks = ranks_on_this_machine(rank);
  Plan plan = agreed("before the run", [&] { return plan_run(o, rank, W, node_ranks); });
  if (rank == 0) print_header(o, plan, W);

  progress.phase(plan.loaded() ? "taking each rank's rows of the file"
                               : "generating the tokens and the routing");
  const LocalBatch batch = make_local_batch(o, plan, rank);
  progress.phase("gathering the batch on rank 0");
  const Batch global = gather_batch(plan, batch);
  if (!o.save_routing.empty()) {  // the same on every rank: all take part in the agreement
    progress.phase("saving the routing");
    on_rank_0("saving the routing", [&] {
      with_flag("--save-routing", [&] { save_routing(o.save_routing, global); });
      print_wrapped("  routing saved to " + whole(o.save_routing), 4);
      std::fflush(stdout);
    });
  }
  if (rank == 0 && plan.R > 0) print_redundant_usage(plan, global);

  const Gathered g = run_layer(o, plan, batch, groups, node_leaders(rank, node_ranks), progress);

  // Rank 0 reports, saves the output and checks it; a failure there (say a full disk under
  // --save-output) is agreed on by every rank instead of leaving them in the result broadcast.
  int result = 1;
  on_rank_0("writing the results", [&] {
    print_measurements(o, plan, g.stats, g.warm);
    if (!o.save_output.empty()) {
      progress.phase("saving the output");
      with_flag("--save-output", [&] {
        save_output(o.save_output, g.output, plan.N, plan.layer.hidden, plan.dtype);
      });
      print_wrapped("output saved to " + whole(o.save_output));
    }
    std::fflush(stdout);
    progress.phase("the dense single-process reference on rank 0");
    const CheckResult c = check_output(plan, o, global, batch, g.output);
    progress.done();
    print_check(c, plan.N * plan.layer.hidden);
    print_wrapped(summary_line(plan, W, g.stats, g.warm, c), 2);
    std::fflush(stdout);
    result = c.pass ? 0 : 1;
  });
  progress.done();
  MPI_Request request;
  MPI_Ibcast(&result, 1, MPI_INT, 0, MPI_COMM_WORLD, &request);
  wait_idle(&request, "the broadcast of the result");
  return result;
}

}  // namespace moe_ep_tool
