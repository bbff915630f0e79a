// moe-ep tool: the checks `moe-ep run` makes before it allocates or communicates.
//
//   - flag text: integers in a range, the unsigned seed, a finite positive timeout (CLI11
//     validators; each message names the bound and the value given);
//   - sizes: every product of the layer's sizes (N = tokens x W, N x H x dtype bytes, A x H, the
//     expert weights 3 x H x FFN x 4 B, ...) computed with overflow checks, and the MPI_Gatherv
//     limit of 2^31 - 1 bytes on rank 0;
//   - memory: an estimate of what each rank allocates, compared with the machine's physical
//     memory before anything large is allocated;
//   - files: output paths writable, distinct from each other and from the input.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "experts.h"
#include "moe_ep/tensor.h"
#include "routing.h"

namespace moe_ep_tool {

// The largest number of experts: expert ids are int32 and E itself must fit one.
constexpr int64_t kMaxExperts = (int64_t{1} << 31) - 2;
// The largest tokens per rank, H and FFN: token indices, row sizes and GEMM dimensions are int.
constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;

// CLI11 validator bodies: "" when `text` is valid, else what is wrong with it (CLI11 prefixes the
// flag name). check_integer: a decimal integer in [low, high], e.g.
// "must be an integer in [0, 2147483647], got abc (not an integer)"; `note` follows the range.
std::string check_integer(const std::string& text, int64_t low, int64_t high,
                          const std::string& note = "");
// An unsigned 64-bit integer (the seed).
std::string check_unsigned(const std::string& text);
// A finite number of seconds > 0.
std::string check_timeout(const std::string& text);
// "" when `text` is a finite number > 0, else "must be a finite number of <unit> > 0, got <text>".
std::string check_positive(const std::string& text, const std::string& unit);

// What the run's sizes are and where they came from (for the messages).
struct RunShape {
  int64_t world = 1;                     // all ranks: W_ep x T
  std::vector<int64_t> tokens_per_rank;  // BS of each rank (world entries)
  int64_t hidden = 0, experts = 0, top_k = 0, ffn = 0;
  int64_t tp = 1;              // T: 1, or 2 (world rank r is EP rank r / T, TP rank r % T)
  int64_t shared_ranks = 0;    // S
  int64_t shared_experts = 0;  // Ns (with S = 0: computed locally as shared_expert_x)
  int64_t special = 0;         // Z + C + Q
  int64_t global_bs = 0;       // 0: W_ep x max tokens per rank
  bool quant = false, comm_quant = false;
  int mask_dims = 0;  // x_active_mask: 0 none, 1 (BS), 2 (BS, K)
  moe_ep::DType dtype = moe_ep::DType::kBF16;
  ExpertFn fn = ExpertFn::kSwiglu;
  RoutingKind routing = RoutingKind::kReal;
  bool loaded = false;      // the batch comes from --load-routing
  uint64_t file_bytes = 0;  // its size when loaded
  // "--tokens 64" / "--load-routing 'F' (128 tokens)", "H 2048" / "--hidden 2048", ...
  std::string tokens_label, hidden_label, experts_label, top_k_label, ffn_label;
};

// Throws moe_ep::Error(kInvalidArgument) naming the flags, their values and the bound when a
// product of the sizes overflows int64 or when one expert's swiglu weights exceed the int GEMM
// sizes.
void check_sizes(const RunShape& shape);
// Throws moe_ep::Error(kInvalidArgument) when x or expert_ids gathered on rank 0 exceed 2^31 - 1
// bytes (one MPI_Gatherv). Call after check_sizes.
void check_gather_limits(const RunShape& shape);

// The estimates' per-expert terms (moe-ep run's and bench's): dispatch_v2's per-expert counts
// and offsets, and the router's tables (probabilities, logits, sort keys, order, flags).
constexpr double kDispatchBytesPerExpert = 64, kRouterBytesPerExpert = 41;

struct MemoryPart {
  std::string name;
  double bytes = 0;
  std::vector<std::string> advice;  // alternatives: "fewer --tokens", "a smaller --ffn", ...
};
struct MemoryEstimate {
  double bytes = 0;
  std::vector<MemoryPart> parts;
};
// What rank `rank` allocates, roughly (the largest buffers: tokens, mask, routing tables,
// dispatch's receive buffers (T x A rows, int8 with --quant, plus the dequantised fp32 rows),
// expert outputs, one expert's weights, the shared expert's, const experts' tables, combine (its
// int8 copies with --comm-quant), and on rank 0 the gathered batch, the gathered output and the
// dense reference with its shared-expert slots and quantisation bounds). Call after check_sizes.
MemoryEstimate estimate_rank_memory(const RunShape& shape, int64_t rank);

// sysconf(_SC_PHYS_PAGES) x page size (0 when unknown).
uint64_t physical_memory_bytes();

// Throws moe_ep::Error(kInvalidArgument) when one rank's estimate, or the sum over `node_ranks`
// (the ranks sharing this machine), exceeds `physical` bytes: "moe-ep run: --tokens 1000000 with
// H 2048 (...) needs about X GiB on rank 0 (more than this machine's Y GiB; mostly ...); use
// fewer --tokens". No check when `physical` is 0.
void check_memory(const RunShape& shape, const std::vector<int>& node_ranks, uint64_t physical);

// Throws moe_ep::Error(kInvalidArgument) when reading a routing file of `file_bytes` (about three
// copies of it on every rank) would exceed `physical` bytes. No check when `physical` is 0.
void check_load_memory(const std::string& path, uint64_t file_bytes, uint64_t physical);

// Throws moe_ep::Error(kInvalidArgument) unless `path` can be written: an existing writable file,
// or a new name in an existing writable directory (the message, "<command>: <flag> '<path>': ...",
// gives strerror's text).
void check_writable(const std::string& flag, const std::string& path,
                    const char* command = "moe-ep run");

// Whether the two paths name the same file (std::filesystem::weakly_canonical: ./F and F are).
bool same_path(const std::string& a, const std::string& b);

// "nan", "inf", "-inf" or the value (%g).
std::string format_value(double v);

// The context added to a dispatch/combine error on a run that loaded its batch: "(rank 1 holds
// rows [64, 128) of routing file 'F': expert_ids[6,*] is file row 70)"; the row part only when
// the message names a token of expert_ids, expert_scales or x.
std::string file_rows_context(const std::string& message, int rank, int64_t first, int64_t count,
                              const std::string& file);

// moe_ep::check_environment(--timeout, --transport) on this rank, before the first collective:
// the error it raised (null if none) and the deadline for agreeing on it across the ranks (the
// communicator's, else --timeout, else 300 s).
struct EnvironmentCheck {
  std::exception_ptr error;
  double timeout_s = 300;
};
EnvironmentCheck check_environment_here(const std::optional<double>& timeout_s,
                                        const std::string& transport);

}  // namespace moe_ep_tool
