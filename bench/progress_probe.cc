// Does an asynchronous MPI exchange move while its caller computes? Ranks 2i and 2i+1 swap M bytes
// (Isend + Irecv both ways) while each computes for C ms, in three progress modes, against the
// transfer alone and the compute alone:
//   no progress      post, compute without any MPI call, Waitall
//   caller polls     post, compute in slices of --poll-us with MPI_Testall between them, Waitall
//   progress thread  a helper thread posts and loops MPI_Testall (yield, then sleeps backing off)
//                    while the main thread computes; join
// The compute is a fixed amount of work (sums over a 64 MiB array), calibrated to take C ms alone,
// so that CPU stolen by MPI or by the helper thread shows up as time, not as less work done.
// Each time is the max over ranks of one iteration, median over --iters; the modes are interleaved
// per iteration so that drift of a shared machine hits all alike. ratio = total / (transfer +
// compute): 1 is no overlap, 0.5 is perfect overlap of equal parts.
//   mpirun -n 2 progress_probe [--bytes 65536,1048576,8388608] [--compute-ms C] [--iters 10]
//       [--poll-us 100] [--max-sleep-us 50] [--json FILE]
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Options {
  std::vector<long> bytes{8 << 20};
  double compute_ms = 0;  // 0: the measured transfer time of each size
  int iters = 10, poll_us = 100, max_sleep_us = 50;
  std::string json;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "progress_probe: error: %s\nusage: progress_probe [--bytes N[,N...]] "
               "[--compute-ms C] [--iters N] [--poll-us N] [--max-sleep-us N] [--json FILE]\n",
               why);
  MPI_Abort(MPI_COMM_WORLD, 2);
  std::exit(2);
}

double number(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (*end != '\0' || v.empty() || !(x > 0)) usage((flag + " needs a number > 0").c_str());
  return x;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + a).c_str());
    const std::string v = argv[i + 1];
    if (a == "--bytes") {
      o.bytes.clear();
      for (std::size_t p = 0; p <= v.size();) {
        const std::size_t comma = std::min(v.find(',', p), v.size());
        o.bytes.push_back(static_cast<long>(number(a, v.substr(p, comma - p))));
        p = comma + 1;
      }
    } else if (a == "--compute-ms") {
      o.compute_ms = number(a, v);
    } else if (a == "--iters") {
      o.iters = static_cast<int>(number(a, v));
    } else if (a == "--poll-us") {
      o.poll_us = static_cast<int>(number(a, v));
    } else if (a == "--max-sleep-us") {
      o.max_sleep_us = static_cast<int>(number(a, v));
    } else if (a == "--json") {
      o.json = v;
    } else {
      usage(("unknown option " + a).c_str());
    }
  }
  return o;
}

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Streaming sums over an array larger than the caches: memory traffic like a real expert's
// weights, which also competes with the shared-memory copies of the transfer.
class Compute {
 public:
  static constexpr std::size_t kChunk = 2048;  // doubles (16 KiB): ~1-2 us, the poll granularity

  Compute() : data_((64u << 20) / sizeof(double)) {
    for (std::size_t i = 0; i < data_.size(); ++i) data_[i] = static_cast<double>(i % 1000);
  }

  // Runs `chunks` chunks, calling poll every `every` chunks (0: never).
  void run(long chunks, long every = 0, const std::function<void()>& poll = {}) {
    for (long c = 0; c < chunks; ++c) {
      sink_ += sum(data_.data() + (next_++ % (data_.size() / kChunk)) * kChunk);
      if (every && (c + 1) % every == 0) poll();
    }
  }

  // How many chunks take `ms` here: the fastest of 3 timings over at least 10 ms, scaled, since
  // a disturbance (page faults, another process) only ever slows a timing down.
  long calibrate(double ms) {
    const double span = std::max(ms, 10.0);
    long best = 0;
    for (int pass = 0; pass < 3; ++pass) {
      long chunks = 0;
      for (const auto t0 = Clock::now(); ms_since(t0) < span; chunks += 16) run(16);
      best = std::max(best, chunks);
    }
    return std::max(1L, std::lround(best * ms / span));
  }

