#include "bench.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <thread>

#include "batch.h"
#include "checks.h"
#include "experts.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "moe_ep/permute.h"
#include "moe_ep/threads.h"
#include "numeric.h"
#include "presets.h"
#include "reference.h"
#include "routing.h"
#include "run.h"

namespace moe_ep_tool {

using moe_ep::DType;
using moe_ep::Error;
using moe_ep::ErrorKind;
using moe_ep::Tensor;
using moe_ep::TensorView;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// The target configuration (issue 6): DeepSeek-V3's hidden size with OLMoE's 64 experts
// and top-8, 512 tokens per rank, W = 2.
constexpr int64_t kTargetHidden = 7168;
constexpr int64_t kTargetTokens = 512;
// Targets: moe-ep at least 1.0x the bare MPI_Alltoallv and 2x the textbook pipeline; int8
// dispatch "moves about half the bytes and its time drops accordingly": at most this fraction
// of the bf16 dispatch time (half, plus slack for the per-row scale and the quantisation pass).
constexpr double kTargetVsAlltoallv = 1.0;
constexpr double kTargetVsTextbook = 2.0;
constexpr double kTargetInt8Time = 0.6;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string fmt(const char* format, double a) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, a);
  return buf;
}

// The deadline of the benchmark's own blocking MPI calls (barriers, the baselines' collectives,
// gathers): they have no timeout of their own, so a thread watches them and ends the process
// (mpirun then ends the job) when one takes longer than --timeout. moe-ep's ops have their own.
class Watchdog {
 public:
  Watchdog(double timeout_s, int rank) : timeout_s_(timeout_s), rank_(rank) {
    thread_ = std::thread([this] { loop(); });
  }
  ~Watchdog() {
    stop_ = true;
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // `phase` must outlive the wait (a string literal).
  void arm(const char* phase) {
    phase_ = phase;
    deadline_ = now_s() + timeout_s_;
  }
  void disarm() { deadline_ = 0; }

 private:
  void loop() {
    while (!stop_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      const double d = deadline_;
      if (d > 0 && now_s() > d) {
        std::fprintf(stderr,
                     "moe-ep: error: Timeout: moe-ep bench: rank %d waited more than %g s in %s "
                     "(another rank failed or stopped; --timeout); ending the job\n",
                     rank_, timeout_s_, phase_.load());
        std::fflush(stderr);
        std::_Exit(3);
      }
    }
  }

  double timeout_s_;
  int rank_;
  std::atomic<double> deadline_{0};
  std::atomic<const char*> phase_{""};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Runs f with the watchdog armed.
template <typename F>
void guarded(Watchdog& dog, const char* phase, F&& f) {
  dog.arm(phase);
  f();
  dog.disarm();
}

// An owned MPI datatype of `bytes` contiguous bytes (one row).
class RowType {
 public:
  explicit RowType(int64_t bytes) {
    MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &t_);
    MPI_Type_commit(&t_);
  }
  ~RowType() {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Type_free(&t_);
  }
  RowType(const RowType&) = delete;
  RowType& operator=(const RowType&) = delete;
  MPI_Datatype get() const { return t_; }

 private:
  MPI_Datatype t_ = MPI_DATATYPE_NULL;
};

// The transport the ops use, as printed: --transport, else $MOE_EP_TRANSPORT, else shm (the
// library's own rule, EpConfig::transport).
std::string transport_name(const std::string& flag) {
  if (!flag.empty()) return flag;
  const char* env = std::getenv("MOE_EP_TRANSPORT");
  return env != nullptr && *env != '\0' ? std::string(env) + " ($MOE_EP_TRANSPORT)" : "shm";
}

// The one place the benchmark builds its EpConfig.
moe_ep::EpConfig make_ep_config(const BenchOptions& options, moe_ep::Communicator& comm,
                                int64_t experts) {
  moe_ep::EpConfig cfg;
  cfg.group_ep = &comm;
  cfg.ep_world_size = comm.size();
  cfg.ep_rank_id = comm.rank();
  cfg.moe_expert_num = experts;
  cfg.shared_expert_num = 0;  // routed experts only (SPEC §1.3: (Ns, S) = (0, 0))
  cfg.transport = options.transport;
  return cfg;
}

// Collective. Every rank learns whether any failed in a local step (`when`: "before the run",
// "writing the results"): the lowest failed rank rethrows its error, the others throw kRemote
// naming it (main prints only the former), and no rank is left waiting for one that is
// unwinding.
void agree_on_error(const std::exception_ptr& error, int rank, Watchdog& dog, const char* when) {
  int mine = error ? rank : INT_MAX, lowest = INT_MAX;
  guarded(dog, "the error agreement",
          [&] { MPI_Allreduce(&mine, &lowest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD); });
  if (lowest == INT_MAX) return;
  if (rank == lowest) std::rethrow_exception(error);
  throw Error(ErrorKind::kRemote, "moe-ep bench: rank " + std::to_string(lowest) + " failed " +
                                      when + " (its message says why)");
}

// Everything fixed for the whole sweep.
struct Setup {
  Preset layer;
  DType dtype = DType::kBF16;
  RoutingKind kind = RoutingKind::kReal;
  std::vector<double> real_p;
  std::string routing_desc;
  int64_t W = 1, rank = 0, L = 1;
  bool gnuplot = false;
};

Setup plan_bench(const BenchOptions& o, int64_t W, int64_t rank, int node_ranks) {
  Setup s;
  const Preset* p = find_preset(o.preset);
  if (p == nullptr) {
    throw Error(ErrorKind::kInvalidArgument, "moe-ep bench: unknown preset '" + o.preset + "'");
  }
  s.layer = *p;
  s.layer.hidden = o.hidden.value_or(o.preset_given ? p->hidden : kTargetHidden);
  if (o.experts) s.layer.experts = *o.experts;
  if (o.top_k) s.layer.top_k = *o.top_k;
  s.layer.shared_experts = 0;
  s.dtype = parse_float_dtype(o.dtype);
  s.kind = o.routing == "gate"      ? RoutingKind::kGate
           : o.routing == "uniform" ? RoutingKind::kUniform
                                    : RoutingKind::kReal;
  s.W = W;
  s.rank = rank;
  const int64_t E = s.layer.experts, K = s.layer.top_k, H = s.layer.hidden;
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
  s.L = E / W;
  // Sizes: one MPI message count (int) per rank and row, and the memory of the largest point.
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
  // Per rank: every rank's tokens (verification), dispatch's A = W x BS x min(L, K) rows twice
  // (expand_x and the expert outputs) plus the int8 copy, and about eight (BS x K)-row buffers
  // (permute, the baselines' send/receive buffers, the combine buffers).
  // Per expert: dispatch_v2's counts and offsets and the router's tables (checks.h).
  const double A = static_cast<double>(W * max_bs) * static_cast<double>(std::min(s.L, K));
  const double rows_need =
      row * (static_cast<double>(W * max_bs) + 2.5 * A + 8 * entries) + 4 * A * 128;
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
  if (s.kind == RoutingKind::kReal) {
    const std::string file = o.routing_file.empty() ? default_routing_file() : o.routing_file;
    RealRoutingSource src{file, o.routing_model.empty() ? s.layer.routing_model : o.routing_model,
                          o.domain, o.layer};
    ExpertDistribution d = load_real_distribution(src, E, K);
    s.real_p = std::move(d.p);
    s.routing_desc = d.description + " from " + file;
  } else if (s.kind == RoutingKind::kGate) {
    s.routing_desc = "gate (router matrix Wr [H, E] from the seed, logits = x @ Wr, top-k)";
  } else {
    s.routing_desc = "uniform (K distinct experts, each equally likely)";
  }
  if (rank == 0) {
    // check_writable speaks for `moe-ep run`; the message names the flag and the file.
    auto writable = [](const char* flag, const std::string& path) {
      try {
        check_writable(flag, path);
      } catch (const Error& e) {
        std::string m = e.what();
        if (m.rfind("moe-ep run: ", 0) == 0) m = "moe-ep bench: " + m.substr(12);
        throw Error(e.kind(), m);
      }
    };
    if (!o.csv.empty()) writable("--csv", o.csv);
    if (!o.json.empty()) writable("--json", o.json);
    if (!o.plot.empty()) writable("--plot", o.plot);
  }
  return s;
}

// One point of the sweep: this rank's batch, every rank's routing and the traffic it implies.
struct Point {
  int64_t BS = 0, H = 0, K = 0, E = 0, L = 1, W = 1, rank = 0;
  DType dtype = DType::kBF16;
  int64_t row_bytes = 0;
  std::vector<std::byte> x_all;     // (W x BS, H): every rank's tokens, global token order
  std::vector<int32_t> ids_all;     // (W x BS, K): every rank's expert_ids
  std::vector<float> scales;        // (BS, K): this rank's expert_scales
  std::vector<int32_t> recv_block;  // (W x L): [s L + l] = rows source s sends local expert l
  std::vector<int> send_rows, send_displ, recv_rows, recv_displ;  // rows per peer
  std::vector<int64_t> order;  // this rank's entries i K + k, stably sorted by expert
  int64_t valid = 0;           // rows dispatch delivers here
  int64_t other_send = 0;      // rows sent to other ranks (dispatch)
  int64_t other_recv = 0;      // rows received from other ranks (combine sends them back)

