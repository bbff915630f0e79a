#include "core/ep/tp.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "base/check.h"
#include "base/numeric.h"
#include "core/validate.h"
#include "kernels/cpu/convert.h"
#include "transport/exchange.h"
#include "transport/tags.h"

namespace moe_ep::detail {

bool tp_pair(const EpConfig& cfg) {
  return cfg.tp_world_size == 2 && cfg.group_tp != nullptr && cfg.group_tp->size() == 2;
}

void reject_tp_scale_in(const char* op, const Communicator& comm, const EpConfig& cfg, World& w) {
  if (cfg.tp_world_size != 2 || w.hash == 0) return;
  // Every rank of group_ep, removed ones included, reports the error through the header
  // agreement of the whole (old) world, and the TP header, so that no rank waits for another.
  const int64_t hash = w.hash;
  w = whole_world(comm);
  w.hash = hash;
  unsupported(op,
              ": elastic_info scale-in (is_scaled_down = 1) with tp_world_size = 2 "
              "is not supported by this build");
}

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

int64_t tp_handshake(const char* op, const EpConfig& cfg, OpHeader& hdr,
                     std::optional<Error>& local, TpHeader mine) {
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
    ex.irecv(theirs.get(), sizeof(TpHeader), peer, kTagTpHeader);
    ex.isend(sent.get(), sizeof(TpHeader), peer, kTagTpHeader);
    ex.wait();
  }
  if (local) return -1;  // this rank's own error comes first
  theirs->message[sizeof(theirs->message) - 1] = '\0';
  const TpHeader& t = *theirs;
  capture(hdr, local, [&] {
    if (t.magic != mine.magic || t.op != mine.op)
      invalid(op, ": the TP peer (group_tp rank ", peer, ") is not running ", op,
              " (both ranks of a TP pair must call the same ops in the same order)");
    if (t.ok == 0)
      throw Error(ErrorKind::kRemote,
                  cat(op, ": TP peer (group_tp rank ", peer, ") failed: ", t.message));
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
        invalid(op, ": ", name, " differs within the TP pair: group_tp rank ", tp.rank(), " has ",
                mine.*field, ", rank ", peer, " has ", t.*field,
                " (the ranks of a TP pair hold the same expert of the same EP rank)");
    // A rank with a handle does not know its peer's rows (-1): it takes them from here.
    const bool own_differ = t.peer_rows >= 0 && mine.own_rows != t.peer_rows;
    const bool peer_differ = mine.peer_rows >= 0 && mine.peer_rows != t.own_rows;
    if (own_differ || peer_differ)
      invalid(op, ": ep_send_counts disagree within the TP pair: group_tp rank ", tp.rank(),
              " has ", mine.own_rows, " own rows and ", mine.peer_rows, " of its peer, rank ", peer,
              " has ", t.own_rows, " own rows and ", t.peer_rows,
              " of its peer (pass dispatch_v2's ep_recv_counts and rows)");
  });
  return local ? -1 : t.own_rows;
}

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
  int64_t scales_bytes = 0;
  {
    Exchange ex(tp, op, "tp rows");
    ex.keep_alive(counts_out);
    ex.keep_alive(counts_in);
    for (const Tensor* t :
         {&out.expand_x, &out.assist_info_for_combine, &out.expand_scales, &out.dynamic_scales})
      if (t->defined()) ex.keep_alive(std::make_shared<Tensor>(*t));
    char* x = out.expand_x.ptr<char>();
    int32_t* assist = out.assist_info_for_combine.ptr<int32_t>();
    float* scales = out.expand_scales.ptr<float>();
    ex.irecv_n(counts_in->data(), WL, peer, kTagTpCounts);
    ex.irecv_rows(x + own * row_bytes, cap, row_bytes, peer, kTagTpRows);
    ex.irecv_n(assist + 3 * own, 3 * cap, peer, kTagTpAssist);
    ex.irecv_n(scales + own, cap, peer, kTagTpScales);
    if (dyn) ex.irecv_n(out.dynamic_scales.ptr<float>() + own, cap, peer, kTagTpDynScales);
    ex.isend_n(counts_out->data(), WL, peer, kTagTpCounts);
    ex.isend_rows(x, own, row_bytes, peer, kTagTpRows);
    ex.isend_n(assist, 3 * own, peer, kTagTpAssist);
    ex.isend_n(scales, own, peer, kTagTpScales);
    if (dyn) ex.isend_n(out.dynamic_scales.ptr<float>(), own, peer, kTagTpDynScales);
    ex.wait();
    scales_bytes = ex.received_bytes(3);
  }
  const int64_t peer_rows = WL > 0 ? counts_in->back() : 0;
  MOE_EP_CHECK(scales_bytes == peer_rows * static_cast<int64_t>(sizeof(float)) && peer_rows <= cap);

  MOE_EP_CHECK(out.ep_recv_counts.numel() == 2 * WL && out.tp_recv_counts.numel() == 2);
  int32_t* c = out.ep_recv_counts.ptr<int32_t>();
  for (int64_t b = 0; b < WL; ++b) c[WL + b] = static_cast<int32_t>(own + (*counts_in)[b]);
  // L = 1: the running sum and the count are the same.
  out.expert_token_nums.ptr<int64_t>()[0] = own + peer_rows;
  out.tp_recv_counts.ptr<int32_t>()[tp_rank] = static_cast<int32_t>(own);
  out.tp_recv_counts.ptr<int32_t>()[peer] = static_cast<int32_t>(peer_rows);
}

