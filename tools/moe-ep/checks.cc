#include "checks.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <regex>
#include <set>

#include "moe_ep/comm.h"
#include "moe_ep/error.h"

namespace moe_ep_tool {

using moe_ep::Error;
using moe_ep::ErrorKind;

namespace {

std::string range_words(int64_t low, int64_t high) {
  return "must be an integer in [" + std::to_string(low) + ", " + std::to_string(high) + "]";
}

// One factor of a size: its value and how to name it in a message ("--tokens 64", "H 2048").
struct Factor {
  std::string label;
  int64_t value;
};

[[noreturn]] void overflow(const std::string& what, const std::string& terms,
                           const std::string& advice) {
  throw Error(ErrorKind::kInvalidArgument, "moe-ep run: " + what + " = " + terms +
                                               " overflows a 64-bit integer (bound 2^63 - 1 = " +
                                               std::to_string(INT64_MAX) + "); use " + advice);
}

// The product of the factors, or an Error naming each of them and the int64 bound.
int64_t product(const std::string& what, std::initializer_list<Factor> factors,
                const std::string& advice) {
  int64_t p = 1;
  bool overflowed = false;
  for (const Factor& f : factors) overflowed = overflowed || __builtin_mul_overflow(p, f.value, &p);
  if (overflowed) {
    std::string terms;
    for (const Factor& f : factors) terms += (terms.empty() ? "" : " x ") + f.label;
    overflow(what, terms, advice);
  }
  return p;
}

// What MPI_Gatherv (int counts and displacements, in bytes) moves to rank 0.
void gather_limit(const std::string& what, int64_t bytes, const std::string& terms,
                  const std::string& advice) {
  if (bytes > INT_MAX) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: " + what + " = " + terms + " = " + std::to_string(bytes) +
                    " bytes exceeds 2^31 - 1 = " + std::to_string(INT_MAX) +
                    " bytes, the most one MPI_Gatherv moves to rank 0; use " + advice);
  }
}

std::string dtype_label(moe_ep::DType dtype) {
  return std::to_string(moe_ep::dtype_size(dtype)) + " B (" + moe_ep::dtype_name(dtype) + ")";
}

std::string gib(double bytes) {
  const double g = bytes / double(int64_t{1} << 30);
  char buf[64];
  std::snprintf(buf, sizeof buf, g >= 10 ? "%.0f GiB" : g >= 0.1 ? "%.1f GiB" : "%.3g GiB", g);
  return buf;
}

std::string describe(const RunShape& s) {
  std::string d =
      s.tokens_label + " with " + s.hidden_label + " (" + s.experts_label + ", " + s.top_k_label;
  if (s.fn == ExpertFn::kSwiglu) d += ", " + s.ffn_label;
  return d + ", " + moe_ep::dtype_name(s.dtype) + ", W " + std::to_string(s.world) + ")";
}

// "mostly A 12 GiB, B 3 GiB" and "fewer --tokens or a smaller --ffn" from the largest parts.
std::pair<std::string, std::string> summarise(const MemoryEstimate& m) {
  std::vector<MemoryPart> parts = m.parts;
  std::sort(parts.begin(), parts.end(),
            [](const MemoryPart& a, const MemoryPart& b) { return a.bytes > b.bytes; });
  std::string mostly, advice;
  std::set<std::string> advised;
  for (size_t i = 0; i < parts.size() && i < 2; ++i) {
    if (i > 0 && parts[i].bytes < 0.2 * m.bytes) break;
    mostly += (i ? ", " : "") + parts[i].name + " " + gib(parts[i].bytes);
    for (const std::string& item : parts[i].advice) {  // each alternative once
      if (advised.insert(item).second) advice += (advice.empty() ? "" : " or ") + item;
    }
  }
  return {mostly, advice};
}

}  // namespace

std::string check_integer(const std::string& text, int64_t low, int64_t high,
                          const std::string& note) {
  const char* b = text.data();
  const char* e = b + text.size();
  if (b != e && *b == '+') ++b;
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(b, e, v);
  if (b == e || end != e || ec == std::errc::invalid_argument) {
    return range_words(low, high) + note + ", got " + text + " (not an integer)";
  }
  if (ec == std::errc::result_out_of_range || v < low || v > high) {
    return range_words(low, high) + note + ", got " + text;
  }
  return {};
}

