// The size query dispatch_workspace() and CommOptions::shm_window_bytes (issue 6, "Buffers"):
// the query's sizes equal the nbytes of what dispatch_v2 and combine_v2 then return, for bf16
// and int8, on both transports; a window reserved from the query holds that many live outputs in
// its first generation (no call grows it); bad arguments raise errors naming the value.
#include <gtest/gtest.h>
#include <mpi.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "mpi/common.h"
#include "transport/communicator.h"
#include "transport/windows.h"

namespace moe_ep {
namespace {

constexpr int64_t kL = 4, kK = 3, kBS = 10;

struct Inputs {
  Tensor x, ids, scales;
};

// BS tokens of H values, each routed to kK distinct experts of E (token i: experts i, i + 1, ...
// wrapping, shifted by the rank), weights 1/kK.
Inputs make_inputs(int64_t BS, int64_t H, int64_t E, int rank) {
  Inputs in;
  in.x = Tensor::empty(DType::kBF16, {BS, H});
  auto* px = in.x.ptr<uint16_t>();
  for (int64_t i = 0; i < BS * H; ++i) px[i] = static_cast<uint16_t>(0x3f80 + (i % 64));
  in.ids = Tensor::empty(DType::kI32, {BS, kK});
  in.scales = Tensor::empty(DType::kF32, {BS, kK});
  for (int64_t i = 0; i < BS; ++i)
    for (int64_t k = 0; k < kK; ++k) {
      in.ids.ptr<int32_t>()[i * kK + k] = static_cast<int32_t>((i + rank + k) % E);
      in.scales.ptr<float>()[i * kK + k] = 1.0f / kK;
    }
  return in;
}

EpConfig make_cfg(Communicator& comm, const std::string& transport) {
  EpConfig cfg;
  cfg.group_ep = &comm;
  cfg.ep_world_size = comm.size();
  cfg.ep_rank_id = comm.rank();
  cfg.moe_expert_num = kL * comm.size();
  cfg.transport = transport;
  return cfg;
}

std::shared_ptr<Communicator> world_comm(int64_t shm_window_bytes = 0) {
  CommOptions o;
  o.shm_window_bytes = shm_window_bytes;
  return Communicator::from_mpi(MPI_COMM_WORLD, o);
}

int64_t nbytes(const Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

TEST(Workspace, SizesEqualTheOutputs) {
  auto comm = world_comm();
  const int rank = comm->rank();
  const int64_t H = 96, E = kL * comm->size();
  for (const std::string transport : {"shm", "mpi"})
    for (const int64_t quant : {0, 2}) {
      SCOPED_TRACE("transport " + transport + ", quant_mode " + std::to_string(quant));
      const EpConfig cfg = make_cfg(*comm, transport);
      const DispatchWorkspace w = dispatch_workspace(cfg, kBS, H, kK, DType::kBF16, quant);
      const Inputs in = make_inputs(kBS, H, E, rank);
      DispatchInputs din;
      din.x = in.x;
      din.expert_ids = in.ids;
      din.expert_scales = in.scales.view();
      din.quant_mode = quant;
      const DispatchOutputs d = dispatch_v2(din, cfg);
      // A = G * min(L, K) with G = BS * W (SPEC §1.4), written out independently.
      EXPECT_EQ(w.recv_rows, kBS * comm->size() * std::min(kL, kK));
      EXPECT_EQ(w.recv_rows, d.expand_x.size(0));
      EXPECT_EQ(w.expand_x_bytes, nbytes(d.expand_x));
      EXPECT_EQ(w.expand_x_bytes, w.recv_rows * H * (quant == 2 ? 1 : 2));
      EXPECT_EQ(w.other_outputs_bytes, nbytes(d.dynamic_scales) +
                                           nbytes(d.assist_info_for_combine) +
                                           nbytes(d.expert_token_nums) + nbytes(d.ep_recv_counts) +
                                           nbytes(d.tp_recv_counts) + nbytes(d.expand_scales));
      if (transport == "shm") {
        // The slot covers expand_x, then from a 64-byte boundary 16 bytes of metadata per row
        // (4 KiB granules); expand_x lies in this rank's window.
        const int64_t need = (w.expand_x_bytes + 63) / 64 * 64 + w.recv_rows * 16;
        EXPECT_GE(w.shm_slot_bytes, need);
        EXPECT_LT(w.shm_slot_bytes, need + 4096);
        EXPECT_EQ(w.shm_slot_bytes % 4096, 0);
        const auto& ctx = detail::CommInternals::shm(*comm);
        int gen = 0;
        int64_t off = 0;
        EXPECT_TRUE(ctx && ctx->locate(d.expand_x.data(), w.expand_x_bytes, gen, off));
        // Staging holds up to A rows of the experts' outputs (x's dtype); with comm_quant_mode 2,
        // A int8 rows, then from a 64-byte boundary their fp32 scales.
        EXPECT_GE(w.shm_stage_bytes, w.recv_rows * H * 2);
        const DispatchWorkspace wq = dispatch_workspace(cfg, kBS, H, kK, DType::kBF16, quant, 2);
        const int64_t int8_stage = (w.recv_rows * H + 63) / 64 * 64 + w.recv_rows * 4;
        EXPECT_GE(wq.shm_stage_bytes, int8_stage);
        EXPECT_LT(wq.shm_stage_bytes, int8_stage + 4096);
      } else {
        EXPECT_EQ(w.shm_slot_bytes, 0);
        EXPECT_EQ(w.shm_stage_bytes, 0);
      }
      if (quant == 2) continue;  // combine_v2 takes the experts' bf16 rows: run it on bf16 only
      CombineInputs cin;
      cin.expand_x = d.expand_x;
      cin.expert_ids = in.ids;
      cin.assist_info_for_combine = d.assist_info_for_combine;
      cin.ep_send_counts = d.ep_recv_counts;
      cin.expert_scales = in.scales;
      EXPECT_EQ(w.combine_output_bytes, nbytes(combine_v2(cin, cfg)));
    }
}

// With the window sized from the query for n live outputs and a combine (n x shm_slot_bytes +
// shm_stage_bytes), n dispatch_v2 calls whose outputs are all kept alive each receive into the
// window, in its first generation, and a combine_v2 of experts that wrote elsewhere still finds
// room for its staging rows: nothing grew the window. H is large enough that this exceeds both
// the 1 MiB minimum and twice one call's need (what the window would be without the reservation).
TEST(Workspace, ReservedWindowHoldsTheLiveOutputsAndACombine) {
  const int64_t H = 4096, n = 5;
  DispatchWorkspace w;
  {
    auto probe = world_comm();
    w = dispatch_workspace(make_cfg(*probe, "shm"), kBS, H, kK, DType::kBF16);
  }
  ASSERT_GT(w.shm_slot_bytes, 0);
  const int64_t reserve = n * w.shm_slot_bytes + w.shm_stage_bytes;
  ASSERT_GT(reserve, std::max<int64_t>(2 * w.shm_slot_bytes, int64_t{1} << 20));
  auto comm = world_comm(reserve);
  EXPECT_EQ(comm->shm_window_bytes(), reserve);
  const EpConfig cfg = make_cfg(*comm, "shm");
  const Inputs in = make_inputs(kBS, H, kL * comm->size(), comm->rank());
  std::vector<DispatchOutputs> live;
  for (int64_t c = 0; c < n; ++c) {
    DispatchInputs din;
    din.x = in.x;
    din.expert_ids = in.ids;
    live.push_back(dispatch_v2(din, cfg));
  }
  const auto& ctx = detail::CommInternals::shm(*comm);
  ASSERT_TRUE(ctx);
  EXPECT_EQ(ctx->capacity(), reserve);
  for (int64_t c = 0; c < n; ++c) {
    int gen = -1;
    int64_t off = -1;
    EXPECT_TRUE(ctx->locate(live[c].expand_x.data(), nbytes(live[c].expand_x), gen, off))
        << "call " << c << ": expand_x is not in the window";
    EXPECT_EQ(gen, 0) << "call " << c;
  }
  // The staging slot a combine of out-of-place expert outputs needs is free.
  EXPECT_TRUE(ctx->try_alloc(w.shm_stage_bytes).has_value());
  // Such a combine (the rows copied out of the window first) equals the in-place one, and the
  // window is still the first one.
  const DispatchOutputs& d = live.back();
  Tensor y = Tensor::empty(DType::kBF16, {d.expand_x.size(0), H});
  std::memcpy(y.data(), d.expand_x.data(), d.expand_x.nbytes());
  CombineInputs cin;
  cin.expert_ids = in.ids;
  cin.assist_info_for_combine = d.assist_info_for_combine;
  cin.ep_send_counts = d.ep_recv_counts;
  cin.expert_scales = in.scales;
  cin.expand_x = y;
  const Tensor staged = combine_v2(cin, cfg);
  cin.expand_x = d.expand_x;
  const Tensor in_place = combine_v2(cin, cfg);
  EXPECT_EQ(std::memcmp(staged.data(), in_place.data(), staged.nbytes()), 0);
  EXPECT_EQ(ctx->capacity(), reserve);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// The defined part of two dispatch_v2 outputs is equal: the valid rows of expand_x (the last
// running count of ep_recv_counts), 3 entries per valid row of assist_info_for_combine, and the
// counts; rows past the valid ones are unspecified (SPEC §1.4).
void expect_same_dispatch(const DispatchOutputs& a, const DispatchOutputs& b, int call) {
  SCOPED_TRACE("call " + std::to_string(call));
  ASSERT_TRUE(same_bytes(a.ep_recv_counts, b.ep_recv_counts));
  const int64_t n = a.ep_recv_counts.numel();
  const int64_t valid = n > 0 ? a.ep_recv_counts.ptr<int32_t>()[n - 1] : 0;
  const auto row = static_cast<std::size_t>(a.expand_x.nbytes() / a.expand_x.size(0));
  ASSERT_EQ(a.expand_x.nbytes(), b.expand_x.nbytes());
  EXPECT_EQ(std::memcmp(a.expand_x.data(), b.expand_x.data(), valid * row), 0);
  EXPECT_EQ(std::memcmp(a.assist_info_for_combine.data(), b.assist_info_for_combine.data(),
                        3 * valid * sizeof(int32_t)),
            0);
  EXPECT_EQ(std::memcmp(a.expand_scales.data(), b.expand_scales.data(), valid * sizeof(float)), 0);
  EXPECT_TRUE(same_bytes(a.expert_token_nums, b.expert_token_nums));
}

// CommOptions::shm_grow = false: from_mpi makes the window (one generation, shm_window_bytes per
// rank) and no op grows it. With room for one live output, the first dispatch_v2 receives into the
// window and the next two (the first still held) by messages, as does a combine_v2 (no room to
// stage its rows); all equal the MPI transport's bits, and the window is the one from_mpi made.
TEST(Workspace, FixedWindowIsMadeOnceAndNeverGrows) {
  const int64_t H = 256;
  DispatchWorkspace w;
  {
    auto probe = world_comm();
    w = dispatch_workspace(make_cfg(*probe, "shm"), kBS, H, kK, DType::kBF16);
  }
  const int64_t reserve = w.shm_slot_bytes;
  CommOptions o;
  o.shm_window_bytes = reserve;
  o.shm_grow = false;
  auto comm = Communicator::from_mpi(MPI_COMM_WORLD, o);
  auto plain = world_comm();
  const auto& ctx = detail::CommInternals::shm(*comm);
  ASSERT_TRUE(ctx) << "from_mpi did not make the window";
  EXPECT_EQ(ctx->generations(), 1);
  EXPECT_EQ(ctx->capacity(), reserve);
  const EpConfig cfg = make_cfg(*comm, "shm"), ref_cfg = make_cfg(*plain, "mpi");
  const Inputs in = make_inputs(kBS, H, kL * comm->size(), comm->rank());
  DispatchInputs din;
  din.x = in.x;
  din.expert_ids = in.ids;
  din.expert_scales = in.scales.view();
  const DispatchOutputs want = dispatch_v2(din, ref_cfg);
  std::vector<DispatchOutputs> live;
  for (int c = 0; c < 3; ++c) {
    live.push_back(dispatch_v2(din, cfg));
    int gen = -1;
    int64_t off = -1;
    const bool in_window = ctx->locate(live[c].expand_x.data(), nbytes(live[c].expand_x), gen, off);
    EXPECT_EQ(in_window, c == 0) << "call " << c;
    expect_same_dispatch(live[c], want, c);
    EXPECT_EQ(ctx->generations(), 1) << "call " << c << " grew the window";
  }
  CombineInputs cin;
  cin.expert_ids = in.ids;
  cin.assist_info_for_combine = want.assist_info_for_combine;
  cin.ep_send_counts = want.ep_recv_counts;
  cin.expert_scales = in.scales;
  cin.expand_x = want.expand_x;
  const Tensor ref = combine_v2(cin, ref_cfg);
  cin.expand_x = live[2].expand_x;  // not in the window: combine_v2 stages its rows there
  EXPECT_TRUE(same_bytes(combine_v2(cin, cfg), ref));
  EXPECT_EQ(ctx->generations(), 1);
  EXPECT_EQ(ctx->capacity(), reserve);
}

// shm_grow = false needs a size (on this rank, before duplicating), and every rank must pass the
// same shm_grow (on every rank).
TEST(Workspace, FixedWindowOptionsAreChecked) {
  CommOptions o;
  o.shm_grow = false;
  try {
    Communicator::from_mpi(MPI_COMM_SELF, o);
    ADD_FAILURE() << "no error for shm_grow = false without shm_window_bytes";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()),
              "Communicator: shm_grow = false needs shm_window_bytes > 0 (the window is made "
              "once, with that size; see dispatch_workspace for the bytes a call needs), got 0");
  }
  int size = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (size == 1) return;
  o.shm_grow = rank != 0;
  o.shm_window_bytes = int64_t{1} << 20;
  try {
    Communicator::from_mpi(MPI_COMM_WORLD, o);
    ADD_FAILURE() << "no error for ranks that disagree on shm_grow";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()),
              std::string("Communicator: ranks disagree on shm_grow (this rank: ") +
                  (rank != 0 ? "true" : "false") +
                  "); every rank must pass the same CommOptions::shm_grow");
  }  // With shm_grow false on every rank, $MOE_EP_SHM_NODE_RANKS must agree too (the window calls
  // that follow are collective): rank 0 sees another value than the others, then a malformed one.
  // Every rank raises; none is left in a collective. The variable is restored (some ctest runs
  // set it for the whole binary).
  const char* set = std::getenv("MOE_EP_SHM_NODE_RANKS");
  const std::string original = set ? set : "";
  const std::string others = original.empty() ? "0" : original;
  const std::string differs = others == "1" ? "3" : "1";
  o.shm_grow = false;
  for (const std::string& zero_sees : {differs, std::string("x")}) {
    if (rank == 0) setenv("MOE_EP_SHM_NODE_RANKS", zero_sees.c_str(), 1);
    try {
      Communicator::from_mpi(MPI_COMM_WORLD, o);
      ADD_FAILURE() << "no error for $MOE_EP_SHM_NODE_RANKS " << zero_sees << " on rank 0 only";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      const std::string what = e.what();
      if (rank == 0 && zero_sees == "x") {
        EXPECT_NE(what.find("MOE_EP_SHM_NODE_RANKS"), std::string::npos) << what;
      } else {
        EXPECT_EQ(what,
                  "Communicator: with shm_grow = false every rank must see the same "
                  "$MOE_EP_SHM_NODE_RANKS; this rank's is " +
                      (rank == 0 ? zero_sees : others) + ", another's differs (or is malformed)");
      }
    }
    if (rank == 0) {
      if (original.empty())
        unsetenv("MOE_EP_SHM_NODE_RANKS");
      else
        setenv("MOE_EP_SHM_NODE_RANKS", original.c_str(), 1);
    }
  }
}

