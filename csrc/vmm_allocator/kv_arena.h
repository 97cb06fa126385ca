// kv_arena.h — the KV side: one virtual range per layer's K and V buffer, and which
// token slots the serving side uses.
//
// All 2 * num_layers KV ranges live in one reservation; range r's slot for chunk c is
// r * num_chunks + c, the same number as the page id of the chunk's page there, so slot
// s holds page s, mapped once at start-up and never again: a lent chunk's pages are
// mapped into the general arena as well, and stay here (hvmm.h says why that is safe).
//
// Liveness: a per-slot flag plus a per-chunk count of live slots, fed by the serving
// side's slot allocator (hvmm_mark_slots). A chunk may be lent only with no live slot.
#pragma once

#include <string>
#include <vector>

#include "geometry.h"
#include "page_pool.h"

namespace harvest::vmm {

class KvArena {
 public:
  // Maps every chunk's pages into the KV ranges, with one set_access for the whole
  // reservation.
  KvArena(Backend& backend, const PagePool& pool, const Geometry& geometry);

  va_t base() const { return table_.base(); }
  uint64_t range_bytes() const { return geometry_.num_chunks * geometry_.page_bytes; }
  const MappingTable& table() const { return table_; }

  // Bookkeeping: the caller holds the allocator's state mutex.
  uint64_t live_slots(chunk_id_t chunk) const { return live_per_chunk_[chunk]; }
  uint64_t total_live_slots() const { return total_live_; }
  // Marks slots live or free, all or nothing. `chunk_states` refuses slots of chunks
  // that are not mapped when marking live.
  void mark_slots_locked(const int64_t* slots, int64_t count, bool live, const std::vector<int32_t>& chunk_states);

  // Appends a description of the first broken invariant to `violation` (empty: none).
  void check(const std::vector<int32_t>& chunk_states, std::string& violation) const;

 private:
  uint64_t slot(chunk_id_t chunk, uint64_t range) const { return range * geometry_.num_chunks + chunk; }

  const Geometry& geometry_;
  MappingTable table_;
  std::vector<uint8_t> slot_live_;        // per token slot
  std::vector<uint64_t> live_per_chunk_;  // per chunk
  uint64_t total_live_ = 0;
};

}  // namespace harvest::vmm