std::string check_unsigned(const std::string& text) {
  const std::string words =
      "must be an integer in [0, " + std::to_string(UINT64_MAX) + "] (the seed is unsigned)";
  const char* b = text.data();
  const char* e = b + text.size();
  if (b != e && *b == '+') ++b;
  if (b != e && *b == '-') {
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(b, e, v);
    if (end == e && ec != std::errc::invalid_argument) return words + ", got " + text;
    return words + ", got " + text + " (not an integer)";
  }
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(b, e, v);
  if (b == e || end != e || ec == std::errc::invalid_argument) {
    return words + ", got " + text + " (not an integer)";
  }
  if (ec == std::errc::result_out_of_range) return words + ", got " + text;
  return {};
}

std::string check_positive(const std::string& text, const std::string& unit) {
  char* end = nullptr;
  errno = 0;
  const double v = text.empty() ? 0 : std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v) || !(v > 0)) {
    return "must be a finite number of " + unit + " > 0, got " + text;
  }
  return {};
}

std::string check_timeout(const std::string& text) { return check_positive(text, "seconds"); }

void check_sizes(const RunShape& s) {
  const int64_t W = s.world, H = s.hidden, E = s.experts, K = s.top_k, F = s.ffn;
  const int64_t es = static_cast<int64_t>(moe_ep::dtype_size(s.dtype));
  const std::string tokens_advice = s.loaded ? "a routing file of fewer tokens" : "fewer --tokens";
  const Factor w{"W " + std::to_string(W) + " ranks", W};
  const Factor h{s.hidden_label, H}, k{s.top_k_label, K}, f{s.ffn_label, F}, e{s.experts_label, E},
      b{dtype_label(s.dtype), es};

  int64_t N = 0, max_bs = 0;
  for (int64_t n : s.tokens_per_rank) {
    if (__builtin_add_overflow(N, n, &N)) {
      overflow("N (the tokens of all ranks)", s.tokens_label + " x " + w.label, tokens_advice);
    }
    max_bs = std::max(max_bs, n);
  }
  const Factor n{"N " + std::to_string(N) +
                     (s.loaded ? "" : " (" + s.tokens_label + " x W " + std::to_string(W) + ")"),
                 N};
  const Factor bs{"max tokens per rank " + std::to_string(max_bs), max_bs};
  const int64_t Wep = W / s.tp;
  const int64_t m = std::min(E / std::max<int64_t>(1, Wep - s.shared_ranks), K);
  const Factor mk{
      (s.tp > 1 || s.shared_ranks > 0 ? "min(L, K) " : "min(E / W, K) ") + std::to_string(m), m};
  const Factor t{"T " + std::to_string(s.tp), s.tp};

  product("the global batch x in bytes", {n, h, b}, tokens_advice);
  product("the global expert_ids in bytes", {n, k, {"4 B", 4}}, tokens_advice);
  const int64_t A =
      s.global_bs > 0
          ? product("dispatch_v2's capacity A (rows of expand_x)",
                    {t, {"--global-bs " + std::to_string(s.global_bs), s.global_bs}, mk},
                    tokens_advice)
      : s.tp > 1
          ? product("dispatch_v2's capacity A (rows of expand_x)",
                    {t, {"W_ep " + std::to_string(Wep), Wep}, bs, mk}, tokens_advice)
          : product("dispatch_v2's capacity A (rows of expand_x)", {w, bs, mk}, tokens_advice);
  const Factor a{"A " + std::to_string(A), A};
  product("dispatch_v2's expand_x in bytes", {a, h, b}, tokens_advice);
  product("dispatch_v2's assist_info_for_combine in bytes", {a, {"128 x 4 B", 512}}, tokens_advice);
  product("combine_v2's expert outputs on one rank in bytes", {bs, k, h, b}, tokens_advice);
  product("the dense reference's expert outputs on rank 0 in bytes",
          {n, {"K + Ns " + std::to_string(K + s.shared_experts), K + s.shared_experts}, h, b},
          tokens_advice);
  if (s.fn == ExpertFn::kSwiglu) {
    product("one expert's swiglu weights in bytes", {{"3", 3}, h, f, {"4 B", 4}},
            "a smaller --ffn");
    const int64_t w13 = product("W1 and W3 of one expert", {{"2", 2}, f, h}, "a smaller --ffn");
    if (w13 > INT_MAX) {
      throw Error(ErrorKind::kInvalidArgument,
                  "moe-ep run: swiglu expert: W1 and W3 = 2 x " + s.ffn_label + " x " +
                      s.hidden_label + " = " + std::to_string(w13) +
                      " weights exceed 2^31 - 1, the int sizes of the fp32 GEMMs; use a smaller "
                      "--ffn");
    }
    product("the swiglu GEMM buffers of one expert in bytes",
            {n, {"(2 H + 3 FFN) x 4 B", (2 * H + 3 * F) * 4}}, tokens_advice);
  }
  if (!s.loaded && s.routing == RoutingKind::kGate) {
    product("the gate router matrix in bytes",
            {h, {"E + Z + C + Q " + std::to_string(E + s.special), E + s.special}, {"4 B", 4}},
            "fewer --experts or a smaller --hidden");
  }
}

