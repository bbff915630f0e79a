#include "transport/shm/context.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "base/check.h"
#include "transport/exchange.h"
#include "transport/mpi/check.h"

namespace moe_ep::detail {

namespace {

constexpr int64_t kSlotAlign = 4096;

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Releases a slot: removes its region from the window's live list.
struct SlotRelease {
  std::shared_ptr<ShmWindow> win;
  int64_t offset;
  ~SlotRelease() {
    std::lock_guard<std::mutex> lock(win->mu);
    auto it = std::find_if(win->live.begin(), win->live.end(),
                           [&](const auto& r) { return r.offset == offset; });
    if (it != win->live.end()) win->live.erase(it);
  }
};

}  // namespace

std::shared_ptr<Windows> open_windows(const Communicator& comm, const char* op,
                                      int ranks_per_node) {
  return ShmContext::create(comm, op, ranks_per_node);
}

std::shared_ptr<ShmContext> ShmContext::create(const Communicator& comm, const char* op,
                                               int ranks_per_node) {
  std::shared_ptr<ShmContext> ctx(new ShmContext());
  MPI_Comm machine = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(comm.mpi_comm(), MPI_COMM_TYPE_SHARED, comm.rank(), MPI_INFO_NULL,
                                &machine),
            op, "MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)");
  MPI_Comm_set_errhandler(machine, MPI_ERRORS_RETURN);
  // $MOE_EP_SHM_NODE_RANKS (testing): runs of that many of the machine's ranks, each a node of
  // its own.
  int machine_rank = 0;
  MPI_Comm_rank(machine, &machine_rank);
  int rc = MPI_Comm_split(machine, ranks_per_node > 0 ? machine_rank / ranks_per_node : 0,
                          machine_rank, &ctx->node_);
  MPI_Comm_free(&machine);
  check_mpi(rc, op, "splitting the machine's ranks by MOE_EP_SHM_NODE_RANKS");
  MPI_Comm_set_errhandler(ctx->node_, MPI_ERRORS_RETURN);
  int n = 0;
  MPI_Comm_rank(ctx->node_, &ctx->node_rank_);
  MPI_Comm_size(ctx->node_, &n);
  MPI_Group node_group, group;
  check_mpi(MPI_Comm_group(ctx->node_, &node_group), op, "MPI_Comm_group");
  check_mpi(MPI_Comm_group(comm.mpi_comm(), &group), op, "MPI_Comm_group");
  std::vector<int> node_ranks(n);
  for (int i = 0; i < n; ++i) node_ranks[i] = i;
  ctx->node_to_group_.assign(n, MPI_UNDEFINED);
  rc = MPI_Group_translate_ranks(node_group, n, node_ranks.data(), group,
                                 ctx->node_to_group_.data());
  MPI_Group_free(&node_group);
  MPI_Group_free(&group);
  check_mpi(rc, op, "MPI_Group_translate_ranks");
  ctx->group_to_node_.assign(comm.size(), -1);
  for (int i = 0; i < n; ++i) {
    const int g = ctx->node_to_group_[i];
    MOE_EP_CHECK(g >= 0 && g < comm.size());
    ctx->group_to_node_[g] = i;
  }
  ctx->links_.resize(comm.size());
  for (int g : ctx->node_to_group_) ctx->links_[g] = std::make_unique<WindowLink>(g, *ctx);
  return ctx;
}

// Local, never blocking: the windows and the node communicator are left mapped until the
// process exits. Freeing them is collective over the node (MPI_Win_free has a barrier), and a
// destructor runs when the last reference goes, which differs across ranks (Python's garbage
// collector, an exception's traceback keeping a communicator alive on one rank only): a rank in
// MPI_Win_free, or in an agreement to call it, would wait for peers that are elsewhere, up to
// forever. Live tensors in the windows stay valid either way.
ShmContext::~ShmContext() = default;

int64_t ShmContext::capacity() const {
  return windows_.empty() ? 0 : windows_.back()->bytes[node_rank_];
}