int64_t physical_memory() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
}

// A window segment is memory of this machine: more than its physical memory is refused by
// from_mpi (on this rank, before duplicating), naming the value and the bound; the bound itself
// is accepted (nothing is allocated until an op needs the window). 2^62 was accepted and failed
// inside MPI_Win_allocate_shared (MPI_ERR_INTERN) naming neither.
TEST(Workspace, WindowBeyondThePhysicalMemoryIsRefused) {
  const int64_t physical = physical_memory();
  ASSERT_GT(physical, 0);
  for (const int64_t bytes : {int64_t{1} << 62, physical + 1, INT64_MAX}) {
    CommOptions o;
    o.shm_window_bytes = bytes;
    try {
      Communicator::from_mpi(MPI_COMM_SELF, o);
      ADD_FAILURE() << "no error for shm_window_bytes = " << bytes;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_EQ(std::string(e.what()),
                "Communicator: shm_window_bytes = " + std::to_string(bytes) +
                    " exceeds this machine's physical memory of " + std::to_string(physical) +
                    " bytes (sysconf(_SC_PHYS_PAGES) x sysconf(_SC_PAGESIZE)), which each rank's "
                    "segment of the shared-memory window must fit in");
    }
  }
  CommOptions o;
  o.shm_window_bytes = physical;
  EXPECT_EQ(Communicator::from_mpi(MPI_COMM_SELF, o)->shm_window_bytes(), physical);
}

