#include "run.h"

#include <cblas.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <numeric>
#include <optional>
#include <thread>

#include "batch.h"
#include "checks.h"
#include "experts.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "numeric.h"
#include "presets.h"
#include "reference.h"
#include "routing.h"

namespace moe_ep_tool {

using moe_ep::DType;
using moe_ep::Error;
using moe_ep::ErrorKind;

namespace {

std::string fmt(const char* format, double a) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, a);
  return buf;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The deadline of the tool's own waits: the library communicator's (--timeout, $MOE_EP_TIMEOUT_S,
// else 300 s), set once the communicator exists.
double g_wait_timeout_s = 300;

// Waits for a non-blocking collective without spinning: with more ranks than cores (CI runs
// oversubscribed) a spinning rank would steal the CPU from the one doing the work. Throws
// Error(kTimeout) past the deadline.
void wait_idle(MPI_Request* request) {
  const double deadline = now_s() + g_wait_timeout_s;
  int done = 0;
  for (int polls = 0;; ++polls) {
    MPI_Test(request, &done, MPI_STATUS_IGNORE);
    if (done) return;
    if (now_s() > deadline) {
      int rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      throw Error(ErrorKind::kTimeout, "moe-ep run: rank " + std::to_string(rank) +
                                           " timed out after " + fmt("%g", g_wait_timeout_s) +
                                           " s waiting for the other ranks (gather or barrier)");
    }
    if (polls > 100) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void barrier_idle() {
  MPI_Request request;
  MPI_Ibarrier(MPI_COMM_WORLD, &request);
  wait_idle(&request);
}

// Concatenates every rank's bytes on rank 0, in rank order.
std::vector<std::byte> gather_bytes(const void* data, size_t bytes, int rank, int world) {
  if (bytes > static_cast<size_t>(INT_MAX)) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: " + std::to_string(bytes) +
                    " bytes on one rank exceed what MPI_Gatherv moves (2^31-1); use fewer "
                    "--tokens");
  }
  const int n = static_cast<int>(bytes);
  std::vector<int> counts(world), displs(world);
  MPI_Gather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::vector<std::byte> all;
  if (rank == 0) {
    int64_t total = 0;
    for (int r = 0; r < world; ++r) {
      displs[r] = static_cast<int>(total);
      total += counts[r];
      if (total > INT_MAX) {
        throw Error(ErrorKind::kInvalidArgument,
                    "moe-ep run: the gathered batch exceeds 2^31-1 bytes on rank 0; use fewer "
                    "--tokens");
      }
    }
    all.resize(static_cast<size_t>(total));
  }
  MPI_Request request;
  MPI_Igatherv(data, n, MPI_BYTE, all.data(), counts.data(), displs.data(), MPI_BYTE, 0,
               MPI_COMM_WORLD, &request);
  wait_idle(&request);
  return all;
}

template <typename T>
std::vector<T> gather_values(const std::vector<T>& local, int rank, int world) {
  const auto bytes = gather_bytes(local.data(), local.size() * sizeof(T), rank, world);
  std::vector<T> all(bytes.size() / sizeof(T));
  if (!all.empty()) std::memcpy(all.data(), bytes.data(), bytes.size());
  return all;
}

Preset effective_layer(const RunOptions& o) {
  const Preset* p = find_preset(o.preset);
  if (p == nullptr) {
    throw Error(ErrorKind::kInvalidArgument, "moe-ep run: unknown preset '" + o.preset + "'");
  }
  Preset layer = *p;
  if (o.hidden) layer.hidden = *o.hidden;
  if (o.experts) layer.experts = *o.experts;
  if (o.top_k) layer.top_k = *o.top_k;
  if (o.ffn) layer.ffn = *o.ffn;
  return layer;
}

// What each rank measures; gathered to rank 0.
struct RankStats {
  double route_s, dispatch_s, experts_s, generate_s, combine_s;
  double received_rows;        // dispatch's valid rows
  double sent_other_rows;      // entries this rank dispatched to another rank
  double received_other_rows;  // rows it received from another rank (and sends back in combine)
};

}  // namespace

std::string default_routing_file() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  const auto dir = ec ? std::filesystem::path(".") : exe.parent_path();
  return (dir / ".." / "share" / "moe-ep" / "real-routing" / "expert_counts.csv")
      .lexically_normal()
      .string();
}

