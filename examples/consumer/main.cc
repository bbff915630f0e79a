// One MoE step with moe-ep: dispatch each token to its top-2 experts, run a trivial "expert"
// (expert e multiplies by e + 1), combine with the gate weights, check the result.
// Build against the installed package (see CMakeLists.txt); run: mpirun -n 2 ./moe_ep_consumer
#include <moe_ep/dispatch.h>
#include <moe_ep/error.h>
#include <moe_ep/permute.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int bad = 0;
  try {
    auto comm = moe_ep::Communicator::from_mpi(MPI_COMM_WORLD);
    const int W = comm->size(), r = comm->rank(), BS = 3, H = 8, K = 2, E = 4 * W;
    std::vector<float> x(BS * H), scales(BS * K, 0.5f);
    std::vector<int32_t> ids(BS * K);
    for (int i = 0; i < BS; ++i) {
      for (int h = 0; h < H; ++h) x[i * H + h] = static_cast<float>(r * 100 + i + h);
      ids[i * K] = (r + i) % E;  // two distinct experts per token
      ids[i * K + 1] = (r + i + 1) % E;
    }
    moe_ep::EpConfig cfg{
        .group_ep = comm.get(), .ep_world_size = W, .ep_rank_id = r, .moe_expert_num = E};
    auto xv = moe_ep::TensorView::contiguous(x.data(), moe_ep::DType::kF32, {BS, H});
    auto idv = moe_ep::TensorView::contiguous(ids.data(), moe_ep::DType::kI32, {BS, K});
    auto sv = moe_ep::TensorView::contiguous(scales.data(), moe_ep::DType::kF32, {BS, K});
    moe_ep::DispatchOutputs d = moe_ep::dispatch_v2({.x = xv, .expert_ids = idv}, cfg);

    // The experts: rows of local expert e are [counts[e*W - 1], counts[(e+1)*W - 1]).
    const int L = E / W;
    const int32_t* counts = d.ep_recv_counts.ptr<int32_t>();
    float* rows = d.expand_x.ptr<float>();
    for (int e = 0; e < L; ++e) {
      const int begin = e == 0 ? 0 : counts[e * W - 1], end = counts[(e + 1) * W - 1];
      for (int j = begin; j < end; ++j)
        for (int h = 0; h < H; ++h) rows[j * H + h] *= static_cast<float>(r * L + e + 1);
    }
    moe_ep::Tensor y = moe_ep::combine_v2({.expand_x = d.expand_x,
                                           .expert_ids = idv,
                                           .assist_info_for_combine = d.assist_info_for_combine,
                                           .ep_send_counts = d.ep_recv_counts,
                                           .expert_scales = sv},
                                          cfg);
    for (int i = 0; i < BS; ++i)
      for (int h = 0; h < H; ++h) {
        const float want =
            0.5f * x[i * H + h] * (ids[i * K] + 1) + 0.5f * x[i * H + h] * (ids[i * K + 1] + 1);
        if (std::fabs(y.ptr<float>()[i * H + h] - want) > 1e-4f * std::fabs(want)) bad = 1;
      }
  } catch (const moe_ep::Error& e) {
    std::fprintf(stderr, "moe_ep error (%s): %s\n", moe_ep::error_kind_name(e.kind()), e.what());
    bad = 1;
  }
  int any = 0;
  MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) std::printf("%s\n", any ? "FAIL" : "PASS");
  MPI_Finalize();
  return any;
}
