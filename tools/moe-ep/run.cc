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
#include <map>
#include <numeric>
#include <optional>
#include <thread>

#include "batch.h"
#include "checks.h"
#include "experts.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "moe_ep/threads.h"
#include "numeric.h"
#include "presets.h"
#include "redundant.h"
#include "reference.h"
#include "rng.h"
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
// else 300 s), set by the environment check before the first collective.
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
  if (o.shared_experts) layer.shared_experts = *o.shared_experts;
  return layer;
}

// What each rank measures; gathered to rank 0.
struct RankStats {
  double route_s, dispatch_s, experts_s, generate_s, combine_s;
  double received_rows;        // dispatch's valid rows (with the TP peer's)
  double sent_other_rows;      // rows this rank dispatched to another EP rank
  double received_other_rows;  // rows it received from another EP rank (and sends back)
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

// Collective. Every rank learns whether any failed in a local step (`when`: "before the run",
// "saving the routing", "writing the results"): the lowest failed rank rethrows its error, the
// others throw kRemote naming it (main prints only the former, so a failure every rank shares is
// reported once), and no rank is left waiting for one that is unwinding.
void agree_on_error(const std::exception_ptr& error, int rank, const char* when) {
  int mine = error ? rank : INT_MAX, lowest = INT_MAX;
  MPI_Request request;
  MPI_Iallreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD, &request);
  wait_idle(&request);
  if (lowest == INT_MAX) return;
  if (rank == lowest) std::rethrow_exception(error);
  throw Error(ErrorKind::kRemote, "moe-ep run: rank " + std::to_string(lowest) + " failed " + when +
                                      " (its message says why)");
}

// Collective: rank 0 runs `step` (output only it writes), then every rank agrees on its outcome
// (agree_on_error).
template <typename F>
void on_rank_0(int rank, const char* when, F&& step) {
  std::exception_ptr error;
  if (rank == 0) {
    try {
      step();
    } catch (...) {
      error = std::current_exception();
    }
  }
  agree_on_error(error, rank, when);
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
  std::vector<int64_t> bs;             // tokens per (world) rank
  std::vector<double> real_p;          // over E + Z + C + Q
  std::string routing_desc, seed_desc;
  int64_t T = 1, Wep = 1, S = 0, Ns = 0, L = 1;
  int64_t Z = 0, C = 0, Q = 0;
  int64_t R = 0;               // redundant expert slots (moe_expert_num = E + R)
  RedundantExperts redundant;  // which experts they replicate
  std::string redundant_desc;  // how the replicated experts were chosen
  int mask_dims = 0;           // 0, 1, 2 (generated or loaded)
  std::string mask_desc;
};

std::string label(const char* flag, const char* name, const std::optional<int64_t>& given,
                  int64_t value) {
  return std::string(given ? flag : name) + " " + std::to_string(value);
}

// "1 rank", "3 ranks"
std::string ranks_words(int64_t n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); }

// "4, 4, 3, 3"
std::string join_ints(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i == 0 ? "" : ", ") + std::to_string(v[i]);
  return s;
}

std::string join_ways(const std::vector<std::string>& ways) {
  std::string s;
  for (size_t i = 0; i < ways.size(); ++i) {
    s += (i == 0 ? "" : i + 1 == ways.size() ? " or " : ", ") + ways[i];
  }
  return s;
}

// Flags that make the expert placement work when E % (W_ep - S) != 0 (or, with TP, E != W_ep - S):
// fewer experts (with --routing real: a count the data's D experts map onto), another S, another
// number of ranks.
std::string placement_advice(const Plan& p, bool tp_one_per_rank, int64_t data_experts) {
  const int64_t E = p.layer.experts, K = p.layer.top_k, special = p.Z + p.C + p.Q;
  const int64_t m = p.Wep - p.S;
  std::vector<std::string> ways;
  auto maps = [&](int64_t e) {
    return data_experts == 0 || e % data_experts == 0 || data_experts % e == 0;
  };
  if (tp_one_per_rank) {
    if (maps(m)) {
      std::string w = "--experts " + std::to_string(m);
      if (K > m + special) w += " --top-k " + std::to_string(m + special);
      ways.push_back(w);
    }
    if (E + p.S <= 1 << 20) ways.push_back(std::to_string(p.T * (p.S + E)) + " ranks");
    return join_ways(ways);
  }
  // Fewer experts: the largest multiple of m below E (that the real data maps onto).
  int64_t best = 0;
  for (int64_t e = (E / m) * m; e >= m && best == 0; e -= m) {
    if (maps(e)) best = e;
    if ((E / m) * m - e > (int64_t{1} << 22)) break;  // bounded search
  }
  if (best > 0 && best + special >= K) ways.push_back("--experts " + std::to_string(best));
  // Another number of shared-expert ranks.
  for (int64_t d = 1; d < p.Wep; ++d) {
    int64_t found = -1;
    for (int64_t s : {p.S + d, p.S - d}) {
      if (s < 0 || s >= p.Wep) continue;
      const bool ns_ok = s == 0 ? p.Ns <= 1 : p.Ns > 0 && s % p.Ns == 0;
      if (ns_ok && E % (p.Wep - s) == 0) {
        found = s;
        break;
      }
    }
    if (found >= 0) {
      ways.push_back("--shared-expert-ranks " + std::to_string(found));
      break;
    }
  }
  // Another number of ranks: the nearest MoE-rank counts that divide E.
  for (int64_t n = m + 1; n <= E && n <= m + 4096; ++n) {
    if (E % n == 0) {
      ways.push_back(std::to_string(p.T * (p.S + n)) + " ranks");
      break;
    }
  }
  return join_ways(ways);
}