namespace {

// The ranks of MPI_COMM_WORLD that share this machine (for the memory check). Collective.
std::vector<int> ranks_on_this_machine(int rank) {
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int n = 1;
  MPI_Comm_size(node, &n);
  std::vector<int> ranks(static_cast<size_t>(n));
  MPI_Request request;
  MPI_Iallgather(&rank, 1, MPI_INT, ranks.data(), 1, MPI_INT, node, &request);
  wait_idle(&request);
  MPI_Comm_free(&node);
  return ranks;
}

// Collective. When any rank's setup failed, the lowest such rank rethrows its error and every
// other rank throws kRemote (main prints only the former, so a failure every rank shares is
// reported once).
void agree_on_setup(const std::exception_ptr& error, int rank) {
  int mine = error ? rank : INT_MAX, lowest = INT_MAX;
  MPI_Request request;
  MPI_Iallreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD, &request);
  wait_idle(&request);
  if (lowest == INT_MAX) return;
  if (rank == lowest) std::rethrow_exception(error);
  throw Error(ErrorKind::kRemote, "moe-ep run: rank " + std::to_string(lowest) +
                                      " failed before the run (its message says why)");
}

// Everything decided before the first allocation of the run's size and the first message.
struct Plan {
  Preset layer;
  DType dtype = DType::kBF16;
  ExpertFn fn = ExpertFn::kSwiglu;
  RoutingKind kind = RoutingKind::kReal;
  uint64_t seed = 0;                   // of every value generated here
  std::optional<uint64_t> batch_seed;  // the seed x and the routing were generated with
  Batch file;                          // --load-routing
  std::vector<int64_t> bs;             // tokens per rank
  std::vector<double> real_p;
  std::string routing_desc, seed_desc;
};

std::string label(const char* flag, const char* name, const std::optional<int64_t>& given,
                  int64_t value) {
  return std::string(given ? flag : name) + " " + std::to_string(value);
}

