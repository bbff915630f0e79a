// Sharded permute / unpermute on hidden-dimension shards: SPEC §5 (the DTensor sharding rules of
// torch_npu's npu_moe_token_permute / unpermute family, torch_npu/distributed/tensor/_moe_ops.py).
//
// A 1-D mesh is a Communicator: mesh rank r holds one piece of every distributed tensor. A
// distributed tensor (DTensor) is this rank's local piece plus the global shape and a placement:
//   Replicate()  every rank holds the whole tensor;
//   Shard(d)     rank r holds the slice [offset_r, offset_r + len_r) of dimension d, split
//                exactly like PyTorch DTensor's Shard(d) (torch.chunk): with S = shape[d] and n
//                ranks, chunk = ceil(S/n), offset_r = min(r * chunk, S), len_r = min(chunk,
//                S - offset_r) (H = 10, n = 4: 3, 3, 3, 1; 1000 on 3: 334, 334, 332; 5 on 4:
//                2, 2, 1, 0), so DTensor local shards can be passed as they are. Trailing ranks
//                may hold EMPTY pieces. NOTE this is not numpy.array_split / torch.tensor_split
//                (3, 3, 2, 2); for divisible sizes all agree. docs/sharding.md has the details.
//   Partial()    every rank holds a tensor of the global shape; the value is the sum over ranks.
//
// Every function taking a Communicator is collective over it: all ranks call it in the same
// order with arguments that agree (placements, global shapes, dtypes, scalar arguments); the
// first phase of each call exchanges a small header, so a bad argument on one rank makes every
// rank throw (that rank the error, the others Error(kRemote) naming it) instead of hanging.
// All waits have the communicator's deadline (Error(kTimeout) naming rank, peer and phase).
// Errors raised by the local kernel after the data has moved (e.g. an index value out of range
// on one rank only) are raised on the ranks whose data is bad; the op does no communication
// after the kernel, so no rank hangs.
//
// Numerics: data movement is bit-exact. A Partial is summed in fp32 in rank order 0..n-1
// (the sum starts with rank 0's value) and rounded once to the tensor's dtype, by the rank that
// owns that piece of the result, so every rank gets the same bits whoever receives. Results of
// the sharded ops equal the single-process ops of moe_ep/permute.h bit for bit, except
// grad_probs, a Partial of per-shard dot products: its sum differs from the single-process dot
// product only by fp32 summation order (then one rounding to probs' dtype).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/export.h"
#include "moe_ep/permute.h"
#include "moe_ep/tensor.h"

namespace moe_ep {

// ---------------------------------------------------------------------------------------------
// Placements.

struct MOE_EP_API Placement {
  enum class Kind : uint8_t { kReplicate, kShard, kPartial };
  Kind kind = Kind::kReplicate;
  int dim = 0;  // the sharded dimension (kShard only; 0 otherwise)

  bool is_replicate() const { return kind == Kind::kReplicate; }
  bool is_shard() const { return kind == Kind::kShard; }
  bool is_shard(int d) const { return kind == Kind::kShard && dim == d; }
  bool is_partial() const { return kind == Kind::kPartial; }
  friend bool operator==(const Placement& a, const Placement& b) {
    return a.kind == b.kind && a.dim == b.dim;
  }
  // "Replicate", "Shard(1)", "Partial(sum)".
  std::string to_string() const;
};

inline Placement Replicate() { return {Placement::Kind::kReplicate, 0}; }
// d >= 0 is checked against the tensor's ndim where the placement is used.
inline Placement Shard(int d) { return {Placement::Kind::kShard, d}; }
// Sum is the only reduction.
inline Placement Partial() { return {Placement::Kind::kPartial, 0}; }

// The slice of a dimension of `size` that mesh rank `rank` of `mesh_size` holds under Shard,
// PyTorch DTensor's (torch.chunk): chunk = ceil(size / mesh_size), offset = min(rank * chunk,
// size), length = min(chunk, size - offset). offset + length <= size; length may be 0 for trailing
// ranks (5 on 4: 2, 2, 1, 0; 6 on 4: 2, 2, 2, 0; 0 on n: all 0).
struct ShardRange {
  int64_t offset = 0;
  int64_t length = 0;
};
// Throws Error(kInvalidArgument) for size < 0, mesh_size < 1 or rank outside [0, mesh_size).
MOE_EP_API ShardRange shard_range(int64_t size, int mesh_size, int rank);

// The local shape of a tensor of `global_shape` placed by `placement` on mesh rank `rank`.
// Throws Error(kInvalidArgument) for a negative size or a Shard dim outside [0, ndim).
MOE_EP_API std::vector<int64_t> local_shape(const std::vector<int64_t>& global_shape,
                                            Placement placement, int mesh_size, int rank);

// ---------------------------------------------------------------------------------------------
// Distributed tensors.

struct MOE_EP_API DTensor {
  // [in/out] This rank's piece: shape local_shape(global_shape, placement, n, rank), possibly
  // empty. Any non-negative strides: redistribution copies any layout, and the sharded ops copy a
  // token-like piece whose columns are strided before the local kernel (which needs contiguous
  // rows), so a layout never fails on some ranks only. Not owned unless `owner` holds it.
  TensorView local{};
  std::vector<int64_t> global_shape{};  // ndim 1..4, sizes >= 0
  Placement placement{};
  // The dtype of the global tensor. Equals local.dtype, except that the local pieces of a float
  // Partial may be fp32 partial sums of a bf16/fp16 tensor (the sharded ops return grad_probs
  // that way, so the sum is rounded once). Unset: local.dtype.
  std::optional<DType> dtype{};
  // Storage of `local` when moe-ep allocated it (outputs); undefined for a caller's view. It may
  // be larger than `local` (a buffer the piece views): only `local` is ever read.
  Tensor owner{};

