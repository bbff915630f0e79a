// Inputs the libFuzzer target fuzz_dispatch (tests/fuzz, one rank) found to reach undefined
// behaviour, as tests of the fixed behaviour at every world size. The crashing inputs are in
// tests/fuzz/corpus/dispatch/ too (finding-*).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moe_ep/backward.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/tensor.h"

namespace moe_ep {
namespace {

std::shared_ptr<Communicator> comm() {
  static std::shared_ptr<Communicator> c = Communicator::from_mpi(MPI_COMM_WORLD);
  return c;
}

// fuzz_dispatch, UBSan "applying non-zero offset 4 to null pointer" in Dispatch::x_row: x of
// H = 0 has no elements, so its data may be null, but its rows were still addressed from it (with
// strides [1, 1], which torch.empty(BS, 0) has). Dispatch and combine move rows of no bytes.
TEST(FuzzFindings, RowsOfNoBytesFromAnXWithoutData) {
  const int64_t W = comm()->size(), r = comm()->rank(), BS = 3, K = 1;
  std::vector<int32_t> ids(BS * K);
  std::vector<float> scales(BS * K, 1.0f);
  for (int64_t i = 0; i < BS; ++i) ids[i] = static_cast<int32_t>((r + i) % W);
  int64_t expected_rows = 0;  // tokens (s, i) of every rank s routed to expert r
  for (int64_t s = 0; s < W; ++s)
    for (int64_t i = 0; i < BS; ++i) expected_rows += (s + i) % W == r;
  for (const char* transport : {"shm", "mpi"}) {
    SCOPED_TRACE(transport);
    EpConfig cfg;
    cfg.group_ep = comm().get();
    cfg.ep_world_size = W;
    cfg.ep_rank_id = r;
    cfg.moe_expert_num = W;
    cfg.transport = transport;
    DispatchInputs in;
    in.x.dtype = DType::kF32;
    in.x.ndim = 2;
    in.x.shape = {BS, 0};
    in.x.strides = {1, 1};
    in.expert_ids = TensorView::contiguous(ids.data(), DType::kI32, {BS, K});
    in.expert_scales = TensorView::contiguous(scales.data(), DType::kF32, {BS, K});
    const DispatchOutputs out = dispatch_v2(in, cfg);
    ASSERT_EQ(out.expand_x.size(1), 0);
    EXPECT_EQ(out.ep_recv_counts.ptr<int32_t>()[W - 1], expected_rows);
    // fuzz_dispatch, UBSan "null pointer passed as argument 1" (memcpy): the caller's expand_x
    // of H = 0 without data, into which the shm transport copied the valid rows' 0 bytes.
    DispatchBuffers buffers;
    buffers.expand_x = TensorView::contiguous(nullptr, DType::kF32, {out.expand_x.size(0), 0});
    in.out = &buffers;
    const DispatchOutputs into = dispatch_v2(in, cfg);
    EXPECT_EQ(into.expand_x.size(0), out.expand_x.size(0));
    EXPECT_EQ(into.ep_recv_counts.ptr<int32_t>()[W - 1], expected_rows);
    in.out = nullptr;
    CombineInputs c;
    c.expand_x = out.expand_x;
    c.expert_ids = in.expert_ids;
    c.assist_info_for_combine = out.assist_info_for_combine;
    c.ep_send_counts = out.ep_recv_counts;
    c.expert_scales = *in.expert_scales;
    const Tensor y = combine_v2(c, cfg);
    EXPECT_EQ(y.size(0), BS);
    EXPECT_EQ(y.size(1), 0);
    // fuzz_dispatch, UBSan "applying non-zero offset 2 to null pointer" in shared_row: a
    // shared_expert_x of H = 0 without data, its rows addressed from null.
    TensorView shared;
    shared.dtype = DType::kF32;
    shared.ndim = 2;
    shared.shape = {BS, 0};
    shared.strides = {1, 1};
    c.shared_expert_x = shared;
    EXPECT_EQ(combine_v2(c, cfg).size(0), BS);
    // fuzz_dispatch, UBSan "null pointer passed as argument 1" (memset in sum_rows): the caller's
    // output of H = 0 without data, each token's 0 bytes zeroed at null.
    c.out = TensorView::contiguous(nullptr, DType::kF32, {BS, 0});
    EXPECT_EQ(combine_v2(c, cfg).size(0), BS);
  }
}

// fuzz_dispatch, UBSan "null pointer passed as argument 2" (memcpy in combine_v2_backward's
// source_grads): grad_out of H = 0 without data, each active token's 0 bytes copied from null into
// grad_shared_expert_x. The backward ops of rows of no bytes, with and without a shared-expert
// rank (whose rows the owner copies rather than scales), give outputs of no bytes and zero dots.
TEST(FuzzFindings, BackwardOfRowsOfNoBytes) {
  const int64_t W = comm()->size(), r = comm()->rank(), BS = 3, K = 1;
  for (int64_t S : {int64_t{0}, int64_t{1}}) {
    if (S >= W) continue;
    SCOPED_TRACE("shared_expert_rank_num " + std::to_string(S));
    std::vector<int32_t> ids(BS * K);
    std::vector<float> scales(BS * K, 0.5f);
    for (int64_t i = 0; i < BS; ++i) ids[i] = static_cast<int32_t>((r + i) % (W - S));
    EpConfig cfg;
    cfg.group_ep = comm().get();
    cfg.ep_world_size = W;
    cfg.ep_rank_id = r;
    cfg.moe_expert_num = W - S;
    cfg.shared_expert_rank_num = S;
    TensorView empty_rows;  // (BS, 0) without data, as torch.empty(BS, 0) may be
    empty_rows.dtype = DType::kF32;
    empty_rows.ndim = 2;
    empty_rows.shape = {BS, 0};
    empty_rows.strides = {1, 1};
    DispatchInputs in;
    in.x = empty_rows;
    in.expert_ids = TensorView::contiguous(ids.data(), DType::kI32, {BS, K});
    in.expert_scales = TensorView::contiguous(scales.data(), DType::kF32, {BS, K});
    const DispatchOutputs out = dispatch_v2(in, cfg);
    CombineBackwardInputs cb;
    cb.grad_out = empty_rows;
    cb.expand_x = out.expand_x;
    cb.expert_ids = in.expert_ids;
    cb.expert_scales = *in.expert_scales;
    cb.shared_expert_x = true;
    cb.handle = &out.handle;
    const CombineBackwardOutputs g = combine_v2_backward(cb, cfg);
    EXPECT_EQ(g.grad_expand_x.size(0), out.expand_x.size(0));
    EXPECT_EQ(g.grad_expand_x.size(1), 0);
    ASSERT_EQ(g.grad_expert_scales.numel(), BS * K);
    for (int64_t j = 0; j < BS * K; ++j) EXPECT_EQ(g.grad_expert_scales.ptr<float>()[j], 0.0f);
    EXPECT_EQ(g.grad_shared_expert_x.size(0), BS);
    EXPECT_EQ(g.grad_shared_expert_x.size(1), 0);
    DispatchBackwardInputs db;
    db.grad_expand_x = out.expand_x;
    db.expert_ids = in.expert_ids;
    db.handle = &out.handle;
    const Tensor gx = dispatch_v2_backward(db, cfg);
    EXPECT_EQ(gx.size(0), BS);
    EXPECT_EQ(gx.size(1), 0);
  }
}

}  // namespace
}  // namespace moe_ep
