// dispatch_v2 / combine_v2 under mpiexec at W = 1..4. Every rank builds the same global batch from
// a seed, runs the op on its slice and compares every output with the naive reference
// (ref/ep_ref.h), which sees the whole batch.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "mpi/common.h"
#include "ref/ep_ref.h"
#include "ref/numeric.h"

namespace moe_ep {
namespace {

struct Mpi {
  int rank = 0;
  int size = 1;
  std::shared_ptr<Communicator> comm;
};

const Mpi& mpi() {
  static const Mpi m = [] {
    Mpi w;
    MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &w.size);
    w.comm = Communicator::from_mpi(MPI_COMM_WORLD);
    return w;
  }();
  return m;
}

using test::values;

// One stream per global token (the batch must be the same on every rank and every W).
struct Rng : test::SplitMix64 {
  Rng(uint64_t seed, uint64_t stream)
      : SplitMix64{seed * 0x9e3779b97f4a7c15ull + stream * 0xbf58476d1ce4e5b9ull} {}
  float uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(next() >> 40) / static_cast<float>(1 << 24);
  }
};

enum class Split { kEqual, kUneven, kLastEmpty };

struct BatchSpec {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t tokens = 24;  // global tokens (kEqual: a multiple of 12, so every W divides it)
  int64_t H = 16;
  int64_t K = 2;                 // clamped to E
  int64_t E = 12;                // used when experts_per_rank == 0 (12: divisible by W = 1..4)
  int64_t experts_per_rank = 0;  // > 0: E = W * experts_per_rank (L fixed across W)
  Split split = Split::kEqual;
  bool global_bs = false;    // pass global_bs = W * (max BS + 1) instead of 0
  int64_t x_pad = 0;         // x row stride = H + x_pad (the padding is garbage)
  int64_t y_pad = 0;         // combine's expand_x row stride = H + y_pad
  int64_t meta_pad = 0;      // expert_ids / expert_scales row stride = K + meta_pad (garbage)
  double inactive = 0.0;     // probability of an entry -1; > 0 also makes every 5th token all -1
  int64_t skew_expert = -1;  // >= 0: slot 0 of every token goes to this expert
  bool self_id = true;       // x[i, 0] = source rank, x[i, 1] = token index
  bool scales = true;        // pass expert_scales to dispatch
  uint64_t seed = 1;
};

void PrintTo(const BatchSpec& s, std::ostream* os) { *os << s.name; }

// The global batch, held whole by every rank; inputs[r] views rank r's slice.
struct Batch {
  BatchSpec spec;
  int W = 1;
  int64_t E = 0, K = 0, L = 0, global_bs = 0, stride = 0;
  std::vector<int64_t> bs;
  std::vector<std::vector<unsigned char>> x;
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::vector<float>> scales;
  std::vector<ref::EpRankInput> inputs;
};

int64_t esize(DType d) { return d == DType::kF32 ? 4 : 2; }

// memcmp that accepts the null data of empty tensors.
bool same_bytes(const void* a, const void* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}

Batch make_batch(const BatchSpec& spec, int W) {
  Batch b;
  b.spec = spec;
  b.W = W;
  b.E = spec.experts_per_rank > 0 ? W * spec.experts_per_rank : spec.E;
  b.L = b.E / W;
  b.K = std::min(spec.K, b.E);
  b.stride = spec.H + spec.x_pad;
  // Split the global tokens over the ranks (the global token order is the same for every W).
  b.bs.assign(W, 0);
  if (spec.split == Split::kEqual || W == 1) {
    for (int r = 0; r < W; ++r) b.bs[r] = spec.tokens / W;
    b.bs[W - 1] += spec.tokens % W;
  } else if (spec.split == Split::kUneven) {
    int64_t weight = 0, given = 0;
    for (int r = 0; r < W; ++r) weight += r + 1;
    for (int r = 0; r < W - 1; ++r) given += b.bs[r] = spec.tokens * (r + 1) / weight;
    b.bs[W - 1] = spec.tokens - given;
  } else {  // kLastEmpty
    for (int r = 0; r < W - 1; ++r) b.bs[r] = spec.tokens / (W - 1);
    b.bs[W - 2] += spec.tokens % (W - 1);
  }
  if (spec.split == Split::kLastEmpty && W == 1) b.bs[0] = 0;
  const int64_t max_bs = *std::max_element(b.bs.begin(), b.bs.end());
  b.global_bs = spec.global_bs ? W * (max_bs + 1) : 0;

  const int64_t es = esize(spec.dtype), K = b.K, ks = K + spec.meta_pad;
  int64_t g = 0;  // global token index
  for (int r = 0; r < W; ++r) {
    const int64_t BS = b.bs[r];
    b.x.emplace_back(std::max<int64_t>(1, BS * b.stride * es), 0xff);  // padding: NaN-ish garbage
    b.ids.emplace_back(std::max<int64_t>(1, BS * ks), 999);
    b.scales.emplace_back(std::max<int64_t>(1, BS * ks), -77.0f);
    for (int64_t i = 0; i < BS; ++i, ++g) {
      Rng rng(spec.seed, static_cast<uint64_t>(g));
      std::vector<int64_t> pool(b.E);
      for (int64_t e = 0; e < b.E; ++e) pool[e] = e;
      int64_t first = 0;
      if (spec.skew_expert >= 0) {
        std::swap(pool[0], pool[spec.skew_expert]);
        first = 1;
      }
      for (int64_t k = first; k < K; ++k) std::swap(pool[k], pool[k + rng.below(b.E - k)]);
      const bool all_off = spec.inactive > 0 && g % 5 == 3;
      for (int64_t k = 0; k < K; ++k) {
        const bool off = all_off || (spec.inactive > 0 && rng.uniform(0, 1) < spec.inactive);
        b.ids[r][i * ks + k] = off ? -1 : static_cast<int32_t>(pool[k]);
        b.scales[r][i * ks + k] = rng.uniform(0.125f, 1.5f);
      }
      unsigned char* row = b.x[r].data() + i * b.stride * es;
      for (int64_t h = 0; h < spec.H; ++h) ref::store(spec.dtype, row, h, rng.uniform(-2, 2));
      if (spec.self_id && spec.H >= 2) {
        ref::store(spec.dtype, row, 0, static_cast<float>(r));
        ref::store(spec.dtype, row, 1, static_cast<float>(i));
      }
    }
  }
  for (int r = 0; r < W; ++r) {
    ref::EpRankInput in;
    in.x = TensorView::contiguous(b.x[r].data(), spec.dtype, {b.bs[r], spec.H});
    in.x.strides[0] = b.stride;
    in.expert_ids = TensorView::contiguous(b.ids[r].data(), DType::kI32, {b.bs[r], K});
    in.expert_ids.strides[0] = ks;
    TensorView sc = TensorView::contiguous(b.scales[r].data(), DType::kF32, {b.bs[r], K});
    sc.strides[0] = ks;
    in.expert_scales = sc;
    b.inputs.push_back(in);
  }
  return b;
}

