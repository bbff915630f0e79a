// dispatch_v2 / combine_v2 over MPI: SPEC §1 and §2 (torch_npu npu_moe_distribute_dispatch_v2 /
// npu_moe_distribute_combine_v2). Field names are the SPEC's parameter names.
//
// Supported in this build (everything else raises Error(kUnsupported) naming the argument, never a
// wrong answer): tp_world_size 0, 1 or 2 (see "Tensor parallelism"); shared-expert ranks (S, Ns);
// x_active_mask 1-D or 2-D; zero/copy/const experts; elastic_info scale-in; performance_info;
// quant_mode 0, 2 (int8, with optional smoothing scales) and comm_quant_mode 0, 2; comm_alg "",
// "fullmesh" or "hierarchy" (not with tp_world_size 2, elastic_info or performance_info);
// expert_shard_type 0; expert id -1 = inactive entry; global_bs 0 (BS equal on all
// ranks) or global_bs = W * m with m >= max BS (BS may differ, BS = 0 allowed; then every token
// must be active); expert_token_nums_type 0, 1.
//
// Activity (SPEC §1.3, §1.6): entry (i, k) is active when expert_ids[i,k] != -1 and
// x_active_mask allows it (1-D: mask[i]; 2-D: mask[i,k]); a token is active when at least one of
// its entries is. An inactive token is sent nowhere (not to the shared experts either) and its
// combine output is 0. Special expert ids (>= E) count as active entries but are never sent.
//
// Scale-in (SPEC §1.7, elastic_info with is_scaled_down = 1): a removed rank (old->new = -1) takes
// no part: after checking its own arguments it returns at once, sending nothing (dispatch_v2:
// expand_x (0, H), assist_info_for_combine, expand_scales, expert_token_nums and ep_recv_counts
// empty, tp_recv_counts (1,) = 0; combine_v2: (BS, H) zeros). The surviving ranks run the op as a
// fresh world of the new W ranks (new rank = old->new[ep_rank_id]) with the new S and E: placement,
// ep_recv_counts, assist_info_for_combine (source = new rank), A and global_bs (interpreted for the
// new world) are those of that smaller world, and expert_ids use the new E. The survivors check
// that they passed the same table (a hash in the header); a rank whose table disagrees about WHO
// survives cannot be told apart from a dead one and shows up as a Timeout. ep_world_size,
// ep_rank_id, performance_info, moe_expert_num and shared_expert_rank_num keep the old
// (group_ep) values, checked against the old world (moe_expert_num a multiple of ep_world_size -
// shared_expert_rank_num); the table's new E and S alone decide the new placement.
//
// Tensor parallelism (tp_world_size 2, SPEC §1.1 step 3, §2): group_tp holds the TP pair (2
// ranks; tp_rank_id must equal group_tp->rank()), the same ep_rank_id of two EP groups (any rank
// grouping: group_ep and group_tp are just communicators), and L must be 1 (moe_expert_num =
// ep_world_size - shared_expert_rank_num). dispatch_v2 runs the EP exchange, then sends this rank's
// valid rows to its TP peer and appends the peer's, PACKED: expand_x (2A, H) rows [0, own) this
// rank's, [own, own + peer) the peer's, unspecified after; ep_recv_counts (2W,) is one inclusive
// running sum whose second W entries (continuing from own) are the peer's blocks by source rank;
// tp_recv_counts (2,) [tp_rank_id] = own, [1 - tp_rank_id] = peer; expert_token_nums = own + peer;
// assist_info_for_combine, expand_scales (2A,) and dynamic_scales (2A,) hold both halves.
// combine_v2 takes expand_x with each row's PARTIAL expert output: it sends the peer's rows to the
// peer, receives the peer's partials for its own rows, forms rs_out[j] = fp32(partial of tp rank
// 0) + fp32(partial of tp rank 1) rounded once (the same bits on both ranks), then runs the EP
// all-to-all on rs_out. Before the EP header, the pair exchanges a header (same deadline): a
// failure on one rank of a pair reaches both EP groups (kRemote), a disagreement within the pair
// (ep_rank_id, W, E, S, H, dtype, A, row counts) is kInvalidArgument on both. Errors: group_tp
// null or not of size 2, tp_rank_id != group_tp->rank(), L != 1, comm_quant_mode 2
// (kInvalidArgument); elastic_info scale-in with TP (kUnsupported). A TP peer that does not call
// the op (or passes tp_world_size != 2) shows up as kTimeout.
//
// Both ops are collective over group_ep: every rank of it must call them, in the same order. Before
// moving data, the ranks exchange a small header; a rank whose arguments fail validation throws
// its error (kInvalidArgument, or kUnsupported) and every other rank throws Error(kRemote) carrying
// that message, so a mistake on one rank never hangs the others. Ranks that disagree on
// ep_world_size, moe_expert_num, global_bs (or any other argument SPEC §1.3 requires equal) all
// throw Error(kInvalidArgument). Every wait has the communicator's deadline (Error(kTimeout) names
// rank, peer and phase); after a timeout the communicator is unusable. MPI failures raise
// Error(kSystem).
//
// Shared-memory transport (EpConfig::transport "shm", the default; docs/design.md): the first op
// that uses it creates, collectively over group_ep, the node communicator and a window per
// machine; windows grow (collectively over the machine, after the header agreement) when a call
// needs more. dispatch_v2's expand_x then lives in a slot of this rank's window: it is a normal
// Tensor, valid as long as any copy of it lives (even after the Communicator is destroyed), and
// the slot is reused by a later call only once every copy has been released. A call for which
// no slot is free (previous outputs still held and the window full) receives into ordinary
// memory through MPI instead. combine_v2 lets peers read expand_x in place when it lies in this
// rank's window (experts run in place on dispatch_v2's expand_x), otherwise it copies the valid
// rows once into a window slot (comm_quant_mode 2: quantises them there); combine_v2 returns only
// after every peer on the machine has finished reading them. The whole call uses MPI when
// tp_world_size is 2 or elastic_info scales in (is_scaled_down 1).
//
// Data flow (docs/design.md): a header exchange, then per-(destination, local expert) counts, then
// the rows as contiguous messages (dispatch: one per (destination, local expert) block, packed by
// the sender in send order and received straight into place, or one per destination of each
// distinct token once; combine: one per block, sent straight from expand_x when its rows are
// contiguous, after the owners announce their counts per block), plus a per-row metadata message
// (int8 rows: their fp32 scale travels there). A rank's own rows go through no message (dispatch
// still sends itself their metadata). After a timeout (Error kTimeout) MPI may still read the
// buffers of the abandoned call, the caller's expand_x included: keep them alive, and treat the
// communicator as unusable. Row counts and offsets
// are 64-bit; one message holds at most INT32_MAX rows of at most INT_MAX bytes each
// (Error(kUnsupported) beyond).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "moe_ep/comm.h"
#include "moe_ep/error.h"
#include "moe_ep/export.h"
#include "moe_ep/tensor.h"