  const std::byte* x() const { return x_all.data() + rank * BS * row_bytes; }
  const int32_t* ids() const { return ids_all.data() + rank * BS * K; }
  TensorView x_view() const {
    return TensorView::contiguous(const_cast<std::byte*>(x()), dtype, {BS, H});
  }
  TensorView ids_view() const {
    return TensorView::contiguous(const_cast<int32_t*>(ids()), DType::kI32, {BS, K});
  }
  TensorView scales_view() const {
    return TensorView::contiguous(const_cast<float*>(scales.data()), DType::kF32, {BS, K});
  }
};

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
  // x of every rank is a function of (seed, global token index): generated here, not sent.
  p.x_all = make_tokens(o.seed, 0, W * BS, p.H, p.dtype);
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

// The textbook pipeline, written as a user would (Megatron-LM's alltoall token dispatcher):
// dispatch = permute (moe_ep::permute: sort the (token, k) copies by expert) -> MPI_Alltoall of
// the per-expert counts -> MPI_Alltoallv of the rows -> regroup the received (source, local
// expert) chunks by local expert (Megatron's sort_chunks_by_idxs); combine = regroup back ->
// MPI_Alltoallv -> unpermute with the top-k weights (moe_ep::unpermute: the weighted sum). Its
// buffers are allocated once per point (as a caching allocator would), the permute/unpermute
// outputs by those ops.
class Textbook {
 public:
  Textbook(const Point& p, MPI_Datatype row) : p_(p), row_(row) {
    per_expert_.assign(static_cast<size_t>(p.E), 0);
    recv_block_.assign(static_cast<size_t>(p.W * p.L), 0);
    block_at_.assign(static_cast<size_t>(p.W * p.L), 0);
    send_counts_.assign(p.W, 0);
    send_displs_.assign(p.W, 0);
    recv_counts_.assign(p.W, 0);
    recv_displs_.assign(p.W, 0);
    recv_.resize(static_cast<size_t>(p.valid * p.row_bytes));
    expand_.resize(recv_.size());
    back_send_.resize(recv_.size());
    back_recv_.resize(static_cast<size_t>(p.BS * p.K * p.row_bytes));
  }

  void dispatch(const TensorView& x, const TensorView& ids) {
    const int64_t W = p_.W, L = p_.L, rb = p_.row_bytes;
    moe_ep::PermuteResult perm =
        moe_ep::permute({.tokens = x, .indices = ids, .num_out_tokens = {}, .padded_mode = false});
    std::fill(per_expert_.begin(), per_expert_.end(), 0);
    const int32_t* id = ids.ptr<int32_t>();
    for (int64_t j = 0; j < ids.numel(); ++j) ++per_expert_[id[j]];
    MPI_Alltoall(per_expert_.data(), static_cast<int>(L), MPI_INT32_T, recv_block_.data(),
                 static_cast<int>(L), MPI_INT32_T, MPI_COMM_WORLD);
    int64_t sent = 0, got = 0;
    for (int64_t d = 0; d < W; ++d) {
      send_counts_[d] = recv_counts_[d] = 0;
      for (int64_t l = 0; l < L; ++l) {
        send_counts_[d] += per_expert_[d * L + l];
        block_at_[d * L + l] = got + recv_counts_[d];
        recv_counts_[d] += recv_block_[d * L + l];
      }
      send_displs_[d] = static_cast<int>(sent);
      recv_displs_[d] = static_cast<int>(got);
      sent += send_counts_[d];
      got += recv_counts_[d];
    }
    valid_ = got;
    if (static_cast<size_t>(got * rb) > recv_.size()) {
      recv_.resize(static_cast<size_t>(got * rb));
      expand_.resize(recv_.size());
      back_send_.resize(recv_.size());
    }
    MPI_Alltoallv(perm.permuted_tokens.data(), send_counts_.data(), send_displs_.data(), row_,
                  recv_.data(), recv_counts_.data(), recv_displs_.data(), row_, MPI_COMM_WORLD);
    // (source, local expert) chunks -> (local expert, source): SPEC §1.4's order.
    int64_t out = 0;
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t s = 0; s < W; ++s) {
        const int64_t n = recv_block_[s * L + l];
        std::memcpy(expand_.data() + out * rb, recv_.data() + block_at_[s * L + l] * rb,
                    static_cast<size_t>(n * rb));
        out += n;
      }
    }
    sorted_indices_ = perm.sorted_indices;
  }

  // The rows dispatch delivered, grouped by local expert: (valid, H).
  std::byte* expand() { return expand_.data(); }
  int64_t valid() const { return valid_; }

  // y: the expert outputs in expand()'s layout, (valid, H).
  Tensor combine(const std::byte* y, const TensorView& probs) {
    const int64_t W = p_.W, L = p_.L, rb = p_.row_bytes;
    int64_t in = 0;
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t s = 0; s < W; ++s) {
        const int64_t n = recv_block_[s * L + l];
        std::memcpy(back_send_.data() + block_at_[s * L + l] * rb, y + in * rb,
                    static_cast<size_t>(n * rb));
        in += n;
      }
    }
    MPI_Alltoallv(back_send_.data(), recv_counts_.data(), recv_displs_.data(), row_,
                  back_recv_.data(), send_counts_.data(), send_displs_.data(), row_,
                  MPI_COMM_WORLD);
    const TensorView back =
        TensorView::contiguous(back_recv_.data(), p_.dtype, {p_.BS * p_.K, p_.H});
    return moe_ep::unpermute({.permuted_tokens = back,
                              .sorted_indices = sorted_indices_,
                              .probs = probs,
                              .padded_mode = false,
                              .restore_shape = {}});
  }

 private:
  const Point& p_;
  MPI_Datatype row_;
  std::vector<int32_t> per_expert_, recv_block_;
  std::vector<int64_t> block_at_;  // [s L + l]: first row of chunk (s, l) in recv_
  std::vector<int> send_counts_, send_displs_, recv_counts_, recv_displs_;
  std::vector<std::byte> recv_, expand_, back_send_, back_recv_;
  Tensor sorted_indices_;
  int64_t valid_ = 0;
};