  DType global_dtype() const { return dtype ? *dtype : local.dtype; }

  // A DTensor viewing the caller's local piece (not owned).
  static DTensor from_local(const TensorView& local, Placement placement,
                            std::vector<int64_t> global_shape);
  // A DTensor owning `local`.
  static DTensor from_local(const Tensor& local, Placement placement,
                            std::vector<int64_t> global_shape);
};

// This rank's piece of `full` (the whole tensor, the same on every rank) under `placement`
// (Replicate or Shard(d)): a view INTO `full` (no copy, no communication, not collective), so
// `full` must outlive the result. Throws Error(kInvalidArgument) for Shard(d) outside [0, ndim),
// Error(kUnsupported) for Partial.
MOE_EP_API DTensor distribute(const TensorView& full, Placement placement, int mesh_size, int rank);

// ---------------------------------------------------------------------------------------------
// Redistribution (collective).
//
// redistribute() turns `x` into the placement `to`:
//   Shard(d) -> Replicate   all-gather
//   Shard(a) -> Shard(b)    all-to-all (e.g. Shard(0) <-> Shard(1))
//   Partial  -> Replicate   reduce-scatter then all-gather (sum in fp32, rank order, one rounding)
//   Partial  -> Shard(d)    reduce-scatter (sum in fp32, rank order, one rounding)
//   Replicate -> Shard(d)   local slice: a view into x.local, no communication
//   same placement          x unchanged (aliases x.local)
// Anything -> Partial raises Error(kUnsupported). Partial needs a float tensor (local bf16/fp16/
// fp32). Outputs that moved are fresh contiguous tensors in x's global dtype, owned by the result.
// `name` names x in error messages. Point-to-point messages with the communicator's deadline; a
// timeout leaves the communicator unusable (see comm.h) and x.local must stay alive until the
// job ends.
MOE_EP_API DTensor redistribute(const Communicator& mesh, const DTensor& x, Placement to,
                                const char* name = "x");
// redistribute(x, Replicate()) as an owned contiguous tensor of the global shape.
MOE_EP_API Tensor full_tensor(const Communicator& mesh, const DTensor& x, const char* name = "x");

// ---------------------------------------------------------------------------------------------
// Strategies (data: a Python front can generate DTensor sharding rules from them).

enum class ShardedOp : uint8_t {
  kPermute,
  kPermuteGrad,
  kPermuteGradV2,
  kUnpermute,
  kUnpermuteWithSaved,
  kUnpermuteGrad,
  kUnpermuteGradV2,
};
// "permute", "permute_grad", "permute_grad_v2", "unpermute", "unpermute_with_saved",
// "unpermute_grad", "unpermute_grad_v2".
MOE_EP_API const char* op_name(ShardedOp op);

struct ArgPlacement {
  std::string name{};                    // the SPEC's parameter name: "tokens", "sorted_indices"...
  std::optional<Placement> placement{};  // nullopt: "-" (an absent argument or output)
  // false: the op uses only this argument's shape and dtype (permute_grad's tokens,
  // unpermute_grad's permuted_tokens without probs): placing it differently moves no data.
  bool data_read = true;
};

struct Strategy {
  std::string name{};                  // "R" (all Replicate) or "S" (hidden dimension sharded)
  std::vector<ArgPlacement> inputs{};  // the op's tensor arguments, in SPEC §4 order
  std::vector<ArgPlacement> outputs{};
};

// The two strategies of `op` (SPEC §5), R first. has_probs: whether probs is given (ops without
// probs ignore it). has_permuted_tokens: unpermute_grad_v2 only, whether permuted_tokens is
// given (required with probs). Throws Error(kInvalidArgument) for unpermute_grad_v2 with probs
// and no permuted_tokens.
MOE_EP_API std::vector<Strategy> strategies(ShardedOp op, bool has_probs,
                                            bool has_permuted_tokens = true);

// What the cost rule needs to know about a tensor.
struct TensorSpec {
  std::vector<int64_t> global_shape{};
  DType dtype = DType::kF32;  // the global dtype
  Placement placement{};
  std::optional<DType> local_dtype{};  // dtype of the local pieces; unset: dtype
};
MOE_EP_API TensorSpec spec_of(const DTensor& x);

// Bytes a rank receives to redistribute `x` to `to` on a mesh of `mesh_size` ranks, the maximum
// over ranks (the critical path; self-copies are free). Shard(d)->Replicate: the global size
// minus the smallest shard; Shard(a)->Shard(b): the largest target piece minus what the rank
// already holds; Partial->Shard(d): (n-1) x the largest target piece (in the local dtype);
// Partial->Replicate: that for an element-range split, plus the all-gather of the rest (in
// dtype); Replicate->anything else and x->x: 0. Throws Error(kUnsupported) for a Partial
// target, Error(kInvalidArgument) for a bad Shard dim or mesh_size < 1.
MOE_EP_API int64_t redistribute_cost(const TensorSpec& x, Placement to, int mesh_size);

struct Redistribution {
  std::string arg{};  // the argument's name
  Placement from{}, to{};
  int64_t recv_bytes = 0;  // redistribute_cost
};

struct StrategyChoice {
  int index = 0;        // into strategies(op, ...): 0 = R, 1 = S
  Strategy strategy{};  // that strategy
  // The inputs whose placement must change and whose data the op reads, in argument order.
  std::vector<Redistribution> redistributions{};
  int64_t cost_bytes = 0;  // sum of their recv_bytes
};

// The cost rule: the strategy whose input redistributions make a rank receive the fewest bytes
// (sum over arguments of redistribute_cost); a tie goes to the first in table order (R), as
// PyTorch DTensor's propagation does. Arguments whose data the op does not read cost 0.
// `inputs` maps each given tensor argument's name (as in strategies()) to its spec; absent
// optional arguments (probs, permuted_tokens) are left out. Throws Error(kInvalidArgument) for
// an unknown or missing argument name, or an invalid spec.
MOE_EP_API StrategyChoice select_strategy(ShardedOp op,
                                          const std::map<std::string, TensorSpec>& inputs,
                                          int mesh_size);

// ---------------------------------------------------------------------------------------------
// Sharded ops (collective). Each takes DTensors in any placement, selects a strategy
// (select_strategy), redistributes the inputs it needs, runs the local op of moe_ep/permute.h on
// this rank's pieces and returns the outputs with the strategy's placements (global shapes as
// the single-process op). Argument meanings, shapes, dtypes and the checks of the local op are
// those of moe_ep/permute.h (SPEC §4); the shapes below are GLOBAL. Placement checks raise
// Error(kInvalidArgument) naming the op ("sharded::permute"), the argument, the value and the
// bound: a Shard dim outside [0, ndim), a local piece whose shape is not local_shape(global,
// placement, n, rank), a Partial index tensor, a global dtype that differs from local.dtype
// (other than fp32 pieces of a float Partial). `choice` reports what was done.

namespace sharded {

struct PermuteArgs {
  DTensor tokens{};   // (N, H) bf16/fp16/fp32
  DTensor indices{};  // (N,) or (N, topK) int32/int64
  std::optional<int64_t> num_out_tokens{};
  bool padded_mode = false;
};
struct PermuteResult {
  DTensor permuted_tokens{};  // (rows, H): R or Shard(1)
  DTensor sorted_indices{};   // (M,) int32 (padded_mode: indices' shape): Replicate
  StrategyChoice choice{};
};
MOE_EP_API PermuteResult permute(const Communicator& mesh, const PermuteArgs& args);

struct PermuteGradArgs {
  DTensor tokens{};                // (N, H): only its shape and dtype are used (no data moves)
  DTensor grad_permuted_tokens{};  // (R, H), tokens' dtype
  DTensor indices{};               // (N,) or (N, topK): gives topK
  DTensor sorted_indices{};        // (N*topK,) int32
  bool padded_mode = false;
};
struct GradTokensResult {
  DTensor grad_tokens{};  // (N, H): R or Shard(1)
  StrategyChoice choice{};
};
MOE_EP_API GradTokensResult permute_grad(const Communicator& mesh, const PermuteGradArgs& args);

struct PermuteGradV2Args {
  DTensor grad_permuted_tokens{};  // (R, H) bf16/fp16/fp32
  DTensor sorted_indices{};        // (tokens_rows*num_topk,) int32
  int64_t tokens_rows = 0;
  DType tokens_dtype = DType::kBF16;
  int64_t num_topk = 1;
  bool padded_mode = false;
};
MOE_EP_API GradTokensResult permute_grad_v2(const Communicator& mesh,
                                            const PermuteGradV2Args& args);

struct UnpermuteArgs {
  DTensor permuted_tokens{};       // (P, H) bf16/fp16/fp32
  DTensor sorted_indices{};        // (M,) int32
  std::optional<DTensor> probs{};  // (N, topK) float
  bool padded_mode = false;
  std::optional<std::vector<int64_t>> restore_shape{};  // the GLOBAL output shape {N, H}
};
struct UnpermuteResult {
  DTensor out{};  // (N, H): R or Shard(1)
  StrategyChoice choice{};
};
MOE_EP_API UnpermuteResult unpermute(const Communicator& mesh, const UnpermuteArgs& args);

struct UnpermuteWithSavedResult {
  DTensor out{};                           // (N, H): R or Shard(1)
  DTensor permuted_tokens_for_backward{};  // (P, H), placed as out: a contiguous copy
  StrategyChoice choice{};
};
MOE_EP_API UnpermuteWithSavedResult unpermute_with_saved(const Communicator& mesh,
                                                         const UnpermuteArgs& args);

struct UnpermuteGradArgs {
  DTensor permuted_tokens{};  // (P, H); data read only with probs
  DTensor grad_out{};         // (N, H)
  DTensor sorted_indices{};   // (M,) int32
  std::optional<DTensor> probs{};
  bool padded_mode = false;
  std::optional<std::vector<int64_t>> restore_shape{};  // the GLOBAL shape {N, H}
};
struct UnpermuteGradResult {
  DTensor grad_permuted_tokens{};  // (P, H): R or Shard(1)
  // (N, topK), global dtype = probs' dtype. Strategy R: Replicate, local in probs' dtype.
  // Strategy S: Partial whose local pieces are fp32 per-shard dot products (dtype is probs');
  // redistribute(..., Replicate()) sums them (fp32, rank order) and rounds once. nullopt without
  // probs (SPEC §5 Decision: "-" in both strategies).
  std::optional<DTensor> grad_probs{};
  StrategyChoice choice{};
};
MOE_EP_API UnpermuteGradResult unpermute_grad(const Communicator& mesh,
                                              const UnpermuteGradArgs& args);

struct UnpermuteGradV2Args {
  DTensor grad_out{};        // (N, H) bf16/fp16/fp32
  DTensor sorted_indices{};  // (M,) int32
  int64_t permuted_rows = 0;
  DType permuted_dtype = DType::kBF16;
  std::optional<DTensor> probs{};
  bool padded_mode = false;
  std::optional<std::vector<int64_t>> restore_shape{};  // the GLOBAL shape {N, H}
  std::optional<DTensor> permuted_tokens{};             // (P, H): required with probs
};
MOE_EP_API UnpermuteGradResult unpermute_grad_v2(const Communicator& mesh,
                                                 const UnpermuteGradV2Args& args);

}  // namespace sharded
}  // namespace moe_ep
