#include "routing.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <sstream>

#include "moe_ep/error.h"
#include "moe_ep/tensor.h"
#include "rng.h"

namespace moe_ep_tool {

using moe_ep::Error;
using moe_ep::ErrorKind;

namespace {

template <class Set>
std::string join(const Set& items) {
  std::string s;
  for (const auto& i : items) s += (s.empty() ? "" : ", ") + i;
  return s;
}

// Layer numbers as text, in numeric order (0, 7, 15; not 0, 15, 7).
struct NumericText {
  bool operator()(const std::string& a, const std::string& b) const {
    return a.size() != b.size() ? a.size() < b.size() : a < b;
  }
};

// An empty domain is the model's default: tulu for the instruction-tuned OLMoE models (their
// only domain in the data), else c4.
RealRoutingSource with_domain(RealRoutingSource source) {
  if (source.domain.empty())
    source.domain = source.model == "olmoe-sft" || source.model == "olmoe-dpo" ? "tulu" : "c4";
  return source;
}

// A field of the routing CSV that must be an integer in [0, 2^63 - 1] (a trailing '\r' of a
// CRLF line is not part of it).
int64_t parse_count(const std::string& where, const char* name, std::string text) {
  if (!text.empty() && text.back() == '\r') text.pop_back();
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || v < 0) {
    throw Error(ErrorKind::kInvalidArgument,
                where + ": " + name + " = '" + text + "' is not an integer in [0, 2^63 - 1]");
  }
  return v;
}

// The per-expert top-k counts of source's model/domain/layer, experts 0..D-1 each once.
std::map<int64_t, double> read_counts(const RealRoutingSource& source) {
  std::error_code ec;
  if (std::filesystem::is_directory(source.file, ec)) {
    throw Error(ErrorKind::kInvalidArgument,
                "real routing: '" + source.file +
                    "' is a directory, not a file (set --routing-file to an expert_counts.csv "
                    "file)");
  }
  std::ifstream in(source.file);
  if (!in) {
    throw Error(ErrorKind::kInvalidArgument,
                "real routing: cannot open '" + source.file +
                    "' (set --routing-file to data/real-routing/expert_counts.csv)");
  }
  std::string line;
  std::getline(in, line);
  if (line.rfind("model,domain,selection,layer,expert,count", 0) != 0) {
    throw Error(ErrorKind::kInvalidArgument, "real routing: '" + source.file +
                                                 "' does not start with the header "
                                                 "model,domain,selection,layer,expert,count");
  }
  std::map<int64_t, double> counts;
  std::set<std::string> models, domains;
  std::set<std::string, NumericText> layers;
  int64_t line_no = 1;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    std::vector<std::string> f;
    std::stringstream ss(line);
    for (std::string cell; std::getline(ss, cell, ',');) f.push_back(cell);
    if (f.size() != 6) {
      throw Error(ErrorKind::kInvalidArgument, "real routing: " + source.file + ":" +
                                                   std::to_string(line_no) + " has " +
                                                   std::to_string(f.size()) + " fields, not 6");
    }
    if (f[2] != "topk") continue;
    models.insert(f[0]);
    if (f[0] != source.model) continue;
    domains.insert(f[1]);
    if (f[1] != source.domain) continue;
    layers.insert(f[3]);
    if (f[3] != std::to_string(source.layer)) continue;
    const std::string where = "real routing: " + source.file + ":" + std::to_string(line_no);
    const int64_t expert = parse_count(where, "expert", f[4]);
    const int64_t count = parse_count(where, "count", f[5]);
    if (!counts.emplace(expert, static_cast<double>(count)).second) {
      throw Error(ErrorKind::kInvalidArgument,
                  where + " lists expert " + std::to_string(expert) + " of " + source.model + "/" +
                      source.domain + "/layer " + std::to_string(source.layer) + " again");
    }
  }
  const std::string what =
      source.model + "/" + source.domain + "/layer " + std::to_string(source.layer);
  if (models.count(source.model) == 0) {
    throw Error(ErrorKind::kInvalidArgument,
                "real routing: model '" + source.model + "' is not in " + source.file +
                    (models.empty() ? " (it has no topk rows)" : " (has " + join(models) + ")"));
  }
  if (domains.count(source.domain) == 0) {
    throw Error(ErrorKind::kInvalidArgument, "real routing: domain '" + source.domain +
                                                 "' is not in " + source.file + " for model " +
                                                 source.model + " (has " + join(domains) + ")");
  }
  if (counts.empty()) {
    throw Error(ErrorKind::kInvalidArgument, "real routing: layer " + std::to_string(source.layer) +
                                                 " is not in " + source.file + " for " +
                                                 source.model + "/" + source.domain + " (has " +
                                                 join(layers) + ")");
  }
  const int64_t data_experts = counts.rbegin()->first + 1;
  if (counts.begin()->first < 0 || static_cast<int64_t>(counts.size()) != data_experts) {
    throw Error(ErrorKind::kInvalidArgument,
                "real routing: " + what + " does not list experts 0.." +
                    std::to_string(data_experts - 1) + " exactly once each");
  }
  double total = 0;
  for (const auto& [e, c] : counts) total += c;
  if (!(total > 0)) {
    throw Error(ErrorKind::kInvalidArgument, "real routing: " + what + " has no counts");
  }
  return counts;
}

}  // namespace