// The bare MPI_Alltoallv: the rows dispatch moves (counts from the same routing, self included),
// pre-packed contiguously by destination, and the same rows back for combine. No routing, no
// layout: what MPI itself does with the payload.
class Alltoallv {
 public:
  // row_bytes: the payload of one row (H x dtype, or H + 4 for int8 and its scale). The send
  // buffer holds the rows of x in `order` (truncated or zero-padded to row_bytes).
  Alltoallv(const Point& p, int64_t row_bytes) : p_(p), type_(row_bytes) {
    const size_t rb = static_cast<size_t>(row_bytes);
    const size_t copy = std::min(rb, static_cast<size_t>(p.row_bytes));
    send_.assign(p.order.size() * rb, std::byte{0});
    for (size_t j = 0; j < p.order.size(); ++j) {
      std::memcpy(send_.data() + j * rb, p.x() + (p.order[j] / p.K) * p.row_bytes, copy);
    }
    recv_.assign(static_cast<size_t>(p.valid) * rb, std::byte{0});
    back_.assign(send_.size(), std::byte{0});
  }
  void dispatch() {
    MPI_Alltoallv(send_.data(), p_.send_rows.data(), p_.send_displ.data(), type_.get(),
                  recv_.data(), p_.recv_rows.data(), p_.recv_displ.data(), type_.get(),
                  MPI_COMM_WORLD);
  }
  void combine() {
    MPI_Alltoallv(recv_.data(), p_.recv_rows.data(), p_.recv_displ.data(), type_.get(),
                  back_.data(), p_.send_rows.data(), p_.send_displ.data(), type_.get(),
                  MPI_COMM_WORLD);
  }
  const std::vector<std::byte>& sent() const { return send_; }
  const std::vector<std::byte>& received() const { return recv_; }
  const std::vector<std::byte>& returned() const { return back_; }

 private:
  const Point& p_;
  RowType type_;
  std::vector<std::byte> send_, recv_, back_;
};

// ---- verification ------------------------------------------------------------------------------

enum Check {
  kCheckLayout,       // dispatch_v2 expand_x vs SPEC §1.4
  kCheckCombine,      // combine_v2 (scale experts) vs SPEC §2.3 reference
  kCheckTbDispatch,   // textbook expand vs moe-ep expand_x
  kCheckTbCombine,    // textbook combine vs moe-ep combine
  kCheckA2aDispatch,  // alltoallv blocks vs expand_x blocks
  kCheckA2aCombine,   // alltoallv round trip
  kCheckInt8,         // quant_mode 2 rows and scales vs SPEC §1.5
  kChecks,
};

struct Verification {
  int64_t failures[kChecks] = {};
  int64_t total[kChecks] = {};  // what each check compared (rows or elements), summed over ranks
};

// Bitwise, except that +0 and -0 are equal.
bool same_values(DType dtype, const void* a, const void* b, int64_t n, int64_t* first_bad) {
  const size_t es = moe_ep::dtype_size(dtype);
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(static_cast<const char*>(a) + i * es, static_cast<const char*>(b) + i * es,
                    es) == 0) {
      continue;
    }
    if (moe_ep::load_float(dtype, a, i) == 0.0f && moe_ep::load_float(dtype, b, i) == 0.0f)
      continue;
    *first_bad = i;
    return false;
  }
  return true;
}

void report_mismatch(int64_t rank, int64_t tokens, const std::string& what) {
  std::fprintf(stderr, "moe-ep bench: rank %lld, tokens/rank %lld: verification failed: %s\n",
               static_cast<long long>(rank), static_cast<long long>(tokens), what.c_str());
  std::fflush(stderr);
}

