// dispatch_v2 / combine_v2 over MPI point-to-point (SPEC §1, §2).
//
// dispatch_v2, on every rank:
//   1. header:  validate locally, exchange an OpHeader with every rank, agree (exchange.h);
//   2. counts:  send rank d the L counts [d*L, d*L+L) (entries for each of its local experts),
//               receive L counts from every source: the receive layout (ep_recv_counts) follows;
//   3. rows:    the sender packs its rows for MPI destinations in send order (one parallel copy
//               of x's rows; strided x welcome) and sends one contiguous message per non-empty
//               block (destination d, local expert l); the receiver posts one receive per block
//               (l, s) straight into expand_x, so rows land at their final position (contiguous
//               messages take OpenMPI's single-copy path; derived datatypes did not, ~6x slower).
//               A second message per peer carries (token, slot, expert_scale) per row for
//               assist_info_for_combine and expand_scales. A rank's own rows are copied (or
//               quantised) straight into its expand_x, never sent to itself. Peers on this
//               machine with the shared-memory transport: see docs/design.md.
//               quant_mode 2: the sender builds the int8 row of every send-order entry (SPEC
//               §1.5; without smoothing scales each token is quantised once and its row copied
//               per entry), sends each destination its contiguous slice of H-byte rows, and the
//               metadata also carries each row's scale (-> dynamic_scales).
// combine_v2 is the way back: the expert side sends each source one contiguous message per block
// (l, s), straight from expand_x when its rows are contiguous (else from its rows packed in send
// order: s, then l, or the int8 rows of comm_quant_mode 2); its own rows it does not send (its
// sum reads them in place). The source recomputes dispatch's send order from expert_ids, learns
// each owner's per-block row counts first (phase "layout back"), receives peer d's block l after
// its block l - 1 at d's offset in that order (sized by those counts, so no receive is ever shorter
// than its message; a disagreement with expert_ids is reported after the rows phase), then
// reduces in the SPEC §2.3 order. Empty blocks send nothing: both sides know every block's count
// (dispatch's from its counts phase, combine's from "layout back"), so no message can be longer
// than its receive.
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "base/check.h"
#include "base/env.h"
#include "base/parallel.h"
#include "base/threads.h"
#include "core/ep_layout.h"
#include "core/validate.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/quant.h"
#include "moe_ep/dispatch.h"
#include "transport/mpi/exchange.h"
#include "transport/shm/context.h"