// The integer value of a metadata key: 0 when absent, -1 when not an integer.
int64_t metadata_count(const Batch& file, const char* key) {
  auto it = file.metadata.find(key);
  if (it == file.metadata.end()) return 0;
  try {
    return std::stoll(it->second);
  } catch (const std::exception&) {
    return -1;
  }
}

// dispatch_v2's rules on the tokens per rank (SPEC §1.3), checked here so that the error names
// the flag or the file and is agreed on (printed once) before the run: --global-bs at least
// W_ep x max BS and a multiple of W_ep; a batch split unevenly over an EP group only with
// --global-bs (the default then) and with every token of that group active; a loaded 1-D mask
// all Trues before all Falses in each rank's rows (the tool's copy of dispatch_v2's check, which
// it cannot call before the run). Throws Error(kInvalidArgument).
void check_batch_split(const RunOptions& o, const Plan& p) {
  const std::vector<int64_t>& bs = p.bs;
  const int64_t W = static_cast<int64_t>(bs.size()),
                max_bs = *std::max_element(bs.begin(), bs.end());
  // EP group i = {x T + i} (i = r % T): whether its ranks' tokens differ.
  std::vector<bool> uneven(static_cast<std::size_t>(p.T), false);
  for (int64_t r = p.T; r < W; ++r) {
    if (bs[r] != bs[r % p.T]) uneven[static_cast<std::size_t>(r % p.T)] = true;
  }
  const bool any_uneven = std::find(uneven.begin(), uneven.end(), true) != uneven.end();
  if (o.global_bs) {
    const int64_t g = *o.global_bs;
    if (g == 0 && any_uneven) {
      throw Error(ErrorKind::kInvalidArgument,
                  "moe-ep run: --global-bs 0 needs the same tokens on every rank of an EP group; "
                  "this split has " +
                      join_ints(bs) +
                      " (SPEC §1.3; leave --global-bs out for W_ep x max tokens per rank)");
    }
    if (g > 0 && g < p.Wep * max_bs) {
      throw Error(ErrorKind::kInvalidArgument,
                  "moe-ep run: --global-bs " + std::to_string(g) +
                      " is less than W_ep x max tokens per rank = " + std::to_string(p.Wep) +
                      " x " + std::to_string(max_bs) + " = " + std::to_string(p.Wep * max_bs) +
                      " (SPEC §1.3)");
    }
    if (g % p.Wep != 0) {
      throw Error(ErrorKind::kInvalidArgument,
                  "moe-ep run: --global-bs " + std::to_string(g) +
                      " is not a multiple of W_ep = " + std::to_string(p.Wep) + " (SPEC §1.3)");
    }
  }
  if (o.load_routing.empty() || p.mask_dims == 0) return;
  const std::vector<uint8_t>& mask = p.file.x_active_mask;
  const int64_t row = p.mask_dims == 2 ? p.file.top_k : 1;  // mask entries per token
  const std::string where = "moe-ep run: --load-routing '" + o.load_routing + "': ";
  // Saved on another number of ranks: a hint (the saving run's dispatch_v2 accepted that split).
  const int64_t saved_ranks = static_cast<int64_t>(p.file.tokens_per_rank.size());
  const std::string saved =
      saved_ranks > 0 && saved_ranks != W
          ? "; it was saved on " + ranks_words(saved_ranks) + ", where it fits"
          : std::string();
  int64_t first = 0;
  for (int64_t r = 0; r < W; ++r) {
    const auto begin = mask.begin() + first * row, end = mask.begin() + (first + bs[r]) * row;
    if (uneven[static_cast<std::size_t>(r % p.T)] && std::find(begin, end, 0) != end) {
      throw Error(ErrorKind::kInvalidArgument,
                  where + "on " + ranks_words(W) + " the " + std::to_string(p.file.tokens) +
                      " tokens split unevenly (" + join_ints(bs) + "), and rank " +
                      std::to_string(r) + "'s file rows [" + std::to_string(first) + ", " +
                      std::to_string(first + bs[r]) +
                      ") have an inactive x_active_mask entry (SPEC §1.3: when BS differs "
                      "across ranks every token must be active)" +
                      saved);
    }
    for (int64_t i = first + 1; p.mask_dims == 1 && i < first + bs[r]; ++i) {
      if (mask[i] && !mask[i - 1]) {
        throw Error(ErrorKind::kInvalidArgument,
                    where + "on " + ranks_words(W) + ", rank " + std::to_string(r) +
                        " takes file rows [" + std::to_string(first) + ", " +
                        std::to_string(first + bs[r]) +
                        "), where its 1-D x_active_mask has a True after a False (SPEC §1.3: all "
                        "Trues before all Falses on each rank)" +
                        saved);
      }
    }
    first += bs[r];
  }
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
  p.T = o.tp;
  p.S = o.shared_expert_ranks;
  p.Ns = p.layer.shared_experts;
  p.Z = o.zero_experts;
  p.C = o.copy_experts;
  p.Q = o.const_experts;
  const Preset& layer = p.layer;
  const bool loaded = !o.load_routing.empty();
  const uint64_t physical = physical_memory_bytes();
  uint64_t file_bytes = 0;

  // ---- the ranks: W_ep x T, shared-expert ranks, placement -----------------------------------
  if (W % p.T != 0) {
    throw Error(ErrorKind::kInvalidArgument, "moe-ep run: --tp " + std::to_string(p.T) +
                                                 " needs a multiple of " + std::to_string(p.T) +
                                                 " ranks (W_ep x T), got " + std::to_string(W));
  }
  p.Wep = W / p.T;
  if (p.S >= p.Wep) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: --shared-expert-ranks " + std::to_string(p.S) +
                    " (shared_expert_rank_num) must be below the " + std::to_string(p.Wep) +
                    " EP ranks (SPEC §1.3: shared_expert_rank_num in [0, ep_world_size)); use "
                    "more ranks");
  }
  const int64_t moe_ranks = p.Wep - p.S;
  const int64_t E = layer.experts;
  const int64_t auto_R = auto_redundant(E, moe_ranks);
  p.R = o.redundant_experts.value_or(auto_R);
  const int64_t slots = E + p.R;
  const bool tp_mismatch = p.T == 2 && slots != moe_ranks;
  if (slots % moe_ranks != 0 || tp_mismatch) {
    int64_t data_experts = 0;
    if (!loaded && p.kind == RoutingKind::kReal) {
      try {
        data_experts = real_data_experts(
            {o.routing_file.empty() ? default_routing_file() : o.routing_file,
             o.routing_model.empty() ? layer.routing_model : o.routing_model, o.domain, o.layer});
      } catch (const Error&) {
        data_experts = 0;  // reported later by the routing itself
      }
    }
    const std::string where =
        p.S > 0
            ? "the W_ep - S = " + std::to_string(p.Wep) + " - " + std::to_string(p.S) + " = " +
                  std::to_string(moe_ranks) + " MoE ranks"
            : "W" + std::string(p.T > 1 ? "_ep" : "") + " = " + std::to_string(p.Wep) + " ranks";
    // Other flags only help without redundant slots; another R helps when one exists.
    std::vector<std::string> ways;
    const bool r_helps = !tp_mismatch || E <= moe_ranks;
    if (r_helps) {
      ways.push_back("--redundant-experts " + std::to_string(tp_mismatch ? moe_ranks - E : auto_R) +
                     (tp_mismatch ? std::string(" (E + R = W_ep - S)")
                                  : " (the default: the smallest R with (E + R) % " +
                                        std::to_string(moe_ranks) + " == 0)"));
    }
    if (p.R == 0) {
      const std::string advice = placement_advice(p, tp_mismatch, data_experts);
      if (!advice.empty()) ways.push_back(advice);
    }
    std::string use;
    for (size_t i = 0; i < ways.size(); ++i) use += (i == 0 ? "; use " : "; or ") + ways[i];
    const std::string real_note = data_experts > 0 && p.R == 0
                                      ? " (with --routing real, E must also map onto the data's " +
                                            std::to_string(data_experts) + " experts)"
                                      : "";
    const std::string r_words = p.R > 0 ? " + R = " + std::to_string(p.R) + " redundant" : "";
    if (tp_mismatch && slots % moe_ranks == 0) {
      throw Error(ErrorKind::kInvalidArgument,
                  "moe-ep run: --tp 2 needs one expert per MoE rank (SPEC §1.3: with "
                  "tp_world_size 2, local_expert_num must be 1), but E = " +
                      std::to_string(E) + r_words + " over " + where + " gives " +
                      std::to_string(slots / moe_ranks) + " per rank" + use + real_note);
    }
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: --redundant-experts " + std::to_string(p.R) +
                    ": E + R = " + std::to_string(E) + " + " + std::to_string(p.R) + " = " +
                    std::to_string(slots) + " expert slots cannot be split evenly over " + where +
                    (p.S > 0 ? " (SPEC §1.3: moe_expert_num % (ep_world_size - "
                               "shared_expert_rank_num) == 0 with moe_expert_num = E + R; "
                               "shared-expert ranks host no routed expert)"
                             : " (SPEC §1.3: moe_expert_num % ep_world_size == 0 with "
                               "moe_expert_num = E + R)") +
                    use + real_note);
  }
  if (slots + p.Z + p.C + p.Q > kMaxExperts) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: E + R + Z + C + Q = " + std::to_string(slots + p.Z + p.C + p.Q) +
                    " (R = " + std::to_string(p.R) +
                    " redundant slots) must stay below 2^31 - 1 (SPEC §1.3: expert ids are int32)");
  }
  p.L = slots / moe_ranks;

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
    const std::tuple<const char*, const char*, int64_t> counts[] = {
        {"zero_expert_num", "--zero-experts", p.Z},
        {"copy_expert_num", "--copy-experts", p.C},
        {"const_expert_num", "--const-experts", p.Q}};
    for (const auto& [key, flag, value] : counts) {
      const int64_t saved = metadata_count(file, key);
      if (saved != value) {
        throw Error(ErrorKind::kInvalidArgument,
                    where + "saved with " + key + " = " +
                        (file.metadata.count(key) ? file.metadata.at(key) : std::string("0")) +
                        ", this run has " + flag + " " + std::to_string(value) +
                        " (the expert ids depend on it; pass the value it was saved with)");
      }
    }
    if (o.dtype_given && file.dtype != p.dtype) {
      throw Error(ErrorKind::kInvalidArgument, where + "x is " + moe_ep::dtype_name(file.dtype) +
                                                   ", --dtype says " + moe_ep::dtype_name(p.dtype));
    }
    p.dtype = file.dtype;
    p.batch_seed = file.seed;
    if (!o.seed_given && file.seed) p.seed = *file.seed;
    p.bs = split_tokens(file.tokens, file.tokens_per_rank, W);
    p.mask_dims = file.mask_dims;
    if (p.mask_dims > 0) {
      p.mask_desc = std::string(p.mask_dims == 1 ? "1-D" : "2-D") + " from the file";
    }
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
    p.mask_dims = o.mask == "entries" ? 2 : o.mask == "none" ? 0 : 1;
    p.mask_desc = o.mask == "prefix"    ? "prefix (1-D: the last quarter of each rank's tokens "
                                          "inactive)"
                  : o.mask == "entries" ? "entries (2-D: each entry inactive with probability 0.2)"
                  : o.mask == "bad-prefix"
                      ? "bad-prefix (test hook: 1-D {T, F, T, F, ...}, not a prefix)"
                      : "";
  }

  check_batch_split(o, p);

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
  shape.tp = p.T;
  shape.shared_ranks = p.S;
  shape.shared_experts = p.Ns;
  shape.special = p.Z + p.C + p.Q;
  shape.global_bs = o.global_bs.value_or(0);
  shape.quant = o.quant == "int8";
  shape.comm_quant = o.comm_quant == "int8";
  shape.mask_dims = p.mask_dims;
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
  const int64_t special = p.Z + p.C + p.Q;
  const std::string special_note =
      special > 0 ? "; ids over E + Z + C + Q = " + std::to_string(layer.experts + special) +
                        ", each special expert as likely as an average routed expert"
                  : "";
  if (!loaded) {
    if (p.kind == RoutingKind::kReal) {
      const std::string routing_file =
          o.routing_file.empty() ? default_routing_file() : o.routing_file;
      RealRoutingSource src{routing_file,
                            o.routing_model.empty() ? layer.routing_model : o.routing_model,
                            o.domain, o.layer};
      ExpertDistribution d =
          load_real_distribution(src, layer.experts, std::min(layer.top_k, layer.experts));
      p.real_p = std::move(d.p);
      // Special experts: each with the mean probability of a routed one (sum of p is 1).
      p.real_p.resize(static_cast<size_t>(layer.experts + special),
                      1.0 / static_cast<double>(layer.experts));
      p.routing_desc = d.description + " from " + routing_file + special_note;
    } else if (p.kind == RoutingKind::kGate) {
      p.routing_desc =
          "gate (router matrix Wr [H, E] from the seed, logits = x @ Wr, top-k)" + special_note;
    } else {
      p.routing_desc = "uniform (K distinct experts, each equally likely)" + special_note;
    }
  }

  // ---- redundant expert slots: replicas of the busiest experts ----------------------------
  if (p.R > 0) {
    std::vector<double> load;
    if (loaded) {
      // The file's own counts (every id in [0, E), masked or not).
      load.assign(static_cast<size_t>(layer.experts), 0.0);
      for (const int32_t e : p.file.expert_ids) {
        if (e >= 0 && e < layer.experts) load[static_cast<size_t>(e)] += 1;
      }
      p.redundant_desc = "the busiest by the loaded file's expert_ids counts";
    } else if (p.kind == RoutingKind::kReal) {
      load.assign(p.real_p.begin(), p.real_p.begin() + layer.experts);
      p.redundant_desc = "the busiest by the real routing's p_e";
    } else {
      p.redundant_desc = "experts 0, 1, ... (routing " + o.routing + " has no expected load)";
    }
    p.redundant = make_redundant(layer.experts, p.R, load);
    p.redundant_desc += "; an entry of a replicated expert goes to copy (global token) mod copies";
  } else {
    p.redundant = make_redundant(layer.experts, 0, {});
  }

  // ---- what the seed does -------------------------------------------------------------------
  const std::string seed = std::to_string(p.seed);
  const bool seeded = p.fn == ExpertFn::kSwiglu || p.Q > 0;
  if (!loaded) {
    p.seed_desc = "seed " + seed;
  } else if (!seeded) {
    p.seed_desc = std::string("seed not used (x and routing come from the file; expert-fn ") +
                  expert_fn_name(p.fn) + " has no weights)";
  } else {
    const std::string saved =
        p.file.seed ? "saved with seed " + std::to_string(*p.file.seed) : "saved without a seed";
    p.seed_desc = "seed " + seed + " (" +
                  (o.seed_given  ? "--seed"
                   : p.file.seed ? "the file's"
                                 : "default") +
                  "; " +
                  (p.fn == ExpertFn::kSwiglu
                       ? (p.Q > 0 ? "expert weights and const experts" : "expert weights")
                       : "const experts") +
                  " only: x and routing come from the file, " + saved + ")";
  }
  return p;
}

