// Internal: reuse of large tensor storage between ops.
//
// Every op returns freshly allocated outputs (an owned Tensor). glibc serves blocks above 32 MiB
// with mmap and returns them with munmap, so each call of an op with a large output would
// otherwise start on fresh pages: the kernel maps and zeroes every 4 KiB page on first touch,
// which on the development machine costs about as much as writing the output three times
// (docs/performance.md). The cache keeps up to kCacheBytes of freed blocks of at least
// kMinBlockBytes and hands one back to the next allocation of the same rounded size, so a
// steady stream of same-shaped calls (a training or serving loop) touches no fresh page.
#pragma once

#include <cstddef>

namespace moe_ep::detail {

// Blocks below this size come from and go to malloc/free directly (64 bytes more, aligned by
// hand: glibc's aligned_alloc splits a larger chunk on every call, about 6x the cost of a malloc,
// and a small dispatch_v2 call allocates several such outputs).
inline constexpr std::size_t kMinBlockBytes = std::size_t{4} << 20;
// Blocks of at least kMinBlockBytes are rounded up to a multiple of this (so that near-equal
// sizes share blocks).
inline constexpr std::size_t kBlockRounding = std::size_t{2} << 20;
// At most this many bytes of freed blocks are kept; the oldest are released first.
inline constexpr std::size_t kCacheBytes = std::size_t{2} << 30;

// A 64-byte aligned block of at least `bytes` bytes (a cached one when a freed block of the same
// rounded size is kept), or null when allocation fails. Thread-safe.
void* allocate_block(std::size_t bytes);
// Returns a block from allocate_block(bytes) (same `bytes`): kept for reuse or freed. Never
// throws. Thread-safe.
void release_block(void* p, std::size_t bytes) noexcept;

}  // namespace moe_ep::detail
