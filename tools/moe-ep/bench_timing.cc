#include "bench_timing.h"

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "bench_baselines.h"
#include "common.h"
#include "moe_ep/dispatch.h"

namespace moe_ep_tool::bench {

using moe_ep::Tensor;

namespace {

// Nearest-rank percentile of sorted values.
double percentile(const std::vector<double>& sorted, double q) {
  const size_t n = sorted.size();
  const size_t i = static_cast<size_t>(std::ceil(q * static_cast<double>(n)));
  return sorted[std::min(n, std::max<size_t>(i, 1)) - 1];
}

// The timed iterations of one point on this rank: times[op * iters + i] (NaN for ops not run).
class Iterations {
 public:
  Iterations(const BenchOptions& o, const Setup& s, const Point& p, moe_ep::Communicator& comm,
             bool compare, bool quant, Watchdog& dog);

  bool enabled(int op) const { return enabled_[op]; }
  // What op's first timed call moved (moe-ep's ops; empty for the others).
  const moe_ep::Traffic& traffic(int op) const { return traffic_[op]; }
  // Runs warm-up + iters iterations of every enabled group, the first group rotating.
  const std::vector<double>& run();

 private:
  template <typename F>
  void timed(Op op, bool guard, F&& fn);
  void moe_group(bool alt);
  void a2a_group();
  void tb_group();
  void copy_group();

