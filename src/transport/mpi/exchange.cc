#include "transport/exchange.h"

#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory_resource>
#include <mutex>
#include <new>
#include <sstream>
#include <thread>

#include "base/check.h"
#include "base/threads.h"
#include "moe_ep/tensor.h"
#include "transport/communicator.h"
#include "transport/mpi/check.h"

namespace moe_ep::detail {

namespace {

std::string mpi_error_string(int rc) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) return cat("MPI error code ", rc);
  return std::string(msg, len);
}

// Buffers of abandoned requests: never freed (MPI may still write into them).
void bury(std::pmr::vector<std::shared_ptr<const void>>& buffers) {
  static std::mutex mu;
  static auto* graveyard = new std::vector<std::shared_ptr<const void>>();  // leaked on purpose
  std::lock_guard<std::mutex> lock(mu);
  for (auto& b : buffers) graveyard->push_back(std::move(b));
}

}  // namespace

void check_mpi(int rc, const char* op, const char* what) {
  if (rc == MPI_SUCCESS) return;
  fail(ErrorKind::kSystem, op, ": ", what, " failed: ", mpi_error_string(rc));
}

thread_local std::vector<std::string>* phase_trace = nullptr;

struct Exchange::State {
  State(const Communicator& comm, const char* op, const char* phase);
  ~State();
  void post(bool recv, void* buf, int count, MPI_Datatype type, int peer, int tag);
  MPI_Datatype row_type(int64_t row_bytes);
  void wait(const std::function<void(int peer)>& on_received);
  void make_room();  // capacity for one more request, reserved before it is posted
  // Marks the communicator unusable with `what` (the first failure only): require_comm refuses
  // later ops on it.
  void broken(std::string what) const;

  struct Posted {
    int peer;
    bool recv;
    int64_t done_us;    // after wait(): microseconds from its start to this request's completion
    MPI_Datatype type;  // what it was posted with
    MPI_Status status;  // after wait()
  };
  const Communicator& comm_;
  const char* op_;
  const char* phase_;
  alignas(std::max_align_t) std::byte arena_[4096];
  std::pmr::monotonic_buffer_resource pool_{arena_, sizeof(arena_)};
  std::pmr::vector<MPI_Request> reqs_{&pool_};  // contiguous, for MPI_Testsome
  std::pmr::vector<Posted> posted_{&pool_};     // one per request
  std::pmr::vector<std::shared_ptr<const void>> keep_{&pool_};
  // Row datatypes of the blocks past INT_MAX bytes, freed with the phase (MPI lets pending
  // requests finish).
  std::pmr::vector<MPI_Datatype> types_{&pool_};
};

Exchange::State& Exchange::state() { return *std::launder(reinterpret_cast<State*>(storage_)); }
const Exchange::State& Exchange::state() const {
  return *std::launder(reinterpret_cast<const State*>(storage_));
}

Exchange::Exchange(const Communicator& comm, const char* op, const char* phase) {
  static_assert(sizeof(State) <= kStateBytes && alignof(State) <= alignof(std::max_align_t),
                "Exchange::kStateBytes is too small for its State");
  new (storage_) State(comm, op, phase);
}
Exchange::~Exchange() { state().~State(); }

void Exchange::isend(const void* buf, int64_t bytes, int peer, int tag) {
  MOE_EP_CHECK(bytes >= 0 && bytes <= INT_MAX);
  state().post(false, const_cast<void*>(buf), static_cast<int>(bytes), MPI_BYTE, peer, tag);
}

void Exchange::irecv(void* buf, int64_t bytes, int peer, int tag) {
  MOE_EP_CHECK(bytes >= 0 && bytes <= INT_MAX);
  state().post(true, buf, static_cast<int>(bytes), MPI_BYTE, peer, tag);
}

// A block of up to INT_MAX bytes travels as bytes; a larger one as rows of a contiguous datatype
// (the type signatures are the same, so either side may use either form).
void Exchange::isend_rows(const void* buf, int64_t rows, int64_t row_bytes, int peer, int tag) {
  MOE_EP_CHECK(rows >= 0 && rows <= INT_MAX && row_bytes >= 0 && row_bytes <= INT_MAX);
  if (rows * row_bytes <= INT_MAX) return isend(buf, rows * row_bytes, peer, tag);
  State& s = state();
  s.post(false, const_cast<void*>(buf), static_cast<int>(rows), s.row_type(row_bytes), peer, tag);
}

void Exchange::irecv_rows(void* buf, int64_t rows, int64_t row_bytes, int peer, int tag) {
  MOE_EP_CHECK(rows >= 0 && rows <= INT_MAX && row_bytes >= 0 && row_bytes <= INT_MAX);
  if (rows * row_bytes <= INT_MAX) return irecv(buf, rows * row_bytes, peer, tag);
  State& s = state();
  s.post(true, buf, static_cast<int>(rows), s.row_type(row_bytes), peer, tag);
}