namespace moe_ep {

namespace detail {
struct EpPlan;
struct HandleInternals;
}  // namespace detail

// The arguments dispatch_v2 and combine_v2 share; they must be equal on all ranks (except
// ep_rank_id and tp_rank_id) and equal between a dispatch and its combine.
struct EpConfig {
  Communicator* group_ep = nullptr;  // [in] not owned; group_ep->size() must equal ep_world_size
  int64_t ep_world_size = 0;         // W >= 1
  int64_t ep_rank_id = 0;            // r in [0, W); must equal group_ep->rank()
  int64_t moe_expert_num = 0;        // E >= 1, E % (W - S) == 0
  Communicator* group_tp = nullptr;  // [in] not owned; the TP pair (size 2) when T == 2
  int64_t tp_world_size = 0;         // T: 0, 1 (no TP) or 2 (see "Tensor parallelism")
  int64_t tp_rank_id = 0;            // 0 unless T == 2; then group_tp->rank()
  int64_t expert_shard_type = 0;     // must be 0 (the only placement, SPEC §1.2)
  // Shared experts (SPEC §1.2): Ns in [0, 4]; valid (Ns, S): (1, 0) the default, (0, 0), or
  // Ns > 0 with S % Ns == 0, S in [0, W). Ranks [0, S) host the Ns shared experts (expert s on
  // ranks [s*S/Ns, (s+1)*S/Ns)); MoE expert e lives on rank S + e / L, L = E / (W - S). With S = 0
  // no rank hosts shared experts (pass their output as combine_v2's shared_expert_x). Rank r sends
  // every active token once to rank (r % (S/Ns)) + s*(S/Ns) for each s. Errors: kInvalidArgument.
  int64_t shared_expert_num = 1;       // Ns
  int64_t shared_expert_rank_num = 0;  // S
  int64_t global_bs = 0;  // 0 (BS equal on all ranks) or W * m, m >= max BS over ranks (BS may
                          // then differ across ranks, and be 0)
  // "" or "fullmesh": every rank sends every other its rows. "hierarchy" (SPEC §3): across
  // nodes (the ranks sharing memory, or runs of $MOE_EP_SHM_NODE_RANKS; equal in size and
  // numbered node-major, else kInvalidArgument on every rank), a token crosses once per
  // destination node, to the source's relay there (the rank of that node with the source's local
  // index), which copies it to the node's ranks; combine_v2's relays send back one partial sum
  // per (token, node). dispatch_v2's outputs are fullmesh's bit for bit; combine_v2 differs only
  // by SPEC §3's re-association (deterministic). smoothing `scales` must then be the same on every
  // rank (the relay quantises the copies it makes with its own). On one node: fullmesh.
  // kUnsupported with tp_world_size 2, elastic_info or performance_info.
  std::string comm_alg;
  // comm_alg "hierarchy" (SPEC §3): the dtype of the partial sums combine_v2's relays send back,
  // one row per (token, node). "" or "fp32" (default): fp32, summed at the source unrounded.
  // "bf16", with bf16 expand_x only (else kInvalidArgument): the relay sums in fp32 and rounds
  // each partial p once, to nearest even, before the network: half the bytes, and the output
  // moves by at most 2^-8 |p| per remote node's partial before its final rounding (docs/spec.md,
  // "Partials"). Still deterministic. "fp16": kUnsupported (a partial beyond fp16's range would
  // become inf where other nodes' partials cancel it). Another value: kInvalidArgument. With
  // comm_quant_mode 2 the partials travel as int8 whatever this says; other comm_algs, and
  // dispatch_v2_backward (its gradients' partials stay fp32), ignore it. combine_v2's ranks must
  // pass the same value (else kInvalidArgument on every rank).
  std::string partials;
  // How rows move between ranks on the same machine (not a SPEC argument; results are bitwise
  // the same either way). "mpi": MPI point-to-point for every peer. "shm": ranks that share
  // memory (MPI_Comm_split_type SHARED) write dispatch_v2's rows straight into the receiver's
  // expand_x inside an MPI-3 shared-memory window, and combine_v2 reads the expert outputs from
  // the owner's window; peers on other machines use MPI. "" (default): $MOE_EP_TRANSPORT when
  // set, else "shm". Must resolve to the same value on every rank (kInvalidArgument on every rank
  // otherwise); any other value, here or in $MOE_EP_TRANSPORT: kInvalidArgument naming it. See
  // "Shared-memory transport" below for when a call still uses MPI and for the lifetime of
  // expand_x.
  std::string transport;
  // Output sizes (not a SPEC argument; SPEC §1.4 defines A). false (default): dispatch_v2's
  // row-indexed outputs have SPEC §1.4's worst-case sizes, A = G * min(L, K) rows (which grows
  // with W at a fixed BS), and the shared-memory window holds that many rows per output. true:
  // sized to the rows this rank actually receives, valid = ep_recv_counts[W*L-1], as DeepEP's
  // normal mode does: expand_x (valid, H), dynamic_scales, expand_scales (valid,),
  // assist_info_for_combine (3 * valid,), and a window slot of valid rows; the other outputs
  // keep their SPEC sizes. The valid rows and every other value are bitwise those of false
  // (docs/design.md, "Exact-size outputs"). A dispatch_v2 without a handle then agrees once more
  // after its counts phase (phase "exact sizes": the outputs are sized there, and a failure there
  // reaches every rank); a cached dispatch (DispatchInputs::handle) sizes them up front.
  // combine_v2 with true accepts assist_info_for_combine of at least 3 * valid entries (false: it
  // must be SPEC's max(BS*K, A*128)); expand_x needs at least the valid rows either way.
  // DispatchBuffers given to dispatch_v2 with true must hold at least the rows the call writes
  // (kInvalidArgument on every rank otherwise, after the counts phase); the outputs view their
  // first rows. Must be equal on all ranks (kInvalidArgument on every rank otherwise).
  // kUnsupported with tp_world_size 2 (the TP peer's rows would have to be known before the
  // EP exchange).
  bool exact_size = false;
  // Special experts (SPEC §2.2), Z, C, Q >= 0, E+Z+C+Q < 2^31-1: ids [E, E+Z) zero experts,
  // [E+Z, E+Z+C) copy experts, [E+Z+C, E+Z+C+Q) const experts. Never sent; combine_v2 evaluates
  // them locally. K <= E+Z+C+Q.
  int64_t zero_expert_num = 0;   // Z
  int64_t copy_expert_num = 0;   // C
  int64_t const_expert_num = 0;  // Q
};

// SPEC §7: the plan one dispatch_v2 computed (who sends which rows where, and where they landed),
// returned with its outputs. Given to the combine_v2 of those outputs, it lets combine exchange
// the rows only: no "layout back" round, no per-row metadata, no assist_info_for_combine or
// ep_send_counts to read. Given to a later dispatch_v2 with the same routing (a "cached
// dispatch", e.g. the recomputation of a layer in the backward pass), it skips the counts phase.
// A handle is bound to its communicator (group_ep, group_tp), to the arguments every rank agrees
// on, and to its dispatch's expert_ids and x_active_mask (compared element by element on every
// use: kInvalidArgument naming the first difference), and every rank must pass the handle of the
// same dispatch_v2 call, or none (kInvalidArgument on every rank otherwise). Copies share the
// plan; it lives as long as any copy. Small: its memory is that of the routing, O(BS * K + W * L).
class MOE_EP_API DispatchHandle {
 public:
  DispatchHandle() = default;
  // False for a default-constructed handle (and on a rank removed by a scale-in).
  bool defined() const { return plan_ != nullptr; }