void ShmContext::grow(int64_t own_bytes, const char* op, int64_t shm_window_bytes) {
  if (fixed_)
    fail(ErrorKind::kInternal, op,
         ": the shared-memory window was made with shm_grow = false "
         "and must not grow (please report this bug)");
  auto w = std::make_shared<ShmWindow>();
  w->gen = static_cast<int>(windows_.size());
  w->me = node_rank_;
  MPI_Info info;
  MPI_Info_create(&info);
  // Each segment on its own pages, first touched by its owner (NUMA placement).
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  char* mine = nullptr;
  // One page more than asked for: MPI need not return page-aligned segments (Open MPI's start
  // 8 bytes past a 64-byte boundary), and rows that straddle cache lines make every vector store
  // two (measured: dispatch's copies about 1.3x slower). Each segment is used from its first
  // kSlotAlign boundary on (a shared mapping keeps an address's offset within a page in every
  // process, so each rank finds the same boundary in a peer's segment; checked below).
  const int64_t asked = round_up(own_bytes, kSlotAlign) + kSlotAlign;
  const int rc =
      MPI_Win_allocate_shared(static_cast<MPI_Aint>(asked), 1, info, node_, &mine, &w->win);
  MPI_Info_free(&info);
  if (rc != MPI_SUCCESS) {
    // The size and where it came from: a size this machine cannot give (CommOptions bounds it
    // only by the physical memory) shows as an MPI error code alone otherwise.
    const std::string what =
        cat("MPI_Win_allocate_shared of ", asked,
            " bytes (this rank's segment of the shm transport's ", "window: ", own_bytes,
            " bytes, the largest of CommOptions::shm_window_bytes = ", shm_window_bytes,
            ", twice this op's need, 1 MiB and the current segment, plus one page; ",
            "a smaller shm_window_bytes, or EpConfig::transport = \"mpi\", avoids the window)");
    check_mpi(rc, op, what.c_str());
  }
  MPI_Win_set_errhandler(w->win, MPI_ERRORS_RETURN);
  const int n = static_cast<int>(node_to_group_.size());
  w->base.resize(n);
  w->bytes.resize(n);
  // Slots are named by their offset from that boundary. Every rank gathers what every rank found,
  // so all decide alike, and a failed query (pad -1) is reported the same way instead of leaving
  // the others in the collective.
  std::vector<int64_t> pads(static_cast<std::size_t>(n) * n);  // row r: the pads rank r found
  int64_t* mine_pads = pads.data() + static_cast<std::ptrdiff_t>(node_rank_) * n;
  for (int p = 0; p < n; ++p) {
    MPI_Aint size = 0;
    int disp = 0;
    void* base = nullptr;
    mine_pads[p] = -1;
    w->base[p] = nullptr;
    w->bytes[p] = 0;
    if (MPI_Win_shared_query(w->win, p, &size, &disp, &base) != MPI_SUCCESS) continue;
    const auto addr = reinterpret_cast<std::uintptr_t>(base);
    const auto pad = static_cast<int64_t>((kSlotAlign - addr % kSlotAlign) % kSlotAlign);
    const auto usable = static_cast<int64_t>(size) - pad;
    mine_pads[p] = pad;
    w->base[p] = usable > 0 ? static_cast<char*>(base) + pad : nullptr;
    w->bytes[p] = usable > 0 ? usable / kSlotAlign * kSlotAlign : 0;
  }
  const int gathered =
      MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, pads.data(), n, MPI_INT64_T, node_);
  if (gathered != MPI_SUCCESS) {
    MPI_Win_free(&w->win);
    check_mpi(gathered, op, "MPI_Allgather");
  }
  auto seen = [&](int r, int p) { return pads[static_cast<std::size_t>(r) * n + p]; };
  for (int r = 0; r < n; ++r)
    for (int p = 0; p < n; ++p) {
      if (seen(r, p) == seen(p, p) && seen(r, p) >= 0) continue;
      MPI_Win_free(&w->win);
      if (seen(r, p) < 0)
        fail(ErrorKind::kSystem, op, ": MPI_Win_shared_query of segment ", p,
             " failed on node rank ", r);
      fail(ErrorKind::kInternal, op, ": the first ", kSlotAlign, "-byte boundary of shared-memory ",
           "segment ", p, " lies ", seen(r, p), " bytes in for node rank ", r, " but ", seen(p, p),
           " for its owner; the shm transport needs the same (EpConfig::transport = \"mpi\", or "
           "$MOE_EP_TRANSPORT=mpi when it is empty, avoids it; please report this bug)");
    }
  // One passive-target epoch for the window's life: MPI_Win_sync needs one.
  check_mpi(MPI_Win_lock_all(MPI_MODE_NOCHECK, w->win), op, "MPI_Win_lock_all");
  windows_.push_back(std::move(w));
}

