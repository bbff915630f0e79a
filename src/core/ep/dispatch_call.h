// Internal: one dispatch_v2 call as its steps see it (dispatch.cc, the fullmesh route, and
// relay_dispatch.cc, the relay's part of comm_alg "hierarchy"): its arguments and what each step
// leaves for the next.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "base/numeric.h"
#include "core/ep/config.h"
#include "core/ep/handle.h"
#include "core/ep/header.h"
#include "core/ep/plan.h"
#include "core/ep/slot.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "transport/exchange.h"
#include "transport/link.h"
#include "transport/windows.h"

namespace moe_ep::detail {

class AsyncState;

// One dispatch_v2 call: its arguments and what each step leaves for the next.
struct Dispatch {
  const char* op = "dispatch_v2";  // or the op that runs this route (run_dispatch)
  const DispatchInputs& in;
  const EpConfig& cfg;
  const Communicator& comm;
  const EpPlan* cached = nullptr;  // in.handle's plan
  // 1. validate
  OpHeader hdr;
  std::optional<Error> local;
  EpShape sh;
  World world;
  int64_t* perf = nullptr;
  bool quant = false;
  std::shared_ptr<EpPlan> plan;  // being made (null for a cached dispatch)
  DispatchOutputs out;
  // quant_mode 2: the int8 rows in send order (SPEC §1.5) and their dynamic scales. A Tensor,
  // not a std::vector: its zero fill cost a pass over fresh pages every call (the allocator's
  // block cache reuses mapped pages and fills nothing).
  std::shared_ptr<Tensor> qsend;
  std::shared_ptr<std::vector<float>> qsend_scale;
  // Shared-memory transport: expand_x's slot in this rank's window, or, when the window must
  // first grow, its allocation deferred until after the header agreement.
  bool shm_want = false, shm_defer = false;
  std::optional<ShmSlot> slot;
  // The caller's expand_x (DispatchInputs::out) when the rows land elsewhere first (a window
  // slot): the valid rows are copied there at the end.
  std::optional<TensorView> copy_to;
  // Rows of expand_x (and of expand_scales, dynamic_scales): max(1,T)*A, or with
  // EpConfig::exact_size the rows this call receives. sized_late: exact_size without a handle,
  // so those outputs are allocated after the counts phase (phase "exact sizes").
  int64_t out_rows = 0;
  bool sized_late = false;
  int64_t expand_bytes = 0, slot_need = 0, stream_min = 0;
  // 2. agree
  std::vector<OpHeader> headers;
  Windows* shm = nullptr;
  int W = 0, L = 0, me = 0;
  std::vector<Where> where;  // per world rank: its slot (this machine only)
  // comm_alg "hierarchy" across nodes: the ranks per node (0: the fullmesh route, also on one
  // node). Rows for a rank of another node go through this rank's relay there (SPEC §3).
  int G = 0;
  bool relayed(int d) const { return G > 0 && d / G != me / G; }
  int relay_on(int n) const { return n * G + me % G; }      // this rank's relay on node n
  int relay_of(int s) const { return me / G * G + s % G; }  // source s's relay on this node
  // 3. counts (or the cached plan)
  const EpPlan* p = nullptr;            // plan or cached
  std::vector<int32_t> distinct_count;  // new plan: per destination, the rows on the wire
  std::vector<int64_t> dest_rows;       // one machine: the rows each destination receives (else -1)
  int64_t out_row_bytes = 0;            // of expand_x (int8 with quant_mode 2)
  // 4. rows: per destination, the link its rows take (null: this rank itself).
  std::vector<const Link*> to;
  // Per source: its rows land in this rank's window (written by the source, or its relay).
  std::vector<char> window_from;
  bool any_message_to = false;
  // An asynchronous dispatch (dispatch_v2_start): where each source's rows are reported as they
  // land (land_each_source), else null.
  AsyncState* async = nullptr;

  Dispatch(const DispatchInputs& i, const EpConfig& c, const Communicator& m)
      : in(i), cfg(c), comm(m), world(whole_world(m)) {}
  const SendPlan& send() const { return p->send; }
  const RecvPlan& recv() const { return p->recv; }
  const std::vector<int>& peers() const { return world.peers; }
  // Null when x has no elements (H = 0: data may be null, and an offset from null is undefined).
  const char* x_row(int64_t token) const {
    if (in.x.data == nullptr) return nullptr;
    return in.x.ptr<char>() +
           token * in.x.strides[0] * static_cast<int64_t>(dtype_size(in.x.dtype));
  }
};

// The rows phase's buffers.
struct RowsPhase {
  explicit RowsPhase(const Dispatch& c)
      : row_bytes(c.out_row_bytes),
        meta_bytes(sizeof(RowMeta)),
        meta_in(c.W),
        meta_out(c.W),
        merged_in(c.W),
        announced(std::make_shared<std::vector<int64_t>>(4 * c.W, 0)) {}
  const int64_t row_bytes, meta_bytes;
  std::vector<std::shared_ptr<std::vector<RowMeta>>> meta_in, meta_out;
  // Rows of a merged source: its distinct tokens in the order of their first rows.
  std::vector<std::shared_ptr<Tensor>> merged_in;
  // Rows in shared memory announced: by each source to this rank, by this rank to each
  // destination, then the same of the rows relays write (comm_alg "hierarchy"): 4 runs of W.
  std::shared_ptr<std::vector<int64_t>> announced;
};

// comm_alg "hierarchy" across nodes (relay_dispatch.cc, SPEC §3).
// Step 3, each source: per remote node, its tokens bound there (EpPlan::node_tokens) and how many
// tokens and copies it relays through each relay (the counts message's two last entries).
void plan_relay_sends(Dispatch& c);
// Step 4a, phase "relay": every source sends each of its relays (one per remote node) the tokens
// bound to that node once, with the routing of every copy; every relay receives them.
struct RelayIn;
std::shared_ptr<RelayIn> exchange_relay(Dispatch& c);
// Step 4b, in phase "rows": the relay's copies to the ranks of its node (its own straight into its
// expand_x), and each rank's receives of the rows relayed to it.
void post_relayed_receives(Dispatch& c, Exchange& ex, RowsPhase& rx);
void relay_copies(Dispatch& c, Exchange& ex, RowsPhase& rx, const RelayIn& in);

// dispatch_v2's route run by `op` (its name in errors) with header op code `code` (kOpDispatch,
// or kOpCombineBackward, whose grad_out travels it). async: an asynchronous dispatch's state, to
// report each source's rows as they land (null: a synchronous call).
DispatchOutputs run_dispatch(const DispatchInputs& in, const EpConfig& cfg, const char* op,
                             int32_t code, AsyncState* async = nullptr);

}  // namespace moe_ep::detail