// Throws on any rank whose setup fails (every rank alike for a bad flag or file).
Plan plan_run(const RunOptions& o, int rank, int64_t W, const std::vector<int>& node_ranks) {
  Plan p;
  p.layer = effective_layer(o);
  p.dtype = parse_float_dtype(o.dtype);
  p.seed = o.seed;
  p.fn = o.expert_fn == "scale"      ? ExpertFn::kScale
         : o.expert_fn == "identity" ? ExpertFn::kIdentity
                                     : ExpertFn::kSwiglu;
  p.kind = o.routing == "gate"      ? RoutingKind::kGate
           : o.routing == "uniform" ? RoutingKind::kUniform
                                    : RoutingKind::kReal;
  const Preset& layer = p.layer;
  const bool loaded = !o.load_routing.empty();
  const uint64_t physical = physical_memory_bytes();
  uint64_t file_bytes = 0;

  // ---- inputs: --load-routing, or --tokens per rank --------------------------------------
  if (loaded) {
    std::error_code ec;
    file_bytes = std::filesystem::file_size(o.load_routing, ec);
    if (ec) file_bytes = 0;
    check_load_memory(o.load_routing, file_bytes, physical);
    p.file = load_routing(o.load_routing);
    const Batch& file = p.file;
    const std::string where = "--load-routing '" + o.load_routing + "': ";
    if (file.hidden != layer.hidden) {
      throw Error(ErrorKind::kInvalidArgument,
                  where + "x has H = " + std::to_string(file.hidden) + ", the preset " +
                      layer.name + " has H = " + std::to_string(layer.hidden) +
                      " (choose the preset or --hidden it was saved with)");
    }
    if (file.top_k != layer.top_k) {
      throw Error(ErrorKind::kInvalidArgument,
                  where + "expert_ids has K = " + std::to_string(file.top_k) + ", the preset " +
                      layer.name + " has K = " + std::to_string(layer.top_k) +
                      " (choose the preset or --top-k it was saved with)");
    }
    if (auto it = file.metadata.find("moe_expert_num");
        it != file.metadata.end() && it->second != std::to_string(layer.experts)) {
      throw Error(ErrorKind::kInvalidArgument,
                  where + "saved with E = " + it->second + ", the preset " + layer.name +
                      " has E = " + std::to_string(layer.experts) +
                      " (choose the preset or --experts it was saved with)");
    }
    if (o.dtype_given && file.dtype != p.dtype) {
      throw Error(ErrorKind::kInvalidArgument, where + "x is " + moe_ep::dtype_name(file.dtype) +
                                                   ", --dtype says " + moe_ep::dtype_name(p.dtype));
    }
    p.dtype = file.dtype;
    p.batch_seed = file.seed;
    if (!o.seed_given && file.seed) p.seed = *file.seed;
    p.bs = split_tokens(file.tokens, file.tokens_per_rank, W);
    const bool own_split = static_cast<int64_t>(file.tokens_per_rank.size()) == W;
    p.routing_desc =
        "loaded from " + o.load_routing + " (" + std::to_string(file.tokens) + " tokens, " +
        (own_split ? std::string("its tokens_per_rank")
                   : std::string("split evenly over the ranks")) +
        (file.metadata.count("routing") ? "; saved routing: " + file.metadata.at("routing")
                                        : std::string()) +
        ")";
  } else {
    p.bs.assign(W, o.tokens);
    p.batch_seed = p.seed;
  }
  if (layer.experts % W != 0) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: E = " + std::to_string(layer.experts) +
                    " experts cannot be split evenly over W = " + std::to_string(W) +
                    " ranks (SPEC §1.3: moe_expert_num % ep_world_size == 0)");
  }

  // ---- sizes and memory, before anything of the run's size is allocated -------------------
  RunShape shape;
  shape.world = W;
  shape.tokens_per_rank = p.bs;
  shape.hidden = layer.hidden;
  shape.experts = layer.experts;
  shape.top_k = layer.top_k;
  shape.ffn = layer.ffn;
  shape.dtype = p.dtype;
  shape.fn = p.fn;
  shape.routing = p.kind;
  shape.loaded = loaded;
  shape.file_bytes = file_bytes;
  shape.tokens_label = loaded ? "--load-routing '" + o.load_routing + "' (" +
                                    std::to_string(p.file.tokens) + " tokens)"
                              : "--tokens " + std::to_string(o.tokens);
  shape.hidden_label = label("--hidden", "H", o.hidden, layer.hidden);
  shape.experts_label = label("--experts", "E", o.experts, layer.experts);
  shape.top_k_label = label("--top-k", "K", o.top_k, layer.top_k);
  shape.ffn_label = label("--ffn", "FFN", o.ffn, layer.ffn);
  check_sizes(shape);
  check_memory(shape, node_ranks, physical);
  check_gather_limits(shape);

  // ---- output files: writable (rank 0 writes them) ----------------------------------------
  if (rank == 0) {
    if (!o.save_routing.empty()) check_writable("--save-routing", o.save_routing);
    if (!o.save_output.empty()) check_writable("--save-output", o.save_output);
  }

  // ---- routing source -----------------------------------------------------------------------
  if (!loaded) {
    if (p.kind == RoutingKind::kReal) {
      const std::string routing_file =
          o.routing_file.empty() ? default_routing_file() : o.routing_file;
      RealRoutingSource src{routing_file,
                            o.routing_model.empty() ? layer.routing_model : o.routing_model,
                            o.domain, o.layer};
      ExpertDistribution d = load_real_distribution(src, layer.experts, layer.top_k);
      p.real_p = std::move(d.p);
      p.routing_desc = d.description + " from " + routing_file;
    } else if (p.kind == RoutingKind::kGate) {
      p.routing_desc = "gate (router matrix Wr [H, E] from the seed, logits = x @ Wr, top-k)";
    } else {
      p.routing_desc = "uniform (K distinct experts, each equally likely)";
    }
  }

  // ---- what the seed does -------------------------------------------------------------------
  const std::string seed = std::to_string(p.seed);
  if (!loaded) {
    p.seed_desc = "seed " + seed;
  } else if (p.fn != ExpertFn::kSwiglu) {
    p.seed_desc = std::string("seed not used (x and routing come from the file; expert-fn ") +
                  expert_fn_name(p.fn) + " has no weights)";
  } else {
    const std::string saved =
        p.file.seed ? "saved with seed " + std::to_string(*p.file.seed) : "saved without a seed";
    p.seed_desc = "seed " + seed + " (" +
                  (o.seed_given  ? "--seed"
                   : p.file.seed ? "the file's"
                                 : "default") +
                  "; expert weights only: x and routing come from the file, " + saved + ")";
  }
  return p;
}

}  // namespace

