#include "bench.h"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

#include "bench_output.h"
#include "bench_overlap.h"
#include "bench_point.h"
#include "bench_timing.h"
#include "bench_verify.h"
#include "checks.h"
#include "collective.h"
#include "moe_ep/comm.h"
#include "nodes.h"

namespace moe_ep_tool {

namespace {

// This process's peak resident memory so far (VmHWM of /proc/self/status), in bytes; -1 where
// the file or the line is missing (not Linux). Shared-memory window pages this rank touched
// count, as they do in the kernel's accounting.
double peak_rss_bytes() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  double kib = -1;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    long long v = 0;
    if (std::strncmp(line, "VmHWM:", 6) == 0 && std::sscanf(line + 6, "%lld", &v) == 1) {
      kib = static_cast<double>(v);
      break;
    }
  }
  std::fclose(f);
  return kib < 0 ? -1 : kib * 1024;
}

// Rank 0 prints the peak RSS per rank over the whole run, min and max over ranks (collective).
void print_peak_rss(int rank, Watchdog& dog) {
  double mine[2] = {peak_rss_bytes(), 0};
  mine[1] = -mine[0];
  double all[2] = {0, 0};
  guarded(dog, "the reduction of the peak RSS",
          [&] { MPI_Allreduce(mine, all, 2, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD); });
  if (rank != 0) return;
  if (all[0] < 0) {
    std::printf("peak RSS per rank: unknown (no VmHWM in /proc/self/status)\n");
  } else {
    std::printf("peak RSS per rank (VmHWM, whole run): min %.1f MB, max %.1f MB\n", all[0] / 1e6,
                -all[1] / 1e6);
  }
  std::fflush(stdout);
}

}  // namespace

int bench_command(const BenchOptions& o) {
  using namespace bench;
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  // $MOE_EP_* first, agreed on (one rank reports a value every rank shares), before the first
  // collective that reads them.
  const EnvironmentCheck env = check_environment_here(o.timeout_s, o.transport);
  set_wait_context("moe-ep bench", env.timeout_s);
  agree_on_error(env.error, "checking the environment");
  auto comm = moe_ep::Communicator::from_mpi(MPI_COMM_WORLD, {o.timeout_s});
  set_wait_context("moe-ep bench", comm->timeout_s());
  Watchdog dog(comm->timeout_s(), rank);

  const std::vector<int> machine = ranks_on_this_machine(rank);
  const int node_ranks = static_cast<int>(machine.size());
  Setup setup = agreed("before the run", [&] { return plan_bench(o, world, rank, node_ranks); });
  if (o.overlap) return overlap_command(o, setup, *comm, dog);
  const bool compare = o.compare, quant = o.quant == "int8" || (o.quant.empty() && compare);
  setup.leaders = node_leaders(rank, machine);
  const bool nodes = std::any_of(setup.leaders.begin(), setup.leaders.end(),
                                 [&](int l) { return l != setup.leaders[0]; });
  setup.alt = compare && nodes;
  setup.hierarchy = setup.alt || o.comm_alg == "hierarchy";
  setup.gnuplot =
      rank == 0 && !o.plot.empty() && std::system("command -v gnuplot > /dev/null 2>&1") == 0;
  const Rules rules = counting_rules(o, setup);
  if (rank == 0) print_header(o, setup, rules, compare, quant);

  Sweep sweep;
  for (const int64_t BS : o.tokens) {
    const Point p = make_point(o, setup, BS, dog);
    const Verification v = verify(o, setup, p, *comm, compare, quant, dog);
    if (rank == 0) print_verification(v, BS);
    if (v.failed() > 0) return 1;
    PointResult pr = time_point(o, setup, p, *comm, compare, quant, dog);
    if (rank == 0) {
      print_table(pr, BS);
      sweep.results.insert(sweep.results.end(), pr.results.begin(), pr.results.end());
      sweep.targets.insert(sweep.targets.end(), pr.targets.begin(), pr.targets.end());
      sweep.points.push_back(std::move(pr));
    }
  }

  // Rank 0 prints and writes the results; a failed write (a full disk, an unwritable file the
  // early path check could not see) is agreed on by every rank instead of leaving the others in
  // the final barrier until the deadline.
  on_rank_0("writing the results", [&] { write_report(o, setup, rules, sweep, compare); });
  print_peak_rss(rank, dog);
  return 0;
}

}  // namespace moe_ep_tool
