// Internal: the tags of every message moe-ep sends, in one place. Each phase of an op has its own
// tag; MPI's non-overtaking order keeps consecutive ops (and phases with one tag) apart.
#pragma once

namespace moe_ep::detail {

enum Tag : int {
  // dispatch_v2 / combine_v2 (src/core/ep)
  kTagHeader = 0x4d01,         // the agreement on arguments before an op moves data
  kTagCounts = 0x4d02,         // dispatch_v2: rows per (destination, local expert)
  kTagMeta = 0x4d03,           // dispatch_v2: per-row (token, slot, weight, scale), or a count
  kTagRows = 0x4d04,           // dispatch_v2: the rows
  kTagCombineRows = 0x4d05,    // combine_v2: the expert outputs going back
  kTagCombineMeta = 0x4d06,    // combine_v2: per-row (token, slot, expert) checks
  kTagShmOffsets = 0x4d07,     // dispatch_v2: where a sender's rows go in a receiver's window
  kTagCombineLayout = 0x4d08,  // combine_v2: an owner's rows per block, and where they lie
  kTagShmDone = 0x4d09,        // combine_v2: a reader is done with an owner's rows
  kTagShmReady = 0x4d0a,       // every rank passed the header before a collective shm call
  kTagWhere = 0x4d0b,          // where a rank's rows lie, when its window grew in this call
  kTagCombineScales = 0x4d0c,  // combine_v2 with comm_quant_mode 2: each row's int8 scale
  // comm_alg "hierarchy" (src/core/ep/relay_*.cc): a source and its relay on another node
  kTagRelayRows = 0x4d11,     // dispatch_v2: a source's tokens to its relay, the relay's copies on
  kTagRelayMeta = 0x4d12,     // dispatch_v2: their routing / the copies' RowMeta
  kTagRelayWeights = 0x4d13,  // combine_v2: a source's weights for a relay's node
  kTagRelayCounts = 0x4d14,   // combine_v2: an owner's rows for each source a relay serves
  kTagRelayBack = 0x4d15,     // combine_v2: an owner's rows (and their checks) to the relay
  kTagRelayPartial = 0x4d16,  // combine_v2: a relay's partial sums to the source
  kTagRelayStatus = 0x4d17,   // combine_v2: the tokens of the partials, or what disagreed
  kTagScaleGrads = 0x4d18,    // combine_v2_backward: dot(grad_out, y) per row, to its source
  // Sharded ops (src/sharding)
  kTagShardHeader = 0x4d21,
  kTagShardData = 0x4d22,
  // Tensor parallelism within a TP pair (src/core/ep/tp.cc)
  kTagTpHeader = 0x4d31,
  kTagTpCounts = 0x4d32,
  kTagTpRows = 0x4d33,
  kTagTpAssist = 0x4d34,
  kTagTpScales = 0x4d35,
  kTagTpDynScales = 0x4d36,
};

}  // namespace moe_ep::detail