std::string default_routing_file() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  const auto dir = ec ? std::filesystem::path(".") : exe.parent_path();
  return (dir / ".." / "share" / "moe-ep" / "real-routing" / "expert_counts.csv")
      .lexically_normal()
      .string();
}

int64_t real_data_experts(const RealRoutingSource& source) {
  return static_cast<int64_t>(read_counts(with_domain(source)).size());
}

ExpertDistribution load_real_distribution(const RealRoutingSource& given, int64_t experts,
                                          int64_t top_k) {
  const RealRoutingSource source = with_domain(given);
  const std::map<int64_t, double> counts = read_counts(source);
  const int64_t data_experts = static_cast<int64_t>(counts.size());
  const std::string what =
      source.model + "/" + source.domain + "/layer " + std::to_string(source.layer);
  double total = 0;
  for (const auto& [e, c] : counts) total += c;

  ExpertDistribution d;
  d.p.assign(experts, 0.0);
  std::ostringstream desc;
  desc << "real (" << what << ", top-k counts of " << data_experts << " experts";
  if (experts == data_experts) {
    for (const auto& [e, c] : counts) d.p[e] = c / total;
  } else if (experts % data_experts == 0) {
    const int64_t m = experts / data_experts;
    for (const auto& [e, c] : counts) {
      for (int64_t j = 0; j < m; ++j) d.p[e * m + j] = c / total / static_cast<double>(m);
    }
    desc << "; each data expert's probability split evenly over " << m
         << " consecutive experts of the preset's " << experts;
  } else if (data_experts % experts == 0) {
    const int64_t m = data_experts / experts;
    for (const auto& [e, c] : counts) d.p[e / m] += c / total;
    desc << "; each " << m << " consecutive data experts merged into one of the preset's "
         << experts;
  } else {
    throw Error(ErrorKind::kInvalidArgument,
                "real routing: " + what + " has " + std::to_string(data_experts) +
                    " experts, which cannot be mapped onto E = " + std::to_string(experts) +
                    " (neither divides the other)");
  }
  desc << ")";
  d.description = desc.str();
  const auto nonzero = std::count_if(d.p.begin(), d.p.end(), [](double p) { return p > 0; });
  if (nonzero < top_k) {
    throw Error(ErrorKind::kInvalidArgument,
                "real routing: only " + std::to_string(nonzero) + " experts of " + what +
                    " have a nonzero count; top-k " + std::to_string(top_k) +
                    " needs at least that many");
  }
  return d;
}

std::vector<std::byte> make_tokens(uint64_t seed, int64_t first, int64_t count, int64_t hidden,
                                   moe_ep::DType dtype) {
  std::vector<std::byte> x(static_cast<size_t>(count * hidden) * moe_ep::dtype_size(dtype));
  for (int64_t i = 0; i < count; ++i) {
    const Counter c(seed, Stream::kTokenX, static_cast<uint64_t>(first + i));
    for (int64_t h = 0; h < hidden; ++h)
      moe_ep::store_float(dtype, x.data(), i * hidden + h, c.uniform(h));
  }
  return x;
}

