// kv_arena.h — the KV side: one virtual range per layer's K and V buffer, and which
// token slots the serving side uses.
//
// All 2 * num_layers KV ranges live in one reservation; range r's slot for chunk c is
// r * num_chunks + c, the same number as the page id of the chunk's page there, so a
// mapped chunk's slot s holds page s. A lent chunk's slots all hold the shared dummy
// page instead (kvcached's trick): padded decode batches read and write slot 0-like
// indices in any chunk, and those accesses must land somewhere harmless, not fault.
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

  // Mapping moves on chunks the caller owns (marked busy). Each brings every slot of the
  // runs to the target state from whatever mix of states a failed move left, so the same
  // calls undo a move: converge_to_pages is the rollback of converge_to_dummy and back.
  // Normal cost: per KV range and run of n chunks one unmap and n maps; then one
  // set_access for all of them (kv_arena.cpp says why one call is allowed).
  void converge_to_dummy(const std::vector<ChunkRun>& runs);
  void converge_to_pages(const std::vector<ChunkRun>& runs);

  // Appends a description of the first broken invariant to `violation` (empty: none).
  void check(const std::vector<int32_t>& chunk_states, std::string& violation) const;

 private:
  uint64_t slot(chunk_id_t chunk, uint64_t range) const { return range * geometry_.num_chunks + chunk; }
  void converge(const std::vector<ChunkRun>& runs, bool to_dummy);

  const Geometry& geometry_;
  MappingTable table_;
  std::vector<uint8_t> slot_live_;        // per token slot
  std::vector<uint64_t> live_per_chunk_;  // per chunk
  uint64_t total_live_ = 0;
};

}  // namespace harvest::vmm
