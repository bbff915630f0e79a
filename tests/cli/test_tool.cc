// Unit tests of the moe-ep tool's pure parts: safetensors I/O, the batch files, token splitting,
// the real-routing data mapping, routing determinism and the scoring rules.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>

#include "batch.h"
#include "moe_ep/error.h"
#include "numeric.h"
#include "presets.h"
#include "rng.h"
#include "routing.h"
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

TEST(Numeric, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  EXPECT_EQ(f16_to_f32(f32_to_f16(0.333333f)),
            static_cast<float>(static_cast<_Float16>(0.333333f)));
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
  write_raw("{not json", 0);
  expect_error("JSON");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    const uint64_t n = 1000;
    out.write(reinterpret_cast<const char*>(&n), 8);
  }
  expect_error("exceeds the file size");
  std::filesystem::remove(path);
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

}  // namespace
}  // namespace moe_ep_tool
