#include "core/ep/config.h"

#include <algorithm>
#include <climits>
#include <string>
#include <utility>

#include "base/check.h"
#include "base/env.h"
#include "core/validate.h"
#include "transport/communicator.h"
#include "transport/nodes.h"

namespace moe_ep::detail {

void check_placement(const char* op, int64_t W, int64_t S, int64_t Ns, int64_t E,
                     const char* what) {
  if (W < 1) invalid(op, ": ep_world_size", what, " = ", W, " must be >= 1");
  if (S < 0 || S >= W)
    invalid(op, ": shared_expert_rank_num", what, " = ", S, " is outside [0, ", W,
            ") (ep_world_size)");
  if (Ns < 0 || Ns > 4) invalid(op, ": shared_expert_num = ", Ns, " is outside [0, 4]");
  if (S == 0 && Ns > 1)
    invalid(op, ": shared_expert_num = ", Ns,
            " needs shared_expert_rank_num > 0 and a multiple of it (shared_expert_rank_num", what,
            " = 0; valid: (1, 0), (0, 0), or shared_expert_num > 0 dividing "
            "shared_expert_rank_num)");
  if (S > 0 && Ns == 0)
    invalid(op, ": shared_expert_rank_num", what, " = ", S,
            " needs shared_expert_num > 0 (shared_expert_num = 0)");
  if (S > 0 && S % Ns != 0)
    invalid(op, ": shared_expert_rank_num", what, " = ", S,
            " is not a multiple of shared_expert_num = ", Ns);
  if (E < 1) invalid(op, ": moe_expert_num", what, " = ", E, " must be >= 1");
  if (E >= INT32_MAX) invalid(op, ": moe_expert_num", what, " = ", E, " must be < 2^31 - 1");
  if (E % (W - S) != 0)
    invalid(op, ": moe_expert_num", what, " = ", E,
            " is not a multiple of ep_world_size - shared_expert_rank_num = ", W - S);
}

void check_ep_config(const char* op, const EpConfig& cfg, int comm_rank, int comm_size) {
  if (cfg.ep_world_size < 1) invalid(op, ": ep_world_size = ", cfg.ep_world_size, " must be >= 1");
  if (cfg.ep_world_size != comm_size)
    invalid(op, ": ep_world_size = ", cfg.ep_world_size, " differs from group_ep's size ",
            comm_size);
  if (cfg.ep_rank_id != comm_rank)
    invalid(op, ": ep_rank_id = ", cfg.ep_rank_id, " differs from this rank's rank ", comm_rank,
            " in group_ep (ep_rank_id must be in [0, ", comm_size, ") and equal group_ep's rank)");
  if (cfg.tp_world_size < 0 || cfg.tp_world_size > 2)
    invalid(op, ": tp_world_size = ", cfg.tp_world_size, " is not one of {0, 1, 2}");
  if (cfg.tp_world_size == 2) {
    // SPEC §1.3: a TP pair is group_tp (2 ranks); this rank is tp_rank_id in it.
    if (cfg.group_tp == nullptr) invalid(op, ": group_tp is null with tp_world_size = 2");
    if (cfg.group_tp->size() != 2)
      invalid(op, ": group_tp has ", cfg.group_tp->size(),
              " ranks but tp_world_size = 2 (group_tp must hold exactly the TP pair)");
    if (cfg.tp_rank_id != cfg.group_tp->rank())
      invalid(op, ": tp_rank_id = ", cfg.tp_rank_id, " differs from this rank's rank ",
              cfg.group_tp->rank(), " in group_tp (tp_rank_id must be in [0, 2) and equal ",
              "group_tp's rank)");
  } else if (cfg.tp_rank_id != 0) {
    invalid(op, ": tp_rank_id = ", cfg.tp_rank_id,
            " must be 0 when tp_world_size = ", cfg.tp_world_size);
  }
  if (cfg.expert_shard_type != 0)
    invalid(op, ": expert_shard_type = ", cfg.expert_shard_type, " is not 0 (the only value)");
  check_placement(op, cfg.ep_world_size, cfg.shared_expert_rank_num, cfg.shared_expert_num,
                  cfg.moe_expert_num, "");
  if (cfg.tp_world_size == 2 &&
      cfg.moe_expert_num != cfg.ep_world_size - cfg.shared_expert_rank_num)
    invalid(op, ": moe_expert_num = ", cfg.moe_expert_num,
            " gives L = ", cfg.moe_expert_num / (cfg.ep_world_size - cfg.shared_expert_rank_num),
            " local experts per MoE rank, but tp_world_size = 2 needs L = 1 (moe_expert_num = ",
            "ep_world_size - shared_expert_rank_num = ",
            cfg.ep_world_size - cfg.shared_expert_rank_num, ")");
  if (cfg.exact_size && cfg.tp_world_size == 2)
    unsupported(op,
                ": exact_size = true does not support tp_world_size = 2 (the TP peer's rows "
                "would have to be known before the EP exchange); use exact_size = false");
  if (cfg.comm_alg == "hierarchy" && cfg.tp_world_size == 2)
    unsupported(op, ": comm_alg = \"hierarchy\" does not support tp_world_size = 2 (SPEC §3)");
  if (!cfg.comm_alg.empty() && cfg.comm_alg != "fullmesh" && cfg.comm_alg != "hierarchy")
    invalid(op, ": comm_alg = \"", cfg.comm_alg,
            "\" is not one of {\"\", \"fullmesh\", \"hierarchy\"}");
  if (cfg.partials == "fp16")
    unsupported(op,
                ": partials = \"fp16\" is not supported: a partial beyond fp16's range (65504) "
                "would become inf where the fp32 partials of other nodes cancel it; use \"bf16\" "
                "(fp32's range) or \"fp32\"");
  if (!cfg.partials.empty() && cfg.partials != "fp32" && cfg.partials != "bf16")
    invalid(op, ": partials = \"", cfg.partials, "\" is not one of {\"\", \"fp32\", \"bf16\"}");
  const std::pair<const char*, int64_t> special[] = {{"zero_expert_num", cfg.zero_expert_num},
                                                     {"copy_expert_num", cfg.copy_expert_num},
                                                     {"const_expert_num", cfg.const_expert_num}};
  int64_t total = cfg.moe_expert_num;
  for (const auto& [name, v] : special) {
    if (v < 0) invalid(op, ": ", name, " = ", v, " must be >= 0");
    if (v >= INT32_MAX) invalid(op, ": ", name, " = ", v, " must be < 2^31 - 1");
    total += v;
  }
  if (total >= INT32_MAX)
    invalid(op, ": moe_expert_num + zero_expert_num + copy_expert_num + const_expert_num = ", total,
            " must be < 2^31 - 1");
  if (cfg.global_bs < 0) invalid(op, ": global_bs = ", cfg.global_bs, " must be >= 0");
}

void check_expert_ids(const char* op, const TensorView& ids, int64_t BS, int64_t E,
                      int64_t special) {
  expect_tensor(op, "expert_ids", ids, {DType::kI32}, 2);
  expect_size(op, "expert_ids", ids, 0, BS, "BS, the tokens of this rank");
  const int64_t K = ids.shape[1], N = E + special;
  if (K < 1 || K > N) {
    if (special == 0)
      invalid(op, ": expert_ids.shape[1] = ", K, " (K) is outside [1, ", E, "] (moe_expert_num)");
    invalid(op, ": expert_ids.shape[1] = ", K, " (K) is outside [1, ", N,
            "] (moe_expert_num + zero/copy/const_expert_num)");
  }
  for (int64_t i = 0; i < BS; ++i) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = index_at(ids, i, k);
      if (e == -1) continue;
      if (e < 0 || e >= N) {
        if (special == 0)
          invalid(op, ": expert_ids[", i, ",", k, "] = ", e, " is outside [0, ", E,
                  ") (moe_expert_num; -1 marks an inactive entry)");
        invalid(op, ": expert_ids[", i, ",", k, "] = ", e, " is outside [0, ", N,
                ") (moe_expert_num + zero/copy/const_expert_num; -1 marks an inactive entry)");
      }
      for (int64_t k2 = 0; k2 < k; ++k2)
        if (index_at(ids, i, k2) == e)
          invalid(op, ": expert_ids[", i, ",*] repeats expert ", e, " (slots ", k2, " and ", k,
                  "); the ids of a token must be distinct");
    }
  }
}