namespace moe_ep {

namespace {

using detail::EpShape;
using detail::Exchange;
using detail::MpiType;
using detail::OpHeader;

constexpr int32_t kOpDispatch = 1;
constexpr int32_t kOpCombine = 2;

struct RowMeta {
  int32_t token;
  int32_t slot;
  float scale;
  float qscale;  // quant_mode 2: the row's dynamic scale (SPEC §1.5); else 0
};

// dispatch_v2's slot in a receiver's shared-memory window: expand_x (expand_bytes), then, from
// the next 64-byte boundary, one RowMeta per row of expand_x (rows), which each sender on the
// machine writes next to its rows (no MPI message of metadata: a small one announces them).
int64_t dispatch_meta_offset(int64_t expand_bytes) { return (expand_bytes + 63) / 64 * 64; }
int64_t dispatch_slot_need(int64_t expand_bytes, int64_t rows) {
  return dispatch_meta_offset(expand_bytes) + rows * static_cast<int64_t>(sizeof(RowMeta));
}

// What combine_v2 sends back with each row, so the source can check that the row is the one its
// expert_ids expect at that position (a caller who reorders or edits expert_ids between dispatch
// and combine gets an error, not a wrong sum).
struct BackMeta {
  int32_t token;
  int32_t slot;
  int32_t expert;
  float qscale;  // comm_quant_mode 2: the row's dynamic scale; else 0
};

const Communicator& require_comm(const char* op, const EpConfig& cfg) {
  if (cfg.group_ep == nullptr) detail::invalid(op, ": group_ep is null");
  return *cfg.group_ep;
}

OpHeader base_header(int32_t op, const EpConfig& cfg) {
  OpHeader h;
  h.op = op;
  h.ep_world_size = cfg.ep_world_size;
  h.moe_expert_num = cfg.moe_expert_num;
  h.tp_world_size = cfg.tp_world_size;
  h.shared_expert_num = cfg.shared_expert_num;
  h.shared_expert_rank_num = cfg.shared_expert_rank_num;
  h.expert_shard_type = cfg.expert_shard_type;
  h.global_bs = cfg.global_bs;
  h.zero_expert_num = cfg.zero_expert_num;
  h.copy_expert_num = cfg.copy_expert_num;
  h.const_expert_num = cfg.const_expert_num;
  h.comm_alg = (cfg.comm_alg.empty() || cfg.comm_alg == "fullmesh") ? 0
               : cfg.comm_alg == "hierarchy"                        ? 1
                                                                    : 2;
  return h;
}

void record_failure(OpHeader& h, std::optional<Error>& local, Error e) {
  h.ok = 0;
  h.kind = static_cast<int32_t>(e.kind());
  std::strncpy(h.message, e.what(), sizeof(h.message) - 1);
  local.emplace(std::move(e));
}

// Runs the local validation `f`; a failure is recorded (not thrown) until the headers are agreed.
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

// BS may differ across ranks only with global_bs = W * m, m >= max BS, and then every token
// must be active (SPEC §1.3, §1.6).
void check_batch_sizes(const char* op, const std::vector<OpHeader>& h,
                       const std::vector<int>& peers, int64_t global_bs, const char* bs_name) {
  const int64_t W = static_cast<int64_t>(h.size());
  int64_t max_bs = 0, max_rank = 0;
  bool differ = false;
  for (int64_t p = 0; p < W; ++p) {
    if (h[p].BS != h[0].BS) differ = true;
    if (global_bs == 0 && h[p].BS != h[0].BS)
      detail::invalid(op, ": BS (", bs_name, ") differs across ranks with global_bs = 0: rank ",
                      peers[0], " has ", h[0].BS, ", rank ", peers[p], " has ", h[p].BS,
                      " (pass global_bs = ep_world_size * max BS)");
    if (h[p].BS > max_bs) max_bs = h[p].BS, max_rank = p;
  }
  if (global_bs > 0 && global_bs < W * max_bs)
    detail::invalid(op, ": global_bs = ", global_bs, " is less than ep_world_size * max BS = ", W,
                    " * ", max_bs, " = ", W * max_bs, " (rank ", peers[max_rank],
                    " has BS = ", max_bs, ")");
  if (differ)
    for (int64_t p = 0; p < W; ++p)
      if (!h[p].all_active)
        detail::invalid(op, ": x_active_mask on rank ", peers[p],
                        " has a False entry while BS differs across ranks (", bs_name,
                        "): when BS differs, every token must be active");
}

// quant_mode (dispatch_v2) / comm_quant_mode (combine_v2) must be equal on all ranks: the rows
// would otherwise differ in size on the wire (kInvalidArgument on every rank).
void check_quant_modes(const char* op, const std::vector<OpHeader>& h,
                       const std::vector<int>& peers, const char* name) {
  for (std::size_t p = 1; p < h.size(); ++p)
    if (h[p].quant_mode != h[0].quant_mode)
      detail::invalid(op, ": ", name, " differs across ranks: rank ", peers[0], " has ",
                      h[0].quant_mode, ", rank ", peers[p], " has ", h[p].quant_mode);
}

// Optional arguments outside this build's slice: kUnsupported naming the first one given.
void reject_given(const char* op, std::initializer_list<std::pair<const char*, bool>> given) {
  for (const auto& [name, is_given] : given)
    if (is_given) detail::unsupported(op, ": ", name, " is not supported by this build");
}

// The ranks an op runs on: all of group_ep, or the survivors of a scale-in (SPEC §1.7).
struct World {
  int64_t W = 1, S = 0, E = 1, rank = 0;  // of the (new) world
  std::vector<int> peers;                 // new rank -> group_ep rank
  bool removed = false;                   // this rank was scaled in: it takes no part
  int64_t hash = 0;                       // of the table when scaled down, else 0
};

// elastic_info: int32 (4 + 2W,) [is_scaled_down, new W, new S, new E, W x old->new (-1 removed),
// W x new->old (-1 padding)], checked for consistency.
// All of group_ep: the world of an op whose arguments failed before elastic_info was read.
World whole_world(const Communicator& comm) {
  World w;
  w.W = comm.size();
  w.rank = comm.rank();
  for (int p = 0; p < comm.size(); ++p) w.peers.push_back(p);
  return w;
}

World resolve_world(const char* op, const EpConfig& cfg, const std::optional<TensorView>& elastic) {
  World w;
  w.W = cfg.ep_world_size;
  w.S = cfg.shared_expert_rank_num;
  w.E = cfg.moe_expert_num;
  w.rank = cfg.ep_rank_id;
  w.peers.resize(w.W);
  for (int64_t p = 0; p < w.W; ++p) w.peers[p] = static_cast<int>(p);
  if (!elastic) return w;
  const TensorView& t = *elastic;
  const int64_t W = cfg.ep_world_size;
  detail::expect_tensor(op, "elastic_info", t, {DType::kI32}, 1);
  detail::expect_size(op, "elastic_info", t, 0, 4 + 2 * W, "4 + 2 * ep_world_size");
  auto at = [&](int64_t i) { return detail::index_at(t, i); };
  const int64_t flag = at(0);
  if (flag != 0 && flag != 1)
    detail::invalid(op, ": elastic_info[0] = ", flag, " (is_scaled_down) is not one of {0, 1}");
  if (flag == 0) return w;
  const int64_t nW = at(1), nS = at(2), nE = at(3);
  if (nW < 1 || nW > W)
    detail::invalid(op, ": elastic_info[1] = ", nW, " (new ep_world_size) is outside [1, ", W, "]");
  detail::check_placement(op, nW, nS, cfg.shared_expert_num, nE, " (elastic_info)");
  std::vector<int> seen(nW, -1);
  int64_t kept = 0;
  for (int64_t o = 0; o < W; ++o) {
    const int64_t n = at(4 + o);
    if (n == -1) continue;
    if (n < 0 || n >= nW)
      detail::invalid(op, ": elastic_info[", 4 + o, "] = ", n, " (new rank of old rank ", o,
                      ") is outside [0, ", nW, ") (new ep_world_size; -1 = removed)");
    if (seen[n] >= 0)
      detail::invalid(op, ": elastic_info[", 4 + o, "] = ", n, " repeats the new rank of old rank ",
                      seen[n], " (elastic_info[", 4 + seen[n], "])");
    seen[n] = static_cast<int>(o);
    ++kept;
  }
  if (kept != nW)
    detail::invalid(op, ": elastic_info[4..", 4 + W, ") keeps ", kept,
                    " ranks but elastic_info[1] (new ep_world_size) = ", nW);
  for (int64_t n = 0; n < W; ++n) {
    const int64_t o = at(4 + W + n), want = n < nW ? seen[n] : -1;
    if (o != want)
      detail::invalid(op, ": elastic_info[", 4 + W + n, "] = ", o, " (old rank of new rank ", n,
                      ") must be ", want, " (the inverse of elastic_info[4..", 4 + W,
                      "); -1 pads beyond the new ep_world_size)");
  }
  uint64_t hash = 1469598103934665603ull;
  for (int64_t i = 0; i < 4 + 2 * W; ++i)
    hash = (hash ^ static_cast<uint64_t>(at(i) + 2)) * 1099511628211ull;
  w.hash = static_cast<int64_t>(hash >> 1) | 1;
  w.W = nW;
  w.S = nS;
  w.E = nE;
  w.peers.assign(seen.begin(), seen.end());
  w.rank = at(4 + cfg.ep_rank_id);
  w.removed = w.rank < 0;
  return w;
}

// performance_info: int64 (W,), W = ep_world_size (group_ep's ranks), any stride.
int64_t* perf_ptr(const char* op, const std::optional<TensorView>& perf, const EpConfig& cfg) {
  if (!perf) return nullptr;
  detail::expect_tensor(op, "performance_info", *perf, {DType::kI64}, 1);
  detail::expect_size(op, "performance_info", *perf, 0, cfg.ep_world_size, "ep_world_size");
  if (perf->shape[0] > 1 && perf->strides[0] != 1)
    detail::unsupported(op, ": performance_info.stride(0) = ", perf->strides[0], " is not 1");
  return perf->ptr<int64_t>();
}

// scales (SPEC §1.3): fp32 (Ns + E, H) when shared-expert ranks host Ns experts, else (E, H),
// contiguous; quant_mode 2 only. Row Ns + e smooths MoE expert e, row s shared expert s.
void check_smooth_scales(const char* op, const TensorView& t, const EpShape& sh) {
  detail::expect_tensor(op, "scales", t, {DType::kF32}, 2);
  detail::expect_size(op, "scales", t, 0, sh.pl.Ns + sh.E,
                      sh.pl.Ns > 0 ? "shared_expert_num + moe_expert_num" : "moe_expert_num");
  detail::expect_size(op, "scales", t, 1, sh.H, "H, x.shape[1]");
  if ((t.shape[1] > 1 && t.strides[1] != 1) || (t.shape[0] > 1 && t.strides[0] != t.shape[1]))
    detail::invalid(op, ": scales must be contiguous (strides (", t.strides[0], ", ", t.strides[1],
                    ") for shape (", t.shape[0], ", ", t.shape[1], "))");
}

// The sizes every op derives from the world and its token tensor.
EpShape local_shape(const EpConfig& cfg, const World& w, int64_t BS, int64_t H, DType dtype) {
  EpShape sh;
  sh.pl = detail::make_placement(w.W, w.S, cfg.shared_expert_num, w.E,
                                 cfg.zero_expert_num + cfg.copy_expert_num + cfg.const_expert_num);
  sh.W = w.W;
  sh.rank = w.rank;
  sh.E = w.E;
  sh.L = sh.pl.local_experts(sh.rank);
  sh.BS = BS;
  sh.H = H;
  sh.dtype = dtype;
  return sh;
}

int to_int(int64_t v) {
  MOE_EP_CHECK(v >= 0 && v <= INT_MAX);
  return static_cast<int>(v);
}

// ---- Shared-memory transport (EpConfig::transport, docs/design.md) ---------------------------
// EpConfig::transport, or $MOE_EP_TRANSPORT when it is empty (default "shm").
int64_t resolve_transport(const char* op, const EpConfig& cfg) {
  std::string v = cfg.transport;
  if (v.empty()) v = detail::env_transport(op).value_or("shm");
  if (v == "mpi") return detail::kTransportMpi;
  if (v == "shm") return detail::kTransportShm;
  detail::invalid(op, ": transport = \"", v, "\" is not one of \"\", \"mpi\", \"shm\"");
}

// Whether a call uses the shared-memory transport: decided from agreed values only (transport,
// tp_world_size, the elastic_info hash), so every rank decides the same.
bool shm_applies(int64_t transport, const EpConfig& cfg, const World& w) {
  return transport == detail::kTransportShm && cfg.tp_world_size != 2 && w.hash == 0;
}

constexpr int64_t kMinShmBytes = int64_t{1} << 20;

// After the header agreement of a call that uses shm: the communicator's context, created
// (collectively over group_ep) on first use; a new window generation (collectively over the
// machine) when any rank of this machine asked for one (shm_grow: its segment too small, or full
// within ShmContext::should_grow's bound). `own_need`: the bytes this rank wants in one slot;
// its new segment holds two.
detail::ShmContext& ensure_shm(const Communicator& comm, const char* op,
                               const std::vector<OpHeader>& h, const std::vector<int>& peers,
                               int64_t own_need) {
  std::shared_ptr<detail::ShmContext>& ctx = detail::CommInternals::shm(comm);
  // A rank that timed out in the header phase sent its header all the same, so the others'
  // agreement does not prove it is still here. Before a blocking collective (which has no
  // deadline), every rank taking part confirms it passed the agreement (phase "shm ready", with
  // the deadline): a missing rank then shows up as kTimeout instead of a hang.
  auto confirm = [&](const std::vector<int>& with) {
    Exchange ex(comm, op, "shm ready");
    auto flags = std::make_shared<std::vector<int32_t>>(with.size() + 1, 1);
    ex.keep_alive(flags);
    for (std::size_t i = 0; i < with.size(); ++i) {
      if (with[i] == comm.rank()) continue;
      ex.irecv(flags->data() + i, 1, MPI_INT32_T, with[i], detail::kTagShmReady);
      ex.isend(flags->data() + with.size(), 1, MPI_INT32_T, with[i], detail::kTagShmReady);
    }
    ex.wait();
  };
  bool grow = false;
  if (!ctx) {
    confirm(peers);  // MPI_Comm_split_type is collective over group_ep
    ctx = detail::ShmContext::create(comm, op, h[0].shm_node_ranks);
    grow = true;
  } else {
    std::vector<int> node;
    for (std::size_t p = 0; p < h.size(); ++p) {
      if (ctx->node_of(peers[p]) < 0) continue;
      node.push_back(peers[p]);
      if (h[p].shm_grow) grow = true;
    }
    if (grow) confirm(node);  // MPI_Win_allocate_shared is collective over the machine
  }
  if (grow)
    ctx->grow(std::max({ctx->capacity(), 2 * detail::ShmContext::slot_bytes(own_need), kMinShmBytes,
                        comm.shm_window_bytes()}),
              op);
  return *ctx;
}

// A row to copy (parallel_copy).
struct RowCopy {
  const char* src;
  char* dst;
  int64_t key;  // the source row's index (>= 0): rows with one key have one src
};

// Orders rows by key (a counting sort: stable, linear in rows and keys; a comparison sort of
// dispatch's 4096 copies took about 0.1 ms) and returns the start of each run of one key, then
// rows.size(): group t is rows [first[t], first[t + 1]).
template <class Row>
std::vector<int64_t> group_by_src(std::vector<Row>& rows) {
  int64_t keys = 0;
  for (const Row& r : rows) keys = std::max(keys, r.key + 1);
  std::vector<int64_t> first, at(static_cast<std::size_t>(keys) + 1, 0);
  for (const Row& r : rows) ++at[static_cast<std::size_t>(r.key) + 1];
  for (int64_t k = 0; k < keys; ++k) {
    if (at[k + 1] > 0) first.push_back(at[k]);
    at[k + 1] += at[k];
  }
  first.push_back(static_cast<int64_t>(rows.size()));
  std::vector<Row> sorted(rows.size());
  for (const Row& r : rows) sorted[static_cast<std::size_t>(at[r.key]++)] = r;
  rows.swap(sorted);
  return first;
}

// Row copies over all threads (large buffers: the copy is the transport). The copies are grouped
// by source row and each group is one copy_row_to: a token sent to several experts is read once
// and its destinations are written side by side, which keeps more stores in flight than one row
// at a time (measured faster: docs/performance.md). stream: non-temporal stores (stream_min_bytes).
// Reorders rows.
void parallel_copy(std::vector<RowCopy>& rows, int64_t row_bytes, bool stream = false) {
  const std::vector<int64_t> first = group_by_src(rows);
  std::vector<void*> dst;
  for (const RowCopy& r : rows) dst.push_back(r.dst);
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t groups = static_cast<int64_t>(first.size()) - 1;
  detail::parallel(detail::threads_if(n * row_bytes > (int64_t{1} << 16)), [&] {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < groups; ++t)
      detail::copy_row_to(dst.data() + first[t], first[t + 1] - first[t], rows[first[t]].src,
                          static_cast<std::size_t>(row_bytes), stream);
  });
}

// quant_mode 2 without smoothing scales: every copy of a token quantises to the same bytes. Like
// parallel_copy, grouped by source row, but each group is quantised once and its int8 row stored
// to all its destinations in the same pass (detail::quantize_rows_int8_to, OpenMP inside), so
// the quantisation runs between the stores instead of before them. scales[j] gets the dynamic
// scale of each send-order entry j (+0 for every entry when h == 0: an empty row). Reorders rows.
struct QuantCopy {
  const char* src;  // the token's row of x (null when h == 0)
  char* dst;        // h int8 values
  int64_t key;      // the token
  int64_t j;        // send-order entry
};
void parallel_quantize(std::vector<QuantCopy>& rows, int64_t h, DType dtype, float* scales,
                       bool stream = false) {
  if (rows.empty()) return;
  if (h == 0) {
    for (const QuantCopy& r : rows) scales[r.j] = 0.0f;
    return;
  }
  const std::vector<int64_t> first = group_by_src(rows);
  const int64_t groups = static_cast<int64_t>(first.size()) - 1;
  std::vector<const void*> src;
  std::vector<int8_t*> dst;
  for (int64_t t = 0; t < groups; ++t) src.push_back(rows[first[t]].src);
  for (const QuantCopy& r : rows) dst.push_back(reinterpret_cast<int8_t*>(r.dst));
  std::vector<float> group_scale(src.size());
  detail::quantize_rows_int8_to(src.data(), dtype, groups, h, dst.data(), first.data(),
                                group_scale.data(), stream);
  for (int64_t t = 0; t < groups; ++t)
    for (int64_t r = first[t]; r < first[t + 1]; ++r) scales[rows[r].j] = group_scale[t];
}

// ---- Tensor parallelism, tp_world_size 2 (SPEC §1.1 step 3, §2) --------------------------------
// A TP pair (group_tp, 2 ranks) is the same EP rank (same expert, L = 1) of two EP groups.
// dispatch_v2 appends the peer's rows after this rank's own, PACKED: own rows [0, valid_own), the
// peer's [valid_own, valid_own + valid_peer), unspecified up to 2A; ep_recv_counts (2W,) is ONE
// inclusive running sum (the second W entries continue from valid_own and describe the peer's
// blocks by source rank). combine_v2 reduce-scatters the partial outputs over the pair, then runs
// the EP all-to-all on the sums. Tags distinct from the EP phases'.
constexpr int kTagTpHeader = 0x4d31;
constexpr int kTagTpCounts = 0x4d32;
constexpr int kTagTpRows = 0x4d33;
constexpr int kTagTpAssist = 0x4d34;
constexpr int kTagTpScales = 0x4d35;
constexpr int kTagTpDynScales = 0x4d36;

// Rows of expand_x (and expand_scales, dynamic_scales): max(1, T) * A.
int64_t tp_rows(const EpConfig& cfg, int64_t A) { return cfg.tp_world_size == 2 ? 2 * A : A; }

// This rank takes part in a TP pair (the arguments may still fail validation).
bool tp_pair(const EpConfig& cfg) {
  return cfg.tp_world_size == 2 && cfg.group_tp != nullptr && cfg.group_tp->size() == 2;
}

// Scale-in with TP is not implemented: checked before a removed rank would leave.
void reject_tp_scale_in(const char* op, const Communicator& comm, const EpConfig& cfg, World& w) {
  if (cfg.tp_world_size != 2 || w.hash == 0) return;
  // Every rank of group_ep, removed ones included, reports the error through the header
  // agreement of the whole (old) world, and the TP header, so that no rank waits for another.
  const int64_t hash = w.hash;
  w = whole_world(comm);
  w.hash = hash;
  detail::unsupported(op,
                      ": elastic_info scale-in (is_scaled_down = 1) with tp_world_size = 2 "
                      "is not supported by this build");
}

// What the two ranks of a TP pair tell each other before the EP header agreement.
struct TpHeader {
  int32_t magic = 0x4d4f5450;  // "MOTP"
  int32_t op = 0;
  int32_t ok = 1;
  int32_t kind = 0;
  int64_t ep_rank_id = 0, ep_world_size = 0, moe_expert_num = 0, shared_expert_rank_num = 0, H = 0,
          dtype = 0, A = 0;
  int64_t own_rows = -1, peer_rows = -1;  // combine_v2: the valid rows of each half of expand_x
  char message[400] = {};
};

TpHeader tp_header(const EpConfig& cfg, const EpShape& sh, int64_t own_rows, int64_t peer_rows) {
  TpHeader t;
  t.ep_rank_id = cfg.ep_rank_id;
  t.ep_world_size = cfg.ep_world_size;
  t.moe_expert_num = cfg.moe_expert_num;
  t.shared_expert_rank_num = cfg.shared_expert_rank_num;
  t.H = sh.H;
  t.dtype = static_cast<int64_t>(sh.dtype);
  t.A = sh.A;
  t.own_rows = own_rows;
  t.peer_rows = peer_rows;
  return t;
}

// Exchanges TpHeaders with the TP peer (phase "tp header", the communicator's deadline). A
// failure on either rank, or a disagreement within the pair, becomes a local failure of both
// ranks (kRemote naming the peer's message, or kInvalidArgument), so the EP header agreement that
// follows carries it to both EP groups: no rank is left waiting for data.
void tp_handshake(const char* op, const EpConfig& cfg, OpHeader& hdr, std::optional<Error>& local,
                  TpHeader mine) {
  const Communicator& tp = *cfg.group_tp;
  const int peer = 1 - tp.rank();
  mine.op = hdr.op;
  mine.ok = hdr.ok;
  mine.kind = hdr.kind;
  std::memcpy(mine.message, hdr.message, sizeof(mine.message));
  mine.message[sizeof(mine.message) - 1] = '\0';
  auto theirs = std::make_shared<TpHeader>();
  auto sent = std::make_shared<TpHeader>(mine);
  {
    Exchange ex(tp, op, "tp header");
    ex.keep_alive(theirs);
    ex.keep_alive(sent);
    ex.irecv(theirs.get(), static_cast<int>(sizeof(TpHeader)), MPI_BYTE, peer, kTagTpHeader);
    ex.isend(sent.get(), static_cast<int>(sizeof(TpHeader)), MPI_BYTE, peer, kTagTpHeader);
    ex.wait();
  }
  if (local) return;  // this rank's own error comes first
  theirs->message[sizeof(theirs->message) - 1] = '\0';
  const TpHeader& t = *theirs;
  capture(hdr, local, [&] {
    if (t.magic != mine.magic || t.op != mine.op)
      detail::invalid(op, ": the TP peer (group_tp rank ", peer, ") is not running ", op,
                      " (both ranks of a TP pair must call the same ops in the same order)");
    if (t.ok == 0)
      throw Error(ErrorKind::kRemote,
                  detail::cat(op, ": TP peer (group_tp rank ", peer, ") failed: ", t.message));
    const std::pair<const char*, int64_t TpHeader::*> equal[] = {
        {"ep_rank_id", &TpHeader::ep_rank_id},
        {"ep_world_size", &TpHeader::ep_world_size},
        {"moe_expert_num", &TpHeader::moe_expert_num},
        {"shared_expert_rank_num", &TpHeader::shared_expert_rank_num},
        {"H", &TpHeader::H},
        {"dtype", &TpHeader::dtype},
        {"A (the receive capacity: global_bs, BS and K)", &TpHeader::A}};
    for (const auto& [name, field] : equal)
      if (mine.*field != t.*field)
        detail::invalid(op, ": ", name, " differs within the TP pair: group_tp rank ", tp.rank(),
                        " has ", mine.*field, ", rank ", peer, " has ", t.*field,
                        " (the ranks of a TP pair hold the same expert of the same EP rank)");
    if (mine.own_rows != t.peer_rows || mine.peer_rows != t.own_rows)
      detail::invalid(op, ": ep_send_counts disagree within the TP pair: group_tp rank ", tp.rank(),
                      " has ", mine.own_rows, " own rows and ", mine.peer_rows,
                      " of its peer, rank ", peer, " has ", t.own_rows, " own rows and ",
                      t.peer_rows, " of its peer (pass dispatch_v2's ep_recv_counts and rows)");
  });
}

// dispatch_v2's TP all-gather (SPEC §1.1 step 3), after the EP exchange: this rank's `own` valid
// rows with their ep_recv_counts, assist triples, expand_scales (and dynamic_scales when defined)
// go to the TP peer; the peer's land after them. Rewrites ep_recv_counts (2W), expert_token_nums
// and tp_recv_counts (2).
void tp_all_gather(const char* op, const EpConfig& cfg, const EpShape& sh, int64_t own,
                   DispatchOutputs& out) {
  const Communicator& tp = *cfg.group_tp;
  const int tp_rank = tp.rank(), peer = 1 - tp_rank;
  const int64_t WL = sh.W * sh.L;
  const int64_t total = out.expand_x.size(0), cap = total - own;
  const int64_t row_bytes = sh.H * static_cast<int64_t>(dtype_size(out.expand_x.dtype()));
  const bool dyn = out.dynamic_scales.defined();
  MOE_EP_CHECK(own >= 0 && cap >= 0 && out.expand_scales.numel() == total);
  MOE_EP_CHECK(!dyn || out.dynamic_scales.numel() == total);
  auto counts_out = std::make_shared<std::vector<int32_t>>(out.ep_recv_counts.ptr<int32_t>(),
                                                           out.ep_recv_counts.ptr<int32_t>() + WL);
  auto counts_in = std::make_shared<std::vector<int32_t>>(WL, 0);
  MPI_Status scales_status{};
  {
    Exchange ex(tp, op, "tp rows");
    ex.keep_alive(counts_out);
    ex.keep_alive(counts_in);
    for (const Tensor* t :
         {&out.expand_x, &out.assist_info_for_combine, &out.expand_scales, &out.dynamic_scales})
      if (t->defined()) ex.keep_alive(std::make_shared<Tensor>(*t));
    const MpiType row(row_bytes, op);
    char* x = out.expand_x.ptr<char>();
    int32_t* assist = out.assist_info_for_combine.ptr<int32_t>();
    float* scales = out.expand_scales.ptr<float>();
    ex.irecv(counts_in->data(), to_int(WL), MPI_INT32_T, peer, kTagTpCounts);
    ex.irecv(x + own * row_bytes, to_int(cap), row.get(), peer, kTagTpRows);
    ex.irecv(assist + 3 * own, to_int(3 * cap), MPI_INT32_T, peer, kTagTpAssist);
    ex.irecv(scales + own, to_int(cap), MPI_FLOAT, peer, kTagTpScales);
    if (dyn)
      ex.irecv(out.dynamic_scales.ptr<float>() + own, to_int(cap), MPI_FLOAT, peer,
               kTagTpDynScales);
    ex.isend(counts_out->data(), to_int(WL), MPI_INT32_T, peer, kTagTpCounts);
    ex.isend(x, to_int(own), row.get(), peer, kTagTpRows);
    ex.isend(assist, to_int(3 * own), MPI_INT32_T, peer, kTagTpAssist);
    ex.isend(scales, to_int(own), MPI_FLOAT, peer, kTagTpScales);
    if (dyn)
      ex.isend(out.dynamic_scales.ptr<float>(), to_int(own), MPI_FLOAT, peer, kTagTpDynScales);
    ex.wait();
    scales_status = ex.recv_status(3);
  }
  const int64_t peer_rows = WL > 0 ? counts_in->back() : 0;
  int got = 0;
  detail::check_mpi(MPI_Get_count(&scales_status, MPI_FLOAT, &got), op, "MPI_Get_count");
  MOE_EP_CHECK(got == peer_rows && peer_rows <= cap);

  Tensor counts = Tensor::empty(DType::kI32, {2 * WL});
  int32_t* c = counts.ptr<int32_t>();
  std::copy(counts_out->begin(), counts_out->end(), c);
  for (int64_t b = 0; b < WL; ++b) c[WL + b] = static_cast<int32_t>(own + (*counts_in)[b]);
  out.ep_recv_counts = counts;
  // L = 1: the running sum and the count are the same.
  out.expert_token_nums.ptr<int64_t>()[0] = own + peer_rows;
  out.tp_recv_counts = Tensor::empty(DType::kI32, {2});
  out.tp_recv_counts.ptr<int32_t>()[tp_rank] = static_cast<int32_t>(own);
  out.tp_recv_counts.ptr<int32_t>()[peer] = static_cast<int32_t>(peer_rows);
}

// combine_v2's blocks: with tp_world_size 2 (L = 1), ep_send_counts (2W,) is one inclusive
// running sum over this rank's blocks, then the peer's; returns this rank's blocks and sets
// `peer_rows`. tp_send_counts (optional) must be dispatch_v2's tp_recv_counts.
detail::RecvPlan combine_blocks(const char* op, const EpConfig& cfg, const CombineInputs& in,
                                const EpShape& sh, int64_t& peer_rows) {
  peer_rows = 0;
  if (cfg.tp_world_size != 2)
    return detail::plan_recvs_from_inclusive(op, in.ep_send_counts, sh.W, sh.L,
                                             in.expand_x.shape[0]);
  MOE_EP_CHECK(sh.L == 1);
  const TensorView& c = in.ep_send_counts;
  detail::expect_tensor(op, "ep_send_counts", c, {DType::kI32}, 1);
  if (c.shape[0] != 2 * sh.W)
    detail::invalid(op, ": ep_send_counts.shape[0] = ", c.shape[0],
                    " must equal 2 * ep_world_size * L = 2 * ", sh.W, " * 1 = ", 2 * sh.W,
                    " with tp_world_size = 2 (dispatch_v2's ep_recv_counts)");
  detail::RecvPlan own =
      detail::plan_recvs_from_inclusive(op, c, 2 * sh.W, 1, in.expand_x.shape[0]);
  const int64_t total = own.valid;
  own.inclusive.resize(sh.W);
  own.block_offset.resize(sh.W);
  own.block_rows.resize(sh.W);
  own.source_rows.resize(sh.W);
  own.valid = own.inclusive.back();
  peer_rows = total - own.valid;
  if (peer_rows > sh.A)
    detail::invalid(op, ": ep_send_counts describe ", peer_rows,
                    " rows of the TP peer, more than the receive capacity A = ", sh.A);
  if (in.tp_send_counts) {
    const TensorView& t = *in.tp_send_counts;
    detail::expect_tensor(op, "tp_send_counts", t, {DType::kI32}, 1);
    detail::expect_size(op, "tp_send_counts", t, 0, 2, "tp_world_size");
    const int64_t r = cfg.tp_rank_id,
                  want[2] = {r == 0 ? own.valid : peer_rows, r == 0 ? peer_rows : own.valid};
    for (int64_t i = 0; i < 2; ++i)
      if (detail::index_at(t, i) != want[i])
        detail::invalid(op, ": tp_send_counts[", i, "] = ", detail::index_at(t, i), " but ",
                        "ep_send_counts give ", want[i], " rows of tp rank ", i,
                        " (pass dispatch_v2's tp_recv_counts)");
  }
  return own;
}

// combine_v2's TP reduce-scatter (SPEC §2): this rank's partials for the peer's rows
// [own, own + peer_rows) go to the peer; the peer's partials for this rank's rows [0, own) come
// back; rs_out[j] = fp32(partial of tp rank 0) + fp32(partial of tp rank 1), rounded once to the
// dtype (the same bits on both ranks of the pair). Row counts were agreed in the TP header.
std::shared_ptr<Tensor> tp_reduce_scatter(const char* op, const EpConfig& cfg,
                                          const CombineInputs& in, const EpShape& sh, int64_t own,
                                          int64_t peer_rows) {
  const Communicator& tp = *cfg.group_tp;
  const int tp_rank = tp.rank(), peer = 1 - tp_rank;
  const int64_t esize = static_cast<int64_t>(dtype_size(sh.dtype)), row_bytes = sh.H * esize;
  const int64_t stride = in.expand_x.strides[0] * esize;
  const char* x = static_cast<const char*>(in.expand_x.data);
  auto send = std::make_shared<std::vector<char>>(static_cast<std::size_t>(peer_rows * row_bytes));
  auto recv = std::make_shared<std::vector<char>>(static_cast<std::size_t>(own * row_bytes));
  for (int64_t j = 0; j < peer_rows; ++j)
    std::memcpy(send->data() + j * row_bytes, x + (own + j) * stride,
                static_cast<std::size_t>(row_bytes));
  {
    Exchange ex(tp, op, "tp reduce-scatter");
    ex.keep_alive(send);
    ex.keep_alive(recv);
    const MpiType row(row_bytes, op);
    ex.irecv(recv->data(), to_int(own), row.get(), peer, kTagTpRows);
    ex.isend(send->data(), to_int(peer_rows), row.get(), peer, kTagTpRows);
    ex.wait();
  }
  auto rs = std::make_shared<Tensor>(Tensor::empty(sh.dtype, {own, sh.H}));
  std::vector<float> acc(static_cast<std::size_t>(sh.H));
  for (int64_t j = 0; j < own; ++j) {
    const char* mine = x + j * stride;
    const char* theirs = recv->data() + j * row_bytes;
    const char* p0 = tp_rank == 0 ? mine : theirs;
    const char* p1 = tp_rank == 0 ? theirs : mine;
    for (int64_t h = 0; h < sh.H; ++h)
      acc[h] = detail::load_f32(p0, sh.dtype, h) + detail::load_f32(p1, sh.dtype, h);
    detail::store_row_f32(rs->ptr<char>() + j * row_bytes, sh.dtype, acc.data(), sh.H);
  }
  return rs;
}

}  // namespace

