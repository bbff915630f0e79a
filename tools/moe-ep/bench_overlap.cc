#include "bench_overlap.h"

#include <cblas.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "experts.h"
#include "moe_ep/async.h"
#include "moe_ep/dispatch.h"
#include "routing.h"

namespace moe_ep_tool::bench {

namespace {

using moe_ep::DispatchOutputs;
using moe_ep::Tensor;
using moe_ep::TensorView;

// One micro-batch of this rank: its tokens and their routing (the bench's router, --routing).
struct MicroBatch {
  int64_t BS = 0, H = 0, K = 0;
  moe_ep::DType dtype = moe_ep::DType::kBF16;
  std::vector<std::byte> x;
  std::vector<int32_t> ids;
  std::vector<float> scales;
  moe_ep::DispatchInputs inputs() const {
    moe_ep::DispatchInputs in;
    in.x = TensorView::contiguous(const_cast<std::byte*>(x.data()), dtype, {BS, H});
    in.expert_ids = ids_view();
    in.expert_scales =
        TensorView::contiguous(const_cast<float*>(scales.data()), moe_ep::DType::kF32, {BS, K});
    return in;
  }
  TensorView ids_view() const {
    return TensorView::contiguous(const_cast<int32_t*>(ids.data()), moe_ep::DType::kI32, {BS, K});
  }
};

// Micro-batch `mb` of this rank: global tokens [first, first + BS), first unique per (mb, rank).
MicroBatch make_micro_batch(const BenchOptions& o, const Setup& s, int mb, int64_t BS,
                            int64_t max_bs) {
  MicroBatch b;
  b.BS = BS;
  b.H = s.layer.hidden;
  b.K = s.layer.top_k;
  b.dtype = s.dtype;
  const int64_t first = (int64_t{mb} * s.W + s.rank) * max_bs;
  b.x = make_tokens(o.seed, first, BS, b.H, b.dtype);
  b.ids.resize(static_cast<size_t>(BS * b.K));
  b.scales.resize(b.ids.size());
  Router(s.layer, s.kind, o.seed, s.real_p)
      .route(first, BS, b.x.data(), b.dtype, b.ids.data(), b.scales.data());
  return b;
}

// The layer: its EpConfig and the experts. Every local expert computes with one weight set
// (expert `first_expert`'s): a timing stand-in whose work per row is a real SwiGLU's, without L
// copies of the weights.
struct Layer {
  moe_ep::EpConfig cfg;
  ExpertBank bank;
  int64_t first_expert = 0;
  int64_t row_bytes = 0;
  moe_ep::DType dtype = moe_ep::DType::kBF16;

