// libFuzzer target: argument validation of the local ops of moe_ep/permute.h (permute,
// permute_grad, permute_grad_v2, unpermute, unpermute_with_saved, unpermute_grad,
// unpermute_grad_v2), in one process. The input picks the op, padded_mode, each tensor's dtype,
// shape, strides and contents (fuzz_common.h: Views), the optional arguments and the sizes; the
// tensors are mostly of the right dtype and rank with small sizes, so that valid calls run too,
// but any size may be negative, huge or overflowing. A moe_ep::Error (not Internal) is fine;
// another exception, a crash or a sanitizer report is a finding.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "fuzz_common.h"
#include "moe_ep/permute.h"
#include "moe_ep/tensor.h"
#include "moe_ep/threads.h"

namespace {

using moe_ep::DType;
using moe_ep::TensorView;
using moe_ep_fuzz::Input;
using moe_ep_fuzz::Views;

DType float_dtype(Input& in) {
  static constexpr DType kFloats[] = {DType::kBF16, DType::kF16, DType::kF32};
  return kFloats[in.below(3)];
}
DType index_dtype(Input& in) { return in.flag() ? DType::kI32 : DType::kI64; }

// An index tensor (token ids, expert ids or sorted_indices): ids in [0, span) mostly, or a
// permutation of its elements.
TensorView indices(Input& in, Views& views, DType dtype, int ndim, std::vector<int64_t> dims,
                   int64_t span) {
  TensorView v = views.make(dtype, ndim, std::move(dims));
  if (in.flag()) {
    views.fill_permutation(v);
  } else {
    views.fill_ids(v, in.flag() ? -1 : 0, span);
  }
  return v;
}

std::optional<std::vector<int64_t>> restore_shape(Input& in, int64_t n, int64_t h) {
  const uint8_t b = in.byte();
  if (b < 64) return std::nullopt;
  if (b < 192) return std::vector<int64_t>{n, h};
  std::vector<int64_t> shape(in.below(4));
  for (int64_t& d : shape) d = in.size();
  return shape;
}

void run_op(Input& in) {
  Views views(in);
  const int op = static_cast<int>(in.below(7));
  const bool padded = in.byte() >= 192;
  const int64_t n = in.size(), h = in.size(), k = in.size();
  int64_t m = 0;  // N * topK, a hint (the sizes may be anything)
  if (__builtin_mul_overflow(n, k, &m)) m = n;
  const DType dt = float_dtype(in);
  switch (op) {
    case 0: {
      moe_ep::PermuteArgs a;
      a.padded_mode = padded;
      a.tokens = views.make(dt, 2, {n, h});
      a.indices = indices(in, views, index_dtype(in), in.flag() ? 2 : 1, {n, k}, 8);
      if (in.flag()) {
        const bool positive = in.flag();
        const int64_t v = in.size();
        a.num_out_tokens = positive || v == INT64_MIN ? v : -v;  // negative: rows dropped
      }
      (void)moe_ep::permute(a);
      break;
    }
    case 1: {
      moe_ep::PermuteGradArgs a;
      a.padded_mode = padded;
      a.tokens = views.make(dt, 2, {n, h});
      a.grad_permuted_tokens = views.make(dt, 2, {m, h});
      a.indices = indices(in, views, index_dtype(in), 2, {n, k}, 8);
      a.sorted_indices = indices(in, views, DType::kI32, 1, {m}, m > 0 ? m : 8);
      (void)moe_ep::permute_grad(a);
      break;
    }
    case 2: {
      moe_ep::PermuteGradV2Args a;
      a.padded_mode = padded;
      a.grad_permuted_tokens = views.make(dt, 2, {m, h});
      a.sorted_indices = indices(in, views, DType::kI32, 1, {m}, m > 0 ? m : 8);
      a.tokens_rows = in.flag() ? n : in.size();
      a.tokens_dtype = in.byte() < 224 ? dt : static_cast<DType>(in.below(7));
      a.num_topk = in.flag() ? k : in.size();
      (void)moe_ep::permute_grad_v2(a);
      break;
    }
    case 3:
    case 4: {
      moe_ep::UnpermuteArgs a;
      a.padded_mode = padded;
      a.permuted_tokens = views.make(dt, 2, {m, h});
      a.sorted_indices = indices(in, views, DType::kI32, padded && in.flag() ? 2 : 1, {m}, m);
      if (in.flag()) a.probs = views.make(float_dtype(in), padded ? 1 : 2, {n, k});
      a.restore_shape = restore_shape(in, n, h);
      if (op == 3) {
        (void)moe_ep::unpermute(a);
      } else {
        (void)moe_ep::unpermute_with_saved(a);
      }
      break;
    }
    case 5: {
      moe_ep::UnpermuteGradArgs a;
      a.padded_mode = padded;
      a.permuted_tokens = views.make(dt, 2, {m, h});
      a.grad_out = views.make(dt, 2, {n, h});
      a.sorted_indices = indices(in, views, DType::kI32, 1, {m}, m);
      if (in.flag()) a.probs = views.make(float_dtype(in), 2, {n, k});
      a.restore_shape = restore_shape(in, n, h);
      (void)moe_ep::unpermute_grad(a);
      break;
    }
    default: {
      moe_ep::UnpermuteGradV2Args a;
      a.padded_mode = padded;
      a.grad_out = views.make(dt, 2, {n, h});
      a.sorted_indices = indices(in, views, DType::kI32, 1, {m}, m);
      a.permuted_rows = in.flag() ? m : in.size();
      a.permuted_dtype = in.byte() < 224 ? dt : static_cast<DType>(in.below(7));
      if (in.flag()) a.probs = views.make(float_dtype(in), 2, {n, k});
      a.restore_shape = restore_shape(in, n, h);
      if (in.flag()) a.permuted_tokens = views.make(dt, 2, {m, h});
      (void)moe_ep::unpermute_grad_v2(a);
      break;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  moe_ep::set_num_threads(1);  // one thread: fast, and every input replays the same way
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  moe_ep_fuzz::expect_error_or_success([&] { run_op(in); });
  return 0;
}