void detail::check_transport_environment(const char* op, const std::string& transport) {
  EpConfig cfg;
  cfg.transport = transport;
  resolve_transport(op, cfg);
  detail::check_env(op, true, !transport.empty());
}

DispatchOutputs dispatch_v2(const DispatchInputs& in, const EpConfig& cfg) {
  const char* op = "dispatch_v2";
  const Communicator& comm = require_comm(op, cfg);
  OpHeader hdr = base_header(kOpDispatch, cfg);
  hdr.BS = in.x.ndim >= 1 ? in.x.shape[0] : -1;
  hdr.H = in.x.ndim == 2 ? in.x.shape[1] : -1;
  hdr.K = in.expert_ids.ndim == 2 ? in.expert_ids.shape[1] : -1;
  hdr.dtype = static_cast<int64_t>(in.x.dtype);
  hdr.quant_mode = static_cast<int32_t>(in.quant_mode);

  std::optional<Error> local;
  EpShape sh;
  World world = whole_world(comm);
  detail::SendPlan send;
  DispatchOutputs out;
  int64_t* perf = nullptr;
  const bool quant = in.quant_mode == 2;
  // quant_mode 2: the int8 rows in send order (SPEC §1.5) and their dynamic scales.
  // Not a std::vector: its zero fill cost a pass over fresh pages every call (the allocator's
  // block cache reuses mapped pages and fills nothing).
  std::shared_ptr<Tensor> qsend;
  std::shared_ptr<std::vector<float>> qsend_scale;
  // Shared-memory transport: expand_x's slot in this rank's window, or, when the window must
  // first grow, its allocation deferred until after the header agreement.
  bool shm_want = false, shm_defer = false;
  std::optional<detail::ShmSlot> slot;
  int64_t expand_bytes = 0, slot_need = 0, stream_min = 0;
  capture(hdr, local, [&] {
    if (in.caller_error) throw *in.caller_error;
    hdr.transport = resolve_transport(op, cfg);
    stream_min = detail::env_stream_min_bytes(op);
    hdr.shm_node_ranks = detail::env_shm_node_ranks(op);
    detail::check_ep_config(op, cfg, comm.rank(), comm.size());
    world = resolve_world(op, cfg, in.elastic_info);
    hdr.elastic = world.hash;
    reject_tp_scale_in(op, comm, cfg, world);
    if (in.quant_mode != 0 && in.quant_mode != 2)
      detail::invalid(op, ": quant_mode = ", in.quant_mode, " is not one of {0, 2}");
    if (in.scales && in.quant_mode != 2)
      detail::invalid(op, ": scales (smoothing factors) are given but quant_mode = ", in.quant_mode,
                      "; they apply to quant_mode 2 (int8) only");
    if (in.expert_token_nums_type != 0 && in.expert_token_nums_type != 1)
      detail::invalid(op, ": expert_token_nums_type = ", in.expert_token_nums_type,
                      " is not one of {0, 1}");
    perf = perf_ptr(op, in.performance_info, cfg);
    detail::expect_rows(op, "x", in.x);
    sh = local_shape(cfg, world, in.x.shape[0], in.x.shape[1], in.x.dtype);
    detail::check_expert_ids(op, in.expert_ids, sh.BS, sh.E, sh.pl.special);
    sh.K = in.expert_ids.shape[1];
    sh.KS = sh.K + sh.pl.Ns;
    if (in.x_active_mask) {
      detail::check_active_mask(op, *in.x_active_mask, sh.BS, sh.K);
      hdr.all_active = detail::mask_all_true(*in.x_active_mask) ? 1 : 0;
    }
    if (in.expert_scales) detail::check_expert_scales(op, *in.expert_scales, sh.BS, sh.K);
    if (in.scales) check_smooth_scales(op, *in.scales, sh);
    if (world.removed) return;
    detail::compute_capacity(op, cfg.global_bs, sh);
    const detail::Activity act{&in.expert_ids, in.x_active_mask ? &*in.x_active_mask : nullptr};
    send = detail::plan_sends(act, sh.pl, sh.rank);
    // Allocated before the header exchange, so an allocation failure on one rank is reported to
    // every rank instead of leaving them waiting for its rows.
    const DType out_dtype = quant ? DType::kI8 : sh.dtype;
    expand_bytes = tp_rows(cfg, sh.A) * sh.H * static_cast<int64_t>(dtype_size(out_dtype));
    slot_need = dispatch_slot_need(expand_bytes, tp_rows(cfg, sh.A));
    shm_want = shm_applies(hdr.transport, cfg, world);
    if (shm_want) {
      const auto& ctx = detail::CommInternals::shm(comm);
      if (ctx) slot = ctx->try_alloc(slot_need);
      // No window yet, or ShmContext::should_grow (one too small, or full within a bound): all
      // ranks of the machine grow it after the agreement. Otherwise: MPI for this call.
      if (!slot && (!ctx || ctx->should_grow(slot_need))) hdr.shm_grow = 1, shm_defer = true;
    }
    if (slot)
      out.expand_x = detail::TensorInternals::wrap(slot->token, slot->ptr, out_dtype,
                                                   {tp_rows(cfg, sh.A), sh.H});
    else if (!shm_defer)
      out.expand_x = Tensor::empty(out_dtype, {tp_rows(cfg, sh.A), sh.H});
    if (quant) {
      out.dynamic_scales = Tensor::zeros(DType::kF32, {tp_rows(cfg, sh.A)});
      const int64_t n = static_cast<int64_t>(send.order.size());
      // With shm the int8 rows for peers on this machine are written straight into their
      // expand_x; the send buffer is allocated later, only if some peer needs MPI.
      if (!shm_want) qsend = std::make_shared<Tensor>(Tensor::empty(DType::kI8, {n * sh.H}));
      qsend_scale = std::make_shared<std::vector<float>>(static_cast<std::size_t>(n));
    }
    // Only the first 3 * valid entries are written (SPEC §1.4: opaque, only those are read).
    out.assist_info_for_combine = Tensor::empty(DType::kI32, {std::max(sh.BS * sh.K, sh.A * 128)});
    out.expand_scales = Tensor::zeros(DType::kF32, {tp_rows(cfg, sh.A)});
  });
  if (world.removed && !local) {
    // Scaled in (SPEC §1.7): this rank takes no part; its outputs are empty.
    out.expand_x = Tensor::zeros(quant ? DType::kI8 : sh.dtype, {0, sh.H});
    if (quant) out.dynamic_scales = Tensor::zeros(DType::kF32, {0});
    out.assist_info_for_combine = Tensor::zeros(DType::kI32, {0});
    out.expand_scales = Tensor::zeros(DType::kF32, {0});
    out.expert_token_nums = Tensor::zeros(DType::kI64, {0});
    out.ep_recv_counts = Tensor::zeros(DType::kI32, {0});
    out.tp_recv_counts = Tensor::zeros(DType::kI32, {1});
    return out;
  }
  if (local && world.removed) throw *local;
  if (tp_pair(cfg)) tp_handshake(op, cfg, hdr, local, tp_header(cfg, sh, -1, -1));
  const auto headers =
      detail::agree_on_headers(comm, world.peers, op, hdr, local ? &*local : nullptr, perf);
  check_batch_sizes(op, headers, world.peers, cfg.global_bs, "x.shape[0]");
  check_quant_modes(op, headers, world.peers, "quant_mode");

  const int W = to_int(sh.W), L = to_int(sh.L), me = to_int(sh.rank);
  const std::vector<int>& peers = world.peers;
  detail::ShmContext* shm = nullptr;
  if (shm_applies(headers[0].transport, cfg, world)) {
    MOE_EP_CHECK(shm_want);
    shm = &ensure_shm(comm, op, headers, peers, slot_need);
    if (shm_defer) {
      slot = shm->try_alloc(slot_need);
      MOE_EP_CHECK(slot.has_value());
      out.expand_x = detail::TensorInternals::wrap(
          slot->token, slot->ptr, quant ? DType::kI8 : sh.dtype, {tp_rows(cfg, sh.A), sh.H});
    }
  }
  // Over plain MPI a token goes to a peer once, however many of its experts live there, and the
  // peer copies it to each (docs/design.md, dispatch_v2 step 4), when that sends at most 3/4 of
  // the rows; not to peers reached through shared memory (one copy already), nor when quant_mode 2
  // with smoothing scales gives each copy its own bytes. distinct[d]: the send-order entry of
  // each token's first copy to d, in send order (the order the tokens travel in, which the
  // receiver finds again in the metadata); empty where d gets every copy.
  std::vector<std::vector<int64_t>> distinct(W);
  std::vector<int32_t> distinct_count(W);
  {
    const bool may_merge = sh.H > 0 && !(quant && in.scales);
    std::vector<int32_t> seen(may_merge ? static_cast<std::size_t>(sh.BS) : 0, -1);
    for (int d = 0; d < W; ++d) {
      const int64_t first = send.rank_offset[d], n = send.rank_offset[d + 1] - first;
      distinct_count[d] = static_cast<int32_t>(n);
      if (!may_merge || d == me || (shm && shm->node_of(peers[d]) >= 0)) continue;
      std::vector<int64_t>& u = distinct[d];
      for (int64_t j = first; j < first + n; ++j) {
        const int64_t i = send.order[j] / sh.KS;
        if (seen[i] != d) seen[i] = d, u.push_back(j);
      }
      if (4 * static_cast<int64_t>(u.size()) > 3 * n) {
        u.clear();  // too little to merge for the receiver's extra copy of every row
        continue;
      }
      distinct_count[d] = static_cast<int32_t>(u.size());
    }
  }
  // On one machine (every rank of the op on this rank's node, shared memory to each), the counts
  // phase is an all-gather of each rank's whole count vector and of where its window slot lies:
  // each sender then computes where its rows go in every receiver's window, and the "shm
  // offsets" phase below is skipped (one round fewer: docs/performance.md, "Small batches").
  // shared[p]: rank p's message, T = blocks() int32 counts, then (as int64, 8 int32 entries) its
  // slot's generation (-1: none), the offsets of its rows and of their metadata in its segment,
  // and the rows the slot holds.
  const bool one_node = shm != nullptr && std::all_of(peers.begin(), peers.end(),
                                                      [&](int r) { return shm->node_of(r) >= 0; });
  const int64_t T = sh.pl.blocks(), shared_len = T + 8;
  const int64_t meta_at = dispatch_meta_offset(expand_bytes);
  std::shared_ptr<std::vector<int32_t>> shared;
  auto slot_field = [&](int p, int f) {  // field f of rank p's slot, as int64
    int64_t v = 0;
    std::memcpy(&v, shared->data() + p * shared_len + T + 2 * f, sizeof v);
    return v;
  };
  std::vector<int32_t> from_source(static_cast<std::size_t>(sh.W * sh.L)), distinct_from(W);
  if (one_node) {
    shared = std::make_shared<std::vector<int32_t>>(static_cast<std::size_t>(W * shared_len));
    int32_t* mine = shared->data() + me * shared_len;
    std::copy(send.counts.begin(), send.counts.end(), mine);
    const int64_t fields[4] = {slot ? slot->gen : -1, slot ? slot->offset : 0,
                               slot ? slot->offset + meta_at : 0, slot ? sh.A : 0};
    std::memcpy(mine + T, fields, sizeof fields);
    Exchange ex(comm, op, "counts");
    ex.keep_alive(shared);
    for (int p = 0; p < W; ++p) {
      if (p == me) continue;
      ex.irecv(shared->data() + p * shared_len, to_int(shared_len), MPI_INT32_T, peers[p],
               detail::kTagCounts);
      ex.isend(mine, to_int(shared_len), MPI_INT32_T, peers[p], detail::kTagCounts);
    }
    ex.wait();
    if (perf) ex.add_recv_wait_us(perf);
    const int64_t base = sh.pl.block_base(me);
    for (int p = 0; p < W; ++p) {
      int64_t rows = 0;
      for (int l = 0; l < L; ++l) {
        const int32_t c = (*shared)[p * shared_len + base + l];
        from_source[p * L + l] = c;
        rows += c;
      }
      MOE_EP_CHECK(rows <= INT32_MAX);
      distinct_from[p] = static_cast<int32_t>(rows);  // shared memory: no merged tokens
    }
  } else {
    // Phase "counts": rank d learns how many rows each source sends for each of its local
    // experts, then how many distinct tokens among them travel by MPI (the last entry of each
    // message).
    auto counts_out = std::make_shared<std::vector<int32_t>>();
    auto counts_in = std::make_shared<std::vector<int32_t>>(sh.W * (sh.L + 1), 0);
    for (int p = 0; p < W; ++p) {
      const auto* c = send.counts.data() + sh.pl.block_base(p);
      counts_out->insert(counts_out->end(), c, c + sh.pl.local_experts(p));
      counts_out->push_back(distinct_count[p]);
    }
    {
      Exchange ex(comm, op, "counts");
      ex.keep_alive(counts_out);
      ex.keep_alive(counts_in);
      for (int p = 0; p < W; ++p)
        ex.irecv(counts_in->data() + p * (L + 1), L + 1, MPI_INT32_T, peers[p], detail::kTagCounts);
      for (int p = 0, at = 0; p < W; ++p) {
        const int n = to_int(sh.pl.local_experts(p)) + 1;
        ex.isend(counts_out->data() + at, n, MPI_INT32_T, peers[p], detail::kTagCounts);
        at += n;
      }
      ex.wait();
      if (perf) ex.add_recv_wait_us(perf);
    }
    for (int p = 0; p < W; ++p) {
      std::copy_n(counts_in->data() + p * (L + 1), L, from_source.data() + p * L);
      distinct_from[p] = (*counts_in)[p * (L + 1) + L];
    }
  }
  const detail::RecvPlan recv = detail::plan_recvs_from_counts(from_source, sh.W, sh.L);
  MOE_EP_CHECK(recv.valid <= sh.A);
  for (int p = 0; p < W; ++p)
    if (distinct_from[p] < 0 || distinct_from[p] > recv.source_rows[p] ||
        (distinct_from[p] == 0 && recv.source_rows[p] > 0))
      detail::fail(ErrorKind::kInternal, op, ": rank ", peers[p], " announced ", distinct_from[p],
                   " distinct tokens for its ", recv.source_rows[p],
                   " rows (please report this bug)");

  const int64_t esize = static_cast<int64_t>(dtype_size(sh.dtype));
  const int64_t row_bytes = sh.H * esize;
  const int64_t out_row_bytes = quant ? sh.H : row_bytes;  // of expand_x (int8 with quant_mode 2)

  // Phase "shm offsets" (not on one machine: see "counts"): each receiver on this machine tells
  // each sender on it where, in its window, that sender's block of each local expert starts, and
  // where the block's RowMeta entries go (gen -1: "use MPI this time", when the receiver has no
  // slot). to[d]: what receiver d said (gen, then L row offsets, then L metadata offsets, in
  // bytes); shm_to / shm_from: pairs that use shared memory in each direction.
  std::vector<char> shm_to(W, 0), shm_from(W, 0);
  std::vector<std::vector<int64_t>> to(W);
  if (one_node) {
    // On one machine, what receiver d would say, from the counts every rank sent: block (l, me)
    // of d starts after d's blocks of its local experts before l (from every source), then the
    // blocks of l from the sources before this rank (SPEC §1.4's expert-major order).
    auto where_at = [&](int d) {
      const int64_t ld = sh.pl.local_experts(d), base = sh.pl.block_base(d);
      std::vector<int64_t> o(static_cast<std::size_t>(1 + 2 * ld), 0);
      o[0] = slot_field(d, 0);
      if (o[0] < 0) return o;
      int64_t before = 0;  // rows of d's blocks of local experts < l
      for (int64_t l = 0; l < ld; ++l) {
        int64_t at = before;
        for (int s = 0; s < W; ++s) {
          const int64_t c = (*shared)[s * shared_len + base + l];
          if (s < me) at += c;
          before += c;
        }
        o[1 + l] = slot_field(d, 1) + at * out_row_bytes;
        o[1 + ld + l] = slot_field(d, 2) + at * static_cast<int64_t>(sizeof(RowMeta));
      }
      // The receiver checks the same total against its capacity only after this rank has
      // written: checked here too, before any row lands past its slot.
      if (before > slot_field(d, 3))
        detail::fail(ErrorKind::kInternal, op, ": rank ", peers[d], " would receive ", before,
                     " rows in a slot of ", slot_field(d, 3), " (please report this bug)");
      return o;
    };
    for (int p = 0; p < W; ++p) {
      shm_from[p] = slot.has_value();
      to[p] = where_at(p);
      shm_to[p] = to[p][0] >= 0;
    }
  } else if (shm) {
    auto where_for = [&](int p) {  // what this rank tells sender p
      std::vector<int64_t> o(1 + 2 * L, 0);
      o[0] = slot ? slot->gen : -1;
      for (int l = 0; l < L && slot; ++l) {
        o[1 + l] = slot->offset + recv.block_offset[l * W + p] * out_row_bytes;
        o[1 + L + l] = slot->offset + meta_at +
                       recv.block_offset[l * W + p] * static_cast<int64_t>(sizeof(RowMeta));
      }
      return o;
    };
    Exchange ex(comm, op, "shm offsets");
    std::vector<std::shared_ptr<std::vector<int64_t>>> in_off(W), out_off(W);
    for (int p = 0; p < W; ++p) {
      if (shm->node_of(peers[p]) < 0) continue;
      shm_from[p] = slot.has_value();
      if (p == me) continue;
      out_off[p] = std::make_shared<std::vector<int64_t>>(where_for(p));
      in_off[p] = std::make_shared<std::vector<int64_t>>(1 + 2 * sh.pl.local_experts(p));
      ex.keep_alive(out_off[p]);
      ex.keep_alive(in_off[p]);
      ex.irecv(in_off[p]->data(), to_int(1 + 2 * sh.pl.local_experts(p)), MPI_INT64_T, peers[p],
               detail::kTagShmOffsets);
      ex.isend(out_off[p]->data(), 1 + 2 * L, MPI_INT64_T, peers[p], detail::kTagShmOffsets);
    }
    ex.wait();
    if (perf) ex.add_recv_wait_us(perf);
    for (int p = 0; p < W; ++p) {
      if (shm->node_of(peers[p]) < 0) continue;
      to[p] = p == me ? where_for(me) : *in_off[p];
      shm_to[p] = to[p][0] >= 0;
    }
  }
  // This rank's own rows never go through MPI: without a window slot they are copied (or
  // quantised) straight into its expand_x, like rows to a peer through shared memory.
  auto in_place_to = [&](int d) { return shm_to[d] || d == me; };
  bool any_mpi_to = false;
  for (int d = 0; d < W; ++d) any_mpi_to |= !in_place_to(d);
  if (quant && any_mpi_to && !qsend)
    qsend = std::make_shared<Tensor>(
        Tensor::empty(DType::kI8, {static_cast<int64_t>(send.order.size()) * sh.H}));

  // quant_mode 2 (SPEC §1.5): every (token, destination) copy in send order, smoothed by its
  // expert's row of scales (Ns + e for MoE expert e, s for shared expert s). Without scales every
  // copy of a token quantises to the same bytes, so each sent token is quantised once and stored
  // to all its destinations in the same pass (parallel_quantize); with scales each copy is
  // quantised on its own. Rows for MPI destinations go to the send buffer, rows for
  // shared-memory ones straight to their place.
  std::vector<int32_t> src_index, smooth_index;
  detail::QuantizeRowsInt8Args qa;
  if (quant) {
    const int64_t n = static_cast<int64_t>(send.order.size());
    qa.op = op;
    qa.name = "x";
    qa.n = sh.H;
    qa.dtype = sh.dtype;
    qa.src = in.x.data;
    qa.src_stride = in.x.strides[0];
    qa.q_stride = sh.H;
    if (in.scales) {
      src_index.resize(static_cast<std::size_t>(n));
      smooth_index.resize(static_cast<std::size_t>(n));
      for (int64_t j = 0; j < n; ++j) {
        const int64_t i = send.order[j] / sh.KS, k = send.order[j] % sh.KS;
        src_index[j] = static_cast<int32_t>(i);
        smooth_index[j] = static_cast<int32_t>(
            k < sh.K ? sh.pl.Ns + detail::index_at(in.expert_ids, i, k) : k - sh.K);
      }
      qa.smooth = in.scales->ptr<float>();
      qa.smooth_stride = sh.H;
    }
  }
  // Writes the int8 rows of send-order entries [first, first + n) to q (without scales: queued
  // in qcopies, written by parallel_quantize).
  std::vector<RowCopy> copies;
  std::vector<QuantCopy> qcopies;
  auto quantise = [&](int64_t first, int64_t n, int8_t* q) {
    if (n == 0) return;
    if (!in.scales) {
      for (int64_t r = 0; r < n; ++r) {
        const int64_t i = send.order[first + r] / sh.KS;
        const char* src = sh.H > 0 ? in.x.ptr<char>() + i * in.x.strides[0] * esize : nullptr;
        qcopies.push_back({src, reinterpret_cast<char*>(q) + r * sh.H, i, first + r});
      }
      return;
    }
    detail::QuantizeRowsInt8Args a = qa;
    a.rows = n;
    a.src_index = src_index.data() + first;
    a.smooth_index = smooth_index.data() + first;
    a.q = q;
    a.scales = qsend_scale->data() + first;
    detail::quantize_rows_int8(a);
  };
  if (quant) {
    // A merged destination's distinct tokens are quantised to the front of its range of the send
    // buffer, each token's scale to its first copy's entry, then to its other copies'.
    for (int d = 0; d < W; ++d) {
      if (in_place_to(d)) continue;
      int8_t* q = qsend->ptr<int8_t>() + send.rank_offset[d] * sh.H;
      if (distinct[d].empty()) {
        quantise(send.rank_offset[d], send.rank_offset[d + 1] - send.rank_offset[d], q);
        continue;
      }
      for (std::size_t t = 0; t < distinct[d].size(); ++t) {
        const int64_t j = distinct[d][t], i = send.order[j] / sh.KS;
        qcopies.push_back({in.x.ptr<char>() + i * in.x.strides[0] * esize,
                           reinterpret_cast<char*>(q + static_cast<int64_t>(t) * sh.H), i, j});
      }
    }
    parallel_quantize(qcopies, sh.H, sh.dtype, qsend_scale->data());  // MPI's send buffer
    qcopies.clear();
    std::vector<int64_t> first_copy;  // [token]: its first copy's entry (d being filled)
    for (int d = 0; d < W; ++d) {
      if (in_place_to(d) || distinct[d].empty()) continue;
      first_copy.resize(static_cast<std::size_t>(sh.BS));
      for (const int64_t j : distinct[d]) first_copy[send.order[j] / sh.KS] = j;
      for (int64_t j = send.rank_offset[d]; j < send.rank_offset[d + 1]; ++j)
        (*qsend_scale)[j] = (*qsend_scale)[first_copy[send.order[j] / sh.KS]];
    }
  }

  // Phase "rows": rows (one message per block, or per destination when merged) and their metadata
  // (one per peer and direction; a rank's own rows travel through no message). With shared
  // memory the sender writes the rows and their metadata itself, then sends their count, which
  // announces them (a message of 8 bytes instead of 16 per row: such a message of a few
  // thousand rows went through MPI's rendezvous, which stalled about 0.25 ms in half the calls).
  {
    Exchange ex(comm, op, "rows");
    auto expand_x = std::make_shared<Tensor>(out.expand_x);
    ex.keep_alive(expand_x);
    const MpiType row(out_row_bytes, op);
    const MpiType meta_type(sizeof(RowMeta), op);
    if (qsend) ex.keep_alive(qsend);
    std::vector<std::shared_ptr<std::vector<RowMeta>>> meta_in(W), meta_out(W);
    auto announced = std::make_shared<std::vector<int64_t>>(2 * W, 0);  // received, then sent
    ex.keep_alive(announced);
    // Rows of a merged source: its distinct tokens in the order of their first rows, copied into
    // place below.
    std::vector<std::shared_ptr<Tensor>> merged_in(W);
    for (int s = 0; s < W; ++s) {
      if (!shm_from[s] && distinct_from[s] < recv.source_rows[s]) {
        merged_in[s] = std::make_shared<Tensor>(
            Tensor::empty(DType::kI8, {static_cast<int64_t>(distinct_from[s]) * out_row_bytes}));
        ex.keep_alive(merged_in[s]);
        ex.irecv(merged_in[s]->data(), distinct_from[s], row.get(), peers[s], detail::kTagRows);
      }
      // Otherwise one contiguous message per non-empty block (l, s), straight into place:
      // OpenMPI moves contiguous messages with its single-copy path, derived datatypes through
      // copy-in/out. Messages of one sender with one tag arrive in the order sent (MPI's
      // non-overtaking rule).
      if (!shm_from[s] && !merged_in[s] && s != me)  // own rows: copied into place below
        for (int l = 0; l < L; ++l) {
          const int64_t b = static_cast<int64_t>(l) * W + s;
          if (recv.block_rows[b] > 0)
            ex.irecv(out.expand_x.ptr<char>() + recv.block_offset[b] * out_row_bytes,
                     recv.block_rows[b], row.get(), peers[s], detail::kTagRows);
        }
      if (shm_from[s]) {
        ex.irecv(announced->data() + s, 1, MPI_INT64_T, peers[s], detail::kTagMeta);
        continue;
      }
      meta_in[s] = std::make_shared<std::vector<RowMeta>>(recv.source_rows[s]);
      ex.keep_alive(meta_in[s]);
      ex.irecv(meta_in[s]->data(), to_int(recv.source_rows[s]), meta_type.get(), peers[s],
               detail::kTagMeta);
    }
    const int64_t x_row_stride = in.x.strides[0] * esize;
    // The rows for MPI destinations in send order: qsend's int8 rows, or x's rows packed (one
    // parallel copy) so that every message is contiguous.
    std::shared_ptr<Tensor> send_rows;
    if (any_mpi_to) {
      if (quant) {
        send_rows = std::make_shared<Tensor>(detail::TensorInternals::wrap(
            qsend, qsend->data(), DType::kI8, {static_cast<int64_t>(send.order.size()), sh.H}));
      } else {
        send_rows = std::make_shared<Tensor>(
            Tensor::empty(sh.dtype, {static_cast<int64_t>(send.order.size()), sh.H}));
        std::vector<RowCopy> pack;
        for (int d = 0; d < W; ++d) {
          if (in_place_to(d)) continue;
          char* to_d = send_rows->ptr<char>() + send.rank_offset[d] * row_bytes;
          if (!distinct[d].empty()) {  // merged: each distinct token once
            for (std::size_t t = 0; t < distinct[d].size(); ++t) {
              const int64_t i = send.order[distinct[d][t]] / sh.KS;
              pack.push_back({in.x.ptr<char>() + i * x_row_stride,
                              to_d + static_cast<int64_t>(t) * row_bytes, i});
            }
            continue;
          }
          for (int64_t j = send.rank_offset[d]; j < send.rank_offset[d + 1]; ++j)
            pack.push_back({in.x.ptr<char>() + (send.order[j] / sh.KS) * x_row_stride,
                            send_rows->ptr<char>() + j * row_bytes, send.order[j] / sh.KS});
        }
        parallel_copy(pack, row_bytes);
      }
      ex.keep_alive(send_rows);
    }
    for (int d = 0; d < W; ++d) {
      const int64_t first = send.rank_offset[d], n = send.rank_offset[d + 1] - first;
      meta_out[d] = std::make_shared<std::vector<RowMeta>>(n);
      ex.keep_alive(meta_out[d]);
      if (in_place_to(d)) continue;  // rows below, metadata after them
      if (!distinct[d].empty()) {    // merged: one message of the distinct tokens
        ex.isend(send_rows->ptr<char>() + first * out_row_bytes,
                 static_cast<int>(distinct[d].size()), row.get(), peers[d], detail::kTagRows);
        continue;
      }
      // One message per non-empty (d, local expert) run of the send order, in expert order
      // (the receiver posts one receive per block, in the same order): int8 rows are contiguous
      // in the send buffer, other rows packed into it first (below).
      for (int64_t l = 0, j = first; l < sh.pl.local_experts(d); ++l) {
        const int64_t rows = send.counts[sh.pl.block_base(d) + l];
        if (rows > 0)
          ex.isend(send_rows->ptr<char>() + j * out_row_bytes, to_int(rows), row.get(), peers[d],
                   detail::kTagRows);
        j += rows;
      }
    }
    // Shared memory (and this rank's own rows): each (destination, local expert) run of the
    // send order is contiguous at its destination; bf16/fp16/fp32 rows are copied there in
    // parallel (the one copy), int8 rows quantised there (once per token without smoothing
    // scales, once per copy with them).
    for (int d = 0; d < W; ++d) {
      if (!in_place_to(d)) continue;
      int64_t j = send.rank_offset[d];
      for (int64_t l = 0; l < sh.pl.local_experts(d); ++l) {
        const int64_t n = send.counts[sh.pl.block_base(d) + l];
        char* dst = shm_to[d]
                        ? shm->peer_ptr(static_cast<int>(to[d][0]), peers[d], to[d][1 + l],
                                        n * out_row_bytes)
                        : out.expand_x.ptr<char>() + recv.block_offset[l * W + me] * out_row_bytes;
        if (quant) {
          quantise(j, n, reinterpret_cast<int8_t*>(dst));
        } else {
          for (int64_t r = 0; r < n; ++r)
            copies.push_back({in.x.ptr<char>() + (send.order[j + r] / sh.KS) * x_row_stride,
                              dst + r * row_bytes, send.order[j + r] / sh.KS});
        }
        j += n;
      }
      MOE_EP_CHECK(j == send.rank_offset[d + 1]);
    }
    // Window stores and this rank's own rows only (stream_min_bytes): MPI's send buffer above is
    // read at once.
    parallel_copy(copies, out_row_bytes,
                  static_cast<int64_t>(copies.size()) * out_row_bytes >= stream_min);
    if (quant)
      parallel_quantize(qcopies, sh.H, sh.dtype, qsend_scale->data(),
                        static_cast<int64_t>(qcopies.size()) * sh.H >= stream_min);
    for (int d = 0; d < W; ++d) {
      const int64_t first = send.rank_offset[d], n = send.rank_offset[d + 1] - first;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t flat = send.order[first + j], i = flat / sh.KS, k = flat % sh.KS;
        // Shared-expert copies (slot >= K) carry no weight: expand_scales 0.
        (*meta_out[d])[j] =
            RowMeta{static_cast<int32_t>(i), static_cast<int32_t>(k),
                    in.expert_scales && k < sh.K ? detail::float_at(*in.expert_scales, i, k) : 0.0f,
                    quant ? (*qsend_scale)[first + j] : 0.0f};
      }
      if (!shm_to[d]) continue;
      // Each (d, local expert) run of metadata next to its rows, at the offset d gave.
      const int64_t ld = sh.pl.local_experts(d);
      for (int64_t l = 0, j = 0; l < ld; ++l) {
        const int64_t rows = send.counts[sh.pl.block_base(d) + l];
        const int64_t bytes = rows * static_cast<int64_t>(sizeof(RowMeta));
        if (rows > 0)
          std::memcpy(shm->peer_ptr(static_cast<int>(to[d][0]), peers[d], to[d][1 + ld + l], bytes),
                      meta_out[d]->data() + j, static_cast<std::size_t>(bytes));
        j += rows;
      }
    }
    if (shm) shm->sync();  // rows and metadata are in place before their count announces them
    for (int d = 0; d < W; ++d) {
      const int64_t n = send.rank_offset[d + 1] - send.rank_offset[d];
      if (shm_to[d]) {
        (*announced)[W + d] = n;
        ex.isend(announced->data() + W + d, 1, MPI_INT64_T, peers[d], detail::kTagMeta);
      } else {
        ex.isend(meta_out[d]->data(), to_int(n), meta_type.get(), peers[d], detail::kTagMeta);
      }
    }
    ex.wait();
    if (perf) ex.add_recv_wait_us(perf);
    if (shm) shm->sync();  // the peers' rows and metadata, announced, are visible
    for (int s = 0; s < W; ++s)
      if (shm_from[s] && (*announced)[s] != recv.source_rows[s])
        detail::fail(ErrorKind::kInternal, op, ": rank ", peers[s], " announced ", (*announced)[s],
                     " rows in shared memory, its counts said ", recv.source_rows[s],
                     " (please report this bug)");

    // Merged sources: each row copied to its place from the source's distinct tokens, which
    // came in the order the metadata (in send order) first names them.
    std::vector<RowCopy> spread;
    std::vector<int32_t> at;  // [token]: its row among the source's distinct tokens, or -1
    for (int s = 0, keys = 0; s < W; ++s) {
      if (!merged_in[s]) continue;
      at.assign(static_cast<std::size_t>(headers[s].BS), -1);
      int32_t next = 0;
      const RowMeta* m = meta_in[s]->data();
      const char* base = merged_in[s]->ptr<char>();
      for (int l = 0; l < L; ++l) {
        const int64_t b = static_cast<int64_t>(l) * W + s;
        for (int64_t j = recv.block_offset[b]; j < recv.block_offset[b] + recv.block_rows[b];
             ++j, ++m) {
          if (m->token < 0 || m->token >= headers[s].BS)
            detail::fail(ErrorKind::kInternal, op, ": rank ", peers[s], " sent token ", m->token,
                         " of its ", headers[s].BS, " (please report this bug)");
          int32_t& t = at[static_cast<std::size_t>(m->token)];
          if (t < 0) t = next++;
          spread.push_back({base + static_cast<int64_t>(t) * out_row_bytes,
                            out.expand_x.ptr<char>() + j * out_row_bytes, keys + t});
        }
      }
      if (next != distinct_from[s])
        detail::fail(ErrorKind::kInternal, op, ": rank ", peers[s], " sent ", distinct_from[s],
                     " distinct tokens, its rows' metadata names ", next,
                     " (please report this bug)");
      keys += next;
    }
    parallel_copy(spread, out_row_bytes,
                  static_cast<int64_t>(spread.size()) * out_row_bytes >= stream_min);

    int32_t* assist = out.assist_info_for_combine.ptr<int32_t>();
    float* scales = out.expand_scales.ptr<float>();
    float* dyn = quant ? out.dynamic_scales.ptr<float>() : nullptr;
    // Metadata from a sender on this machine lies in this rank's window, at its rows' indices.
    const auto* window_meta =
        slot ? reinterpret_cast<const RowMeta*>(static_cast<char*>(slot->ptr) + meta_at) : nullptr;
    for (int s = 0; s < W; ++s) {
      const RowMeta* next = shm_from[s] ? nullptr : meta_in[s]->data();  // s's rows in MPI order
      for (int l = 0; l < L; ++l) {
        const int64_t b = static_cast<int64_t>(l) * W + s;
        const RowMeta* m = shm_from[s] ? window_meta + recv.block_offset[b] : next;
        if (!shm_from[s]) next += recv.block_rows[b];
        for (int64_t j = recv.block_offset[b]; j < recv.block_offset[b] + recv.block_rows[b];
             ++j, ++m) {
          assist[3 * j] = s;
          assist[3 * j + 1] = m->token;
          assist[3 * j + 2] = m->slot;
          scales[j] = m->scale;
          if (dyn) dyn[j] = m->qscale;
        }
      }
    }
  }

  out.ep_recv_counts = Tensor::empty(DType::kI32, {sh.W * sh.L});
  std::copy(recv.inclusive.begin(), recv.inclusive.end(), out.ep_recv_counts.ptr<int32_t>());
  out.expert_token_nums = Tensor::empty(DType::kI64, {sh.L});
  int64_t running = 0;
  for (int l = 0; l < L; ++l) {
    int64_t rows = 0;
    for (int s = 0; s < W; ++s) rows += recv.block_rows[l * W + s];
    running += rows;
    out.expert_token_nums.ptr<int64_t>()[l] = in.expert_token_nums_type == 0 ? running : rows;
  }
  out.tp_recv_counts = Tensor::empty(DType::kI32, {1});
  out.tp_recv_counts.ptr<int32_t>()[0] = static_cast<int32_t>(recv.valid);
  if (cfg.tp_world_size == 2) tp_all_gather(op, cfg, sh, recv.valid, out);  // T == 2 (SPEC §1.1)
  return out;
}