int run_command(const RunOptions& o) {
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const int64_t W = world;
  // One BLAS thread per rank unless asked otherwise: ranks already fill the cores.
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) openblas_set_num_threads(1);

  // Created first (collective), so that its deadline also bounds the tool's own waits.
  auto comm = moe_ep::Communicator::from_mpi(MPI_COMM_WORLD, {o.timeout_s});
  g_wait_timeout_s = comm->timeout_s();

  const std::vector<int> node_ranks = ranks_on_this_machine(rank);
  Plan plan;
  std::exception_ptr setup_error;
  try {
    plan = plan_run(o, rank, W, node_ranks);
  } catch (...) {
    setup_error = std::current_exception();
  }
  agree_on_setup(setup_error, rank);

  const bool loaded = !o.load_routing.empty();
  const Preset& layer = plan.layer;
  const DType dtype = plan.dtype;
  const ExpertFn fn = plan.fn;
  const uint64_t seed = plan.seed;
  const std::vector<int64_t>& bs = plan.bs;
  Batch& file = plan.file;
  const int64_t H = layer.hidden, E = layer.experts, K = layer.top_k, L = E / W;
  const int64_t N = std::accumulate(bs.begin(), bs.end(), int64_t{0});
  const int64_t BS = bs[rank];
  const int64_t first = std::accumulate(bs.begin(), bs.begin() + rank, int64_t{0});
  const int64_t max_bs = *std::max_element(bs.begin(), bs.end());
  const bool uneven = std::any_of(bs.begin(), bs.end(), [&](int64_t n) { return n != bs[0]; });
  const size_t es = moe_ep::dtype_size(dtype);
  const size_t row_bytes = static_cast<size_t>(H) * es;

  if (rank == 0) {
    std::printf(
        "moe-ep run: preset %s  H %lld  E %lld  K %lld  FFN %lld  dtype %s  expert-fn %s"
        "  W %lld  tokens/rank ",
        layer.name.c_str(), static_cast<long long>(H), static_cast<long long>(E),
        static_cast<long long>(K), static_cast<long long>(layer.ffn), moe_ep::dtype_name(dtype),
        expert_fn_name(fn), static_cast<long long>(W));
    if (uneven) {
      for (int64_t r = 0; r < W; ++r)
        std::printf("%s%lld", r ? "," : "", static_cast<long long>(bs[r]));
    } else {
      std::printf("%lld", static_cast<long long>(bs[0]));
    }
    std::printf(" (N %lld%s)  %s\n", static_cast<long long>(N), loaded ? ", from the file" : "",
                plan.seed_desc.c_str());
    if (!loaded) std::printf("  router scores: %s\n", describe_scoring(layer).c_str());
    if (!layer.note.empty()) std::printf("  note: %s\n", layer.note.c_str());
    std::printf("  routing: %s\n", plan.routing_desc.c_str());
    std::printf("  placement: %lld experts per rank (expert e on rank e / %lld)%s\n",
                static_cast<long long>(L), static_cast<long long>(L),
                uneven ? ", global_bs = W x max tokens per rank" : "");
    std::fflush(stdout);
  }

  std::vector<std::byte> x;
  std::vector<int32_t> ids(static_cast<size_t>(BS * K));
  std::vector<float> scales(static_cast<size_t>(BS * K));
  double route_s = 0;
  if (loaded) {
    x.assign(file.x.begin() + static_cast<std::ptrdiff_t>(first * row_bytes),
             file.x.begin() + static_cast<std::ptrdiff_t>((first + BS) * row_bytes));
    std::copy_n(file.expert_ids.begin() + first * K, BS * K, ids.begin());
    std::copy_n(file.expert_scales.begin() + first * K, BS * K, scales.begin());
    file = Batch{};
  } else {
    x = make_tokens(seed, first, BS, H, dtype);
    const Router router(layer, plan.kind, seed, std::move(plan.real_p));
    const double t0 = now_s();
    router.route(first, BS, x.data(), dtype, ids.data(), scales.data());
    route_s = now_s() - t0;
  }

  // A dispatch/combine error on a loaded batch names this rank's token index: add the file's.
  auto with_file_rows = [&](auto&& op) {
    if (!loaded) return op();
    try {
      return op();
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::kRemote) throw;
      throw Error(e.kind(), std::string(e.what()) + " " +
                                file_rows_context(e.what(), rank, first, BS, o.load_routing));
    }
  };

  // ---- the global batch on rank 0 (for --save-routing and the reference) ------------------
  Batch global;
  global.tokens = N;
  global.hidden = H;
  global.top_k = K;
  global.dtype = dtype;
  global.x = gather_bytes(x.data(), x.size(), rank, world);
  global.expert_ids = gather_values(ids, rank, world);
  global.expert_scales = gather_values(scales, rank, world);
  global.tokens_per_rank = bs;
  global.metadata = {{"moe_expert_num", std::to_string(E)},
                     {"preset", layer.name},
                     {"routing", plan.routing_desc}};
  if (plan.batch_seed) global.metadata["seed"] = std::to_string(*plan.batch_seed);
  if (rank == 0 && !o.save_routing.empty()) {
    save_routing(o.save_routing, global);
    std::printf("  routing saved to %s\n", o.save_routing.c_str());
    std::fflush(stdout);
  }

  // ---- dispatch_v2 -------------------------------------------------------------------------
  moe_ep::EpConfig cfg;
  cfg.group_ep = comm.get();
  cfg.ep_world_size = W;
  cfg.ep_rank_id = rank;
  cfg.moe_expert_num = E;
  cfg.shared_expert_num = 0;
  cfg.global_bs = uneven ? W * max_bs : 0;
  moe_ep::DispatchInputs din;
  din.x = moe_ep::TensorView::contiguous(x.data(), dtype, {BS, H});
  din.expert_ids = moe_ep::TensorView::contiguous(ids.data(), DType::kI32, {BS, K});
  din.expert_scales = moe_ep::TensorView::contiguous(scales.data(), DType::kF32, {BS, K});
  barrier_idle();
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = now_s();
  moe_ep::DispatchOutputs d = with_file_rows([&] { return moe_ep::dispatch_v2(din, cfg); });
  const double dispatch_s = now_s() - t0;

  // ---- the local experts -------------------------------------------------------------------
  const int32_t* recv = d.ep_recv_counts.ptr<int32_t>();
  const int64_t valid = W * L > 0 ? recv[W * L - 1] : 0;
  moe_ep::Tensor expert_out = moe_ep::Tensor::zeros(dtype, {d.expand_x.size(0), H});
  ExpertBank bank(fn, seed, E, H, layer.ffn);
  t0 = now_s();
  for (int64_t j = 0; j < L; ++j) {
    const int64_t begin = j == 0 ? 0 : recv[j * W - 1];
    const int64_t end = recv[(j + 1) * W - 1];
    bank.forward(rank * L + j, static_cast<const std::byte*>(d.expand_x.data()) + begin * row_bytes,
                 static_cast<std::byte*>(expert_out.data()) + begin * row_bytes, end - begin,
                 dtype);
  }
  const double experts_s = now_s() - t0 - bank.generate_seconds();

  // ---- combine_v2 --------------------------------------------------------------------------
  moe_ep::CombineInputs cin;
  cin.expand_x = expert_out;
  cin.expert_ids = din.expert_ids;
  cin.assist_info_for_combine = d.assist_info_for_combine;
  cin.ep_send_counts = d.ep_recv_counts;
  cin.expert_scales = *din.expert_scales;
  barrier_idle();
  MPI_Barrier(MPI_COMM_WORLD);
  t0 = now_s();
  moe_ep::Tensor out = with_file_rows([&] { return moe_ep::combine_v2(cin, cfg); });
  const double combine_s = now_s() - t0;

  // ---- statistics --------------------------------------------------------------------------
  RankStats mine{route_s,   dispatch_s,
                 experts_s, bank.generate_seconds(),
                 combine_s, static_cast<double>(valid),
                 0,         0};
  for (int32_t e : ids) {
    if (e >= 0 && e / L != rank) mine.sent_other_rows += 1;
  }
  for (int64_t j = 0; j < L; ++j) {
    for (int64_t s = 0; s < W; ++s) {
      const int64_t b = j * W + s;
      if (s != rank) mine.received_other_rows += recv[b] - (b == 0 ? 0 : recv[b - 1]);
    }
  }
  constexpr int kStats = sizeof(RankStats) / sizeof(double);
  std::vector<RankStats> all(rank == 0 ? W : 0);
  MPI_Gather(&mine, kStats, MPI_DOUBLE, all.data(), kStats, MPI_DOUBLE, 0, MPI_COMM_WORLD);

  const std::vector<std::byte> output = gather_bytes(out.data(), out.nbytes(), rank, world);

  int result = 1;
  if (rank == 0) {
    auto max_of = [&](double RankStats::*f) {
      double m = 0;
      for (const auto& s : all) m = std::max(m, s.*f);
      return m;
    };
    double rmin = all[0].received_rows, rsum = 0, cross = 0;
    for (const auto& s : all) {
      rmin = std::min(rmin, s.received_rows);
      rsum += s.received_rows;
      cross += s.sent_other_rows;
    }
    const double rmean = rsum / static_cast<double>(W), rmax = max_of(&RankStats::received_rows);
    std::printf(
        "tokens received per rank (dispatch valid rows): min %.0f  mean %.1f  max %.0f"
        "  imbalance max/mean %s\n",
        rmin, rmean, rmax, rmean > 0 ? fmt("%.3f", rmax / rmean).c_str() : "n/a");
    std::printf(
        "time per phase, ms (max over ranks): route %.3f  dispatch %.3f  experts %.3f  "
        "combine %.3f  (expert weight generation %.1f ms, not counted)\n",
        1e3 * max_of(&RankStats::route_s), 1e3 * max_of(&RankStats::dispatch_s),
        1e3 * max_of(&RankStats::experts_s), 1e3 * max_of(&RankStats::combine_s),
        1e3 * max_of(&RankStats::generate_s));
    const double per_rank_bytes = cross / static_cast<double>(W) * static_cast<double>(row_bytes);
    if (cross > 0) {
      std::printf(
          "bandwidth: dispatch %.3f GB/s  combine %.3f GB/s  (bytes per rank = rows sent "
          "to other ranks x H x %zu B, self-traffic excluded, mean over ranks = %.3f MB; "
          "combine sends the same rows back; time = max over ranks)\n",
          per_rank_bytes / max_of(&RankStats::dispatch_s) / 1e9,
          per_rank_bytes / max_of(&RankStats::combine_s) / 1e9, es, per_rank_bytes / 1e6);
    } else {
      std::printf("bandwidth: n/a (no rows travel between ranks)\n");
    }

    if (!o.save_output.empty()) {
      save_output(o.save_output, output, N, H, dtype);
      std::printf("output saved to %s\n", o.save_output.c_str());
    }
    ExpertBank ref_bank(fn, seed, E, H, layer.ffn);
    const std::vector<std::byte> ref = dense_reference(global, E, ref_bank);
    const CheckResult c = compare_outputs(output, ref, dtype, fn);
    const std::string nan_note =
        c.nans > 0 ? " (" + std::to_string(c.nans) + " of them NaN)" : std::string();
    if (c.exact) {
      std::printf(
          "check vs dense single-process reference (SPEC §2.3): %s (%lld of %lld "
          "elements differ%s; max abs err %.3g); rule: %s\n",
          c.mismatches == 0 && c.pass ? "exact" : "NOT exact", static_cast<long long>(c.mismatches),
          static_cast<long long>(N * H), nan_note.c_str(), c.max_abs, c.rule.c_str());
    } else {
      std::printf(
          "check vs dense single-process reference (SPEC §2.3): max abs err %.3g, max rel "
          "err %.3g (max|ref| %.3g)%s, %lld of %lld elements not bitwise equal%s; rule: %s\n",
          c.max_abs, c.max_rel, c.max_ref, c.nans > 0 ? " over the non-NaN elements" : "",
          static_cast<long long>(c.mismatches), static_cast<long long>(N * H), nan_note.c_str(),
          c.rule.c_str());
    }
    std::printf("%s\n", c.pass ? "PASS" : "FAIL");
    std::fflush(stdout);
    result = c.pass ? 0 : 1;
  }
  MPI_Request request;
  MPI_Ibcast(&result, 1, MPI_INT, 0, MPI_COMM_WORLD, &request);
  wait_idle(&request);
  return result;
}

}  // namespace moe_ep_tool