EpConfig config(const Batch& b) {
  EpConfig c;
  c.group_ep = mpi().comm.get();
  c.ep_world_size = b.W;
  c.ep_rank_id = mpi().rank;
  c.moe_expert_num = b.E;
  c.global_bs = b.global_bs;
  return c;
}

DispatchInputs dispatch_inputs(const Batch& b, int64_t type = 1) {
  const ref::EpRankInput& mine = b.inputs[mpi().rank];
  DispatchInputs in;
  in.x = mine.x;
  in.expert_ids = mine.expert_ids;
  if (b.spec.scales) in.expert_scales = mine.expert_scales;
  in.expert_token_nums_type = type;
  return in;
}

// Every dispatch output against the reference; a wrong row says where it came from.
void check_dispatch(const Batch& b, const DispatchOutputs& out, const ref::EpRankDispatch& want,
                    int64_t type) {
  const int64_t H = b.spec.H, row_bytes = H * esize(b.spec.dtype);
  ASSERT_EQ(out.expand_x.ndim(), 2);
  ASSERT_EQ(out.expand_x.size(0), want.A);
  ASSERT_EQ(out.expand_x.size(1), H);
  ASSERT_EQ(out.expand_x.dtype(), b.spec.dtype);
  // Only the first `valid` rows are compared: the rest of expand_x is unspecified (SPEC §1.4).
  ASSERT_LE(want.valid, want.A);
  int reported = 0;
  for (int64_t j = 0; j < want.valid; ++j) {
    const unsigned char* got = out.expand_x.ptr<unsigned char>() + j * row_bytes;
    const unsigned char* exp = want.expand_x.data() + j * row_bytes;
    if (same_bytes(got, exp, row_bytes)) continue;
    if (++reported > 5) break;
    if (b.spec.self_id && H >= 2) {
      ADD_FAILURE() << "expand_x row " << j << " holds (rank " << ref::load(b.spec.dtype, got, 0)
                    << ", token " << ref::load(b.spec.dtype, got, 1) << "), expected (rank "
                    << ref::load(b.spec.dtype, exp, 0) << ", token "
                    << ref::load(b.spec.dtype, exp, 1) << ")";
    } else {
      ADD_FAILURE() << "expand_x row " << j << " differs from the reference";
    }
  }
  EXPECT_EQ(values<int32_t>(out.ep_recv_counts), want.ep_recv_counts);
  EXPECT_EQ(values<int64_t>(out.expert_token_nums),
            type == 0 ? want.expert_token_nums0 : want.expert_token_nums1);
  // Likewise only the first 3 * valid entries of assist_info_for_combine (SPEC §1.4).
  EXPECT_EQ(out.assist_info_for_combine.numel(), static_cast<int64_t>(want.assist_info.size()));
  EXPECT_EQ(values<int32_t>(out.assist_info_for_combine, 3 * want.valid),
            test::prefix(want.assist_info, 3 * want.valid));
  ASSERT_EQ(out.expand_scales.numel(), want.A);
  EXPECT_TRUE(same_bytes(out.expand_scales.data(), want.expand_scales.data(), want.A * 4))
      << "expand_scales differ from the reference";
  ASSERT_EQ(out.tp_recv_counts.numel(), 1);
  EXPECT_EQ(out.tp_recv_counts.ptr<int32_t>()[0], want.valid);
  EXPECT_FALSE(out.dynamic_scales.defined());
}

// The test's experts, applied to dispatch's rows: row j belongs to local expert l when it lies in
// the blocks [ep_recv_counts[l*W - 1], ep_recv_counts[l*W + W - 1]).
// The rows of y are b.spec.y_pad elements apart beyond H (combine_v2 accepts strided rows).
Tensor run_experts(const Batch& b, const DispatchOutputs& out, const ref::ExpertFn& expert) {
  const int64_t stride = b.spec.H + b.spec.y_pad;
  Tensor y = Tensor::zeros(out.expand_x.dtype(), {out.expand_x.size(0), stride});
  const int64_t row_bytes = b.spec.H * esize(b.spec.dtype);
  const int64_t y_row_bytes = stride * esize(b.spec.dtype);
  const int32_t* inc = out.ep_recv_counts.ptr<int32_t>();
  for (int64_t l = 0; l < b.L; ++l) {
    const int64_t lo = l == 0 ? 0 : inc[l * b.W - 1], hi = inc[l * b.W + b.W - 1];
    for (int64_t j = lo; j < hi; ++j)
      expert(mpi().rank * b.L + l, b.spec.dtype, out.expand_x.ptr<unsigned char>() + j * row_bytes,
             y.ptr<unsigned char>() + j * y_row_bytes, b.spec.H);
  }
  return y;
}

CombineInputs combine_inputs(const Batch& b, const DispatchOutputs& out, const Tensor& y) {
  const ref::EpRankInput& mine = b.inputs[mpi().rank];
  CombineInputs in;
  in.expand_x = y.view();
  in.expand_x.shape[1] = b.spec.H;  // a (rows, H) view of the padded rows
  in.expert_ids = mine.expert_ids;
  in.assist_info_for_combine = out.assist_info_for_combine;
  in.ep_send_counts = out.ep_recv_counts;
  in.expert_scales = *mine.expert_scales;
  in.expand_scales = out.expand_scales.view();
  return in;
}

