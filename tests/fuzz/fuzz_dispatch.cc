// libFuzzer target: argument and header checks of dispatch_v2 / combine_v2 (moe_ep/dispatch.h),
// their backward ops (moe_ep/backward.h) and dispatch_workspace, on one rank. The target
// initialises MPI itself (a singleton: run it without mpirun) and makes a Communicator over
// MPI_COMM_WORLD of size 1. The input picks the EpConfig (mostly W = 1 and small expert counts, but
// any value), each tensor's dtype, shape, strides and contents (fuzz_common.h: Views), the optional
// arguments, a cached dispatch with the first call's handle (its routing perhaps changed), caller
// buffers, and combine_v2's inputs: the dispatch's outputs (one of them perhaps altered) or the
// fuzzer's own; or a backward op over the dispatch's handle. A moe_ep::Error of kind
// InvalidArgument or Unsupported, or System for an allocation (an output the fuzzer's sizes made
// too large) is fine; any other outcome is a finding (Timeout, Remote, Internal and an MPI failure
// included: one rank has no peer to wait for or to blame).
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "moe_ep/backward.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/tensor.h"
#include "moe_ep/threads.h"

namespace {

using moe_ep::DType;
using moe_ep::Tensor;
using moe_ep::TensorView;
using moe_ep_fuzz::Input;
using moe_ep_fuzz::mul;
using moe_ep_fuzz::Views;

std::shared_ptr<moe_ep::Communicator> g_comm;

// A count: mostly `usual` or small ([0, 4)), else Input::size() without the values in
// [4096, 2^31 - 1): those are valid for some counts (E, global_bs) and then cost the O(count)
// time and memory they ask for (per-expert tables, A rows), which is no finding but a slow one.
int64_t small(Input& in, int64_t usual) {
  const uint8_t b = in.byte();
  if (b < 160) return usual;
  if (b < 230) return b % 4;
  const int64_t v = in.size();
  return v >= 4096 && v < (int64_t{1} << 31) - 1 ? v % 4096 : v;
}

moe_ep::EpConfig config(Input& in) {
  moe_ep::EpConfig cfg;
  cfg.group_ep = in.byte() < 250 ? g_comm.get() : nullptr;
  cfg.ep_world_size = small(in, 1);
  cfg.ep_rank_id = small(in, 0);
  cfg.moe_expert_num = small(in, 1 + in.below(4));
  if (in.byte() >= 220) {
    cfg.tp_world_size = small(in, 2);
    cfg.group_tp = in.flag() ? g_comm.get() : nullptr;
    cfg.tp_rank_id = small(in, 0);
  }
  cfg.expert_shard_type = small(in, 0);
  cfg.shared_expert_num = small(in, 1);
  cfg.shared_expert_rank_num = small(in, 0);
  cfg.global_bs = small(in, 0);
  static const char* kAlgs[] = {"", "fullmesh", "hierarchy", "ring"};
  cfg.comm_alg = kAlgs[in.below(4)];
  static const char* kTransports[] = {"mpi", "shm", "", "tcp"};
  cfg.transport = kTransports[in.below(4)];
  cfg.exact_size = in.byte() >= 200;
  cfg.zero_expert_num = small(in, 0);
  cfg.copy_expert_num = small(in, 0);
  cfg.const_expert_num = small(in, 0);
  return cfg;
}

int64_t all_experts(const moe_ep::EpConfig& cfg) {
  int64_t all = 0;
  for (int64_t n :
       {cfg.moe_expert_num, cfg.zero_expert_num, cfg.copy_expert_num, cfg.const_expert_num})
    if (n > 0 && n < 64) all += n;
  return all;
}

DType float_dtype(Input& in) {
  static constexpr DType kFloats[] = {DType::kBF16, DType::kF16, DType::kF32};
  return kFloats[in.below(3)];
}

struct Sizes {
  int64_t bs, h, k;
  DType dtype;
};

moe_ep::DispatchInputs dispatch_inputs(Input& in, Views& views, const moe_ep::EpConfig& cfg,
                                       const Sizes& s) {
  moe_ep::DispatchInputs d;
  d.x = views.make(s.dtype, 2, {s.bs, s.h});
  d.expert_ids = views.make(DType::kI32, 2, {s.bs, s.k});
  views.fill_ids(d.expert_ids, in.flag() ? -1 : 0, all_experts(cfg) + 1);
  if (in.byte() < 192) d.expert_scales = views.make(DType::kF32, 2, {s.bs, s.k});
  if (in.byte() >= 224) d.scales = views.make(DType::kF32, 2, {cfg.moe_expert_num, s.h});
  if (in.byte() >= 192) {
    d.x_active_mask =
        in.flag() ? views.make(DType::kBool, 1, {s.bs}) : views.make(DType::kBool, 2, {s.bs, s.k});
  }
  if (in.byte() >= 232) {
    const int64_t w = cfg.ep_world_size;
    d.elastic_info = views.make(DType::kI32, 1, {w >= 0 && w < (int64_t{1} << 40) ? 2 * w + 4 : w});
    views.fill_ids(*d.elastic_info, -1, 3);
  }
  if (in.byte() >= 232) d.performance_info = views.make(DType::kI64, 1, {cfg.ep_world_size});
  d.quant_mode = in.byte() < 192 ? 0 : small(in, 2);
  d.expert_token_nums_type = small(in, 1);
  return d;
}

// Caller-allocated outputs: some views of the fuzzer's sizes.
moe_ep::DispatchBuffers buffers(Input& in, Views& views, const Sizes& s) {
  moe_ep::DispatchBuffers b;
  if (in.flag()) b.expand_x = views.make(s.dtype, 2, {mul(s.bs, s.k), s.h});
  if (in.flag()) b.expand_scales = views.make(DType::kF32, 1, {mul(s.bs, s.k)});
  if (in.flag()) b.assist_info_for_combine = views.make(DType::kI32, 1, {mul(128, mul(s.bs, s.k))});
  if (in.flag()) b.expert_token_nums = views.make(DType::kI64, 1, {});
  if (in.flag()) b.ep_recv_counts = views.make(DType::kI32, 1, {});
  if (in.flag()) b.tp_recv_counts = views.make(DType::kI32, 1, {1});
  if (in.flag()) b.dynamic_scales = views.make(DType::kF32, 1, {mul(s.bs, s.k)});
  return b;
}

// Overwrites one element of an int32 tensor the call returned (combine_v2 must check it).
void poke(Input& in, const Tensor& t) {
  if (t.numel() == 0 || t.dtype() != DType::kI32) return;
  const int64_t i = static_cast<int64_t>(in.u64() % static_cast<uint64_t>(t.numel()));
  t.ptr<int32_t>()[i] = static_cast<int32_t>(in.size());
}

// The special experts' inputs of combine_v2 or combine_v2_backward (SPEC §2.2): ori_x when copy
// or const experts need it, the const tables when const experts do, or when the input says.
template <typename Inputs>
void special_inputs(Input& in, Views& views, const moe_ep::EpConfig& cfg, const Sizes& s,
                    Inputs& c) {
  const int64_t q = cfg.const_expert_num;
  if (cfg.copy_expert_num > 0 || q > 0 || in.byte() >= 224)
    c.ori_x = views.make(s.dtype, 2, {s.bs, s.h});
  if (q > 0 || in.byte() >= 240) {
    c.const_expert_alpha_1 = views.make(s.dtype, 2, {q, s.h});
    c.const_expert_alpha_2 = views.make(s.dtype, 2, {q, s.h});
    c.const_expert_v = views.make(s.dtype, 2, {q, s.h});
  }
}

void run_combine(Input& in, Views& views, const moe_ep::EpConfig& cfg, const Sizes& s,
                 const moe_ep::DispatchInputs& d, const moe_ep::DispatchOutputs* out) {
  moe_ep::CombineInputs c;
  if (out != nullptr && in.byte() < 224) {
    c.expand_x = out->expand_x;
    if (c.expand_x.dtype == DType::kI8) c.expand_x = views.make(s.dtype, 2, {mul(s.bs, s.k), s.h});
    c.assist_info_for_combine = out->assist_info_for_combine;
    c.ep_send_counts = out->ep_recv_counts;
    if (in.byte() >= 192) c.handle = &out->handle;
    switch (in.below(8)) {
      case 0:
        poke(in, out->assist_info_for_combine);
        break;
      case 1:
        poke(in, out->ep_recv_counts);
        break;
      case 2: {  // fewer rows (or a negative count): the view must still cover its shape
        const int64_t rows = in.size();
        if (rows < c.expand_x.shape[0]) c.expand_x.shape[0] = rows;
        break;
      }
      default:
        break;
    }
  } else {
    c.expand_x = views.make(s.dtype, 2, {mul(s.bs, s.k), s.h});
    c.assist_info_for_combine = views.make(DType::kI32, 1, {mul(128, mul(s.bs, s.k))});
    views.fill_ids(c.assist_info_for_combine, 0, std::min<int64_t>(mul(s.bs, s.k), 1 << 20) + 1);
    c.ep_send_counts = views.make(DType::kI32, 1, {cfg.moe_expert_num});
    views.fill_ids(c.ep_send_counts, 0, std::min<int64_t>(mul(s.bs, s.k), 1 << 20) + 1);
  }
  c.expert_ids = in.byte() < 224 ? d.expert_ids : views.make(DType::kI32, 2, {s.bs, s.k});
  c.expert_scales = d.expert_scales && in.byte() < 224 ? *d.expert_scales
                                                       : views.make(DType::kF32, 2, {s.bs, s.k});
  if (in.byte() >= 240) c.tp_send_counts = views.make(DType::kI32, 1, {2});
  if (d.x_active_mask && in.byte() < 224) c.x_active_mask = d.x_active_mask;
  if (in.byte() >= 224) c.expand_scales = views.make(DType::kF32, 1, {mul(s.bs, s.k)});
  if (in.byte() >= 224) c.shared_expert_x = views.make(s.dtype, in.flag() ? 2 : 3, {s.bs, s.h});
  if (d.elastic_info && in.byte() < 224) c.elastic_info = d.elastic_info;
  special_inputs(in, views, cfg, s, c);
  if (in.byte() >= 240) c.performance_info = views.make(DType::kI64, 1, {cfg.ep_world_size});
  c.comm_quant_mode = in.byte() < 192 ? 0 : small(in, 2);
  if (in.byte() >= 224) c.out = views.make(s.dtype, 2, {s.bs, s.h});
  (void)moe_ep::combine_v2(c, cfg);
}

// The expert-side rows of a backward op: the dispatch's expand_x (a view of the fuzzer's in x's
// dtype when it was int8), or the fuzzer's own.
TensorView expert_rows(Input& in, Views& views, const Sizes& s,
                       const moe_ep::DispatchOutputs& out) {
  if (in.byte() >= 224) return views.make(s.dtype, 2, {mul(s.bs, s.k), s.h});
  TensorView v = out.expand_x;
  if (v.dtype == DType::kI8) v = views.make(s.dtype, 2, {v.shape[0], s.h});
  return v;
}

// dispatch_v2_backward or combine_v2_backward (SPEC §6) over the dispatch's handle (or a
// default-made one, or none), their other inputs the dispatch's (perhaps changed since) or the
// fuzzer's own.
void run_backward(Input& in, Views& views, const moe_ep::EpConfig& cfg, const Sizes& s,
                  const moe_ep::DispatchInputs& d, const moe_ep::DispatchOutputs& out) {
  static const moe_ep::DispatchHandle kNone;
  const uint8_t h = in.byte();
  const moe_ep::DispatchHandle* handle = h < 240 ? &out.handle : h < 248 ? &kNone : nullptr;
  TensorView ids = d.expert_ids;
  if (in.byte() >= 224) {
    ids = views.make(DType::kI32, 2, {s.bs, s.k});
    views.fill_ids(ids, in.flag() ? -1 : 0, all_experts(cfg) + 1);
  }
  std::optional<TensorView> mask = d.x_active_mask;
  if (in.byte() >= 232)
    mask =
        in.flag() ? views.make(DType::kBool, 1, {s.bs}) : views.make(DType::kBool, 2, {s.bs, s.k});
  if (in.flag()) {
    moe_ep::DispatchBackwardInputs b;
    b.grad_expand_x = expert_rows(in, views, s, out);
    b.expert_ids = ids;
    b.x_active_mask = mask;
    b.handle = handle;
    (void)moe_ep::dispatch_v2_backward(b, cfg);
    return;
  }
  moe_ep::CombineBackwardInputs c;
  c.grad_out = views.make(s.dtype, 2, {s.bs, s.h});
  c.expand_x = expert_rows(in, views, s, out);
  c.expert_ids = ids;
  c.expert_scales = d.expert_scales && in.byte() < 224 ? *d.expert_scales
                                                       : views.make(DType::kF32, 2, {s.bs, s.k});
  c.x_active_mask = mask;
  c.shared_expert_x = in.flag();
  special_inputs(in, views, cfg, s, c);
  c.handle = handle;
  (void)moe_ep::combine_v2_backward(c, cfg);
}

void run(Input& in) {
  Views views(in);
  const moe_ep::EpConfig cfg = config(in);
  const Sizes s{small(in, 1 + in.below(4)), small(in, 1 + in.below(8)), small(in, 1 + in.below(2)),
                float_dtype(in)};
  const uint8_t what = in.byte();
  if (what >= 240) {
    (void)moe_ep::dispatch_workspace(cfg, in.flag() ? s.bs : in.size(), s.h, s.k, s.dtype,
                                     small(in, 0), small(in, 0));
    return;
  }
  if (what >= 200) {  // combine_v2 alone, every input the fuzzer's
    const moe_ep::DispatchInputs d = dispatch_inputs(in, views, cfg, s);
    run_combine(in, views, cfg, s, d, nullptr);
    return;
  }
  moe_ep::DispatchInputs d = dispatch_inputs(in, views, cfg, s);
  moe_ep::DispatchBuffers b;
  if (in.byte() >= 232) {
    b = buffers(in, views, s);
    d.out = &b;
  }
  const moe_ep::DispatchOutputs out = moe_ep::dispatch_v2(d, cfg);
  if (in.byte() >= 192) {  // a cached dispatch, its routing perhaps changed
    moe_ep::DispatchInputs again = d;
    again.handle = &out.handle;
    again.out = nullptr;
    if (in.flag() && d.expert_ids.data != nullptr && d.expert_ids.numel() > 0)
      static_cast<int32_t*>(d.expert_ids.data)[0] = static_cast<int32_t>(in.size());
    (void)moe_ep::dispatch_v2(again, cfg);
  }
  if (what >= 176) {  // a backward op over this dispatch
    run_backward(in, views, cfg, s, d, out);
    return;
  }
  run_combine(in, views, cfg, s, d, &out);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SINGLE, &provided);
  moe_ep::set_num_threads(1);
  moe_ep::CommOptions options;
  options.timeout_s = 20;  // nothing should wait on one rank: a Timeout is a finding
  g_comm = moe_ep::Communicator::from_mpi(MPI_COMM_WORLD, options);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  try {
    run(in);
  } catch (const moe_ep::Error& e) {
    const bool allocation = e.kind() == moe_ep::ErrorKind::kSystem &&
                            (std::strstr(e.what(), "allocate") != nullptr ||
                             std::strstr(e.what(), "out of memory") != nullptr);
    if (e.kind() != moe_ep::ErrorKind::kInvalidArgument &&
        e.kind() != moe_ep::ErrorKind::kUnsupported && !allocation)
      moe_ep_fuzz::finding("%s error: %s", moe_ep::error_kind_name(e.kind()), e.what());
  } catch (const std::exception& e) {
    moe_ep_fuzz::finding("a non-moe_ep exception: %s", e.what());
  }
  return 0;
}
