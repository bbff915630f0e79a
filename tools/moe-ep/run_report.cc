#include "run_report.h"

#include <algorithm>
#include <cstdio>
#include <map>

#include "common.h"

namespace moe_ep_tool {

namespace {

double max_of(const std::vector<RankStats>& all, double RankStats::*field) {
  double m = 0;
  for (const RankStats& s : all) m = std::max(m, s.*field);
  return m;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[(v.size() - 1) / 2];
}

// "3 ms", "1.23 ms", "0.0456 ms": three significant digits.
std::string ms(double seconds) { return fmt("%.3g ms", seconds * 1e3); }

std::string plural(int64_t n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

// The header's fields: the layer, the ranks and special features, the batch and the seed.
std::vector<std::string> header_fields(const RunOptions& o, const Plan& p, int64_t W) {
  const Preset& layer = p.layer;
  const std::string redundant_words =
      p.R > 0 ? " (+" + plural(p.R, "redundant slot", "redundant slots") + ": " +
                    p.redundant.describe() + ")"
              : std::string();
  std::vector<std::string> f = {
      "moe-ep run: preset " + layer.name,
      "H " + std::to_string(layer.hidden),
      "E " + std::to_string(layer.experts) + redundant_words,
      "K " + std::to_string(layer.top_k),
      "FFN " + std::to_string(layer.ffn),
      std::string("dtype ") + moe_ep::dtype_name(p.dtype),
      std::string("expert-fn ") + expert_fn_name(p.fn),
      "W " + std::to_string(W) +
          (p.T > 1 ? " (EP " + std::to_string(p.Wep) + " x TP " + std::to_string(p.T) + ")"
                   : std::string())};
  if (p.Ns > 0) {
    f.push_back("shared " + std::to_string(p.Ns) + " on " +
                (p.S > 0 ? plural(p.S, "rank", "ranks") : std::string("every rank")));
  }
  if (p.Z + p.C + p.Q > 0) {
    f.push_back("zero/copy/const " + std::to_string(p.Z) + "/" + std::to_string(p.C) + "/" +
                std::to_string(p.Q));
  }
  if (o.quant == "int8") f.push_back("quant int8");
  if (o.comm_quant == "int8") f.push_back("comm-quant int8");
  if (o.exact_size) f.push_back("exact-size");
  if (o.partials != "fp32") f.push_back("partials " + o.partials);
  if (p.mask_dims > 0) {
    f.push_back("mask " + (p.loaded() ? std::string(p.mask_dims == 1 ? "1-D" : "2-D") : o.mask));
  }
  if (o.global_bs) f.push_back("global_bs " + std::to_string(p.global_bs));
  std::string tokens = "tokens/rank ";
  if (p.uneven) {
    for (int64_t r = 0; r < W; ++r) {
      if (r > 0) tokens += ',';
      tokens += std::to_string(p.bs[r]);
    }
  } else {
    tokens += std::to_string(p.bs[0]);
  }
  f.push_back(tokens + " (N " + std::to_string(p.N) + (p.loaded() ? ", from the file" : "") + ")");
  f.push_back(p.seed_desc);
  return f;
}

// Where the experts are: shared-expert ranks, then the routed experts (or slots) by rank.
std::string placement_words(const RunOptions& o, const Plan& p) {
  const int64_t E = p.layer.experts, L = p.L, S = p.S, R = p.R;
  const int64_t per_shared = S > 0 ? S / p.Ns : 1;
  std::string placement;
  if (S > 0) {
    placement = plural(S, "shared-expert rank", "shared-expert ranks") + " [0, " +
                std::to_string(S) + ") (shared expert s on ranks [s x " +
                std::to_string(per_shared) + ", (s + 1) x " + std::to_string(per_shared) +
                ")), then ";
  }
  const std::string on_rank = S > 0 ? std::to_string(S) + " + " : std::string();
  if (R > 0) {
    placement += plural(L, "expert slot", "expert slots") +
                 " per rank (moe_expert_num = E + R = " + std::to_string(E + R) +
                 "; slot p on rank " + on_rank + "p / " + std::to_string(L) + "; slot p < " +
                 std::to_string(E) + " holds expert p, slots [" + std::to_string(E) + ", " +
                 std::to_string(E + R) + ") " + p.redundant.describe() + ": " + p.redundant_desc +
                 "; special expert ids shifted by R)";
  } else {
    placement += plural(L, "expert", "experts") + " per rank (expert e on rank " + on_rank +
                 "e / " + std::to_string(L) + ")";
  }
  if (S == 0 && p.Ns > 0) placement += "; the shared expert on every rank (shared_expert_x)";
  if (p.T > 1) {
    placement +=
        "; world rank r = EP rank r / 2, TP rank r % 2; each TP rank computes half "
        "of every expert (" +
        std::string(p.fn == ExpertFn::kSwiglu ? "FFN split in halves"
                                              : "TP rank 0 the value, rank 1 zeros") +
        ")";
  }
  if (p.uneven && !o.global_bs) placement += ", global_bs = W_ep x max tokens per rank";
  return placement;
}

}  // namespace

WarmTimes median_of_max(const std::vector<double>& dispatch_all,
                        const std::vector<double>& combine_all, int n) {
  WarmTimes w;
  w.n = n;
  if (n == 0) return w;
  const size_t ranks = dispatch_all.size() / static_cast<size_t>(n);
  std::vector<double> d(static_cast<size_t>(n), 0.0), c(static_cast<size_t>(n), 0.0);
  for (size_t r = 0; r < ranks; ++r) {
    for (int i = 0; i < n; ++i) {
      d[i] = std::max(d[i], dispatch_all[r * n + i]);
      c[i] = std::max(c[i], combine_all[r * n + i]);
    }
  }
  w.dispatch_s = median(d);
  w.combine_s = median(c);
  return w;
}

void print_header(const RunOptions& o, const Plan& p, int64_t W) {
  std::printf("%s\n", wrap_fields(header_fields(o, p, W), 2).c_str());
  if (!p.loaded()) print_wrapped("  router scores: " + describe_scoring(p.layer), 4);
  if (!p.layer.note.empty()) print_wrapped("  note: " + p.layer.note, 4);
  print_wrapped("  routing: " + p.routing_desc, 4);
  print_threads_line();
  print_wrapped("  placement: " + placement_words(o, p), 4);
  if (p.mask_dims > 0) print_wrapped("  x_active_mask: " + p.mask_desc, 4);
  std::fflush(stdout);
}

void print_redundant_usage(const Plan& p, const Batch& global) {
  const RedundantExperts& redundant = p.redundant;
  const int64_t K = p.layer.top_k, mask_row = p.mask_dims == 2 ? K : 1;
  std::map<int32_t, std::map<int32_t, int64_t>> used;
  for (int64_t i = 0; i < p.N; ++i) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = global.expert_ids[i * K + k];
      const bool active =
          p.mask_dims == 0 || global.x_active_mask[i * mask_row + (p.mask_dims == 2 ? k : 0)];
      if (active && redundant.copies.count(e)) ++used[e][redundant.physical(e, i)];
    }
  }
  std::string words;
  size_t shown = 0;
  for (const auto& [e, copies] : redundant.copies) {
    if (shown++ == 8) {
      words += "; ...";
      break;
    }
    std::string slots_words, rows_words;
    for (const int32_t slot : copies) {
      if (!slots_words.empty()) {
        slots_words += '/';
        rows_words += '/';
      }
      const auto it = used[e].find(slot);
      slots_words += std::to_string(slot);
      rows_words += std::to_string(it == used[e].end() ? 0 : it->second);
    }
    words += (words.empty() ? "" : "; ") + std::string("expert ") + std::to_string(e) +
             " on slots " + slots_words + ": " + rows_words + " rows";
  }
  print_wrapped("  redundant slots used (rows per slot, original first): " + words, 4);
  std::fflush(stdout);
}

