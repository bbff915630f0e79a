#include "reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moe_ep/error.h"
#include "numeric.h"

namespace moe_ep_tool {

std::vector<std::byte> dense_reference(const Batch& b, int64_t experts, ExpertBank& bank) {
  const int64_t N = b.tokens, H = b.hidden, K = b.top_k;
  const size_t row_bytes = static_cast<size_t>(H) * moe_ep::dtype_size(b.dtype);
  // Every entry's expert output, in the dtype (what a rank hands to combine).
  std::vector<std::byte> y(static_cast<size_t>(N * K) * row_bytes);
  std::vector<std::vector<int64_t>> entries(experts);  // per expert: flattened i*K+k, increasing
  for (int64_t j = 0; j < N * K; ++j) {
    const int32_t e = b.expert_ids[j];
    if (e == -1) continue;
    if (e < 0 || e >= experts) {
      throw moe_ep::Error(moe_ep::ErrorKind::kInternal,
                          "reference: expert_ids[" + std::to_string(j / K) + "," +
                              std::to_string(j % K) + "] = " + std::to_string(e) +
                              " passed dispatch_v2 but is outside [0, " + std::to_string(experts) +
                              ")");
    }
    entries[e].push_back(j);
  }
  std::vector<std::byte> in, out;
  for (int64_t e = 0; e < experts; ++e) {
    const auto& list = entries[e];
    if (list.empty()) continue;
    in.resize(list.size() * row_bytes);
    out.resize(list.size() * row_bytes);
    for (size_t r = 0; r < list.size(); ++r) {
      std::memcpy(in.data() + r * row_bytes, b.x.data() + (list[r] / K) * row_bytes, row_bytes);
    }
    bank.forward(e, in.data(), out.data(), static_cast<int64_t>(list.size()), b.dtype);
    for (size_t r = 0; r < list.size(); ++r) {
      std::memcpy(y.data() + list[r] * row_bytes, out.data() + r * row_bytes, row_bytes);
    }
  }
  std::vector<std::byte> result(static_cast<size_t>(N) * row_bytes);
  std::vector<float> acc(H);
  for (int64_t i = 0; i < N; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      if (b.expert_ids[i * K + k] < 0) continue;
      const float s = b.expert_scales[i * K + k];
      const std::byte* row = y.data() + (i * K + k) * row_bytes;
      for (int64_t h = 0; h < H; ++h) {
        const float p = s * load(b.dtype, row, h);  // rounded to fp32 before the add
        acc[h] = acc[h] + p;
      }
    }
    for (int64_t h = 0; h < H; ++h) store(b.dtype, result.data(), i * H + h, acc[h]);
  }
  return result;
}

CheckResult compare_outputs(const std::vector<std::byte>& out, const std::vector<std::byte>& ref,
                            moe_ep::DType dtype, ExpertFn fn) {
  CheckResult c;
  c.exact = fn != ExpertFn::kSwiglu;
  const int64_t n = static_cast<int64_t>(ref.size() / moe_ep::dtype_size(dtype));
  const size_t es = moe_ep::dtype_size(dtype);
  if (out.size() != ref.size()) {
    c.size_mismatch = true;
    c.mismatches = n;
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const double o = load(dtype, out.data(), i), r = load(dtype, ref.data(), i);
      const bool nan = std::isnan(o) || std::isnan(r);
      if (nan) ++c.nans;
      if (nan || std::memcmp(out.data() + i * es, ref.data() + i * es, es) != 0) ++c.mismatches;
      if (nan) continue;
      c.max_abs = std::max(c.max_abs, std::fabs(o - r));
      c.max_ref = std::max(c.max_ref, std::fabs(r));
    }
  }
  const bool bad = c.size_mismatch || c.nans > 0;
  c.max_rel = c.max_ref > 0 ? c.max_abs / c.max_ref : c.max_abs;
  if (c.exact) {
    c.rule = "bitwise equality (exact: expert-fn " + std::string(expert_fn_name(fn)) +
             " is computed identically by both)";
    c.pass = !bad && c.mismatches == 0;
  } else {
    c.tolerance = dtype == moe_ep::DType::kBF16 ? 1e-2 : dtype == moe_ep::DType::kF16 ? 1e-3 : 1e-5;
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "max|out - ref| / max|ref| <= %g for %s (GEMM batch composition may change "
                  "the low bits)",
                  c.tolerance, moe_ep::dtype_name(dtype));
    c.rule = buf;
    c.pass = !bad && c.max_rel <= c.tolerance;
  }
  if (c.size_mismatch) {
    c.rule += "; the output has " + std::to_string(out.size()) + " bytes, the reference " +
              std::to_string(ref.size());
  } else if (c.nans > 0) {
    c.rule += "; " + std::to_string(c.nans) + " element(s) NaN in the output or the reference";
  }
  return c;
}

}  // namespace moe_ep_tool