Verification verify(const BenchOptions& o, const Point& p, moe_ep::Communicator& comm, bool compare,
                    bool quant, Watchdog& dog) {
  Verification v;
  const int64_t W = p.W, L = p.L, K = p.K, BS = p.BS, H = p.H, rb = p.row_bytes, me = p.rank;
  const moe_ep::EpConfig cfg = make_ep_config(o, comm, p.E);
  auto fail = [&](Check c, int64_t count, const std::string& what) {
    if (v.failures[c] == 0) report_mismatch(me, BS, what);
    v.failures[c] += count;
  };

  // The SPEC §1.4 layout: by local expert, source rank, then the source's entry i K + k.
  std::vector<int64_t> expected;  // global token index of each expected row
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t s = 0; s < W; ++s) {
      for (int64_t j = 0; j < BS * K; ++j) {
        if (p.ids_all[s * BS * K + j] == me * L + l) expected.push_back(s * BS + j / K);
      }
    }
  }

  moe_ep::DispatchInputs din;
  din.x = p.x_view();
  din.expert_ids = p.ids_view();
  din.expert_scales = p.scales_view();
  const moe_ep::DispatchOutputs d = moe_ep::dispatch_v2(din, cfg);
  const int64_t valid = d.ep_recv_counts.ptr<int32_t>()[W * L - 1];
  const std::byte* ex = static_cast<const std::byte*>(d.expand_x.data());
  v.total[kCheckLayout] = static_cast<int64_t>(expected.size());
  if (valid != static_cast<int64_t>(expected.size()) || valid != p.valid) {
    fail(kCheckLayout, std::max<int64_t>(1, static_cast<int64_t>(expected.size())),
         "dispatch_v2 delivered " + std::to_string(valid) + " rows, SPEC §1.4 expects " +
             std::to_string(expected.size()));
  } else {
    for (int64_t j = 0; j < valid; ++j) {
      if (std::memcmp(ex + j * rb, p.x_all.data() + expected[j] * rb, static_cast<size_t>(rb))) {
        fail(kCheckLayout, 1,
             "dispatch_v2 expand_x row " + std::to_string(j) + " is not global token " +
                 std::to_string(expected[j]) + " (SPEC §1.4 order)");
      }
    }
  }

  // combine_v2 of the rows through expert e: y = x * (1 + e/E) (experts.h), against SPEC §2.3.
  ExpertBank bank(ExpertFn::kScale, o.seed, p.E, H, 1);
  Tensor y = Tensor::zeros(p.dtype, {d.expand_x.size(0), H});
  const int32_t* incl = d.ep_recv_counts.ptr<int32_t>();
  for (int64_t l = 0; l < L && valid == p.valid; ++l) {
    const int64_t begin = l == 0 ? 0 : incl[l * W - 1], end = incl[(l + 1) * W - 1];
    if (end > begin) {
      bank.forward(me * L + l, ex + begin * rb, p.dtype,
                   static_cast<std::byte*>(y.data()) + begin * rb, p.dtype, end - begin);
    }
  }
  moe_ep::CombineInputs cin;
  cin.expand_x = y;
  cin.expert_ids = din.expert_ids;
  cin.assist_info_for_combine = d.assist_info_for_combine;
  cin.ep_send_counts = d.ep_recv_counts;
  cin.expert_scales = *din.expert_scales;
  const Tensor out = moe_ep::combine_v2(cin, cfg);
  Batch local;
  local.tokens = BS;
  local.hidden = H;
  local.top_k = K;
  local.dtype = p.dtype;
  local.x.assign(p.x(), p.x() + BS * rb);
  local.expert_ids.assign(p.ids(), p.ids() + BS * K);
  local.expert_scales = p.scales;
  LayerSpec spec;
  spec.experts = p.E;
  ExpertBank ref_bank(ExpertFn::kScale, o.seed, p.E, H, 1);
  const Reference ref = dense_reference(local, spec, ExpertFn::kScale, ref_bank);
  std::vector<std::byte> out_bytes(static_cast<const std::byte*>(out.data()),
                                   static_cast<const std::byte*>(out.data()) + out.nbytes());
  const CheckResult c = compare_outputs(out_bytes, ref, p.dtype, ExpertFn::kScale);
  v.total[kCheckCombine] = BS * H;
  if (!c.pass) {
    fail(kCheckCombine, std::max<int64_t>(1, c.mismatches),
         "combine_v2 differs from the SPEC §2.3 reference in " + std::to_string(c.mismatches) +
             " elements (max abs err " + fmt("%.3g", c.max_abs) + ")");
  }

  if (compare) {
    RowType row(rb);
    Textbook tb(p, row.get());
    guarded(dog, "the textbook pipeline's dispatch", [&] { tb.dispatch(din.x, din.expert_ids); });
    if (o.debug_corrupt_baseline && tb.valid() > 0) tb.expand()[0] ^= std::byte{1};
    v.total[kCheckTbDispatch] = valid;
    int64_t bad = 0;
    if (tb.valid() != valid) {
      fail(kCheckTbDispatch, std::max<int64_t>(1, valid),
           "the textbook pipeline delivered " + std::to_string(tb.valid()) + " rows, dispatch_v2 " +
               std::to_string(valid));
    } else {
      for (int64_t j = 0; j < valid; ++j) {
        if (std::memcmp(tb.expand() + j * rb, ex + j * rb, static_cast<size_t>(rb))) ++bad;
      }
      if (bad > 0) {
        fail(kCheckTbDispatch, bad,
             std::to_string(bad) +
                 " rows of the textbook pipeline's regrouped rows differ from "
                 "dispatch_v2's expand_x");
      }
    }
    Tensor tb_out;
    guarded(dog, "the textbook pipeline's combine", [&] {
      tb_out = tb.combine(static_cast<const std::byte*>(y.data()), *din.expert_scales);
    });
    v.total[kCheckTbCombine] = BS * H;
    int64_t first = 0;
    if (tb.valid() == valid && !same_values(p.dtype, tb_out.data(), out.data(), BS * H, &first)) {
      fail(kCheckTbCombine, 1,
           "the textbook pipeline's combine differs from combine_v2 at token " +
               std::to_string(first / H) + ", h " + std::to_string(first % H));
    }

    Alltoallv a2a(p, rb);
    guarded(dog, "the bare MPI_Alltoallv", [&] {
      a2a.dispatch();
      a2a.combine();
    });
    // Received in (source, local expert) order: each chunk equals expand_x's (l, s) block.
    v.total[kCheckA2aDispatch] = valid;
    bad = 0;
    int64_t at = 0;
    for (int64_t s = 0; s < W && valid == p.valid; ++s) {
      for (int64_t l = 0; l < L; ++l) {
        const int64_t b = l * W + s, n = p.recv_block[s * L + l];
        const int64_t block = b == 0 ? 0 : incl[b - 1];
        for (int64_t r = 0; r < n; ++r, ++at) {
          if (std::memcmp(a2a.received().data() + at * rb, ex + (block + r) * rb,
                          static_cast<size_t>(rb))) {
            ++bad;
          }
        }
      }
    }
    if (bad > 0) {
      fail(kCheckA2aDispatch, bad,
           std::to_string(bad) + " rows the bare MPI_Alltoallv received differ from dispatch_v2's");
    }
    v.total[kCheckA2aCombine] = BS * K;
    if (a2a.returned() != a2a.sent()) {
      fail(kCheckA2aCombine, 1, "the bare MPI_Alltoallv did not bring the rows back unchanged");
    }
  }

  if (quant) {
    din.quant_mode = 2;
    const moe_ep::DispatchOutputs dq = moe_ep::dispatch_v2(din, cfg);
    v.total[kCheckInt8] = valid;
    const int8_t* q = dq.expand_x.ptr<int8_t>();
    const float* dyn = dq.dynamic_scales.ptr<float>();
    std::vector<float> xf(static_cast<size_t>(H)), deq(static_cast<size_t>(H));
    int64_t bad = 0;
    for (int64_t j = 0; j < valid && j < static_cast<int64_t>(expected.size()); ++j) {
      const std::byte* src = p.x_all.data() + expected[j] * rb;
      for (int64_t h = 0; h < H; ++h) xf[h] = moe_ep::load_float(p.dtype, src, h);
      const float inv = quantize_dequantize_row(xf.data(), H, deq.data());
      bool ok = std::memcmp(&inv, &dyn[j], sizeof(float)) == 0;
      for (int64_t h = 0; h < H && ok; ++h) {
        // By value: int8 has no -0, the reference's rne of a small negative value gives -0.
        ok = static_cast<float>(q[j * H + h]) * dyn[j] == deq[h];
      }
      if (!ok) ++bad;
    }
    if (bad > 0) {
      fail(kCheckInt8, bad,
           std::to_string(bad) +
               " int8 rows (or their dynamic_scales) of dispatch_v2 quant_mode 2 differ from "
               "SPEC §1.5 applied to the expected rows");
    }
  }

  guarded(dog, "the verification summary", [&] {
    MPI_Allreduce(MPI_IN_PLACE, v.failures, kChecks, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, v.total, kChecks, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  });
  return v;
}

