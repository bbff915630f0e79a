#include "core/ep/header.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "base/check.h"
#include "core/ep/config.h"
#include "transport/exchange.h"
#include "transport/tags.h"

namespace moe_ep::detail {

namespace {

const char* op_name(int32_t op) {
  switch (op) {
    case kOpDispatch:
      return "dispatch_v2";
    case kOpCombine:
      return "combine_v2";
    case kOpDispatchBackward:
      return "dispatch_v2_backward";
    case kOpCombineBackward:
      return "combine_v2_backward";
    default:
      return "an unknown op";
  }
}

}  // namespace

OpHeader base_header(int32_t op, const EpConfig& cfg, const TensorView& bs_of,
                     const TensorView& rows, const TensorView& expert_ids, int64_t quant_mode) {
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
  h.BS = bs_of.ndim >= 1 ? bs_of.shape[0] : -1;
  h.H = rows.ndim == 2 ? rows.shape[1] : -1;
  h.K = expert_ids.ndim == 2 ? expert_ids.shape[1] : -1;
  h.dtype = static_cast<int64_t>(rows.dtype);
  h.quant_mode = static_cast<int32_t>(quant_mode);
  h.exact_size = cfg.exact_size ? 1 : 0;
  // Read by combine_v2's relays alone (comm_alg "hierarchy"): agreed there only.
  h.partials = op == kOpCombine && h.comm_alg == 1 && cfg.partials == "bf16" ? 1 : 0;
  return h;
}

void record_failure(OpHeader& h, std::optional<Error>& local, Error e) {
  h.ok = 0;
  h.kind = static_cast<int32_t>(e.kind());
  std::strncpy(h.message, e.what(), sizeof(h.message) - 1);
  local.emplace(std::move(e));
}

void check_batch_sizes(const char* op, const std::vector<OpHeader>& h,
                       const std::vector<int>& peers, int64_t global_bs, const char* bs_name) {
  const int64_t W = static_cast<int64_t>(h.size());
  int64_t max_bs = 0, max_rank = 0, differ_rank = 0;
  bool differ = false;
  for (int64_t p = 0; p < W; ++p) {
    if (h[p].BS != h[0].BS && !differ) differ = true, differ_rank = p;
    if (h[p].BS > max_bs) max_bs = h[p].BS, max_rank = p;
  }
  // The fix, with its numbers: the same global_bs on every rank, for the dispatch_v2 and the
  // combine_v2 (and backward ops) of the step, since A and the layout depend on it (SPEC §1.3).
  if (global_bs == 0 && differ)
    invalid(op, ": BS (", bs_name, ") differs across ranks with global_bs = 0: rank ", peers[0],
            " has ", h[0].BS, ", rank ", peers[differ_rank], " has ", h[differ_rank].BS,
            "; pass global_bs = ep_world_size * max BS = ", W, " * ", max_bs, " = ", W * max_bs,
            " (rank ", peers[max_rank], " has BS = ", max_bs,
            "; or any multiple of ep_world_size at least that) on every rank, to dispatch_v2 "
            "and to the combine_v2 of its rows alike (SPEC §1.3)");
  if (global_bs > 0 && global_bs < W * max_bs)
    invalid(op, ": global_bs = ", global_bs, " is less than ep_world_size * max BS = ", W, " * ",
            max_bs, " = ", W * max_bs, " (rank ", peers[max_rank], " has BS = ", max_bs, ")");
  if (differ)
    for (int64_t p = 0; p < W; ++p)
      if (!h[p].all_active)
        invalid(op, ": x_active_mask on rank ", peers[p],
                " makes a token inactive (a False in 1-D, an all-False row in 2-D) while BS "
                "differs across ranks (",
                bs_name, "): when BS differs, every token must be active");
}

void check_quant_modes(const char* op, const std::vector<OpHeader>& h,
                       const std::vector<int>& peers, const char* name) {
  for (std::size_t p = 1; p < h.size(); ++p)
    if (h[p].quant_mode != h[0].quant_mode)
      invalid(op, ": ", name, " differs across ranks: rank ", peers[0], " has ", h[0].quant_mode,
              ", rank ", peers[p], " has ", h[p].quant_mode);
}

std::vector<OpHeader> agree_on_headers(const Communicator& comm, const std::vector<int>& peers,
                                       const char* op, const OpHeader& mine, const Error* local,
                                       int64_t* perf, const char* phase) {
  const int W = static_cast<int>(peers.size());
  const int me =
      static_cast<int>(std::find(peers.begin(), peers.end(), comm.rank()) - peers.begin());
  MOE_EP_CHECK(me < W);
  auto headers = std::make_shared<std::vector<OpHeader>>(W);
  auto sent = std::make_shared<OpHeader>(mine);
  (*headers)[me] = mine;
  {
    Exchange ex(comm, op, phase);
    ex.keep_alive(headers);
    ex.keep_alive(sent);
    for (int p = 0; p < W; ++p) {
      if (p == me) continue;
      ex.irecv(&(*headers)[p], sizeof(OpHeader), peers[p], kTagHeader);
      ex.isend(sent.get(), sizeof(OpHeader), peers[p], kTagHeader);
    }
    ex.wait();
    if (perf != nullptr && local == nullptr) ex.add_recv_wait_us(perf);
  }
  const std::vector<OpHeader>& h = *headers;
  if (local != nullptr) throw *local;
  for (int p = 0; p < W; ++p) {
    if (h[p].magic != mine.magic)
      invalid(op, ": rank ", peers[p],
              " sent a malformed header (is it running another library on the ",
              "same communicator?)");
    if (h[p].op != mine.op)
      invalid(op, ": the ranks called different ops: rank ", peers[me], " called ",
              op_name(mine.op), ", rank ", peers[p], " called ", op_name(h[p].op),
              " (collective ops must be called in the "
              "same order on every rank)");
  }
  for (int p = 0; p < W; ++p)
    if (!h[p].ok) {
      std::string msg(h[p].message, strnlen(h[p].message, sizeof(h[p].message)));
      fail(ErrorKind::kRemote, op, ": rank ", peers[p], " failed: ", msg);
    }
  struct Field {
    const char* name;
    int64_t OpHeader::*member;
  };
  static constexpr Field fields[] = {
      {"ep_world_size", &OpHeader::ep_world_size},
      {"moe_expert_num", &OpHeader::moe_expert_num},
      {"tp_world_size", &OpHeader::tp_world_size},
      {"shared_expert_num", &OpHeader::shared_expert_num},
      {"shared_expert_rank_num", &OpHeader::shared_expert_rank_num},
      {"expert_shard_type", &OpHeader::expert_shard_type},
      {"global_bs", &OpHeader::global_bs},
      {"zero_expert_num", &OpHeader::zero_expert_num},
      {"copy_expert_num", &OpHeader::copy_expert_num},
      {"const_expert_num", &OpHeader::const_expert_num},
      {"comm_alg", &OpHeader::comm_alg},
      {"K (expert_ids.shape[1])", &OpHeader::K},
      {"elastic_info (hash of the table)", &OpHeader::elastic},
  };
  const bool dispatch = mine.op == kOpDispatch || mine.op == kOpCombineBackward;
  for (const Field& f : fields)
    for (int p = 1; p < W; ++p)
      if (h[p].*f.member != h[0].*f.member)
        invalid(op, ": ", f.name, " differs across ranks: rank ", peers[0], " has ", h[0].*f.member,
                ", rank ", peers[p], " has ", h[p].*f.member,
                " (every rank must pass the same value)");
  auto transport_name = [](int64_t t) {
    return t == kTransportMpi ? "\"mpi\"" : t == kTransportShm ? "\"shm\"" : "(unresolved)";
  };
  for (int p = 1; p < W; ++p)
    if (h[p].transport != h[0].transport)
      invalid(op, ": transport differs across ranks: rank ", peers[0], " uses ",
              transport_name(h[0].transport), ", rank ", peers[p], " uses ",
              transport_name(h[p].transport),
              " (EpConfig::transport, or $MOE_EP_TRANSPORT when it is empty, must resolve to the "
              "same value on every rank)");
  auto handle = [](uint64_t plan) {
    return plan == 0 ? std::string("no handle")
                     : cat("the handle of dispatch_v2 call ", plan, " on this communicator");
  };
  for (int p = 1; p < W; ++p)
    if (h[p].plan != h[0].plan)
      invalid(op, ": the ranks passed different dispatch handles: rank ", peers[0], " passed ",
              handle(h[0].plan), ", rank ", peers[p], " passed ", handle(h[p].plan),
              " (every rank must pass the handle of the same dispatch_v2 call, or none)");
  for (int p = 1; p < W; ++p)
    if (h[p].exact_size != h[0].exact_size)
      invalid(op, ": exact_size differs across ranks: rank ", peers[0], " has ",
              h[0].exact_size ? "true" : "false", ", rank ", peers[p], " has ",
              h[p].exact_size ? "true" : "false", " (every rank must pass the same value)");
  auto partials = [](int32_t code) { return code == 1 ? "bf16" : "fp32"; };
  for (int p = 1; p < W; ++p)
    if (h[p].partials != h[0].partials)
      invalid(op, ": partials differs across ranks: rank ", peers[0], " has \"",
              partials(h[0].partials), "\", rank ", peers[p], " has \"", partials(h[p].partials),
              "\" (every rank must pass the same value)");
  for (int p = 1; p < W; ++p)
    if (h[p].shm_node_ranks != h[0].shm_node_ranks)
      invalid(op, ": MOE_EP_SHM_NODE_RANKS differs across ranks: rank ", peers[0], " has ",
              h[0].shm_node_ranks, ", rank ", peers[p], " has ", h[p].shm_node_ranks,
              " (0: unset; every rank must see the same value)");
  const char* xname = dispatch ? "x" : "expand_x";
  for (int p = 1; p < W; ++p) {
    if (h[p].H != h[0].H)
      invalid(op, ": H (", xname, ".shape[1]) differs across ranks: rank ", peers[0], " has ",
              h[0].H, ", rank ", peers[p], " has ", h[p].H,
              " (every rank must pass the same value)");
    if (h[p].dtype != h[0].dtype)
      invalid(op, ": ", xname, " dtype differs across ranks: rank ", peers[0], " has ",
              dtype_name(static_cast<DType>(h[0].dtype)), ", rank ", peers[p], " has ",
              dtype_name(static_cast<DType>(h[p].dtype)), " (every rank must pass the same dtype)");
  }
  return h;
}

}  // namespace moe_ep::detail