// Lowers this process's address-space limit (RLIMIT_AS, soft) to `bytes` above what it maps now,
// restoring it on destruction; ok() is false when that is not possible here.
class AddressSpaceLimit {
 public:
  explicit AddressSpaceLimit(int64_t bytes) {
    if (getrlimit(RLIMIT_AS, &old_) != 0) return;
    std::FILE* f = std::fopen("/proc/self/statm", "r");
    if (f == nullptr) return;
    unsigned long pages = 0;
    const bool read = std::fscanf(f, "%lu", &pages) == 1;
    std::fclose(f);
    if (!read) return;
    rlimit lower = old_;
    lower.rlim_cur = static_cast<rlim_t>(pages) * sysconf(_SC_PAGESIZE) + bytes;
    if (old_.rlim_cur != RLIM_INFINITY && old_.rlim_cur <= lower.rlim_cur) return;
    ok_ = setrlimit(RLIMIT_AS, &lower) == 0;
  }
  ~AddressSpaceLimit() {
    if (ok_) setrlimit(RLIMIT_AS, &old_);
  }
  bool ok() const { return ok_; }

 private:
  rlimit old_{};
  bool ok_ = false;
};

// GCC names its sanitizers with macros, clang with __has_feature.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define MOE_EP_UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define MOE_EP_UNDER_SANITIZER 1
#endif
#endif