void check_active_mask(const char* op, const TensorView& m, int64_t BS, int64_t K) {
  expect_dtype(op, "x_active_mask", m, {DType::kBool});
  if (m.ndim != 1 && m.ndim != 2)
    invalid(op, ": x_active_mask.ndim = ", m.ndim, " must be 1 (BS,) or 2 (BS, K)");
  expect_memory(op, "x_active_mask", m);
  expect_size(op, "x_active_mask", m, 0, BS, "BS, expert_ids.shape[0]");
  if (m.ndim == 2) {
    expect_size(op, "x_active_mask", m, 1, K, "K, expert_ids.shape[1]");
    return;
  }
  int64_t first_false = -1;
  for (int64_t i = 0; i < BS; ++i) {
    const bool v = bool_at(m, i, 0);
    if (!v && first_false < 0) first_false = i;
    if (v && first_false >= 0)
      invalid(op, ": x_active_mask[", i, "] = true follows x_active_mask[", first_false,
              "] = false (a 1-D mask must hold all Trues before all Falses)");
  }
}

bool mask_tokens_active(const TensorView& m) {
  const int64_t rows = m.shape[0], cols = m.ndim == 2 ? m.shape[1] : 1;
  for (int64_t i = 0; i < rows; ++i) {
    bool any = false;
    for (int64_t j = 0; j < cols && !any; ++j) any = bool_at(m, i, j);
    if (!any) return false;
  }
  return true;
}

