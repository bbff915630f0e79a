// Internal: rows copied (or quantised to int8) from their sources to many destinations at once,
// over all threads: how dispatch_v2 writes rows into receive buffers, send buffers and peers'
// shared-memory windows, and how combine_v2 packs the rows it sends back. Destinations may be
// anywhere (they are plain addresses; kernels know no network).
#pragma once

#include <cstdint>
#include <vector>

#include "moe_ep/tensor.h"

namespace moe_ep::detail {

// A row to copy.
struct RowCopy {
  const char* src;
  char* dst;
  int64_t key;  // the source row's index (>= 0): rows with one key have one src
};

// Copies every row (row_bytes each). The copies are grouped by source row and each group is one
// copy_row_to: a token sent to several experts is read once and its destinations are written
// side by side, which keeps more stores in flight than one row at a time (measured faster:
// docs/performance.md). stream: non-temporal stores. Reorders rows.
void parallel_copy(std::vector<RowCopy>& rows, int64_t row_bytes, bool stream = false);

// An int8 row to write (SPEC §1.5 without smoothing scales: every copy of a token quantises to
// the same bytes).
struct QuantCopy {
  const char* src;  // the token's row of x (null when h == 0)
  char* dst;        // h int8 values
  int64_t key;      // the token
  int64_t j;        // its entry: scales[j] gets the row's dynamic scale
};

// Like parallel_copy, grouped by source row, but each group is quantised once and its int8 row
// stored to all its destinations in the same pass (quantize_rows_int8_to, OpenMP inside), so the
// quantisation runs between the stores instead of before them. scales[j] gets the dynamic scale
// of each row's entry j (+0 for every entry when h == 0: an empty row). Reorders rows.
void parallel_quantize(std::vector<QuantCopy>& rows, int64_t h, DType dtype, float* scales,
                       bool stream = false);

}  // namespace moe_ep::detail
