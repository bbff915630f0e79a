#include "reference.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

#include "moe_ep/error.h"
#include "moe_ep/tensor.h"

namespace moe_ep_tool {

namespace {

// Unit roundoff of the dtype (half an ulp, relative) and half its smallest subnormal.
double unit_roundoff(moe_ep::DType dtype) {
  return dtype == moe_ep::DType::kBF16 ? 0x1p-8 : dtype == moe_ep::DType::kF16 ? 0x1p-11 : 0x1p-24;
}
double half_subnormal(moe_ep::DType dtype) {
  return dtype == moe_ep::DType::kBF16  ? 0x1p-134
         : dtype == moe_ep::DType::kF16 ? 0x1p-25
                                        : 0x1p-150;
}

// Whether entry (i, k) of the batch is active: a routed id (not -1) the mask allows.
bool active_entry(const Batch& b, int64_t i, int64_t k) {
  const int64_t K = b.top_k;
  if (b.expert_ids[i * K + k] == -1) return false;
  if (b.mask_dims == 1) return b.x_active_mask[i] != 0;
  if (b.mask_dims == 2) return b.x_active_mask[i * K + k] != 0;
  return true;
}

// Per expert (routed e, shared E + s): the result slots it computes (i (K + Ns) + k for entry k,
// i (K + Ns) + K + s for shared expert s), increasing; token_active[i]: whether token i has an
// active entry (only those get the shared experts). Ids in [E, id_end) are special experts.
std::vector<std::vector<int64_t>> expert_slots(const Batch& b, int64_t E, int64_t Ns,
                                               int64_t id_end, std::vector<char>& token_active) {
  const int64_t N = b.tokens, K = b.top_k, KS = K + Ns;
  token_active.assign(static_cast<size_t>(N), 0);
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(E + Ns));
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t k = 0; k < K; ++k) {
      if (!active_entry(b, i, k)) continue;
      token_active[i] = 1;
      const int32_t e = b.expert_ids[i * K + k];
      if (e < 0 || e >= id_end) {
        throw moe_ep::Error(moe_ep::ErrorKind::kInternal,
                            "reference: expert_ids[" + std::to_string(i) + "," + std::to_string(k) +
                                "] = " + std::to_string(e) +
                                " passed dispatch_v2 but is outside [0, " + std::to_string(id_end) +
                                ")");
      }
      if (e < E) slots[e].push_back(i * KS + k);
    }
    if (!token_active[i]) continue;
    for (int64_t s = 0; s < Ns; ++s) slots[E + s].push_back(i * KS + K + s);
  }
  return slots;
}

// How the reference of a quantised swiglu run was computed.
std::string reference_note(bool emulate_in, bool emulate_out) {
  return std::string("; the reference quantises like the run (SPEC §1.5: ") +
         (emulate_in ? "each expert input row" : "") + (emulate_in && emulate_out ? ", " : "") +
         (emulate_out ? "each expert output row sent back" : "") +
         "), so swiglu's tolerance still applies";
}

// The per-element bound of a quantised scale/identity run, in words.
std::string bound_rule(const LayerSpec& sp, moe_ep::DType dt) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "u = %s (%s)",
                dt == moe_ep::DType::kBF16  ? "2^-8"
                : dt == moe_ep::DType::kF16 ? "2^-11"
                                            : "2^-24",
                moe_ep::dtype_name(dt));
  if (!sp.quant && !sp.comm_quant)  // hierarchy alone: the re-association of SPEC §3
    return std::string(
               "per element |out - ref| <= 2 (K + Ns + 1) 2^-24 sum_t |w_t y_t| + 2.02 u "
               "|ref|") +
           (sp.low_partials ? " + u sum_t |w_t y_t| (--partials: each remote node's partial "
                              "rounded to the dtype)"
                            : "") +
           ", " + buf +
           " (--comm-alg hierarchy: sums re-associated per node, SPEC §3); t over the token's "
           "routed entries (w = expert_scales) and shared experts (w = 1); inactive tokens "
           "exactly 0";
  return std::string("per element |out - ref| <= (1 + 2^-20) sum_t |w_t| (") +
         (sp.quant ? "1.01 (c_t amax|x_i| / 254 (1 + u) + 2u |y_t|)" : "") +
         (sp.quant && sp.comm_quant ? " + " : "") +
         (sp.comm_quant
              ? std::string(sp.hierarchy ? "2 " : "") + "(amax|y_t| + its dispatch error) / 254"
              : std::string()) +
         ") + 2 (K + Ns + 1) 2^-24 sum_t |w_t y_t| + 2.02 u |ref|, " + buf +
         ", against the unquantised reference (the int8 bound amax/254 of SPEC §1.5 carried "
         "through the expert; " +
         (sp.quant ? "--quant: c_t = the expert's factor (scale 1 + e/E, identity 1)" : "") +
         (sp.quant && sp.comm_quant ? "; " : "") +
         (sp.comm_quant ? "--comm-quant: rows return as int8" : "") +
         (sp.hierarchy ? std::string((sp.quant || sp.comm_quant) ? "; " : "") +
                             "--comm-alg hierarchy: sums re-associated per node (SPEC §3)" +
                             (sp.comm_quant ? ", the relays' partial sums int8 too" : "")
                       : std::string()) +
         "); t over the token's routed entries (w = expert_scales) and shared experts (w = 1); "
         "special experts are not quantised; inactive tokens exactly 0";
}

