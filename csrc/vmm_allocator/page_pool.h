// page_pool.h — every physical page, created once at start-up, and the tables of which
// page is mapped at which virtual slot.
//
// PagePool: creating a page costs ~193 us on an A100 (cuMemCreate), so all pages exist
// from start-up to teardown and nothing on the lend/reclaim path creates or releases one
// (hvmm_counters_t.create stays at create_at_init). Page ids: KV pages first, then the
// shared dummy page, then the small pool's pages (the Allocator assigns the ranges).
//
// MappingTable: a reserved virtual range cut into page-sized slots, recording the page
// mapped in each slot and whether access was granted. It is the only code that maps or
// unmaps, and it records a change only after the backend call succeeded, so
// check_integrity compares intended state against what was really done.
#pragma once

#include <cstdint>
#include <vector>

#include "backend.h"

namespace harvest::vmm {

using page_id_t = uint32_t;  // index of a physical page in the PagePool
constexpr int64_t kNoPage = -1;

class PagePool {
 public:
  // Creates `num_pages` pages; on failure releases the ones it made and throws.
  PagePool(Backend& backend, uint64_t num_pages);
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  phys_handle_t handle(page_id_t page) const { return pages_[page].handle(); }
  uint64_t num_pages() const { return pages_.size(); }

 private:
  std::vector<PhysPage> pages_;
};

class MappingTable {
 public:
  MappingTable(Backend& backend, const PagePool& pool, uint64_t num_slots);
  ~MappingTable();  // unmaps every mapped run (logging failures), then frees the range
  MappingTable(const MappingTable&) = delete;
  MappingTable& operator=(const MappingTable&) = delete;

  va_t base() const { return range_.base(); }
  uint64_t num_slots() const { return page_.size(); }
  uint64_t bytes() const { return range_.bytes(); }
  va_t slot_address(uint64_t slot) const { return range_.base() + slot * page_bytes_; }
  int64_t page_at(uint64_t slot) const { return page_[slot]; }
  bool accessible(uint64_t slot) const { return accessible_[slot] != 0; }

  // One backend map; the slot must be empty.
  void map(uint64_t slot, page_id_t page);
  // One backend unmap over [first, first + count); every slot must be mapped.
  void unmap_run(uint64_t first, uint64_t count);
  // One backend set_access over [first, first + count); every slot must be mapped.
  void set_access_run(uint64_t first, uint64_t count);

 private:
  void check_run(const char* what, uint64_t first, uint64_t count) const;

  Backend& backend_;
  const PagePool& pool_;
  uint64_t page_bytes_;
  VaRange range_;
  std::vector<int64_t> page_;        // kNoPage or the page id mapped in each slot
  std::vector<uint8_t> accessible_;  // set_access covered the slot since its map
};

}  // namespace harvest::vmm
