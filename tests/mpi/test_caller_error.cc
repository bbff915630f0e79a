// DispatchInputs/CombineInputs::caller_error: an argument error a caller (a binding) found before
// the call travels through the op's header agreement like the op's own checks: the rank that set
// it throws it, every other rank throws kRemote naming that rank, and nobody waits for the
// deadline. Afterwards the communicator still works.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <memory>
#include <string>

#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "mpi/common.h"

namespace moe_ep {
namespace {

// A long deadline: a rank that left without the agreement would make the others wait for it.
std::shared_ptr<Communicator> comm() {
  static std::shared_ptr<Communicator> c = [] {
    CommOptions o;
    o.timeout_s = 120;
    return Communicator::from_mpi(MPI_COMM_WORLD, o);
  }();
  return c;
}

EpConfig config() {
  EpConfig cfg;
  cfg.group_ep = comm().get();
  cfg.ep_world_size = comm()->size();
  cfg.ep_rank_id = comm()->rank();
  cfg.moe_expert_num = 2 * comm()->size();
  return cfg;
}

struct Batch {
  Tensor x, ids, scales;
};

Batch batch() {
  const int64_t BS = 3, H = 8, K = 2, E = 2 * comm()->size();
  Batch b{Tensor::zeros(DType::kF32, {BS, H}), Tensor::empty(DType::kI32, {BS, K}),
          Tensor::empty(DType::kF32, {BS, K})};
  for (int64_t i = 0; i < BS * H; ++i) b.x.ptr<float>()[i] = static_cast<float>(i % 7) - 3.0f;
  for (int64_t i = 0; i < BS; ++i)
    for (int64_t k = 0; k < K; ++k) {
      b.ids.ptr<int32_t>()[i * K + k] = static_cast<int32_t>((i + k) % E);
      b.scales.ptr<float>()[i * K + k] = 0.5f;
    }
  return b;
}

// combine_v2's inputs for the rows dispatch_v2 returned for batch b (identity experts).
CombineInputs combine_inputs(const DispatchOutputs& d, const Batch& b) {
  CombineInputs cin;
  cin.expand_x = d.expand_x;
  cin.expert_ids = b.ids;
  cin.assist_info_for_combine = d.assist_info_for_combine;
  cin.ep_send_counts = d.ep_recv_counts;
  cin.expert_scales = b.scales;
  return cin;
}

const char* kMessage = "from_dlpack: x dtype (code 2, bits 64) is not supported";

TEST(CallerError, DispatchReportsItLikeItsOwnChecks) {
  const int rank = comm()->rank(), bad = comm()->size() - 1;
  const Batch b = batch();
  DispatchInputs in;
  in.x = b.x;
  in.expert_ids = b.ids;
  if (rank == bad) {
    in = DispatchInputs{};  // the binding could not convert the tensors: nothing else is set
    in.caller_error = Error(ErrorKind::kUnsupported, kMessage);
  }
  const auto start = std::chrono::steady_clock::now();
  test::expect_collective_error([&] { dispatch_v2(in, config()); }, rank, bad,
                                ErrorKind::kUnsupported, {kMessage});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  // Still in step: a full round trip works.
  DispatchInputs good;
  good.x = b.x;
  good.expert_ids = b.ids;
  const DispatchOutputs d = dispatch_v2(good, config());
  CombineInputs cin = combine_inputs(d, b);
  const Tensor y = combine_v2(cin, config());
  // x times the two weights of 0.5 (the identity experts): x itself, exactly.
  for (int64_t i = 0; i < b.x.numel(); ++i) EXPECT_EQ(y.ptr<float>()[i], b.x.ptr<float>()[i]);
}

TEST(CallerError, CombineReportsItLikeItsOwnChecks) {
  const int rank = comm()->rank(), bad = 0;
  const Batch b = batch();
  DispatchInputs din;
  din.x = b.x;
  din.expert_ids = b.ids;
  const DispatchOutputs d = dispatch_v2(din, config());
  CombineInputs cin = combine_inputs(d, b);
  if (rank == bad) {
    cin = CombineInputs{};
    cin.caller_error = Error(ErrorKind::kInvalidArgument, "combine_v2: expand_x is not a tensor");
  }
  const auto start = std::chrono::steady_clock::now();
  test::expect_collective_error([&] { combine_v2(cin, config()); }, rank, bad,
                                ErrorKind::kInvalidArgument,
                                {"combine_v2: expand_x is not a tensor"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

}  // namespace
}  // namespace moe_ep