RecvPlan combine_blocks(const char* op, const EpConfig& cfg, const CombineInputs& in,
                        const EpShape& sh, int64_t& peer_rows) {
  peer_rows = 0;
  if (cfg.tp_world_size != 2)
    return plan_recvs_from_inclusive(op, in.ep_send_counts, sh.W, sh.L, in.expand_x.shape[0]);
  MOE_EP_CHECK(sh.L == 1);
  const TensorView& c = in.ep_send_counts;
  expect_tensor(op, "ep_send_counts", c, {DType::kI32}, 1);
  if (c.shape[0] != 2 * sh.W)
    invalid(op, ": ep_send_counts.shape[0] = ", c.shape[0],
            " must equal 2 * ep_world_size * L = 2 * ", sh.W, " * 1 = ", 2 * sh.W,
            " with tp_world_size = 2 (dispatch_v2's ep_recv_counts)");
  RecvPlan own = plan_recvs_from_inclusive(op, c, 2 * sh.W, 1, in.expand_x.shape[0]);
  const int64_t total = own.valid;
  own.inclusive.resize(sh.W);
  own.block_offset.resize(sh.W);
  own.block_rows.resize(sh.W);
  own.source_rows.resize(sh.W);
  own.valid = own.inclusive.back();
  peer_rows = total - own.valid;
  if (peer_rows > sh.A)
    invalid(op, ": ep_send_counts describe ", peer_rows,
            " rows of the TP peer, more than the receive capacity A = ", sh.A);
  if (in.tp_send_counts) {
    const TensorView& t = *in.tp_send_counts;
    expect_tensor(op, "tp_send_counts", t, {DType::kI32}, 1);
    expect_size(op, "tp_send_counts", t, 0, 2, "tp_world_size");
    const int64_t r = cfg.tp_rank_id,
                  want[2] = {r == 0 ? own.valid : peer_rows, r == 0 ? peer_rows : own.valid};
    for (int64_t i = 0; i < 2; ++i)
      if (index_at(t, i) != want[i])
        invalid(op, ": tp_send_counts[", i, "] = ", index_at(t, i), " but ", "ep_send_counts give ",
                want[i], " rows of tp rank ", i, " (pass dispatch_v2's tp_recv_counts)");
  }
  return own;
}

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
    ex.irecv_rows(recv->data(), own, row_bytes, peer, kTagTpRows);
    ex.isend_rows(send->data(), peer_rows, row_bytes, peer, kTagTpRows);
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
      acc[h] = load_f32(p0, sh.dtype, h) + load_f32(p1, sh.dtype, h);
    store_row_f32(rs->ptr<char>() + j * row_bytes, sh.dtype, acc.data(), sh.H);
  }
  return rs;
}

}  // namespace moe_ep::detail
