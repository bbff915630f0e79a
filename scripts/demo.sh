#!/usr/bin/env bash
# The main job: one OLMoE MoE layer's forward across 4 MPI ranks on real routing statistics,
# checked against a single-process dense reference. Installs what is missing, builds, runs.
# Extra arguments go to `moe-ep run` (e.g. scripts/demo.sh --preset mixtral-8x7b --ffn 256).
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
moe_ep_install_deps
moe_ep_build "$MOE_EP_ROOT/build" -DMOE_EP_BUILD_TESTS=OFF
moe_ep_mpi_env
exec mpirun -n 4 --oversubscribe "$MOE_EP_ROOT/build/bin/moe-ep" run "$@"