namespace {

// Row i of shared_expert_x: 2-D (BS, H), or 3-D (a, b, H) with a*b = BS.
const char* shared_row(const TensorView& t, int64_t i) {
  const int64_t es = static_cast<int64_t>(dtype_size(t.dtype));
  const int64_t off = t.ndim == 2
                          ? i * t.strides[0]
                          : (i / t.shape[1]) * t.strides[0] + (i % t.shape[1]) * t.strides[1];
  return static_cast<const char*>(t.data) + off * es;
}

void check_shared_expert_x(const char* op, const TensorView& t, const EpShape& sh) {
  detail::expect_dtype(op, "shared_expert_x", t, {sh.dtype});
  if (t.ndim != 2 && t.ndim != 3)
    detail::invalid(op, ": shared_expert_x.ndim = ", t.ndim, " must be 2 (BS, H) or 3 (a, b, H)");
  detail::expect_memory(op, "shared_expert_x", t);
  const int last = t.ndim - 1;
  detail::expect_size(op, "shared_expert_x", t, last, sh.H, "H, expand_x.shape[1]");
  const int64_t rows = t.ndim == 2 ? t.shape[0] : t.shape[0] * t.shape[1];
  if (rows != sh.BS)
    detail::invalid(op, ": shared_expert_x has ", rows, " rows (",
                    t.ndim == 2 ? "shape[0]" : "shape[0] * shape[1]", ") but BS = ", sh.BS,
                    " (expert_ids.shape[0])");
  if (sh.H > 1 && t.strides[last] != 1)
    detail::unsupported(op, ": shared_expert_x.stride(", last, ") = ", t.strides[last],
                        " is not 1 (rows may be strided, each row must be contiguous)");
}

// A (rows, H) tensor of expand_x's dtype: ori_x, const_expert_alpha_1/2, const_expert_v.
void check_rows_like(const char* op, const char* name, const TensorView& t, int64_t rows,
                     const char* rows_what, const EpShape& sh) {
  detail::expect_rows(op, name, t);
  detail::expect_dtype(op, name, t, {sh.dtype});
  detail::expect_size(op, name, t, 0, rows, rows_what);
  detail::expect_size(op, name, t, 1, sh.H, "H, expand_x.shape[1]");
}

}  // namespace

