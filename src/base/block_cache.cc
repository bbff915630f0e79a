#include "base/block_cache.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <utility>

namespace moe_ep::detail {

namespace {

std::size_t rounded_size(std::size_t bytes) {
  if (bytes < kMinBlockBytes) return (bytes + 63) / 64 * 64;
  return (bytes + kBlockRounding - 1) / kBlockRounding * kBlockRounding;
}

struct BlockCache {
  std::mutex mu;
  std::deque<std::pair<std::size_t, void*>> blocks;  // (rounded size, block), oldest first
  std::size_t total = 0;
};

// Never destroyed: tensors may be released during static destruction.
BlockCache& cache() {
  static BlockCache* c = new BlockCache;
  return *c;
}

}  // namespace

void* allocate_block(std::size_t bytes) {
  const std::size_t size = rounded_size(bytes == 0 ? 1 : bytes);
  if (size >= kMinBlockBytes) {
    BlockCache& c = cache();
    std::lock_guard<std::mutex> lock(c.mu);
    for (auto it = c.blocks.rbegin(); it != c.blocks.rend(); ++it)
      if (it->first == size) {
        void* p = it->second;
        c.total -= size;
        c.blocks.erase(std::next(it).base());
        return p;
      }
  }
  if (size < kMinBlockBytes) {
    // The byte before the block holds its distance from malloc's pointer (16 to 64).
    auto* raw = static_cast<unsigned char*>(std::malloc(size + 64));
    if (raw == nullptr) return nullptr;
    const std::size_t shift = 64 - reinterpret_cast<std::uintptr_t>(raw) % 64;
    raw[shift - 1] = static_cast<unsigned char>(shift);
    return raw + shift;
  }
  // Large blocks start on a 2 MiB boundary and ask for transparent huge pages (honoured where
  // /sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise"; a no-op elsewhere):
  // the ops walk their rows in routing order, and with 4 KiB pages nearly every row start is a
  // TLB miss (docs/performance.md).
  void* p = std::aligned_alloc(kBlockRounding, size);
#ifdef MADV_HUGEPAGE
  if (p != nullptr) (void)madvise(p, size, MADV_HUGEPAGE);
#endif
  return p;
}

void release_block(void* p, std::size_t bytes) noexcept {
  const std::size_t size = rounded_size(bytes == 0 ? 1 : bytes);
  if (p == nullptr) return;
  if (size < kMinBlockBytes) {
    auto* block = static_cast<unsigned char*>(p);
    std::free(block - block[-1]);
    return;
  }
  if (size > kCacheBytes) {
    std::free(p);
    return;
  }
  BlockCache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.blocks.emplace_back(size, p);
  c.total += size;
  while (c.total > kCacheBytes) {
    std::free(c.blocks.front().second);
    c.total -= c.blocks.front().first;
    c.blocks.pop_front();
  }
}

}  // namespace moe_ep::detail
