// moe-ep tool: the layer of `moe-ep run` on one rank: this rank's part of the batch (generated
// from the seed, or its rows of a loaded file), then router -> dispatch_v2 -> the local experts
// -> combine_v2, each timed; and warm repeats of dispatch_v2 + combine_v2 on the same inputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "experts.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/tensor.h"
#include "progress.h"
#include "run.h"
#include "run_plan.h"

namespace moe_ep_tool {

// This rank's part of the batch.
struct LocalBatch {
  int64_t first = 0, BS = 0;      // its global tokens [first, first + BS)
  std::vector<std::byte> x;       // (BS, H) in the plan's dtype
  std::vector<int32_t> ids;       // (BS, K) logical expert ids (saved, and the reference's input)
  std::vector<int32_t> slot_ids;  // (BS, K) the library's: physical slots (redundant.h)
  std::vector<float> scales;      // (BS, K)
  std::vector<uint8_t> mask;      // x_active_mask: (BS) or (BS, K) of 0/1, or empty
  double route_s = 0;             // the router's time (0 for a loaded batch)
  // The const experts' tables (Q, H) in the plan's dtype, from the seed.
  std::vector<std::byte> alpha_1, alpha_2, const_v;
};

// Generates (or takes from plan.file, then releases it) this rank's part of the batch.
LocalBatch make_local_batch(const RunOptions& o, Plan& plan, int rank);

// The EP group and, with --tp 2, the TP group of this rank.
struct Groups {
  std::shared_ptr<moe_ep::Communicator> ep, tp;
};

// One call of each phase on this rank, seconds.
struct PhaseTimes {
  double dispatch_s = 0, experts_s = 0, generate_s = 0, combine_s = 0;
};

class Layer {
 public:
  // Keeps references to all four arguments.
  Layer(const RunOptions& o, const Plan& plan, const LocalBatch& batch, const Groups& groups);

  // The forward, once: dispatch_v2 -> local experts -> combine_v2, each after a barrier and
  // timed (cold: the first calls, window set-up included). Returns the combined output (BS, H).
  moe_ep::Tensor forward(PhaseTimes* times, Progress& progress);

  // After forward(): `n` more dispatch_v2 + combine_v2 on the same inputs (combine_v2 takes the
  // forward's expert outputs), each op after a barrier; this rank's time of each call.
  void repeat(int n, std::vector<double>* dispatch_s, std::vector<double>* combine_s);

  // After forward(): dispatch's valid rows here (with the TP peer's), and the rows it received
  // from other EP ranks (combine sends them back).
  int64_t valid_rows() const { return valid_; }
  int64_t received_other_rows() const { return received_other_; }
  // Rows this rank dispatches to other EP ranks (its active entries' slots elsewhere, and its
  // tokens' copies to the shared-expert ranks of other ranks).
  int64_t sent_other_rows() const;
  // What the first dispatch_v2 and combine_v2 moved between this rank and each EP rank.
  const moe_ep::Traffic& dispatch_traffic() const { return dispatch_traffic_; }
  const moe_ep::Traffic& combine_traffic() const { return combine_traffic_; }
  // This rank's rank in MPI_COMM_WORLD of EP rank e (of its EP group).
  int world_rank_of(int64_t e) const { return static_cast<int>(e * plan_.T + tp_rank_); }

 private:
  moe_ep::DispatchOutputs dispatch();
  moe_ep::Tensor combine(const moe_ep::DispatchOutputs& d);
  // The local experts on expand_x, into expert_out_ (and shared_x_); times the experts and,
  // apart, their weight generation.
  void run_experts(const moe_ep::DispatchOutputs& d, PhaseTimes* times);
  void count_received(const moe_ep::DispatchOutputs& d);
  // A dispatch/combine error on a loaded batch names this rank's token index: add the file's.
  template <typename F>
  auto with_file_rows(F&& op);

  moe_ep::Traffic dispatch_traffic_, combine_traffic_;
  const RunOptions& o_;
  const Plan& plan_;
  const LocalBatch& batch_;
  int rank_ = 0;
  int64_t ep_rank_ = 0, tp_rank_ = 0;
  moe_ep::EpConfig cfg_;
  moe_ep::DispatchInputs din_;
  std::vector<std::byte> shared_x_;  // the shared expert's output (shared_expert_x), if local
  moe_ep::Tensor expert_out_;        // the local experts' outputs, in expand_x's layout
  int64_t valid_ = 0, received_other_ = 0;
};

}  // namespace moe_ep_tool