// Every expert's rows as one batch: y[slot] (dtype rows, KS slots per token) for each slot of
// `slots[e]`; the input is x, or the dequantised fp32 rows `xdeq` for the experts `deq_in` says.
void expert_outputs(const Batch& b, const std::vector<std::vector<int64_t>>& slots, int64_t KS,
                    const std::vector<float>& xdeq, const std::function<bool(int64_t)>& deq_in,
                    ExpertBank& bank, std::vector<std::byte>& y) {
  const int64_t H = b.hidden;
  const moe_ep::DType dt = b.dtype;
  const size_t row_bytes = static_cast<size_t>(H) * moe_ep::dtype_size(dt);
  std::vector<std::byte> in, out;
  for (int64_t e = 0; e < static_cast<int64_t>(slots.size()); ++e) {
    const auto& list = slots[e];
    if (list.empty()) continue;
    const bool deq = deq_in(e);
    const moe_ep::DType in_dt = deq ? moe_ep::DType::kF32 : dt;
    const size_t in_row = static_cast<size_t>(H) * moe_ep::dtype_size(in_dt);
    const std::byte* in_base = deq ? reinterpret_cast<const std::byte*>(xdeq.data()) : b.x.data();
    in.resize(list.size() * in_row);
    out.resize(list.size() * row_bytes);
    for (size_t r = 0; r < list.size(); ++r) {
      std::memcpy(in.data() + r * in_row, in_base + (list[r] / KS) * in_row, in_row);
    }
    bank.forward(e, in.data(), in_dt, out.data(), dt, static_cast<int64_t>(list.size()));
    for (size_t r = 0; r < list.size(); ++r) {
      std::memcpy(y.data() + list[r] * row_bytes, out.data() + r * row_bytes, row_bytes);
    }
  }
}

}  // namespace

float quantize_dequantize_row(const float* xf, int64_t n, float* deq) {
  float amax = 0;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xf[i]));
  if (amax == 0) {
    std::fill(deq, deq + n, 0.0f);
    return 0;
  }
  const float s = 127.0f / amax;
  const float inv = 1.0f / s;
  for (int64_t i = 0; i < n; ++i) {
    const float p = xf[i] * s;
    const float q = std::clamp(std::nearbyint(p), -127.0f, 127.0f);  // ties to even
    deq[i] = q * inv;
  }
  return inv;
}

