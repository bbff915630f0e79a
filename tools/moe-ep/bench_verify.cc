#include "bench_verify.h"

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "batch.h"
#include "bench_baselines.h"
#include "common.h"
#include "experts.h"
#include "moe_ep/dispatch.h"
#include "reference.h"

namespace moe_ep_tool::bench {

using moe_ep::DType;
using moe_ep::Tensor;

namespace {

// Bitwise, except that +0 and -0 are equal.
bool same_values(DType dtype, const void* a, const void* b, int64_t n, int64_t* first_bad) {
  const size_t es = moe_ep::dtype_size(dtype);
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(static_cast<const char*>(a) + i * es, static_cast<const char*>(b) + i * es,
                    es) == 0) {
      continue;
    }
    if (moe_ep::load_float(dtype, a, i) == 0.0f && moe_ep::load_float(dtype, b, i) == 0.0f) {
      continue;
    }
    *first_bad = i;
    return false;
  }
  return true;
}

// The checks of one point on one rank; verify() runs them in order.
class Verifier {
 public:
  Verifier(const BenchOptions& o, const Point& p, moe_ep::Communicator& comm, Watchdog& dog)
      : o_(o),
        p_(p),
        comm_(comm),
        cfg_(make_ep_config(o, comm, p.E, "fullmesh")),
        dog_(dog),
        din_(p.dispatch_inputs()) {}

  void dispatch_layout();
  void combine_reference();
  void textbook();
  void alltoallv();
  void int8();
  void hierarchy();
  Verification& result() { return v_; }

 private:
  void fail(Check c, int64_t count, const std::string& what);
  const std::byte* expand_x() const { return static_cast<const std::byte*>(d_.expand_x.data()); }
  bool delivered() const { return valid_ == p_.valid; }

  const BenchOptions& o_;
  const Point& p_;
  moe_ep::Communicator& comm_;
  const moe_ep::EpConfig cfg_;
  Watchdog& dog_;
  moe_ep::DispatchInputs din_;
  Verification v_;
  std::vector<int64_t> expected_;  // the global token of each row SPEC §1.4 expects here
  moe_ep::DispatchOutputs d_;
  int64_t valid_ = 0;  // the rows dispatch_v2 delivered
  Tensor y_, out_;     // the scale experts' outputs (expand_x's layout), combine_v2's output
  Batch local_;        // this rank's tokens and routing, for the references
};

void Verifier::fail(Check c, int64_t count, const std::string& what) {
  if (v_.failures[c] == 0) {
    std::fprintf(stderr, "moe-ep bench: rank %lld, tokens/rank %lld: verification failed: %s\n",
                 static_cast<long long>(p_.rank), static_cast<long long>(p_.BS), what.c_str());
    std::fflush(stderr);
  }
  v_.failures[c] += count;
}

// The SPEC §1.4 layout (by local expert, source rank, then the source's entry i K + k) against
// dispatch_v2's expand_x.
void Verifier::dispatch_layout() {
  const int64_t W = p_.W, L = p_.L, K = p_.K, BS = p_.BS, rb = p_.row_bytes;
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t s = 0; s < W; ++s) {
      for (int64_t j = 0; j < BS * K; ++j) {
        if (p_.ids_all[s * BS * K + j] == p_.rank * L + l) expected_.push_back(s * BS + j / K);
      }
    }
  }
  d_ = moe_ep::dispatch_v2(din_, cfg_);
  valid_ = d_.ep_recv_counts.ptr<int32_t>()[W * L - 1];
  const int64_t n = static_cast<int64_t>(expected_.size());
  v_.total[kCheckLayout] = n;
  if (valid_ != n || !delivered()) {
    fail(kCheckLayout, std::max<int64_t>(1, n),
         "dispatch_v2 delivered " + std::to_string(valid_) + " rows, SPEC §1.4 expects " +
             std::to_string(n));
    return;
  }
  std::vector<std::byte> want(static_cast<size_t>(rb));
  for (int64_t j = 0; j < valid_; ++j) {
    p_.token_row(expected_[j], want.data());
    if (std::memcmp(expand_x() + j * rb, want.data(), static_cast<size_t>(rb))) {
      fail(kCheckLayout, 1,
           "dispatch_v2 expand_x row " + std::to_string(j) + " is not global token " +
               std::to_string(expected_[j]) + " (SPEC §1.4 order)");
    }
  }
}