void check_expert_scales(const char* op, const TensorView& s, int64_t BS, int64_t K) {
  expect_tensor(op, "expert_scales", s, {DType::kF32}, 2);
  expect_size(op, "expert_scales", s, 0, BS, "BS, expert_ids.shape[0]");
  expect_size(op, "expert_scales", s, 1, K, "K, expert_ids.shape[1]");
}

void compute_capacity(const char* op, int64_t global_bs, EpShape& sh) {
  if (global_bs > 0) {
    if (global_bs % sh.W != 0)
      invalid(op, ": global_bs = ", global_bs, " is not a multiple of ep_world_size = ", sh.W);
    sh.G = global_bs;
  } else {
    sh.G = sh.BS * sh.W;
  }
  // Every product below stays far from 2^63: each factor is checked against int32 first.
  if (sh.G > INT32_MAX)
    unsupported(op, ": G = ", sh.G, " tokens (global_bs, or BS * ep_world_size) exceeds int32");
  if (sh.BS * sh.K > INT32_MAX)
    unsupported(op, ": BS * K = ", sh.BS, " * ", sh.K, " = ", sh.BS * sh.K,
                " entries exceed int32 (assist_info_for_combine is int32)");
  if (sh.rank < sh.pl.S) {
    const int64_t per = sh.pl.S / sh.pl.Ns, senders = (sh.W + per - 1) / per;
    sh.A = sh.G / sh.W * senders;
    if (sh.A > INT32_MAX)
      unsupported(op, ": the receive capacity A = (G / W) * ceil(W / (S / Ns)) = ", sh.G / sh.W,
                  " * ", senders, " = ", sh.A, " exceeds int32 (ep_recv_counts)");
  } else {
    sh.A = sh.G * std::min(sh.L, sh.K);
    if (sh.A > INT32_MAX)
      unsupported(op, ": the receive capacity A = G * min(L, K) = ", sh.G, " * ",
                  std::min(sh.L, sh.K), " = ", sh.A, " exceeds int32 (ep_recv_counts)");
  }
  const int64_t row_bytes = sh.H * static_cast<int64_t>(dtype_size(sh.dtype));
  if (row_bytes > INT_MAX)
    unsupported(op, ": one row of H = ", sh.H, " ", dtype_name(sh.dtype), " elements is ",
                row_bytes, " bytes, more than an MPI count (INT_MAX)");
}

const Communicator& require_comm(const char* op, const EpConfig& cfg) {
  if (cfg.group_ep == nullptr) invalid(op, ": group_ep is null");
  for (const auto& [name, group] :
       {std::pair{"group_ep", cfg.group_ep}, std::pair{"group_tp", cfg.group_tp}}) {
    if (group == nullptr) continue;
    if (const std::string& why = CommInternals::broken(*group); !why.empty())
      invalid(op, ": ", name, " is unusable: an earlier op on it failed (", why,
              ") and its messages may still be in flight, where a new op would take them for its "
              "own. Release the communicator on every rank (Python: moe_ep.torch.release_group) "
              "and make a new one, or end the job");
  }
  return *cfg.group_ep;
}

void reject_given(const char* op, std::initializer_list<std::pair<const char*, bool>> given) {
  for (const auto& [name, is_given] : given)
    if (is_given) unsupported(op, ": ", name, " is not supported by this build");
}

void check_hierarchy_scope(const char* op, const EpConfig& cfg, bool elastic_info,
                           bool performance_info) {
  if (cfg.comm_alg != "hierarchy") return;
  if (elastic_info)
    unsupported(op, ": elastic_info is not supported with comm_alg = \"hierarchy\" (SPEC §3)");
  if (performance_info)
    unsupported(op, ": performance_info is not supported with comm_alg = \"hierarchy\" (SPEC §3)");
}

