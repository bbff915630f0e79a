#include "core/ep/handle.h"

#include <string>

#include "base/check.h"
#include "base/numeric.h"
#include "transport/communicator.h"

namespace moe_ep::detail {

uint64_t next_plan_id(const Communicator& comm) { return ++CommInternals::plans(comm); }

void keep_routing(EpPlan& plan, const TensorView& ids, const TensorView* mask) {
  const int64_t BS = ids.shape[0], K = ids.shape[1];
  plan.expert_ids.resize(static_cast<std::size_t>(BS * K));
  for (int64_t i = 0; i < BS; ++i)
    for (int64_t k = 0; k < K; ++k)
      plan.expert_ids[static_cast<std::size_t>(i * K + k)] =
          static_cast<int32_t>(index_at(ids, i, k));
  plan.mask_ndim = mask ? mask->ndim : 0;
  if (!mask) return;
  const int64_t cols = mask->ndim == 2 ? K : 1;
  plan.mask.resize(static_cast<std::size_t>(BS * cols));
  for (int64_t i = 0; i < BS; ++i)
    for (int64_t j = 0; j < cols; ++j)
      plan.mask[static_cast<std::size_t>(i * cols + j)] = bool_at(*mask, i, j) ? 1 : 0;
}

namespace {

// The arguments a handle's calls must repeat, as (name, value in the plan, value now).
void check_config(const char* op, const EpPlan& p, const EpConfig& cfg) {
  if (CommInternals::serial(*cfg.group_ep) != p.comm_serial)
    invalid(op, ": the dispatch handle belongs to another communicator (group_ep)");
  const std::pair<const char*, std::pair<int64_t, int64_t>> same[] = {
      {"ep_world_size", {p.cfg.ep_world_size, cfg.ep_world_size}},
      {"moe_expert_num", {p.cfg.moe_expert_num, cfg.moe_expert_num}},
      {"tp_world_size", {p.cfg.tp_world_size, cfg.tp_world_size}},
      {"shared_expert_num", {p.cfg.shared_expert_num, cfg.shared_expert_num}},
      {"shared_expert_rank_num", {p.cfg.shared_expert_rank_num, cfg.shared_expert_rank_num}},
      {"global_bs", {p.cfg.global_bs, cfg.global_bs}},
      {"zero_expert_num", {p.cfg.zero_expert_num, cfg.zero_expert_num}},
      {"copy_expert_num", {p.cfg.copy_expert_num, cfg.copy_expert_num}},
      {"const_expert_num", {p.cfg.const_expert_num, cfg.const_expert_num}},
  };
  for (const auto& [name, v] : same)
    if (v.first != v.second)
      invalid(op, ": ", name, " = ", v.second, " differs from the ", v.first,
              " of the dispatch_v2 that made the handle");
  const auto alg = [](const std::string& a) { return a == "hierarchy" ? "hierarchy" : "fullmesh"; };
  if (std::string(alg(cfg.comm_alg)) != alg(p.cfg.comm_alg))
    invalid(op, ": comm_alg = \"", alg(cfg.comm_alg), "\" differs from the \"", alg(p.cfg.comm_alg),
            "\" of the dispatch_v2 that made the handle");
  const bool tp_same =
      (cfg.group_tp == nullptr) == (p.cfg.group_tp == nullptr) &&
      (cfg.group_tp == nullptr || CommInternals::serial(*cfg.group_tp) == p.tp_serial);
  if (!tp_same) invalid(op, ": group_tp differs from the dispatch_v2 that made the handle");
}

}  // namespace

void check_plan(const char* op, const EpPlan& p, const EpConfig& cfg, const TensorView& ids,
                const TensorView* mask, int64_t transport, int64_t world_hash) {
  check_config(op, p, cfg);
  if (transport != p.transport)
    invalid(op, ": transport resolves to \"", transport == kTransportMpi ? "mpi" : "shm",
            "\" but the dispatch_v2 of the handle used \"",
            p.transport == kTransportMpi ? "mpi" : "shm", "\"");
  if (world_hash != p.world_hash)
    invalid(op, ": elastic_info differs from the dispatch_v2 of the handle");
  const int64_t BS = p.sh.BS, K = p.sh.K;
  if (ids.ndim != 2 || ids.shape[0] != BS || ids.shape[1] != K)
    invalid(op, ": expert_ids is ", ids.describe(), " but the dispatch_v2 of the handle had (", BS,
            ", ", K, ")");
  for (int64_t i = 0; i < BS; ++i)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t was = p.expert_ids[static_cast<std::size_t>(i * K + k)];
      if (index_at(ids, i, k) != was)
        invalid(op, ": expert_ids[", i, ",", k, "] = ", index_at(ids, i, k),
                " differs from the dispatch_v2 of the handle (", was, ")");
    }
  if ((mask ? mask->ndim : 0) != p.mask_ndim)
    invalid(op, ": x_active_mask is ", mask ? mask->describe() : std::string("not given"),
            " but the dispatch_v2 of the handle had ",
            p.mask_ndim == 0 ? "none" : cat("a ", p.mask_ndim, "-D one"));
  if (!mask) return;
  const int64_t cols = mask->ndim == 2 ? K : 1;
  for (int64_t i = 0; i < BS; ++i)
    for (int64_t j = 0; j < cols; ++j)
      if (bool_at(*mask, i, j) != (p.mask[static_cast<std::size_t>(i * cols + j)] != 0))
        invalid(op, ": x_active_mask[", i, mask->ndim == 2 ? cat(",", j) : std::string(),
                "] differs from the dispatch_v2 of the handle");
}

}  // namespace moe_ep::detail