Reference dense_reference(const Batch& b, const LayerSpec& sp, ExpertFn fn, ExpertBank& bank) {
  const int64_t N = b.tokens, H = b.hidden, K = b.top_k, E = sp.experts, Ns = sp.shared;
  const int64_t KS = K + Ns;  // result slots per token: K entries, then Ns shared experts
  const int64_t copy_begin = E + sp.zero, const_begin = copy_begin + sp.copy,
                id_end = const_begin + sp.constant;
  const moe_ep::DType dt = b.dtype;
  const size_t row_bytes = static_cast<size_t>(H) * moe_ep::dtype_size(dt);
  const bool emulate_in = fn == ExpertFn::kSwiglu && sp.quant;
  const bool emulate_out = fn == ExpertFn::kSwiglu && sp.comm_quant;
  const bool bounded = fn != ExpertFn::kSwiglu && (sp.quant || sp.comm_quant || sp.hierarchy);

  auto entry_active = [&](int64_t i, int64_t k) { return active_entry(b, i, k); };
  std::vector<char> token_active;
  const std::vector<std::vector<int64_t>> slots = expert_slots(b, E, Ns, id_end, token_active);

  // Expert inputs: x in the dtype, or (quantised swiglu) the dequantised fp32 rows.
  std::vector<float> xdeq;
  if (emulate_in) {
    xdeq.resize(static_cast<size_t>(N * H));
    std::vector<float> xf(static_cast<size_t>(H));
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t h = 0; h < H; ++h) xf[h] = moe_ep::load_float(dt, b.x.data(), i * H + h);
      quantize_dequantize_row(xf.data(), H, xdeq.data() + i * H);
    }
  }
  auto quantised = [&](int64_t e) { return e < E || !sp.shared_local; };

  // Every slot's expert output, in the dtype (what a rank hands to combine).
  std::vector<std::byte> y(static_cast<size_t>(N * KS) * row_bytes);
  expert_outputs(
      b, slots, KS, xdeq, [&](int64_t e) { return emulate_in && quantised(e); }, bank, y);

  Reference ref;
  ref.out.resize(static_cast<size_t>(N) * row_bytes);
  if (bounded) ref.bound.assign(static_cast<size_t>(N * H), 0.0);
  const double u = unit_roundoff(dt), tiny = half_subnormal(dt);
  std::vector<float> acc(H), yf(H), deq(H);
  std::vector<double> err(H), mag(H), ymar(H);
  for (int64_t i = 0; i < N; ++i) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    if (!token_active[i]) {
      for (int64_t h = 0; h < H; ++h) moe_ep::store_float(dt, ref.out.data(), i * H + h, 0.0f);
      continue;
    }
    const std::byte* xi = b.x.data() + i * row_bytes;
    double amax_x = 0;
    if (bounded) {
      std::fill(err.begin(), err.end(), 0.0);
      std::fill(mag.begin(), mag.end(), 0.0);
      for (int64_t h = 0; h < H; ++h)
        amax_x = std::max(amax_x, std::fabs(double(moe_ep::load_float(dt, xi, h))));
    }
    const double dx = sp.quant ? amax_x / 254 * (1 + 0x1p-14) + 0x1p-143 : 0;
    // One expert output row (routed or shared) with weight w (factor c of scale/identity).
    auto add_expert = [&](const std::byte* row, float w, bool weighted, float c, bool q) {
      for (int64_t h = 0; h < H; ++h) yf[h] = moe_ep::load_float(dt, row, h);
      const float* v = yf.data();
      if (emulate_out && q) {
        quantize_dequantize_row(yf.data(), H, deq.data());
        v = deq.data();
      }
      for (int64_t h = 0; h < H; ++h) {
        if (weighted) {
          const float p = w * v[h];  // rounded to fp32 before the add
          acc[h] = acc[h] + p;
        } else {
          acc[h] = acc[h] + v[h];
        }
      }
      if (!bounded) return;
      // The run's y differs by the dispatch int8 error through the expert (factor c) and the
      // dtype rounding of y; combine's int8 error is relative to the row's max.
      double amax_y = 0, ymax = 0;
      for (int64_t h = 0; h < H; ++h) {
        const double a = std::fabs(double(yf[h]));
        amax_y = std::max(amax_y, a);
        ymar[h] = sp.quant && q ? 1.01 * (c * dx * (1 + u) + 2 * u * a) + 2 * tiny : 0;
        ymax = std::max(ymax, ymar[h]);
      }
      // With hierarchy the relay's partial (at most the sum of its terms' magnitudes) is
      // quantised once more: each term adds its own int8 step again.
      const double dy =
          sp.comm_quant && q
              ? (sp.hierarchy ? 2 : 1) * (amax_y + ymax) / 254 * (1 + 0x1p-14) + 0x1p-143
              : 0;
      const double aw = std::fabs(double(w));
      for (int64_t h = 0; h < H; ++h) {
        err[h] += aw * (ymar[h] + dy) * (1 + 0x1p-20);
        mag[h] += aw * (std::fabs(double(yf[h])) + ymar[h] + dy);
      }
    };
    for (int64_t k = 0; k < K; ++k) {
      if (!entry_active(i, k)) continue;
      const int32_t e = b.expert_ids[i * K + k];
      const float w = b.expert_scales[i * K + k];
      if (e < E) {
        add_expert(y.data() + (i * KS + k) * row_bytes, w, true, bank.factor(e), true);
      } else if (e < copy_begin) {
        // zero expert: contributes 0
      } else if (e < const_begin) {
        for (int64_t h = 0; h < H; ++h) {
          const float p = w * moe_ep::load_float(dt, xi, h);
          acc[h] = acc[h] + p;
          if (bounded) mag[h] += std::fabs(double(p));
        }
      } else {
        const int64_t q = e - const_begin;
        const std::byte* a1 = sp.alpha_1.data() + q * row_bytes;
        const std::byte* a2 = sp.alpha_2.data() + q * row_bytes;
        const std::byte* v = sp.const_v.data() + q * row_bytes;
        for (int64_t h = 0; h < H; ++h) {
          const float t1 = moe_ep::load_float(dt, a1, h) * moe_ep::load_float(dt, xi, h);
          const float t2 = moe_ep::load_float(dt, a2, h) * moe_ep::load_float(dt, v, h);
          const float t = t1 + t2;
          const float p = w * t;
          acc[h] = acc[h] + p;
          if (bounded) mag[h] += std::fabs(double(p));
        }
      }
    }
    for (int64_t s = 0; s < Ns; ++s) {
      add_expert(y.data() + (i * KS + K + s) * row_bytes, 1.0f, false, bank.factor(E + s),
                 quantised(E + s));
    }
    for (int64_t h = 0; h < H; ++h) moe_ep::store_float(dt, ref.out.data(), i * H + h, acc[h]);
    if (bounded) {
      // The relays' partials rounded to the dtype: at most u per term's magnitude (int8 instead
      // with --comm-quant, bounded above).
      const double gamma = 2.0 * static_cast<double>(K + Ns + 1) * 0x1p-24 +
                           (sp.low_partials && !sp.comm_quant ? u : 0.0);
      for (int64_t h = 0; h < H; ++h) {
        const double eacc = err[h] + gamma * mag[h];
        const double r = std::fabs(double(moe_ep::load_float(dt, ref.out.data(), i * H + h)));
        ref.bound[i * H + h] = eacc * (1 + u) + 2.02 * u * r + 2 * tiny;
      }
    }
  }
  if (emulate_in || emulate_out) ref.note = reference_note(emulate_in, emulate_out);
  if (bounded) ref.bound_rule = bound_rule(sp, dt);
  return ref;
}