void check_gather_limits(const RunShape& s) {
  const int64_t W = s.world, H = s.hidden, K = s.top_k;
  const int64_t es = static_cast<int64_t>(moe_ep::dtype_size(s.dtype));
  const std::string tokens_advice = s.loaded ? "a routing file of fewer tokens" : "fewer --tokens";
  int64_t N = 0;
  for (int64_t n : s.tokens_per_rank) N += n;  // check_sizes made sure it fits
  const std::string n = "N " + std::to_string(N) +
                        (s.loaded ? "" : " (" + s.tokens_label + " x W " + std::to_string(W) + ")");
  // Gathered on rank 0 with one MPI_Gatherv each.
  gather_limit("the batch x gathered on rank 0", N * H * es,
               n + " x " + s.hidden_label + " x " + dtype_label(s.dtype), tokens_advice);
  gather_limit("the expert_ids gathered on rank 0", N * K * 4, n + " x " + s.top_k_label + " x 4 B",
               tokens_advice);
}

MemoryEstimate estimate_rank_memory(const RunShape& s, int64_t rank) {
  const double W = static_cast<double>(s.world), H = static_cast<double>(s.hidden),
               E = static_cast<double>(s.experts), K = static_cast<double>(s.top_k),
               F = static_cast<double>(s.ffn);
  const double es = static_cast<double>(moe_ep::dtype_size(s.dtype)), row = H * es;
  double N = 0, max_bs = 0;
  for (int64_t n : s.tokens_per_rank) {
    N += static_cast<double>(n);
    max_bs = std::max(max_bs, static_cast<double>(n));
  }
  const double BS = static_cast<double>(s.tokens_per_rank[rank]);
  const double T = static_cast<double>(s.tp), Wep = W / T, S = static_cast<double>(s.shared_ranks);
  const double Ns = static_cast<double>(s.shared_experts);
  const double G = s.global_bs > 0 ? static_cast<double>(s.global_bs) : Wep * max_bs;
  const bool shared_rank = static_cast<double>(rank / s.tp) < S;
  // SPEC §1.4, with the TP peer's rows: T x A rows.
  const double A =
      T * (shared_rank ? std::floor(G / Wep) * std::ceil(Wep / std::max(1.0, std::floor(S / Ns)))
                       : G * std::min(std::floor(E / std::max(1.0, Wep - S)), K));
  const double Etot = E + static_cast<double>(s.special);
  const double Kslots = K + Ns;
  const std::string tokens = s.loaded ? "a routing file of fewer tokens" : "fewer --tokens";
  // The advice names what the user set: a flag given on the command line (its label starts
  // with the flag) is suggested beside the tokens.
  auto or_smaller = [](std::vector<std::string> advice, const std::string& label,
                       const char* flag) {
    if (label.rfind(flag, 0) == 0) advice.push_back(std::string("a smaller ") + flag);
    return advice;
  };
  const std::vector<std::string> rows = or_smaller({tokens}, s.hidden_label, "--hidden");
  // dispatch_v2's A rows: global_bs (given, or W_ep x max BS) x min(local experts, K).
  const std::vector<std::string> expand = or_smaller(
      or_smaller({s.global_bs > 0 ? "fewer --tokens with a smaller --global-bs" : tokens},
                 s.top_k_label, "--top-k"),
      s.hidden_label, "--hidden");
  const bool swiglu = s.fn == ExpertFn::kSwiglu;

  MemoryEstimate m;
  auto add = [&](std::string name, double bytes, std::vector<std::string> advice) {
    m.parts.push_back({std::move(name), bytes, std::move(advice)});
    m.bytes += bytes;
  };
  add("this rank's x, expert_ids, expert_scales and x_active_mask",
      BS * (row + 8 * K +
            (s.mask_dims == 2   ? K
             : s.mask_dims == 1 ? 1
                                : 0)),
      rows);
  if (s.loaded) {
    // The file's bytes, the parsed tensors and the Batch's copies, on every rank.
    add("the routing file read whole", 3 * static_cast<double>(s.file_bytes),
        {"a routing file of fewer tokens"});
  } else {
    // Per-expert tables of the router: probabilities, logits, sort keys, order, flags.
    const bool gate = s.routing == RoutingKind::kGate;
    add(gate ? "the gate router (H x E matrix and per-expert tables)"
             : "the router's per-expert tables",
        kRouterBytesPerExpert * Etot + (gate ? 4 * H * Etot : 0),
        gate ? std::vector<std::string>{"fewer --experts", "a smaller --hidden"}
             : std::vector<std::string>{"fewer --experts"});
  }
  // expand_x and the expert outputs (A rows each), expand_scales, assist_info_for_combine and
  // per-row metadata of dispatch_v2; its per-expert counts and offsets.
  // With --quant: int8 rows, their fp32 scales and the dequantised fp32 rows the experts read.
  const double expand_row = s.quant ? H + 4 + 4 * H : row;
  add("dispatch_v2's receive buffers and the expert outputs (A = " +
          std::to_string(static_cast<int64_t>(A)) + " rows)",
      A * (expand_row + row) + 4 * A + 4 * std::max(BS * K, 128 * A) + 32 * (A + BS * K), expand);
  add("dispatch_v2's per-expert counts", kDispatchBytesPerExpert * E, {"fewer --experts"});
  if (swiglu) {
    // One expert's fp32 weights; GEMM buffers for up to G rows (N on rank 0's reference).
    const double weights = 12 * H * F;
    add(rank == 0 ? "swiglu weights and GEMM buffers (experts and reference)"
                  : "one expert's swiglu weights and GEMM buffers",
        (rank == 0 ? 2 : 1) * weights + (G + (rank == 0 ? N : 0)) * (2 * H + 3 * F) * 4,
        {"a smaller --ffn"});
  }
  // Rows back (int8 copies with --comm-quant), the output, shared_expert_x (S = 0), and the
  // const experts' alpha_1, alpha_2, v.
  const bool shared_local = S == 0 && Ns > 0;
  add("combine_v2's buffers",
      BS * K * row + BS * row + (s.comm_quant ? A * (H + 4) : 0) + (shared_local ? BS * row : 0) +
          3 * static_cast<double>(s.special) * row,
      rows);
  if (swiglu && shared_local) {
    add("the shared expert's GEMM buffers", BS * (2 * H + 3 * F) * 4, {tokens});
  }
  if (rank == 0) {
    // Gathered x, ids and scales (with their byte copies), the gathered output, the reference's
    // per-entry expert outputs, its per-expert batches and result, the per-expert entry lists.
    add("the gathered batch, output and dense reference on rank 0",
        N * row + 16 * N * K + 2 * N * row + N * Kslots * row + 3 * N * row + 8 * N * Kslots +
            24 * (E + Ns) + (s.quant || s.comm_quant ? 12 * N * H : 0) + N * K,
        rows);
  }
  return m;
}

