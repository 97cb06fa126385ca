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
// Thread-safe with its own mutex (the decode thread and the trainer both allocate).
#pragma once

#include <cstdint>
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
  // >= one page (those belong to the general arena).
  va_t allocate(int64_t num_bytes);
  // Throws Error(HVMM_ERR_INVALID) for an address that is not a live block (double free,
  // unknown pointer); nothing changes then.
  void free(va_t address);

  struct Usage {
    uint64_t used_bytes = 0;
    uint64_t requested_bytes = 0;
    uint64_t allocations = 0;
    uint64_t largest_free_bytes = 0;
  };
  Usage usage() const;

  // Called with the allocator's remap mutex held; takes the pool's own mutex.
  void check(std::string& violation) const;

 private:
  enum : uint8_t { kInterior = 0, kFreeHead = 1, kUsedHead = 2 };
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
};

}  // namespace harvest::vmm