// (count, H) values of const expert tables in dtype: alpha_1 (j = 0), alpha_2 (1), v (2).
std::vector<std::byte> const_table(uint64_t seed, int64_t count, int64_t hidden, int j,
                                   DType dtype) {
  std::vector<std::byte> t(static_cast<size_t>(count * hidden) * moe_ep::dtype_size(dtype));
  for (int64_t q = 0; q < count; ++q) {
    const Counter c(seed, Stream::kConstExpert, static_cast<uint64_t>(3 * q + j));
    for (int64_t h = 0; h < hidden; ++h)
      moe_ep::store_float(dtype, t.data(), q * hidden + h, c.uniform(h));
  }
  return t;
}

// This rank's generated x_active_mask (SPEC §1.3): 1-D (BS) or 2-D (BS, K) of 0/1.
std::vector<uint8_t> make_mask(const std::string& kind, uint64_t seed, int64_t first, int64_t BS,
                               int64_t K) {
  std::vector<uint8_t> m;
  if (kind == "prefix") {
    const int64_t inactive = (BS + 2) / 4;  // a quarter, rounded
    for (int64_t i = 0; i < BS; ++i) m.push_back(i < BS - inactive ? 1 : 0);
  } else if (kind == "bad-prefix") {
    for (int64_t i = 0; i < BS; ++i) m.push_back(i % 2 == 0 ? 1 : 0);
  } else if (kind == "entries") {
    for (int64_t i = 0; i < BS; ++i) {
      const Counter c(seed, Stream::kActiveMask, static_cast<uint64_t>(first + i));
      for (int64_t k = 0; k < K; ++k) m.push_back(c.unit(static_cast<uint64_t>(k)) >= 0.2 ? 1 : 0);
    }
  }
  return m;
}