uint64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || size <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(size);
}

void check_memory(const RunShape& s, const std::vector<int>& node_ranks, uint64_t physical) {
  if (physical == 0) return;
  const double phys = static_cast<double>(physical);
  int64_t worst = 0;
  MemoryEstimate worst_m = estimate_rank_memory(s, 0);
  for (int64_t r = 1; r < s.world; ++r) {
    MemoryEstimate m = estimate_rank_memory(s, r);
    if (m.bytes > worst_m.bytes) {
      worst = r;
      worst_m = std::move(m);
    }
  }
  if (worst_m.bytes > phys) {
    const auto [mostly, advice] = summarise(worst_m);
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: " + describe(s) + " needs about " + gib(worst_m.bytes) + " on rank " +
                    std::to_string(worst) + " (more than this machine's " + gib(phys) +
                    "; mostly " + mostly + "); use " + advice);
  }
  double node = 0;
  for (int r : node_ranks) node += estimate_rank_memory(s, r).bytes;
  if (node_ranks.size() > 1 && node > phys) {
    const auto [mostly, advice] = summarise(worst_m);
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: " + describe(s) + " needs about " + gib(node) + " on the " +
                    std::to_string(node_ranks.size()) + " ranks of this machine (more than its " +
                    gib(phys) + "; rank " + std::to_string(worst) + " alone about " +
                    gib(worst_m.bytes) + ", mostly " + mostly + "); use " + advice +
                    ", or fewer ranks per machine");
  }
}

