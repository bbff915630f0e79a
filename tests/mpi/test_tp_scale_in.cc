// elastic_info scale-in (SPEC §1.7) together with tp_world_size 2 is not implemented: dispatch_v2
// raises Error(kUnsupported) on every rank of both EP groups, at once (no rank is left waiting),
// and the communicators still work afterwards. Needs 4 ranks (two EP groups of 2, TP pairs of the
// same EP rank); skipped otherwise.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <memory>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "mpi/common.h"

namespace moe_ep {
namespace {

TEST(TpScaleIn, IsUnsupportedOnEveryRank) {
  int rank = 0, n = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (n != 4) GTEST_SKIP() << "needs 4 ranks";
  const int W = 2, ep_rank = rank / 2, tp_rank = rank % 2;
  MPI_Comm ep = MPI_COMM_NULL, tp = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, tp_rank, ep_rank, &ep);
  MPI_Comm_split(MPI_COMM_WORLD, ep_rank, tp_rank, &tp);
  CommOptions o;
  o.timeout_s = 120;  // a rank left behind would show as a long wait, checked below
  auto ep_comm = Communicator::from_mpi(ep, o);
  auto tp_comm = Communicator::from_mpi(tp, o);
  MPI_Comm_free(&ep);
  MPI_Comm_free(&tp);

  EpConfig cfg;
  cfg.group_ep = ep_comm.get();
  cfg.ep_world_size = W;
  cfg.ep_rank_id = ep_rank;
  cfg.moe_expert_num = W;  // L = 1, as TP requires
  cfg.group_tp = tp_comm.get();
  cfg.tp_world_size = 2;
  cfg.tp_rank_id = tp_rank;
  std::vector<uint16_t> x(2 * 8, 0x3f80);  // bf16 1.0
  std::vector<int32_t> ids = {0, 1};
  DispatchInputs in;
  in.x = TensorView::contiguous(x.data(), DType::kBF16, {2, 8});
  in.expert_ids = TensorView::contiguous(ids.data(), DType::kI32, {2, 1});
  // Old EP rank 1 removed: [is_scaled_down, new W, new S, new E, old->new x W, new->old x W].
  std::vector<int32_t> table = {1, 1, 0, 1, 0, -1, 0, -1};
  in.elastic_info = TensorView::contiguous(table.data(), DType::kI32, {4 + 2 * W});
  const auto start = std::chrono::steady_clock::now();
  test::expect_collective_error(
      [&] { dispatch_v2(in, cfg); }, rank, -1, ErrorKind::kUnsupported,
      {"dispatch_v2: elastic_info scale-in (is_scaled_down = 1) with tp_world_size = 2 is not "
       "supported by this build"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));

  // Without the scale-in the same TP call works: every rank receives the rows sent to its
  // expert, its own and its TP peer's.
  in.elastic_info.reset();
  const DispatchOutputs d = dispatch_v2(in, cfg);
  ASSERT_EQ(d.tp_recv_counts.numel(), 2);
  // Each EP group sends 2 ranks x 2 tokens, one per expert: 2 rows to each expert per group.
  EXPECT_EQ(d.tp_recv_counts.ptr<int32_t>()[0], 2);
  EXPECT_EQ(d.tp_recv_counts.ptr<int32_t>()[1], 2);

  // combine_v2 of those rows with the scale-in: the same error on every rank, then without it the
  // pair's partial outputs (the rows themselves on both TP ranks) sum to 2x each token's row.
  std::vector<float> weights = {1.0f, 1.0f};
  CombineInputs cin;
  cin.expand_x = d.expand_x;
  cin.expert_ids = in.expert_ids;
  cin.assist_info_for_combine = d.assist_info_for_combine;
  cin.ep_send_counts = d.ep_recv_counts;
  cin.tp_send_counts = d.tp_recv_counts;
  cin.expert_scales = TensorView::contiguous(weights.data(), DType::kF32, {2, 1});
  cin.elastic_info = in.elastic_info =
      TensorView::contiguous(table.data(), DType::kI32, {4 + 2 * W});
  test::expect_collective_error(
      [&] { combine_v2(cin, cfg); }, rank, -1, ErrorKind::kUnsupported,
      {"combine_v2: elastic_info scale-in (is_scaled_down = 1) with tp_world_size = 2 is not "
       "supported by this build"});
  cin.elastic_info.reset();
  const Tensor y = combine_v2(cin, cfg);
  ASSERT_EQ(y.size(0), 2);
  for (int64_t i = 0; i < 2 * 8; ++i) EXPECT_EQ(y.ptr<uint16_t>()[i], 0x4000) << i;  // bf16 2.0
}

}  // namespace
}  // namespace moe_ep