void print_measurements(const RunOptions& o, const Plan& p, const std::vector<RankStats>& all,
                        const WarmTimes& warm) {
  const double W = static_cast<double>(all.size());
  double rmin = all[0].received_rows, rsum = 0, cross = 0;
  for (const RankStats& s : all) {
    rmin = std::min(rmin, s.received_rows);
    rsum += s.received_rows;
    cross += s.sent_other_rows;
  }
  const double rmean = rsum / W, rmax = max_of(all, &RankStats::received_rows);
  std::printf(
      "%s\n",
      wrap_fields({std::string("tokens received per rank (dispatch valid rows") +
                       (p.T > 1 ? ", with the TP peer's" : "") + "): min " + fmt("%.0f", rmin),
                   "mean " + fmt("%.1f", rmean), "max " + fmt("%.0f", rmax),
                   "imbalance max/mean " + (rmean > 0 ? fmt("%.3f", rmax / rmean) : "n/a")})
          .c_str());
  const double dispatch_s = max_of(all, &RankStats::dispatch_s);
  const double combine_s = max_of(all, &RankStats::combine_s);
  std::printf(
      "time per phase, ms (max over ranks; cold = the first call, window set-up included):\n");
  std::printf("%s\n",
              wrap_fields({"  route " + fmt("%.3f", 1e3 * max_of(all, &RankStats::route_s)),
                           "dispatch " + fmt("%.3f", 1e3 * dispatch_s) + " cold",
                           "experts " + fmt("%.3f", 1e3 * max_of(all, &RankStats::experts_s)),
                           "combine " + fmt("%.3f", 1e3 * combine_s) + " cold"},
                          4)
                  .c_str());
  std::printf("  expert weight generation %.1f ms, not counted\n",
              1e3 * max_of(all, &RankStats::generate_s));
  if (warm.n > 0) {
    std::printf(
        "warm, ms (median of %d repeats of dispatch_v2 + combine_v2 on the same inputs, "
        "max over ranks):\n  dispatch %.3f  combine %.3f\n",
        warm.n, 1e3 * warm.dispatch_s, 1e3 * warm.combine_s);
  }
  auto mb = [&](double RankStats::*field) {
    double sum = 0;
    for (const RankStats& s : all) sum += s.*field;
    return fmt("%.3f", sum / W / 1e6);
  };
  print_wrapped(
      "bytes per rank, MB (all that the first call moved: the rows with their per-row "
      "metadata and the counts; mean over ranks; comm_alg " +
          o.comm_alg + "): dispatch inter-node " + mb(&RankStats::dispatch_inter) +
          ", intra-node " + mb(&RankStats::dispatch_intra) + "; combine inter-node " +
          mb(&RankStats::combine_inter) + ", intra-node " + mb(&RankStats::combine_intra),
      2);
  // Bytes of one row on the wire: int8 values and an fp32 scale when quantised.
  const double H = static_cast<double>(p.layer.hidden);
  const double row = H * static_cast<double>(moe_ep::dtype_size(p.dtype));
  const double dispatch_row = o.quant == "int8" ? H + 4 : row;
  const double combine_row = o.comm_quant == "int8" ? H + 4 : row;
  const double rows_per_rank = cross / W;
  if (cross <= 0) {
    std::printf("bandwidth: n/a (no rows travel between EP ranks)\n");
    return;
  }
  auto gbps = [&](double row_bytes, double cold_s, double warm_s) {
    const double bytes = rows_per_rank * row_bytes;
    return fmt("%.3f", bytes / cold_s / 1e9) + " cold" +
           (warm.n > 0 ? ", " + fmt("%.3f", bytes / warm_s / 1e9) + " warm" : std::string());
  };
  std::printf("%s\n", wrap_fields({"bandwidth, GB/s: dispatch " +
                                       gbps(dispatch_row, dispatch_s, warm.dispatch_s),
                                   "combine " + gbps(combine_row, combine_s, warm.combine_s)})
                          .c_str());
  print_wrapped(
      "  the bandwidth counts the row data alone: rows sent to other EP ranks x " +
          fmt("%.0f", dispatch_row) + " B per row (dispatch) / " + fmt("%.0f", combine_row) +
          " B (combine), self-traffic" + (p.T > 1 ? " and TP traffic" : "") +
          " excluded, mean over ranks = " + fmt("%.3f", rows_per_rank * dispatch_row / 1e6) +
          " / " + fmt("%.3f", rows_per_rank * combine_row / 1e6) +
          " MB per rank (the bytes above add the metadata and counts); combine sends the same "
          "rows back; time = max over ranks",
      4);
}

