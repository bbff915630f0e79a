#include "bench_baselines.h"

#include <algorithm>
#include <cstring>

#include "moe_ep/permute.h"

namespace moe_ep_tool::bench {

using moe_ep::Tensor;
using moe_ep::TensorView;

RowType::RowType(int64_t bytes) {
  MPI_Type_contiguous(static_cast<int>(bytes), MPI_BYTE, &t_);
  MPI_Type_commit(&t_);
}

RowType::~RowType() {
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Type_free(&t_);
}

Textbook::Textbook(const Point& p, MPI_Datatype row) : p_(p), row_(row) {
  per_expert_.assign(static_cast<size_t>(p.E), 0);
  recv_block_.assign(static_cast<size_t>(p.W * p.L), 0);
  block_at_.assign(static_cast<size_t>(p.W * p.L), 0);
  send_counts_.assign(p.W, 0);
  send_displs_.assign(p.W, 0);
  recv_counts_.assign(p.W, 0);
  recv_displs_.assign(p.W, 0);
  recv_.resize(static_cast<size_t>(p.valid * p.row_bytes));
  expand_.resize(recv_.size());
  back_send_.resize(recv_.size());
  back_recv_.resize(static_cast<size_t>(p.BS * p.K * p.row_bytes));
}

void Textbook::dispatch(const TensorView& x, const TensorView& ids) {
  const int64_t W = p_.W, L = p_.L, rb = p_.row_bytes;
  moe_ep::PermuteResult perm =
      moe_ep::permute({.tokens = x, .indices = ids, .num_out_tokens = {}, .padded_mode = false});
  std::fill(per_expert_.begin(), per_expert_.end(), 0);
  const int32_t* id = ids.ptr<int32_t>();
  for (int64_t j = 0; j < ids.numel(); ++j) ++per_expert_[id[j]];
  MPI_Alltoall(per_expert_.data(), static_cast<int>(L), MPI_INT32_T, recv_block_.data(),
               static_cast<int>(L), MPI_INT32_T, MPI_COMM_WORLD);
  int64_t sent = 0, got = 0;
  for (int64_t d = 0; d < W; ++d) {
    send_counts_[d] = recv_counts_[d] = 0;
    for (int64_t l = 0; l < L; ++l) {
      send_counts_[d] += per_expert_[d * L + l];
      block_at_[d * L + l] = got + recv_counts_[d];
      recv_counts_[d] += recv_block_[d * L + l];
    }
    send_displs_[d] = static_cast<int>(sent);
    recv_displs_[d] = static_cast<int>(got);
    sent += send_counts_[d];
    got += recv_counts_[d];
  }
  valid_ = got;
  if (static_cast<size_t>(got * rb) > recv_.size()) {
    recv_.resize(static_cast<size_t>(got * rb));
    expand_.resize(recv_.size());
    back_send_.resize(recv_.size());
  }
  MPI_Alltoallv(perm.permuted_tokens.data(), send_counts_.data(), send_displs_.data(), row_,
                recv_.data(), recv_counts_.data(), recv_displs_.data(), row_, MPI_COMM_WORLD);
  // (source, local expert) chunks -> (local expert, source): SPEC §1.4's order.
  int64_t out = 0;
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t s = 0; s < W; ++s) {
      const int64_t n = recv_block_[s * L + l];
      std::memcpy(expand_.data() + out * rb, recv_.data() + block_at_[s * L + l] * rb,
                  static_cast<size_t>(n * rb));
      out += n;
    }
  }
  sorted_indices_ = perm.sorted_indices;
}

Tensor Textbook::combine(const std::byte* y, const TensorView& probs) {
  const int64_t W = p_.W, L = p_.L, rb = p_.row_bytes;
  int64_t in = 0;
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t s = 0; s < W; ++s) {
      const int64_t n = recv_block_[s * L + l];
      std::memcpy(back_send_.data() + block_at_[s * L + l] * rb, y + in * rb,
                  static_cast<size_t>(n * rb));
      in += n;
    }
  }
  MPI_Alltoallv(back_send_.data(), recv_counts_.data(), recv_displs_.data(), row_,
                back_recv_.data(), send_counts_.data(), send_displs_.data(), row_, MPI_COMM_WORLD);
  const TensorView back = TensorView::contiguous(back_recv_.data(), p_.dtype, {p_.BS * p_.K, p_.H});
  return moe_ep::unpermute({.permuted_tokens = back,
                            .sorted_indices = sorted_indices_,
                            .probs = probs,
                            .padded_mode = false,
                            .restore_shape = {}});
}

Alltoallv::Alltoallv(const Point& p, int64_t row_bytes) : p_(p), type_(row_bytes) {
  const size_t rb = static_cast<size_t>(row_bytes);
  const size_t copy = std::min(rb, static_cast<size_t>(p.row_bytes));
  send_.assign(p.order.size() * rb, std::byte{0});
  for (size_t j = 0; j < p.order.size(); ++j) {
    std::memcpy(send_.data() + j * rb, p.x() + (p.order[j] / p.K) * p.row_bytes, copy);
  }
  recv_.assign(static_cast<size_t>(p.valid) * rb, std::byte{0});
  back_.assign(send_.size(), std::byte{0});
}

void Alltoallv::dispatch() {
  MPI_Alltoallv(send_.data(), p_.send_rows.data(), p_.send_displ.data(), type_.get(), recv_.data(),
                p_.recv_rows.data(), p_.recv_displ.data(), type_.get(), MPI_COMM_WORLD);
}
void Alltoallv::combine() {
  MPI_Alltoallv(recv_.data(), p_.recv_rows.data(), p_.recv_displ.data(), type_.get(), back_.data(),
                p_.send_rows.data(), p_.send_displ.data(), type_.get(), MPI_COMM_WORLD);
}

}  // namespace moe_ep_tool::bench
