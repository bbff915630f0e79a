// SPEC §5 without a mesh: the strategy table (compared with the SPEC's table row by row), the
// PyTorch DTensor (torch.chunk) shard ranges, the redistribution cost (hand-computed) and the
// selection rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "moe_ep/error.h"
#include "moe_ep/sharding.h"

namespace moe_ep {
namespace {

// "R" / "Shard(1)" / "Partial" / "-" as in the SPEC's table.
std::string cell(const std::optional<Placement>& p) {
  if (!p) return "-";
  if (p->is_replicate()) return "R";
  if (p->is_partial()) return "Partial";
  return p->to_string();
}

std::string row(const Strategy& s) {
  std::string out = s.name + " |";
  for (std::size_t i = 0; i < s.inputs.size(); ++i)
    out += (i ? ", " : " ") + s.inputs[i].name + " " + cell(s.inputs[i].placement);
  out += " |";
  for (std::size_t i = 0; i < s.outputs.size(); ++i)
    out += (i ? ", " : " ") + s.outputs[i].name + " " + cell(s.outputs[i].placement);
  return out;
}

std::vector<std::string> rows(ShardedOp op, bool probs, bool permuted = true) {
  std::vector<std::string> r;
  for (const Strategy& s : strategies(op, probs, permuted)) r.push_back(row(s));
  return r;
}

using V = std::vector<std::string>;

TEST(ShardingRules, TableMatchesSpecSection5) {
  for (bool probs : {true, false}) {
    EXPECT_EQ(rows(ShardedOp::kPermute, probs),
              (V{"R | tokens R, indices R | permuted_tokens R, sorted_indices R",
                 "S | tokens Shard(1), indices R | permuted_tokens Shard(1), sorted_indices R"}));
    EXPECT_EQ(rows(ShardedOp::kPermuteGrad, probs),
              (V{"R | tokens R, grad_permuted_tokens R, indices R, sorted_indices R | "
                 "grad_tokens R",
                 "S | tokens Shard(1), grad_permuted_tokens Shard(1), indices R, sorted_indices R "
                 "| grad_tokens Shard(1)"}));
    EXPECT_EQ(rows(ShardedOp::kPermuteGradV2, probs),
              (V{"R | grad_permuted_tokens R, sorted_indices R | grad_tokens R",
                 "S | grad_permuted_tokens Shard(1), sorted_indices R | grad_tokens Shard(1)"}));
  }
  EXPECT_EQ(rows(ShardedOp::kUnpermute, true),
            (V{"R | permuted_tokens R, sorted_indices R, probs R | out R",
               "S | permuted_tokens Shard(1), sorted_indices R, probs R | out Shard(1)"}));
  EXPECT_EQ(rows(ShardedOp::kUnpermute, false),
            (V{"R | permuted_tokens R, sorted_indices R, probs - | out R",
               "S | permuted_tokens Shard(1), sorted_indices R, probs - | out Shard(1)"}));
  EXPECT_EQ(rows(ShardedOp::kUnpermuteWithSaved, true),
            (V{"R | permuted_tokens R, sorted_indices R, probs R | out R, "
               "permuted_tokens_for_backward R",
               "S | permuted_tokens Shard(1), sorted_indices R, probs R | out Shard(1), "
               "permuted_tokens_for_backward Shard(1)"}));
  EXPECT_EQ(rows(ShardedOp::kUnpermuteGrad, true),
            (V{"R | permuted_tokens R, grad_out R, sorted_indices R, probs R | "
               "grad_permuted_tokens R, grad_probs R",
               "S | permuted_tokens Shard(1), grad_out Shard(1), sorted_indices R, probs R | "
               "grad_permuted_tokens Shard(1), grad_probs Partial"}));
  // SPEC §5 Decision: without probs grad_probs is "-" in both strategies (not Partial).
  EXPECT_EQ(rows(ShardedOp::kUnpermuteGrad, false),
            (V{"R | permuted_tokens R, grad_out R, sorted_indices R, probs - | "
               "grad_permuted_tokens R, grad_probs -",
               "S | permuted_tokens Shard(1), grad_out Shard(1), sorted_indices R, probs - | "
               "grad_permuted_tokens Shard(1), grad_probs -"}));
  EXPECT_EQ(rows(ShardedOp::kUnpermuteGradV2, true),
            (V{"R | grad_out R, sorted_indices R, probs R, permuted_tokens R | "
               "grad_permuted_tokens R, grad_probs R",
               "S | grad_out Shard(1), sorted_indices R, probs R, permuted_tokens Shard(1) | "
               "grad_permuted_tokens Shard(1), grad_probs Partial"}));
  EXPECT_EQ(rows(ShardedOp::kUnpermuteGradV2, false, false),
            (V{"R | grad_out R, sorted_indices R, probs -, permuted_tokens - | "
               "grad_permuted_tokens R, grad_probs -",
               "S | grad_out Shard(1), sorted_indices R, probs -, permuted_tokens - | "
               "grad_permuted_tokens Shard(1), grad_probs -"}));
  EXPECT_EQ(rows(ShardedOp::kUnpermuteGradV2, false, true)[1],
            "S | grad_out Shard(1), sorted_indices R, probs -, permuted_tokens Shard(1) | "
            "grad_permuted_tokens Shard(1), grad_probs -");
}

TEST(ShardingRules, ShapeOnlyArguments) {
  auto read = [](ShardedOp op, bool probs, const std::string& name) {
    const std::vector<Strategy> all = strategies(op, probs);
    for (const ArgPlacement& a : all[1].inputs)
      if (a.name == name) return a.data_read;
    ADD_FAILURE() << name;
    return true;
  };
  EXPECT_FALSE(read(ShardedOp::kPermuteGrad, false, "tokens"));
  EXPECT_TRUE(read(ShardedOp::kPermuteGrad, false, "grad_permuted_tokens"));
  EXPECT_FALSE(read(ShardedOp::kUnpermuteGrad, false, "permuted_tokens"));
  EXPECT_TRUE(read(ShardedOp::kUnpermuteGrad, true, "permuted_tokens"));
  EXPECT_FALSE(read(ShardedOp::kUnpermuteGradV2, false, "permuted_tokens"));
  EXPECT_TRUE(read(ShardedOp::kUnpermuteGradV2, true, "permuted_tokens"));
}

TEST(ShardingRules, UnpermuteGradV2NeedsPermutedTokensWithProbs) {
  try {
    strategies(ShardedOp::kUnpermuteGradV2, true, false);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("permuted_tokens is required when probs is given"),
              std::string::npos)
        << e.what();
  }
}

TEST(ShardingRules, OpNamesAndPlacementNames) {
  EXPECT_STREQ(op_name(ShardedOp::kUnpermuteWithSaved), "unpermute_with_saved");
  EXPECT_STREQ(op_name(ShardedOp::kPermuteGradV2), "permute_grad_v2");
  EXPECT_EQ(Replicate().to_string(), "Replicate");
  EXPECT_EQ(Shard(1).to_string(), "Shard(1)");
  EXPECT_EQ(Partial().to_string(), "Partial(sum)");
  EXPECT_TRUE(Shard(1) == Shard(1));
  EXPECT_FALSE(Shard(0) == Shard(1));
  EXPECT_FALSE(Replicate() == Partial());
}

std::vector<ShardRange> ranges(int64_t size, int n) {
  std::vector<ShardRange> r;
  for (int i = 0; i < n; ++i) r.push_back(shard_range(size, n, i));
  return r;
}

// PyTorch's Shard.local_shard_size_and_offset (torch/distributed/tensor/placement_types.py),
// transcribed: the reference the shard ranges must equal.
ShardRange torch_chunk(int64_t size, int n, int rank) {
  if (size % n == 0) return {size / n * rank, size / n};
  const int64_t full_chunk_size = (size + n - 1) / n;
  const int64_t start = full_chunk_size * rank;
  if (size < start) return {size, 0};
  return {start, std::min(size, start + full_chunk_size) - start};
}

TEST(ShardingRules, ShardRangesSplitLikePyTorchDTensor) {
  auto lens = [](int64_t size, int n) {
    std::vector<int64_t> out;
    int64_t next = 0;
    for (const ShardRange& r : ranges(size, n)) {
      EXPECT_EQ(r.offset, next) << size << "/" << n;  // contiguous, in rank order
      next += r.length;
      out.push_back(r.length);
    }
    EXPECT_EQ(next, size);
    return out;
  };
  // torch.chunk, as PyTorch DTensor's Shard (numpy.array_split would give 3,3,2,2 / 334,333,333
  // / 2,1,1,1 / 2,2,1,1).
  EXPECT_EQ(lens(10, 4), (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(lens(1000, 3), (std::vector<int64_t>{334, 334, 332}));  // the issue's acceptance
  EXPECT_EQ(lens(5, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(lens(3, 4), (std::vector<int64_t>{1, 1, 1, 0}));
  EXPECT_EQ(lens(6, 4), (std::vector<int64_t>{2, 2, 2, 0}));  // torch.chunk makes 3 chunks
  EXPECT_EQ(lens(7, 4), (std::vector<int64_t>{2, 2, 2, 1}));
  EXPECT_EQ(lens(9, 4), (std::vector<int64_t>{3, 3, 3, 0}));
  EXPECT_EQ(lens(12, 4), (std::vector<int64_t>{3, 3, 3, 3}));
  EXPECT_EQ(lens(2, 3), (std::vector<int64_t>{1, 1, 0}));
  EXPECT_EQ(lens(1, 4), (std::vector<int64_t>{1, 0, 0, 0}));
  EXPECT_EQ(lens(0, 2), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(lens(0, 1), (std::vector<int64_t>{0}));
  EXPECT_EQ(lens(5, 1), (std::vector<int64_t>{5}));
  // Empty pieces sit at the end (offset = size), as PyTorch's.
  EXPECT_EQ(shard_range(2, 3, 2).offset, 2);
  EXPECT_EQ(shard_range(5, 4, 3).offset, 5);
  EXPECT_EQ(shard_range(10, 4, 3).offset, 9);
  EXPECT_EQ(shard_range(1000, 3, 2).offset, 668);
  // Against the transcription of PyTorch's formula, exhaustively for small sizes and meshes.
  for (int n = 1; n <= 9; ++n)
    for (int64_t size = 0; size <= 40; ++size)
      for (int r = 0; r < n; ++r) {
        const ShardRange got = shard_range(size, n, r), want = torch_chunk(size, n, r);
        EXPECT_EQ(got.offset, want.offset) << size << " on " << n << ", rank " << r;
        EXPECT_EQ(got.length, want.length) << size << " on " << n << ", rank " << r;
      }
  // No overflow near the int64 limit.
  const int64_t big = std::numeric_limits<int64_t>::max();
  int64_t total = 0;
  for (const ShardRange& r : ranges(big, 3)) {
    EXPECT_GE(r.length, 0);
    EXPECT_LE(r.offset, big - r.length);
    total += r.length;
  }
  EXPECT_EQ(total, big);
  EXPECT_EQ(shard_range(big, 2, 1).length, big / 2);
}

void expect_invalid(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error, expected: " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(ShardingRules, LocalShapesAndTheirErrors) {
  EXPECT_EQ(local_shape({4, 10}, Shard(1), 4, 3), (std::vector<int64_t>{4, 1}));
  EXPECT_EQ(local_shape({4, 5}, Shard(1), 4, 3), (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(local_shape({3, 8}, Shard(0), 4, 3), (std::vector<int64_t>{0, 8}));
  EXPECT_EQ(local_shape({10, 4}, Shard(0), 4, 0), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(local_shape({4, 10}, Replicate(), 4, 3), (std::vector<int64_t>{4, 10}));
  EXPECT_EQ(local_shape({4, 10}, Partial(), 4, 3), (std::vector<int64_t>{4, 10}));
  expect_invalid(
      [] {
        local_shape({4, 10}, Shard(2), 2, 0);
      },
      "local_shape: placement Shard(2) is outside dims [0, 2) of the 2-D tensor");
  expect_invalid([] { local_shape({4, -1}, Replicate(), 2, 0); }, "global_shape[1] = -1");
  expect_invalid([] { shard_range(4, 0, 0); }, "mesh_size = 0 must be >= 1");
  expect_invalid([] { shard_range(4, 2, 2); }, "rank = 2 is outside [0, 2)");
}

TEST(ShardingRules, DistributeIsAViewOfTheFullTensor) {
  Tensor full = Tensor::zeros(DType::kF32, {4, 10});
  const DTensor d = distribute(full.view(), Shard(1), 4, 2);
  EXPECT_EQ(d.local.shape[0], 4);
  EXPECT_EQ(d.local.shape[1], 3);  // columns 6..8 (torch.chunk: 3, 3, 3, 1)
  EXPECT_EQ(d.local.strides[0], 10);
  EXPECT_EQ(d.local.data, full.ptr<float>() + 6);
  const DTensor last = distribute(full.view(), Shard(1), 4, 3);
  EXPECT_EQ(last.local.shape[1], 1);
  EXPECT_EQ(last.local.data, full.ptr<float>() + 9);
  // An empty trailing piece (5 columns on 4 ranks: 2, 2, 1, 0).
  Tensor narrow = Tensor::zeros(DType::kF32, {4, 5});
  const DTensor empty = distribute(narrow.view(), Shard(1), 4, 3);
  EXPECT_EQ(empty.local.shape[0], 4);
  EXPECT_EQ(empty.local.shape[1], 0);
  EXPECT_EQ(empty.local.numel(), 0);
  EXPECT_EQ(d.global_shape, (std::vector<int64_t>{4, 10}));
  expect_invalid([&] { distribute(full.view(), Shard(2), 4, 0); },
                 "distribute: placement Shard(2) is outside dims [0, 2)");
}

TensorSpec spec(std::vector<int64_t> shape, DType dt, Placement p,
                std::optional<DType> local = std::nullopt) {
  return {std::move(shape), dt, p, local};
}

TEST(ShardingRules, RedistributeCostIsTheMostBytesARankReceives) {
  // All-gather: the whole tensor minus the smallest shard (10 on 4: 3, 3, 3, 1; 5 on 4: 2, 2, 1,
  // 0, so rank 3 receives everything).
  EXPECT_EQ(redistribute_cost(spec({8, 10}, DType::kF32, Shard(0)), Replicate(), 4), 60 * 4);
  EXPECT_EQ(redistribute_cost(spec({10, 10}, DType::kBF16, Shard(0)), Replicate(), 4), 90 * 2);
  EXPECT_EQ(redistribute_cost(spec({10, 10}, DType::kBF16, Shard(1)), Replicate(), 4), 90 * 2);
  EXPECT_EQ(redistribute_cost(spec({3, 5}, DType::kF32, Shard(1)), Replicate(), 4), 15 * 4);
  EXPECT_EQ(redistribute_cost(spec({1000}, DType::kF32, Shard(0)), Replicate(), 3), 668 * 4);
  // All-to-all: the target piece minus what the rank holds.
  EXPECT_EQ(redistribute_cost(spec({8, 12}, DType::kF32, Shard(0)), Shard(1), 4), (24 - 6) * 4);
  EXPECT_EQ(redistribute_cost(spec({8, 12}, DType::kF32, Shard(1)), Shard(0), 4), (24 - 6) * 4);
  // Uneven: (5, 10) Shard(0) -> Shard(1) on 4: rows 2, 2, 1, 0, columns 3, 3, 3, 1. Rank 0..2
  // receive 5x3 minus their rows x 3 (at most 15 - 3 = 12); rank 3 (no rows) 5x1 = 5.
  EXPECT_EQ(redistribute_cost(spec({5, 10}, DType::kF32, Shard(0)), Shard(1), 4), 12 * 4);
  // Reduce-scatter: n-1 pieces of the largest target (cols 4, 4, 2), in the local dtype.
  EXPECT_EQ(redistribute_cost(spec({6, 10}, DType::kBF16, Partial(), DType::kF32), Shard(1), 3),
            2 * 24 * 4);
  // All-reduce: reduce-scatter of 20 elements (fp32 pieces), all-gather of 40 (bf16).
  EXPECT_EQ(redistribute_cost(spec({6, 10}, DType::kBF16, Partial(), DType::kF32), Replicate(), 3),
            2 * 20 * 4 + 40 * 2);
  // Free: a local slice, no change, one rank.
  EXPECT_EQ(redistribute_cost(spec({8, 12}, DType::kF32, Replicate()), Shard(1), 4), 0);
  EXPECT_EQ(redistribute_cost(spec({8, 12}, DType::kF32, Shard(1)), Shard(1), 4), 0);
  EXPECT_EQ(redistribute_cost(spec({8, 12}, DType::kF32, Shard(1)), Replicate(), 1), 0);
  EXPECT_EQ(redistribute_cost(spec({8, 12}, DType::kF32, Partial()), Partial(), 4), 0);
  try {
    redistribute_cost(spec({8, 12}, DType::kF32, Replicate()), Partial(), 4);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
  }
  expect_invalid(
      [] {
        redistribute_cost(spec({8, 12}, DType::kF32, Shard(2)), Replicate(), 2);
      },
      "placement Shard(2) is outside dims [0, 2)");
  expect_invalid(
      [] {
        redistribute_cost(spec({8, 12}, DType::kF32, Shard(0)), Replicate(), 0);
      },
      "mesh_size = 0");
}

TEST(ShardingRules, SelectionTakesTheCheaperStrategyTiesGoToR) {
  const auto bf = DType::kBF16;
  // All Replicate: both strategies cost 0 (Replicate -> Shard(1) is a local slice): R.
  StrategyChoice c = select_strategy(ShardedOp::kPermute,
                                     {{"tokens", spec({8, 12}, bf, Replicate())},
                                      {"indices", spec({8, 2}, DType::kI32, Replicate())}},
                                     4);
  EXPECT_EQ(c.index, 0);
  EXPECT_EQ(c.strategy.name, "R");
  EXPECT_TRUE(c.redistributions.empty());
  // tokens Shard(0): R gathers 6 rows x 12 (144 B), S moves 6 rows x 3 (36 B): S.
  c = select_strategy(ShardedOp::kPermute,
                      {{"tokens", spec({8, 12}, bf, Shard(0))},
                       {"indices", spec({8, 2}, DType::kI32, Replicate())}},
                      4);
  EXPECT_EQ(c.strategy.name, "S");
  ASSERT_EQ(c.redistributions.size(), 1u);
  EXPECT_EQ(c.redistributions[0].arg, "tokens");
  EXPECT_EQ(c.redistributions[0].from, Shard(0));
  EXPECT_EQ(c.redistributions[0].to, Shard(1));
  EXPECT_EQ(c.redistributions[0].recv_bytes, 36);
  EXPECT_EQ(c.cost_bytes, 36);
  // tokens Shard(1): S is free.
  c = select_strategy(ShardedOp::kPermute,
                      {{"tokens", spec({8, 12}, bf, Shard(1))},
                       {"indices", spec({8, 2}, DType::kI32, Replicate())}},
                      4);
  EXPECT_EQ(c.index, 1);
  EXPECT_EQ(c.cost_bytes, 0);
  // indices sharded: both strategies gather them, a tie: R.
  c = select_strategy(ShardedOp::kPermute,
                      {{"tokens", spec({8, 12}, bf, Replicate())},
                       {"indices", spec({8, 2}, DType::kI32, Shard(0))}},
                      4);
  EXPECT_EQ(c.index, 0);
  ASSERT_EQ(c.redistributions.size(), 1u);
  EXPECT_EQ(c.redistributions[0].arg, "indices");
  EXPECT_EQ(c.cost_bytes, 6 * 2 * 4);
  // One rank: everything is free, R.
  c = select_strategy(ShardedOp::kPermute,
                      {{"tokens", spec({8, 12}, bf, Shard(1))},
                       {"indices", spec({8, 2}, DType::kI32, Replicate())}},
                      1);
  EXPECT_EQ(c.index, 0);
}

TEST(ShardingRules, ShapeOnlyArgumentsCostNothing) {
  // permute_grad reads only tokens' shape: tokens Shard(0) does not pull towards R.
  const StrategyChoice c =
      select_strategy(ShardedOp::kPermuteGrad,
                      {{"tokens", spec({8, 12}, DType::kF32, Shard(0))},
                       {"grad_permuted_tokens", spec({16, 12}, DType::kF32, Shard(1))},
                       {"indices", spec({8, 2}, DType::kI32, Replicate())},
                       {"sorted_indices", spec({16}, DType::kI32, Replicate())}},
                      4);
  EXPECT_EQ(c.index, 1);
  EXPECT_TRUE(c.redistributions.empty());
}

TEST(ShardingRules, PartialInputsPreferReduceScatter) {
  // grad_out Partial: reduce-scatter to Shard(1) is cheaper than the all-reduce R needs.
  const StrategyChoice c =
      select_strategy(ShardedOp::kUnpermuteGrad,
                      {{"permuted_tokens", spec({16, 12}, DType::kF32, Replicate())},
                       {"grad_out", spec({8, 12}, DType::kF32, Partial())},
                       {"sorted_indices", spec({16}, DType::kI32, Replicate())},
                       {"probs", spec({8, 2}, DType::kF32, Replicate())}},
                      4);
  EXPECT_EQ(c.strategy.name, "S");
  ASSERT_EQ(c.redistributions.size(), 2u);
  EXPECT_EQ(c.redistributions[0].arg, "permuted_tokens");  // a local slice: listed, free
  EXPECT_EQ(c.redistributions[0].recv_bytes, 0);
  EXPECT_EQ(c.redistributions[1].arg, "grad_out");
  EXPECT_EQ(c.redistributions[1].to, Shard(1));
  EXPECT_EQ(c.cost_bytes, 3 * 8 * 3 * 4);
}

TEST(ShardingRules, SelectionRejectsUnknownAndMissingArguments) {
  expect_invalid(
      [] {
        select_strategy(ShardedOp::kPermute,
                        {{"tokens", spec({8, 12}, DType::kF32, Replicate())},
                         {"indices", spec({8}, DType::kI32, Replicate())},
                         {"probs", spec({8, 1}, DType::kF32, Replicate())}},
                        2);
      },
      "permute: select_strategy: unknown argument 'probs'");
  expect_invalid(
      [] {
        select_strategy(ShardedOp::kUnpermute,
                        {{"permuted_tokens", spec({8, 12}, DType::kF32, Replicate())}}, 2);
      },
      "unpermute: select_strategy: argument 'sorted_indices' is missing");
}

}  // namespace
}  // namespace moe_ep