CheckResult compare_outputs(const std::vector<std::byte>& out, const Reference& reference,
                            moe_ep::DType dtype, ExpertFn fn) {
  const std::vector<std::byte>& ref = reference.out;
  CheckResult c;
  c.bounded = !reference.bound.empty();
  c.exact = fn != ExpertFn::kSwiglu && !c.bounded;
  const int64_t n = static_cast<int64_t>(ref.size() / moe_ep::dtype_size(dtype));
  const size_t es = moe_ep::dtype_size(dtype);
  if (out.size() != ref.size()) {
    c.size_mismatch = true;
    c.mismatches = n;
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const double o = moe_ep::load_float(dtype, out.data(), i),
                   r = moe_ep::load_float(dtype, ref.data(), i);
      const bool nan = std::isnan(o) || std::isnan(r);
      if (nan) ++c.nans;
      if (nan || std::memcmp(out.data() + i * es, ref.data() + i * es, es) != 0) ++c.mismatches;
      if (nan) continue;
      const double d = std::fabs(o - r);
      c.max_abs = std::max(c.max_abs, d);
      c.max_ref = std::max(c.max_ref, std::fabs(r));
      if (c.bounded) {
        const double b = reference.bound[i];
        if (d > b) ++c.over_bound;
        c.max_ratio = std::max(c.max_ratio, b > 0 ? d / b : (d > 0 ? INFINITY : 0.0));
      }
    }
  }
  const bool bad = c.size_mismatch || c.nans > 0;
  c.max_rel = c.max_ref > 0 ? c.max_abs / c.max_ref : c.max_abs;
  if (c.exact) {
    c.rule = "bitwise equality (exact: expert-fn " + std::string(expert_fn_name(fn)) +
             " is computed identically by both)";
    c.pass = !bad && c.mismatches == 0;
  } else if (c.bounded) {
    c.rule = reference.bound_rule;
    c.pass = !bad && c.over_bound == 0;
  } else {
    c.tolerance = dtype == moe_ep::DType::kBF16 ? 1e-2 : dtype == moe_ep::DType::kF16 ? 1e-3 : 1e-5;
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "max|out - ref| / max|ref| <= %g for %s (GEMM batch composition may change "
                  "the low bits)",
                  c.tolerance, moe_ep::dtype_name(dtype));
    c.rule = buf + reference.note;
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