uint64_t fnv1a(const std::vector<unsigned char>& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Every rank's bytes, concatenated in rank order, on every rank.
std::vector<unsigned char> gather_bytes(const void* data, int64_t n) {
  const int W = mpi().size;
  int mine = static_cast<int>(n);
  std::vector<int> sizes(W), offs(W);
  MPI_Allgather(&mine, 1, MPI_INT, sizes.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < W; ++r) offs[r] = total, total += sizes[r];
  std::vector<unsigned char> all(std::max(total, 1));
  MPI_Allgatherv(data, mine, MPI_BYTE, all.data(), sizes.data(), offs.data(), MPI_BYTE,
                 MPI_COMM_WORLD);
  all.resize(total);
  return all;
}

// dispatch (both expert_token_nums types), the scale experts, combine: all against the reference.
void round_trip(const Batch& b) {
  const int rank = mpi().rank;
  std::vector<ref::EpRankInput> given = b.inputs;  // what dispatch_v2 sees
  if (!b.spec.scales)
    for (auto& in : given) in.expert_scales.reset();
  const auto want = ref::dispatch_reference(given, b.E, b.global_bs);
  DispatchOutputs out0 = dispatch_v2(dispatch_inputs(b, 0), config(b));
  {
    SCOPED_TRACE("expert_token_nums_type 0");
    check_dispatch(b, out0, want[rank], 0);
  }
  DispatchOutputs out = dispatch_v2(dispatch_inputs(b, 1), config(b));
  {
    SCOPED_TRACE("expert_token_nums_type 1");
    check_dispatch(b, out, want[rank], 1);
  }
  if (!b.spec.scales) return;
  const ref::ExpertFn expert = ref::scale_expert(b.E);
  const Tensor y = run_experts(b, out, expert);
  const Tensor x = combine_v2(combine_inputs(b, out, y), config(b));
  ASSERT_EQ(x.ndim(), 2);
  ASSERT_EQ(x.size(0), b.bs[rank]);
  ASSERT_EQ(x.size(1), b.spec.H);
  ASSERT_EQ(x.dtype(), b.spec.dtype);
  const auto combined = ref::combine_reference(b.inputs, expert);
  const auto& mine = combined[rank];
  ASSERT_EQ(x.nbytes(), mine.size());
  EXPECT_TRUE(same_bytes(x.data(), mine.data(), mine.size()))
      << "combine_v2 differs from SPEC §2.3 computed by the reference";
  // The whole batch's result: the reference computes it token by token, independent of W, so
  // equality at every W is bitwise identity across W.
  std::vector<unsigned char> want_all;
  for (const auto& part : combined) want_all.insert(want_all.end(), part.begin(), part.end());
  const std::vector<unsigned char> got_all =
      gather_bytes(x.data(), static_cast<int64_t>(x.nbytes()));
  EXPECT_EQ(fnv1a(got_all), fnv1a(want_all));
  if (rank == 0)
    std::printf("[ %s ] W=%d global combine hash %016llx\n", b.spec.name.c_str(), b.W,
                static_cast<unsigned long long>(fnv1a(got_all)));
}

class DispatchCombine : public ::testing::TestWithParam<BatchSpec> {};

TEST_P(DispatchCombine, MatchesReference) { round_trip(make_batch(GetParam(), mpi().size)); }

std::vector<BatchSpec> grid() {
  std::vector<BatchSpec> g;
  auto add = [&](std::string name, auto&& tweak) {
    BatchSpec s;
    s.name = std::move(name);
    tweak(s);
    g.push_back(s);
  };
  add("bf16_K2_E12", [](BatchSpec&) {});
  add("fp16_K8_E12", [](BatchSpec& s) { s.dtype = DType::kF16, s.K = 8; });
  add("fp32_K1_E12", [](BatchSpec& s) { s.dtype = DType::kF32, s.K = 1; });
  add("bf16_L1_K1", [](BatchSpec& s) { s.experts_per_rank = 1, s.K = 1; });
  add("fp16_L1_K2", [](BatchSpec& s) { s.dtype = DType::kF16, s.experts_per_rank = 1; });
  add("bf16_L5_K3", [](BatchSpec& s) { s.experts_per_rank = 5, s.K = 3; });
  add("bf16_L2_K8", [](BatchSpec& s) { s.experts_per_rank = 2, s.K = 8; });
  add("skew_all_to_expert7_K2", [](BatchSpec& s) { s.skew_expert = 7; });
  add("skew_all_to_expert0_K1", [](BatchSpec& s) { s.skew_expert = 0, s.K = 1; });
  add("uneven_bs_global_bs", [](BatchSpec& s) { s.split = Split::kUneven, s.global_bs = true; });
  add("last_rank_bs0", [](BatchSpec& s) { s.split = Split::kLastEmpty, s.global_bs = true; });
  add("inactive_entries", [](BatchSpec& s) { s.inactive = 0.3, s.K = 3; });
  add("inactive_fp32_K8", [](BatchSpec& s) { s.inactive = 0.4, s.K = 8, s.dtype = DType::kF32; });
  add("strided_x_bf16", [](BatchSpec& s) { s.x_pad = 5, s.y_pad = 2; });
  add("strided_ids_scales_K3", [](BatchSpec& s) { s.meta_pad = 2, s.K = 3, s.inactive = 0.2; });
  add("strided_x_fp16_uneven", [](BatchSpec& s) {
    s.dtype = DType::kF16, s.x_pad = 3, s.y_pad = 7, s.split = Split::kUneven, s.global_bs = true;
  });
  add("no_tokens", [](BatchSpec& s) { s.tokens = 0; });
  add("one_token",
      [](BatchSpec& s) { s.tokens = 1, s.split = Split::kUneven, s.global_bs = true; });
  add("no_expert_scales", [](BatchSpec& s) { s.scales = false; });
  add("global_bs_equal_bs", [](BatchSpec& s) { s.global_bs = true; });
  add("large_fp16_K8_H200", [](BatchSpec& s) {
    s.dtype = DType::kF16, s.tokens = 240, s.H = 200, s.K = 8, s.E = 24, s.self_id = false,
    s.inactive = 0.1;
  });
  add("bitwise_bf16_K4_random",
      [](BatchSpec& s) { s.tokens = 120, s.H = 64, s.K = 4, s.self_id = false, s.seed = 7; });
  return g;
}

INSTANTIATE_TEST_SUITE_P(Grid, DispatchCombine, ::testing::ValuesIn(grid()),
                         [](const ::testing::TestParamInfo<BatchSpec>& p) { return p.param.name; });

// ---------------------------------------------------------------------------------------------
// Failures the field has reported, replayed (in our words): each case checks every output against
// the reference.

// dispatch_v2 and combine_v2 of b, `repeats` times, every output against the reference each time.
void repeated_round_trips(const Batch& b, int repeats) {
  const int rank = mpi().rank;
  const auto want = ref::dispatch_reference(b.inputs, b.E, b.global_bs);
  const ref::ExpertFn expert = ref::scale_expert(b.E);
  const auto combined = ref::combine_reference(b.inputs, expert);
  int wrong = 0;
  for (int i = 0; i < repeats && wrong == 0; ++i) {
    SCOPED_TRACE("call " + std::to_string(i));
    const DispatchOutputs out = dispatch_v2(dispatch_inputs(b), config(b));
    check_dispatch(b, out, want[rank], 1);
    const Tensor x = combine_v2(combine_inputs(b, out, run_experts(b, out, expert)), config(b));
    if (!same_bytes(x.data(), combined[rank].data(), combined[rank].size())) ++wrong;
    if (::testing::Test::HasFailure()) ++wrong;
  }
  EXPECT_EQ(wrong, 0) << "a call's output differs from the reference";
}

// DeepEP#700: one silently wrong row in 1.5-3.3% of calls, only when every rank sends exactly the
// maximum token count. Here every rank holds global_bs / W tokens, 1,000 calls (10 batches), at
// every W: the largest multiple of W up to 48 tokens (at least one per rank), and 12 experts
// where W divides 12, else 3 per rank.
TEST(KnownFailures, ExactlyAtTheMaximumTokenCountRepeated) {
  const int W = mpi().size;
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    BatchSpec s;
    s.name = "at_max";
    s.tokens = int64_t{W} * std::max(1, 48 / W);
    if (12 % W != 0) s.experts_per_rank = 3;
    s.H = 32;
    s.K = 4;
    s.seed = seed;
    Batch b = make_batch(s, W);
    ASSERT_EQ(s.tokens % W, 0);
    const int64_t max_bs = *std::max_element(b.bs.begin(), b.bs.end());
    ASSERT_EQ(max_bs, s.tokens / W) << "every rank holds the same tokens";
    b.global_bs = W * max_bs;  // every rank at the maximum
    repeated_round_trips(b, 100);
  }
}