  const BenchOptions& o_;
  const Point& p_;
  moe_ep::Communicator& comm_;
  const moe_ep::EpConfig cfg_, cfg_alt_;  // --comm-alg, and the other
  const bool compare_, quant_;
  Watchdog& dog_;
  bool enabled_[kOps] = {};
  RowType row_;
  std::optional<Textbook> tb_;
  std::optional<Alltoallv> a2a_, a2a8_;
  std::vector<std::byte> copy_src_, copy_dst_;
  moe_ep::DispatchInputs din_, din8_;
  std::vector<double> times_;
  moe_ep::Traffic traffic_[kOps];
  int64_t it_ = 0;
};

Iterations::Iterations(const BenchOptions& o, const Setup& s, const Point& p,
                       moe_ep::Communicator& comm, bool compare, bool quant, Watchdog& dog)
    : o_(o),
      p_(p),
      comm_(comm),
      cfg_(make_ep_config(o, comm, p.E, o.comm_alg)),
      cfg_alt_(make_ep_config(o, comm, p.E, other_comm_alg(o.comm_alg))),
      compare_(compare),
      quant_(quant),
      dog_(dog),
      row_(p.row_bytes),
      din_(p.dispatch_inputs()),
      times_(static_cast<size_t>(kOps * o.iters), kNaN) {
  enabled_[kMoeDispatch] = enabled_[kMoeCombine] = true;
  enabled_[kMoeDispatchInt8] = quant;
  enabled_[kA2aDispatch] = enabled_[kA2aCombine] = enabled_[kTbDispatch] = enabled_[kTbCombine] =
      enabled_[kMemcpy] = compare;
  enabled_[kA2aDispatchInt8] = compare && quant;
  enabled_[kAltDispatch] = enabled_[kAltCombine] = s.alt;
  if (compare) {
    tb_.emplace(p, row_.get());
    a2a_.emplace(p, p.row_bytes);
    if (quant) a2a8_.emplace(p, p.H + 4);
    copy_src_.assign(static_cast<size_t>(p.other_send * p.row_bytes), std::byte{1});
    copy_dst_.assign(copy_src_.size(), std::byte{0});
  }
  din8_ = din_;
  din8_.quant_mode = 2;
}

template <typename F>
void Iterations::timed(Op op, bool guard, F&& fn) {
  // The presence rounds are the barrier itself, with no MPI_Barrier after them: a rank dying
  // inside a blocking barrier would be outwaited by the watchdog, not named.
  line_up("a barrier between timed ops");
  if (guard) dog_.arm("a baseline's MPI collective");
  const double t0 = now_s();
  fn();
  const double t = now_s() - t0;
  if (guard) dog_.disarm();
  if (it_ >= o_.warmup) times_[op * o_.iters + (it_ - o_.warmup)] = t;
}

// A group: ops that run together (a dispatch before its combine).
// moe-ep's dispatch and combine, with --comm-alg or (alt) the other; the first timed call of
// each records what it moved.
void Iterations::moe_group(bool alt) {
  const moe_ep::EpConfig& cfg = alt ? cfg_alt_ : cfg_;
  const Op dop = alt ? kAltDispatch : kMoeDispatch, cop = alt ? kAltCombine : kMoeCombine;
  const bool count = it_ == o_.warmup;
  moe_ep::DispatchOutputs d;
  if (count) comm_.reset_traffic();
  timed(dop, false, [&] { d = moe_ep::dispatch_v2(din_, cfg); });
  if (count) traffic_[dop] = comm_.traffic(), comm_.reset_traffic();
  // Identity experts: the rows go back as they came.
  const moe_ep::CombineInputs cin = combine_inputs(din_, d, d.expand_x);
  Tensor out;
  timed(cop, false, [&] { out = moe_ep::combine_v2(cin, cfg); });
  if (count) traffic_[cop] = comm_.traffic();
  if (quant_ && !alt) {
    moe_ep::DispatchOutputs d8;
    timed(kMoeDispatchInt8, false, [&] { d8 = moe_ep::dispatch_v2(din8_, cfg_); });
  }
}

void Iterations::a2a_group() {
  timed(kA2aDispatch, true, [&] { a2a_->dispatch(); });
  timed(kA2aCombine, true, [&] { a2a_->combine(); });
  if (quant_) timed(kA2aDispatchInt8, true, [&] { a2a8_->dispatch(); });
}

void Iterations::tb_group() {
  timed(kTbDispatch, true, [&] { tb_->dispatch(din_.x, din_.expert_ids); });
  Tensor out;
  timed(kTbCombine, true, [&] { out = tb_->combine(tb_->expand(), *din_.expert_scales); });
}

void Iterations::copy_group() {
  timed(kMemcpy, false, [&] { std::memcpy(copy_dst_.data(), copy_src_.data(), copy_src_.size()); });
}

const std::vector<double>& Iterations::run() {
  const int groups = compare_ ? (enabled_[kAltDispatch] ? 5 : 4) : 1;
  for (it_ = 0; it_ < o_.warmup + o_.iters; ++it_) {
    for (int g = 0; g < groups; ++g) {
      switch ((g + it_) % groups) {
        case 0:
          moe_group(false);
          break;
        case 4:
          moe_group(true);
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
  return times_;
}

// Rows sent to other ranks: the sum, min and max over ranks; and the sum of the rows received
// from other ranks (combine sends them back).
struct RowCounts {
  int64_t sent[3];  // sum, min, max
  int64_t back;
};

RowCounts reduce_row_counts(const Point& p, Watchdog& dog) {
  RowCounts c{{p.other_send, p.other_send, p.other_send}, p.other_recv};
  guarded(dog, "the reduction of the row counts", [&] {
    MPI_Allreduce(MPI_IN_PLACE, &c.sent[0], 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &c.sent[1], 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &c.sent[2], 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &c.back, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  });
  return c;
}

// Per op: per iteration the max over ranks, then the percentiles over iterations. `all`: every
// rank's times (rank-major).
void summarise_ops(const BenchOptions& o, const Setup& s, const Point& p, const Iterations& its,
                   const std::vector<double>& all, double back_rows, PointResult& pr,
                   double p50[kOps]) {
  const int64_t iters = o.iters;
  const double row_b = static_cast<double>(p.row_bytes), row8 = static_cast<double>(p.H + 4);
  const double send_b = pr.rows_other_mean * row_b, back_b = back_rows * row_b;
  const size_t per_rank = static_cast<size_t>(kOps * iters);
  for (int op = 0; op < kOps; ++op) {
    if (!its.enabled(op)) continue;
    std::vector<double> worst(static_cast<size_t>(iters), 0.0);
    for (int64_t r = 0; r < p.W; ++r) {
      for (int64_t i = 0; i < iters; ++i) {
        worst[i] = std::max(worst[i], all[r * per_rank + op * iters + i]);
      }
    }
    std::sort(worst.begin(), worst.end());
    Result res;
    res.tokens = p.BS;
    res.op = static_cast<Op>(op);
    res.impl = impl_name(res.op, o.comm_alg, s.alt);
    res.bytes = op == kMoeCombine || op == kA2aCombine || op == kTbCombine || op == kAltCombine
                    ? back_b
                : op == kMoeDispatchInt8 || op == kA2aDispatchInt8 ? pr.rows_other_mean * row8
                                                                   : send_b;
    res.p50_s = p50[op] = percentile(worst, 0.50);
    res.p99_s = percentile(worst, 0.99);
    res.gbps = res.p50_s > 0 ? res.bytes / res.p50_s / 1e9 : kNaN;
    pr.results.push_back(res);
  }
}

// What moe-ep's ops moved to other nodes and inside this one: per op [inter, intra] summed over
// ranks (on rank 0).
std::vector<double> reduce_node_bytes(const Setup& s, const Point& p, const Iterations& its,
                                      Watchdog& dog) {
  std::vector<double> b(2 * kOps, 0.0);
  for (const Op op : {kMoeDispatch, kMoeCombine, kAltDispatch, kAltCombine}) {
    if (!its.enabled(op)) continue;
    const NodeBytes n = split_traffic(
        its.traffic(op), [](int64_t e) { return static_cast<int>(e); }, s.leaders,
        static_cast<int>(p.rank));
    b[2 * op] = n.inter, b[2 * op + 1] = n.intra;
  }
  guarded(dog, "the reduction of the bytes per node", [&] {
    MPI_Reduce(p.rank == 0 ? MPI_IN_PLACE : b.data(), b.data(), 2 * kOps, MPI_DOUBLE, MPI_SUM, 0,
               MPI_COMM_WORLD);
  });
  return b;
}

// hierarchy's inter-node bytes and p50 over fullmesh's, and their targets (both timed).
void compare_algorithms(const BenchOptions& o, const Setup& s, const Point& p,
                        const double p50[kOps], PointResult& pr) {
  if (!s.alt) return;
  const bool main_hier = o.comm_alg == "hierarchy";
  const Op hier[2] = {main_hier ? kMoeDispatch : kAltDispatch,
                      main_hier ? kMoeCombine : kAltCombine};
  const Op full[2] = {main_hier ? kAltDispatch : kMoeDispatch,
                      main_hier ? kAltCombine : kMoeCombine};
  auto inter = [&](Op op) {
    for (const Result& r : pr.results)
      if (r.op == op) return r.inter_node;
    return kNaN;
  };
  for (int i = 0; i < 2; ++i) {
    pr.hier_bytes[i] = inter(hier[i]) / inter(full[i]);
    pr.hier_time[i] = p50[hier[i]] / p50[full[i]];
    const std::string op = kOpNames[hier[i]].op;
    pr.targets.push_back({p.BS, op + " hierarchy/fullmesh inter-node bytes", pr.hier_bytes[i],
                          kTargetHierBytes, false, pr.hier_bytes[i] <= kTargetHierBytes});
    pr.targets.push_back({p.BS, op + " hierarchy/fullmesh p50", pr.hier_time[i], kTargetHierTime,
                          false, pr.hier_time[i] <= kTargetHierTime});
  }
}

// The ratios against the baselines, int8's against bf16's, and the targets.
void compare_ops(const Point& p, bool compare, bool quant, const double p50[kOps],
                 PointResult& pr) {
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
  const double row_b = static_cast<double>(p.row_bytes), row8 = static_cast<double>(p.H + 4);
  if (quant) {
    pr.int8_bytes_ratio = row8 / row_b;
    pr.int8_traffic_ratio =
        (row_b + static_cast<double>(p.K) * row8) / (row_b + static_cast<double>(p.K) * row_b);
    pr.int8_time_ratio = p50[kMoeDispatchInt8] / p50[kMoeDispatch];
  }
  if (!compare) return;
  for (const Result& r : pr.results) {
    if (r.op != kMoeDispatch && r.op != kMoeCombine) continue;
    const std::string op = kOpNames[r.op].op;
    pr.targets.push_back({p.BS, op + " moe-ep/alltoallv", r.vs_alltoallv, kTargetVsAlltoallv, true,
                          r.vs_alltoallv >= kTargetVsAlltoallv});
    pr.targets.push_back({p.BS, op + " moe-ep/textbook", r.vs_textbook, kTargetVsTextbook, true,
                          r.vs_textbook >= kTargetVsTextbook});
  }
  if (quant) {
    pr.targets.push_back({p.BS, "dispatch int8/bf16 time", pr.int8_time_ratio, kTargetInt8Time,
                          false, pr.int8_time_ratio <= kTargetInt8Time});
  }
}

}  // namespace

std::string impl_name(Op op, const std::string& comm_alg, bool alt) {
  if (op == kAltDispatch || op == kAltCombine) return "moe-ep/" + other_comm_alg(comm_alg);
  if (alt && (op == kMoeDispatch || op == kMoeCombine || op == kMoeDispatchInt8))
    return "moe-ep/" + comm_alg;
  return kOpNames[op].impl;
}

PointResult time_point(const BenchOptions& o, const Setup& s, const Point& p,
                       moe_ep::Communicator& comm, bool compare, bool quant, Watchdog& dog) {
  Iterations its(o, s, p, comm, compare, quant, dog);
  const std::vector<double>& times = its.run();
  std::vector<double> all(p.rank == 0 ? static_cast<size_t>(p.W) * times.size() : 0);
  guarded(dog, "the gather of the timings", [&] {
    MPI_Gather(times.data(), static_cast<int>(times.size()), MPI_DOUBLE, all.data(),
               static_cast<int>(times.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  });
  const RowCounts rows = reduce_row_counts(p, dog);
  const std::vector<double> node_bytes = reduce_node_bytes(s, p, its, dog);
  PointResult pr;
  if (p.rank != 0) return pr;
  const double Wd = static_cast<double>(p.W);
  pr.rows_other_mean = static_cast<double>(rows.sent[0]) / Wd;
  pr.rows_other_min = static_cast<double>(rows.sent[1]);
  pr.rows_other_max = static_cast<double>(rows.sent[2]);
  double p50[kOps] = {};
  summarise_ops(o, s, p, its, all, static_cast<double>(rows.back) / Wd, pr, p50);
  for (Result& r : pr.results) {
    if (r.op != kMoeDispatch && r.op != kMoeCombine && r.op != kAltDispatch && r.op != kAltCombine)
      continue;
    r.inter_node = node_bytes[2 * r.op] / Wd;
    r.intra_node = node_bytes[2 * r.op + 1] / Wd;
  }
  compare_ops(p, compare, quant, p50, pr);
  compare_algorithms(o, s, p, p50, pr);
  return pr;
}

}  // namespace moe_ep_tool::bench