// A communicator split from MPI_COMM_WORLD.
MPI_Comm split_world(int color, int key) {
  MPI_Comm c;
  MPI_Comm_split(MPI_COMM_WORLD, color, key, &c);
  return c;
}

}  // namespace

void print_threads_line() {
  std::printf(
      "  threads: %d per rank in moe-ep's parallel loops (by default each rank's share of its "
      "machine's CPUs; OMP_NUM_THREADS chooses)\n",
      moe_ep::num_threads());
}

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
  g_wait_timeout_s = env.timeout_s;
  agree_on_error(env.error, rank, "checking the environment");

  // The EP and TP groups (created first, collectively, so that their deadline also bounds the
  // tool's own waits). As in Ascend's example: EP group i = {x T + i}, TP group i = {T i + x}.
  const int T = static_cast<int>(o.tp);
  std::shared_ptr<moe_ep::Communicator> comm, comm_tp;
  if (T == 1) {
    comm = moe_ep::Communicator::from_mpi(MPI_COMM_WORLD, {o.timeout_s});
  } else {
    MPI_Comm ep = split_world(rank % T, rank / T), tp = split_world(rank / T, rank % T);
    comm = moe_ep::Communicator::from_mpi(ep, {o.timeout_s});
    comm_tp = moe_ep::Communicator::from_mpi(tp, {o.timeout_s});
    MPI_Comm_free(&ep);
    MPI_Comm_free(&tp);
  }
  g_wait_timeout_s = comm->timeout_s();

  const std::vector<int> node_ranks = ranks_on_this_machine(rank);
  Plan plan;
  std::exception_ptr setup_error;
  try {
    plan = plan_run(o, rank, W, node_ranks);
  } catch (...) {
    setup_error = std::current_exception();
  }
  agree_on_error(setup_error, rank, "before the run");

  const bool loaded = !o.load_routing.empty();
  const Preset& layer = plan.layer;
  const DType dtype = plan.dtype;
  const ExpertFn fn = plan.fn;
  const uint64_t seed = plan.seed;
  const std::vector<int64_t>& bs = plan.bs;
  Batch& file = plan.file;
  const int64_t H = layer.hidden, E = layer.experts, K = layer.top_k, L = plan.L;
  const int64_t Wep = plan.Wep, S = plan.S, Ns = plan.Ns, Z = plan.Z, C = plan.C, Q = plan.Q;
  const int64_t R = plan.R;  // redundant slots: the library sees E + R routed experts
  const RedundantExperts& redundant = plan.redundant;
  const int64_t ep_rank = rank / T, tp_rank = rank % T;
  const bool shared_rank = ep_rank < S;
  const bool shared_local = S == 0 && Ns > 0;  // shared_expert_x
  const int64_t per_shared = S > 0 ? S / Ns : 1;
  const bool quant = o.quant == "int8", comm_quant = o.comm_quant == "int8";
  const int mask_dims = plan.mask_dims;
  const int64_t N = std::accumulate(bs.begin(), bs.end(), int64_t{0});
  const int64_t BS = bs[rank];
  const int64_t first = std::accumulate(bs.begin(), bs.begin() + rank, int64_t{0});
  const int64_t max_bs = *std::max_element(bs.begin(), bs.end());
  const bool uneven = std::any_of(bs.begin(), bs.end(), [&](int64_t n) { return n != bs[0]; });
  const int64_t global_bs = o.global_bs ? *o.global_bs : uneven ? Wep * max_bs : 0;
  const size_t es = moe_ep::dtype_size(dtype);
  const size_t row_bytes = static_cast<size_t>(H) * es;

  if (rank == 0) {
    const std::string redundant_words = R > 0 ? " (+" + std::to_string(R) + " redundant slot" +
                                                    (R > 1 ? "s" : "") + ": " +
                                                    redundant.describe() + ")"
                                              : std::string();
    std::printf(
        "moe-ep run: preset %s  H %lld  E %lld%s  K %lld  FFN %lld  dtype %s  expert-fn %s"
        "  W %lld",
        layer.name.c_str(), static_cast<long long>(H), static_cast<long long>(E),
        redundant_words.c_str(), static_cast<long long>(K), static_cast<long long>(layer.ffn),
        moe_ep::dtype_name(dtype), expert_fn_name(fn), static_cast<long long>(W));
    if (T > 1) {
      std::printf(" (EP %lld x TP %d)", static_cast<long long>(Wep), T);
    }
    if (Ns > 0) {
      std::printf(
          "  shared %lld on %s", static_cast<long long>(Ns),
          S > 0 ? (std::to_string(S) + " rank" + (S > 1 ? "s" : "")).c_str() : "every rank");
    }
    if (Z + C + Q > 0) {
      std::printf("  zero/copy/const %lld/%lld/%lld", static_cast<long long>(Z),
                  static_cast<long long>(C), static_cast<long long>(Q));
    }
    if (quant) std::printf("  quant int8");
    if (comm_quant) std::printf("  comm-quant int8");
    if (mask_dims > 0) {
      std::printf("  mask %s", loaded ? (mask_dims == 1 ? "1-D" : "2-D") : o.mask.c_str());
    }
    if (o.global_bs) std::printf("  global_bs %lld", static_cast<long long>(global_bs));
    std::printf("  tokens/rank ");
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
    print_threads_line();
    std::string placement;
    if (S > 0) {
      placement = std::to_string(S) + " shared-expert rank" + (S > 1 ? "s" : "") + " [0, " +
                  std::to_string(S) + ") (shared expert s on ranks [s x " +
                  std::to_string(per_shared) + ", (s + 1) x " + std::to_string(per_shared) +
                  ")), then ";
    }
    if (R > 0) {
      placement += std::to_string(L) + (L == 1 ? " expert slot" : " expert slots") +
                   " per rank (moe_expert_num = E + R = " + std::to_string(E + R) +
                   "; slot p on rank " + (S > 0 ? std::to_string(S) + " + " : std::string()) +
                   "p / " + std::to_string(L) + "; slot p < " + std::to_string(E) +
                   " holds expert p, slots [" + std::to_string(E) + ", " + std::to_string(E + R) +
                   ") " + redundant.describe() + ": " + plan.redundant_desc +
                   "; special expert ids shifted by R)";
    } else {
      placement +=
          std::to_string(L) + (L == 1 ? " expert" : " experts") + " per rank (expert e on rank " +
          (S > 0 ? std::to_string(S) + " + " : std::string()) + "e / " + std::to_string(L) + ")";
    }
    if (shared_local) placement += "; the shared expert on every rank (shared_expert_x)";
    if (T > 1) {
      placement +=
          "; world rank r = EP rank r / 2, TP rank r % 2; each TP rank computes half "
          "of every expert (" +
          std::string(fn == ExpertFn::kSwiglu ? "FFN split in halves"
                                              : "TP rank 0 the value, rank 1 zeros") +
          ")";
    }
    if (uneven && !o.global_bs) placement += ", global_bs = W_ep x max tokens per rank";
    std::printf("  placement: %s\n", placement.c_str());
    if (mask_dims > 0) std::printf("  x_active_mask: %s\n", plan.mask_desc.c_str());
    std::fflush(stdout);
  }

  std::vector<std::byte> x;
  std::vector<int32_t> ids(static_cast<size_t>(BS * K));
  std::vector<float> scales(static_cast<size_t>(BS * K));
  std::vector<uint8_t> mask;
  double route_s = 0;
  const int64_t mask_row = mask_dims == 2 ? K : 1;
  if (loaded) {
    x.assign(file.x.begin() + static_cast<std::ptrdiff_t>(first * row_bytes),
             file.x.begin() + static_cast<std::ptrdiff_t>((first + BS) * row_bytes));
    std::copy_n(file.expert_ids.begin() + first * K, BS * K, ids.begin());
    std::copy_n(file.expert_scales.begin() + first * K, BS * K, scales.begin());
    if (mask_dims > 0) {
      mask.assign(file.x_active_mask.begin() + first * mask_row,
                  file.x_active_mask.begin() + (first + BS) * mask_row);
    }
    file = Batch{};
  } else {
    x = make_tokens(seed, first, BS, H, dtype);
    Preset router_layer = layer;
    router_layer.experts = E + Z + C + Q;
    const Router router(router_layer, plan.kind, seed, std::move(plan.real_p));
    const double t0 = now_s();
    router.route(first, BS, x.data(), dtype, ids.data(), scales.data());
    route_s = now_s() - t0;
    mask = make_mask(o.mask, seed, first, BS, K);
  }
  const std::vector<std::byte> alpha_1 = const_table(seed, Q, H, 0, dtype),
                               alpha_2 = const_table(seed, Q, H, 1, dtype),
                               const_v = const_table(seed, Q, H, 2, dtype);

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
  global.mask_dims = mask_dims;
  if (mask_dims > 0) global.x_active_mask = gather_values(mask, rank, world);
  global.metadata = {{"moe_expert_num", std::to_string(E)},
                     {"zero_expert_num", std::to_string(Z)},
                     {"copy_expert_num", std::to_string(C)},
                     {"const_expert_num", std::to_string(Q)},
                     {"preset", layer.name},
                     {"routing", plan.routing_desc}};
  if (mask_dims > 0) global.metadata["mask"] = plan.mask_desc;
  if (plan.batch_seed) global.metadata["seed"] = std::to_string(*plan.batch_seed);
  if (!o.save_routing.empty()) {  // the same on every rank: all take part in the agreement
    on_rank_0(rank, "saving the routing", [&] {
      with_flag("--save-routing", [&] { save_routing(o.save_routing, global); });
      std::printf("  routing saved to %s\n", o.save_routing.c_str());
      std::fflush(stdout);
    });
  }

  // The library's ids: physical slots (redundant.h); `ids` and the gathered batch (saved,
  // and the reference's input) keep the logical ids.
  std::vector<int32_t> slot_ids(ids.size());
  redundant.map_rows(ids.data(), slot_ids.data(), first, BS, K);
  if (rank == 0 && R > 0) {
    // How the replicated experts' entries were split over their slots (active entries).
    std::map<int32_t, std::map<int32_t, int64_t>> used;
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = global.expert_ids[i * K + k];
        const bool active =
            mask_dims == 0 || global.x_active_mask[i * mask_row + (mask_dims == 2 ? k : 0)];
        if (active && redundant.copies.count(e)) ++used[e][redundant.physical(e, i)];
      }
    }
    std::string words;
    size_t shown = 0;
    for (const auto& [e, copies] : redundant.copies) {
      if (shown++ == 8) {
        words += "; ...";
        break;
      }
      std::string slots_words, rows_words;
      for (const int32_t slot : copies) {
        if (!slots_words.empty()) {
          slots_words += '/';
          rows_words += '/';
        }
        const auto it = used[e].find(slot);
        slots_words += std::to_string(slot);
        rows_words += std::to_string(it == used[e].end() ? 0 : it->second);
      }
      words += (words.empty() ? "" : "; ") + std::string("expert ") + std::to_string(e) +
               " on slots " + slots_words + ": " + rows_words + " rows";
    }
    std::printf("  redundant slots used (rows per slot, original first): %s\n", words.c_str());
    std::fflush(stdout);
  }

  // ---- dispatch_v2 -------------------------------------------------------------------------
  moe_ep::EpConfig cfg;
  cfg.group_ep = comm.get();
  cfg.ep_world_size = Wep;
  cfg.ep_rank_id = ep_rank;
  cfg.moe_expert_num = E + R;
  if (T > 1) {
    cfg.group_tp = comm_tp.get();
    cfg.tp_world_size = T;
    cfg.tp_rank_id = tp_rank;
  }
  cfg.shared_expert_num = Ns;
  cfg.shared_expert_rank_num = S;
  cfg.global_bs = global_bs;
  cfg.zero_expert_num = Z;
  cfg.copy_expert_num = C;
  cfg.const_expert_num = Q;
  cfg.transport = o.transport;
  moe_ep::DispatchInputs din;
  din.x = moe_ep::TensorView::contiguous(x.data(), dtype, {BS, H});
  din.expert_ids = moe_ep::TensorView::contiguous(slot_ids.data(), DType::kI32, {BS, K});
  din.expert_scales = moe_ep::TensorView::contiguous(scales.data(), DType::kF32, {BS, K});
  std::optional<moe_ep::TensorView> mask_view;
  if (mask_dims == 1) {
    mask_view = moe_ep::TensorView::contiguous(mask.data(), DType::kBool, {BS});
  } else if (mask_dims == 2) {
    mask_view = moe_ep::TensorView::contiguous(mask.data(), DType::kBool, {BS, K});
  }
  din.x_active_mask = mask_view;
  din.quant_mode = quant ? 2 : 0;
  barrier_idle();
  MPI_Barrier(MPI_COMM_WORLD);
  double t0 = now_s();
  moe_ep::DispatchOutputs d = with_file_rows([&] { return moe_ep::dispatch_v2(din, cfg); });
  const double dispatch_s = now_s() - t0;

  // ---- the local experts -------------------------------------------------------------------
  // Row segments of expand_x and their expert (the logical id of a routed slot, or E + s for
  // shared expert s; so a replica computes exactly its expert): this
  // rank's blocks (SPEC §1.4 order), then with TP the peer's rows (L = 1: the same expert).
  const int64_t Lr = shared_rank ? 1 : L;
  const int32_t* recv = d.ep_recv_counts.ptr<int32_t>();
  struct Segment {
    int64_t begin, end, expert;
  };
  std::vector<Segment> segments;
  const int64_t own_rows = Wep * Lr > 0 ? recv[Wep * Lr - 1] : 0;
  for (int64_t j = 0; j < Lr; ++j) {
    const int64_t begin = j == 0 ? 0 : recv[j * Wep - 1];
    const int64_t end = recv[(j + 1) * Wep - 1];
    const int64_t expert =
        shared_rank ? E + ep_rank / per_shared : redundant.logical((ep_rank - S) * L + j);
    segments.push_back({begin, end, expert});
  }
  int64_t valid = own_rows;
  if (T > 1) {
    const int64_t peer_rows = d.tp_recv_counts.ptr<int32_t>()[1 - tp_rank];
    segments.push_back({own_rows, own_rows + peer_rows, segments.front().expert});
    valid += peer_rows;
  }
  moe_ep::Tensor expert_out = moe_ep::Tensor::zeros(dtype, {d.expand_x.size(0), H});
  ExpertBank bank(fn, seed, E, H, layer.ffn, tp_rank, T);
  ExpertBank shared_bank(fn, seed, E, H, layer.ffn);
  std::vector<float> deq;
  t0 = now_s();
  for (const Segment& sg : segments) {
    const int64_t rows = sg.end - sg.begin;
    if (rows <= 0) continue;
    std::byte* out = static_cast<std::byte*>(expert_out.data()) + sg.begin * row_bytes;
    if (quant) {
      // The experts read the dequantised rows: fp32(q) * dynamic_scales[row].
      const int8_t* q = d.expand_x.ptr<int8_t>() + sg.begin * H;
      const float* dyn = d.dynamic_scales.ptr<float>() + sg.begin;
      deq.resize(static_cast<size_t>(rows * H));
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t h = 0; h < H; ++h) deq[r * H + h] = static_cast<float>(q[r * H + h]) * dyn[r];
      }
      bank.forward(sg.expert, deq.data(), DType::kF32, out, dtype, rows);
    } else {
      bank.forward(sg.expert,
                   static_cast<const std::byte*>(d.expand_x.data()) + sg.begin * row_bytes, dtype,
                   out, dtype, rows);
    }
  }
  std::vector<std::byte> shared_x;
  if (shared_local) {
    shared_x.resize(static_cast<size_t>(BS) * row_bytes);
    shared_bank.forward(E, x.data(), dtype, shared_x.data(), dtype, BS);
  }
  const double generate_s = bank.generate_seconds() + shared_bank.generate_seconds();
  const double experts_s = now_s() - t0 - generate_s;

  // ---- combine_v2 --------------------------------------------------------------------------
  moe_ep::CombineInputs cin;
  cin.expand_x = expert_out;
  cin.expert_ids = din.expert_ids;
  cin.assist_info_for_combine = d.assist_info_for_combine;
  cin.ep_send_counts = d.ep_recv_counts;
  cin.expert_scales = *din.expert_scales;
  if (T > 1) cin.tp_send_counts = d.tp_recv_counts;
  cin.x_active_mask = mask_view;
  if (shared_local) {
    cin.shared_expert_x = moe_ep::TensorView::contiguous(shared_x.data(), dtype, {BS, H});
  }
  if ((C > 0 || Q > 0) && !o.debug_omit_ori_x) cin.ori_x = din.x;
  if (Q > 0) {
    auto table = [&](const std::vector<std::byte>& t) {
      return moe_ep::TensorView::contiguous(const_cast<std::byte*>(t.data()), dtype, {Q, H});
    };
    cin.const_expert_alpha_1 = table(alpha_1);
    cin.const_expert_alpha_2 = table(alpha_2);
    cin.const_expert_v = table(const_v);
  }
  cin.comm_quant_mode = comm_quant ? 2 : 0;
  barrier_idle();
  MPI_Barrier(MPI_COMM_WORLD);
  t0 = now_s();
  moe_ep::Tensor out = with_file_rows([&] { return moe_ep::combine_v2(cin, cfg); });
  const double combine_s = now_s() - t0;

  // ---- statistics --------------------------------------------------------------------------
  RankStats mine{route_s, dispatch_s, experts_s, generate_s, combine_s, static_cast<double>(valid),
                 0,       0};
  for (int64_t i = 0; i < BS; ++i) {
    bool any = false;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = slot_ids[i * K + k];
      const bool active =
          e >= 0 && (mask_dims == 0 || mask[i * mask_row + (mask_dims == 2 ? k : 0)]);
      if (!active) continue;
      any = true;
      if (e < E + R && S + e / L != ep_rank) mine.sent_other_rows += 1;
    }
    for (int64_t s = 0; any && S > 0 && s < Ns; ++s) {
      if (ep_rank % per_shared + s * per_shared != ep_rank) mine.sent_other_rows += 1;
    }
  }
  for (int64_t j = 0; j < Lr; ++j) {
    for (int64_t s = 0; s < Wep; ++s) {
      const int64_t b = j * Wep + s;
      if (s != ep_rank) mine.received_other_rows += recv[b] - (b == 0 ? 0 : recv[b - 1]);
    }
  }
  constexpr int kStats = sizeof(RankStats) / sizeof(double);
  std::vector<RankStats> all(rank == 0 ? W : 0);
  MPI_Gather(&mine, kStats, MPI_DOUBLE, all.data(), kStats, MPI_DOUBLE, 0, MPI_COMM_WORLD);

  const std::vector<std::byte> output = gather_bytes(out.data(), out.nbytes(), rank, world);

  // Rank 0 reports, saves the output and checks it; a failure there (say a full disk under
  // --save-output) is agreed on by every rank instead of leaving them in the result broadcast.
  int result = 1;
  on_rank_0(rank, "writing the results", [&] {
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
        "tokens received per rank (dispatch valid rows%s): min %.0f  mean %.1f  max %.0f"
        "  imbalance max/mean %s\n",
        T > 1 ? ", with the TP peer's" : "", rmin, rmean, rmax,
        rmean > 0 ? fmt("%.3f", rmax / rmean).c_str() : "n/a");
    std::printf(
        "time per phase, ms (max over ranks): route %.3f  dispatch %.3f  experts %.3f  "
        "combine %.3f  (expert weight generation %.1f ms, not counted)\n",
        1e3 * max_of(&RankStats::route_s), 1e3 * max_of(&RankStats::dispatch_s),
        1e3 * max_of(&RankStats::experts_s), 1e3 * max_of(&RankStats::combine_s),
        1e3 * max_of(&RankStats::generate_s));
    // Bytes of one row on the wire: int8 values and an fp32 scale when quantised.
    const double dispatch_row = quant ? static_cast<double>(H) + 4 : static_cast<double>(row_bytes);
    const double combine_row =
        comm_quant ? static_cast<double>(H) + 4 : static_cast<double>(row_bytes);
    const double rows_per_rank = cross / static_cast<double>(W);
    if (cross > 0) {
      std::printf(
          "bandwidth: dispatch %.3f GB/s  combine %.3f GB/s  (bytes per rank = rows sent "
          "to other EP ranks x %s B per row (dispatch) / %s B (combine), self-traffic%s "
          "excluded, mean over ranks = %.3f / %.3f MB; combine sends the same rows back; "
          "time = max over ranks)\n",
          rows_per_rank * dispatch_row / max_of(&RankStats::dispatch_s) / 1e9,
          rows_per_rank * combine_row / max_of(&RankStats::combine_s) / 1e9,
          fmt("%.0f", dispatch_row).c_str(), fmt("%.0f", combine_row).c_str(),
          T > 1 ? " and TP traffic" : "", rows_per_rank * dispatch_row / 1e6,
          rows_per_rank * combine_row / 1e6);
    } else {
      std::printf("bandwidth: n/a (no rows travel between EP ranks)\n");
    }

    if (!o.save_output.empty()) {
      with_flag("--save-output", [&] { save_output(o.save_output, output, N, H, dtype); });
      std::printf("output saved to %s\n", o.save_output.c_str());
    }
    ExpertBank ref_bank(fn, seed, E, H, layer.ffn);
    LayerSpec spec;
    spec.experts = E;
    spec.zero = Z;
    spec.copy = C;
    spec.constant = Q;
    spec.shared = Ns;
    spec.alpha_1 = alpha_1;
    spec.alpha_2 = alpha_2;
    spec.const_v = const_v;
    spec.quant = quant;
    spec.comm_quant = comm_quant;
    spec.shared_local = shared_local;
    const Reference ref = dense_reference(global, spec, fn, ref_bank);
    const CheckResult c = compare_outputs(output, ref, dtype, fn);
    const std::string nan_note =
        c.nans > 0 ? " (" + std::to_string(c.nans) + " of them NaN)" : std::string();
    if (c.exact) {
      std::printf(
          "check vs dense single-process reference (SPEC §2.3): %s (%lld of %lld "
          "elements differ%s; max abs err %.3g); rule: %s\n",
          c.mismatches == 0 && c.pass ? "exact" : "NOT exact", static_cast<long long>(c.mismatches),
          static_cast<long long>(N * H), nan_note.c_str(), c.max_abs, c.rule.c_str());
    } else if (c.bounded) {
      std::printf(
          "check vs dense single-process reference (SPEC §2.2, §2.3) within the int8 bound: "
          "%lld of %lld elements over the bound%s, max |err| / bound %.3g, max abs err %.3g "
          "(max|ref| %.3g), %lld elements not bitwise equal; rule: %s\n",
          static_cast<long long>(c.over_bound), static_cast<long long>(N * H), nan_note.c_str(),
          c.max_ratio, c.max_abs, c.max_ref, static_cast<long long>(c.mismatches), c.rule.c_str());
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
  });
  MPI_Request request;
  MPI_Ibcast(&result, 1, MPI_INT, 0, MPI_COMM_WORLD, &request);
  wait_idle(&request);
  return result;
}

}  // namespace moe_ep_tool