// nccl#2252: receive buffers sized without top-k broke with more experts than ranks squared. Here
// E = W (2W + 1) > W^2, K = 8, and every token sends all K entries to rank 0's experts (the worst
// case A = G * min(L, K) rows arrive there).
TEST(KnownFailures, MoreExpertsThanRanksSquaredAtFullCapacity) {
  const int W = mpi().size;
  BatchSpec s;
  s.name = "experts_gt_w2";
  s.experts_per_rank = 2 * W + 1;
  s.K = 8;
  s.tokens = 24;
  Batch b = make_batch(s, W);
  ASSERT_GT(b.E, int64_t{W} * W);
  round_trip(b);
  // All K entries of every token on rank 0 (L = 2W + 1 >= K for W >= 4; fewer distinct experts
  // otherwise: K is clamped to L below).
  const int64_t k_on_0 = std::min<int64_t>(b.K, b.L);
  BatchSpec t = s;
  t.K = k_on_0;
  Batch c = make_batch(t, W);
  for (int r = 0; r < W; ++r)
    for (int64_t i = 0; i < c.bs[r]; ++i)
      for (int64_t k = 0; k < c.K; ++k)
        c.ids[r][i * (c.K + t.meta_pad) + k] = static_cast<int32_t>((k + i) % c.L);
  round_trip(c);
}

// TRT-LLM#18689: rows of one call (padding past the valid rows) leaked into the next. A large
// call with NaN-free garbage-heavy rows, then smaller calls with inactive entries and a rank with
// no tokens: each against the reference.
TEST(KnownFailures, RowsOfOneCallNeverLeakIntoTheNext) {
  const int W = mpi().size;
  BatchSpec big;
  big.name = "big";
  big.tokens = 240;
  big.K = 8;
  big.self_id = false;
  big.seed = 31;
  round_trip(make_batch(big, W));
  BatchSpec small = big;
  small.name = "small";
  small.tokens = 12;
  small.K = 3;
  small.inactive = 0.4;
  small.split = Split::kLastEmpty;
  small.global_bs = true;
  small.seed = 32;
  round_trip(make_batch(small, W));
  BatchSpec none = small;
  none.name = "none";
  none.tokens = 0;
  round_trip(make_batch(none, W));
  round_trip(make_batch(small, W));
}

// A recomputed forward (activation checkpointing) equals the first, bit for bit: uncached, and
// through the first call's handle.
TEST(KnownFailures, RecomputedForwardIsBitwiseTheFirst) {
  BatchSpec s;
  s.name = "recompute";
  s.tokens = 48;
  s.H = 64;
  s.K = 4;
  s.inactive = 0.2;
  s.self_id = false;
  const Batch b = make_batch(s, mpi().size);
  const ref::ExpertFn expert = ref::scale_expert(b.E);
  const DispatchOutputs first = dispatch_v2(dispatch_inputs(b), config(b));
  const Tensor x1 = combine_v2(combine_inputs(b, first, run_experts(b, first, expert)), config(b));
  const DispatchOutputs again = dispatch_v2(dispatch_inputs(b), config(b));
  DispatchInputs cached_in = dispatch_inputs(b);
  cached_in.handle = &first.handle;
  const DispatchOutputs cached = dispatch_v2(cached_in, config(b));
  for (const DispatchOutputs* d : {&again, &cached}) {
    const int64_t valid = d->ep_recv_counts.ptr<int32_t>()[d->ep_recv_counts.numel() - 1];
    ASSERT_EQ(valid, first.ep_recv_counts.ptr<int32_t>()[first.ep_recv_counts.numel() - 1]);
    EXPECT_TRUE(same_bytes(d->expand_x.data(), first.expand_x.data(),
                           static_cast<std::size_t>(valid * s.H * esize(s.dtype))));
    const Tensor x = combine_v2(combine_inputs(b, *d, run_experts(b, *d, expert)), config(b));
    ASSERT_EQ(x.nbytes(), x1.nbytes());
    EXPECT_TRUE(same_bytes(x.data(), x1.data(), x.nbytes())) << "the recomputed combine differs";
  }
  const auto combined = ref::combine_reference(b.inputs, expert);
  EXPECT_TRUE(same_bytes(x1.data(), combined[mpi().rank].data(), combined[mpi().rank].size()));
}