namespace {

// The first i not taken, of weight w[i] > 0, whose running sum of such weights exceeds u (u in
// [0, their total)); the last such i when rounding leaves u at the top end; -1 when none.
int64_t weighted_pick(const std::vector<double>& w, const std::vector<char>& taken, double u) {
  double cum = 0;
  int64_t pick = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(w.size()); ++i) {
    if (taken[i] || w[i] <= 0) continue;
    pick = i;
    cum += w[i];
    if (u < cum) break;
  }
  return pick;
}

}  // namespace

Router::Router(const Preset& layer, RoutingKind kind, uint64_t seed, std::vector<double> real_p)
    : layer_(layer), kind_(kind), seed_(seed), p_(std::move(real_p)) {
  const int64_t H = layer_.hidden, E = layer_.experts;
  if (layer_.group_limited() &&
      (E % layer_.n_group != 0 || layer_.topk_group * (E / layer_.n_group) < layer_.top_k))
    throw Error(ErrorKind::kInternal,
                "Router: groups that do not fit the experts reached it "
                "(layer_of checks them; please report this bug)");
  if (kind_ == RoutingKind::kUniform) p_.assign(E, 1.0 / static_cast<double>(E));
  if (kind_ == RoutingKind::kGate) {
    router_.resize(static_cast<size_t>(H * E));
    const Counter c(seed_, Stream::kRouterMatrix, 0);
    const float scale = 1.0f / std::sqrt(static_cast<float>(H));
    for (int64_t i = 0; i < H * E; ++i) router_[i] = c.uniform(i) * scale;
  }
}

void Router::sample(int64_t token, const std::vector<double>& p, int32_t* ids,
                    std::vector<double>& logits) const {
  const int64_t E = layer_.experts, K = layer_.top_k;
  const Counter draws(seed_, Stream::kRouteSample, static_cast<uint64_t>(token));
  std::vector<char> taken(E, 0);
  double remaining = std::accumulate(p.begin(), p.end(), 0.0);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t pick = weighted_pick(p, taken, draws.unit(k) * remaining);
    taken[pick] = 1;
    remaining -= p[pick];
    ids[k] = static_cast<int32_t>(pick);
  }
  // Router logits: the k-th drawn expert gets the k-th largest of E normals.
  const Counter normals(seed_, Stream::kRouteLogits, static_cast<uint64_t>(token));
  std::vector<double> drawn(E);
  for (int64_t e = 0; e < E; ++e) drawn[e] = normals.normal(e);
  std::sort(drawn.begin(), drawn.end(), std::greater<>());
  int64_t next = K;
  for (int64_t k = 0; k < K; ++k) logits[ids[k]] = drawn[k];
  for (int64_t e = 0; e < E; ++e) {
    if (!taken[e]) logits[e] = drawn[next++];
  }
}

// p restricted to the groups drawn for `token` (routing.h, "real, uniform").
std::vector<double> Router::drawn_groups(int64_t token, const std::vector<double>& p) const {
  const int64_t N = layer_.n_group, S = layer_.experts / N;
  std::vector<double> mass(N, 0.0);
  std::vector<int64_t> nonzero(N, 0);
  for (int64_t e = 0; e < layer_.experts; ++e) {
    mass[e / S] += p[e];
    nonzero[e / S] += p[e] > 0;
  }
  const Counter draws(seed_, Stream::kRouteGroups, static_cast<uint64_t>(token));
  std::vector<double> kept(p.size(), 0.0);
  std::vector<char> taken(N, 0);
  for (int64_t n = 0, experts = 0; n < N && (n < layer_.topk_group || experts < layer_.top_k);
       ++n) {
    double remaining = 0;  // summed afresh: no drift from subtracting
    for (int64_t g = 0; g < N; ++g) remaining += taken[g] ? 0.0 : mass[g];
    const int64_t pick = weighted_pick(mass, taken, draws.unit(n) * remaining);
    if (pick < 0) break;  // every group of nonzero mass drawn
    taken[pick] = 1;
    experts += nonzero[pick];
    std::copy(p.begin() + pick * S, p.begin() + (pick + 1) * S, kept.begin() + pick * S);
  }
  return kept;
}

