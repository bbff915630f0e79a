// Internal: how dispatch_v2's outputs lie in a shared-memory window slot (dispatch.cc,
// workspace.cc), and the metadata that travels with each row.
#pragma once

#include <cstdint>

namespace moe_ep::detail {

// What dispatch_v2 sends with each row (assist_info_for_combine, expand_scales, dynamic_scales).
struct RowMeta {
  int32_t token;
  int32_t slot;
  float scale;
  float qscale;  // quant_mode 2: the row's dynamic scale (SPEC §1.5); else 0
};

// dispatch_v2's slot in a receiver's window: expand_x (expand_bytes), then, from the next 64-byte
// boundary, one RowMeta per row of expand_x (rows), which each sender on the machine writes next
// to its rows (no MPI message of metadata: a small one announces them).
inline int64_t dispatch_meta_offset(int64_t expand_bytes) { return (expand_bytes + 63) / 64 * 64; }
inline int64_t dispatch_slot_need(int64_t expand_bytes, int64_t rows) {
  return dispatch_meta_offset(expand_bytes) + rows * static_cast<int64_t>(sizeof(RowMeta));
}

// combine_v2's staging of its valid rows in its window (when expand_x does not lie there, or with
// comm_quant_mode 2): the rows in expand_x's order, `wire_row` bytes each, then (int8 rows) their
// fp32 scales from the next 64-byte boundary.
inline int64_t stage_scales_offset(int64_t rows, int64_t wire_row) {
  return (rows * wire_row + 63) / 64 * 64;
}
inline int64_t stage_need(int64_t rows, int64_t wire_row, bool int8) {
  return int8 ? stage_scales_offset(rows, wire_row) + rows * 4 : rows * wire_row;
}

}  // namespace moe_ep::detail
