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
class DispatchRoute;

// One dispatch_v2 call, the operation: what the caller gave, the outputs it writes, and the value
// each step returns (Agreed, Counted, RowLinks), which the steps after it read. The steps are the
// functions of dispatch.cc; run_dispatch calls them in order and keeps what they return.
struct Dispatch {
  const char* op = "dispatch_v2";  // or the op that runs this route (run_dispatch)
  const DispatchInputs& in;
  const EpConfig& cfg;
  const Communicator& comm;
  const EpPlan* cached = nullptr;  // in.handle's plan
  // An asynchronous dispatch (dispatch_v2_start): where each source's rows are reported as they
  // land (land_each_source), else null.
  AsyncState* async = nullptr;
  // This rank's header for the agreements, and a failure recorded for them (header.h).
  OpHeader hdr;
  std::optional<Error> local;
  // Step 1a (check_arguments), fixed from then on: the shapes, the world (W ranks, this rank me,
  // L local experts), the bytes of a row of expand_x (int8 with quant_mode 2).
  EpShape sh;
  World world;
  int W = 0, L = 0, me = 0;
  int64_t out_row_bytes = 0;
  int64_t* perf = nullptr;
  bool quant = false;
  int64_t stream_min = 0;
  // Step 1b on (allocate, then agree and agree_on_sizes for a slot they place): the outputs and
  // the memory they live in. plan: being made (null for a cached dispatch).
  std::shared_ptr<EpPlan> plan;
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
  int64_t expand_bytes = 0, slot_need = 0;
  // Step 2's value (agree): every rank's header, the windows of this machine and where each of its
  // ranks receives its rows, and the route the rows take.
  struct Agreed {
    std::vector<OpHeader> headers;  // per world rank
    Windows* shm = nullptr;         // when the call uses shared memory
    std::vector<Where> where;       // per world rank: its slot (this machine only)
    // Fullmesh, or the relays of comm_alg "hierarchy" (relay_dispatch.cc).
    std::unique_ptr<DispatchRoute> route;
  };

  // Step 3's value (plan_receives): the plan this call follows, and on one machine the rows each
  // destination receives (step 3d checks them against its slot).
  struct Counted {
    const EpPlan* p = nullptr;       // the new plan, or the handle's
    std::vector<int64_t> dest_rows;  // per destination; empty when not known
  };

  // Step 4's value (choose_links): per destination, the link its rows take (null: this rank
  // itself), and per source, whether its rows land in this rank's window (written by the source,
  // or its relay).
  struct RowLinks {
    std::vector<const Link*> to;
    std::vector<char> window_from;
    bool any_message_to = false;
  };
  Agreed agreed;
  Counted counted;
  RowLinks links;

  Dispatch(const DispatchInputs& i, const EpConfig& c, const Communicator& m)
      : in(i), cfg(c), comm(m), world(whole_world(m)) {}
  const SendPlan& send() const { return counted.p->send; }
  const RecvPlan& recv() const { return counted.p->recv; }
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

// How a dispatch's rows reach their ranks: its route. The steps of dispatch.cc move the rows
// between this rank and the ranks the route reaches directly; the route moves the rest, with a
// call at each step. Fullmesh (dispatch.cc) reaches every rank directly and adds nothing; the
// relays of comm_alg "hierarchy" across nodes (relay_dispatch.cc, SPEC §3) reach the ranks of
// this node directly and every other one through a relay on its node.
class DispatchRoute {
 public:
  virtual ~DispatchRoute() = default;
  // The ranks per node it routes for (0: fullmesh), kept in the plan: a handle is replayed only
  // on the same nodes.
  virtual int ranks_per_node() const = 0;
  // Whether rows travel straight between this rank and rank d, both ways.
  virtual bool direct(int d) const = 0;
  // Step 3a, a new plan: what the route moves besides the direct rows.
  virtual void plan_sends(const Dispatch& c) const = 0;
  // Step 3b across machines: the entries it adds to the counts message for each destination
  // (after the local experts' counts and the distinct tokens); put for destination d, taken from
  // source q's message.
  virtual int count_entries() const = 0;
  virtual void put_counts(const Dispatch& c, int d, std::vector<int32_t>& out) const = 0;
  virtual void take_counts(const Dispatch& c, int q, const int32_t* entries) const = 0;
  // Step 3c, shared memory across machines: a peer q on this machine learns where the blocks of
  // `block_runs()` sources start in this rank's expand_x, run m for source block_source(m, q);
  // this rank's own blocks in q's expand_x are run own_run() of what q sends, and keep_block_rows
  // keeps all of them.
  virtual int block_runs(int W) const = 0;
  virtual int block_source(int m, int q) const = 0;
  virtual int own_run() const = 0;
  virtual void keep_block_rows(EpPlan& p, int q, std::vector<int64_t>&& runs) const = 0;
  // Step 4a, before phase "rows": what must arrive first (a relay's tokens).
  virtual void before_rows(const Dispatch& c) = 0;
  // In phase "rows": the receives and the sends of the rows it moves.
  virtual void post_receives(const Dispatch& c, Exchange& ex, RowsPhase& rx) const = 0;
  virtual void post_sends(const Dispatch& c, Exchange& ex, RowsPhase& rx) = 0;
  // The peer whose receives in phase "rows" bring source s's rows to this rank (s itself when
  // direct; this rank: they are in place before the wait): source s has landed when every
  // receive from its carrier has completed (per-source completion, land_each_source). A source
  // that is not direct, carried by a peer, has its rows written into this rank's window when
  // this rank has a slot.
  virtual int carrier(int s) const = 0;
  // Once every receive from peer q (not this rank) has completed: the check of what q announced
  // it wrote into this rank's window for the route (a relay: the rows of the sources it relays).
  virtual void check_carried(const Dispatch& c, const RowsPhase& rx, int q) const = 0;
};

// The routes: fullmesh (dispatch.cc) and the relays across nodes of G ranks (relay_dispatch.cc).
std::unique_ptr<DispatchRoute> fullmesh_dispatch();
std::unique_ptr<DispatchRoute> relay_dispatch(int G, int me);

// The rows rank s announced it wrote into this rank's window (`what`: whose) against the counts.
void check_announced(const Dispatch& c, int s, int64_t announced, int64_t counted,
                     const char* what);

// dispatch_v2's route run by `op` (its name in errors) with header op code `code` (kOpDispatch,
// or kOpCombineBackward, whose grad_out travels it). async: an asynchronous dispatch's state, to
// report each source's rows as they land (null: a synchronous call).
DispatchOutputs run_dispatch(const DispatchInputs& in, const EpConfig& cfg, const char* op,
                             int32_t code, AsyncState* async = nullptr);

}  // namespace moe_ep::detail