  double sink() const { return sink_; }

 private:
  // Out of line with independent partial sums, so that the loop's code (and speed) is the same
  // whether or not run() polls: an inlined single sum kept live across poll() was spilled to the
  // stack and ran twice as slow.
  [[gnu::noinline]] static double sum(const double* p) {
    double s[8] = {};
    for (std::size_t i = 0; i < kChunk; i += 8)
      for (int j = 0; j < 8; ++j) s[j] += p[i + j];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  }

  std::vector<double> data_;
  std::size_t next_ = 0;
  double sink_ = 0;
};

// Both directions of one pair's exchange.
struct Exchange {
  int partner;
  std::vector<char> out, in;
  MPI_Request req[2];

  Exchange(int partner_rank, long bytes, int rank)
      : partner(partner_rank), out(bytes, static_cast<char>('a' + rank % 26)), in(bytes, 0) {}
  void post() {
    MPI_Irecv(in.data(), static_cast<int>(in.size()), MPI_BYTE, partner, 7, MPI_COMM_WORLD,
              &req[0]);
    MPI_Isend(out.data(), static_cast<int>(out.size()), MPI_BYTE, partner, 7, MPI_COMM_WORLD,
              &req[1]);
  }
  bool test() {
    int done = 0;
    MPI_Testall(2, req, &done, MPI_STATUSES_IGNORE);
    return done;
  }
  void wait() { MPI_Waitall(2, req, MPI_STATUSES_IGNORE); }
  bool arrived() const {  // the partner's fill byte at both ends: a cheap check of each transfer
    const char want = static_cast<char>('a' + partner % 26);
    return in.front() == want && in.back() == want;
  }
};

// A progress engine's loop: Testall, yield for a while (the message may be about to land), then
// sleep, doubling up to max_sleep_us, so that a long transfer does not burn a core.
void progress_loop(Exchange& x, int max_sleep_us) {
  int sleep_us = 1;
  for (int tries = 0; !x.test(); ++tries) {
    if (tries < 64) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
      sleep_us = std::min(2 * sleep_us, max_sleep_us);
    }
  }
}

enum Mode { kTransfer, kCompute, kNoProgress, kPoll, kThread, kThreadCompute, kModes };
const char* const kNames[kModes] = {"transfer",     "compute",         "no_progress",
                                    "caller_polls", "progress_thread", "thread_compute"};

struct Row {
  long bytes, chunks;
  double ms[kModes];  // median over iterations of the max over ranks
};

