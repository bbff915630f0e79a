// Internal: the shared-memory transport as the ops use it (docs/design.md, "Shared-memory
// transport"): whether a call uses it, the windows set up and grown after the header agreement,
// and where each rank's rows lie.
#pragma once

#include <cstdint>
#include <vector>

#include "core/ep/config.h"
#include "core/ep/header.h"
#include "moe_ep/comm.h"
#include "transport/windows.h"

namespace moe_ep::detail {

// The smallest window segment a rank creates.
constexpr int64_t kMinShmBytes = int64_t{1} << 20;

// Whether a call uses the shared-memory transport: decided from agreed values only (transport,
// tp_world_size, the elastic_info hash), so every rank decides the same.
bool shm_applies(int64_t transport, const EpConfig& cfg, const World& w);

// After the header agreement of a call that uses shm: the communicator's context, created
// (collectively over group_ep) on first use; a new window generation (collectively over the
// machine) when any rank of this machine asked for one (shm_grow: its segment too small, or full
// within Windows::should_grow's bound). `own_need`: the bytes this rank wants in one slot;
// its new segment holds two.
Windows& ensure_shm(const Communicator& comm, const char* op, const std::vector<OpHeader>& h,
                    const std::vector<int>& peers, int64_t own_need);

// Where every rank of the op's world has its rows (world order): from the headers, then, for the
// ranks of this machine that could place them only after ensure_shm grew the windows (shm_grow),
// from phase "where", in which each of those tells the others of this machine (`mine`: this
// rank's). Ranks on other machines: gen -1.
std::vector<Where> rows_where(const Communicator& comm, const char* op, const Windows& shm,
                              const std::vector<OpHeader>& h, const std::vector<int>& peers, int me,
                              const Where& mine);

}  // namespace moe_ep::detail