void Exchange::keep_alive(std::shared_ptr<const void> buffer) {
  state().keep_.push_back(std::move(buffer));
}

void Exchange::wait(const std::function<void(int peer)>& on_received) { state().wait(on_received); }

int Exchange::receives_from(int peer) const {
  const auto& posted = state().posted_;
  return static_cast<int>(std::count_if(posted.begin(), posted.end(), [&](const State::Posted& p) {
    return p.recv && p.peer == peer;
  }));
}

int64_t Exchange::received_bytes(int i) const {
  const State& s = state();
  int left = i;
  for (const State::Posted& p : s.posted_)
    if (p.recv && left-- == 0) {
      MPI_Count elements = 0;  // basic elements of its datatype: bytes (every type is of bytes)
      check_mpi(MPI_Get_elements_x(&p.status, p.type, &elements), s.op_, "MPI_Get_elements_x");
      return static_cast<int64_t>(elements);
    }
  fail(ErrorKind::kInternal, s.op_, ": no receive ", i, " in phase '", s.phase_, "'");
}

void Exchange::progress() const {
  int flag = 0;
  const State& s = state();
  check_mpi(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, s.comm_.mpi_comm(), &flag, MPI_STATUS_IGNORE),
            s.op_, "MPI_Iprobe");
}

void Exchange::add_recv_wait_us(int64_t* per_peer) const {
  std::vector<std::pair<int, int64_t>> last;  // (peer, latest completion)
  for (const State::Posted& p : state().posted_) {
    if (!p.recv) continue;
    auto it =
        std::find_if(last.begin(), last.end(), [&](const auto& pr) { return pr.first == p.peer; });
    if (it == last.end())
      last.emplace_back(p.peer, p.done_us);
    else
      it->second = std::max(it->second, p.done_us);
  }
  for (const auto& [peer, us] : last) per_peer[peer] += us;
}

Exchange::State::State(const Communicator& comm, const char* op, const char* phase)
    : comm_(comm), op_(op), phase_(phase) {
  if (phase_trace) phase_trace->push_back(phase);
  // A send and a receive per peer is the common phase; reserved at once, since the arena never
  // reuses what a growing vector gives back.
  const std::size_t expect = 2 * static_cast<std::size_t>(comm.size());
  reqs_.reserve(expect);
  posted_.reserve(expect);
  keep_.reserve(4);
}

Exchange::State::~State() {
  bool abandoned = false;
  for (std::size_t i = 0; i < reqs_.size(); ++i) {
    if (reqs_[i] == MPI_REQUEST_NULL) continue;
    abandoned = true;
    if (posted_[i].recv) MPI_Cancel(&reqs_[i]);
    MPI_Request_free(&reqs_[i]);
  }
  if (abandoned) bury(keep_);
  if (types_.empty()) return;
  int finalized = 1;
  MPI_Finalized(&finalized);
  for (MPI_Datatype& t : types_)
    if (!finalized) MPI_Type_free(&t);
}

void Exchange::State::make_room() {
  if (reqs_.size() < reqs_.capacity() && posted_.size() < posted_.capacity()) return;
  const std::size_t n = 2 * reqs_.size() + 8;
  reqs_.reserve(n);
  posted_.reserve(n);
}

MPI_Datatype Exchange::State::row_type(int64_t row_bytes) {
  MPI_Datatype t;
  check_mpi(MPI_Type_contiguous(static_cast<int>(row_bytes), MPI_BYTE, &t), op_,
            "MPI_Type_contiguous");
  const int rc = MPI_Type_commit(&t);
  if (rc != MPI_SUCCESS) MPI_Type_free(&t);
  check_mpi(rc, op_, "MPI_Type_commit");
  types_.push_back(t);
  return t;
}

void Exchange::State::post(bool recv, void* buf, int count, MPI_Datatype type, int peer, int tag) {
  make_room();  // a posted request is always recorded (nothing can throw after MPI_Isend)
  MPI_Request r = MPI_REQUEST_NULL;
  if (recv) {
    check_mpi(MPI_Irecv(buf, count, type, peer, tag, comm_.mpi_comm(), &r), op_, "MPI_Irecv");
  } else {
    check_mpi(MPI_Isend(buf, count, type, peer, tag, comm_.mpi_comm(), &r), op_, "MPI_Isend");
    int size = 0;
    MPI_Type_size(type, &size);
    CommInternals::traffic(comm_).message_bytes[static_cast<std::size_t>(peer)] +=
        int64_t{count} * size;
  }
  reqs_.push_back(r);
  posted_.push_back({peer, recv, 0, type, {}});
}