// The experts of the topk_group groups whose two best scores sum highest (routing.h, "gate").
void Router::gate_groups(const std::vector<float>& logits, std::vector<char>& allowed) const {
  const int64_t E = layer_.experts, N = layer_.n_group, S = E / N;
  std::vector<double> score(E);
  if (layer_.scoring == Scoring::kSoftmax) {
    const double m = *std::max_element(logits.begin(), logits.end());
    double denom = 0;
    for (const float l : logits) denom += std::exp(l - m);
    for (int64_t e = 0; e < E; ++e) score[e] = std::exp(logits[e] - m) / denom;
  } else {
    for (int64_t e = 0; e < E; ++e) score[e] = 1.0 / (1.0 + std::exp(-double{logits[e]}));
  }
  std::vector<double> group(N);
  for (int64_t g = 0; g < N; ++g) {
    std::vector<double> s(score.begin() + g * S, score.begin() + (g + 1) * S);
    const int64_t two = std::min<int64_t>(2, S);
    std::partial_sort(s.begin(), s.begin() + two, s.end(), std::greater<>());
    group[g] = std::accumulate(s.begin(), s.begin() + two, 0.0);
  }
  std::vector<int64_t> order(N);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return group[a] > group[b]; });
  allowed.assign(E, 0);
  for (int64_t t = 0; t < layer_.topk_group; ++t)
    std::fill(allowed.begin() + order[t] * S, allowed.begin() + (order[t] + 1) * S, 1);
}

void Router::scores(const std::vector<double>& logits, const int32_t* ids, float* out) const {
  const int64_t K = layer_.top_k;
  std::vector<double> s(K);
  if (layer_.scoring == Scoring::kSoftmax) {
    const double m = *std::max_element(logits.begin(), logits.end());
    double denom = 0;
    for (double l : logits) denom += std::exp(l - m);
    for (int64_t k = 0; k < K; ++k) s[k] = std::exp(logits[ids[k]] - m) / denom;
  } else {
    for (int64_t k = 0; k < K; ++k) s[k] = 1.0 / (1.0 + std::exp(-logits[ids[k]]));
  }
  double sum = 0;
  for (double v : s) sum += v;
  for (int64_t k = 0; k < K; ++k) {
    const double v = layer_.normalise_top_k ? s[k] / sum : s[k];
    out[k] = static_cast<float>(v * layer_.scaling);
  }
}

void Router::route(int64_t first, int64_t count, const void* x, moe_ep::DType dtype,
                   int32_t* expert_ids, float* expert_scales) const {
  const int64_t H = layer_.hidden, E = layer_.experts, K = layer_.top_k;
  std::vector<double> logits(E);
  std::vector<float> acc(E);
  std::vector<int32_t> order(E);
  std::vector<char> allowed;
  for (int64_t i = 0; i < count; ++i) {
    int32_t* ids = expert_ids + i * K;
    if (kind_ == RoutingKind::kGate) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t h = 0; h < H; ++h) {
        const float xv = moe_ep::load_float(dtype, x, i * H + h);
        const float* row = router_.data() + h * E;
        for (int64_t e = 0; e < E; ++e) acc[e] += xv * row[e];
      }
      for (int64_t e = 0; e < E; ++e) logits[e] = acc[e];
      order.resize(static_cast<size_t>(E));
      std::iota(order.begin(), order.end(), 0);
      if (layer_.group_limited()) {  // only the allowed groups' experts compete
        gate_groups(acc, allowed);
        order.erase(
            std::remove_if(order.begin(), order.end(), [&](int32_t e) { return !allowed[e]; }),
            order.end());
      }
      std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t a, int32_t b) {
        return acc[a] > acc[b] || (acc[a] == acc[b] && a < b);
      });
      std::copy(order.begin(), order.begin() + K, ids);
    } else {
      if (layer_.group_limited())
        sample(first + i, drawn_groups(first + i, p_), ids, logits);
      else
        sample(first + i, p_, ids, logits);
    }
    scores(logits, ids, expert_scales + i * K);
  }
}

}  // namespace moe_ep_tool
