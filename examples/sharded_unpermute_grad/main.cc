// The backward of a tensor-parallel MoE unpermute with moe-ep's sharded ops (SPEC §5): the
// activations are split over the hidden dimension (Shard(1), H = 1000 over the ranks), the routing
// (sorted_indices, probs) is replicated. The hidden dimension is split exactly like PyTorch
// DTensor's Shard(1) (torch.chunk: ceil(H/n) columns per rank until they run out; on 3 ranks
// 334, 334, 332), so DTensor local shards can be handed over as they are. sharded::unpermute_grad
// returns grad_permuted_tokens as Shard(1) and grad_probs as Partial (each rank's dot products
// cover its columns only); redistributing grad_probs to Replicate sums the pieces. Both are checked
// against the single-process op on the whole tensors. Prints PASS or FAIL; exits 0 on PASS. Build
// against the installed package (see CMakeLists.txt); run: mpirun -n 3
// ./sharded_unpermute_grad
#include <moe_ep/error.h>
#include <moe_ep/permute.h>
#include <moe_ep/sharding.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

// The same pseudo-random values on every rank.
uint64_t next(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

float value(uint64_t& s) { return static_cast<float>(next(s) % 4096) / 1024.0f - 2.0f; }

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int ok = 1;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    auto mesh = moe_ep::Communicator::from_mpi(MPI_COMM_WORLD);
    const int n = mesh->size();
    const int64_t N = 16, H = 1000, K = 2, E = 8;
    using moe_ep::DType;
    using moe_ep::TensorView;

    // Whole tensors (fp32 storage, every rank the same): tokens, routing, gate weights, grad_out.
    uint64_t seed = 42;
    std::vector<float> tokens(N * H), probs(N * K), grad_out(N * H);
    std::vector<int32_t> ids(N * K);
    for (auto& v : tokens) v = value(seed);
    for (auto& v : probs) v = value(seed) / 2;
    for (auto& v : grad_out) v = value(seed);
    for (int64_t i = 0; i < N; ++i) {
      ids[i * K] = static_cast<int32_t>(next(seed) % E);
      ids[i * K + 1] = static_cast<int32_t>((ids[i * K] + 1 + next(seed) % (E - 1)) % E);
    }
    const TensorView tv = TensorView::contiguous(tokens.data(), DType::kF32, {N, H});
    const TensorView iv = TensorView::contiguous(ids.data(), DType::kI32, {N, K});
    const TensorView pv = TensorView::contiguous(probs.data(), DType::kF32, {N, K});
    const TensorView gv = TensorView::contiguous(grad_out.data(), DType::kF32, {N, H});

    // The forward's permute (single process) gives permuted_tokens and sorted_indices.
    const moe_ep::PermuteResult fwd =
        moe_ep::permute({.tokens = tv, .indices = iv, .num_out_tokens = std::nullopt});

    // The reference: the single-process backward on the whole tensors.
    const moe_ep::UnpermuteGradResult want =
        moe_ep::unpermute_grad({.permuted_tokens = fwd.permuted_tokens,
                                .grad_out = gv,
                                .sorted_indices = fwd.sorted_indices,
                                .probs = pv,
                                .padded_mode = false,
                                .restore_shape = std::nullopt});

    // The tensor-parallel backward: activations Shard(1), routing Replicate.
    auto shard = [&](const TensorView& full, moe_ep::Placement p) {
      return moe_ep::distribute(full, p, n, mesh->rank());
    };
    const moe_ep::sharded::UnpermuteGradResult got = moe_ep::sharded::unpermute_grad(
        *mesh, {.permuted_tokens = shard(fwd.permuted_tokens, moe_ep::Shard(1)),
                .grad_out = shard(gv, moe_ep::Shard(1)),
                .sorted_indices = shard(fwd.sorted_indices, moe_ep::Replicate()),
                .probs = shard(pv, moe_ep::Replicate()),
                .padded_mode = false,
                .restore_shape = std::nullopt});
    if (rank == 0)
      std::printf("strategy %s on %d ranks: grad_permuted_tokens %s, grad_probs %s\n",
                  got.choice.strategy.name.c_str(), n,
                  got.grad_permuted_tokens.placement.to_string().c_str(),
                  got.grad_probs->placement.to_string().c_str());

    // The shard widths: PyTorch DTensor's Shard(1), i.e. torch.chunk (on 3 ranks: 334, 334, 332).
    const int64_t chunk = (H + n - 1) / n;
    std::vector<int64_t> widths(static_cast<std::size_t>(n));
    const int64_t mine = got.grad_permuted_tokens.local.shape[1];
    MPI_Allgather(&mine, 1, MPI_INT64_T, widths.data(), 1, MPI_INT64_T, MPI_COMM_WORLD);
    for (int r = 0; r < n; ++r) {
      const int64_t want_w =
          std::max<int64_t>(0, std::min<int64_t>(H, chunk * (r + 1)) - chunk * r);
      if (widths[r] != want_w) {
        if (rank == 0)
          std::printf("rank %d holds %lld columns, torch.chunk gives %lld\n", r,
                      static_cast<long long>(widths[r]), static_cast<long long>(want_w));
        ok = 0;
      }
    }
    if (n == 3 && (widths[0] != 334 || widths[1] != 334 || widths[2] != 332)) ok = 0;
    if (rank == 0) {
      std::printf("hidden shards (H = %lld):", static_cast<long long>(H));
      for (int64_t w : widths) std::printf(" %lld", static_cast<long long>(w));
      std::printf("\n");
    }

    // grad_permuted_tokens: bit-identical once gathered.
    const moe_ep::Tensor gp = moe_ep::full_tensor(*mesh, got.grad_permuted_tokens);
    if (gp.nbytes() != want.grad_permuted_tokens.nbytes() ||
        std::memcmp(gp.data(), want.grad_permuted_tokens.data(), gp.nbytes()) != 0) {
      std::printf("rank %d: grad_permuted_tokens differs from the single-process op\n", rank);
      ok = 0;
    }
    // grad_probs: Partial -> Replicate (fp32 sum in rank order); equal up to fp32 summation order.
    const moe_ep::DTensor probs_rep =
        moe_ep::redistribute(*mesh, *got.grad_probs, moe_ep::Replicate(), "grad_probs");
    const float* a = static_cast<const float*>(probs_rep.local.data);
    const float* b = want.grad_probs.ptr<float>();
    // The bound: the two sums differ only in the order of H fp32 additions, each off by at most
    // 2^-24 of the running magnitude, so by at most H * 2^-24 * sum |terms| (twice for margin).
    const float* perm = fwd.permuted_tokens.ptr<float>();
    const int32_t* sorted = fwd.sorted_indices.ptr<int32_t>();
    double worst = 0;
    for (int64_t j = 0; j < N * K; ++j) {
      const int64_t row = sorted[j], i = j / K;
      double mag = 0;
      for (int64_t h = 0; h < H; ++h)
        mag += std::fabs(double{grad_out[i * H + h]} * perm[row * H + h]);
      const double err = std::fabs(double{a[j]} - b[j]);
      worst = std::max(worst, err);
      if (err > 2.0 * H * std::ldexp(1.0, -24) * mag) {
        std::printf("rank %d: grad_probs[%lld] = %.9g, single-process %.9g\n", rank,
                    static_cast<long long>(j), a[j], b[j]);
        ok = 0;
      }
    }
    if (rank == 0) std::printf("grad_probs: max |sharded - single-process| = %.3g\n", worst);
  } catch (const moe_ep::Error& e) {
    std::printf("rank %d: %s error: %s\n", rank, moe_ep::error_kind_name(e.kind()), e.what());
    ok = 0;
  }
  int all = 0;
  MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) std::printf("%s\n", all ? "PASS" : "FAIL");
  MPI_Finalize();
  return all ? 0 : 1;
}
