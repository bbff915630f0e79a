// Internal: one combine_v2 call as its steps see it (combine.cc, the fullmesh route, and
// relay_combine.cc, the relays of comm_alg "hierarchy"): its arguments, its outputs and the value
// each step returns.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "core/ep/config.h"
#include "core/ep/handle.h"
#include "core/ep/header.h"
#include "core/ep/plan.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "transport/windows.h"

namespace moe_ep::detail {

// What combine_v2 sends back with each row when there is no handle, so the source can check that
// the row is the one its expert_ids expect at that position (a caller who reorders or edits
// expert_ids between dispatch and combine gets an error, not a wrong sum).
struct BackMeta {
  int32_t token;
  int32_t slot;
  int32_t expert;
};

class CombineRoute;
struct CombineSum;

// One combine_v2 call, the operation: what the caller gave, the rows it serves and the output it
// writes, and the value each step returns (Agreed, Layout, Located), which the steps after it
// read. The steps are the functions of combine.cc; run_combine calls them in order and keeps
// what they return.
struct Combine {
  const char* op = "combine_v2";  // or the op that runs this route (run_combine)
  // dispatch_v2_backward: every weight is 1 and the special experts add nothing.
  bool unit_terms = false;
  const CombineInputs& in;
  const EpConfig& cfg;
  const Communicator& comm;
  const EpPlan* plan = nullptr;  // in.handle's
  // This rank's header for the agreements, and a failure recorded for them (header.h).
  OpHeader hdr;
  std::optional<Error> local;
  // Step 1 (check_arguments), fixed from then on: the shapes, the world (W ranks, this rank me,
  // L local experts).
  EpShape sh;
  World world;
  int W = 0, L = 0, me = 0;
  int64_t* perf = nullptr;
  bool cq = false;  // comm_quant_mode 2
  // comm_alg "hierarchy": the dtype the relays' fp32 partial sums are rounded to before the
  // network (EpConfig::partials; int8 instead with comm_quant_mode 2).
  DType partials = DType::kF32;
  const TensorView* mask = nullptr;
  SendPlan own_back;                 // without a handle: what this rank sent in dispatch
  RecvPlan own_blocks;               // without a handle: what it holds now, from ep_send_counts
  const SendPlan* back = nullptr;    // what comes back to this rank, in its send order
  const RecvPlan* blocks = nullptr;  // what this rank holds for each source (own part with TP)
  int64_t tp_peer_rows = 0;          // T == 2: rows of the TP peer in expand_x, after its own
  Tensor out;
  // Step 2 on (provide, then agree for a staging slot it places): the rows this rank sends back, in
  // expand_x's row order, and where peers on this machine read them: expand_x in place (in_gen,
  // in_off), or a staging slot.
  std::shared_ptr<Tensor> rs_out;  // T == 2: the reduce-scattered rows (SPEC §2)
  bool shm_want = false, in_place = false, stage_defer = false;
  int in_gen = -1;
  int64_t in_off = 0, stage_bytes = 0;
  std::optional<ShmSlot> stage;
  std::shared_ptr<Tensor> qback;  // comm_quant_mode 2 without a stage: the int8 rows
  std::shared_ptr<std::vector<float>> qback_scale;
  int8_t* qrows = nullptr;              // comm_quant_mode 2: the int8 rows (stage or qback)
  float* qscales = nullptr;             // and their scales
  int64_t row_bytes = 0, wire_row = 0;  // a row in expand_x's dtype; on the way back
  // Step 3's value (agree): every rank's header, the windows of this machine and where each of
  // its ranks' rows lie, who reads whose rows in place, and the route the rows take.
  struct Agreed {
    std::vector<OpHeader> headers;  // per world rank
    Windows* shm = nullptr;         // when the call uses shared memory
    std::vector<Where> where;       // per world rank: where its rows lie (this machine only)
    std::vector<char> provide;      // per source: it reads this rank's rows in place
    std::vector<char> read;         // per owner: this rank reads its rows in place
    // Fullmesh, or the relays of comm_alg "hierarchy" (relay_combine.cc).
    std::unique_ptr<CombineRoute> route;
  };
  // Step 4's value (plan_layout): per owner, the first row (in its expand_x) and the rows of each
  // block it holds for this rank, their sum, and whether they are what expert_ids route to it
  // (the first disagreement: mismatch, raised once every row announced is taken).
  struct Layout {
    std::vector<std::vector<int64_t>> first_row, rows_of;
    std::vector<int64_t> announced;
    std::vector<char> agrees;
    std::optional<Error> mismatch;
  };
  // Step 5's value (move_rows): yrow[i*KS + k], the row holding y_ik; yscale, its int8 scale;
  // y_keep, the rows received through MPI, which the sum reads.
  struct Located {
    std::vector<const char*> yrow;
    std::vector<float> yscale;
    std::shared_ptr<Tensor> y_keep;
  };
  Agreed agreed;
  Layout layout;
  Located located;
  bool finished = false;  // phase "shm done" ran

  Combine(const CombineInputs& i, const EpConfig& c, const Communicator& m)
      : in(i), cfg(c), comm(m), world(whole_world(m)) {}
  const std::vector<int>& peers() const { return world.peers; }
  // The rows this rank serves: the TP sums, or expand_x.
  const TensorView& rows_src() const { return rs_out ? rs_out->view() : in.expand_x; }
  int64_t src_stride() const { return rows_src().strides[0] * int64_t(dtype_size(sh.dtype)); }
};

// How a combine's rows reach their sources: its route. The steps of combine.cc move the rows
// between this rank and the ranks the route reaches directly; the route moves the rest and sums.
// Fullmesh (combine.cc) reaches every rank directly; the relays of comm_alg "hierarchy" across
// nodes (relay_combine.cc, SPEC §3) reach the ranks of this node directly, and the rows of a
// token of another node go to its relay on this node, which sends back per (token, node) partial
// sums.
class CombineRoute {
 public:
  virtual ~CombineRoute() = default;
  // The ranks per node it routes for (0: fullmesh); a handle is replayed only on the same nodes.
  virtual int ranks_per_node() const = 0;
  // Whether rows travel straight between this rank and rank d, both ways.
  virtual bool direct(int d) const = 0;
  // Whether this rank still serves the other ranks' rows after its own rows failed their check
  // (an InvalidArgument of the direct steps, raised after the route's phases).
  virtual bool serves_others() const = 0;
  // Step 5, after the direct rows: the route's own phases. `sum` is this call's sum, which it may
  // run on this rank's located rows (`located`) while its transfers travel.
  virtual void move_rows(const Combine& c, CombineSum& sum, bool located) = 0;
  // Step 6: out from the located rows (sum.yrow) and whatever the route moved.
  virtual void sum(const CombineSum& sum) = 0;
};

// The routes: fullmesh (combine.cc) and the relays across nodes of G ranks (relay_combine.cc).
std::unique_ptr<CombineRoute> fullmesh_combine();
std::unique_ptr<CombineRoute> relay_combine(int G, int me);

// combine_v2's route run by `op` (its name in errors) with header op code `code` (kOpCombine, or
// kOpDispatchBackward with unit_terms: every weight 1, special experts adding nothing).
Tensor run_combine(const CombineInputs& in, const EpConfig& cfg, const char* op, int32_t code,
                   bool unit_terms);

}  // namespace moe_ep::detail