  // y rows [off, off + n) = experts(x rows [off, off + n)).
  void rows(const Tensor& x, Tensor& y, int64_t off, int64_t n) {
    if (n == 0) return;
    bank.forward(first_expert, x.ptr<std::byte>() + off * row_bytes, dtype,
                 y.ptr<std::byte>() + off * row_bytes, dtype, n);
  }
  // The rows of one source, one block per local expert (every variant computes these blocks,
  // so that every variant gives the same bits whatever the BLAS does with a block's size).
  void source(const Tensor& x, Tensor& y, const std::vector<int64_t>& offset,
              const std::vector<int64_t>& n) {
    for (size_t l = 0; l < n.size(); ++l) rows(x, y, offset[l], n[l]);
  }
  // Every valid row: the sources' blocks in source order (from ep_recv_counts).
  Tensor all(const DispatchOutputs& d) {
    Tensor y = Tensor::empty(dtype, {d.expand_x.size(0), d.expand_x.size(1)});
    const int64_t L = d.expert_token_nums.numel(), W = d.ep_recv_counts.numel() / L;
    const int32_t* inclusive = d.ep_recv_counts.ptr<int32_t>();
    for (int64_t s = 0; s < W; ++s) {
      std::vector<int64_t> offset, n;
      for (int64_t l = 0; l < L; ++l) {
        const int64_t b = l * W + s, end = inclusive[b];
        n.push_back(end - (b > 0 ? inclusive[b - 1] : 0));
        offset.push_back(end - n.back());
      }
      source(d.expand_x, y, offset, n);
    }
    return y;
  }
  // As all(), each source as soon as its rows have landed (PendingDispatch::wait_source).
  Tensor as_they_land(moe_ep::PendingDispatch& p) {
    Tensor y;
    while (std::optional<moe_ep::SourceRows> s = p.wait_source()) {
      if (!y.defined()) y = Tensor::empty(dtype, {s->expand_x.size(0), s->expand_x.size(1)});
      source(s->expand_x, y, s->offsets, s->rows);
    }
    return y;
  }
  moe_ep::CombineInputs combine_inputs(const MicroBatch& b, const DispatchOutputs& d,
                                       const Tensor& y) const {
    moe_ep::CombineInputs in;
    in.expand_x = y.view();
    in.expert_ids = b.ids_view();
    in.expert_scales = TensorView::contiguous(const_cast<float*>(b.scales.data()),
                                              moe_ep::DType::kF32, {b.BS, b.K});
    in.handle = &d.handle;
    return in;
  }
};

// The two micro-batches one after the other.
std::vector<Tensor> sequential(Layer& layer, const std::vector<MicroBatch>& mbs) {
  std::vector<Tensor> out;
  for (const MicroBatch& b : mbs) {
    const DispatchOutputs d = moe_ep::dispatch_v2(b.inputs(), layer.cfg);
    const Tensor y = layer.all(d);
    out.push_back(moe_ep::combine_v2(layer.combine_inputs(b, d, y), layer.cfg));
  }
  return out;
}

// Both dispatches started at once; each micro-batch's experts start on each source as its rows
// land, and its combine as soon as its experts are done: micro-batch 1's dispatch travels during
// micro-batch 0's experts, micro-batch 0's combine during micro-batch 1's, and the first
// dispatch's late sources during the experts of its early ones.
std::vector<Tensor> overlapped(Layer& layer, const std::vector<MicroBatch>& mbs) {
  std::vector<moe_ep::PendingDispatch> pd;
  for (const MicroBatch& b : mbs) pd.push_back(moe_ep::dispatch_v2_start(b.inputs(), layer.cfg));
  std::vector<DispatchOutputs> d(mbs.size());
  std::vector<Tensor> y(mbs.size());
  std::vector<moe_ep::Pending<Tensor>> pc;
  for (size_t i = 0; i < mbs.size(); ++i) {
    y[i] = layer.as_they_land(pd[i]);
    d[i] = pd[i].wait();
    pc.push_back(moe_ep::combine_v2_start(layer.combine_inputs(mbs[i], d[i], y[i]), layer.cfg));
  }
  std::vector<Tensor> out;
  for (auto& p : pc) out.push_back(p.wait());
  return out;
}

// One micro-batch's experts once its whole dispatch has landed (per_source false), or source by
// source as each lands (true); the same blocks either way, so the same bits. Returns the
// dispatch and y; *experts_done_s: seconds from `start` until the last expert block was done.
Tensor experts_by_source(Layer& layer, const MicroBatch& b, bool per_source, double start,
                         double* experts_done_s, DispatchOutputs* d) {
  moe_ep::PendingDispatch p = moe_ep::dispatch_v2_start(b.inputs(), layer.cfg);
  Tensor y;
  if (per_source) {
    y = layer.as_they_land(p);
    *d = p.wait();
  } else {
    *d = p.wait();
    y = layer.all(*d);
  }
  *experts_done_s = now_s() - start;
  return y;
}

// The blocking MPI calls of the bench (outside moe-ep's ops, which have their own deadlines)
// run with the watchdog armed: a rank that failed is named, not waited for.
double max_over_ranks(Watchdog& dog, double v) {
  double m = 0;
  dog.arm("the overlap bench's reduction of the times");
  MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  dog.disarm();
  return m;
}

bool same_bits(Watchdog& dog, const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  bool same = a.size() == b.size();
  for (size_t i = 0; same && i < a.size(); ++i)
    same = a[i].nbytes() == b[i].nbytes() &&
           std::memcmp(a[i].data(), b[i].data(), static_cast<size_t>(a[i].nbytes())) == 0;
  int ok = same ? 1 : 0, all = 0;
  dog.arm("the overlap bench's comparison of the outputs");
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  dog.disarm();
  return all == 1;
}

void barrier(Watchdog& dog) {
  dog.arm("the overlap bench's barrier");
  MPI_Barrier(MPI_COMM_WORLD);
  dog.disarm();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Seconds of `f` on the slowest rank, median of `n` runs after a barrier each.
template <class F>
double timed(Watchdog& dog, int n, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < n; ++i) {
    barrier(dog);
    const double t0 = now_s();
    f();
    t.push_back(max_over_ranks(dog, now_s() - t0));
  }
  return median(t);
}

}  // namespace

int overlap_command(const BenchOptions& o, const Setup& s, moe_ep::Communicator& comm,
                    Watchdog& dog) {
  // One BLAS thread per rank unless asked otherwise, as moe-ep run: ranks already fill the cores.
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) openblas_set_num_threads(1);
  int fails = 0;
  for (const int64_t BS : o.tokens) {
    // --skew F: the last rank has F times the tokens (its rows land last everywhere).
    const int64_t heavy = std::max<int64_t>(BS, static_cast<int64_t>(BS * o.skew));
    const int64_t my_bs = s.rank == s.W - 1 ? heavy : BS;
    std::vector<MicroBatch> mbs;
    for (int mb = 0; mb < 2; ++mb) mbs.push_back(make_micro_batch(o, s, mb, my_bs, heavy));
    Layer layer{make_ep_config(o, comm, s.layer.experts, o.comm_alg),
                ExpertBank(ExpertFn::kSwiglu, o.seed, s.layer.experts, s.layer.hidden, 16),
                s.rank * s.L, s.layer.hidden * static_cast<int64_t>(moe_ep::dtype_size(s.dtype)),
                s.dtype};
    layer.cfg.global_bs = s.W * heavy;
    // Expert work near the transfer time: time dispatch + combine and the experts at F = 16,
    // then scale F (--ffn overrides), the largest over ranks.
    const int reps = std::max<int64_t>(1, std::min<int64_t>(o.iters, 3));
    const double comm_s = timed(dog, reps, [&] {
      const DispatchOutputs d = moe_ep::dispatch_v2(mbs[0].inputs(), layer.cfg);
      moe_ep::combine_v2(layer.combine_inputs(mbs[0], d, d.expand_x), layer.cfg);
    });
    const DispatchOutputs d0 = moe_ep::dispatch_v2(mbs[0].inputs(), layer.cfg);
    int64_t ffn = o.ffn.value_or(0);
    if (ffn == 0) {
      const double expert_s = timed(dog, reps, [&] { layer.all(d0); });
      const double f = 16.0 * comm_s / std::max(expert_s, 1e-6);
      ffn = std::clamp<int64_t>(static_cast<int64_t>(f), 16, 1 << 16);
      dog.arm("the overlap bench's agreement on the FFN size");
      MPI_Allreduce(MPI_IN_PLACE, &ffn, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
      dog.disarm();
    }
    layer.bank = ExpertBank(ExpertFn::kSwiglu, o.seed, s.layer.experts, s.layer.hidden, ffn);
    const double expert_s = timed(dog, reps, [&] { layer.all(d0); });
    for (int i = 0; i < o.warmup; ++i) {
      sequential(layer, mbs);
      overlapped(layer, mbs);
    }
    std::vector<double> seq, ovl, whole, by_source;
    bool same = true;
    for (int64_t it = 0; it < o.iters; ++it) {
      std::vector<Tensor> a, b;
      seq.push_back(timed(dog, 1, [&] { a = sequential(layer, mbs); }));
      ovl.push_back(timed(dog, 1, [&] { b = overlapped(layer, mbs); }));
      same = same_bits(dog, a, b) && same;
      for (bool per_source : {false, true}) {
        barrier(dog);
        double done = 0;
        DispatchOutputs d;
        const Tensor y = experts_by_source(layer, mbs[0], per_source, now_s(), &done, &d);
        // The slow source itself waits for nobody's rows: its time is not the one at stake.
        const double mine = s.rank == s.W - 1 && s.W > 1 ? 0 : done;
        (per_source ? by_source : whole).push_back(max_over_ranks(dog, mine));
        moe_ep::combine_v2(layer.combine_inputs(mbs[0], d, y), layer.cfg);
      }
    }
    if (!same) ++fails;
    if (s.rank == 0) {
      std::printf(
          "tokens/rank %lld (last rank %lld), H %lld, K %lld, E %lld, W %lld, ffn %lld (%s)\n"
          "  dispatch+combine of one micro-batch %.3f ms, its experts %.3f ms\n"
          "  layer of 2 micro-batches, p50 of %lld: sequential %.3f ms, overlapped %.3f ms, "
          "ratio %.3f; outputs %s\n"
          "  experts done (ranks other than the last), p50: whole dispatch %.3f ms, per source "
          "%.3f ms, ratio %.3f\n",
          static_cast<long long>(BS), static_cast<long long>(heavy),
          static_cast<long long>(s.layer.hidden), static_cast<long long>(s.layer.top_k),
          static_cast<long long>(s.layer.experts), static_cast<long long>(s.W),
          static_cast<long long>(ffn), o.ffn ? "--ffn" : "sized to the transfer time", comm_s * 1e3,
          expert_s * 1e3, static_cast<long long>(o.iters), median(seq) * 1e3, median(ovl) * 1e3,
          median(ovl) / median(seq), same ? "bitwise equal" : "DIFFER (FAIL)", median(whole) * 1e3,
          median(by_source) * 1e3, median(by_source) / median(whole));
      std::fflush(stdout);
    }
  }
  return fails > 0 ? 1 : 0;
}

}  // namespace moe_ep_tool::bench
