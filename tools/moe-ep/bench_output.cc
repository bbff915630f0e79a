#include "bench_output.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common.h"
#include "moe_ep/error.h"
#include "moe_ep/threads.h"

namespace moe_ep_tool::bench {

using moe_ep::DType;
using moe_ep::Error;
using moe_ep::ErrorKind;

namespace {

std::string ratio(double r) { return std::isnan(r) ? "-" : fmt("%.2fx", r); }

// Writes `text` to `path` (created or truncated) with stdio, so that the failing call's errno
// names the cause. Returns "" or why not: "cannot open it for writing: <strerror>" or "write
// failed: <strerror>" (a full device shows at the last flush, in fclose).
std::string write_text(const std::string& path, const std::string& text) {
  auto failure = [] { return std::strerror(errno != 0 ? errno : EIO); };
  errno = 0;
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return std::string("cannot open it for writing: ") + failure();
  errno = 0;
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  std::string why = written ? "" : std::string("write failed: ") + failure();
  errno = 0;
  if (std::fclose(f) != 0 && why.empty()) why = std::string("write failed: ") + failure();
  return why;
}

void print_targets(const BenchOptions& o, const Setup& s, const std::vector<Target>& targets) {
  const Preset& layer = s.layer;
  const bool target_config = layer.hidden == kTargetHidden && layer.experts == 64 &&
                             layer.top_k == 8 && s.dtype == DType::kBF16 && s.W == 2 &&
                             o.routing == "real";
  std::printf(
      "targets (docs/performance.md; stated for bf16, H 7168, top-8, 64 experts, %lld "
      "tokens/rank, W = 2, real OLMoE routing%s):\n",
      static_cast<long long>(kTargetTokens),
      target_config ? "" : "; THIS RUN'S CONFIGURATION DIFFERS");
  for (const Target& t : targets) {
    std::printf("  tokens/rank %5lld  %-26s %7.3f %s %.1f  %s\n", static_cast<long long>(t.tokens),
                t.name.c_str(), t.value, t.at_least ? ">=" : "<=", t.bound,
                t.pass ? "PASS" : "FAIL");
  }
  std::printf("  (a missed performance target does not change the exit status)\n");
}

void write_csv(const std::string& path, const std::vector<Result>& all) {
  std::ostringstream f;
  f << "tokens_per_rank,op,impl,bytes_per_rank,p50_ms,p99_ms,gbps,ratio_vs_alltoallv,"
       "ratio_vs_textbook\n";
  for (const Result& r : all) {
    auto num = [](double v) { return std::isnan(v) ? std::string() : fmt("%.6g", v); };
    f << r.tokens << ',' << kOpNames[r.op].op << ',' << r.impl << ',' << fmt("%.0f", r.bytes) << ','
      << num(r.p50_s * 1e3) << ',' << num(r.p99_s * 1e3) << ',' << num(r.gbps) << ','
      << num(r.vs_alltoallv) << ',' << num(r.vs_textbook) << '\n';
  }
  const std::string why = write_text(path, f.str());
  if (!why.empty()) throw Error(ErrorKind::kSystem, "moe-ep bench: --csv '" + path + "': " + why);
}

nlohmann::json json_results(const Sweep& sweep) {
  auto num = [](double v) { return std::isnan(v) ? nlohmann::json() : nlohmann::json(v); };
  nlohmann::json results = nlohmann::json::array();
  for (const Result& r : sweep.results) {
    results.push_back({{"tokens_per_rank", r.tokens},
                       {"op", kOpNames[r.op].op},
                       {"impl", r.impl},
                       {"bytes_per_rank", r.bytes},
                       {"p50_ms", r.p50_s * 1e3},
                       {"p99_ms", r.p99_s * 1e3},
                       {"gbps", num(r.gbps)},
                       {"ratio_vs_alltoallv", num(r.vs_alltoallv)},
                       {"ratio_vs_textbook", num(r.vs_textbook)},
                       {"inter_node_bytes_per_rank", num(r.inter_node)},
                       {"intra_node_bytes_per_rank", num(r.intra_node)}});
  }
  return results;
}

void write_json(const BenchOptions& o, const Setup& s, const Rules& rules, const Sweep& sweep,
                bool compare) {
  nlohmann::json j;
  j["config"] = {{"preset", s.layer.name},
                 {"hidden", s.layer.hidden},
                 {"experts", s.layer.experts},
                 {"top_k", s.layer.top_k},
                 {"dtype", moe_ep::dtype_name(s.dtype)},
                 {"world", s.W},
                 {"routing", s.routing_desc},
                 {"seed", o.seed},
                 {"iters", o.iters},
                 {"warmup", o.warmup},
                 {"compare", compare},
                 {"quant", o.quant},
                 {"transport", transport_name(o.transport)},
                 {"comm_alg", o.comm_alg},
                 {"partials", o.partials},
                 {"exact_size", o.exact_size},
                 {"threads_per_rank", moe_ep::num_threads()}};
  j["bytes_rule"] = rules.bytes;
  j["time_rule"] = rules.time;
  j["verified"] = true;
  j["results"] = json_results(sweep);
  j["int8"] = nlohmann::json::array();
  for (const PointResult& pr : sweep.points) {
    if (std::isnan(pr.int8_time_ratio)) continue;
    j["int8"].push_back({{"tokens_per_rank", pr.results.front().tokens},
                         {"bytes_ratio", pr.int8_bytes_ratio},
                         {"traffic_ratio", pr.int8_traffic_ratio},
                         {"time_ratio", pr.int8_time_ratio}});
  }
  j["targets"] = nlohmann::json::array();
  for (const Target& t : sweep.targets) {
    j["targets"].push_back({{"tokens_per_rank", t.tokens},
                            {"name", t.name},
                            {"value", t.value},
                            {"bound", t.bound},
                            {"at_least", t.at_least},
                            {"pass", t.pass}});
  }
  const std::string why = write_text(o.json, j.dump(2) + '\n');
  if (!why.empty()) {
    throw Error(ErrorKind::kSystem, "moe-ep bench: --json '" + o.json + "': " + why);
  }
}

// gnuplot single-quoted string: '' stands for '.
std::string gp_quote(const std::string& s) {
  std::string q = "'";
  for (const char c : s) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

// POSIX shell single-quoted word.
std::string sh_quote(const std::string& s) {
  std::string q = "'";
  for (const char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// "op impl" of a series, as its results name it.
std::string series_name(const std::vector<Result>& all, Op op) {
  for (const Result& r : all)
    if (r.op == op) return std::string(kOpNames[op].op) + ' ' + r.impl;
  return kOpNames[op].op;
}

// The plot's data: one row per tokens value, one column per series (NaN where missing).
bool write_plot_data(const std::string& dat, const std::vector<Result>& all,
                     const std::vector<int64_t>& tokens, const std::vector<Op>& series) {
  std::ofstream f(dat);
  f << "# tokens_per_rank";
  for (const Op op : series) {
    std::string name = series_name(all, op);
    std::replace(name.begin(), name.end(), ' ', '/');
    f << ' ' << name;
  }
  f << '\n';
  for (const int64_t t : tokens) {
    f << t;
    for (const Op op : series) {
      double v = kNaN;
      for (const Result& r : all) {
        if (r.tokens == t && r.op == op) v = r.gbps;
      }
      f << ' ' << (std::isnan(v) ? std::string("NaN") : fmt("%.6g", v));
    }
    f << '\n';
  }
  return static_cast<bool>(f);
}

// The gnuplot script: each series its own colour (series_colour) and point type.
bool write_plot_script(const std::string& gp, const std::string& png, const std::string& dat,
                       const std::string& title, const std::vector<Result>& all,
                       const std::vector<Op>& series) {
  std::ofstream f(gp);
  f << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
       "  set terminal pngcairo size 1000,600\n"
       "} else {\n"
       "  set terminal png size 1000,600\n"
       "}\n"
    << "set output " << gp_quote(png) << "\n"
    << "set title " << gp_quote(title) << " noenhanced\n"
    << "set xlabel 'tokens per rank'\n"
       "set ylabel 'GB/s per rank (bytes sent to other ranks / p50 of max over ranks)'\n"
       "set logscale x 2\n"
       "set grid\n"
       "set key outside right top noenhanced\n"
       "set datafile missing 'NaN'\n"
       "plot ";
  for (size_t i = 0; i < series.size(); ++i) {
    f << (i ? ", \\\n     " : "") << gp_quote(dat) << " using 1:" << i + 2
      << " with linespoints lw 2 lc rgb '" << series_colour(series[i]) << "' pt "
      << static_cast<int>(series[i]) + 1 << " title " << gp_quote(series_name(all, series[i]));
  }
  f << "\n";
  return static_cast<bool>(f);
}

// GB/s against tokens per rank, one line per (op, impl). Returns "" or what went wrong.
std::string write_plot(const std::string& path, const std::vector<Result>& all,
                       const std::string& title) {
  std::vector<int64_t> tokens;
  std::vector<Op> series;
  for (const Result& r : all) {
    if (std::find(tokens.begin(), tokens.end(), r.tokens) == tokens.end()) {
      tokens.push_back(r.tokens);
    }
    if (std::find(series.begin(), series.end(), r.op) == series.end()) series.push_back(r.op);
  }
  std::sort(tokens.begin(), tokens.end());
  const std::filesystem::path base = std::filesystem::path(path).replace_extension("");
  const std::string dat = base.string() + ".dat", gp = base.string() + ".gp";
  if (!write_plot_data(dat, all, tokens, series)) return "cannot write " + dat;
  if (!write_plot_script(gp, path, dat, title, all, series)) return "cannot write " + gp;
  const int rc = std::system(("gnuplot " + sh_quote(gp) + " 2>&1").c_str());
  if (rc != 0) return "gnuplot " + gp + " failed (exit status " + std::to_string(rc) + ")";
  return "";
}

void plot(const BenchOptions& o, const Setup& s, const Sweep& sweep) {
  if (!s.gnuplot) {
    std::printf("plot skipped: gnuplot is not installed (Debian: apt-get install gnuplot-nox)\n");
    return;
  }
  const std::string title =
      "moe-ep bench: " + s.layer.name + " H " + std::to_string(s.layer.hidden) + " E " +
      std::to_string(s.layer.experts) + " K " + std::to_string(s.layer.top_k) + " " +
      moe_ep::dtype_name(s.dtype) + " W " + std::to_string(s.W);
  const std::string err = write_plot(o.plot, sweep.results, title);
  if (!err.empty()) throw Error(ErrorKind::kSystem, "moe-ep bench: --plot: " + err);
  std::printf("plot written to %s (data and gnuplot script beside it: .dat, .gp)\n",
              o.plot.c_str());
}

}  // namespace

const char* series_colour(Op op) {
  // Okabe-Ito's colour-blind-safe set, and three more; moe-ep's ops in the strongest.
  static const char* const kColours[kOps] = {
      "#0072b2",  // dispatch moe-ep: blue
      "#d55e00",  // combine moe-ep: vermillion
      "#009e73",  // dispatch-int8 moe-ep: green
      "#56b4e9",  // dispatch alltoallv: sky blue
      "#e69f00",  // combine alltoallv: orange
      "#cc79a7",  // dispatch-int8 alltoallv: reddish purple
      "#6a3d9a",  // dispatch textbook: purple
      "#8c564b",  // combine textbook: brown
      "#000000",  // copy memcpy: black
      "#1b9e77",  // dispatch moe-ep, the other comm_alg: teal
      "#e7298a",  // combine moe-ep, the other comm_alg: magenta
  };
  return kColours[op];
}

Rules counting_rules(const BenchOptions& o, const Setup& s) {
  Rules r;
  r.bytes =
      "bytes counted per rank = rows it sends to OTHER ranks (self-traffic excluded) x the row "
      "payload (H x " +
      std::to_string(moe_ep::dtype_size(s.dtype)) + " B; int8: H + 4 B with its fp32 " +
      "scale); moe-ep's 16 B per-row metadata and count messages are not counted; combine: the "
      "rows it sends back; mean over ranks";
  r.time =
      std::string(
          "per iteration: a barrier (each rank hears from every other), then each rank times the "
          "op; p50/p99 (nearest ") +
      "rank; below 100 iterations p99 is the slowest) over " + std::to_string(o.iters) +
      " iterations (after " + std::to_string(o.warmup) +
      " warm-up) of the max over ranks; GB/s = bytes / p50; ratios = baseline p50 / moe-ep p50";
  return r;
}

void print_header(const BenchOptions& o, const Setup& s, const Rules& rules, bool compare,
                  bool quant) {
  const Preset& layer = s.layer;
  std::string tokens_list;
  for (const int64_t t : o.tokens) {
    if (!tokens_list.empty()) tokens_list += ',';
    tokens_list += std::to_string(t);
  }
  std::printf(
      "moe-ep bench: preset %s  H %lld  E %lld  K %lld  dtype %s  W %lld  tokens/rank %s  "
      "seed %llu  transport %s  comm_alg %s%s%s%s%s\n",
      layer.name.c_str(), static_cast<long long>(layer.hidden),
      static_cast<long long>(layer.experts), static_cast<long long>(layer.top_k),
      moe_ep::dtype_name(s.dtype), static_cast<long long>(s.W), tokens_list.c_str(),
      static_cast<unsigned long long>(o.seed), transport_name(o.transport).c_str(),
      o.comm_alg.c_str(), o.partials != "fp32" ? ("  --partials " + o.partials).c_str() : "",
      o.exact_size ? "  --exact-size" : "", compare ? "  --compare" : "",
      quant ? "  --quant int8" : "");
  std::printf("  routing: %s\n", s.routing_desc.c_str());
  print_threads_line();
  std::printf("  placement: %lld experts per rank (expert e on rank e / %lld), no shared experts\n",
              static_cast<long long>(s.L), static_cast<long long>(s.L));
  std::printf("  %s\n  time: %s\n", rules.bytes.c_str(), rules.time.c_str());
  if (compare) {
    std::printf(
        "  baselines (same run, same routing, same rows): alltoallv = one MPI_Alltoallv of the "
        "rows dispatch moves (self included), pre-packed by destination, and the same rows back "
        "for combine; textbook = moe_ep::permute -> MPI_Alltoall(counts) -> MPI_Alltoallv -> "
        "regroup by local expert, combine = regroup -> MPI_Alltoallv -> moe_ep::unpermute "
        "with the top-k weights; memcpy = one memcpy of the dispatch bytes on each rank at once "
        "(the machine's copy limit)\n");
  }
  if (!o.plot.empty() && !s.gnuplot) {
    std::printf(
        "  note: --plot %s: gnuplot is not installed (Debian: apt-get install gnuplot-nox); "
        "the plot will be skipped, --csv/--json are still written\n",
        o.plot.c_str());
  }
  std::fflush(stdout);
}

void print_verification(const Verification& v, int64_t tokens) {
  std::printf("verify tokens/rank %lld:", static_cast<long long>(tokens));
  for (int c = 0; c < kChecks; ++c) {
    if (v.total[c] == 0 && v.failures[c] == 0) continue;
    std::printf("\n  %s: %lld checked, %lld bad", check_description(static_cast<Check>(c)),
                static_cast<long long>(v.total[c]), static_cast<long long>(v.failures[c]));
  }
  std::printf("\n  %s\n", v.failed() == 0 ? "verified" : "VERIFICATION FAILED: nothing timed");
  std::fflush(stdout);
}

namespace {

// moe-ep's bytes to other nodes and inside this one, per op; and with both comm_algs,
// hierarchy's against fullmesh's.
void print_node_bytes(const PointResult& pr) {
  for (const Result& r : pr.results) {
    if (std::isnan(r.inter_node)) continue;
    std::printf("  %-13s %-16s bytes per rank, MB: inter-node %.3f, intra-node %.3f\n",
                kOpNames[r.op].op, r.impl.c_str(), r.inter_node / 1e6, r.intra_node / 1e6);
  }
  if (std::isnan(pr.hier_bytes[0])) return;
  print_wrapped("hierarchy / fullmesh (same run, same batch): inter-node bytes dispatch " +
                    fmt("%.3f", pr.hier_bytes[0]) + ", combine " + fmt("%.3f", pr.hier_bytes[1]) +
                    "; p50 dispatch " + fmt("%.3f", pr.hier_time[0]) + ", combine " +
                    fmt("%.3f", pr.hier_time[1]),
                4);
}

}  // namespace

void print_table(const PointResult& pr, int64_t tokens) {
  std::printf(
      "tokens/rank %lld: rows sent to other ranks per rank: mean %.1f (min %.0f, max %.0f)\n",
      static_cast<long long>(tokens), pr.rows_other_mean, pr.rows_other_min, pr.rows_other_max);
  int w = 9;  // the impl column: "moe-ep/hierarchy" with both comm_algs
  for (const Result& r : pr.results) w = std::max(w, static_cast<int>(r.impl.size()));
  std::printf("  %-13s %-*s %11s %9s %9s %8s %15s %14s\n", "op", w, "impl", "MB/rank", "p50 ms",
              "p99 ms", "GB/s", "moe/alltoallv", "moe/textbook");
  for (const Result& r : pr.results) {
    std::printf("  %-13s %-*s %11.3f %9.3f %9.3f %8.3f %15s %14s\n", kOpNames[r.op].op, w,
                r.impl.c_str(), r.bytes / 1e6, r.p50_s * 1e3, r.p99_s * 1e3, r.gbps,
                ratio(r.vs_alltoallv).c_str(), ratio(r.vs_textbook).c_str());
  }
  if (!std::isnan(pr.int8_time_ratio)) {
    std::printf(
        "  int8 dispatch (quant_mode 2): bytes moved %.3f of bf16's (H + 4 B per row vs 2H), "
        "time %.3f of bf16's (p50); memory traffic %.3f of bf16's (each token read once, "
        "each of its K copies written)\n",
        pr.int8_bytes_ratio, pr.int8_time_ratio, pr.int8_traffic_ratio);
  }
  print_node_bytes(pr);
  std::fflush(stdout);
}

void write_report(const BenchOptions& o, const Setup& s, const Rules& rules, const Sweep& sweep,
                  bool compare) {
  if (compare) print_targets(o, s, sweep.targets);
  if (!o.csv.empty()) {
    write_csv(o.csv, sweep.results);
    std::printf("csv written to %s\n", o.csv.c_str());
  }
  if (!o.json.empty()) {
    write_json(o, s, rules, sweep, compare);
    std::printf("json written to %s\n", o.json.c_str());
  }
  if (!o.plot.empty()) plot(o, s, sweep);
  std::fflush(stdout);
}

}  // namespace moe_ep_tool::bench