Tensor combine_v2(const CombineInputs& in, const EpConfig& cfg) {
  const char* op = "combine_v2";
  const Communicator& comm = require_comm(op, cfg);
  OpHeader hdr = base_header(kOpCombine, cfg);
  hdr.BS = in.expert_ids.ndim >= 1 ? in.expert_ids.shape[0] : -1;
  hdr.H = in.expand_x.ndim == 2 ? in.expand_x.shape[1] : -1;
  hdr.K = in.expert_ids.ndim == 2 ? in.expert_ids.shape[1] : -1;
  hdr.dtype = static_cast<int64_t>(in.expand_x.dtype);
  hdr.quant_mode = static_cast<int32_t>(in.comm_quant_mode);

  std::optional<Error> local;
  EpShape sh;
  World world = whole_world(comm);
  detail::SendPlan back;  // what this rank sent in dispatch = what it receives now
  detail::RecvPlan blocks;
  int64_t tp_peer_rows = 0;        // T == 2: rows of the TP peer in expand_x, after this rank's
  std::shared_ptr<Tensor> rs_out;  // T == 2: the reduce-scattered rows sent back (SPEC §2)
  std::shared_ptr<Tensor> y;       // the expert output of slot (i, k) at row i*KS+k (int8 with cq)
  const bool cq = in.comm_quant_mode == 2;
  // comm_quant_mode 2: the dynamic scale of y's row i*KS+k; the int8 rows this rank sends back
  // (in send order: source rank, then its blocks) and their scales.
  std::shared_ptr<std::vector<float>> yscale;
  std::shared_ptr<Tensor> qback;  // a Tensor, not a zero-filled std::vector (see qsend)
  std::shared_ptr<std::vector<float>> qback_scale;
  Tensor out;
  int64_t* perf = nullptr;
  const TensorView* mask = in.x_active_mask ? &*in.x_active_mask : nullptr;
  const int64_t Z = cfg.zero_expert_num, C = cfg.copy_expert_num, Q = cfg.const_expert_num;
  // Shared-memory transport: where peers read this rank's rows. `in_place`: expand_x's valid
  // rows lie in this rank's window (at in_gen, in_off); else they are staged (copied, or
  // quantised with comm_quant_mode 2) once into `stage` in send order; `stage_defer`: the window
  // must grow first.
  bool shm_want = false, in_place = false, stage_defer = false;
  int in_gen = -1;
  int64_t in_off = 0, stage_bytes = 0;
  std::optional<detail::ShmSlot> stage;
  capture(hdr, local, [&] {
    if (in.caller_error) throw *in.caller_error;
    hdr.transport = resolve_transport(op, cfg);
    hdr.shm_node_ranks = detail::env_shm_node_ranks(op);
    // Checked first: never valid (SPEC §2.1), whatever else this build supports.
    if (in.comm_quant_mode != 0 && in.comm_quant_mode != 2)
      detail::invalid(op, ": comm_quant_mode = ", in.comm_quant_mode, " is not one of {0, 2}");
    if (in.comm_quant_mode == 2 && cfg.tp_world_size == 2)
      detail::invalid(op, ": comm_quant_mode = 2 (int8) is not allowed with tp_world_size = 2");
    detail::check_ep_config(op, cfg, comm.rank(), comm.size());
    world = resolve_world(op, cfg, in.elastic_info);
    hdr.elastic = world.hash;
    reject_tp_scale_in(op, comm, cfg, world);
    reject_given(op, {{"tp_send_counts", in.tp_send_counts.has_value() && cfg.tp_world_size != 2}});
    perf = perf_ptr(op, in.performance_info, cfg);
    detail::expect_rows(op, "expand_x", in.expand_x);
    detail::expect_ndim(op, "expert_ids", in.expert_ids, 2);
    sh = local_shape(cfg, world, in.expert_ids.shape[0], in.expand_x.shape[1], in.expand_x.dtype);
    detail::check_expert_ids(op, in.expert_ids, sh.BS, sh.E, sh.pl.special);
    sh.K = in.expert_ids.shape[1];
    sh.KS = sh.K + sh.pl.Ns;
    if (mask) {
      detail::check_active_mask(op, *mask, sh.BS, sh.K);
      hdr.all_active = detail::mask_all_true(*mask) ? 1 : 0;
    }
    detail::check_expert_scales(op, in.expert_scales, sh.BS, sh.K);
    if (in.shared_expert_x) check_shared_expert_x(op, *in.shared_expert_x, sh);
    if ((C > 0 || Q > 0) && !in.ori_x)
      detail::invalid(op, ": ori_x is required when ",
                      C > 0 ? "copy_expert_num = " : "const_expert_num = ", C > 0 ? C : Q, " > 0");
    if (in.ori_x) check_rows_like(op, "ori_x", *in.ori_x, sh.BS, "BS, expert_ids.shape[0]", sh);
    const std::pair<const char*, const std::optional<TensorView>*> consts[] = {
        {"const_expert_alpha_1", &in.const_expert_alpha_1},
        {"const_expert_alpha_2", &in.const_expert_alpha_2},
        {"const_expert_v", &in.const_expert_v}};
    for (const auto& [name, t] : consts) {
      if (Q > 0 && !t->has_value())
        detail::invalid(op, ": ", name, " is required when const_expert_num = ", Q, " > 0");
      if (t->has_value()) check_rows_like(op, name, **t, Q, "const_expert_num", sh);
    }
    if (world.removed) return;
    detail::compute_capacity(op, cfg.global_bs, sh);
    blocks = combine_blocks(op, cfg, in, sh, tp_peer_rows);
    if (blocks.valid > sh.A)
      detail::invalid(op, ": ep_send_counts[", sh.W * sh.L - 1, "] = ", blocks.valid,
                      " exceeds the receive capacity A = ", sh.A, " of this rank");
    const TensorView& ai = in.assist_info_for_combine;
    detail::expect_tensor(op, "assist_info_for_combine", ai, {DType::kI32}, 1);
    const int64_t ai_size = std::max(sh.BS * sh.K, sh.A * 128);
    if (ai.shape[0] != ai_size)
      detail::invalid(op, ": assist_info_for_combine.shape[0] = ", ai.shape[0], " must equal ",
                      "max(BS * K, A * 128) = ", ai_size, " (dispatch_v2's output)");
    // The layout says which source each row goes back to; assist_info must agree.
    for (int64_t b = 0; b < sh.W * sh.L; ++b)
      for (int64_t j = blocks.block_offset[b]; j < blocks.block_offset[b] + blocks.block_rows[b];
           ++j)
        if (detail::index_at(ai, 3 * j) != b % sh.W)
          detail::invalid(op, ": assist_info_for_combine[", 3 * j,
                          "] = ", detail::index_at(ai, 3 * j), " (the source rank of row ", j,
                          ") does not match ep_send_counts, which puts row ", j,
                          " in a block of source rank ", b % sh.W);
    if (in.expand_scales)
      detail::expect_tensor(op, "expand_scales", *in.expand_scales, {DType::kF32}, 1);
    back = detail::plan_sends(detail::Activity{&in.expert_ids, mask}, sh.pl, sh.rank);
    shm_want = shm_applies(hdr.transport, cfg, world);
    if (shm_want) {
      const auto& ctx = detail::CommInternals::shm(comm);
      const int64_t esz = static_cast<int64_t>(dtype_size(sh.dtype));
      const int64_t extent =
          blocks.valid == 0 ? 0 : (blocks.valid - 1) * in.expand_x.strides[0] * esz + sh.H * esz;
      in_place = !cq && (blocks.valid == 0 ||
                         (ctx && ctx->locate(in.expand_x.data, extent, in_gen, in_off)));
      if (!in_place) {
        stage_bytes = blocks.valid * (cq ? sh.H : sh.H * esz);
        if (ctx) stage = ctx->try_alloc(stage_bytes);
        if (!stage && (!ctx || ctx->should_grow(stage_bytes)))
          hdr.shm_grow = 1, stage_defer = true;  // as dispatch_v2's slot
      }
      hdr.shm_rows = in_place || stage || stage_defer;
    }
    // Allocated before the header exchange (see dispatch_v2); with shm, y (the rows received
    // through MPI) only once it is known that some peer sends through MPI.
    if (!shm_want)
      y = std::make_shared<Tensor>(
          Tensor::empty(cq ? DType::kI8 : sh.dtype, {sh.BS * sh.KS, sh.H}));
    if (cq) {
      yscale = std::make_shared<std::vector<float>>(static_cast<std::size_t>(sh.BS * sh.KS));
      if (!stage && !stage_defer)
        qback = std::make_shared<Tensor>(Tensor::empty(DType::kI8, {blocks.valid * sh.H}));
      qback_scale = std::make_shared<std::vector<float>>(static_cast<std::size_t>(blocks.valid));
    }
    out = Tensor::empty(sh.dtype, {sh.BS, sh.H});
  });
  if (local && world.removed) throw *local;
  if (world.removed) return Tensor::zeros(sh.dtype, {sh.BS, sh.H});  // SPEC §1.7: no part
  if (tp_pair(cfg)) {
    // SPEC §2: rs_out = ReduceScatterV_TP(expand_x), before the EP header agreement so that a
    // failure within the pair reaches both EP groups.
    tp_handshake(op, cfg, hdr, local, tp_header(cfg, sh, blocks.valid, tp_peer_rows));
    if (!local)
      capture(hdr, local,
              [&] { rs_out = tp_reduce_scatter(op, cfg, in, sh, blocks.valid, tp_peer_rows); });
  }
  const auto headers =
      detail::agree_on_headers(comm, world.peers, op, hdr, local ? &*local : nullptr, perf);
  check_batch_sizes(op, headers, world.peers, cfg.global_bs, "expert_ids.shape[0]");
  check_quant_modes(op, headers, world.peers, "comm_quant_mode");

  const int W = to_int(sh.W), L = to_int(sh.L), me = to_int(sh.rank);
  const std::vector<int>& peers = world.peers;
  const int64_t esize = static_cast<int64_t>(dtype_size(sh.dtype));
  const int64_t row_bytes = sh.H * esize;
  const int64_t wire_row = cq ? sh.H : row_bytes;  // bytes of a row on the way back (and in y)
  detail::ShmContext* shm = nullptr;
  if (shm_applies(headers[0].transport, cfg, world)) {
    MOE_EP_CHECK(shm_want);
    shm = &ensure_shm(comm, op, headers, peers, stage_bytes);
    if (stage_defer) {
      stage = shm->try_alloc(stage_bytes);
      MOE_EP_CHECK(stage.has_value());
    }
  }
  // Shared memory between this rank and p: p reads this rank's rows from its window (provide),
  // this rank reads p's (read); both sides know both from the headers.
  std::vector<char> provide(W, 0), read(W, 0);
  for (int p = 0; p < W && shm; ++p)
    if (shm->node_of(peers[p]) >= 0) {
      provide[p] = headers[me].shm_rows != 0;
      read[p] = headers[p].shm_rows != 0;
    }
  // This rank's rows for source s, in send order (s, then its blocks l): the rows of
  // comm_quant_mode 2 (quantised) and of staging.
  std::vector<int64_t> send_first(W + 1, 0);
  for (int s = 0; s < W; ++s) send_first[s + 1] = send_first[s] + blocks.source_rows[s];
  const TensorView& rows_src = rs_out ? rs_out->view() : in.expand_x;  // T == 2: the TP sums
  const int64_t src_stride = rows_src.strides[0] * esize;
  int8_t* qrows =
      cq ? (stage ? reinterpret_cast<int8_t*>(stage->ptr) : qback->ptr<int8_t>()) : nullptr;
  // expand_x's rows in this rank's send order back: source s, then its blocks (l, s).
  std::vector<int32_t> back_rows;
  back_rows.reserve(static_cast<std::size_t>(blocks.valid));
  for (int s = 0; s < W; ++s)
    for (int l = 0; l < L; ++l) {
      const int64_t b = static_cast<int64_t>(l) * W + s;
      for (int64_t j = blocks.block_offset[b]; j < blocks.block_offset[b] + blocks.block_rows[b];
           ++j)
        back_rows.push_back(static_cast<int32_t>(j));
    }
  // Copies those rows, in that order, to dst (row_bytes apart).
  auto pack_rows = [&](char* dst) {
    std::vector<RowCopy> copies(back_rows.size());
    for (std::size_t r = 0; r < back_rows.size(); ++r)
      copies[r] = {static_cast<const char*>(rows_src.data) + back_rows[r] * src_stride,
                   dst + static_cast<int64_t>(r) * row_bytes, back_rows[r]};
    parallel_copy(copies, row_bytes);
  };
  if (cq) {
    // SPEC §2.1: each row sent back is quantised like §1.5 (no smoothing), in send order.
    detail::QuantizeRowsInt8Args qa;
    qa.op = op;
    qa.name = "expand_x";
    qa.rows = static_cast<int64_t>(back_rows.size());
    qa.n = sh.H;
    qa.dtype = sh.dtype;
    qa.src = in.expand_x.data;
    qa.src_stride = in.expand_x.strides[0];
    qa.src_index = back_rows.data();
    qa.q = qrows;
    qa.q_stride = sh.H;
    qa.scales = qback_scale->data();
    detail::quantize_rows_int8(qa);
  } else if (stage) {
    pack_rows(stage->ptr);  // staging: the valid rows copied once into the window
  }
  // The rows for sources that receive them through MPI go as one contiguous message per block
  // (l, s), which OpenMPI moves with its single-copy path, unlike a per-row datatype: straight
  // from expand_x (or the TP sums) when its rows are contiguous (`direct`: nothing is packed),
  // else from the rows in send order (row_bytes apart, as in the staging slot, which serves when
  // there is one; int8 with comm_quant_mode 2). This rank's own rows are not sent at all: its
  // weighted sum reads them where they are (expand_x, the TP sums, or the int8 rows).
  const bool direct = !cq && src_stride == row_bytes;
  std::shared_ptr<Tensor> packed;
  const char* send_rows = cq ? reinterpret_cast<const char*>(qrows) : stage ? stage->ptr : nullptr;
  bool any_mpi_back = false;
  for (int s = 0; s < W; ++s) any_mpi_back |= !provide[s] && s != me && blocks.source_rows[s] > 0;
  if (!direct && !send_rows && any_mpi_back) {
    packed = std::make_shared<Tensor>(Tensor::empty(sh.dtype, {blocks.valid, sh.H}));
    pack_rows(packed->ptr<char>());
    send_rows = packed->ptr<char>();
  }
  // Where source s finds its rows in this rank's window: gen, byte offset of row 0, row stride,
  // then per local expert l the first row and the row count of block (l, s).
  auto where_for = [&](int s) {
    std::vector<int64_t> w(3 + 2 * static_cast<std::size_t>(L), 0);
    w[0] = in_place ? in_gen : stage ? stage->gen : -1;
    w[1] = in_place ? in_off : stage ? stage->offset + send_first[s] * wire_row : 0;
    w[2] = in_place ? src_stride : wire_row;
    int64_t staged = 0;
    for (int l = 0; l < L; ++l) {
      const int64_t b = static_cast<int64_t>(l) * W + s;
      w[3 + l] = in_place ? blocks.block_offset[b] : staged;
      w[3 + L + l] = blocks.block_rows[b];
      staged += blocks.block_rows[b];
    }
    return w;
  };

  // yrow[i*KS + k]: the row holding y_ik, in y (received through MPI) or in a peer's window.
  std::vector<const char*> yrow(static_cast<std::size_t>(sh.BS * sh.KS), nullptr);

  // Tells every owner this rank read from that it is done, and waits until every reader of this
  // rank's rows is done with them (they may be the caller's expand_x, or staging about to be
  // reused). Runs on success and, best effort, on errors after the rows phase.
  bool finished = shm == nullptr;
  auto finish_reading = [&] {
    if (finished) return;
    finished = true;
    Exchange ex(comm, op, "shm done");
    auto flag = std::make_shared<std::vector<int32_t>>(static_cast<std::size_t>(W), 0);
    ex.keep_alive(flag);
    for (int p = 0; p < W; ++p) {
      if (p == me) continue;
      if (provide[p]) ex.irecv(flag->data() + p, 1, MPI_INT32_T, peers[p], detail::kTagShmDone);
      if (read[p]) ex.isend(flag->data() + me, 1, MPI_INT32_T, peers[p], detail::kTagShmDone);
    }
    ex.wait();
  };
  // (token, slot, expert, int8 scale) of this rank's rows for source s, in s's send order.
  const TensorView& ai = in.assist_info_for_combine;
  std::vector<std::shared_ptr<std::vector<BackMeta>>> meta_out(W);
  for (int s = 0; s < W; ++s) {
    meta_out[s] = std::make_shared<std::vector<BackMeta>>();
    meta_out[s]->reserve(static_cast<std::size_t>(blocks.source_rows[s]));
    for (int l = 0; l < L; ++l) {
      const int64_t b = static_cast<int64_t>(l) * W + s;
      for (int64_t j = blocks.block_offset[b]; j < blocks.block_offset[b] + blocks.block_rows[b];
           ++j)
        meta_out[s]->push_back(BackMeta{
            static_cast<int32_t>(detail::index_at(ai, 3 * j + 1)),
            static_cast<int32_t>(detail::index_at(ai, 3 * j + 2)),
            static_cast<int32_t>(sh.pl.expert_on(sh.rank, l)),
            cq ? (*qback_scale)[send_first[s] + static_cast<int64_t>(meta_out[s]->size())] : 0.0f});
    }
  }
  // Phase "layout back": every owner tells every other source how many rows it holds for it per
  // block (local expert l), and where in its window when the source reads them there
  // (where_for). The rows phase sizes its receives by these counts, never by what expert_ids
  // lead this rank to expect: MPI rejects a message longer than its receive, and OpenMPI's
  // single-copy path writes all of it past the end of the buffer first. A source whose counts
  // disagree with expert_ids still takes every row announced (no message is left behind), then
  // raises the error. layout[d]: owner d's announcement (this rank's own, for d == me).
  if (shm) shm->sync();  // this rank's rows (the experts' stores, staging) before "where"
  std::vector<std::vector<int64_t>> layout(W);
  {
    Exchange ex(comm, op, "layout back");
    std::vector<std::shared_ptr<std::vector<int64_t>>> in_lay(W), out_lay(W);
    for (int d = 0; d < W; ++d) {
      if (d == me) continue;
      const int64_t ld = sh.pl.local_experts(d);
      in_lay[d] = std::make_shared<std::vector<int64_t>>(static_cast<std::size_t>(3 + 2 * ld));
      out_lay[d] = std::make_shared<std::vector<int64_t>>(where_for(d));
      ex.keep_alive(in_lay[d]);
      ex.keep_alive(out_lay[d]);
      ex.irecv(in_lay[d]->data(), to_int(3 + 2 * ld), MPI_INT64_T, peers[d],
               detail::kTagCombineLayout);
      ex.isend(out_lay[d]->data(), to_int(3 + 2 * static_cast<int64_t>(L)), MPI_INT64_T, peers[d],
               detail::kTagCombineLayout);
    }
    ex.wait();
    if (perf) ex.add_recv_wait_us(perf);
    for (int d = 0; d < W; ++d) layout[d] = d == me ? where_for(me) : *in_lay[d];
  }
  // announced[d]: rows owner d holds for this rank; agrees[d]: block by block what expert_ids
  // route to d. mismatch: the first block that differs (raised after the rows phase).
  std::vector<int64_t> announced(W, 0);
  std::vector<char> agrees(W, 1);
  std::optional<Error> mismatch;
  for (int d = 0; d < W; ++d) {
    const int64_t ld = sh.pl.local_experts(d);
    for (int64_t l = 0; l < ld; ++l) {
      const int64_t rows = layout[d][static_cast<std::size_t>(3 + ld + l)];
      const int64_t want = back.counts[static_cast<std::size_t>(sh.pl.block_base(d) + l)];
      announced[d] += rows;
      if (rows == want) continue;
      agrees[d] = 0;
      if (!mismatch)
        mismatch = Error(ErrorKind::kInvalidArgument,
                         detail::cat(op, ": rank ", peers[d], " sent back ", rows,
                                     " rows of expert ", sh.pl.expert_on(d, l),
                                     " but expert_ids on rank ", comm.rank(), " route ", want,
                                     " entries to it: expert_ids and ep_send_counts must be those "
                                     "of the matching dispatch_v2"));
    }
  }
  {
    Exchange ex(comm, op, "rows");
    if (y) ex.keep_alive(y);
    if (rs_out) ex.keep_alive(rs_out);
    if (qback) ex.keep_alive(qback);
    if (packed) ex.keep_alive(packed);
    const MpiType row(wire_row, op);
    const MpiType meta_type(sizeof(BackMeta), op);
    // The metadata of every peer's rows, in this rank's send order (this rank's own: meta_out).
    std::vector<std::shared_ptr<std::vector<BackMeta>>> meta_in(W);
    // Rows through MPI land in y in this rank's send order (peer d's at back.rank_offset[d]), or,
    // from a peer whose counts disagree with expert_ids, in a buffer of their own (discarded).
    std::vector<std::shared_ptr<Tensor>> discard(W);
    bool need_y = false;
    for (int d = 0; d < W; ++d) need_y |= d != me && !read[d] && agrees[d] && announced[d] > 0;
    if (need_y && !y) {
      y = std::make_shared<Tensor>(
          Tensor::empty(cq ? DType::kI8 : sh.dtype, {sh.BS * sh.KS, sh.H}));
      ex.keep_alive(y);
    }
    for (int d = 0; d < W; ++d) {
      if (d == me) continue;  // this rank's own rows and metadata are here already
      if (!read[d]) {
        char* to = nullptr;
        if (agrees[d]) {
          to = y ? y->ptr<char>() + back.rank_offset[d] * wire_row : nullptr;
        } else {
          discard[d] =
              std::make_shared<Tensor>(Tensor::empty(DType::kI8, {announced[d] * wire_row}));
          ex.keep_alive(discard[d]);
          to = discard[d]->ptr<char>();
        }
        const int64_t ld = sh.pl.local_experts(d);
        for (int64_t l = 0, at = 0; l < ld; ++l) {
          const int64_t rows = layout[d][static_cast<std::size_t>(3 + ld + l)];
          if (rows > 0)
            ex.irecv(to + at * wire_row, to_int(rows), row.get(), peers[d],
                     detail::kTagCombineRows);
          at += rows;
        }
      }
      meta_in[d] = std::make_shared<std::vector<BackMeta>>(static_cast<std::size_t>(announced[d]));
      ex.keep_alive(meta_in[d]);
      if (announced[d] > 0)
        ex.irecv(meta_in[d]->data(), to_int(announced[d]), meta_type.get(), peers[d],
                 detail::kTagCombineMeta);
    }
    for (int s = 0; s < W; ++s) {
      if (s == me) continue;
      ex.keep_alive(meta_out[s]);
      if (!provide[s]) {
        int64_t staged = send_first[s];  // block (l, s)'s first row in send order
        for (int l = 0; l < L; ++l) {
          const int64_t b = static_cast<int64_t>(l) * W + s, rows = blocks.block_rows[b];
          if (rows > 0)
            ex.isend(direct ? static_cast<const char*>(rows_src.data) +
                                  blocks.block_offset[b] * src_stride
                            : send_rows + staged * wire_row,
                     to_int(rows), row.get(), peers[s], detail::kTagCombineRows);
          staged += rows;
        }
      }
      if (!meta_out[s]->empty())
        ex.isend(meta_out[s]->data(), to_int(static_cast<int64_t>(meta_out[s]->size())),
                 meta_type.get(), peers[s], detail::kTagCombineMeta);
    }
    try {
      ex.wait();
      if (perf) ex.add_recv_wait_us(perf);
      if (shm) shm->sync();           // the owners' rows, announced by "where", are visible
      if (mismatch) throw *mismatch;  // every row announced is taken; now the error
      // Every row must be the one expert_ids put at that position: same (token, slot), same
      // expert (a shared expert s is -1 - s).
      for (int d = 0; d < W; ++d) {
        const int64_t first = back.rank_offset[d], ld = sh.pl.local_experts(d);
        const std::vector<BackMeta>& m = d == me ? *meta_out[me] : *meta_in[d];
        const std::vector<int64_t>& where = layout[d];
        // This rank's own rows, when not in its window: row j is back_rows[send_first[me] + j] of
        // rows_src, or int8 row send_first[me] + j of qrows (comm_quant_mode 2).
        const bool own = d == me && !read[me];
        int64_t l = 0, in_block = 0;  // a window's row j: its block l and place in it
        for (int64_t j = 0; j < static_cast<int64_t>(m.size()); ++j) {
          const int64_t flat = back.order[first + j], i = flat / sh.KS, k = flat % sh.KS;
          const int64_t e = k < sh.K ? detail::index_at(in.expert_ids, i, k) : -1 - (k - sh.K);
          if (m[j].token != i || m[j].slot != k || m[j].expert != e)
            detail::invalid(op, ": expert_ids[", i, ",", k, "] = ", e, ", but rank ", peers[d],
                            " returned the output of expert ", m[j].expert, " for (token ",
                            m[j].token, ", slot ", m[j].slot,
                            ") at that position: expert_ids (and x_active_mask) must be those of "
                            "the matching dispatch_v2 (same tokens, same order)");
          if (cq) (*yscale)[flat] = m[j].qscale;
          if (own) {
            const int64_t r = send_first[me] + j;
            yrow[flat] = cq ? reinterpret_cast<const char*>(qrows) + r * wire_row
                            : static_cast<const char*>(rows_src.data) + back_rows[r] * src_stride;
            continue;
          }
          if (!read[d]) {
            yrow[flat] = y->ptr<char>() + (first + j) * wire_row;
            continue;
          }
          while (l < ld && in_block == where[static_cast<std::size_t>(3 + ld + l)])
            ++l, in_block = 0;
          MOE_EP_CHECK(l < ld);  // the counts agree (above)
          yrow[flat] = shm->peer_ptr(
              static_cast<int>(where[0]), peers[d],
              where[1] + (where[static_cast<std::size_t>(3 + l)] + in_block) * where[2], wire_row);
          ++in_block;
        }
      }
    } catch (const Error& e) {
      // The owners wait for this rank's "done" before they return; after a timeout the
      // communicator is unusable anyway.
      if (e.kind() != ErrorKind::kTimeout) try {
          finish_reading();
        } catch (...) {  // the first error is the one to report
        }
      throw;
    }
  }

  // SPEC §2.3 and §2.2, per active token, in fp32: for k = 0..K-1 (active entries), MoE expert:
  // acc += w * y_ik; zero expert: nothing; copy expert: acc += w * ori_x[i]; const expert q:
  // c = alpha_1[q] * ori_x[i] + alpha_2[q] * v[q] (each product rounded to fp32, then the sum),
  // acc += w * c. Then the hosted shared experts in s order (unweighted), then shared_expert_x.
  // Every product is rounded to fp32 before its add (-ffp-contract=off); one final rounding.
  const float* ysc = cq ? yscale->data() : nullptr;
  const char* const* yp = yrow.data();
  char* obase = out.ptr<char>();
  const int64_t BS = sh.BS, K = sh.K, KS = sh.KS, H = sh.H, E = sh.E, Ns = sh.pl.Ns;
  const DType dtype = sh.dtype;
  const detail::Activity act{&in.expert_ids, mask};
  // No const expert and no int8 rows: every term is w * a row of dtype (1 for the unweighted
  // ones, fl(1 * y) == y), so a token's sum is one sum_rows from +0, all its rows read side by
  // side with the accumulators in registers, bitwise the loop below.
  const bool by_rows = !cq && Q == 0;
  detail::parallel(detail::threads_if(BS * H > (1 << 16)), [&] {
    std::vector<float> acc(static_cast<std::size_t>(H)), c(static_cast<std::size_t>(H));
    std::vector<const void*> rows(static_cast<std::size_t>(KS + 1)), next(rows.size());
    std::vector<float> ws(static_cast<std::size_t>(KS + 1)), next_ws(ws.size());
    // Token i's terms in the SPEC §2.3 order: rows r[0..n) and their weights w; returns n.
    auto terms = [&](int64_t i, const void** r, float* w) {
      int64_t n = 0;
      if (i >= BS || !act.token(i)) return n;
      for (int64_t k = 0; k < K; ++k) {
        if (!act.entry(i, k)) continue;
        const int64_t e = detail::index_at(in.expert_ids, i, k);
        if (e >= E && e < E + Z) continue;                              // zero expert
        r[n] = e < E ? yp[i * KS + k] : detail::row_ptr(*in.ori_x, i);  // else copy expert
        w[n++] = detail::float_at(in.expert_scales, i, k);
      }
      for (int64_t s = 0; s < Ns; ++s) r[n] = yp[i * KS + K + s], w[n++] = 1;
      if (in.shared_expert_x) r[n] = shared_row(*in.shared_expert_x, i), w[n++] = 1;
      return n;
    };
#pragma omp for schedule(static)
    for (int64_t i = 0; i < BS; ++i) {
      if (by_rows) {
        // Token i + 1's rows are prefetched during token i's sum (sum_rows' ahead).
        const int64_t n = terms(i, rows.data(), ws.data());
        const int64_t ahead = terms(i + 1, next.data(), next_ws.data());
        detail::sum_rows(obase + i * row_bytes, dtype, rows.data(), ws.data(), n, dtype, H, false,
                         true, next.data(), ahead);
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (act.token(i)) {
        for (int64_t k = 0; k < K; ++k) {
          if (!act.entry(i, k)) continue;
          const int64_t e = detail::index_at(in.expert_ids, i, k);
          const float w = detail::float_at(in.expert_scales, i, k);
          if (e < E) {
            if (cq)  // SPEC §2.3 with comm_quant_mode 2: the dequantised row
              detail::axpy_row_int8(acc.data(), w, reinterpret_cast<const int8_t*>(yp[i * KS + k]),
                                    ysc[i * KS + k], H);
            else
              detail::axpy_row_f32(acc.data(), w, yp[i * KS + k], dtype, H);
          } else if (e < E + Z) {
            // zero expert: contributes nothing
          } else if (e < E + Z + C) {
            detail::axpy_row_f32(acc.data(), w, detail::row_ptr(*in.ori_x, i), dtype, H);
          } else {
            const int64_t q = e - (E + Z + C);
            const char* ox = detail::row_ptr(*in.ori_x, i);
            const char* a1 = detail::row_ptr(*in.const_expert_alpha_1, q);
            const char* a2 = detail::row_ptr(*in.const_expert_alpha_2, q);
            const char* v = detail::row_ptr(*in.const_expert_v, q);
            for (int64_t h = 0; h < H; ++h) {
              const float t1 = detail::load_f32(a1, dtype, h) * detail::load_f32(ox, dtype, h);
              const float t2 = detail::load_f32(a2, dtype, h) * detail::load_f32(v, dtype, h);
              c[h] = t1 + t2;
            }
            detail::axpy_row_f32(acc.data(), w, c.data(), DType::kF32, H);
          }
        }
        for (int64_t s = 0; s < Ns; ++s)
          if (cq)  // acc + fl(1 * y) == acc + y: the unweighted add
            detail::axpy_row_int8(acc.data(), 1.0f,
                                  reinterpret_cast<const int8_t*>(yp[i * KS + K + s]),
                                  ysc[i * KS + K + s], H);
          else
            detail::add_row_f32(acc.data(), yp[i * KS + K + s], dtype, H);
        if (in.shared_expert_x)
          detail::add_row_f32(acc.data(), shared_row(*in.shared_expert_x, i), dtype, H);
      }
      detail::store_row_f32(obase + i * row_bytes, dtype, acc.data(), H);
    }
  });
  finish_reading();
  return out;
}

DispatchWorkspace dispatch_workspace(const EpConfig& cfg, int64_t bs, int64_t hidden, int64_t top_k,
                                     DType dtype, int64_t quant_mode, int64_t comm_quant_mode) {
  const char* op = "dispatch_workspace";
  const Communicator& comm = require_comm(op, cfg);
  const int64_t transport = resolve_transport(op, cfg);
  detail::check_ep_config(op, cfg, comm.rank(), comm.size());
  if (bs < 0 || bs > INT32_MAX)
    detail::invalid(op, ": bs = ", bs, " must be in [0, ", INT32_MAX, "] (x.shape[0])");
  if (hidden < 1 || hidden > INT32_MAX)
    detail::invalid(op, ": hidden = ", hidden, " must be in [1, ", INT32_MAX, "] (x.shape[1])");
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32)
    detail::invalid(op, ": dtype = ", dtype_name(dtype), " must be bf16, fp16 or fp32");
  if (quant_mode != 0 && quant_mode != 2)
    detail::invalid(op, ": quant_mode = ", quant_mode, " is not one of {0, 2}");
  if (comm_quant_mode != 0 && comm_quant_mode != 2)
    detail::invalid(op, ": comm_quant_mode = ", comm_quant_mode, " is not one of {0, 2}");
  const World world = resolve_world(op, cfg, std::nullopt);
  EpShape sh = local_shape(cfg, world, bs, hidden, dtype);
  const int64_t ids = sh.E + sh.pl.special;
  if (top_k < 1 || top_k > ids)
    detail::invalid(op, ": top_k = ", top_k, " must be in [1, ", ids,
                    "] (moe_expert_num + zero/copy/const experts)");
  sh.K = top_k;
  sh.KS = sh.K + sh.pl.Ns;
  detail::compute_capacity(op, cfg.global_bs, sh);
  const int64_t esize = static_cast<int64_t>(dtype_size(dtype));
  const int64_t rows = tp_rows(cfg, sh.A);
  DispatchWorkspace w;
  w.recv_rows = sh.A;
  w.expand_x_bytes = rows * sh.H * (quant_mode == 2 ? 1 : esize);
  w.other_outputs_bytes = std::max(sh.BS * sh.K, sh.A * 128) * 4 +
                          rows * 4 * (quant_mode == 2 ? 2 : 1) +
                          sh.W * sh.L * std::max<int64_t>(1, cfg.tp_world_size) * 4 +
                          std::max<int64_t>(1, cfg.tp_world_size) * 4 + sh.L * 8;
  if (shm_applies(transport, cfg, world)) {
    w.shm_slot_bytes = detail::ShmContext::slot_bytes(dispatch_slot_need(w.expand_x_bytes, rows));
    w.shm_stage_bytes =
        detail::ShmContext::slot_bytes(sh.A * sh.H * (comm_quant_mode == 2 ? 1 : esize));
  }
  w.combine_output_bytes = sh.BS * sh.H * esize;
  return w;
}

}  // namespace moe_ep