int relay_nodes(const Communicator& comm, const char* op, const EpConfig& cfg, int shm_node_ranks) {
  if (cfg.comm_alg != "hierarchy") return 0;
  const int G = ranks_per_node(comm, op, shm_node_ranks);
  return G == comm.size() ? 0 : G;
}

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
  expect_tensor(op, "elastic_info", t, {DType::kI32}, 1);
  expect_size(op, "elastic_info", t, 0, 4 + 2 * W, "4 + 2 * ep_world_size");
  auto at = [&](int64_t i) { return index_at(t, i); };
  const int64_t flag = at(0);
  if (flag != 0 && flag != 1)
    invalid(op, ": elastic_info[0] = ", flag, " (is_scaled_down) is not one of {0, 1}");
  if (flag == 0) return w;
  const int64_t nW = at(1), nS = at(2), nE = at(3);
  if (nW < 1 || nW > W)
    invalid(op, ": elastic_info[1] = ", nW, " (new ep_world_size) is outside [1, ", W, "]");
  check_placement(op, nW, nS, cfg.shared_expert_num, nE, " (elastic_info)");
  std::vector<int> seen(nW, -1);
  int64_t kept = 0;
  for (int64_t o = 0; o < W; ++o) {
    const int64_t n = at(4 + o);
    if (n == -1) continue;
    if (n < 0 || n >= nW)
      invalid(op, ": elastic_info[", 4 + o, "] = ", n, " (new rank of old rank ", o,
              ") is outside [0, ", nW, ") (new ep_world_size; -1 = removed)");
    if (seen[n] >= 0)
      invalid(op, ": elastic_info[", 4 + o, "] = ", n, " repeats the new rank of old rank ",
              seen[n], " (elastic_info[", 4 + seen[n], "])");
    seen[n] = static_cast<int>(o);
    ++kept;
  }
  if (kept != nW)
    invalid(op, ": elastic_info[4..", 4 + W, ") keeps ", kept,
            " ranks but elastic_info[1] (new ep_world_size) = ", nW);
  for (int64_t n = 0; n < W; ++n) {
    const int64_t o = at(4 + W + n), want = n < nW ? seen[n] : -1;
    if (o != want)
      invalid(op, ": elastic_info[", 4 + W + n, "] = ", o, " (old rank of new rank ", n,
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
  expect_tensor(op, "performance_info", *perf, {DType::kI64}, 1);
  expect_size(op, "performance_info", *perf, 0, cfg.ep_world_size, "ep_world_size");
  if (perf->shape[0] > 1 && perf->strides[0] != 1)
    unsupported(op, ": performance_info.stride(0) = ", perf->strides[0], " is not 1");
  return perf->ptr<int64_t>();
}

// The sizes every op derives from the world and its token tensor.
EpShape local_shape(const EpConfig& cfg, const World& w, int64_t BS, int64_t H, DType dtype) {
  EpShape sh;
  sh.pl = make_placement(w.W, w.S, cfg.shared_expert_num, w.E,
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

bool overlap(const TensorView& a, const TensorView& b) {
  auto extent = [](const TensorView& t, const char*& lo, const char*& hi) {
    if (t.numel() == 0 || t.data == nullptr) return false;
    int64_t last = 0;
    for (int d = 0; d < t.ndim; ++d) last += (t.shape[d] - 1) * t.strides[d];
    lo = static_cast<const char*>(t.data);
    hi = lo + (last + 1) * static_cast<int64_t>(dtype_size(t.dtype));
    return true;
  };
  const char *alo, *ahi, *blo, *bhi;
  return extent(a, alo, ahi) && extent(b, blo, bhi) && alo < bhi && blo < ahi;
}

int to_int(int64_t v) {
  MOE_EP_CHECK(v >= 0 && v <= INT_MAX);
  return static_cast<int>(v);
}

// EpConfig::transport, or $MOE_EP_TRANSPORT when it is empty (default "shm").
int64_t resolve_transport(const char* op, const EpConfig& cfg) {
  std::string v = cfg.transport;
  if (v.empty()) v = env_transport(op).value_or("shm");
  if (v == "mpi") return kTransportMpi;
  if (v == "shm") return kTransportShm;
  invalid(op, ": transport = \"", v, "\" is not one of \"\", \"mpi\", \"shm\"");
}

}  // namespace moe_ep::detail

namespace moe_ep {

double check_environment(const CommOptions& comm_options, const std::string& transport) {
  const char* op = "check_environment";
  const double timeout = detail::resolve_timeout(comm_options, op);
  EpConfig cfg;
  cfg.transport = transport;
  detail::resolve_transport(op, cfg);
  detail::check_env(op, true, !transport.empty());
  return timeout;
}

}  // namespace moe_ep