// ---------------------------------------------------------------------------------------------
// Errors: every rank calls the op (it is collective); `bad` is the rank whose call is wrong (-1:
// every rank's call is wrong, or the ranks disagree, so every rank throws `kind`). The others throw
// kRemote carrying the bad rank's message. Afterwards the communicator must still work.

void expect_error(const std::function<void()>& call, int bad, ErrorKind kind,
                  const std::vector<std::string>& needles) {
  test::expect_collective_error(call, mpi().rank, bad, kind, needles);
  // No stray message: a good round trip right after the error still matches the reference.
  BatchSpec s;
  s.name = "after_error";
  s.seed = 99;
  round_trip(make_batch(s, mpi().size));
}

// h: rows of more than 4 KiB (h 4096) take OpenMPI's single-copy path between processes.
Batch error_batch(int64_t h = 16) {
  BatchSpec s;
  s.name = "errors";
  s.tokens = 24;
  s.seed = 3;
  s.H = h;
  return make_batch(s, mpi().size);
}

int last_rank() { return mpi().size - 1; }
bool is_bad(int bad) { return mpi().rank == bad; }

TEST(DispatchErrors, ExpertIdOutOfRange) {
  Batch b = error_batch();
  const int bad = last_rank();
  if (is_bad(bad)) b.ids[bad][1 * b.K + 1] = 300;
  expect_error([&] { dispatch_v2(dispatch_inputs(b), config(b)); }, bad,
               ErrorKind::kInvalidArgument,
               {"dispatch_v2: expert_ids[1,1] = 300 is outside [0, 12)"});
}

TEST(DispatchErrors, ExpertIdNegative) {
  Batch b = error_batch();
  const int bad = 0;
  if (is_bad(bad)) b.ids[bad][0] = -2;
  expect_error([&] { dispatch_v2(dispatch_inputs(b), config(b)); }, bad,
               ErrorKind::kInvalidArgument, {"expert_ids[0,0] = -2 is outside [0, 12)"});
}

TEST(DispatchErrors, ExpertIdRepeated) {
  Batch b = error_batch();
  const int bad = last_rank();
  if (is_bad(bad)) b.ids[bad][2 * b.K + 1] = b.ids[bad][2 * b.K];
  expect_error([&] { dispatch_v2(dispatch_inputs(b), config(b)); }, bad,
               ErrorKind::kInvalidArgument,
               {"dispatch_v2: expert_ids[2,*] repeats expert", "slots 0 and 1"});
}

TEST(DispatchErrors, ExpertNumNotDivisible) {
  if (mpi().size == 1) GTEST_SKIP() << "every E is a multiple of W = 1";
  Batch b = error_batch();
  EpConfig c = config(b);
  c.moe_expert_num = 3 * mpi().size + 1;
  expect_error([&] { dispatch_v2(dispatch_inputs(b), c); }, -1, ErrorKind::kInvalidArgument,
               {"moe_expert_num = " + std::to_string(c.moe_expert_num) +
                " is not a multiple of ep_world_size"});
}

TEST(DispatchErrors, WorldSizeMismatch) {
  Batch b = error_batch();
  const int bad = last_rank();
  EpConfig c = config(b);
  if (is_bad(bad)) c.ep_world_size = mpi().size + 1;
  expect_error(
      [&] { dispatch_v2(dispatch_inputs(b), c); }, bad, ErrorKind::kInvalidArgument,
      {"ep_world_size = " + std::to_string(mpi().size + 1) + " differs from group_ep's size"});
}

TEST(DispatchErrors, RankIdMismatch) {
  Batch b = error_batch();
  const int bad = 0;
  EpConfig c = config(b);
  if (is_bad(bad)) c.ep_rank_id = (mpi().size > 1) ? 1 : 5;
  expect_error([&] { dispatch_v2(dispatch_inputs(b), c); }, bad, ErrorKind::kInvalidArgument,
               {"dispatch_v2: ep_rank_id = "});
}

TEST(DispatchErrors, XDtype) {
  Batch b = error_batch();
  const int bad = last_rank();
  DispatchInputs in = dispatch_inputs(b);
  if (is_bad(bad)) in.x.dtype = DType::kI32;
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"dispatch_v2: x dtype int32 is not one of"});
}

TEST(DispatchErrors, ExpertIdsRows) {
  Batch b = error_batch();
  const int bad = last_rank();
  DispatchInputs in = dispatch_inputs(b);
  if (is_bad(bad)) in.expert_ids.shape[0] -= 1;
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"dispatch_v2: expert_ids.shape[0] = "});
}

TEST(DispatchErrors, ExpertScalesShape) {
  Batch b = error_batch();
  const int bad = 0;
  DispatchInputs in = dispatch_inputs(b);
  if (is_bad(bad)) in.expert_scales->shape[1] = 1;
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"dispatch_v2: expert_scales.shape[1] = 1 must equal 2"});
}

// quant_mode 2 on one rank only: the rows would differ in size; every rank throws.
TEST(DispatchErrors, QuantModeDiffersAcrossRanks) {
  if (mpi().size < 2) GTEST_SKIP() << "needs two ranks";
  Batch b = error_batch();
  const int bad = last_rank();
  DispatchInputs in = dispatch_inputs(b);
  if (is_bad(bad)) in.quant_mode = 2;
  expect_error([&] { dispatch_v2(in, config(b)); }, -1, ErrorKind::kInvalidArgument,
               {"dispatch_v2: quant_mode differs across ranks", " has 2"});
}