 private:
  friend struct detail::HandleInternals;
  std::shared_ptr<const detail::EpPlan> plan_;
};

// Caller-allocated outputs of dispatch_v2 (as NCCL EP's API allows), so that a serving loop
// allocates no output per call. Each view given must be contiguous, of exactly the dtype and
// shape dispatch_v2 returns for it (dispatch_workspace gives the sizes) and stay alive while the
// outputs are used: the returned tensors then view this memory and do not own it. Views not
// given are allocated as usual. expand_x: when it is the expand_x of an earlier dispatch_v2 on
// this communicator whose tensor is still alive (its shared-memory slot), the senders on this
// machine write into it in place and the returned expand_x keeps the slot; any other memory
// gets the rows through the usual path (with shared memory: a slot of the window, then one
// copy of the valid rows). The serving-loop pattern: keep the first call's outputs as the
// buffers, `DispatchBuffers b = buffers_of(first);` then `in.out = &b;` on every call.
// The views must not overlap an input (x, expert_ids, expert_scales, scales, x_active_mask) or
// each other. Errors: kInvalidArgument "dispatch_v2: out.expand_scales is fp32[8] but this call
// writes fp32[12]", a non-contiguous view, an overlap, dynamic_scales with quant_mode 0. With
// EpConfig::exact_size, expand_x, dynamic_scales, expand_scales and assist_info_for_combine may
// hold more rows than the call writes (the outputs view their first ones), not fewer: a view too
// small is kInvalidArgument on this rank (kRemote on the others), raised after the counts phase
// (the sizes are known only then) unless the call is a cached dispatch.
struct DispatchBuffers {
  std::optional<TensorView> expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums,
      ep_recv_counts, tp_recv_counts, expand_scales;
};

// SPEC §1.3.
struct DispatchInputs {
  TensorView x;           // [in] (BS, H) bf16/fp16/fp32, BS >= 0; rows may be strided
                          //      (stride(0) >= 0 any), stride(1) == 1. Read during the call only
  TensorView expert_ids;  // [in] (BS, K) int32, any strides; each id in [0, E+Z+C+Q) or -1
                          //      (inactive); the non-negative ids of a row are distinct
  std::optional<TensorView> expert_scales;  // [in] (BS, K) fp32, any strides -> expand_scales
  // [in] quant_mode 2 only (given with quant_mode 0: kInvalidArgument): fp32 smoothing factors,
  // contiguous, (Ns + E, H) when shared-expert ranks are configured (S > 0), else (E, H). A copy of
  // token i for MoE expert e is multiplied element-wise by row Ns + e before quantisation, a copy
  // for shared expert s by row s. Wrong dtype, shape or strides: kInvalidArgument. SPEC §1.3.
  std::optional<TensorView> scales;
  // [in] bool (BS,) with all Trues before all Falses (else kInvalidArgument naming the index and
  // value), or bool (BS, K) per entry; any strides. See "Activity" above. When BS differs across
  // ranks every element must be True (kInvalidArgument on all ranks). SPEC §1.3, §1.6.
  std::optional<TensorView> x_active_mask;
  // [in] int32 (4 + 2W,), W = ep_world_size: [is_scaled_down (0/1), new W, new S, new E,
  // W x (old rank -> new rank, -1 = removed), W x (new rank -> old rank, -1 padding)]; checked
  // for consistency (kInvalidArgument naming the element). See "Scale-in" above. SPEC §1.7.
  std::optional<TensorView> elastic_info;
  // [in/out] int64 (W,), contiguous: for each group_ep rank p, the microseconds this rank waited
  // for p's data (header, counts and rows phases, and "exact sizes" with EpConfig::exact_size:
  // from the start of each phase's wait until p's last message of that phase arrived) are ADDED
  // to performance_info[p]; never zeroed. SPEC §1.8.
  std::optional<TensorView> performance_info;
  // 0: rows travel in x's dtype. 2: dynamic per-row int8 (SPEC §1.5): every (token,
  // destination) copy, shared-expert copies included, is xf = fp32(x_row) (* scales row),
  // s = 127 / max|xf|, q = int8(rne(xf * s)), and expand_x gets q, dynamic_scales 1/s (an all-zero
  // row: q = 0, scale 0; a NaN/Inf in xf: q = 0, scale NaN, never an error). Dequantised,
  // fl(q * scale) is within max|xf| / 254 * (1 + 2^-14) + 2^-143 of xf per element
  // (src/kernels/cpu/quant.h). Must be equal on all ranks (kInvalidArgument on every rank).
  int64_t quant_mode = 0;
  int64_t expert_token_nums_type = 1;  // 0 = running sum, 1 = per-expert count
  // A bad argument the caller found before the call, e.g. a binding that could not convert a
  // tensor: the op reports it on this rank before any other check, exactly like its own checks
  // (this rank throws it, the others Error(kRemote) naming this rank), instead of this rank
  // leaving and its peers waiting until their deadline. The other fields may be unset.
  std::optional<Error> caller_error;
  // [in] optional, SPEC §7: the handle of an earlier dispatch_v2 with the same expert_ids and
  // x_active_mask (a cached dispatch: no counts phase). H, dtype, expert_scales, quant_mode and
  // scales may differ, except that a handle whose dispatch sent some tokens once per MPI
  // destination is refused with quant_mode 2 smoothing scales or H = 0 (kInvalidArgument: each
  // copy then has its own bytes). Not owned; read during the call only. The outputs are those of
  // an uncached call, bit for bit.
  const DispatchHandle* handle = nullptr;
  // [out] optional: where to write the outputs (see DispatchBuffers). Not owned.
  const DispatchBuffers* out = nullptr;
};

// SPEC §1.4. A = G * min(L, K) on a MoE rank, (G / W) * ceil(W / (S / Ns)) on a shared-expert
// rank, with G = global_bs, or BS * W when global_bs is 0; L = local experts of this rank
// (E / (W - S) on a MoE rank, 1 on a shared-expert rank). With EpConfig::exact_size, read
// "valid" (ep_recv_counts[W*L-1]) for "max(1,T)*A" below, assist_info_for_combine is
// (3 * valid,), and nothing lies past the valid rows. On a shared-expert rank the rows form
// one block per source rank, in rank order, holding that sender's active tokens in order.
// All outputs are contiguous and owned by the returned Tensors (they live as long as any copy),
// except those written into the caller's memory (DispatchInputs::out), which they only view.
// expand_x may be a reused slot of the shared-memory window and the others reused blocks of
// Tensor::empty's cache, so what lies past the valid rows is left over from earlier calls.
struct DispatchOutputs {
  Tensor expand_x;  // (max(1,T)*A, H) (T == 2: see "Tensor parallelism"), x's dtype (int8 with
                    // quant_mode 2); the first ep_recv_counts[W*L-1] rows are valid, in the SPEC
                    // §1.4 order (local expert, source rank, entry i*K+k); the rows
                    // after them are unspecified (left as they were: not zeroed, which would
                    // cost as much as the rows moved, A being the worst case)
  // quant_mode 2: expand_x is int8 (same shape and row layout) and dynamic_scales is (A,) fp32,
  // the dequantisation factor of each received row (0 beyond the valid rows); quant_mode 0:
  // undefined (defined() == false).
  Tensor dynamic_scales;
  Tensor assist_info_for_combine;  // (max(BS*K, A*128),) int32: [3j, 3j+1, 3j+2] = (source rank,
                                   // source token, top-k slot) of row j (slot K + s for a copy
                                   // to shared expert s); the entries after
                                   // 3 * valid are unspecified
  Tensor expert_token_nums;        // (L,) int64: rows per local expert (expert_token_nums_type
                                   // 1) or their running sum (type 0)
  Tensor ep_recv_counts;           // (W*L*max(1,T),) int32, inclusive running sum over
                                   // (expert, source); T == 2: then the peer's blocks
  Tensor tp_recv_counts;           // (max(1,T),) int32: the number of valid rows (T == 2:
                                   // [tp_rank_id] own, [1 - tp_rank_id] the peer's)
  Tensor expand_scales;  // (max(1,T)*A,) fp32: expert_scales of each row (0 when not given,
                         // for shared-expert copies, and beyond the valid rows)
  // Not a SPEC output: the plan of this call (SPEC §7), for its combine_v2 and cached dispatches.
  DispatchHandle handle;
};

// Collective over cfg.group_ep. Errors: kInvalidArgument (this rank's arguments, or ranks that
// disagree), kUnsupported (outside this build's slice), kRemote (another rank's arguments),
// kTimeout, kSystem. docs/errors.md lists every check.
MOE_EP_API DispatchOutputs dispatch_v2(const DispatchInputs& in, const EpConfig& cfg);

// Views of every defined output of `outputs`, to pass back as DispatchInputs::out (they stay
// valid while `outputs`' tensors live).
MOE_EP_API DispatchBuffers buffers_of(const DispatchOutputs& outputs);

// SPEC §2.1. expand_x holds the expert outputs, row for row in dispatch's layout.
struct CombineInputs {
  TensorView expand_x;                 // [in] (A', H) bf16/fp16/fp32 with A' >= valid rows;
                                       //      rows may be strided, stride(1) == 1. The dtype
                                       //      and H must be equal on all ranks
  TensorView expert_ids;               // [in] (BS, K) int32: the same as given to dispatch_v2
                                       //      (other ids: Error(kInvalidArgument) on this rank)
  TensorView assist_info_for_combine;  // [in] from dispatch_v2, (max(BS*K, A*128),) int32
                                       //      (EpConfig::exact_size: at least 3 * valid); the
                                       //      source rank of each valid row is checked
  TensorView ep_send_counts;           // [in] dispatch_v2's ep_recv_counts, (W*L*max(1,T),) int32
  TensorView expert_scales;            // [in] (BS, K) fp32 top-K weights, any strides
  // [in] T == 2: dispatch_v2's tp_recv_counts, checked against ep_send_counts when given;
  // T < 2: Unsupported
  std::optional<TensorView> tp_send_counts;
  std::optional<TensorView> x_active_mask;  // [in] the one given to dispatch_v2 (a different
                                            //      mask: kInvalidArgument when rows mismatch)
  std::optional<TensorView> expand_scales;  // [in] fp32 1-D, checked, not read (the weights are
                                            //      expert_scales, also with "hierarchy")
  // [in] expand_x's dtype, (BS, H) or (a, b, H) with a*b = BS; rows may be strided, the last
  // stride must be 1. Added unweighted to every ACTIVE token after the K terms and the hosted
  // shared experts (SPEC §2.3). kInvalidArgument for a wrong shape or dtype.
  std::optional<TensorView> shared_expert_x;
  std::optional<TensorView> elastic_info;  // [in] the same table as dispatch_v2's
  // [in] (BS, H) expand_x's dtype, rows may be strided: the tokens before the experts. Required
  // when copy_expert_num > 0 or const_expert_num > 0 ("combine_v2: ori_x is required when
  // copy_expert_num = 1 > 0"); checked whenever given.
  std::optional<TensorView> ori_x;
  // [in] (Q, H) expand_x's dtype each, rows may be strided; required when Q > 0, checked
  // whenever given (then with Q rows).
  std::optional<TensorView> const_expert_alpha_1;
  std::optional<TensorView> const_expert_alpha_2;
  std::optional<TensorView> const_expert_v;
  // [in/out] int64 (W,): as dispatch_v2's (header, layout back and rows phases)
  std::optional<TensorView> performance_info;
  // 0, or 2: each expert output row travels back as int8 with an fp32 scale (SPEC §1.5 rounding,
  // no smoothing) and is dequantised inside the weighted sum (axpy of fl(q * scale), SPEC §2.3
  // order unchanged; the shared-expert rows too). Per token the result differs from the
  // unquantised sum by at most sum_k |w_k| (max|y_k| / 254 (1 + 2^-14) + 2^-143) plus the usual
  // fp32 rounding. Not allowed with tp_world_size 2 (kInvalidArgument, reported before any other
  // check); must be equal on all ranks (kInvalidArgument on every rank).
  int64_t comm_quant_mode = 0;
  // A bad argument the caller found before the call, e.g. a binding that could not convert a
  // tensor: the op reports it on this rank before any other check, exactly like its own checks
  // (this rank throws it, the others Error(kRemote) naming this rank), instead of this rank
  // leaving and its peers waiting until their deadline. The other fields may be unset.
  std::optional<Error> caller_error;
  // [in] optional, SPEC §7: the handle dispatch_v2 returned with these rows. Then only the rows
  // travel (no "layout back" round, no per-row metadata), assist_info_for_combine,
  // ep_send_counts and tp_send_counts are not read (they may be left empty; with T == 2 the TP
  // peer's row count comes from the pair's handshake), and expert_ids / x_active_mask must be
  // that dispatch's (checked element by element). The result is the same bits. Not owned.
  const DispatchHandle* handle = nullptr;
  // [out] optional: the caller's (BS, H) contiguous tensor of expand_x's dtype, which combine_v2
  // writes and returns a (non-owning) view of, instead of allocating one. It must not overlap
  // an input (peers may still read expand_x while it is written). kInvalidArgument for another
  // shape, dtype or layout, or an overlap.
  std::optional<TensorView> out;
};

// Returns x (BS, H) in expand_x's dtype: SPEC §2.3 and §2.2, for each ACTIVE token i, in fp32
// (every product rounded to fp32 before its add; no FMA), acc = 0, then for k = 0..K-1, active
// entries only, e = expert_ids[i,k], w = expert_scales[i,k], at slot k's position:
//   MoE expert (e < E):        acc += w * fp32(y_ik)
//   zero expert:               nothing (skipped, like an inactive entry)
//   copy expert:               acc += w * fp32(ori_x[i])
//   const expert q = e-E-Z-C:  c = fp32(alpha_1[q] * ori_x[i]) + fp32(alpha_2[q] * v[q]) (fp32),
//                              acc += w * c
// then acc += fp32(shared_y_is) for each hosted shared expert s = 0..Ns-1 (S > 0), then
// acc += fp32(shared_expert_x[i]) if given; rounded once to nearest even. Inactive tokens give 0.
// Bitwise independent of W (and of S for the same shared outputs).
// Collective over cfg.group_ep, with the errors of dispatch_v2.
MOE_EP_API Tensor combine_v2(const CombineInputs& in, const EpConfig& cfg);

// The memory one dispatch_v2 call and the combine_v2 that follows it take on this rank, known
// before any call (a size query: plan memory, and size the shared-memory window up front with
// CommOptions::shm_window_bytes so that no call has to grow it). All in bytes.
struct DispatchWorkspace {
  // EpConfig::exact_size: every size below is the most a call takes (a call's row outputs and
  // slot hold its valid rows, at most A), and assist_info_for_combine counts 3 entries per row.
  int64_t recv_rows = 0;       // A (SPEC §1.4); expand_x has max(1,T)*A rows (2A with T = 2)
  int64_t expand_x_bytes = 0;  // max(1,T)*A x H x (1 with quant_mode 2, else x's element size)
  // dispatch_v2's other outputs together: assist_info_for_combine (max(BS*K, A*128) x 4),
  // expand_scales and, with quant_mode 2, dynamic_scales (max(1,T)*A x 4 each), ep_recv_counts,
  // tp_recv_counts and expert_token_nums.
  int64_t other_outputs_bytes = 0;
  // Shared-memory transport (0 when the calls use MPI only: transport "mpi", tp_world_size 2):
  // shm_slot_bytes: the part of this rank's window segment one dispatch_v2 output holds while any
  // copy of its expand_x lives: expand_x_bytes rounded up to 64, plus 16 bytes of per-row metadata
  // (the senders on this machine write it next to their rows) per row of expand_x, all rounded
  // up to 4 KiB.
  // shm_stage_bytes: what a combine_v2 holds during the call when its expand_x is not such a slot
  // (the experts wrote their outputs elsewhere) or comm_quant_mode is 2: its valid rows staged, at
  // most A rows of H x x's element size (the experts' outputs in x's dtype), or with
  // comm_quant_mode 2 A int8 rows of H bytes, rounded up to 64, then A fp32 scales. A window of n x
  // shm_slot_bytes + shm_stage_bytes (CommOptions::shm_window_bytes) holds n live dispatch_v2
  // outputs and the combine_v2 of any of them without growing. A call that finds no room in a
  // window big enough for it grows the window (a new generation) while this rank's windows together
  // map less than 4 times its largest request; beyond that it uses MPI for that call (slower, same
  // bits), so holding many outputs does not grow this rank's memory without bound. (Every rank of
  // the machine adds a segment when one asks, so a rank that holds nothing can still gain a
  // generation per request of a peer.)
  int64_t shm_slot_bytes = 0;
  int64_t shm_stage_bytes = 0;
  int64_t combine_output_bytes = 0;  // combine_v2's x: BS x H x x's element size
};

// Local (no communication). cfg as for dispatch_v2 (group_ep set, the same checks and errors:
// kInvalidArgument, kUnsupported), without elastic_info (a scale-in changes W and A; query with
// the new world's cfg). bs: tokens on this rank (x.shape[0], >= 0), hidden: H (>= 1), top_k: K
// (expert_ids.shape[1], >= 1), dtype: x's (bf16, fp16, fp32), quant_mode: dispatch_v2's (0 or
// 2), comm_quant_mode: combine_v2's (0 or 2).
MOE_EP_API DispatchWorkspace dispatch_workspace(const EpConfig& cfg, int64_t bs, int64_t hidden,
                                                int64_t top_k, DType dtype, int64_t quant_mode = 0,
                                                int64_t comm_quant_mode = 0);

}  // namespace moe_ep