// ---- timing ------------------------------------------------------------------------------------

enum Op {
  kMoeDispatch,
  kMoeCombine,
  kMoeDispatchInt8,
  kA2aDispatch,
  kA2aCombine,
  kA2aDispatchInt8,
  kTbDispatch,
  kTbCombine,
  kMemcpy,
  kOps,
};

struct OpName {
  const char* op;
  const char* impl;
};
constexpr OpName kOpNames[kOps] = {
    {"dispatch", "moe-ep"},    {"combine", "moe-ep"},    {"dispatch-int8", "moe-ep"},
    {"dispatch", "alltoallv"}, {"combine", "alltoallv"}, {"dispatch-int8", "alltoallv"},
    {"dispatch", "textbook"},  {"combine", "textbook"},  {"copy", "memcpy"},
};

struct Result {
  int64_t tokens = 0;
  Op op = kMoeDispatch;
  double bytes = 0;  // per rank, mean over ranks
  double p50_s = 0, p99_s = 0;
  double gbps = 0;
  double vs_alltoallv = kNaN, vs_textbook = kNaN;  // baseline p50 / moe-ep p50
};

struct Target {
  int64_t tokens = 0;
  std::string name;
  double value = 0, bound = 0;
  bool at_least = true;  // value >= bound (else value <= bound)
  bool pass = false;
};

// Nearest-rank percentile of sorted values.
double percentile(const std::vector<double>& sorted, double q) {
  const size_t n = sorted.size();
  const size_t i = static_cast<size_t>(std::ceil(q * static_cast<double>(n)));
  return sorted[std::min(n, std::max<size_t>(i, 1)) - 1];
}

struct PointResult {
  std::vector<Result> results;
  std::vector<Target> targets;
  double rows_other_mean = 0, rows_other_min = 0, rows_other_max = 0;
  double int8_bytes_ratio = kNaN, int8_time_ratio = kNaN;
  // Memory traffic of int8 dispatch over bf16's on the one-copy path: each token row is read
  // once (bf16) and each of its K copies written (H + 4 bytes against 2H): the time ratio the
  // memory system allows, above bytes_ratio.
  double int8_traffic_ratio = kNaN;
};