void Exchange::State::wait(const std::function<void(int peer)>& on_received) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // Capped at 10^9 s (~31 years): larger values mean "no deadline" to the caller, and would
  // overflow the clock's 64-bit nanoseconds (a deadline in the past: an immediate timeout).
  const double timeout_s = std::min(comm_.timeout_s(), 1e9);
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  const int n = static_cast<int>(reqs_.size());
  std::pmr::vector<MPI_Status> got(static_cast<std::size_t>(n), &pool_);
  std::pmr::vector<int> idx(static_cast<std::size_t>(n), &pool_);
  std::string mpi_failure;
  bool truncated = false;
  int idle = 0;
  auto idle_since = start;
  const bool poll = cpus_for_every_rank();
  // on_received: receives still pending per peer, and the peers whose last one just completed.
  std::pmr::vector<int> pending_from(on_received ? comm_.size() : 0, 0, &pool_);
  std::pmr::vector<int> received(&pool_);
  for (const Posted& p : posted_)
    if (on_received && p.recv) ++pending_from[static_cast<std::size_t>(p.peer)];
  for (;;) {
    int outcount = 0;
    const int rc = MPI_Testsome(n, reqs_.data(), &outcount, idx.data(), got.data());
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) check_mpi(rc, op_, "MPI_Testsome");
    if (outcount == MPI_UNDEFINED) break;  // every request is complete
    const int64_t now_us =
        outcount > 0
            ? std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count()
            : 0;
    for (int j = 0; j < outcount; ++j) {
      Posted& done = posted_[idx[j]];
      done.status = got[j];
      done.done_us = now_us;
      if (rc == MPI_ERR_IN_STATUS && got[j].MPI_ERROR != MPI_SUCCESS && mpi_failure.empty()) {
        int cls = 0;
        MPI_Error_class(got[j].MPI_ERROR, &cls);
        truncated = cls == MPI_ERR_TRUNCATE;
        mpi_failure = cat((done.recv ? "receive from rank " : "send to rank "), done.peer, ": ",
                          mpi_error_string(got[j].MPI_ERROR));
      }
      if (on_received && done.recv && --pending_from[static_cast<std::size_t>(done.peer)] == 0)
        received.push_back(done.peer);
    }
    if (mpi_failure.empty()) {
      try {
        for (int peer : received) on_received(peer);
      } catch (const std::exception& e) {
        // Other peers' messages of this phase are still in flight: no later op may take them.
        broken(cat(op_, " failed in phase '", phase_, "' while taking a peer's data: ", e.what()));
        throw;
      }
    }
    received.clear();
    if (outcount > 0) {
      idle = 0;
      idle_since = Clock::now();
      continue;
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      std::vector<int> late;
      int pending = 0;
      for (int i = 0; i < n; ++i)
        if (reqs_[i] != MPI_REQUEST_NULL) {
          ++pending;
          late.push_back(posted_[i].peer);
        }
      std::sort(late.begin(), late.end());
      late.erase(std::unique(late.begin(), late.end()), late.end());
      std::ostringstream peers;
      for (std::size_t i = 0; i < late.size(); ++i) peers << (i ? ", " : "") << late[i];
      broken(cat(op_, " timed out in phase '", phase_, "' waiting for rank(s) ", peers.str()));
      fail(ErrorKind::kTimeout, op_, ": rank ", comm_.rank(), " timed out after ",
           comm_.timeout_s(), " s in phase '", phase_, "' waiting for rank(s) ", peers.str(), " (",
           pending, " of ", n, " requests pending; a rank may not have called ", op_,
           " or may have failed)");
    }
    // Backoff: oversubscribed ranks (more ranks than cores) must leave the CPU to their peers.
    // When every rank of this machine has a CPU, poll without yielding for the first kPoll
    // after the last completion: a peer a few microseconds behind is then seen at once (a
    // round of small messages took 3.6 us with the yield below, 1.2-1.4 us with this; docs/
    // performance.md, "Small batches"). Then sched_yield until kSpin (cheap when nobody else
    // is runnable; a peer a fraction of a millisecond behind is then seen at once, where a
    // sleep cost up to 0.3 ms: measured in dispatch_v2), then sleeps of 20 us doubling to
    // 200 us.
    constexpr auto kPoll = std::chrono::microseconds(20);
    constexpr auto kSpin = std::chrono::milliseconds(2);
    const auto idle_for = now - idle_since;
    if (poll && idle_for < kPoll) continue;
    if (idle_for < kSpin) {
      sched_yield();
    } else {
      const int us = std::min(200, 20 << std::min(idle++, 4));
      std::this_thread::sleep_for(std::chrono::microseconds(us));
    }
  }
  if (truncated)
    fail(ErrorKind::kInternal, op_, ": rank ", comm_.rank(),
         " received more data than posted for in phase '", phase_, "' (", mpi_failure,
         "); every receive is sized from what its sender announced, so "
         "this is a bug (please report it)");
  if (!mpi_failure.empty()) {
    broken(cat(op_, " failed in MPI in phase '", phase_, "': ", mpi_failure));
    fail(ErrorKind::kSystem, op_, ": MPI failed in phase '", phase_, "' on rank ", comm_.rank(),
         ": ", mpi_failure);
  }
}

void Exchange::State::broken(std::string what) const {
  std::string& first = CommInternals::broken(comm_);
  if (first.empty()) first = std::move(what);
}

}  // namespace moe_ep::detail
