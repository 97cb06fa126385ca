// allocator.h — the unified allocator: one page pool behind the KV arena, the general
// arena and the small pool, and the lend/reclaim of KV pages into and out of the arena.
//
// Locks (see hvmm.h): remap_mu_ serializes lend, reclaim and check_integrity; state_mu_
// guards chunk states, slot liveness and arena bookkeeping and is never held across a
// driver call. A lend/reclaim validates and marks its chunks busy under state_mu_, moves
// the mappings with only remap_mu_ held (arena alloc/free and slot marking go on
// meanwhile), then publishes the new state. On a driver failure the move is undone by
// the opposite convergence of the arena; if that fails too the chunks are marked broken.
//
// KV fences: a lend hands a chunk's pages to the arena only after the work queued on
// every KV stream (the streams set with set_fence_streams: decode's) at the time of the
// lend has finished, since that work may still write the chunk's slots. It records an
// event on each of them and either waits on the events (lend with wait) or leaves the
// batch pending (state LENDING: the serving side no longer hands out its slots, the arena
// does not have its pages yet) for finish_lends to complete once every event has passed,
// without blocking the caller; cancel_lends gives pending chunks back untouched. A
// reclaim waits on the arena fences before the arena slots change. The KV ranges
// themselves never change after start-up (hvmm.h says why that is safe).
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "backend.h"
#include "general_arena.h"
#include "geometry.h"
#include "hvmm.h"
#include "kv_arena.h"
#include "page_pool.h"
#include "small_pool.h"

namespace harvest::vmm {

class Allocator {
 public:
  explicit Allocator(const hvmm_config_t& config);
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  hvmm_geometry_t describe() const;

  void mark_slots(const int64_t* slots, int64_t count, bool live);
  hvmm_chunk_info_t chunk_info(int64_t chunk);
  void chunk_table(hvmm_chunk_info_t* out, int64_t capacity);
  bool can_lend(int64_t chunk);
  bool can_reclaim(int64_t chunk);
  // True when the chunks are lent on return; false (only without `wait`) when their KV
  // fences have not all passed yet: the batch is pending (LENDING) for finish_lends.
  bool lend(const int64_t* chunks, int64_t count, bool wait);
  // Completes every pending lend whose fences have all passed, as one batch; returns the
  // chunks lent by this call, ascending.
  std::vector<int64_t> finish_lends();
  void cancel_lends(const int64_t* chunks, int64_t count);
  void reclaim(const int64_t* chunks, int64_t count);

  void set_fence_streams(const uint64_t* streams, int64_t count);
  std::vector<stream_t> fence_streams();

  va_t arena_allocate(int64_t num_bytes);  // 0: exhausted right now
  void arena_free(va_t address, const uint64_t* streams, int64_t num_streams);
  va_t small_allocate(int64_t num_bytes);  // 0: exhausted right now
  void small_free(va_t address, const uint64_t* streams, int64_t num_streams);
  uint64_t small_collect();
  SmallPool& small_pool();

  hvmm_stats_t stats();
  hvmm_counters_t counters() const;
  Backend& backend() { return *backend_; }
  void check_integrity();
  // Tests only (hvmm_debug_backend_call): one raw map / unmap / set_access.
  void debug_backend_call(int32_t kind, va_t address, uint64_t bytes, int64_t page);

 private:
  // A lend that recorded its KV fences and waits for them to pass.
  struct PendingLend {
    std::vector<ChunkRun> runs;
    std::vector<FencePtr> fences;
  };

  std::vector<ChunkRun> validate_chunks_locked(const int64_t* chunks, int64_t count, bool lend) const;
  void set_states_locked(const std::vector<ChunkRun>& runs, int32_t state);
  std::vector<FencePtr> record_kv_fences();
  // Drops from the pending lends every chunk no longer LENDING (cancelled, broken), and
  // the batches left empty (their fences recycled).
  void keep_lending_chunks_locked();
  // The mapping move of a lend whose fences have passed: chunks in `state_before`
  // (LENDING) become LENT, or are rolled back to it.
  void move_to_arena(const std::vector<ChunkRun>& runs, int32_t state_before);
  void check_chunk_id(int64_t chunk) const;
  // Undo a failed move with `undo`; on success restore `state_before`, else mark broken.
  // Always throws: the original error, annotated.
  template <typename Undo>
  [[noreturn]] void roll_back(const std::vector<ChunkRun>& runs, const std::exception& error, int32_t state_before,
                              Undo&& undo);

  int32_t backend_kind_;
  int32_t device_ordinal_;
  // Member order is teardown order, reversed: mapping tables (each unmaps, then frees its
  // range) go first, then the physical pages, then the backend.
  std::unique_ptr<Backend> backend_;
  Geometry geometry_;
  PagePool pool_;
  std::unique_ptr<KvArena> kv_;
  std::unique_ptr<GeneralArena> arena_;
  std::unique_ptr<SmallPool> small_;  // null when small_pool_bytes == 0
  uint64_t create_at_init_ = 0;

  std::mutex remap_mu_;
  std::mutex state_mu_;
  std::vector<int32_t> states_;  // hvmm_chunk_state per chunk
  std::vector<stream_t> kv_streams_;  // state_mu_; fenced before any KV slice is unmapped
  std::vector<std::shared_ptr<PendingLend>> pending_lends_;  // state_mu_; changed under remap_mu_ too
};

}  // namespace harvest::vmm