int64_t window_slot_bytes(int64_t bytes) {
  return round_up(std::max<int64_t>(bytes, 1), kSlotAlign);
}

std::optional<ShmSlot> ShmContext::try_alloc(int64_t bytes) {
  const int64_t need = window_slot_bytes(bytes);
  largest_request_ = std::max(largest_request_, need);
  for (auto it = windows_.rbegin(); it != windows_.rend(); ++it) {
    const std::shared_ptr<ShmWindow>& w = *it;
    const int64_t cap = w->bytes[node_rank_];
    std::lock_guard<std::mutex> lock(w->mu);
    int64_t at = 0;  // first fit between the live regions
    std::size_t pos = 0;
    for (; pos < w->live.size(); ++pos) {
      if (w->live[pos].offset - at >= need) break;
      at = w->live[pos].offset + w->live[pos].bytes;
    }
    if (cap - at < need) continue;
    ShmSlot s;
    s.token = std::shared_ptr<SlotRelease>(new SlotRelease{w, at});  // no temporary to destroy
    w->live.insert(w->live.begin() + static_cast<std::ptrdiff_t>(pos), {at, need, s.token});
    s.gen = w->gen;
    s.offset = at;
    s.ptr = w->base[node_rank_] + at;
    ++slots_allocated_;
    return s;
  }
  return std::nullopt;
}

std::optional<ShmSlot> ShmContext::adopt(const void* p, int64_t bytes) const {
  const int64_t need = window_slot_bytes(bytes);
  for (const std::shared_ptr<ShmWindow>& w : windows_) {
    const char* base = w->base[node_rank_];
    const char* c = static_cast<const char*>(p);
    if (c < base || c >= base + w->bytes[node_rank_]) continue;
    std::lock_guard<std::mutex> lock(w->mu);
    for (const ShmWindow::Live& r : w->live) {
      if (r.offset != c - base || r.bytes < need) continue;
      ShmSlot s;
      s.token = r.token.lock();
      if (!s.token) return std::nullopt;  // being released
      s.gen = w->gen;
      s.offset = r.offset;
      s.ptr = w->base[node_rank_] + r.offset;
      return s;
    }
  }
  return std::nullopt;
}

bool ShmContext::should_grow(int64_t bytes) const {
  if (fixed_) return false;
  return capacity() < bytes || mapped() < kFullGrowthFactor * largest_request_;
}

int64_t ShmContext::mapped() const {
  int64_t total = 0;
  for (const auto& w : windows_) total += w->bytes[node_rank_];
  return total;
}

bool ShmContext::locate(const void* p, int64_t bytes, int& gen, int64_t& offset) const {
  const char* c = static_cast<const char*>(p);
  for (const auto& w : windows_) {
    const char* b = w->base[node_rank_];
    const int64_t n = w->bytes[node_rank_];
    if (b != nullptr && c >= b && bytes >= 0 && c - b <= n && bytes <= n - (c - b)) {
      gen = w->gen;
      offset = c - b;
      return true;
    }
  }
  return false;
}

char* ShmContext::peer_ptr(int gen, int group_rank, int64_t offset, int64_t bytes) const {
  MOE_EP_CHECK(gen >= 0 && gen < static_cast<int>(windows_.size()));
  const int p = node_of(group_rank);
  MOE_EP_CHECK(p >= 0);
  const ShmWindow& w = *windows_[gen];
  MOE_EP_CHECK(offset >= 0 && bytes >= 0 && offset <= w.bytes[p] && bytes <= w.bytes[p] - offset);
  return w.base[p] + offset;
}

void ShmContext::sync() const {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (const auto& w : windows_) MPI_Win_sync(w->win);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

}  // namespace moe_ep::detail