TEST(DispatchErrors, ActiveMaskWrongDtype) {
  Batch b = error_batch();
  const int bad = 0;
  DispatchInputs in = dispatch_inputs(b);
  std::vector<int32_t> mask(std::max<int64_t>(1, b.bs[mpi().rank]), 1);
  if (is_bad(bad))
    in.x_active_mask = TensorView::contiguous(mask.data(), DType::kI32, {b.bs[mpi().rank]});
  expect_error([&] { dispatch_v2(in, config(b)); }, bad, ErrorKind::kInvalidArgument,
               {"dispatch_v2: x_active_mask dtype int32 is not one of {bool}"});
}

TEST(DispatchErrors, NullGroup) {
  Batch b = error_batch();
  EpConfig c = config(b);
  c.group_ep = nullptr;
  expect_error([&] { dispatch_v2(dispatch_inputs(b), c); }, -1, ErrorKind::kInvalidArgument,
               {"dispatch_v2: group_ep is null"});
}

TEST(DispatchErrors, TensorParallelNeedsGroupTp) {
  Batch b = error_batch();
  EpConfig c = config(b);
  c.tp_world_size = 2;
  expect_error([&] { dispatch_v2(dispatch_inputs(b), c); }, -1, ErrorKind::kInvalidArgument,
               {"group_tp is null with tp_world_size = 2"});
}

TEST(DispatchErrors, ExpertNumDisagrees) {
  if (mpi().size == 1) GTEST_SKIP() << "needs two ranks to disagree";
  Batch b = error_batch();
  EpConfig c = config(b);
  if (is_bad(last_rank())) c.moe_expert_num = 24;
  expect_error([&] { dispatch_v2(dispatch_inputs(b), c); }, -1, ErrorKind::kInvalidArgument,
               {"moe_expert_num differs across ranks", "has 24"});
}

TEST(DispatchErrors, DtypeDisagrees) {
  if (mpi().size == 1) GTEST_SKIP() << "needs two ranks to disagree";
  Batch b = error_batch();
  DispatchInputs in = dispatch_inputs(b);
  if (is_bad(last_rank())) in.x.dtype = DType::kF16;
  expect_error([&] { dispatch_v2(in, config(b)); }, -1, ErrorKind::kInvalidArgument,
               {"x dtype differs across ranks", "fp16"});
}

TEST(DispatchErrors, HiddenSizeDisagrees) {
  if (mpi().size == 1) GTEST_SKIP() << "needs two ranks to disagree";
  Batch b = error_batch();
  DispatchInputs in = dispatch_inputs(b);
  if (is_bad(0)) in.x.shape[1] -= 1;
  expect_error([&] { dispatch_v2(in, config(b)); }, -1, ErrorKind::kInvalidArgument,
               {"H (x.shape[1]) differs across ranks"});
}

TEST(DispatchErrors, TopKDisagrees) {
  if (mpi().size == 1) GTEST_SKIP() << "needs two ranks to disagree";
  Batch b = error_batch();
  DispatchInputs in = dispatch_inputs(b);
  if (is_bad(last_rank())) {
    in.expert_ids.shape[1] = 1;
    in.expert_scales.reset();
  }
  expect_error([&] { dispatch_v2(in, config(b)); }, -1, ErrorKind::kInvalidArgument,
               {"K (expert_ids.shape[1]) differs across ranks"});
}

TEST(DispatchErrors, BatchSizeDiffersWithoutGlobalBs) {
  if (mpi().size == 1) GTEST_SKIP() << "needs two ranks to disagree";
  Batch b = error_batch();
  DispatchInputs in = dispatch_inputs(b);
  if (is_bad(last_rank())) {
    in.x.shape[0] -= 1;
    in.expert_ids.shape[0] -= 1;
    in.expert_scales->shape[0] -= 1;
  }
  // The message gives the fix with its numbers (rank 0 has the largest BS here).
  const int64_t W = mpi().size, max_bs = b.bs[0];
  expect_error([&] { dispatch_v2(in, config(b)); }, -1, ErrorKind::kInvalidArgument,
               {"BS (x.shape[0]) differs across ranks with global_bs = 0",
                "; pass global_bs = ep_world_size * max BS = " + std::to_string(W) + " * " +
                    std::to_string(max_bs) + " = " + std::to_string(W * max_bs) +
                    " (rank 0 has BS = " + std::to_string(max_bs)});
}

TEST(DispatchErrors, GlobalBsNotMultipleOfW) {
  if (mpi().size == 1) GTEST_SKIP() << "every global_bs is a multiple of W = 1";
  Batch b = error_batch();
  EpConfig c = config(b);
  c.global_bs = 100 * mpi().size + 1;
  expect_error(
      [&] { dispatch_v2(dispatch_inputs(b), c); }, -1, ErrorKind::kInvalidArgument,
      {"global_bs = " + std::to_string(c.global_bs) + " is not a multiple of ep_world_size"});
}

TEST(DispatchErrors, GlobalBsTooSmall) {
  Batch b = error_batch();
  EpConfig c = config(b);
  c.global_bs = mpi().size * (b.bs[0] - 1);
  expect_error(
      [&] { dispatch_v2(dispatch_inputs(b), c); }, -1, ErrorKind::kInvalidArgument,
      {"global_bs = " + std::to_string(c.global_bs) + " is less than ep_world_size * max BS"});
}

TEST(DispatchErrors, GlobalBsDisagrees) {
  if (mpi().size == 1) GTEST_SKIP() << "needs two ranks to disagree";
  Batch b = error_batch();
  EpConfig c = config(b);
  if (is_bad(0)) c.global_bs = 2 * mpi().size * b.bs[0];
  expect_error([&] { dispatch_v2(dispatch_inputs(b), c); }, -1, ErrorKind::kInvalidArgument,
               {"global_bs differs across ranks"});
}