// combine_v2 of the rows through expert e: y = x * (1 + e/E) (experts.h), against SPEC §2.3.
void Verifier::combine_reference() {
  const int64_t W = p_.W, L = p_.L, BS = p_.BS, H = p_.H, K = p_.K, rb = p_.row_bytes;
  ExpertBank bank(ExpertFn::kScale, o_.seed, p_.E, H, 1);
  // Shaped like expand_x, as a layer's expert outputs are: so the peak RSS line shows what
  // EpConfig::exact_size changes (A rows, or the valid ones).
  y_ = Tensor::zeros(p_.dtype, {d_.expand_x.size(0), H});
  const int32_t* incl = d_.ep_recv_counts.ptr<int32_t>();
  for (int64_t l = 0; l < L && delivered(); ++l) {
    const int64_t begin = l == 0 ? 0 : incl[l * W - 1], end = incl[(l + 1) * W - 1];
    if (end > begin) {
      bank.forward(p_.rank * L + l, expand_x() + begin * rb, p_.dtype,
                   static_cast<std::byte*>(y_.data()) + begin * rb, p_.dtype, end - begin);
    }
  }
  out_ = moe_ep::combine_v2(combine_inputs(din_, d_, y_), cfg_);
  local_.tokens = BS;
  local_.hidden = H;
  local_.top_k = K;
  local_.dtype = p_.dtype;
  local_.x.assign(p_.x(), p_.x() + BS * rb);
  local_.expert_ids.assign(p_.ids(), p_.ids() + BS * K);
  local_.expert_scales = p_.scales;
  LayerSpec spec;
  spec.experts = p_.E;
  ExpertBank ref_bank(ExpertFn::kScale, o_.seed, p_.E, H, 1);
  const Reference ref = dense_reference(local_, spec, ExpertFn::kScale, ref_bank);
  const std::byte* out = static_cast<const std::byte*>(out_.data());
  const CheckResult c = compare_outputs(std::vector<std::byte>(out, out + out_.nbytes()), ref,
                                        p_.dtype, ExpertFn::kScale);
  v_.total[kCheckCombine] = BS * H;
  if (!c.pass) {
    fail(kCheckCombine, std::max<int64_t>(1, c.mismatches),
         "combine_v2 differs from the SPEC §2.3 reference in " + std::to_string(c.mismatches) +
             " elements (max abs err " + fmt("%.3g", c.max_abs) + ")");
  }
}

// The textbook pipeline: the same rows as expand_x, and the same combine output.
void Verifier::textbook() {
  const int64_t BS = p_.BS, H = p_.H, rb = p_.row_bytes;
  RowType row(rb);
  Textbook tb(p_, row.get());
  guarded(dog_, "the textbook pipeline's dispatch", [&] { tb.dispatch(din_.x, din_.expert_ids); });
  if (o_.debug_corrupt_baseline && tb.valid() > 0) tb.expand()[0] ^= std::byte{1};
  v_.total[kCheckTbDispatch] = valid_;
  if (tb.valid() != valid_) {
    fail(kCheckTbDispatch, std::max<int64_t>(1, valid_),
         "the textbook pipeline delivered " + std::to_string(tb.valid()) + " rows, dispatch_v2 " +
             std::to_string(valid_));
  } else {
    int64_t bad = 0;
    for (int64_t j = 0; j < valid_; ++j) {
      if (std::memcmp(tb.expand() + j * rb, expand_x() + j * rb, static_cast<size_t>(rb))) ++bad;
    }
    if (bad > 0) {
      fail(kCheckTbDispatch, bad,
           std::to_string(bad) +
               " rows of the textbook pipeline's regrouped rows differ from "
               "dispatch_v2's expand_x");
    }
  }
  Tensor tb_out;
  guarded(dog_, "the textbook pipeline's combine", [&] {
    tb_out = tb.combine(static_cast<const std::byte*>(y_.data()), *din_.expert_scales);
  });
  v_.total[kCheckTbCombine] = BS * H;
  int64_t first = 0;
  if (tb.valid() == valid_ && !same_values(p_.dtype, tb_out.data(), out_.data(), BS * H, &first)) {
    fail(kCheckTbCombine, 1,
         "the textbook pipeline's combine differs from combine_v2 at token " +
             std::to_string(first / H) + ", h " + std::to_string(first % H));
  }
}