void print_check(const CheckResult& c, int64_t elements) {
  const std::string nan_note =
      c.nans > 0 ? " (" + std::to_string(c.nans) + " of them NaN)" : std::string();
  const std::string n = std::to_string(elements), bad = std::to_string(c.mismatches);
  std::string line;
  if (c.exact) {
    line = "check vs dense single-process reference (SPEC §2.3): " +
           std::string(c.mismatches == 0 && c.pass ? "exact" : "NOT exact") + " (" + bad + " of " +
           n + " elements differ" + nan_note + "; max abs err " + fmt("%.3g", c.max_abs) + ")";
  } else if (c.bounded) {
    line = "check vs dense single-process reference (SPEC §2.2, §2.3) within the bound: " +
           std::to_string(c.over_bound) + " of " + n + " elements over the bound" + nan_note +
           ", max |err| / bound " + fmt("%.3g", c.max_ratio) + ", max abs err " +
           fmt("%.3g", c.max_abs) + " (max|ref| " + fmt("%.3g", c.max_ref) + "), " + bad +
           " elements not bitwise equal";
  } else {
    line = "check vs dense single-process reference (SPEC §2.3): max abs err " +
           fmt("%.3g", c.max_abs) + ", max rel err " + fmt("%.3g", c.max_rel) + " (max|ref| " +
           fmt("%.3g", c.max_ref) + ")" + (c.nans > 0 ? " over the non-NaN elements" : "") + ", " +
           bad + " of " + n + " elements not bitwise equal" + nan_note;
  }
  print_wrapped(line, 2);
  print_wrapped("  rule: " + c.rule, 4);
}

std::string summary_line(const Plan& p, int64_t W, const std::vector<RankStats>& all,
                         const WarmTimes& warm, const CheckResult& c) {
  const std::string layer = p.layer.name + " layer (H " + std::to_string(p.layer.hidden) + ", E " +
                            std::to_string(p.layer.experts) + ", top-" +
                            std::to_string(p.layer.top_k) + ") on " + ranks_words(W);
  const std::string speed =
      warm.n > 0 ? "dispatch " + ms(warm.dispatch_s) + " + combine " + ms(warm.combine_s) + " warm"
                 : "dispatch " + ms(max_of(all, &RankStats::dispatch_s)) + " + combine " +
                       ms(max_of(all, &RankStats::combine_s)) + " cold";
  const std::string meaning =
      !c.pass     ? "the output differs from the dense single-process reference (check above)"
      : c.exact   ? "the output equals the dense single-process reference bitwise"
      : c.bounded ? "the output is within the bound of the dense single-process reference"
                  : "the output is within the tolerance of the dense single-process reference";
  return std::string(c.pass ? "PASS: " : "FAIL: ") + layer + ", " + speed + "; " + meaning;
}

}  // namespace moe_ep_tool