TEST(DispatchErrors, DifferentOps) {
  if (mpi().size == 1) GTEST_SKIP() << "needs two ranks to disagree";
  Batch b = error_batch();
  DispatchOutputs out = dispatch_v2(dispatch_inputs(b), config(b));
  const Tensor y = run_experts(b, out, ref::scale_expert(b.E));
  expect_error(
      [&] {
        if (mpi().rank == 0)
          combine_v2(combine_inputs(b, out, y), config(b));
        else
          dispatch_v2(dispatch_inputs(b), config(b));
      },
      -1, ErrorKind::kInvalidArgument, {"the ranks called different ops"});
}

// combine_v2: one rank passes inconsistent layout tensors.
struct CombineErrorCase {
  DispatchOutputs out;
  Tensor y;
  Batch b;
};

CombineErrorCase dispatched(int64_t h = 16) {
  CombineErrorCase c{{}, {}, error_batch(h)};
  c.out = dispatch_v2(dispatch_inputs(c.b), config(c.b));
  c.y = run_experts(c.b, c.out, ref::scale_expert(c.b.E));
  return c;
}

TEST(CombineErrors, ExpandXTooShort) {
  CombineErrorCase c = dispatched();
  const int bad = last_rank();
  CombineInputs in = combine_inputs(c.b, c.out, c.y);
  const int32_t valid = c.out.tp_recv_counts.ptr<int32_t>()[0];
  ASSERT_GT(valid, 0);
  if (is_bad(bad)) in.expand_x.shape[0] = valid - 1;
  expect_error([&] { combine_v2(in, config(c.b)); }, bad, ErrorKind::kInvalidArgument,
               {"combine_v2: expand_x.shape[0] = ", "is less than the valid rows"});
}

TEST(CombineErrors, SendCountsSize) {
  CombineErrorCase c = dispatched();
  const int bad = 0;
  CombineInputs in = combine_inputs(c.b, c.out, c.y);
  if (is_bad(bad)) in.ep_send_counts.shape[0] -= 1;
  expect_error([&] { combine_v2(in, config(c.b)); }, bad, ErrorKind::kInvalidArgument,
               {"combine_v2: ep_send_counts.shape[0] = ", "must equal ep_world_size * L"});
}

TEST(CombineErrors, AssistInfoSize) {
  CombineErrorCase c = dispatched();
  const int bad = last_rank();
  CombineInputs in = combine_inputs(c.b, c.out, c.y);
  if (is_bad(bad)) in.assist_info_for_combine.shape[0] -= 1;
  expect_error([&] { combine_v2(in, config(c.b)); }, bad, ErrorKind::kInvalidArgument,
               {"combine_v2: assist_info_for_combine.shape[0] = "});
}

TEST(CombineErrors, AssistInfoFromAnotherDispatch) {
  CombineErrorCase c = dispatched();
  const int bad = last_rank();
  CombineInputs in = combine_inputs(c.b, c.out, c.y);
  ASSERT_GT(c.out.tp_recv_counts.ptr<int32_t>()[0], 0);
  Tensor other = Tensor::zeros(DType::kI32, {c.out.assist_info_for_combine.numel()});
  std::memcpy(other.data(), c.out.assist_info_for_combine.data(), other.nbytes());
  other.ptr<int32_t>()[0] += 1;  // row 0 claims another source rank
  if (is_bad(bad)) in.assist_info_for_combine = other;
  expect_error([&] { combine_v2(in, config(c.b)); }, bad, ErrorKind::kInvalidArgument,
               {"combine_v2: assist_info_for_combine[0] = ", "does not match ep_send_counts"});
}

TEST(CombineErrors, ExpertScalesDtype) {
  CombineErrorCase c = dispatched();
  const int bad = 0;
  CombineInputs in = combine_inputs(c.b, c.out, c.y);
  if (is_bad(bad)) in.expert_scales.dtype = DType::kBF16;
  expect_error([&] { combine_v2(in, config(c.b)); }, bad, ErrorKind::kInvalidArgument,
               {"combine_v2: expert_scales dtype bf16"});
}

TEST(CombineErrors, CommQuantModeDiffersAcrossRanks) {
  if (mpi().size < 2) GTEST_SKIP() << "needs two ranks";
  CombineErrorCase c = dispatched();
  const int bad = last_rank();
  CombineInputs in = combine_inputs(c.b, c.out, c.y);
  if (is_bad(bad)) in.comm_quant_mode = 2;
  expect_error([&] { combine_v2(in, config(c.b)); }, -1, ErrorKind::kInvalidArgument,
               {"combine_v2: comm_quant_mode differs across ranks", " has 2"});
}

// expert_ids that differ from dispatch's: the source sees a row count it did not route. Only the
// rank holding the changed ids can tell; the others finish (no hang).
// Runs combine_v2 with expert_ids `ids` on rank `bad` (the others pass dispatch's) and expects
// an InvalidArgument naming combine_v2 and dispatch_v2 on `bad` and success elsewhere, then a
// good round trip. comm_quant_mode (every rank): 2 sends the rows back as int8.
void expect_combine_rejects_on(const CombineErrorCase& c, int bad, std::vector<int32_t>& ids,
                               int64_t comm_quant_mode = 0) {
  CombineInputs in = combine_inputs(c.b, c.out, c.y);
  in.comm_quant_mode = comm_quant_mode;
  if (is_bad(bad)) {
    in.expert_ids.data = ids.data();
    try {
      combine_v2(in, config(c.b));
      ADD_FAILURE() << "no error";
    } catch (const Error& err) {
      EXPECT_EQ(err.kind(), ErrorKind::kInvalidArgument) << err.what();
      EXPECT_NE(std::string(err.what()).find("combine_v2: "), std::string::npos) << err.what();
      EXPECT_NE(std::string(err.what()).find("matching dispatch_v2"), std::string::npos)
          << err.what();
    }
  } else {
    EXPECT_NO_THROW(combine_v2(in, config(c.b)));
  }
  BatchSpec s;
  s.name = "after_error";
  round_trip(make_batch(s, mpi().size));
}

