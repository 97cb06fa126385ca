// geometry.h — the allocator's shape, computed once from the model and the page size.
//
// A chunk is the run of token slots whose slice of every K and V range is exactly one
// page: tokens_per_chunk = page_bytes / bytes_per_token, which is why bytes_per_token
// must divide page_bytes. Page ids (PagePool): the KV page of chunk c in KV range r is
// r * num_chunks + c, so each KV range is one contiguous run of page ids (the host
// backend's mappings then merge into one kernel VMA per range); the small pool's pages
// follow; last the arena's dummy run, one allocation of pages_per_chunk pages behind
// every reclaimed chunk's arena slots (one map per chunk instead of one per page, for one
// chunk's worth of memory).
#pragma once

#include <cstdint>
#include <vector>

#include "hvmm.h"
#include "page_pool.h"

namespace harvest::vmm {

using chunk_id_t = uint64_t;  // index of a chunk, 0 .. num_chunks-1

// Chunks first .. first+count-1: lend/reclaim work on such runs so that neighbouring
// chunks share one unmap and one set_access per KV range (and per arena run).
struct ChunkRun {
  chunk_id_t first;
  uint64_t count;
};

struct Geometry {
  uint64_t page_bytes = 0;
  uint64_t num_layers = 0;
  uint64_t bytes_per_token = 0;
  uint64_t tokens_per_chunk = 0;
  uint64_t pages_per_chunk = 0;  // 2 * num_layers: one per KV range
  uint64_t num_chunks = 0;
  uint64_t small_pages = 0;

  uint64_t num_ranges() const { return pages_per_chunk; }
  uint64_t token_capacity() const { return num_chunks * tokens_per_chunk; }
  uint64_t chunk_bytes() const { return pages_per_chunk * page_bytes; }
  uint64_t num_kv_pages() const { return num_chunks * pages_per_chunk; }
  page_id_t kv_page(chunk_id_t chunk, uint64_t range) const {
    return static_cast<page_id_t>(range * num_chunks + chunk);
  }
  page_id_t small_page(uint64_t index) const { return static_cast<page_id_t>(num_kv_pages() + index); }
  page_id_t arena_dummy() const { return static_cast<page_id_t>(num_kv_pages() + small_pages); }
  // Physical allocations made at start-up; every one is a page, but the arena's dummy
  // run, which is pages_per_chunk pages.
  uint64_t total_pages() const { return num_kv_pages() + 1 + small_pages; }
};

// Ascending, distinct chunk ids as runs of neighbours.
std::vector<ChunkRun> runs_of_sorted(const std::vector<int64_t>& chunks);

// "mapped", "lent", ... for error messages.
const char* chunk_state_name(int32_t state);

// Checks the model-shape fields of `config` (everything but the page size, which the
// backend validates); throws Error(HVMM_ERR_INVALID) naming the field, value and fix.
void validate_config(const hvmm_config_t& config);

// The geometry for a validated config and the backend's page size; throws when
// bytes_per_token does not divide page_bytes or the pool would be too large.
Geometry compute_geometry(const hvmm_config_t& config, uint64_t page_bytes);

}  // namespace harvest::vmm
