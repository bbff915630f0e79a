// What the dispatch handle (SPEC §7) saves: dispatch_v2 plain against cached (the handle of an
// earlier dispatch of the same routing: no counts phase), and combine_v2 with the SPEC tensors
// against with the handle (no "layout back" round, no per-row checks), in the same job,
// interleaved: rounds of `--calls` calls of one variant then the other, so that drift of this
// shared machine hits both alike. Each round's time is the max over ranks of its mean per call;
// the table gives the median over rounds, in microseconds, and the ratio plain / handle (a
// round's mean already smooths single slow calls, so no p99 is given). The cached dispatch and
// the combine with the handle are checked equal (bitwise) to the plain ones before timing.
//   mpirun -n 2 build/bin/moe-ep-bench-handle [--tokens 1,16,128] [--hidden 7168] [--experts 64]
//       [--top-k 8] [--rounds 15] [--calls 200] [--transport shm|mpi]
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/tensor.h"

namespace {

struct Options {
  std::vector<int64_t> tokens{1, 16, 128};
  int64_t hidden = 7168, experts = 64, top_k = 8;
  int rounds = 15, calls = 200;
  std::string transport;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "moe-ep-bench-handle: error: %s\nusage: moe-ep-bench-handle [--tokens 1,16,128] "
               "[--hidden N] [--experts N] [--top-k N] [--rounds N] [--calls N] "
               "[--transport shm|mpi]\n",
               why);
  MPI_Finalize();
  std::exit(2);
}

int64_t positive(const char* flag, const char* v) {
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (*end != '\0' || end == v || n < 1)
    usage((std::string(flag) + " needs an integer >= 1").c_str());
  return n;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + a).c_str());
    const char* v = argv[++i];
    if (a == "--tokens") {
      o.tokens.clear();
      for (const char* p = v; *p;) {
        const char* comma = std::strchr(p, ',');
        const std::string item(p, comma ? comma - p : std::strlen(p));
        o.tokens.push_back(positive("--tokens", item.c_str()));
        p = comma ? comma + 1 : p + item.size();
      }
    } else if (a == "--hidden") {
      o.hidden = positive("--hidden", v);
    } else if (a == "--experts") {
      o.experts = positive("--experts", v);
    } else if (a == "--top-k") {
      o.top_k = positive("--top-k", v);
    } else if (a == "--rounds") {
      o.rounds = static_cast<int>(positive("--rounds", v));
    } else if (a == "--calls") {
      o.calls = static_cast<int>(positive("--calls", v));
    } else if (a == "--transport") {
      o.transport = v;
    } else {
      usage(("unknown option " + a).c_str());
    }
  }
  return o;
}

// One batch of this rank: bf16 x, distinct top-k ids drawn uniformly, weights.
struct Batch {
  std::vector<uint16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> scales;
};

Batch make_batch(const Options& o, int64_t bs, int rank) {
  Batch b;
  uint64_t s = 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(rank + 1) + static_cast<uint64_t>(bs);
  auto next = [&] {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    return s;
  };
  for (int64_t i = 0; i < bs * o.hidden; ++i)
    b.x.push_back(moe_ep::float_to_bf16(static_cast<float>(next() % 1000) / 500.0f - 1.0f));
  std::vector<int32_t> pool(static_cast<std::size_t>(o.experts));
  for (int64_t i = 0; i < bs; ++i) {
    for (int32_t e = 0; e < o.experts; ++e) pool[e] = e;
    for (int64_t k = 0; k < o.top_k; ++k) {
      std::swap(pool[k], pool[k + next() % (o.experts - k)]);
      b.ids.push_back(pool[k]);
      b.scales.push_back(static_cast<float>(1 + next() % 7) / 8.0f);
    }
  }
  return b;
}