PointResult time_point(const BenchOptions& o, const Point& p, moe_ep::Communicator& comm,
                       bool compare, bool quant, Watchdog& dog) {
  const moe_ep::EpConfig cfg = make_ep_config(o, comm, p.E);
  const int64_t iters = o.iters, total = o.warmup + o.iters;
  bool enabled[kOps] = {};
  enabled[kMoeDispatch] = enabled[kMoeCombine] = true;
  enabled[kMoeDispatchInt8] = quant;
  enabled[kA2aDispatch] = enabled[kA2aCombine] = enabled[kTbDispatch] = enabled[kTbCombine] =
      enabled[kMemcpy] = compare;
  enabled[kA2aDispatchInt8] = compare && quant;

  RowType row(p.row_bytes);
  std::optional<Textbook> tb;
  std::optional<Alltoallv> a2a, a2a8;
  std::vector<std::byte> copy_src, copy_dst;
  if (compare) {
    tb.emplace(p, row.get());
    a2a.emplace(p, p.row_bytes);
    if (quant) a2a8.emplace(p, p.H + 4);
    copy_src.assign(static_cast<size_t>(p.other_send * p.row_bytes), std::byte{1});
    copy_dst.assign(copy_src.size(), std::byte{0});
  }
  moe_ep::DispatchInputs din;
  din.x = p.x_view();
  din.expert_ids = p.ids_view();
  din.expert_scales = p.scales_view();
  moe_ep::DispatchInputs din8 = din;
  din8.quant_mode = 2;

  std::vector<double> times(static_cast<size_t>(kOps * iters), kNaN);
  int64_t it = 0;
  auto timed = [&](Op op, bool guard, auto&& fn) {
    guarded(dog, "a barrier between timed ops", [] { MPI_Barrier(MPI_COMM_WORLD); });
    if (guard) dog.arm("a baseline's MPI collective");
    const double t0 = now_s();
    fn();
    const double t = now_s() - t0;
    if (guard) dog.disarm();
    if (it >= o.warmup) times[op * iters + (it - o.warmup)] = t;
  };
  // Groups of ops that run together (a dispatch before its combine); an iteration starts at a
  // rotating group.
  auto moe_group = [&] {
    moe_ep::DispatchOutputs d;
    timed(kMoeDispatch, false, [&] { d = moe_ep::dispatch_v2(din, cfg); });
    moe_ep::CombineInputs cin;
    cin.expand_x = d.expand_x;  // identity experts: the rows go back as they came
    cin.expert_ids = din.expert_ids;
    cin.assist_info_for_combine = d.assist_info_for_combine;
    cin.ep_send_counts = d.ep_recv_counts;
    cin.expert_scales = *din.expert_scales;
    Tensor out;
    timed(kMoeCombine, false, [&] { out = moe_ep::combine_v2(cin, cfg); });
    if (quant) {
      moe_ep::DispatchOutputs d8;
      timed(kMoeDispatchInt8, false, [&] { d8 = moe_ep::dispatch_v2(din8, cfg); });
    }
  };
  auto a2a_group = [&] {
    timed(kA2aDispatch, true, [&] { a2a->dispatch(); });
    timed(kA2aCombine, true, [&] { a2a->combine(); });
    if (quant) timed(kA2aDispatchInt8, true, [&] { a2a8->dispatch(); });
  };
  auto tb_group = [&] {
    timed(kTbDispatch, true, [&] { tb->dispatch(din.x, din.expert_ids); });
    Tensor out;
    timed(kTbCombine, true, [&] { out = tb->combine(tb->expand(), *din.expert_scales); });
  };
  auto copy_group = [&] {
    timed(kMemcpy, false, [&] { std::memcpy(copy_dst.data(), copy_src.data(), copy_src.size()); });
  };
  const int groups = compare ? 4 : 1;
  for (it = 0; it < total; ++it) {
    for (int g = 0; g < groups; ++g) {
      switch ((g + it) % groups) {
        case 0:
          moe_group();
          break;
        case 1:
          a2a_group();
          break;
        case 2:
          tb_group();
          break;
        default:
          copy_group();
          break;
      }
    }
  }

  // Per iteration the max over ranks, then percentiles over iterations.
  std::vector<double> all(p.rank == 0 ? static_cast<size_t>(p.W) * times.size() : 0);
  guarded(dog, "the gather of the timings", [&] {
    MPI_Gather(times.data(), static_cast<int>(times.size()), MPI_DOUBLE, all.data(),
               static_cast<int>(times.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  });
  int64_t rows[3] = {p.other_send, p.other_send, p.other_send};  // sum, min, max
  int64_t back = p.other_recv;
  guarded(dog, "the reduction of the row counts", [&] {
    MPI_Allreduce(MPI_IN_PLACE, &rows[0], 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &rows[1], 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &rows[2], 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &back, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  });
  PointResult pr;
  if (p.rank != 0) return pr;
  const double Wd = static_cast<double>(p.W);
  pr.rows_other_mean = static_cast<double>(rows[0]) / Wd;
  pr.rows_other_min = static_cast<double>(rows[1]);
  pr.rows_other_max = static_cast<double>(rows[2]);
  const double row_b = static_cast<double>(p.row_bytes), row8 = static_cast<double>(p.H + 4);
  const double send_b = pr.rows_other_mean * row_b, back_b = static_cast<double>(back) / Wd * row_b;
  double p50[kOps] = {};
  for (int op = 0; op < kOps; ++op) {
    if (!enabled[op]) continue;
    std::vector<double> worst(static_cast<size_t>(iters), 0.0);
    for (int64_t r = 0; r < p.W; ++r) {
      for (int64_t i = 0; i < iters; ++i) {
        worst[i] = std::max(worst[i], all[r * times.size() + op * iters + i]);
      }
    }
    std::sort(worst.begin(), worst.end());
    Result res;
    res.tokens = p.BS;
    res.op = static_cast<Op>(op);
    res.bytes = op == kMoeCombine || op == kA2aCombine || op == kTbCombine ? back_b
                : op == kMoeDispatchInt8 || op == kA2aDispatchInt8 ? pr.rows_other_mean * row8
                                                                   : send_b;
    res.p50_s = p50[op] = percentile(worst, 0.50);
    res.p99_s = percentile(worst, 0.99);
    res.gbps = res.p50_s > 0 ? res.bytes / res.p50_s / 1e9 : kNaN;
    pr.results.push_back(res);
  }
  for (Result& r : pr.results) {
    if (!compare) break;
    if (r.op == kMoeDispatch) {
      r.vs_alltoallv = p50[kA2aDispatch] / r.p50_s;
      r.vs_textbook = p50[kTbDispatch] / r.p50_s;
    } else if (r.op == kMoeCombine) {
      r.vs_alltoallv = p50[kA2aCombine] / r.p50_s;
      r.vs_textbook = p50[kTbCombine] / r.p50_s;
    } else if (r.op == kMoeDispatchInt8 && quant) {
      r.vs_alltoallv = p50[kA2aDispatchInt8] / r.p50_s;
    }
  }
  if (quant) {
    pr.int8_bytes_ratio = row8 / row_b;
    pr.int8_traffic_ratio =
        (row_b + static_cast<double>(p.K) * row8) / (row_b + static_cast<double>(p.K) * row_b);
    pr.int8_time_ratio = p50[kMoeDispatchInt8] / p50[kMoeDispatch];
  }
  if (compare) {
    for (const Result& r : pr.results) {
      if (r.op != kMoeDispatch && r.op != kMoeCombine) continue;
      const std::string op = kOpNames[r.op].op;
      pr.targets.push_back({p.BS, op + " moe-ep/alltoallv", r.vs_alltoallv, kTargetVsAlltoallv,
                            true, r.vs_alltoallv >= kTargetVsAlltoallv});
      pr.targets.push_back({p.BS, op + " moe-ep/textbook", r.vs_textbook, kTargetVsTextbook, true,
                            r.vs_textbook >= kTargetVsTextbook});
    }
    if (quant) {
      pr.targets.push_back({p.BS, "dispatch int8/bf16 time", pr.int8_time_ratio, kTargetInt8Time,
                            false, pr.int8_time_ratio <= kTargetInt8Time});
    }
  }
  return pr;
}

// ---- output ------------------------------------------------------------------------------------

std::string ratio(double r) { return std::isnan(r) ? "-" : fmt("%.2fx", r); }

void print_table(const PointResult& pr, int64_t tokens) {
  std::printf(
      "tokens/rank %lld: rows sent to other ranks per rank: mean %.1f (min %.0f, max %.0f)\n",
      static_cast<long long>(tokens), pr.rows_other_mean, pr.rows_other_min, pr.rows_other_max);
  std::printf("  %-13s %-9s %11s %9s %9s %8s %15s %14s\n", "op", "impl", "MB/rank", "p50 ms",
              "p99 ms", "GB/s", "moe/alltoallv", "moe/textbook");
  for (const Result& r : pr.results) {
    std::printf("  %-13s %-9s %11.3f %9.3f %9.3f %8.3f %15s %14s\n", kOpNames[r.op].op,
                kOpNames[r.op].impl, r.bytes / 1e6, r.p50_s * 1e3, r.p99_s * 1e3, r.gbps,
                ratio(r.vs_alltoallv).c_str(), ratio(r.vs_textbook).c_str());
  }
  if (!std::isnan(pr.int8_time_ratio)) {
    std::printf(
        "  int8 dispatch (quant_mode 2): bytes moved %.3f of bf16's (H + 4 B per row vs 2H), "
        "time %.3f of bf16's (p50); memory traffic %.3f of bf16's (each token read once, "
        "each of its K copies written)\n",
        pr.int8_bytes_ratio, pr.int8_time_ratio, pr.int8_traffic_ratio);
  }
  std::fflush(stdout);
}

void write_csv(const std::string& path, const std::vector<Result>& all) {
  std::ofstream f(path);
  f << "tokens_per_rank,op,impl,bytes_per_rank,p50_ms,p99_ms,gbps,ratio_vs_alltoallv,"
       "ratio_vs_textbook\n";
  for (const Result& r : all) {
    auto num = [](double v) { return std::isnan(v) ? std::string() : fmt("%.6g", v); };
    f << r.tokens << ',' << kOpNames[r.op].op << ',' << kOpNames[r.op].impl << ','
      << fmt("%.0f", r.bytes) << ',' << num(r.p50_s * 1e3) << ',' << num(r.p99_s * 1e3) << ','
      << num(r.gbps) << ',' << num(r.vs_alltoallv) << ',' << num(r.vs_textbook) << '\n';
  }
  f.close();  // a full device reports the failure when the buffer is flushed
  if (!f) throw Error(ErrorKind::kSystem, "moe-ep bench: --csv '" + path + "': write failed");
}

// gnuplot single-quoted string: '' stands for '.
std::string gp_quote(const std::string& s) {
  std::string q = "'";
  for (const char c : s) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}
// POSIX shell single-quoted word.
std::string sh_quote(const std::string& s) {
  std::string q = "'";
  for (const char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// GB/s against tokens per rank, one line per (op, impl). Returns "" or what went wrong.
std::string write_plot(const std::string& path, const std::vector<Result>& all,
                       const std::string& title) {
  std::vector<int64_t> tokens;
  for (const Result& r : all) {
    if (std::find(tokens.begin(), tokens.end(), r.tokens) == tokens.end()) {
      tokens.push_back(r.tokens);
    }
  }
  std::sort(tokens.begin(), tokens.end());
  std::vector<Op> series;
  for (const Result& r : all) {
    if (std::find(series.begin(), series.end(), r.op) == series.end()) series.push_back(r.op);
  }
  const std::filesystem::path base = std::filesystem::path(path).replace_extension("");
  const std::string dat = base.string() + ".dat", gp = base.string() + ".gp";
  {
    std::ofstream f(dat);
    f << "# tokens_per_rank";
    for (const Op op : series) f << ' ' << kOpNames[op].op << '/' << kOpNames[op].impl;
    f << '\n';
    for (const int64_t t : tokens) {
      f << t;
      for (const Op op : series) {
        double v = kNaN;
        for (const Result& r : all) {
          if (r.tokens == t && r.op == op) v = r.gbps;
        }
        f << ' ' << (std::isnan(v) ? std::string("NaN") : fmt("%.6g", v));
      }
      f << '\n';
    }
    if (!f) return "cannot write " + dat;
  }
  {
    std::ofstream f(gp);
    f << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
         "  set terminal pngcairo size 1000,600\n"
         "} else {\n"
         "  set terminal png size 1000,600\n"
         "}\n"
      << "set output " << gp_quote(path) << "\n"
      << "set title " << gp_quote(title) << " noenhanced\n"
      << "set xlabel 'tokens per rank'\n"
         "set ylabel 'GB/s per rank (bytes sent to other ranks / p50 of max over ranks)'\n"
         "set logscale x 2\n"
         "set grid\n"
         "set key outside right top noenhanced\n"
         "set datafile missing 'NaN'\n"
         "plot ";
    for (size_t i = 0; i < series.size(); ++i) {
      f << (i ? ", \\\n     " : "") << gp_quote(dat) << " using 1:" << i + 2
        << " with linespoints lw 2 title '" << kOpNames[series[i]].op << ' '
        << kOpNames[series[i]].impl << "'";
    }
    f << "\n";
    if (!f) return "cannot write " + gp;
  }
  const int rc = std::system(("gnuplot " + sh_quote(gp) + " 2>&1").c_str());
  if (rc != 0) return "gnuplot " + gp + " failed (exit status " + std::to_string(rc) + ")";
  return "";
}

}  // namespace

int bench_command(const BenchOptions& o) {
  int rank_i = 0, world_i = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_i);
  MPI_Comm_size(MPI_COMM_WORLD, &world_i);
  const int64_t rank = rank_i, W = world_i;
  {
    // $MOE_EP_* first, agreed on (one rank reports a value every rank shares), before the first
    // collective that reads them.
    const EnvironmentCheck env = check_environment_here(o.timeout_s, o.transport);
    Watchdog env_dog(env.timeout_s, rank_i);
    agree_on_error(env.error, rank_i, env_dog, "checking the environment");
  }
  auto comm = moe_ep::Communicator::from_mpi(MPI_COMM_WORLD, {o.timeout_s});
  Watchdog dog(comm->timeout_s(), rank_i);

  int node_ranks = 1;
  {
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_i, MPI_INFO_NULL, &node);
    MPI_Comm_size(node, &node_ranks);
    MPI_Comm_free(&node);
  }
  Setup setup;
  std::exception_ptr setup_error;
  try {
    setup = plan_bench(o, W, rank, node_ranks);
  } catch (...) {
    setup_error = std::current_exception();
  }
  agree_on_error(setup_error, rank_i, dog, "before the run");
  const bool compare = o.compare, quant = o.quant == "int8" || (o.quant.empty() && compare);
  const Preset& layer = setup.layer;
  setup.gnuplot =
      rank == 0 && !o.plot.empty() && std::system("command -v gnuplot > /dev/null 2>&1") == 0;

  const std::string bytes_rule =
      "bytes counted per rank = rows it sends to OTHER ranks (self-traffic excluded) x the row "
      "payload (H x " +
      std::to_string(moe_ep::dtype_size(setup.dtype)) + " B; int8: H + 4 B with its fp32 " +
      "scale); moe-ep's 16 B per-row metadata and count messages are not counted; combine: the "
      "rows it sends back; mean over ranks";
  const std::string time_rule =
      std::string("per iteration: MPI_Barrier, then each rank times the op; p50/p99 (nearest ") +
      "rank; below 100 iterations p99 is the slowest) over " + std::to_string(o.iters) +
      " iterations (after " + std::to_string(o.warmup) +
      " warm-up) of the max over ranks; GB/s = bytes / p50; ratios = baseline p50 / moe-ep p50";
  std::string tokens_list;
  for (const int64_t t : o.tokens) {
    if (!tokens_list.empty()) tokens_list += ',';
    tokens_list += std::to_string(t);
  }
  if (rank == 0) {
    std::printf(
        "moe-ep bench: preset %s  H %lld  E %lld  K %lld  dtype %s  W %lld  tokens/rank %s  "
        "seed %llu  transport %s%s%s\n",
        layer.name.c_str(), static_cast<long long>(layer.hidden),
        static_cast<long long>(layer.experts), static_cast<long long>(layer.top_k),
        moe_ep::dtype_name(setup.dtype), static_cast<long long>(W), tokens_list.c_str(),
        static_cast<unsigned long long>(o.seed), transport_name(o.transport).c_str(),
        compare ? "  --compare" : "", quant ? "  --quant int8" : "");
    std::printf("  routing: %s\n", setup.routing_desc.c_str());
    print_threads_line();
    std::printf(
        "  placement: %lld experts per rank (expert e on rank e / %lld), no shared experts\n",
        static_cast<long long>(setup.L), static_cast<long long>(setup.L));
    std::printf("  %s\n  time: %s\n", bytes_rule.c_str(), time_rule.c_str());
    if (compare) {
      std::printf(
          "  baselines (same run, same routing, same rows): alltoallv = one MPI_Alltoallv of the "
          "rows dispatch moves (self included), pre-packed by destination, and the same rows back "
          "for combine; textbook = moe_ep::permute -> MPI_Alltoall(counts) -> MPI_Alltoallv -> "
          "regroup by local expert, combine = regroup -> MPI_Alltoallv -> moe_ep::unpermute "
          "with the top-k weights; memcpy = one memcpy of the dispatch bytes on each rank at once "
          "(the machine's copy limit)\n");
    }
    if (!o.plot.empty() && !setup.gnuplot) {
      std::printf(
          "  note: --plot %s: gnuplot is not installed (Debian: apt-get install gnuplot-nox); "
          "the plot will be skipped, --csv/--json are still written\n",
          o.plot.c_str());
    }
    std::fflush(stdout);
  }

  std::vector<Result> results;
  std::vector<Target> targets;
  std::vector<PointResult> points;
  for (const int64_t BS : o.tokens) {
    const Point p = make_point(o, setup, BS, dog);
    const Verification v = verify(o, p, *comm, compare, quant, dog);
    int64_t failures = 0;
    for (const int64_t f : v.failures) failures += f;
    if (rank == 0) {
      static const char* kWhat[kChecks] = {
          "dispatch_v2 expand_x == SPEC §1.4 layout (rows)",
          "combine_v2 of scale experts == SPEC §2.3 reference, bitwise (elements)",
          "textbook rows == dispatch_v2 expand_x (rows)",
          "textbook combine == combine_v2, bitwise, +0 == -0 (elements)",
          "alltoallv moved the same rows (rows)",
          "alltoallv brought them back unchanged (rows)",
          "quant_mode 2 int8 rows and dynamic_scales == SPEC §1.5 (rows)",
      };
      std::printf("verify tokens/rank %lld:", static_cast<long long>(BS));
      for (int c = 0; c < kChecks; ++c) {
        if (v.total[c] == 0 && v.failures[c] == 0) continue;
        std::printf("\n  %s: %lld checked, %lld bad", kWhat[c], static_cast<long long>(v.total[c]),
                    static_cast<long long>(v.failures[c]));
      }
      std::printf("\n  %s\n", failures == 0 ? "verified" : "VERIFICATION FAILED: nothing timed");
      std::fflush(stdout);
    }
    if (failures > 0) return 1;
    PointResult pr = time_point(o, p, *comm, compare, quant, dog);
    if (rank == 0) {
      print_table(pr, BS);
      results.insert(results.end(), pr.results.begin(), pr.results.end());
      targets.insert(targets.end(), pr.targets.begin(), pr.targets.end());
      points.push_back(std::move(pr));
    }
  }

  // Rank 0 prints and writes the results; a failed write (a full disk, an unwritable file the
  // early path check could not see) is agreed on by every rank instead of leaving the others in
  // the final barrier until the deadline.
  std::exception_ptr output_error;
  auto report = [&] {
    const bool target_config = layer.hidden == kTargetHidden && layer.experts == 64 &&
                               layer.top_k == 8 && setup.dtype == DType::kBF16 && W == 2 &&
                               o.routing == "real";
    if (compare) {
      std::printf(
          "targets (docs/performance.md; stated for bf16, H 7168, top-8, 64 experts, %lld "
          "tokens/rank, W = 2, real OLMoE routing%s):\n",
          static_cast<long long>(kTargetTokens),
          target_config ? "" : "; THIS RUN'S CONFIGURATION DIFFERS");
      for (const Target& t : targets) {
        std::printf("  tokens/rank %5lld  %-26s %7.3f %s %.1f  %s\n",
                    static_cast<long long>(t.tokens), t.name.c_str(), t.value,
                    t.at_least ? ">=" : "<=", t.bound, t.pass ? "PASS" : "FAIL");
      }
      std::printf("  (a missed performance target does not change the exit status)\n");
    }
    if (!o.csv.empty()) {
      write_csv(o.csv, results);
      std::printf("csv written to %s\n", o.csv.c_str());
    }
    if (!o.json.empty()) {
      nlohmann::json j;
      j["config"] = {{"preset", layer.name},
                     {"hidden", layer.hidden},
                     {"experts", layer.experts},
                     {"top_k", layer.top_k},
                     {"dtype", moe_ep::dtype_name(setup.dtype)},
                     {"world", W},
                     {"routing", setup.routing_desc},
                     {"seed", o.seed},
                     {"iters", o.iters},
                     {"warmup", o.warmup},
                     {"compare", compare},
                     {"quant", o.quant},
                     {"transport", transport_name(o.transport)},
                     {"threads_per_rank", moe_ep::num_threads()}};
      j["bytes_rule"] = bytes_rule;
      j["time_rule"] = time_rule;
      j["verified"] = true;
      j["results"] = nlohmann::json::array();
      for (const Result& r : results) {
        auto num = [](double v) { return std::isnan(v) ? nlohmann::json() : nlohmann::json(v); };
        j["results"].push_back({{"tokens_per_rank", r.tokens},
                                {"op", kOpNames[r.op].op},
                                {"impl", kOpNames[r.op].impl},
                                {"bytes_per_rank", r.bytes},
                                {"p50_ms", r.p50_s * 1e3},
                                {"p99_ms", r.p99_s * 1e3},
                                {"gbps", num(r.gbps)},
                                {"ratio_vs_alltoallv", num(r.vs_alltoallv)},
                                {"ratio_vs_textbook", num(r.vs_textbook)}});
      }
      j["int8"] = nlohmann::json::array();
      for (const PointResult& pr : points) {
        if (std::isnan(pr.int8_time_ratio)) continue;
        j["int8"].push_back({{"tokens_per_rank", pr.results.front().tokens},
                             {"bytes_ratio", pr.int8_bytes_ratio},
                             {"traffic_ratio", pr.int8_traffic_ratio},
                             {"time_ratio", pr.int8_time_ratio}});
      }
      j["targets"] = nlohmann::json::array();
      for (const Target& t : targets) {
        j["targets"].push_back({{"tokens_per_rank", t.tokens},
                                {"name", t.name},
                                {"value", t.value},
                                {"bound", t.bound},
                                {"at_least", t.at_least},
                                {"pass", t.pass}});
      }
      std::ofstream f(o.json);
      f << j.dump(2) << '\n';
      f.close();
      if (!f)
        throw Error(ErrorKind::kSystem, "moe-ep bench: --json '" + o.json + "': write failed");
      std::printf("json written to %s\n", o.json.c_str());
    }
    if (!o.plot.empty()) {
      if (!setup.gnuplot) {
        std::printf(
            "plot skipped: gnuplot is not installed (Debian: apt-get install gnuplot-nox)\n");
      } else {
        const std::string title =
            "moe-ep bench: " + layer.name + " H " + std::to_string(layer.hidden) + " E " +
            std::to_string(layer.experts) + " K " + std::to_string(layer.top_k) + " " +
            moe_ep::dtype_name(setup.dtype) + " W " + std::to_string(W);
        const std::string err = write_plot(o.plot, results, title);
        if (!err.empty()) throw Error(ErrorKind::kSystem, "moe-ep bench: --plot: " + err);
        std::printf("plot written to %s (data and gnuplot script beside it: .dat, .gp)\n",
                    o.plot.c_str());
      }
    }
    std::fflush(stdout);
  };
  if (rank == 0) {
    try {
      report();
    } catch (...) {
      output_error = std::current_exception();
    }
  }
  agree_on_error(output_error, rank_i, dog, "writing the results");
  return 0;
}

}  // namespace moe_ep_tool