double median(std::vector<double> t) {
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Median over iterations of the max over ranks of each iteration's time, for each mode.
void reduce(std::vector<double> (&t)[kModes], double (&out)[kModes]) {
  for (int m = 0; m < kModes; ++m) {
    MPI_Allreduce(MPI_IN_PLACE, t[m].data(), static_cast<int>(t[m].size()), MPI_DOUBLE, MPI_MAX,
                  MPI_COMM_WORLD);
    out[m] = median(t[m]);
  }
}

// Runs one size: the transfer alone first (it sets C by default), then the modes interleaved.
Row measure(long bytes, const Options& o, Compute& work, int rank) {
  Exchange x(rank ^ 1, bytes, rank);
  std::vector<double> t[kModes];
  auto timed = [&](Mode m, const std::function<void()>& f) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = Clock::now();
    f();
    t[m].push_back(ms_since(t0));
  };
  auto transfer = [&] { x.post(), x.wait(); };
  transfer();  // connection set-up and first-touch of the buffers, untimed
  for (int i = 0; i < o.iters; ++i) timed(kTransfer, transfer);
  double c_ms = o.compute_ms;
  if (c_ms == 0) {
    MPI_Allreduce(MPI_IN_PLACE, t[kTransfer].data(), o.iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    c_ms = median(t[kTransfer]);
  }
  t[kTransfer].clear();
  Row r{bytes, work.calibrate(c_ms), {}};
  // Chunks per poll slice, from the calibrated rate.
  const long every = std::max(1L, std::lround(r.chunks * o.poll_us / (1000 * c_ms)));
  bool ok = true;
  for (int i = 0; i < o.iters; ++i) {
    timed(kTransfer, transfer);
    ok &= x.arrived();
    timed(kCompute, [&] { work.run(r.chunks); });
    timed(kNoProgress, [&] { x.post(), work.run(r.chunks), x.wait(); });
    timed(kPoll, [&] {
      x.post();
      bool done = false;
      work.run(r.chunks, every, [&] { done = done || x.test(); });
      x.wait();
    });
    timed(kThread, [&] {
      std::thread helper([&] { x.post(), progress_loop(x, o.max_sleep_us); });
      const auto c0 = Clock::now();
      work.run(r.chunks);
      t[kThreadCompute].push_back(ms_since(c0));
      helper.join();
    });
    ok &= x.arrived();
  }
  if (!ok) {
    std::fprintf(stderr, "progress_probe: rank %d: wrong data from rank %d\n", rank, x.partner);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  reduce(t, r.ms);
  return r;
}

void report(const std::vector<Row>& rows, const Options& o, int size) {
  std::printf("progress_probe: %d ranks (pairs 2i,2i+1), median of %d, poll every %d us\n", size,
              o.iters, o.poll_us);
  std::printf("%10s %9s %9s %16s %16s %16s %9s\n", "bytes", "xfer ms", "comp ms", "no-progress",
              "caller-polls", "prog-thread", "comp slow");
  for (const Row& r : rows) {
    const double seq = r.ms[kTransfer] + r.ms[kCompute];
    std::printf("%10ld %9.3f %9.3f", r.bytes, r.ms[kTransfer], r.ms[kCompute]);
    for (Mode m : {kNoProgress, kPoll, kThread})
      std::printf(" %9.3f (%.2f)", r.ms[m], r.ms[m] / seq);
    std::printf(" %8.2fx\n", r.ms[kThreadCompute] / r.ms[kCompute]);
  }
  if (o.json.empty()) return;
  FILE* f = std::fopen(o.json.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "progress_probe: cannot write %s\n", o.json.c_str());
    return;
  }
  char lib[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(lib, &len);
  const std::string first_line(lib, std::strcspn(lib, "\n,"));
  std::fprintf(f, "{\"mpi\": \"%s\", \"ranks\": %d, \"iters\": %d, \"poll_us\": %d, \"rows\": [",
               first_line.c_str(), size, o.iters, o.poll_us);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const double seq = r.ms[kTransfer] + r.ms[kCompute];
    std::fprintf(f, "%s\n  {\"bytes\": %ld", i ? "," : "", r.bytes);
    for (int m = 0; m < kModes; ++m) std::fprintf(f, ", \"%s_ms\": %.4f", kNames[m], r.ms[m]);
    for (Mode m : {kNoProgress, kPoll, kThread})
      std::fprintf(f, ", \"%s_ratio\": %.4f", kNames[m], r.ms[m] / seq);
    std::fprintf(f, ", \"thread_compute_slowdown\": %.4f}", r.ms[kThreadCompute] / r.ms[kCompute]);
  }
  std::fprintf(f, "\n]}\n");
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (provided < MPI_THREAD_MULTIPLE) {
    if (rank == 0)
      std::fprintf(stderr, "progress_probe: MPI gives thread level %d, needs MPI_THREAD_MULTIPLE\n",
                   provided);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (size % 2) usage("needs an even number of ranks (pairs 2i, 2i+1)");
  const Options o = parse(argc, argv);
  Compute work;
  std::vector<Row> rows;
  for (long b : o.bytes) rows.push_back(measure(b, o, work, rank));
  if (rank == 0) report(rows, o, size);
  if (work.sink() == 42.0) std::printf("\n");  // keeps the sums observable
  MPI_Finalize();
  return 0;
}