TEST(CombineErrors, ExpertIdsDifferFromDispatch) {
  if (mpi().size == 1) GTEST_SKIP() << "needs a second rank to route to";
  CombineErrorCase c = dispatched();
  const int bad = last_rank();
  std::vector<int32_t> ids = c.b.ids[bad];
  // Move token 0's slot-0 entry to an expert on another rank, not already in its row.
  const int64_t K = c.b.K, E = c.b.E, L = c.b.L;
  int32_t e = ids[0];
  ASSERT_GE(e, 0);
  int32_t moved = -1;
  for (int64_t step = L; step < E && moved < 0; ++step) {
    const auto cand = static_cast<int32_t>((e + step) % E);
    if (cand / L == e / L) continue;
    bool used = false;
    for (int64_t k = 0; k < K; ++k) used |= ids[k] == cand;
    if (!used) moved = cand;
  }
  ASSERT_GE(moved, 0);
  ids[0] = moved;
  expect_combine_rejects_on(c, bad, ids);
}

// An entry moved to another expert of the same peer: the rows per peer still agree, the rows per
// block (local expert) do not. Over MPI each block is its own message; the source sizes its
// receives by the owner's counts, so it takes every row (rows of more than 4 KiB too, which
// OpenMPI's single-copy path would write past a shorter receive) and then reports the
// disagreement; over shared memory likewise from the counts. Other ranks finish.
// Parameters: H, comm_quant_mode.
class CombineMovedWithinAPeer : public ::testing::TestWithParam<std::pair<int64_t, int64_t>> {};
TEST_P(CombineMovedWithinAPeer, IsAnErrorOnTheSourceOnly) {
  if (mpi().size == 1) GTEST_SKIP() << "needs a second rank to route to";
  CombineErrorCase c = dispatched(GetParam().first);
  const int bad = last_rank();
  std::vector<int32_t> ids = c.b.ids[bad];
  const int64_t K = c.b.K, E = c.b.E, L = c.b.L;
  ASSERT_GE(L, 2);
  int64_t at = -1;
  int32_t moved = -1;
  for (int64_t j = 0; j < static_cast<int64_t>(ids.size()) && moved < 0; ++j) {
    const int32_t e = ids[j];
    if (e < 0 || e >= E || e / L == bad) continue;  // an expert of another rank
    const int64_t i = j / K;
    for (auto cand = static_cast<int32_t>(e / L * L); cand < (e / L + 1) * L; ++cand) {
      bool used = false;
      for (int64_t k = 0; k < K; ++k) used |= ids[i * K + k] == cand;
      if (!used) {
        at = j, moved = cand;
        break;
      }
    }
  }
  ASSERT_GE(moved, 0) << "no entry to move";
  ids[at] = moved;
  expect_combine_rejects_on(c, bad, ids, GetParam().second);
}
INSTANTIATE_TEST_SUITE_P(CombineErrors, CombineMovedWithinAPeer,
                         ::testing::Values(std::pair<int64_t, int64_t>{16, 0},
                                           std::pair<int64_t, int64_t>{4096, 0},
                                           std::pair<int64_t, int64_t>{4096, 2}),
                         [](const auto& info) {
                           return "H" + std::to_string(info.param.first) + "_comm_quant" +
                                  std::to_string(info.param.second);
                         });

// The last entry a rank routes to itself dropped (-1) before combine: only this rank's own rows
// disagree, which travel through no message at all.
class CombineOwnEntryDropped : public ::testing::TestWithParam<int64_t> {};
TEST_P(CombineOwnEntryDropped, IsAnError) {
  CombineErrorCase c = dispatched(4096);
  const int bad = last_rank();
  std::vector<int32_t> ids = c.b.ids[bad];
  const int64_t E = c.b.E, L = c.b.L;
  int64_t at = -1;
  for (int64_t j = 0; j < static_cast<int64_t>(ids.size()); ++j)
    if (ids[j] >= 0 && ids[j] < E && ids[j] / L == bad) at = j;
  ASSERT_GE(at, 0) << "no entry routed to the rank itself";
  ids[at] = -1;
  expect_combine_rejects_on(c, bad, ids, GetParam());
}
INSTANTIATE_TEST_SUITE_P(CombineErrors, CombineOwnEntryDropped, ::testing::Values(0, 2),
                         [](const auto& info) {
                           return "comm_quant" + std::to_string(info.param);
                         });

// Runs last in this file: it leaves rank 0's messages pending on a communicator of its own (freed
// at the end of the scope); tests that follow, here or in other files, use other communicators.
TEST(DispatchTimeout, MissingRankTimesOut) {
  if (mpi().size == 1) GTEST_SKIP() << "needs a rank that does not call";
  Batch b = error_batch();
  {
    CommOptions opt;
    opt.timeout_s = 1.0;
    auto comm = Communicator::from_mpi(MPI_COMM_WORLD, opt);
    if (mpi().rank == 0) {
      EpConfig c = config(b);
      c.group_ep = comm.get();
      try {
        dispatch_v2(dispatch_inputs(b), c);
        ADD_FAILURE() << "no timeout";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kTimeout) << e.what();
        std::string ranks = "1";
        for (int r = 2; r < mpi().size; ++r) ranks += ", " + std::to_string(r);
        EXPECT_NE(std::string(e.what()).find("dispatch_v2: rank 0 timed out after 1 s in phase "
                                             "'header' waiting for rank(s) " +
                                             ranks),
                  std::string::npos)
            << e.what();
      }
      // The communicator is unusable now (its header messages are still posted, where a late
      // rank's call would take them): the next op on it is refused at once, naming the failure.
      const auto start = std::chrono::steady_clock::now();
      try {
        dispatch_v2(dispatch_inputs(b), c);
        ADD_FAILURE() << "a second op on a timed-out communicator ran";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
        EXPECT_NE(std::string(e.what()).find(
                      "dispatch_v2: group_ep is unusable: an earlier op on it failed (dispatch_v2 "
                      "timed out in phase 'header' waiting for rank(s) 1"),
                  std::string::npos)
            << e.what();
      }
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                0.5);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  // The world communicator is untouched.
  BatchSpec s;
  s.name = "after_timeout";
  round_trip(make_batch(s, mpi().size));
}

}  // namespace
}  // namespace moe_ep
