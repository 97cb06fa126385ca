// small_pool.h — the small-tensor pool: always-mapped pages, buddy allocator, 2 KiB units.
//
// Harli (§4.5) counts over 5k allocations under 2 MiB per training iteration; serving
// them from whole pages would waste most of each page and cost a map per tensor. This
// pool maps its pages once at start-up and never unmaps them. Each page is the root of
// a binary buddy tree of blocks of 2 KiB * 2^order (order 0 .. log2(page / 2 KiB)); a
// request is rounded up to one block. Metadata lives in side arrays indexed by block
// number, never inside the memory (which may be device memory), so alloc and free touch
// a few cache lines: a bitmask of non-empty orders finds a block with one ctz, and free
// lists are intrusive doubly linked lists over the side arrays.
//
// Fenced frees: a block freed while work queued on some stream may still use it (torch's
// record_stream cannot help: the memory is not torch's) is freed with fences on those
// streams. It then waits in a FIFO, neither free nor merged with its buddy, and allocate
// hands it out again only after every fence has passed: each allocate first queries the
// oldest waiting frees (one event query each, cuEventQuery on a GPU) and stops at the
// first whose fences have not passed, as PyTorch's caching allocator processes its
// record_stream events. A free with no fences is immediate (the caller knows no queued
// work uses the block, e.g. it is reused on the stream that used it). The allocate fast
// path with nothing waiting is unchanged: one relaxed atomic load.
//
// Thread-safe with its own mutex (the decode thread and the trainer both allocate); no
// driver call runs under it.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "geometry.h"
#include "page_pool.h"

namespace harvest::vmm {

class SmallPool {
 public:
  static constexpr uint64_t kBlockBytes = 2048;

  // Maps pages [first_page, first_page + num_pages) of `pool`, one set_access for all.
  SmallPool(Backend& backend, const PagePool& pool, const Geometry& geometry, page_id_t first_page,
            uint64_t num_pages);

  va_t base() const { return table_.base(); }
  uint64_t bytes() const { return table_.bytes(); }
  const MappingTable& table() const { return table_; }

  // 0 when no block is free that is large enough (transient). Throws for sizes <= 0 or
  // >= one page (those belong to the general arena). Frees whose fences have passed are
  // collected first.
  va_t allocate(int64_t num_bytes);
  // Throws Error(HVMM_ERR_INVALID) for an address that is not a live block (double free,
  // unknown pointer); nothing changes then.
  void free(va_t address);
  // The same check without freeing (before fences are recorded for a fenced free).
  void check_free(va_t address) const;
  // Frees the block once every one of `fences` has passed (at once when empty).
  void free_fenced(va_t address, std::vector<FencePtr> fences);
  // Makes every waiting free whose fences have passed allocatable (oldest first, up to
  // the first still pending); returns how many.
  uint64_t collect_passed();

  struct Usage {
    uint64_t used_bytes = 0;       // live blocks
    uint64_t requested_bytes = 0;  // live blocks, as asked for
    uint64_t allocations = 0;      // live blocks
    uint64_t largest_free_bytes = 0;
    uint64_t pending_frees = 0;    // freed blocks waiting for their fences
    uint64_t pending_bytes = 0;
  };
  Usage usage() const;

  // Called with the allocator's remap mutex held; takes the pool's own mutex.
  void check(std::string& violation) const;

 private:
  enum : uint8_t { kInterior = 0, kFreeHead = 1, kUsedHead = 2, kPendingHead = 3 };
  struct PendingFree {
    int32_t block;
    std::vector<FencePtr> fences;
  };
  int32_t used_block_locked(va_t address) const;  // throws for anything but a live block
  void release_locked(int32_t block);             // a used or pending block becomes free, merged
  void push_locked(int32_t block, int order);
  void unlink_locked(int32_t block, int order);

  const Geometry& geometry_;
  MappingTable table_;
  int top_order_ = 0;  // a whole page
  uint64_t num_blocks_ = 0;
  mutable std::mutex mu_;
  std::vector<int32_t> next_;
  std::vector<int32_t> prev_;
  std::vector<uint8_t> order_;
  std::vector<uint8_t> state_;
  std::vector<uint64_t> requested_;  // bytes asked for, per used head
  std::vector<int32_t> free_head_;   // per order, -1 when empty
  uint64_t nonempty_orders_ = 0;     // bit k: free_head_[k] != -1
  uint64_t used_bytes_ = 0;
  uint64_t requested_bytes_ = 0;
  uint64_t allocations_ = 0;
  std::deque<PendingFree> pending_;  // oldest first
  uint64_t pending_bytes_ = 0;
  std::atomic<uint64_t> pending_count_{0};  // pending_.size(), read without the mutex
};

}  // namespace harvest::vmm
