#include <algorithm>

#include "base/check.h"
#include "core/ep/config.h"
#include "core/ep/slot.h"
#include "core/ep/windows.h"
#include "moe_ep/dispatch.h"
#include "transport/windows.h"

namespace moe_ep {

using namespace detail;

DispatchWorkspace dispatch_workspace(const EpConfig& cfg, int64_t bs, int64_t hidden, int64_t top_k,
                                     DType dtype, int64_t quant_mode, int64_t comm_quant_mode) {
  const char* op = "dispatch_workspace";
  const Communicator& comm = require_comm(op, cfg);
  const int64_t transport = resolve_transport(op, cfg);
  check_ep_config(op, cfg, comm.rank(), comm.size());
  if (bs < 0 || bs > INT32_MAX)
    invalid(op, ": bs = ", bs, " must be in [0, ", INT32_MAX, "] (x.shape[0])");
  if (hidden < 1 || hidden > INT32_MAX)
    invalid(op, ": hidden = ", hidden, " must be in [1, ", INT32_MAX, "] (x.shape[1])");
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32)
    invalid(op, ": dtype = ", dtype_name(dtype), " must be bf16, fp16 or fp32");
  if (quant_mode != 0 && quant_mode != 2)
    invalid(op, ": quant_mode = ", quant_mode, " is not one of {0, 2}");
  if (comm_quant_mode != 0 && comm_quant_mode != 2)
    invalid(op, ": comm_quant_mode = ", comm_quant_mode, " is not one of {0, 2}");
  const World world = resolve_world(op, cfg, std::nullopt);
  EpShape sh = local_shape(cfg, world, bs, hidden, dtype);
  const int64_t ids = sh.E + sh.pl.special;
  if (top_k < 1 || top_k > ids)
    invalid(op, ": top_k = ", top_k, " must be in [1, ", ids,
            "] (moe_expert_num + zero/copy/const experts)");
  sh.K = top_k;
  sh.KS = sh.K + sh.pl.Ns;
  compute_capacity(op, cfg.global_bs, sh);
  const int64_t esize = static_cast<int64_t>(dtype_size(dtype));
  const int64_t rows = tp_rows(cfg, sh.A);
  DispatchWorkspace w;
  w.recv_rows = sh.A;
  w.expand_x_bytes = rows * sh.H * (quant_mode == 2 ? 1 : esize);
  // exact_size: a call takes its valid rows, at most these (assist_info_for_combine 3 per row).
  const int64_t assist = cfg.exact_size ? 3 * rows : std::max(sh.BS * sh.K, sh.A * 128);
  w.other_outputs_bytes = assist * 4 + rows * 4 * (quant_mode == 2 ? 2 : 1) +
                          sh.W * sh.L * std::max<int64_t>(1, cfg.tp_world_size) * 4 +
                          std::max<int64_t>(1, cfg.tp_world_size) * 4 + sh.L * 8;
  if (shm_applies(transport, cfg, world)) {
    w.shm_slot_bytes = window_slot_bytes(dispatch_slot_need(w.expand_x_bytes, rows));
    w.shm_stage_bytes = window_slot_bytes(
        stage_need(sh.A, sh.H * (comm_quant_mode == 2 ? 1 : esize), comm_quant_mode == 2));
  }
  w.combine_output_bytes = sh.BS * sh.H * esize;
  return w;
}

}  // namespace moe_ep