void check_load_memory(const std::string& path, uint64_t file_bytes, uint64_t physical) {
  const double need = 3 * static_cast<double>(file_bytes);
  if (physical != 0 && need > static_cast<double>(physical)) {
    throw Error(ErrorKind::kInvalidArgument,
                "moe-ep run: --load-routing '" + path + "' holds " +
                    gib(static_cast<double>(file_bytes)) + "; reading it needs about " + gib(need) +
                    " on every rank (more than this machine's " +
                    gib(static_cast<double>(physical)) + "); use a routing file of fewer tokens");
  }
}

void check_writable(const std::string& flag, const std::string& path, const char* command) {
  namespace fs = std::filesystem;
  const std::string where = std::string(command) + ": " + flag + " '" + path + "': ";
  const fs::path p(path);
  std::error_code ec;
  if (path.empty() || p.filename().empty() || fs::is_directory(p, ec)) {
    throw Error(ErrorKind::kInvalidArgument, where + "is a directory, not a file name");
  }
  if (fs::exists(p, ec)) {
    if (::access(path.c_str(), W_OK) != 0) {
      throw Error(ErrorKind::kInvalidArgument,
                  where + "cannot be overwritten: " + std::strerror(errno));
    }
    return;
  }
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    throw Error(ErrorKind::kInvalidArgument, where + "cannot create a file in directory '" +
                                                 dir.string() + "': " + std::strerror(errno));
  }
}

bool same_path(const std::string& a, const std::string& b) {
  namespace fs = std::filesystem;
  auto canonical = [](const std::string& p) {
    // Absolute first: weakly_canonical leaves a relative path whose first part does not exist
    // relative ("F" and "./F" would differ).
    std::error_code ec;
    const fs::path absolute = fs::absolute(fs::path(p), ec).lexically_normal();
    fs::path c = fs::weakly_canonical(absolute, ec);
    return ec ? absolute : c;
  };
  return canonical(a) == canonical(b);
}

std::string format_value(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::string file_rows_context(const std::string& message, int rank, int64_t first, int64_t count,
                              const std::string& file) {
  std::string c = "(rank " + std::to_string(rank) + " holds rows [" + std::to_string(first) + ", " +
                  std::to_string(first + count) + ") of routing file '" + file + "'";
  static const std::regex kToken(R"(\b(expert_ids|expert_scales|x)\[(\d{1,18})[,\]])");
  std::smatch match;
  if (std::regex_search(message, match, kToken)) {
    const int64_t i = std::stoll(match[2].str());
    if (i < count) {
      c += ": " + match[1].str() + "[" + std::to_string(i) + ",*] is file row " +
           std::to_string(first + i);
    }
  }
  return c + ")";
}

EnvironmentCheck check_environment_here(const std::optional<double>& timeout_s,
                                        const std::string& transport) {
  EnvironmentCheck c;
  c.timeout_s = timeout_s.value_or(300);
  try {
    c.timeout_s = moe_ep::check_environment({timeout_s}, transport);
  } catch (...) {
    c.error = std::current_exception();
  }
  return c;
}

}  // namespace moe_ep_tool
