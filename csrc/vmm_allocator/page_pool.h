// page_pool.h — every physical page, created once at start-up, and the tables of which
// page is mapped at which virtual slot.
//
// PagePool: creating a page costs ~193 us on an A100 (cuMemCreate), so all pages exist
// from start-up to teardown and nothing on the lend/reclaim path creates or releases one
// (hvmm_counters_t.create stays at create_at_init). Page ids: KV pages first, then the
// small pool's pages, then the arena's dummy run (the Allocator assigns the ranges).
// Every id is one physical allocation: one page, except the arena's dummy run, one
// allocation of a chunk's pages, so it covers a reclaimed chunk's arena slots in one map.
//
// MappingTable: a reserved virtual range cut into page-sized slots, recording the page
// mapped in each slot (a mapping of a multi-page allocation covers several slots) and
// whether access was granted. It is the only code that maps or unmaps, and it records a
// change only after the backend call succeeded, so check_integrity compares intended
// state against what was really done.
#pragma once

#include <cstdint>
#include <vector>

#include "backend.h"

namespace harvest::vmm {

using page_id_t = uint32_t;  // index of a physical page in the PagePool
constexpr int64_t kNoPage = -1;

class PagePool {
 public:
  // Creates `num_pages` allocations of one page each, except `wide_page` (if below
  // num_pages), which gets `wide_pages` pages; on failure releases the ones it made and
  // throws.
  PagePool(Backend& backend, uint64_t num_pages, uint64_t wide_page = UINT64_MAX, uint64_t wide_pages = 1);
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  phys_handle_t handle(page_id_t page) const { return pages_[page].handle(); }
  uint64_t pages_of(page_id_t page) const { return pages_[page].pages(); }  // its size in pages
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
  // Slots of the mapping that starts at `slot`; 0 when none starts there (empty, or
  // inside a multi-page mapping).
  uint64_t mapping_slots(uint64_t slot) const { return length_[slot]; }

  // One backend map of the whole allocation `page` at `slot` (pool_.pages_of(page)
  // slots, all empty).
  void map(uint64_t slot, page_id_t page);
  // One backend unmap over [first, first + count): whole mappings, no empty slot.
  void unmap_run(uint64_t first, uint64_t count);
  // One backend set_access over [first, first + count): whole mappings, no empty slot.
  void set_access_run(uint64_t first, uint64_t count);
  // Gives access to every mapping in [first, end) that lacks it, in as few set_access
  // calls as the driver allows: one per stretch of adjacent mappings with no empty slot
  // between (mappings that already have access inside a stretch are covered again,
  // which changes nothing for them). [first, end) must not cut a mapping. Returns the
  // number of calls made.
  uint64_t grant_access(uint64_t first, uint64_t end);

 private:
  void check_run(const char* what, uint64_t first, uint64_t count) const;

  Backend& backend_;
  const PagePool& pool_;
  uint64_t page_bytes_;
  VaRange range_;
  std::vector<int64_t> page_;        // kNoPage or the page id mapped in each slot
  std::vector<uint32_t> length_;     // slots of the mapping starting here; 0 elsewhere
  std::vector<uint8_t> accessible_;  // set_access covered the slot since its map
};

}  // namespace harvest::vmm