// A size within the bound that MPI_Win_allocate_shared still cannot give (here: the address
// space is limited to 256 MiB more than the process maps, the window asks for 1 GiB) fails the
// op with Error(kSystem) naming the bytes asked for and shm_window_bytes, not only MPI's error
// code. One rank per communicator (MPI_COMM_SELF): every rank fails alike, alone.
TEST(Workspace, FailedWindowAllocationNamesTheSizeAndTheOption) {
#ifdef MOE_EP_UNDER_SANITIZER
  // A sanitizer's allocator aborts on an allocation it cannot make (MPI's, under the lowered
  // limit) instead of returning null, and its shadow memory lives in the same address space.
  GTEST_SKIP() << "the address-space limit this test sets is not usable under a sanitizer";
#endif
  const int64_t window = int64_t{1} << 30;
  if (physical_memory() < 2 * window) GTEST_SKIP() << "less than 2 GiB of memory";
  CommOptions o;
  o.shm_window_bytes = window;
  auto comm = Communicator::from_mpi(MPI_COMM_SELF, o);
  const EpConfig cfg = make_cfg(*comm, "shm");
  const Inputs in = make_inputs(kBS, 64, kL, 0);
  DispatchInputs din;
  din.x = in.x;
  din.expert_ids = in.ids;
  std::string what;
  {
    AddressSpaceLimit limit(int64_t{256} << 20);
    if (!limit.ok()) GTEST_SKIP() << "cannot lower RLIMIT_AS here";
    try {
      dispatch_v2(din, cfg);
      ADD_FAILURE() << "dispatch_v2 created a 1 GiB window under a 256 MiB address-space limit";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kSystem) << e.what();
      what = e.what();
    }
  }
  const std::string asked = std::to_string(window + 4096);
  EXPECT_NE(what.find("dispatch_v2: MPI_Win_allocate_shared of " + asked + " bytes"),
            std::string::npos)
      << what;
  EXPECT_NE(what.find("CommOptions::shm_window_bytes = " + std::to_string(window)),
            std::string::npos)
      << what;
  EXPECT_NE(what.find(") failed: "), std::string::npos) << what;  // then MPI's error string
}

