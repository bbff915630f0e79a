#include "kernels/cpu/scatter.h"

#include <algorithm>

#include "base/parallel.h"
#include "base/threads.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/quant.h"

namespace moe_ep::detail {

namespace {

// Orders rows by key (a counting sort: stable, linear in rows and keys; a comparison sort of
// dispatch's 4096 copies took about 0.1 ms) and returns the start of each run of one key, then
// rows.size(): group t is rows [first[t], first[t + 1]).
template <class Row>
std::vector<int64_t> group_by_src(std::vector<Row>& rows) {
  int64_t keys = 0;
  for (const Row& r : rows) keys = std::max(keys, r.key + 1);
  std::vector<int64_t> first, at(static_cast<std::size_t>(keys) + 1, 0);
  for (const Row& r : rows) ++at[static_cast<std::size_t>(r.key) + 1];
  for (int64_t k = 0; k < keys; ++k) {
    if (at[k + 1] > 0) first.push_back(at[k]);
    at[k + 1] += at[k];
  }
  first.push_back(static_cast<int64_t>(rows.size()));
  std::vector<Row> sorted(rows.size());
  for (const Row& r : rows) sorted[static_cast<std::size_t>(at[r.key]++)] = r;
  rows.swap(sorted);
  return first;
}

}  // namespace

void parallel_copy(std::vector<RowCopy>& rows, int64_t row_bytes, bool stream) {
  if (row_bytes == 0) return;  // empty rows (H = 0), whose src may be null
  const std::vector<int64_t> first = group_by_src(rows);
  std::vector<void*> dst;
  for (const RowCopy& r : rows) dst.push_back(r.dst);
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t groups = static_cast<int64_t>(first.size()) - 1;
  parallel(threads_if(n * row_bytes > (int64_t{1} << 16)), [&] {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < groups; ++t)
      copy_row_to(dst.data() + first[t], first[t + 1] - first[t], rows[first[t]].src,
                  static_cast<std::size_t>(row_bytes), stream);
  });
}

void parallel_quantize(std::vector<QuantCopy>& rows, int64_t h, DType dtype, float* scales,
                       bool stream) {
  if (rows.empty()) return;
  if (h == 0) {
    for (const QuantCopy& r : rows) scales[r.j] = 0.0f;
    return;
  }
  const std::vector<int64_t> first = group_by_src(rows);
  const int64_t groups = static_cast<int64_t>(first.size()) - 1;
  std::vector<const void*> src;
  std::vector<int8_t*> dst;
  for (int64_t t = 0; t < groups; ++t) src.push_back(rows[first[t]].src);
  for (const QuantCopy& r : rows) dst.push_back(reinterpret_cast<int8_t*>(r.dst));
  std::vector<float> group_scale(src.size());
  quantize_rows_int8_to(src.data(), dtype, groups, h, dst.data(), first.data(), group_scale.data(),
                        stream);
  for (int64_t t = 0; t < groups; ++t)
    for (int64_t r = first[t]; r < first[t + 1]; ++r) scales[rows[r].j] = group_scale[t];
}

}  // namespace moe_ep::detail