double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The median over rounds of the max over ranks of the mean time per call, of a and b interleaved.
std::pair<double, double> time_pair(const Options& o, const std::function<void()>& a,
                                    const std::function<void()>& b) {
  std::vector<double> ta, tb;
  for (int r = 0; r < o.rounds; ++r)
    for (int v = 0; v < 2; ++v) {
      const auto& f = v == 0 ? a : b;
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = now_us();
      for (int c = 0; c < o.calls; ++c) f();
      double mean = (now_us() - t0) / o.calls, worst = 0;
      MPI_Allreduce(&mean, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      (v == 0 ? ta : tb).push_back(worst);
    }
  auto median = [](std::vector<double> t) {
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  return {median(ta), median(tb)};
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const Options o = parse(argc, argv);
  int rank = 0, W = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &W);
  if (o.experts % W != 0 || o.top_k > o.experts)
    usage("--experts must be a multiple of the ranks, >= --top-k");
  try {
    auto comm = moe_ep::Communicator::from_mpi(MPI_COMM_WORLD);
    moe_ep::EpConfig cfg;
    cfg.group_ep = comm.get();
    cfg.ep_world_size = W;
    cfg.ep_rank_id = rank;
    cfg.moe_expert_num = o.experts;
    cfg.transport = o.transport;
    if (rank == 0)
      std::printf(
          "moe-ep-bench-handle: W %d  H %lld  E %lld  top-%lld  bf16  %d rounds x %d calls"
          "  (us per call, median over rounds of the max over ranks)\n"
          "%8s %14s %14s %7s %14s %14s %7s\n",
          W, static_cast<long long>(o.hidden), static_cast<long long>(o.experts),
          static_cast<long long>(o.top_k), o.rounds, o.calls, "tokens", "dispatch", "cached",
          "ratio", "combine", "with handle", "ratio");
    for (const int64_t bs : o.tokens) {
      Batch b = make_batch(o, bs, rank);
      moe_ep::DispatchInputs din;
      din.x = moe_ep::TensorView::contiguous(b.x.data(), moe_ep::DType::kBF16, {bs, o.hidden});
      din.expert_ids =
          moe_ep::TensorView::contiguous(b.ids.data(), moe_ep::DType::kI32, {bs, o.top_k});
      const moe_ep::DispatchOutputs d = moe_ep::dispatch_v2(din, cfg);
      moe_ep::DispatchInputs cached = din;
      cached.handle = &d.handle;
      moe_ep::CombineInputs plain;
      plain.expand_x = d.expand_x;  // identity experts, in place
      plain.expert_ids = din.expert_ids;
      plain.expert_scales =
          moe_ep::TensorView::contiguous(b.scales.data(), moe_ep::DType::kF32, {bs, o.top_k});
      plain.assist_info_for_combine = d.assist_info_for_combine;
      plain.ep_send_counts = d.ep_recv_counts;
      moe_ep::CombineInputs with = plain;
      with.handle = &d.handle;
      with.assist_info_for_combine = {};
      with.ep_send_counts = {};
      {  // the cached dispatch's valid rows and layout are the first call's
        const moe_ep::DispatchOutputs dc = moe_ep::dispatch_v2(cached, cfg);
        const int64_t valid = d.tp_recv_counts.ptr<int32_t>()[0];
        if (std::memcmp(dc.expand_x.data(), d.expand_x.data(), valid * o.hidden * 2) != 0 ||
            std::memcmp(dc.ep_recv_counts.data(), d.ep_recv_counts.data(),
                        d.ep_recv_counts.nbytes()) != 0) {
          std::fprintf(stderr, "rank %d: the cached dispatch_v2 differs from the first\n", rank);
          MPI_Abort(MPI_COMM_WORLD, 1);
        }
      }
      const moe_ep::Tensor x1 = moe_ep::combine_v2(plain, cfg), x2 = moe_ep::combine_v2(with, cfg);
      if (std::memcmp(x1.data(), x2.data(), x1.nbytes()) != 0) {
        std::fprintf(stderr, "rank %d: combine_v2 with the handle differs from without\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
      }
      const auto [dp, dc] = time_pair(
          o, [&] { moe_ep::dispatch_v2(din, cfg); }, [&] { moe_ep::dispatch_v2(cached, cfg); });
      const auto [cp, ch] = time_pair(
          o, [&] { moe_ep::combine_v2(plain, cfg); }, [&] { moe_ep::combine_v2(with, cfg); });
      if (rank == 0)
        std::printf("%8lld %14.2f %14.2f %6.2fx %14.2f %14.2f %6.2fx\n", static_cast<long long>(bs),
                    dp, dc, dp / dc, cp, ch, cp / ch);
    }
  } catch (const moe_ep::Error& e) {
    std::fprintf(stderr, "moe-ep-bench-handle: error: %s: %s\n", moe_ep::error_kind_name(e.kind()),
                 e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  MPI_Finalize();
  return 0;
}