TEST(Workspace, Errors) {
  const int rank = test::world_rank();
  try {
    world_comm(-1);
    ADD_FAILURE() << "no error for shm_window_bytes = -1";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_STREQ(e.what(),
                 "Communicator: shm_window_bytes = -1 must be >= 0 (0: sized by "
                 "the first op)");
  }
  auto comm = world_comm();
  const EpConfig cfg = make_cfg(*comm, "");
  const int64_t ids = kL * comm->size();
  struct Bad {
    int64_t bs, h, k;
    DType dtype;
    int64_t quant;
    std::string message;
  };
  const std::vector<Bad> bad = {
      {-1, 8, 2, DType::kBF16, 0, "dispatch_workspace: bs = -1 must be in [0, 2147483647]"},
      {4, 0, 2, DType::kBF16, 0, "dispatch_workspace: hidden = 0 must be in [1, 2147483647]"},
      {4, 8, ids + 1, DType::kBF16, 0,
       "dispatch_workspace: top_k = " + std::to_string(ids + 1) + " must be in [1, " +
           std::to_string(ids) + "]"},
      {4, 8, 2, DType::kI32, 0, "dispatch_workspace: dtype = int32 must be bf16, fp16 or fp32"},
      {4, 8, 2, DType::kBF16, 1, "dispatch_workspace: quant_mode = 1 is not one of {0, 2}"},
      {4, 8, 2, DType::kBF16, 12, "dispatch_workspace: comm_quant_mode = 1 is not one of {0, 2}"},
  };
  for (const Bad& b : bad) {
    try {
      // quant 12: quant_mode 2 with comm_quant_mode 1.
      if (b.quant == 12)
        dispatch_workspace(cfg, b.bs, b.h, b.k, b.dtype, 2, 1);
      else
        dispatch_workspace(cfg, b.bs, b.h, b.k, b.dtype, b.quant);
      ADD_FAILURE() << "no error for " << b.message;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(b.message), std::string::npos)
          << e.what() << "\nexpected: " << b.message;
    }
  }
  // cfg's own checks are dispatch_v2's.
  EpConfig wrong = cfg;
  wrong.ep_rank_id = (rank + 1) % (comm->size() + 1);
  if (wrong.ep_rank_id != rank) {
    EXPECT_THROW(dispatch_workspace(wrong, 4, 8, 2, DType::kBF16), Error);
  }
}

}  // namespace
}  // namespace moe_ep