// The bare MPI_Alltoallv: received in (source, local expert) order, each chunk equal to
// expand_x's (l, s) block; and back unchanged.
void Verifier::alltoallv() {
  const int64_t W = p_.W, L = p_.L, rb = p_.row_bytes;
  Alltoallv a2a(p_, rb);
  guarded(dog_, "the bare MPI_Alltoallv", [&] {
    a2a.dispatch();
    a2a.combine();
  });
  const int32_t* incl = d_.ep_recv_counts.ptr<int32_t>();
  v_.total[kCheckA2aDispatch] = valid_;
  int64_t bad = 0, at = 0;
  for (int64_t s = 0; s < W && delivered(); ++s) {
    for (int64_t l = 0; l < L; ++l) {
      const int64_t b = l * W + s, n = p_.recv_block[s * L + l];
      const int64_t block = b == 0 ? 0 : incl[b - 1];
      for (int64_t r = 0; r < n; ++r, ++at) {
        if (std::memcmp(a2a.received().data() + at * rb, expand_x() + (block + r) * rb,
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
  v_.total[kCheckA2aCombine] = p_.BS * p_.K;
  if (a2a.returned() != a2a.sent()) {
    fail(kCheckA2aCombine, 1, "the bare MPI_Alltoallv did not bring the rows back unchanged");
  }
}

// quant_mode 2: each int8 row and its dynamic scale against SPEC §1.5 on the expected row.
void Verifier::int8() {
  const int64_t H = p_.H, rb = p_.row_bytes;
  moe_ep::DispatchInputs din = din_;
  din.quant_mode = 2;
  const moe_ep::DispatchOutputs dq = moe_ep::dispatch_v2(din, cfg_);
  v_.total[kCheckInt8] = valid_;
  const int8_t* q = dq.expand_x.ptr<int8_t>();
  const float* dyn = dq.dynamic_scales.ptr<float>();
  std::vector<float> xf(static_cast<size_t>(H)), deq(static_cast<size_t>(H));
  std::vector<std::byte> row(static_cast<size_t>(rb));
  int64_t bad = 0;
  for (int64_t j = 0; j < valid_ && j < static_cast<int64_t>(expected_.size()); ++j) {
    p_.token_row(expected_[j], row.data());
    const std::byte* src = row.data();
    for (int64_t h = 0; h < H; ++h) xf[h] = moe_ep::load_float(p_.dtype, src, h);
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

// comm_alg hierarchy on the same batch: expand_x (every valid row) bitwise fullmesh's, and the
// combine of the same expert outputs within SPEC §3's bound of the reference.
void Verifier::hierarchy() {
  const int64_t H = p_.H, rb = p_.row_bytes;
  const moe_ep::EpConfig cfg = make_ep_config(o_, comm_, p_.E, "hierarchy");
  const moe_ep::DispatchOutputs d = moe_ep::dispatch_v2(din_, cfg);
  const int64_t valid = d.ep_recv_counts.ptr<int32_t>()[p_.W * p_.L - 1];
  v_.total[kCheckHierarchy] = valid_ + p_.BS * H;
  const bool rows_ok =
      valid == valid_ && (valid == 0 || std::memcmp(d.expand_x.data(), expand_x(),
                                                    static_cast<size_t>(valid * rb)) == 0);
  if (!rows_ok)
    fail(kCheckHierarchy, std::max<int64_t>(1, valid),
         "dispatch_v2 with comm_alg hierarchy delivered other rows than fullmesh (" +
             std::to_string(valid) + " rows against " + std::to_string(valid_) + ")");
  // combine_v2 is collective: every rank calls it, whatever its own rows' verdict (its errors
  // reach every rank alike).
  Tensor out;
  try {
    out = moe_ep::combine_v2(combine_inputs(din_, d, y_), cfg);
  } catch (const moe_ep::Error& e) {
    fail(kCheckHierarchy, 1, std::string("combine_v2 with comm_alg hierarchy: ") + e.what());
    return;
  }
  if (!rows_ok) return;
  LayerSpec spec;
  spec.experts = p_.E;
  spec.hierarchy = true;
  spec.low_partials = o_.partials != "fp32";
  ExpertBank bank(ExpertFn::kScale, o_.seed, p_.E, H, 1);
  const Reference ref = dense_reference(local_, spec, ExpertFn::kScale, bank);
  const std::byte* o = static_cast<const std::byte*>(out.data());
  const CheckResult c =
      compare_outputs(std::vector<std::byte>(o, o + out.nbytes()), ref, p_.dtype, ExpertFn::kScale);
  if (!c.pass)
    fail(kCheckHierarchy, std::max<int64_t>(1, c.over_bound),
         "combine_v2 with comm_alg hierarchy is outside SPEC §3's bound in " +
             std::to_string(c.over_bound) + " elements (max abs err " + fmt("%.3g", c.max_abs) +
             ")");
}

}  // namespace

const char* check_description(Check check) {
  static const char* const kWhat[kChecks] = {
      "dispatch_v2 expand_x == SPEC §1.4 layout (rows)",
      "combine_v2 of scale experts == SPEC §2.3 reference, bitwise (elements)",
      "textbook rows == dispatch_v2 expand_x (rows)",
      "textbook combine == combine_v2, bitwise, +0 == -0 (elements)",
      "alltoallv moved the same rows (rows)",
      "alltoallv brought them back unchanged (rows)",
      "quant_mode 2 int8 rows and dynamic_scales == SPEC §1.5 (rows)",
      "comm_alg hierarchy: expand_x == fullmesh's (rows), combine within SPEC §3's bound "
      "(elements)",
  };
  return kWhat[check];
}

int64_t Verification::failed() const {
  int64_t n = 0;
  for (const int64_t f : failures) n += f;
  return n;
}

Verification verify(const BenchOptions& o, const Setup& s, const Point& p,
                    moe_ep::Communicator& comm, bool compare, bool quant, Watchdog& dog) {
  Verifier checks(o, p, comm, dog);
  checks.dispatch_layout();
  checks.combine_reference();
  if (compare) {
    checks.textbook();
    checks.alltoallv();
  }
  if (quant) checks.int8();
  if (s.hierarchy) checks.hierarchy();
  Verification& v = checks.result();
  guarded(dog, "the verification summary", [&] {
    MPI_Allreduce(MPI_IN_PLACE, v.failures, kChecks, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, v.total, kChecks, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  });
  return v;
}

}  // namespace moe_ep_tool::bench
