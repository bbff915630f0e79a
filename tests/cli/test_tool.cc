// Unit tests of the moe-ep tool's pure parts: safetensors I/O, the batch files, token splitting,
// the real-routing data mapping, routing determinism, the scoring rules, redundant expert slots,
// the output check, the checks made before a run (flags, sizes, memory, files), the command line
// (errors, suggestions), the report's line wrapping and the progress lines.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <set>
#include <thread>
#include <utility>

#include "batch.h"
#include "checks.h"
#include "cli.h"
#include "common.h"
#include "moe_ep/error.h"
#include "numeric.h"
#include "presets.h"
#include "progress.h"
#include "redundant.h"
#include "reference.h"
#include "rng.h"
#include "routing.h"
#include "run_report.h"
#include "safetensors.h"

namespace moe_ep_tool {
namespace {

using moe_ep::DType;

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("moe_ep_cli_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

std::string routing_csv() { return MOE_EP_TEST_ROUTING_CSV; }

// v rounded to the dtype and back to fp32.
float round_to(DType dtype, float v) {
  float buf = 0;  // room for any dtype
  moe_ep::store_float(dtype, &buf, 0, v);
  return moe_ep::load_float(dtype, &buf, 0);
}

// The tool's reference and experts round through the library's conversions (moe_ep/tensor.h).
TEST(Numeric, Bf16RoundsToNearestEven) {
  EXPECT_EQ(moe_ep::float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(moe_ep::float_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(moe_ep::float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_TRUE(std::isnan(moe_ep::bf16_to_float(moe_ep::float_to_bf16(NAN))));
  EXPECT_EQ(moe_ep::fp16_to_float(moe_ep::float_to_fp16(0.333333f)),
            static_cast<float>(static_cast<_Float16>(0.333333f)));
  EXPECT_EQ(parse_float_dtype("fp16"), DType::kF16);
  EXPECT_EQ(parse_float_dtype("bf16"), DType::kBF16);
}

TEST(Safetensors, RoundTripsEveryDtypeAndMetadata) {
  StFile f;
  for (DType d : {DType::kBF16, DType::kF16, DType::kF32, DType::kI32, DType::kI64}) {
    StTensor t;
    t.dtype = d;
    t.shape = {3, 2};
    t.data.resize(6 * moe_ep::dtype_size(d));
    for (size_t i = 0; i < t.data.size(); ++i) t.data[i] = static_cast<std::byte>(i * 7 + 1);
    f.tensors[std::string("t_") + safetensors_dtype_name(d)] = t;
  }
  f.tensors["empty"] = StTensor{DType::kF32, {0, 5}, {}};
  f.metadata["seed"] = "42";
  const std::string path = temp_path("rt.safetensors");
  write_safetensors(path, f);
  const StFile g = read_safetensors(path);
  std::filesystem::remove(path);
  ASSERT_EQ(g.tensors.size(), f.tensors.size());
  for (const auto& [name, t] : f.tensors) {
    const StTensor& u = g.tensors.at(name);
    EXPECT_EQ(u.dtype, t.dtype) << name;
    EXPECT_EQ(u.shape, t.shape) << name;
    EXPECT_EQ(u.data, t.data) << name;
  }
  EXPECT_EQ(g.metadata.at("seed"), "42");
}

TEST(Safetensors, HeaderIsLittleEndianLengthThenAlignedJson) {
  StFile f;
  f.tensors["a"] = StTensor{DType::kI32, {1}, std::vector<std::byte>(4, std::byte{9})};
  const std::string path = temp_path("hdr.safetensors");
  write_safetensors(path, f);
  std::ifstream in(path, std::ios::binary);
  unsigned char len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n * 256 + len[i];
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  std::filesystem::remove(path);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_NE(header.find("\"dtype\":\"I32\""), std::string::npos) << header;
  EXPECT_NE(header.find("\"data_offsets\":[0,4]"), std::string::npos) << header;
}

TEST(Safetensors, RejectsMalformedFiles) {
  const std::string path = temp_path("bad.safetensors");
  auto write_raw = [&](const std::string& header, size_t data_bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const uint64_t n = header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(data_bytes, '\0');
  };
  auto expect_error_at = [&](const std::string& file, const std::string& needle) {
    try {
      read_safetensors(file);
      ADD_FAILURE() << "no error, expected one naming " << needle;
    } catch (const moe_ep::Error& e) {
      EXPECT_EQ(e.kind(), moe_ep::ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto expect_error = [&](const std::string& needle) {
    try {
      read_safetensors(path);
      ADD_FAILURE() << "no error, expected one naming " << needle;
    } catch (const moe_ep::Error& e) {
      EXPECT_EQ(e.kind(), moe_ep::ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  write_raw(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4);
  expect_error("outside");
  write_raw(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8);
  expect_error("needs 12");
  write_raw(R"({"x":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8);
  expect_error("F64");
  write_raw(R"({"x":{"dtype":"I32","shape":[128,8],"data_offsets":[0,4096]}})", 592);
  expect_error("data_offsets [0,4096] outside the 592 data bytes (a truncated file?)");
  write_raw(R"({"x":{"dtype":"I32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", 8);
  expect_error("shape [4611686018427387904,4] is too large (its size in bytes overflows");
  write_raw(R"({"a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            12);
  expect_error("tensor 'b': data_offsets [4,12] overlap tensor 'a' at [0,8]");
  write_raw(R"({"a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
            R"("c":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
            12);
  EXPECT_EQ(read_safetensors(path).tensors.size(), 3u);  // adjacent and empty spans are fine
  write_raw("{not json", 0);
  expect_error("JSON");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const uint64_t n = 1000;
    out.write(reinterpret_cast<const char*>(&n), 8);
  }
  expect_error("exceeds the file size");
  // A header nested thousands deep (it crashed the JSON parser) and one just within the bound.
  write_raw(R"({"x":)" + std::string(5000, '[') + std::string(5000, ']') + "}", 0);
  expect_error("header nests JSON arrays and objects more than 64 deep");
  write_raw(R"({"__metadata__":{"s":"[[[[{{{{\"[[["},"x":)" + std::string(62, '[') +
                std::string(62, ']') + "}",
            0);
  expect_error("tensor 'x'");  // parsed (brackets in strings do not count); then rejected
  std::filesystem::remove(path);
  // Not a regular file: a directory, and a FIFO (opening one would block until a writer came).
  expect_error_at(std::filesystem::temp_directory_path().string(), "is a directory");
  const std::string fifo = temp_path("routing.fifo");
  std::filesystem::remove(fifo);
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  expect_error_at(fifo, "is a FIFO, not a regular file");
  std::filesystem::remove(fifo);
}

TEST(Batch, SplitTokensEvenlyOrAsSaved) {
  EXPECT_EQ(split_tokens(10, {}, 4), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(split_tokens(10, {7, 3}, 2), (std::vector<int64_t>{7, 3}));
  EXPECT_EQ(split_tokens(10, {7, 3}, 3), (std::vector<int64_t>{4, 3, 3}));
  EXPECT_EQ(split_tokens(2, {}, 4), (std::vector<int64_t>{1, 1, 0, 0}));
}

TEST(Batch, RoutingFileRoundTripsAndChecksShapes) {
  Batch b;
  b.tokens = 3;
  b.hidden = 4;
  b.top_k = 2;
  b.dtype = DType::kF16;
  b.x = make_tokens(1, 0, 3, 4, DType::kF16);
  b.expert_ids = {0, 1, 2, 3, 4, 5};
  b.expert_scales = {0.5f, 0.25f, 1, 2, 3, 4};
  b.tokens_per_rank = {2, 1};
  b.metadata = {{"moe_expert_num", "8"}};
  const std::string path = temp_path("batch.safetensors");
  save_routing(path, b);
  const Batch c = load_routing(path);
  EXPECT_EQ(c.tokens, 3);
  EXPECT_EQ(c.hidden, 4);
  EXPECT_EQ(c.top_k, 2);
  EXPECT_EQ(c.dtype, DType::kF16);
  EXPECT_EQ(c.x, b.x);
  EXPECT_EQ(c.expert_ids, b.expert_ids);
  EXPECT_EQ(c.expert_scales, b.expert_scales);
  EXPECT_EQ(c.tokens_per_rank, b.tokens_per_rank);
  EXPECT_EQ(c.metadata.at("moe_expert_num"), "8");

  b.tokens_per_rank = {2, 2};  // sums to 4, not 3
  save_routing(path, b);
  EXPECT_THROW(load_routing(path), moe_ep::Error);
  std::filesystem::remove(path);
}

TEST(RealRouting, ProbabilitiesFromTheDataAndTheirMappingOntoE) {
  RealRoutingSource src{routing_csv(), "olmoe", "c4", 7};
  const ExpertDistribution d64 = load_real_distribution(src, 64, 8);
  ASSERT_EQ(d64.p.size(), 64u);
  EXPECT_NEAR(std::accumulate(d64.p.begin(), d64.p.end(), 0.0), 1.0, 1e-12);
  // Split 64 -> 256: each data expert's probability spread evenly over 4 consecutive experts.
  const ExpertDistribution d256 = load_real_distribution(src, 256, 8);
  for (int e = 0; e < 256; ++e) EXPECT_DOUBLE_EQ(d256.p[e], d64.p[e / 4] / 4) << e;
  EXPECT_NE(d256.description.find("split evenly over 4"), std::string::npos);
  // Merge 64 -> 16.
  const ExpertDistribution d16 = load_real_distribution(src, 16, 2);
  EXPECT_NEAR(d16.p[3], d64.p[12] + d64.p[13] + d64.p[14] + d64.p[15], 1e-15);
  EXPECT_THROW(load_real_distribution(src, 48, 8), moe_ep::Error);  // neither divides
  EXPECT_THROW(load_real_distribution(src, 4, 8), moe_ep::Error);   // K > nonzero experts

  for (auto bad : {RealRoutingSource{routing_csv(), "olmoe", "nope", 7},
                   RealRoutingSource{routing_csv(), "olmoe", "c4", 3},
                   RealRoutingSource{routing_csv(), "gpt", "c4", 7},
                   RealRoutingSource{"/nonexistent.csv", "olmoe", "c4", 7}}) {
    try {
      load_real_distribution(bad, 64, 8);
      ADD_FAILURE() << "no error for " << bad.model << "/" << bad.domain << "/" << bad.layer;
    } catch (const moe_ep::Error& e) {
      EXPECT_EQ(e.kind(), moe_ep::ErrorKind::kInvalidArgument) << e.what();
    }
  }
}

class RoutingTest : public ::testing::TestWithParam<std::tuple<std::string, RoutingKind>> {};

TEST_P(RoutingTest, DeterministicPerTokenDistinctInRangeAndScored) {
  const auto& [preset_name, kind] = GetParam();
  Preset layer = *find_preset(preset_name);
  layer.hidden = 64;  // the routing does not depend on it except through x (gate)
  const int64_t E = layer.experts, K = layer.top_k, H = layer.hidden, N = 12;
  std::vector<double> p;
  if (kind == RoutingKind::kReal) {
    p = load_real_distribution({routing_csv(), layer.routing_model, "c4", 7}, E, K).p;
  }
  const Router router(layer, kind, 5, p);
  const auto x = make_tokens(5, 0, N, H, DType::kBF16);
  std::vector<int32_t> ids(N * K), ids2(N * K);
  std::vector<float> scales(N * K), scales2(N * K);
  router.route(0, N, x.data(), DType::kBF16, ids.data(), scales.data());
  // The same tokens routed as two ranks' slices: identical (a function of the global index).
  const size_t half = static_cast<size_t>(N / 2 * H) * 2;
  router.route(0, N / 2, x.data(), DType::kBF16, ids2.data(), scales2.data());
  router.route(N / 2, N - N / 2, x.data() + half, DType::kBF16, ids2.data() + N / 2 * K,
               scales2.data() + N / 2 * K);
  EXPECT_EQ(ids, ids2);
  EXPECT_EQ(scales, scales2);
  for (int64_t i = 0; i < N; ++i) {
    std::set<int32_t> row(ids.begin() + i * K, ids.begin() + (i + 1) * K);
    EXPECT_EQ(static_cast<int64_t>(row.size()), K) << "token " << i;
    EXPECT_GE(*row.begin(), 0);
    EXPECT_LT(*row.rbegin(), E);
    double sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_GT(scales[i * K + k], 0.0f);
      if (k > 0 && kind != RoutingKind::kGate) {
        // The k-th drawn expert has the k-th largest logit: scores never increase along k.
        EXPECT_LE(scales[i * K + k], scales[i * K + k - 1]);
      }
      sum += scales[i * K + k];
    }
    if (layer.normalise_top_k) {
      EXPECT_NEAR(sum, layer.scaling, 1e-5) << "token " << i;
    } else {
      EXPECT_LT(sum, 1.0) << "softmax over all experts, not normalised: the top-k sum is < 1";
    }
  }
  // A different seed routes differently.
  const Router other(layer, kind, 6, p);
  other.route(0, N, x.data(), DType::kBF16, ids2.data(), scales2.data());
  EXPECT_NE(scales, scales2);
}

INSTANTIATE_TEST_SUITE_P(
    PresetsAndKinds, RoutingTest,
    ::testing::Combine(::testing::Values("olmoe", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"),
                       ::testing::Values(RoutingKind::kReal, RoutingKind::kGate,
                                         RoutingKind::kUniform)));

TEST(Routing, GatePicksTheLargestLogits) {
  Preset layer = *find_preset("mixtral-8x7b");
  layer.hidden = 16;
  const Router router(layer, RoutingKind::kGate, 3, {});
  // x = e_h (one-hot) makes the logits row h of Wr; recompute them from the documented generator.
  std::vector<float> x(16, 0.0f);
  x[5] = 1.0f;
  int32_t ids[2];
  float scales[2];
  router.route(0, 1, x.data(), DType::kF32, ids, scales);
  std::vector<std::pair<float, int>> logits;
  const Counter c(3, Stream::kRouterMatrix, 0);
  for (int e = 0; e < 8; ++e) logits.push_back({c.uniform(5 * 8 + e) / 4.0f, e});
  std::sort(logits.begin(), logits.end(), [](auto a, auto b) { return a.first > b.first; });
  EXPECT_EQ(ids[0], logits[0].second);
  EXPECT_EQ(ids[1], logits[1].second);
  const double e0 = std::exp(logits[0].first), e1 = std::exp(logits[1].first);
  EXPECT_NEAR(scales[0], e0 / (e0 + e1), 1e-6);
}

TEST(Routing, RealSamplingFollowsTheData) {
  // Mixtral's 8 experts, top-1: the sampled frequencies approach p.
  Preset layer = *find_preset("mixtral-8x7b");
  layer.top_k = 1;
  layer.hidden = 1;
  const auto p = load_real_distribution({routing_csv(), "mistral", "c4", 7}, 8, 1).p;
  const Router router(layer, RoutingKind::kReal, 0, p);
  const int64_t N = 40000;
  std::vector<int32_t> ids(N);
  std::vector<float> scales(N);
  const std::vector<std::byte> x(static_cast<size_t>(N) * 2);
  router.route(0, N, x.data(), DType::kBF16, ids.data(), scales.data());
  std::vector<double> freq(8, 0);
  for (int32_t e : ids) freq[e] += 1.0 / N;
  for (int e = 0; e < 8; ++e) EXPECT_NEAR(freq[e], p[e], 0.01) << "expert " << e;
}

// ---- the checks before a run ---------------------------------------------------------------

// The message of the moe_ep::Error(kInvalidArgument) `f` throws ("" and a failure if none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const moe_ep::Error& e) {
    EXPECT_EQ(e.kind(), moe_ep::ErrorKind::kInvalidArgument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

// DeepSeek-V3's group-limited gate, written out from its published router (transformers'
// DeepseekV3TopkRouter with e_score_correction_bias 0): sigmoid scores, each group's two best
// summed, the topk_group best groups (ties: the lower), the top-k scores inside them (ties: the
// lower id), weights normalised over the top-k and scaled.
TEST(Routing, GroupLimitedGateIsDeepSeekV3s) {
  Preset layer = *find_preset("deepseek-v3");
  layer.hidden = 32;
  ASSERT_EQ(layer.n_group, 8);
  ASSERT_EQ(layer.topk_group, 4);
  const int64_t H = layer.hidden, E = layer.experts, K = layer.top_k, N = 64, S = E / 8;
  const Router router(layer, RoutingKind::kGate, 11, {});
  const auto x = make_tokens(11, 0, N, H, DType::kF32);
  std::vector<int32_t> ids(N * K);
  std::vector<float> scales(N * K);
  router.route(0, N, x.data(), DType::kF32, ids.data(), scales.data());
  const Counter wr(11, Stream::kRouterMatrix, 0);  // Wr as routing.h documents it
  const float* xf = reinterpret_cast<const float*>(x.data());
  for (int64_t i = 0; i < N; ++i) {
    std::vector<float> logit(E, 0.0f);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < E; ++e)
        logit[e] += xf[i * H + h] * (wr.uniform(h * E + e) / std::sqrt(static_cast<float>(H)));
    std::vector<double> score(E);
    for (int64_t e = 0; e < E; ++e) score[e] = 1.0 / (1.0 + std::exp(-double{logit[e]}));
    std::vector<std::pair<double, int64_t>> groups;
    for (int64_t g = 0; g < 8; ++g) {
      std::vector<double> v(score.begin() + g * S, score.begin() + (g + 1) * S);
      std::sort(v.rbegin(), v.rend());
      groups.push_back({-(v[0] + v[1]), g});
    }
    std::sort(groups.begin(), groups.end());
    std::vector<std::pair<double, int64_t>> candidates;
    for (int t = 0; t < 4; ++t)
      for (int64_t e = groups[t].second * S; e < (groups[t].second + 1) * S; ++e)
        candidates.push_back({-score[e], e});
    std::sort(candidates.begin(), candidates.end());
    double sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += -candidates[k].first;
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_EQ(ids[i * K + k], candidates[k].second) << "token " << i << ", slot " << k;
      EXPECT_NEAR(scales[i * K + k], -candidates[k].first / sum * 2.5, 1e-6);
    }
  }
}

// The node-limited draw (routing.h): a group with probability its share of p, then experts from
// p inside it, so with one group per token and K = 1 the experts still follow p; with K = 2 and
// groups of 2 every token takes both experts of one group, each group as often as its share.
TEST(Routing, NodeLimitedDrawKeepsTheDataAndItsGroups) {
  Preset layer = *find_preset("mixtral-8x7b");
  layer.hidden = 1;
  layer.n_group = 4;
  layer.topk_group = 1;
  const auto p = load_real_distribution({routing_csv(), "mistral", "c4", 7}, 8, 1).p;
  const int64_t N = 40000;
  const std::vector<std::byte> x(static_cast<size_t>(N) * 2);
  for (const int64_t K : {1, 2}) {
    layer.top_k = K;
    const Router router(layer, RoutingKind::kReal, 0, p);
    std::vector<int32_t> ids(N * K);
    std::vector<float> scales(N * K);
    router.route(0, N, x.data(), DType::kBF16, ids.data(), scales.data());
    std::vector<double> freq(8, 0);
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t k = 0; k < K; ++k) freq[ids[i * K + k]] += 1.0 / N;
      if (K == 2) {
        EXPECT_EQ(ids[i * K] / 2, ids[i * K + 1] / 2) << "token " << i;
      }
    }
    for (int e = 0; e < 8; ++e) {
      const double want = K == 1 ? p[e] : p[e / 2 * 2] + p[e / 2 * 2 + 1];
      EXPECT_NEAR(freq[e], want, 0.01) << "K " << K << ", expert " << e;
    }
  }
  // deepseek-v3's uniform and real draws: at most topk_group = 4 groups of 32 per token.
  Preset ds = *find_preset("deepseek-v3");
  ds.hidden = 1;
  const auto real = load_real_distribution({routing_csv(), "olmoe", "c4", 7}, 256, 8).p;
  for (const RoutingKind kind : {RoutingKind::kUniform, RoutingKind::kReal}) {
    const Router router(ds, kind, 3, kind == RoutingKind::kReal ? real : std::vector<double>{});
    const int64_t M = 2000;
    const std::vector<std::byte> xs(static_cast<size_t>(M) * 2);
    std::vector<int32_t> ids(M * 8);
    std::vector<float> scales(M * 8);
    router.route(0, M, xs.data(), DType::kBF16, ids.data(), scales.data());
    std::set<int32_t> all_groups;
    for (int64_t i = 0; i < M; ++i) {
      std::set<int32_t> groups;
      for (int64_t k = 0; k < 8; ++k) groups.insert(ids[i * 8 + k] / 32);
      EXPECT_LE(groups.size(), 4u) << "token " << i;
      all_groups.insert(groups.begin(), groups.end());
    }
    EXPECT_EQ(all_groups.size(), 8u);  // every group is reached by some token
  }
}

TEST(Presets, GroupsMustFitTheLayer) {
  const Preset ds = layer_of("moe-ep run", "deepseek-v3", {});
  EXPECT_TRUE(ds.group_limited());
  EXPECT_NE(describe_scoring(ds).find("group-limited: 8 groups of 32 experts"), std::string::npos);
  // The preset's 8 groups on 12 experts do not fit: dropped, and said.
  LayerOverrides twelve;
  twelve.experts = 12;
  const Preset small = layer_of("moe-ep run", "deepseek-v3", twelve);
  EXPECT_FALSE(small.group_limited());
  EXPECT_NE(describe_scoring(small).find(
                "not group-limited: the preset's n_group 8 does not divide E = 12 experts"),
            std::string::npos)
      << describe_scoring(small);
  twelve.experts = 16;  // 4 groups of 2 hold K = 8: kept
  EXPECT_TRUE(layer_of("moe-ep run", "deepseek-v3", twelve).group_limited());
  LayerOverrides one;  // --n-group 1 alone: no limit (topk_group follows it down)
  one.n_group = 1;
  EXPECT_FALSE(layer_of("moe-ep run", "deepseek-v3", one).group_limited());
  // Given ones that do not fit: an error naming the flags and the bound.
  LayerOverrides o;
  o.n_group = 3;
  EXPECT_NE(error_of([&] {
              layer_of("moe-ep plan", "deepseek-v3", o);
            }).find("moe-ep plan: --n-group 3: n_group 3 does not divide E = 256"),
            std::string::npos);
  o.n_group = 8;
  o.topk_group = 9;
  EXPECT_NE(error_of([&] {
              layer_of("moe-ep run", "deepseek-v3", o);
            }).find("topk_group 9 is not in [1, n_group 8]"),
            std::string::npos);
  LayerOverrides olmoe;  // a preset without groups: --n-group alone would mean nothing
  olmoe.n_group = 8;
  EXPECT_NE(error_of([&] { layer_of("moe-ep run", "olmoe", olmoe); })
                .find("moe-ep run: --n-group 8 needs --topk-group: preset 'olmoe' has no routing "
                      "groups"),
            std::string::npos);
  olmoe.topk_group = 2;
  EXPECT_TRUE(layer_of("moe-ep run", "olmoe", olmoe).group_limited());
  o.topk_group = 1;  // 1 group of 32 holds K = 8: fine
  EXPECT_TRUE(layer_of("moe-ep run", "deepseek-v3", o).group_limited());
  o.n_group = 64;  // 1 group of 4 < K = 8
  EXPECT_NE(error_of([&] {
              layer_of("moe-ep run", "deepseek-v3", o);
            }).find("topk_group 1 groups of 4 experts hold fewer than K = 8"),
            std::string::npos);
}

TEST(Checks, IntegerFlagsNameTheBoundAndTheValue) {
  EXPECT_EQ(check_integer("64", 0, 100), "");
  EXPECT_EQ(check_integer("+7", 0, 100), "");
  EXPECT_EQ(check_integer("0", 0, 100), "");
  EXPECT_EQ(check_integer("abc", 0, 100),
            "must be an integer in [0, 100], got abc (not an integer)");
  EXPECT_EQ(check_integer("1.5", 0, 100),
            "must be an integer in [0, 100], got 1.5 (not an integer)");
  EXPECT_EQ(check_integer("", 0, 100), "must be an integer in [0, 100], got  (not an integer)");
  EXPECT_EQ(check_integer("-3", 0, 100), "must be an integer in [0, 100], got -3");
  EXPECT_EQ(check_integer("101", 0, 100, " (note)"),
            "must be an integer in [0, 100] (note), got 101");
  EXPECT_EQ(check_integer("99999999999999999999", 0, 100),
            "must be an integer in [0, 100], got 99999999999999999999");
  EXPECT_EQ(check_integer("2147483646", 1, kMaxExperts), "");
  EXPECT_NE(check_integer("2147483647", 1, kMaxExperts), "");
}

TEST(Checks, SeedIsUnsignedAndTimeoutFinitePositive) {
  EXPECT_EQ(check_unsigned("0"), "");
  EXPECT_EQ(check_unsigned("18446744073709551615"), "");
  const std::string words =
      "must be an integer in [0, 18446744073709551615] (the seed is unsigned)";
  EXPECT_EQ(check_unsigned("-1"), words + ", got -1");
  EXPECT_EQ(check_unsigned("18446744073709551616"), words + ", got 18446744073709551616");
  EXPECT_EQ(check_unsigned("x1"), words + ", got x1 (not an integer)");
  EXPECT_EQ(check_timeout("0.5"), "");
  EXPECT_EQ(check_timeout("300"), "");
  for (const char* bad : {"0", "-3", "inf", "nan", "abc", "", "1e999", "5s"}) {
    EXPECT_EQ(check_timeout(bad),
              std::string("must be a finite number of seconds > 0, got ") + bad);
  }
}

RunShape shape_of(const std::string& preset, int64_t tokens, int64_t world) {
  const Preset& p = *find_preset(preset);
  RunShape s;
  s.world = world;
  s.tokens_per_rank.assign(world, tokens);
  s.hidden = p.hidden;
  s.experts = p.experts;
  s.top_k = p.top_k;
  s.ffn = p.ffn;
  s.tokens_label = "--tokens " + std::to_string(tokens);
  s.hidden_label = "H " + std::to_string(p.hidden);
  s.experts_label = "E " + std::to_string(p.experts);
  s.top_k_label = "K " + std::to_string(p.top_k);
  s.ffn_label = "FFN " + std::to_string(p.ffn);
  return s;
}

TEST(Checks, SizeProductsAreOverflowChecked) {
  RunShape s = shape_of("olmoe", 64, 4);
  check_sizes(s);
  check_gather_limits(s);

  s = shape_of("olmoe", kMaxDim, 1);
  s.hidden = kMaxDim;
  s.hidden_label = "--hidden 2147483647";
  s.fn = ExpertFn::kScale;
  EXPECT_EQ(error_of([&] { check_sizes(s); }),
            "moe-ep run: dispatch_v2's expand_x in bytes = A 17179869176 x --hidden 2147483647 x "
            "2 B (bf16) overflows a 64-bit integer (bound 2^63 - 1 = 9223372036854775807); use "
            "fewer --tokens");
  s.dtype = DType::kF32;
  EXPECT_EQ(error_of([&] { check_sizes(s); }),
            "moe-ep run: the global batch x in bytes = N 2147483647 (--tokens 2147483647 x W 1) x "
            "--hidden 2147483647 x 4 B (fp32) overflows a 64-bit integer (bound 2^63 - 1 = "
            "9223372036854775807); use fewer --tokens");

  // One expert's swiglu weights: the GEMMs take int sizes.
  s = shape_of("olmoe", 1, 1);
  s.ffn = 1 << 20;
  s.ffn_label = "--ffn 1048576";
  EXPECT_NE(error_of([&] { check_sizes(s); }).find("W1 and W3 = 2 x --ffn 1048576 x H 2048"),
            std::string::npos);
  s.fn = ExpertFn::kIdentity;  // no weights
  check_sizes(s);

  // MPI_Gatherv moves at most 2^31 - 1 bytes to rank 0.
  s = shape_of("olmoe", 300000, 2);
  check_sizes(s);
  EXPECT_NE(error_of([&] { check_gather_limits(s); })
                .find("the batch x gathered on rank 0 = N 600000 (--tokens 300000 x W 2) x H "
                      "2048 x 2 B (bf16) = 2457600000 bytes exceeds 2^31 - 1"),
            std::string::npos);
}

TEST(Checks, MemoryEstimateAgainstThePhysicalMemory) {
  const uint64_t GiB = uint64_t{1} << 30;
  EXPECT_GT(physical_memory_bytes(), 0u);
  RunShape s = shape_of("olmoe", 64, 4);
  const MemoryEstimate m0 = estimate_rank_memory(s, 0), m1 = estimate_rank_memory(s, 1);
  EXPECT_GT(m0.bytes, m1.bytes);  // rank 0 also gathers the batch and runs the reference
  EXPECT_LT(m0.bytes, 0.5 * GiB);
  check_memory(s, {0, 1, 2, 3}, 16 * GiB);

  // 1M tokens at H 2048: dispatch's receive buffers alone are A x H x 2 B = 8M x 4 KiB.
  s = shape_of("olmoe", 1000000, 1);
  const std::string msg = error_of([&] { check_memory(s, {0}, 64 * GiB); });
  EXPECT_EQ(msg.rfind("moe-ep run: --tokens 1000000 with H 2048 (E 64, K 8, FFN 1024, bf16, W 1) "
                      "needs about ",
                      0),
            0u)
      << msg;
  EXPECT_NE(msg.find(" GiB on rank 0 (more than this machine's 64 GiB; mostly "), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("); use fewer --tokens"), std::string::npos) << msg;

  // The advice names the flags that were set: --global-bs sizes dispatch's receive buffers,
  // --hidden and --top-k scale them; each alternative is named once.
  s = shape_of("olmoe", 8, 1);
  s.global_bs = 100000000;
  EXPECT_NE(error_of([&] {
              check_memory(s, {0}, 64 * GiB);
            }).find("); use fewer --tokens with a smaller --global-bs"),
            std::string::npos);
  s = shape_of("olmoe", 1000000, 1);
  s.hidden_label = "--hidden 2048";
  s.top_k_label = "--top-k 8";
  EXPECT_NE(error_of([&] {
              check_memory(s, {0}, 64 * GiB);
            }).find("); use fewer --tokens or a smaller --top-k or a smaller --hidden"),
            std::string::npos);

  // Each rank fits, the ranks of one machine together do not.
  s = shape_of("olmoe", 20000, 4);
  const double one = estimate_rank_memory(s, 0).bytes;
  const uint64_t phys = static_cast<uint64_t>(one * 2);
  check_memory(s, {0}, phys);
  EXPECT_NE(error_of([&] {
              check_memory(s, {0, 1, 2, 3}, phys);
            }).find("on the 4 ranks of this machine"),
            std::string::npos);

  // The experts' tables: E near 2^31 with a gate router of H 2^20.
  s = shape_of("olmoe", 4, 1);
  s.experts = kMaxExperts - 62;
  s.experts_label = "--experts " + std::to_string(s.experts);
  s.hidden = 1 << 20;
  s.hidden_label = "--hidden 1048576";
  s.routing = RoutingKind::kGate;
  s.fn = ExpertFn::kScale;
  check_sizes(s);
  EXPECT_NE(error_of([&] {
              check_memory(s, {0}, 1024 * GiB);
            }).find("use fewer --experts or a smaller --hidden"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              check_load_memory("big.safetensors", 100 * GiB, 64 * GiB);
            }).find("--load-routing 'big.safetensors' holds 100 GiB"),
            std::string::npos);
}

TEST(Checks, OutputPaths) {
  EXPECT_EQ(error_of([] { check_writable("--save-output", "/nonexistent/dir/o.safetensors"); }),
            "moe-ep run: --save-output '/nonexistent/dir/o.safetensors': cannot create a file in "
            "directory '/nonexistent/dir': " +
                std::string(std::strerror(ENOENT)));
  const std::string dir = std::filesystem::temp_directory_path().string();
  EXPECT_EQ(error_of([&] { check_writable("--save-routing", dir); }),
            "moe-ep run: --save-routing '" + dir + "': is a directory, not a file name");
  check_writable("--save-output", temp_path("new.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(temp_path("new.safetensors")));  // nothing created

  EXPECT_TRUE(same_path("./F.safetensors", "F.safetensors"));
  EXPECT_TRUE(same_path("a/../F.safetensors", "F.safetensors"));
  EXPECT_TRUE(same_path(dir + "/x.st", dir + "/./x.st"));
  EXPECT_FALSE(same_path("F.safetensors", "G.safetensors"));
}

TEST(Checks, DispatchErrorsOnALoadedBatchNameTheFileRow) {
  EXPECT_EQ(
      file_rows_context("dispatch_v2: expert_ids[6,1] = 300 is outside [0, 64)", 1, 64, 64, "F"),
      "(rank 1 holds rows [64, 128) of routing file 'F': expert_ids[6,*] is file row 70)");
  EXPECT_EQ(file_rows_context("dispatch_v2: expert_scales[2] bad", 0, 0, 4, "F"),
            "(rank 0 holds rows [0, 4) of routing file 'F': expert_scales[2,*] is file row 2)");
  EXPECT_EQ(file_rows_context("combine_v2: expand_x[6,1] has no row", 1, 64, 64, "F"),
            "(rank 1 holds rows [64, 128) of routing file 'F')");
  EXPECT_EQ(format_value(NAN), "nan");
  EXPECT_EQ(format_value(-INFINITY), "-inf");
  EXPECT_EQ(format_value(0.5), "0.5");
}

TEST(Batch, LoadRejectsNonFiniteValuesAndABadSeed) {
  Batch b;
  b.tokens = 4;
  b.hidden = 3;
  b.top_k = 2;
  b.dtype = DType::kBF16;
  b.x = make_tokens(1, 0, 4, 3, DType::kBF16);
  b.expert_ids = {0, 1, 2, 3, 4, 5, 6, 7};
  b.expert_scales = {1, 1, 1, 1, 1, 1, 1, 1};
  b.metadata = {{"seed", "42"}};
  const std::string path = temp_path("finite.safetensors");
  save_routing(path, b);
  EXPECT_EQ(load_routing(path).seed, std::optional<uint64_t>(42));

  Batch c = b;
  c.expert_scales[3 * 2 + 0] = NAN;
  save_routing(path, c);
  EXPECT_EQ(error_of([&] { load_routing(path); }),
            "routing file '" + path + "': expert_scales[3,0] = nan is not finite");
  c = b;
  moe_ep::store_float(DType::kBF16, c.x.data(), 2 * 3 + 1, -INFINITY);
  save_routing(path, c);
  EXPECT_EQ(error_of([&] { load_routing(path); }),
            "routing file '" + path + "': x[2,1] = -inf is not finite");
  for (const char* bad : {"xyz", "-1", "", "1e3", "18446744073709551616"}) {
    c = b;
    c.metadata["seed"] = bad;
    save_routing(path, c);
    EXPECT_EQ(
        error_of([&] { load_routing(path); }),
        "routing file '" + path + "': metadata seed = '" + bad + "' is not an unsigned integer");
  }
  std::filesystem::remove(path);
}

// Found by tests/fuzz (fuzz_safetensors): tokens_per_rank entries whose sum overflows int64 (a
// signed overflow, UBSan) wrapped around to x's token count.
TEST(Batch, TokensPerRankThatOverflowTheSumAreRefused) {
  Batch b;
  b.tokens = 3;
  b.hidden = 2;
  b.top_k = 1;
  b.dtype = DType::kF32;
  b.x = make_tokens(1, 0, 3, 2, DType::kF32);
  b.expert_ids = {0, 1, 2};
  b.expert_scales = {1, 1, 1};
  // (2^63 - 2) + (2^63 - 2) + 7 wraps to 3 = N in 64-bit arithmetic: the old check accepted it.
  const int64_t big = std::numeric_limits<int64_t>::max() - 1;
  b.tokens_per_rank = {big, big, 7};
  const std::string path = temp_path("tpr_overflow.safetensors");
  save_routing(path, b);
  EXPECT_EQ(error_of([&] { load_routing(path); }),
            "routing file '" + path + "': tokens_per_rank sums to more than the 3 tokens of x");
  b.tokens_per_rank = {1, 2};  // the same check leaves a good split alone
  save_routing(path, b);
  EXPECT_EQ(load_routing(path).tokens_per_rank, (std::vector<int64_t>{1, 2}));
  std::filesystem::remove(path);
}

TEST(Batch, MaskRoundTripsAndIsChecked) {
  Batch b;
  b.tokens = 3;
  b.hidden = 2;
  b.top_k = 2;
  b.dtype = DType::kF32;
  b.x = make_tokens(1, 0, 3, 2, DType::kF32);
  b.expert_ids = {0, 1, 2, 3, 4, 5};
  b.expert_scales = {1, 1, 1, 1, 1, 1};
  b.mask_dims = 2;
  b.x_active_mask = {1, 0, 0, 0, 1, 1};
  const std::string path = temp_path("mask.safetensors");
  save_routing(path, b);
  Batch c = load_routing(path);
  EXPECT_EQ(c.mask_dims, 2);
  EXPECT_EQ(c.x_active_mask, b.x_active_mask);
  b.mask_dims = 1;
  b.x_active_mask = {1, 1, 0};
  save_routing(path, b);
  c = load_routing(path);
  EXPECT_EQ(c.mask_dims, 1);
  EXPECT_EQ(c.x_active_mask, b.x_active_mask);
  b.x_active_mask = {1, 2, 0};
  save_routing(path, b);
  EXPECT_EQ(error_of([&] { load_routing(path); }),
            "routing file '" + path + "': x_active_mask element 1 = 2 is not a bool (0 or 1)");
  b.x_active_mask = {1, 1, 0};
  save_routing(path, b);
  StFile f = read_safetensors(path);
  f.tensors["x_active_mask"] = StTensor{DType::kBool, {2}, std::vector<std::byte>(2)};
  write_safetensors(path, f);
  EXPECT_EQ(error_of([&] { load_routing(path); }),
            "routing file '" + path +
                "': tensor 'x_active_mask' is BOOL [2], expected BOOL [3] or [3, 2]");
  std::filesystem::remove(path);
}

TEST(Redundant, AutoIsTheSmallestRFillingTheMoeRanks) {
  EXPECT_EQ(auto_redundant(256, 3), 2);  // 258 = 3 x 86
  EXPECT_EQ(auto_redundant(256, 4), 0);
  EXPECT_EQ(auto_redundant(8, 3), 1);
  EXPECT_EQ(auto_redundant(2, 5), 3);
  EXPECT_EQ(auto_redundant(7, 1), 0);
  for (int64_t E = 1; E < 40; ++E) {
    for (int64_t m = 1; m < 12; ++m) {
      const int64_t R = auto_redundant(E, m);
      EXPECT_EQ((E + R) % m, 0);
      EXPECT_LT(R, m);
    }
  }
}

TEST(Redundant, ReplicasOfTheBusiestAlternateByGlobalToken) {
  // Loads: expert 2 the busiest, then 0 and 3 tied (lower id first).
  const RedundantExperts r = make_redundant(5, 2, {0.2, 0.1, 0.4, 0.2, 0.1});
  EXPECT_EQ(r.replica_of, (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(r.describe(), "replicas of experts 2, 0");
  EXPECT_EQ(r.logical(5), 2);
  EXPECT_EQ(r.logical(6), 0);
  EXPECT_EQ(r.logical(3), 3);
  // Even global tokens: the original slot; odd ones: the replica.
  EXPECT_EQ(r.physical(2, 10), 2);
  EXPECT_EQ(r.physical(2, 11), 5);
  EXPECT_EQ(r.physical(0, 0), 0);
  EXPECT_EQ(r.physical(0, 7), 6);
  EXPECT_EQ(r.physical(1, 7), 1);  // not replicated
  // Special ids come after the E + R slots; -1 (inactive) is kept.
  EXPECT_EQ(r.physical(5, 3), 7);
  EXPECT_EQ(r.physical(8, 4), 10);
  EXPECT_EQ(r.physical(-1, 1), -1);
  // W-independent: mapping a batch in per-rank slices equals mapping it whole.
  const int64_t N = 9, K = 2;
  std::vector<int32_t> logical_ids(N * K), whole(N * K), sliced(N * K);
  for (int64_t i = 0; i < N * K; ++i) logical_ids[i] = static_cast<int32_t>((i * 3) % 7);
  r.map_rows(logical_ids.data(), whole.data(), 0, N, K);
  for (int64_t first : {0, 4, 7}) {
    const int64_t count = first == 0 ? 4 : first == 4 ? 3 : 2;
    r.map_rows(logical_ids.data() + first * K, sliced.data() + first * K, first, count, K);
  }
  EXPECT_EQ(whole, sliced);
  // Both copies of a replicated expert are used, each on half of its entries.
  int64_t original = 0, replica = 0;
  for (int64_t g = 0; g < 100; ++g) (r.physical(2, g) == 2 ? original : replica) += 1;
  EXPECT_EQ(original, 50);
  EXPECT_EQ(replica, 50);
}

TEST(Redundant, WithoutALoadAndMoreSlotsThanExperts) {
  const RedundantExperts none = make_redundant(6, 0, {});
  EXPECT_EQ(none.redundant(), 0);
  EXPECT_EQ(none.physical(4, 3), 4);
  EXPECT_EQ(none.physical(7, 3), 7);
  // R > E cycles over the order: experts 0, 1, 2, then 0 again (three copies of expert 0).
  const RedundantExperts r = make_redundant(3, 4, {});
  EXPECT_EQ(r.replica_of, (std::vector<int32_t>{0, 1, 2, 0}));
  EXPECT_EQ(r.copies.at(0), (std::vector<int32_t>{0, 3, 6}));
  EXPECT_EQ(r.physical(0, 4), 3);  // 4 mod 3 = 1: the first replica
  EXPECT_EQ(r.physical(0, 5), 6);
  EXPECT_EQ(r.physical(3, 0), 7);  // the first special id after 3 + 4 slots
}

TEST(Experts, TensorParallelPartsSumToTheFullExpert) {
  const int64_t H = 16, F = 7, rows = 3;  // odd FFN: parts of 4 and 3 columns
  std::vector<float> x(rows * H), full(rows * H), p0(rows * H), p1(rows * H);
  for (int64_t i = 0; i < rows * H; ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
  ExpertBank whole(ExpertFn::kSwiglu, 5, 4, H, F), a(ExpertFn::kSwiglu, 5, 4, H, F, 0, 2),
      b(ExpertFn::kSwiglu, 5, 4, H, F, 1, 2);
  whole.forward(3, x.data(), DType::kF32, full.data(), DType::kF32, rows);
  a.forward(3, x.data(), DType::kF32, p0.data(), DType::kF32, rows);
  b.forward(3, x.data(), DType::kF32, p1.data(), DType::kF32, rows);
  double max_full = 0, max_err = 0, max_part = 0;
  for (int64_t i = 0; i < rows * H; ++i) {
    max_full = std::max(max_full, std::fabs(double(full[i])));
    max_part = std::max(max_part, std::fabs(double(p1[i])));
    max_err = std::max(max_err, std::fabs(double(p0[i]) + double(p1[i]) - double(full[i])));
  }
  EXPECT_GT(max_full, 0.01);
  EXPECT_GT(max_part, 0.001);  // both parts do work
  EXPECT_LT(max_err, 1e-5 * max_full);
  // scale/identity: part 0 the value, part 1 zeros.
  for (ExpertFn fn : {ExpertFn::kScale, ExpertFn::kIdentity}) {
    ExpertBank w(fn, 0, 4, H, F), q0(fn, 0, 4, H, F, 0, 2), q1(fn, 0, 4, H, F, 1, 2);
    std::fill(p1.begin(), p1.end(), 1.0f);
    w.forward(3, x.data(), DType::kF32, full.data(), DType::kF32, rows);
    q0.forward(3, x.data(), DType::kF32, p0.data(), DType::kF32, rows);
    q1.forward(3, x.data(), DType::kF32, p1.data(), DType::kF32, rows);
    EXPECT_EQ(p0, full);
    EXPECT_EQ(p1, std::vector<float>(rows * H, 0.0f));
  }
}

TEST(Reference, QuantiseDequantiseFollowsSpec15) {
  std::vector<float> x = {0.5f, -1.0f, 0.25f, 0.0f, 1.0f / 3}, deq(x.size());
  const float inv = quantize_dequantize_row(x.data(), 5, deq.data());
  EXPECT_EQ(inv, 1.0f / (127.0f / 1.0f));
  EXPECT_EQ(deq[1], -127 * inv);
  EXPECT_EQ(deq[0], 64 * inv);  // 63.5 rounds to even
  EXPECT_EQ(deq[3], 0.0f);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_LE(std::fabs(deq[i] - x[i]), 1.0 / 254 * (1 + 1e-4));
  std::vector<float> zero(4, 0.0f), dz(4, 1.0f);
  EXPECT_EQ(quantize_dequantize_row(zero.data(), 4, dz.data()), 0.0f);
  EXPECT_EQ(dz, zero);
}

// A quantised run emulated on the CPU (int8 each expert input and each returned row, as
// dispatch_v2 quant_mode 2 and combine_v2 comm_quant_mode 2 do) stays within the derived bound
// of the unquantised reference; an error of twice the bound in one element fails.
TEST(Reference, QuantisedRunWithinTheDerivedInt8Bound) {
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (int modes = 1; modes <= 3; ++modes) {
      const bool quant = modes & 1, comm_quant = modes & 2;
      const int64_t N = 12, H = 40, K = 3, E = 6, Ns = 1;
      Batch b;
      b.tokens = N;
      b.hidden = H;
      b.top_k = K;
      b.dtype = dt;
      b.x = make_tokens(11, 0, N, H, dt);
      for (int64_t i = 0; i < N; ++i) {
        for (int64_t k = 0; k < K; ++k) {
          b.expert_ids.push_back(static_cast<int32_t>((i + 2 * k) % (E + 1)));  // E: a zero expert
          b.expert_scales.push_back(0.2f + 0.1f * static_cast<float>(k));
        }
      }
      b.expert_ids[0] = -1;  // an inactive entry
      LayerSpec spec;
      spec.experts = E;
      spec.zero = 1;
      spec.shared = Ns;
      spec.quant = quant;
      spec.comm_quant = comm_quant;
      ExpertBank bank(ExpertFn::kScale, 0, E, H, 8);
      const Reference ref = dense_reference(b, spec, ExpertFn::kScale, bank);
      ASSERT_EQ(ref.bound.size(), static_cast<size_t>(N * H));
      // The emulated run.
      std::vector<std::byte> out(ref.out.size());
      std::vector<float> xf(H), d(H), y(H), acc(H), yq(H);
      auto term = [&](int64_t e, float w, bool weighted) {
        const float* in = xf.data();
        if (quant) {
          quantize_dequantize_row(xf.data(), H, d.data());
          in = d.data();
        }
        for (int64_t h = 0; h < H; ++h) y[h] = round_to(dt, in[h] * bank.factor(e));
        const float* v = y.data();
        if (comm_quant) {
          quantize_dequantize_row(y.data(), H, yq.data());
          v = yq.data();
        }
        for (int64_t h = 0; h < H; ++h) {
          const float p = weighted ? w * v[h] : v[h];
          acc[h] = acc[h] + p;
        }
      };
      for (int64_t i = 0; i < N; ++i) {
        for (int64_t h = 0; h < H; ++h) xf[h] = moe_ep::load_float(dt, b.x.data(), i * H + h);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t k = 0; k < K; ++k) {
          const int32_t e = b.expert_ids[i * K + k];
          if (e >= 0 && e < E) term(e, b.expert_scales[i * K + k], true);
        }
        for (int64_t s = 0; s < Ns; ++s) term(E + s, 1.0f, false);
        for (int64_t h = 0; h < H; ++h) moe_ep::store_float(dt, out.data(), i * H + h, acc[h]);
      }
      CheckResult c = compare_outputs(out, ref, dt, ExpertFn::kScale);
      EXPECT_TRUE(c.bounded);
      EXPECT_TRUE(c.pass) << moe_ep::dtype_name(dt) << " modes " << modes << " max ratio "
                          << c.max_ratio;
      EXPECT_GT(c.max_ratio, 0.02) << "the bound is not absurdly loose";
      EXPECT_GT(c.mismatches, 0);  // quantisation did change the output
      EXPECT_NE(c.rule.find("/ 254"), std::string::npos) << c.rule;
      // One element off by twice its bound.
      const float r = moe_ep::load_float(dt, ref.out.data(), 5 * H + 7);
      moe_ep::store_float(dt, out.data(), 5 * H + 7,
                          static_cast<float>(r + 2.5 * ref.bound[5 * H + 7] + 0.01));
      c = compare_outputs(out, ref, dt, ExpertFn::kScale);
      EXPECT_FALSE(c.pass);
      EXPECT_EQ(c.over_bound, 1);
    }
  }
}

TEST(Reference, NaNCountsAsAMismatchEvenWithEqualBits) {
  std::vector<std::byte> out(4 * 4), ref(4 * 4);
  for (int i = 0; i < 4; ++i) {
    moe_ep::store_float(DType::kF32, out.data(), i, 1.0f + i);
    moe_ep::store_float(DType::kF32, ref.data(), i, 1.0f + i);
  }
  moe_ep::store_float(DType::kF32, out.data(), 1, NAN);
  moe_ep::store_float(DType::kF32, ref.data(), 1, NAN);  // the same bits
  moe_ep::store_float(DType::kF32, out.data(), 3, NAN);
  for (ExpertFn fn : {ExpertFn::kScale, ExpertFn::kSwiglu}) {
    Reference r;
    r.out = ref;
    const CheckResult c = compare_outputs(out, r, DType::kF32, fn);
    EXPECT_FALSE(c.pass);
    EXPECT_EQ(c.nans, 2);
    EXPECT_EQ(c.mismatches, 2);  // the printed count agrees with the verdict
    EXPECT_EQ(c.max_abs, 0.0);   // over the elements without a NaN
    EXPECT_NE(c.rule.find("2 element(s) NaN"), std::string::npos) << c.rule;
  }
  Reference r;
  r.out = ref;
  const CheckResult c =
      compare_outputs(std::vector<std::byte>(8), r, DType::kF32, ExpertFn::kScale);
  EXPECT_FALSE(c.pass);
  EXPECT_EQ(c.mismatches, 4);
  EXPECT_TRUE(c.size_mismatch);
}

CommandLine parse(std::vector<const char*> args) {
  args.insert(args.begin(), "moe-ep");
  return parse_command_line(static_cast<int>(args.size()), args.data());
}

TEST(CommandLine, ParsesRunAndBench) {
  CommandLine c = parse({"run", "--tokens", "8", "--warm-repeats", "0", "--progress", "on"});
  ASSERT_EQ(c.action, CommandLine::Action::kRun) << c.text;
  EXPECT_EQ(c.run.tokens, 8);
  EXPECT_TRUE(c.run.tokens_given);
  EXPECT_EQ(c.run.warm_repeats, 0);
  EXPECT_EQ(c.run.progress, "on");
  EXPECT_FALSE(c.run.exact_size);
  c = parse({"run", "--exact-size"});
  ASSERT_EQ(c.action, CommandLine::Action::kRun) << c.text;
  EXPECT_TRUE(c.run.exact_size);
  c = parse({"bench", "--tokens", "8,16"});
  ASSERT_EQ(c.action, CommandLine::Action::kBench) << c.text;
  EXPECT_EQ(c.bench.tokens, (std::vector<int64_t>{8, 16}));
  EXPECT_FALSE(c.bench.exact_size);
  c = parse({"bench", "--exact-size"});
  ASSERT_EQ(c.action, CommandLine::Action::kBench) << c.text;
  EXPECT_TRUE(c.bench.exact_size);
}

TEST(CommandLine, ErrorsAreOneLineAndSayWhatIsWrong) {
  const std::pair<std::vector<const char*>, std::string> cases[] = {
      {{"run", "--token", "16"},
       "moe-ep run: unknown option --token; did you mean --tokens? (moe-ep run --help lists "
       "them)"},
      {{"run", "--hiden=3"}, "moe-ep run: unknown option --hiden; did you mean --hidden?"},
      {{"bench", "--iter", "3"}, "moe-ep bench: unknown option --iter; did you mean --iters?"},
      {{"run", "--compare"},
       "moe-ep run: unknown option --compare: it is an option of moe-ep bench"},
      {{"run", "--frobnicate"}, "moe-ep run: unknown option --frobnicate (moe-ep run --help"},
      {{"run", "16"}, "moe-ep run: unexpected argument '16': moe-ep run takes only options"},
      {{"run", "--tokens"}, "--tokens: a value is missing (expected INT:[0, 2147483647])"},
      {{"run", "--tokens", "x"}, "--tokens: must be an integer in [0, 2147483647], got x"},
      {{"run", "--tokens", "4", "--tokens", "8"}, "--tokens: given 2 times; it takes one value"},
      {{"--tokens", "8", "run"}, "moe-ep: unexpected argument '--tokens' before the subcommand"},
      {{"rn"}, "unknown subcommand 'rn' (expected run, bench or plan); did you mean run?"},
      {{}, "a subcommand is required: moe-ep run, moe-ep bench or moe-ep plan"},
  };
  for (const auto& [args, message] : cases) {
    const CommandLine c = parse(args);
    EXPECT_EQ(c.action, CommandLine::Action::kError) << message;
    EXPECT_EQ(c.text.rfind(message, 0), 0u) << c.text;
    EXPECT_EQ(c.text.find('\n'), std::string::npos) << c.text;
  }
}

TEST(CommandLine, HelpAndVersionPrint) {
  CommandLine c = parse({"--version"});
  EXPECT_EQ(c.action, CommandLine::Action::kPrint);
  EXPECT_EQ(c.text, "moe-ep " MOE_EP_TEST_VERSION "\n");
  c = parse({"run", "--help"});
  EXPECT_EQ(c.action, CommandLine::Action::kPrint);
  EXPECT_NE(c.text.find("--warm-repeats"), std::string::npos);
  EXPECT_EQ(c.text.find("--debug-omit-ori-x"), std::string::npos);  // a hidden test hook
}

TEST(CommandLine, ClosestName) {
  const std::vector<std::string> known = {"--tokens",  "--top-k",     "--tp",
                                          "--timeout", "--expert-fn", "--experts"};
  EXPECT_EQ(closest_name("--token", known), "--tokens");
  EXPECT_EQ(closest_name("--tok", known), "--tokens");  // the only name it begins
  EXPECT_EQ(closest_name("--expert_fn", known), "--expert-fn");
  EXPECT_EQ(closest_name("--expret-fn", known), "--expert-fn");  // two letters swapped
  EXPECT_EQ(closest_name("--expert", known), "--experts");
  EXPECT_EQ(closest_name("--t", known), "");  // begins four names
  EXPECT_EQ(closest_name("--x", known), "");  // nothing near
  EXPECT_EQ(closest_name("--banana", known), "");
  EXPECT_EQ(closest_name("--", known), "");
}

TEST(Report, WrapKeepsLinesWithinTheWidthAndBreaksBetweenFields) {
  const std::string text =
      "moe-ep run: preset olmoe  H 2048  E 64  K 8  FFN 1024  dtype bf16  expert-fn swiglu  W 4  "
      "tokens/rank 64 (N 256)  seed 0";
  EXPECT_EQ(wrap(text, 2, 100),
            "moe-ep run: preset olmoe  H 2048  E 64  K 8  FFN 1024  dtype bf16  expert-fn swiglu  "
            "W 4\n  tokens/rank 64 (N 256)  seed 0");
  EXPECT_EQ(wrap("short", 2, 100), "short");
  // A word longer than the line stands alone; "§" counts one column.
  const std::string path(120, 'p');
  EXPECT_EQ(wrap("file " + path + " end", 4, 100), "file\n    " + path + "\n    end");
  // A path marked whole() keeps its spaces unbroken: on its own line when it does not fit.
  const std::string spaced = "/tmp/a path with spaces/" + std::string(90, 'x') + "/f.csv";
  EXPECT_EQ(wrap("counts from " + whole(spaced), 4, 100), "counts from\n    " + spaced);
  EXPECT_EQ(wrap("counts from " + whole("/a b/f.csv") + " end", 4, 100),
            "counts from /a b/f.csv end");
  EXPECT_EQ(unmarked("from " + whole(spaced)), "from " + spaced);
  // 64 columns in 65 bytes: it fits.
  EXPECT_EQ(wrap(std::string(58, 'a') + " §2.3)", 2, 64), std::string(58, 'a') + " §2.3)");
  // In the last third of the line, a break between clauses beats a fuller line.
  EXPECT_EQ(wrap(std::string(50, 'a') + "; bb cc dd ee", 2, 60),
            std::string(50, 'a') + ";\n  bb cc dd ee");
  EXPECT_EQ(wrap_fields({"first", "second", "", "third"}, 2, 13), "first  second\n  third");
}

TEST(Report, SummaryLineSaysWhatRanHowFastAndWhatTheVerdictMeans) {
  Plan p;
  p.layer = *find_preset("olmoe");
  const std::vector<RankStats> stats = {{0, 0.010, 0, 0, 0.020, 0, 0, 0, 0, 0, 0, 0},
                                        {0, 0.012, 0, 0, 0.015, 0, 0, 0, 0, 0, 0, 0}};
  const WarmTimes warm{5, 0.0012, 0.0009};
  CheckResult c;
  c.exact = c.pass = true;
  const std::string layer = "olmoe layer (H 2048, E 64, top-8) on 4 ranks, ";
  EXPECT_EQ(summary_line(p, 4, stats, warm, c),
            "PASS: " + layer +
                "dispatch 1.2 ms + combine 0.9 ms warm; the output equals the dense "
                "single-process reference bitwise");
  // Without warm repeats: the cold calls, max over ranks.
  EXPECT_EQ(summary_line(p, 4, stats, WarmTimes{}, c)
                .rfind("PASS: " + layer + "dispatch 12 ms + combine 20 ms cold;", 0),
            0u);
  c.exact = false;
  c.bounded = true;
  EXPECT_NE(summary_line(p, 4, stats, warm, c).find("; the output is within the bound of"),
            std::string::npos);
  c.bounded = false;
  EXPECT_NE(summary_line(p, 4, stats, warm, c).find("; the output is within the tolerance of"),
            std::string::npos);
  c.pass = false;
  EXPECT_EQ(summary_line(p, 1, stats, warm, c),
            "FAIL: olmoe layer (H 2048, E 64, top-8) on 1 rank, dispatch 1.2 ms + combine 0.9 ms "
            "warm; the output differs from the dense single-process reference (check above)");
  const std::vector<double> dispatch = {3, 1, 2, 1, 5, 1}, combine = {1, 1, 1, 4, 4, 4};
  const WarmTimes w = median_of_max(dispatch, combine, 3);  // 2 ranks x 3 repeats
  EXPECT_EQ(w.n, 3);
  EXPECT_EQ(w.dispatch_s, 3);  // max over ranks 3, 5, 2: median 3
  EXPECT_EQ(w.combine_s, 4);
}

// The progress lines of a run: every phase with `on`, a phase that outlasts the wait with
// `auto`, none with `off` or on other ranks than 0.
TEST(Progress, PrintsPhasesByMode) {
  auto lines = [](Progress::Mode mode, bool active, double after_s, double phase_s) {
    std::FILE* f = std::tmpfile();
    {
      Progress p(mode, active, "moe-ep run", after_s, f);
      p.phase("first");
      std::this_thread::sleep_for(std::chrono::duration<double>(phase_s));
      p.phase("second");
      p.done();
    }
    std::rewind(f);
    std::string text;
    for (int c; (c = std::fgetc(f)) != EOF;) text += static_cast<char>(c);
    std::fclose(f);
    return text;
  };
  const std::string on = lines(Progress::Mode::kOn, true, 10, 0);
  EXPECT_NE(on.find("moe-ep run: [0.0 s] first ...\n"), std::string::npos) << on;
  EXPECT_NE(on.find("] second ...\n"), std::string::npos) << on;
  const std::string slow = lines(Progress::Mode::kAuto, true, 0.05, 0.5);
  EXPECT_NE(slow.find("] first ...\n"), std::string::npos) << slow;
  EXPECT_EQ(lines(Progress::Mode::kAuto, true, 30, 0.05), "");
  EXPECT_EQ(lines(Progress::Mode::kOff, true, 0, 0.1), "");
  EXPECT_EQ(lines(Progress::Mode::kOn, false, 0, 0), "");
  EXPECT_EQ(Progress::parse("on"), Progress::Mode::kOn);
  EXPECT_EQ(Progress::parse("off"), Progress::Mode::kOff);
  EXPECT_EQ(Progress::parse("auto"), Progress::Mode::kAuto);
}

}  // namespace
}  // namespace moe_ep_tool
