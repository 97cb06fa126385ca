// general_arena.h — the trainer's side: lent pages mapped contiguously, handed out in
// whole pages, with fences that say when freed pages may leave the arena.
//
// Placement: chunk c's pages sit at arena slots [c * pages_per_chunk, (c + 1) *
// pages_per_chunk), arena_base + c * chunk_bytes. With SGLang filling low chunks first,
// the free chunks it gives up are the high, adjacent ones, so they form one contiguous
// run and a tensor larger than a chunk (a layer's frozen weights) fits without copying.
// Allocation is best fit over the runs of free lent pages (ties: lowest address), which
// keeps long runs whole and packs tensors into already-used chunks, so that idle chunks
// can go back to the KV cache. A chunk is reclaimable once none of its pages is inside
// a live allocation; reclaim first waits on the fences recorded when they were freed.
//
// A reclaimed chunk's arena slots show a dummy (as a lent chunk's KV slices do), not a
// hole: a tensor view the trainer kept past its free (a Python reference the window
// dropped late, a stale view) then reads and writes the dummy instead of faulting, which
// on a GPU would poison the CUDA context decode runs in, and never reaches the KV data
// that page holds again. That dummy is the arena's dummy run, one allocation of a chunk's
// pages shared by every reclaimed chunk, so one map covers a chunk (one per page with a
// one-page dummy: 64 for Llama-3-8B). Slots of a chunk never lent hold nothing.
//
// Bookkeeping methods (*_locked) need the allocator's state mutex; attach/detach are
// driver calls on chunks the caller owns (marked busy) and need no lock.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "geometry.h"
#include "page_pool.h"

namespace harvest::vmm {

class GeneralArena {
 public:
  GeneralArena(Backend& backend, const PagePool& pool, const Geometry& geometry);

  va_t base() const { return table_.base(); }
  uint64_t bytes() const { return table_.bytes(); }
  const MappingTable& table() const { return table_; }

  // Driver side, on owned chunks; idempotent from any partial state (rollback = the other).
  // Attached: the chunks' own pages; detached: the arena's dummy run over each chunk.
  // Normal cost per run of n chunks: attach one unmap (none at a chunk's first lend),
  // n * pages_per_chunk maps, one set_access; detach one unmap, n maps, one set_access.
  void converge_attached(const std::vector<ChunkRun>& runs);
  void converge_detached(const std::vector<ChunkRun>& runs);

  // Bookkeeping.
  void add_chunks_locked(const std::vector<ChunkRun>& runs);     // their pages become free
  void remove_chunks_locked(const std::vector<ChunkRun>& runs);  // every page must be free
  uint64_t used_pages(chunk_id_t chunk) const { return used_pages_[chunk]; }
  // First slot of the allocation, or -1 when no run of free lent pages is long enough.
  int64_t allocate_locked(uint64_t num_pages);
  // Throws Error(HVMM_ERR_INVALID) for an address that is not a live allocation; returns
  // the chunks the allocation covered (for fencing) without freeing when `dry_run`.
  ChunkRun free_locked(va_t address, bool dry_run);
  void add_fences_locked(const ChunkRun& chunks, const std::vector<FencePtr>& fences);
  // The chunk's fences, copied so the caller can query or wait on them outside the lock;
  // then drop the ones that passed.
  std::vector<FencePtr> fences_locked(chunk_id_t chunk) const { return fences_[chunk]; }
  void drop_fences_locked(chunk_id_t chunk, const std::vector<FencePtr>& passed);
  bool has_fences_locked(chunk_id_t chunk) const { return !fences_[chunk].empty(); }
  uint64_t num_fences_locked() const;

  uint64_t num_allocations() const { return allocations_.size(); }
  uint64_t used_pages_total() const { return used_pages_total_; }
  uint64_t largest_free_run() const;

  void check(const std::vector<int32_t>& chunk_states, std::string& violation) const;

 private:
  void converge(const std::vector<ChunkRun>& runs, bool to_dummy);
  std::string describe_address(va_t address) const;
  void insert_free_run_locked(uint64_t first, uint64_t length);  // coalesces with neighbours

  Backend& backend_;
  const Geometry& geometry_;
  MappingTable table_;
  std::map<uint64_t, uint64_t> free_runs_;    // first slot -> length; coalesced
  std::map<uint64_t, uint64_t> allocations_;  // first slot -> length
  std::vector<uint64_t> used_pages_;          // per chunk
  uint64_t used_pages_total_ = 0;
  std::vector<std::vector<FencePtr>> fences_;  // per chunk, at most one per stream
};

}  // namespace harvest::vmm
