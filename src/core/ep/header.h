// Internal: the agreement every op of src/core/ep starts with. Each rank checks its own arguments
// without throwing (capture), then every rank sends every other its OpHeader (phase "header"):
// a rank whose arguments failed throws its error and the others Error(kRemote) naming it, and
// ranks that disagree on an argument that must be equal all throw Error(kInvalidArgument). So a
// mistake on one rank never leaves another waiting for data that will not come.
#pragma once

#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <vector>

#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"

namespace moe_ep::detail {

constexpr int32_t kOpDispatch = 1;
constexpr int32_t kOpCombine = 2;
constexpr int32_t kOpDispatchBackward = 3;  // combine_v2's route (backward.cc)
constexpr int32_t kOpCombineBackward = 4;   // dispatch_v2's route (backward.cc)

// Where a rank's rows lie in its shared-memory window, as its header (or phase "where") tells
// the peers on its machine: byte offsets in its segment of window generation `gen` (-1: none).
// dispatch_v2: the slot of its expand_x (rows: expand_x's first row; extra: its per-row metadata;
// capacity: the rows the slot holds). combine_v2: its expert outputs (rows: row 0; stride: bytes
// from one row to the next; extra: their int8 scales with comm_quant_mode 2).
struct Where {
  int64_t gen = -1, rows = 0, stride = 0, extra = 0, capacity = 0;
};

// The fixed-size header every rank sends every other rank before an op moves data.
struct OpHeader {
  int32_t magic = 0x4d4f4550;  // "MOEP"
  int32_t op = 0;              // kOpDispatch, kOpCombine, kOp*Backward
  int32_t ok = 1;              // 0: local validation failed, see kind and message
  int32_t kind = 0;            // ErrorKind of the local failure
  int64_t ep_world_size = 0, moe_expert_num = 0, tp_world_size = 0, shared_expert_num = 0,
          shared_expert_rank_num = 0, expert_shard_type = 0, global_bs = 0, zero_expert_num = 0,
          copy_expert_num = 0, const_expert_num = 0, comm_alg = 0;
  int64_t BS = 0, H = 0, K = 0, dtype = 0;
  int64_t elastic = 0;     // hash of elastic_info (0: none or not scaled down)
  int32_t all_active = 1;  // 0: x_active_mask given and some token inactive by it
  int32_t quant_mode = 0;  // dispatch_v2: quant_mode; combine_v2: comm_quant_mode (the op checks)
  int64_t transport = 0;   // TransportCode, must be equal on all ranks
  int32_t shm_grow = 0;    // shm: this rank's window segment is too small (or there is none yet)
  int32_t shm_node_ranks = 0;  // $MOE_EP_SHM_NODE_RANKS (0: unset), must be equal on all ranks
  int32_t exact_size = 0;      // EpConfig::exact_size, must be equal on all ranks
  int32_t partials = 0;  // combine_v2 with "hierarchy": EpConfig::partials, 0 fp32, 1 bf16; equal
  uint64_t plan = 0;     // the DispatchHandle's plan this call uses (0: none), equal on all ranks
  uint64_t smooth_hash = 0;  // comm_alg "hierarchy" with smoothing scales: their hash (dispatch.cc)
  Where where;               // shm: where this rank's rows lie (see Where)
  char message[400] = {};    // the local error, truncated
};

// The header of `op` with cfg's arguments and its tensors' sizes: BS = bs_of.shape[0], H =
// rows.shape[1], K = expert_ids.shape[1] (-1 where a tensor has too few dims: its own check
// reports that), rows' dtype, and quant_mode (dispatch_v2's, or combine_v2's comm_quant_mode).
OpHeader base_header(int32_t op, const EpConfig& cfg, const TensorView& bs_of,
                     const TensorView& rows, const TensorView& expert_ids, int64_t quant_mode);

// Runs the local validation `f`; a failure is recorded in h and `local` (not thrown) until the
// headers are agreed. std::bad_alloc becomes Error(kSystem).
void record_failure(OpHeader& h, std::optional<Error>& local, Error e);
template <typename F>
void capture(OpHeader& h, std::optional<Error>& local, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    record_failure(h, local, e);
  } catch (const std::bad_alloc&) {
    record_failure(h, local, Error(ErrorKind::kSystem, "out of memory while planning"));
  }
}

// Exchanges `mine` with the ranks `peers` of `comm` (the op's world, in its rank order: all of
// comm's ranks, or the survivors of a scale-in; `comm.rank()` must be one of them) in phase
// "header" and returns their headers in that order. Then, in this order:
//   - `local` is set (this rank failed validation): rethrows it;
//   - another rank failed: throws Error(kRemote) "<op>: rank <r> failed: <its message>" (lowest r);
//   - the ranks disagree on an argument that must be equal (op, ep_world_size, moe_expert_num,
//     global_bs, H, K, dtype, transport, $MOE_EP_SHM_NODE_RANKS, the handle, ...): throws
//     Error(kInvalidArgument) on every rank naming the argument, two ranks and their values.
// `perf` (optional, indexed by communicator rank): the wait for each peer's header is added to it.
// `phase` names the exchange in a timeout ("header"; dispatch_v2's second agreement with
// EpConfig::exact_size: "exact sizes").
std::vector<OpHeader> agree_on_headers(const Communicator& comm, const std::vector<int>& peers,
                                       const char* op, const OpHeader& mine, const Error* local,
                                       int64_t* perf = nullptr, const char* phase = "header");

// After the agreement. BS may differ across ranks only with global_bs = W * m, m >= max BS, and
// then every token must be active (SPEC §1.3, §1.6); bs_name names BS's tensor.
void check_batch_sizes(const char* op, const std::vector<OpHeader>& h,
                       const std::vector<int>& peers, int64_t global_bs, const char* bs_name);
// quant_mode (dispatch_v2) / comm_quant_mode (combine_v2), `name`, must be equal on all ranks:
// the rows would otherwise differ in size on the wire.
void check_quant_modes(const char* op, const std::vector<OpHeader>& h,
                       const std::vector<int>& peers, const char* name);

}  // namespace moe_ep::detail
