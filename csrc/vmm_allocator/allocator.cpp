#include "allocator.h"

#include <algorithm>

#include "errors.h"

namespace harvest::vmm {
namespace {

std::unique_ptr<Backend> make_backend(const hvmm_config_t& config) {
  validate_config(config);  // before any resource exists: bad input changes nothing
  const uint64_t page_bytes = static_cast<uint64_t>(config.page_bytes);
  if (config.backend == HVMM_BACKEND_CUDA) return make_cuda_backend(config.device_ordinal, page_bytes);
  return make_host_backend(page_bytes);
}

int status_of(const std::exception& error) {
  const auto* typed = dynamic_cast<const Error*>(&error);
  return typed != nullptr ? typed->status() : HVMM_ERR_INTERNAL;
}

std::string describe_runs(const std::vector<ChunkRun>& runs) {
  std::string text;
  for (const ChunkRun& run : runs) {
    if (!text.empty()) text += ", ";
    text += run.count == 1 ? std::to_string(run.first)
                           : std::to_string(run.first) + "-" + std::to_string(run.first + run.count - 1);
  }
  return text;
}

}  // namespace

Allocator::Allocator(const hvmm_config_t& config)
    : backend_kind_(config.backend),
      device_ordinal_(config.device_ordinal),
      backend_(make_backend(config)),
      geometry_(compute_geometry(config, backend_->page_bytes())),
      pool_(*backend_, geometry_.total_pages(), geometry_.arena_dummy(), geometry_.pages_per_chunk),
      kv_(std::make_unique<KvArena>(*backend_, pool_, geometry_)),
      arena_(std::make_unique<GeneralArena>(*backend_, pool_, geometry_)),
      states_(geometry_.num_chunks, HVMM_CHUNK_MAPPED) {
  if (geometry_.small_pages > 0) {
    small_ = std::make_unique<SmallPool>(*backend_, pool_, geometry_, geometry_.small_page(0), geometry_.small_pages);
  }
  create_at_init_ = backend_->count(CallKind::kCreate);
  // Until the caller names its streams: on a GPU the legacy default stream (what a
  // single-stream program uses, and it waits for the blocking streams); host work is
  // synchronous, so nothing to fence.
  if (backend_kind_ == HVMM_BACKEND_CUDA) kv_streams_.push_back(0);
}

hvmm_geometry_t Allocator::describe() const {
  hvmm_geometry_t out{};
  out.backend = backend_kind_;
  out.device_ordinal = device_ordinal_;
  out.page_bytes = geometry_.page_bytes;
  out.num_layers = geometry_.num_layers;
  out.bytes_per_token = geometry_.bytes_per_token;
  out.tokens_per_chunk = geometry_.tokens_per_chunk;
  out.pages_per_chunk = geometry_.pages_per_chunk;
  out.num_chunks = geometry_.num_chunks;
  out.token_capacity = geometry_.token_capacity();
  out.chunk_bytes = geometry_.chunk_bytes();
  out.kv_range_bytes = kv_->range_bytes();
  out.kv_base = kv_->base();
  out.arena_base = arena_->base();
  out.arena_bytes = arena_->bytes();
  out.small_base = small_ ? small_->base() : 0;
  out.small_bytes = small_ ? small_->bytes() : 0;
  out.small_pages = geometry_.small_pages;
  out.total_pages = geometry_.total_pages();
  return out;
}

void Allocator::check_chunk_id(int64_t chunk) const {
  if (chunk < 0 || static_cast<uint64_t>(chunk) >= geometry_.num_chunks) {
    throw_invalid("chunk " + std::to_string(chunk) + " is out of range [0, " + std::to_string(geometry_.num_chunks) +
                  ")");
  }
}

void Allocator::mark_slots(const int64_t* slots, int64_t count, bool live) {
  if (count < 0 || (count > 0 && slots == nullptr)) {
    throw_invalid("count=" + std::to_string(count) + " with " + (slots ? "a" : "no") + " slot array");
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  kv_->mark_slots_locked(slots, count, live, states_);
}

hvmm_chunk_info_t Allocator::chunk_info(int64_t chunk) {
  check_chunk_id(chunk);
  hvmm_chunk_info_t info{};
  std::vector<FencePtr> fences;
  std::vector<FencePtr> lend_fences;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    info.state = states_[chunk];
    info.live_slots = kv_->live_slots(chunk);
    info.used_pages = arena_->used_pages(chunk);
    fences = arena_->fences_locked(chunk);
    for (const auto& pending : pending_lends_) {
      for (const ChunkRun& run : pending->runs) {
        if (static_cast<uint64_t>(chunk) >= run.first && static_cast<uint64_t>(chunk) < run.first + run.count) {
          lend_fences = pending->fences;
        }
      }
    }
  }
  std::vector<FencePtr> passed;
  for (const FencePtr& fence : fences) {
    if (backend_->fence_passed(fence->event)) passed.push_back(fence);
  }
  info.fence_pending = passed.size() < fences.size() || !all_passed(lend_fences) ? 1 : 0;
  if (!passed.empty()) {
    std::lock_guard<std::mutex> lock(state_mu_);
    arena_->drop_fences_locked(chunk, passed);
  }
  return info;
}

void Allocator::chunk_table(hvmm_chunk_info_t* out, int64_t capacity) {
  if (out == nullptr || capacity < 0 || static_cast<uint64_t>(capacity) < geometry_.num_chunks) {
    throw_invalid("capacity=" + std::to_string(capacity) + " but there are " + std::to_string(geometry_.num_chunks) +
                  " chunks");
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  for (chunk_id_t chunk = 0; chunk < geometry_.num_chunks; ++chunk) {
    out[chunk].state = states_[chunk];
    // A chunk being lent waits on its lend's fences (none when no stream is fenced).
    out[chunk].fence_pending = arena_->has_fences_locked(chunk) || states_[chunk] == HVMM_CHUNK_LENDING ? 1 : 0;
    out[chunk].live_slots = kv_->live_slots(chunk);
    out[chunk].used_pages = arena_->used_pages(chunk);
  }
}

bool Allocator::can_lend(int64_t chunk) {
  check_chunk_id(chunk);
  std::lock_guard<std::mutex> lock(state_mu_);
  return states_[chunk] == HVMM_CHUNK_MAPPED && kv_->live_slots(chunk) == 0;
}

bool Allocator::can_reclaim(int64_t chunk) {
  check_chunk_id(chunk);
  std::lock_guard<std::mutex> lock(state_mu_);
  return states_[chunk] == HVMM_CHUNK_LENT && arena_->used_pages(chunk) == 0;
}

std::vector<ChunkRun> Allocator::validate_chunks_locked(const int64_t* chunks, int64_t count, bool lend) const {
  if (count <= 0 || chunks == nullptr) {
    throw_invalid("count=" + std::to_string(count) + "; pass at least one chunk id");
  }
  std::vector<int64_t> sorted(chunks, chunks + count);
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < count; ++i) {
    const int64_t chunk = sorted[i];
    check_chunk_id(chunk);
    if (i > 0 && sorted[i - 1] == chunk) throw_invalid("chunk " + std::to_string(chunk) + " is listed twice");
    const int32_t state = states_[chunk];
    const std::string name = "chunk " + std::to_string(chunk);
    if (state == HVMM_CHUNK_BUSY) throw_invalid(name + " is busy (another lend or reclaim is moving it)");
    if (state == HVMM_CHUNK_BROKEN) throw_invalid(name + " is broken by an earlier driver failure and cannot move");
    if (state == HVMM_CHUNK_LENDING) {
      throw_invalid(name + (lend ? " is already being lent" : " is not lent yet") +
                    " (its lend waits for the KV streams' fences; finish_lends completes it once they pass, "
                    "cancel_lends gives it back to the KV cache)");
    }
    if (lend) {
      if (state == HVMM_CHUNK_LENT) throw_invalid(name + " is already lent");
      const uint64_t live = kv_->live_slots(chunk);
      if (live > 0) {
        const uint64_t first_slot = static_cast<uint64_t>(chunk) * geometry_.tokens_per_chunk;
        throw_invalid(name + " still holds " + std::to_string(live) + " live token slots (its slots are [" +
                      std::to_string(first_slot) + ", " + std::to_string(first_slot + geometry_.tokens_per_chunk) +
                      ")); free them before lending (can_lend says when a chunk can go)");
      }
    } else {
      if (state == HVMM_CHUNK_MAPPED) throw_invalid(name + " is not lent (it backs the KV cache)");
      const uint64_t used = arena_->used_pages(chunk);
      if (used > 0) {
        throw_invalid(name + " is still used by the trainer: " + std::to_string(used) + " of its " +
                      std::to_string(geometry_.pages_per_chunk) +
                      " pages are in live general-arena allocations; free them first (can_reclaim says when)");
      }
    }
  }
  return runs_of_sorted(sorted);
}

void Allocator::set_states_locked(const std::vector<ChunkRun>& runs, int32_t state) {
  for (const ChunkRun& run : runs) {
    for (chunk_id_t chunk = run.first; chunk < run.first + run.count; ++chunk) states_[chunk] = state;
  }
}

template <typename Undo>
void Allocator::roll_back(const std::vector<ChunkRun>& runs, const std::exception& error, int32_t state_before,
                          Undo&& undo) {
  const int status = status_of(error);
  try {
    undo();
  } catch (const std::exception& undo_error) {
    std::lock_guard<std::mutex> lock(state_mu_);
    set_states_locked(runs, HVMM_CHUNK_BROKEN);
    throw Error(status, std::string(error.what()) + "; undoing the move also failed (" + undo_error.what() +
                            "), so chunks " + describe_runs(runs) + " are now broken");
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  if (state_before == HVMM_CHUNK_LENT) arena_->add_chunks_locked(runs);
  set_states_locked(runs, state_before);
  throw Error(status, std::string(error.what()) + " (rolled back: chunks " + describe_runs(runs) + " unchanged)");
}

void Allocator::set_fence_streams(const uint64_t* streams, int64_t count) {
  if (count < 0 || (count > 0 && streams == nullptr)) {
    throw_invalid("count=" + std::to_string(count) + " with " + (streams ? "a" : "no") + " stream array");
  }
  std::vector<stream_t> distinct;
  for (int64_t i = 0; i < count; ++i) {
    if (std::find(distinct.begin(), distinct.end(), streams[i]) == distinct.end()) distinct.push_back(streams[i]);
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  kv_streams_ = std::move(distinct);
}

std::vector<stream_t> Allocator::fence_streams() {
  std::lock_guard<std::mutex> lock(state_mu_);
  return kv_streams_;
}

std::vector<FencePtr> Allocator::record_kv_fences() {
  std::vector<stream_t> streams;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    streams = kv_streams_;
  }
  return record_fences(*backend_, streams);
}

void Allocator::move_to_arena(const std::vector<ChunkRun>& runs, int32_t state_before) {
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    set_states_locked(runs, HVMM_CHUNK_BUSY);
  }
  try {
    arena_->converge_attached(runs);  // the pages stay at their KV slices too
  } catch (const std::exception& error) {
    roll_back(runs, error, state_before, [&] { arena_->converge_detached(runs); });
  }
}

bool Allocator::lend(const int64_t* chunks, int64_t count, bool wait) {
  std::lock_guard<std::mutex> remap(remap_mu_);
  std::vector<ChunkRun> runs;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    runs = validate_chunks_locked(chunks, count, true);
    set_states_locked(runs, HVMM_CHUNK_LENDING);
  }
  try {
    // The serving side no longer hands these slots out, but kernels queued before now
    // may still write them: the trainer gets no page before every KV stream is past here.
    std::vector<FencePtr> fences = record_kv_fences();
    if (wait) {
      for (const FencePtr& fence : fences) backend_->wait_fence(fence->event);
    } else if (!all_passed(fences)) {
      auto pending = std::make_shared<PendingLend>(PendingLend{runs, std::move(fences)});
      std::lock_guard<std::mutex> lock(state_mu_);
      pending_lends_.push_back(std::move(pending));
      return false;
    }
  } catch (const std::exception& error) {
    // Nothing was mapped yet: the chunks simply back their KV slots alone again.
    std::lock_guard<std::mutex> lock(state_mu_);
    set_states_locked(runs, HVMM_CHUNK_MAPPED);
    throw Error(status_of(error),
                std::string(error.what()) + " (rolled back: chunks " + describe_runs(runs) + " unchanged)");
  }
  move_to_arena(runs, HVMM_CHUNK_MAPPED);
  std::lock_guard<std::mutex> lock(state_mu_);
  arena_->add_chunks_locked(runs);
  set_states_locked(runs, HVMM_CHUNK_LENT);
  return true;
}

std::vector<int64_t> Allocator::finish_lends() {
  std::lock_guard<std::mutex> remap(remap_mu_);
  std::vector<std::shared_ptr<PendingLend>> pending;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    pending = pending_lends_;
  }
  std::vector<std::shared_ptr<PendingLend>> ready;
  std::vector<int64_t> chunks;
  for (const auto& lend : pending) {
    if (!all_passed(lend->fences)) continue;  // decode is still on it: a later call
    ready.push_back(lend);
    for (const ChunkRun& run : lend->runs) {
      for (chunk_id_t chunk = run.first; chunk < run.first + run.count; ++chunk) {
        chunks.push_back(static_cast<int64_t>(chunk));
      }
    }
  }
  if (ready.empty()) return chunks;
  std::sort(chunks.begin(), chunks.end());
  const std::vector<ChunkRun> runs = runs_of_sorted(chunks);  // neighbouring batches share calls
  // On a failure the chunks are rolled back to LENDING with their batches still listed,
  // unless the rollback failed too: broken chunks are no longer being lent.
  try {
    move_to_arena(runs, HVMM_CHUNK_LENDING);
  } catch (...) {
    std::lock_guard<std::mutex> lock(state_mu_);
    keep_lending_chunks_locked();
    throw;
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  auto is_ready = [&](const std::shared_ptr<PendingLend>& lend) {
    return std::find(ready.begin(), ready.end(), lend) != ready.end();
  };
  pending_lends_.erase(std::remove_if(pending_lends_.begin(), pending_lends_.end(), is_ready), pending_lends_.end());
  arena_->add_chunks_locked(runs);
  set_states_locked(runs, HVMM_CHUNK_LENT);
  return chunks;
}

void Allocator::cancel_lends(const int64_t* chunks, int64_t count) {
  if (count <= 0 || chunks == nullptr) {
    throw_invalid("count=" + std::to_string(count) + "; pass at least one chunk id");
  }
  std::lock_guard<std::mutex> remap(remap_mu_);
  std::lock_guard<std::mutex> lock(state_mu_);
  std::vector<int64_t> sorted(chunks, chunks + count);
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < count; ++i) {
    check_chunk_id(sorted[i]);
    if (i > 0 && sorted[i - 1] == sorted[i]) throw_invalid("chunk " + std::to_string(sorted[i]) + " is listed twice");
    if (states_[sorted[i]] != HVMM_CHUNK_LENDING) {
      throw_invalid("chunk " + std::to_string(sorted[i]) + " is " + chunk_state_name(states_[sorted[i]]) +
                    ", not being lent; only a lend still waiting for its fences can be cancelled");
    }
  }
  // Nothing was mapped into the arena yet: nothing to undo.
  const std::vector<int32_t> states_before = states_;
  set_states_locked(runs_of_sorted(sorted), HVMM_CHUNK_MAPPED);
  try {
    keep_lending_chunks_locked();
  } catch (...) {
    states_ = states_before;  // out of memory for the bookkeeping: nothing changed
    throw;
  }
}

void Allocator::keep_lending_chunks_locked() {
  // Every batch's remainder is built before any changes, so a bad_alloc changes nothing.
  std::vector<std::vector<ChunkRun>> remainders;
  for (const auto& lend : pending_lends_) {
    std::vector<int64_t> kept;
    for (const ChunkRun& run : lend->runs) {
      for (chunk_id_t chunk = run.first; chunk < run.first + run.count; ++chunk) {
        if (states_[chunk] == HVMM_CHUNK_LENDING) kept.push_back(static_cast<int64_t>(chunk));
      }
    }
    remainders.push_back(runs_of_sorted(kept));
  }
  for (size_t i = 0; i < pending_lends_.size(); ++i) pending_lends_[i]->runs = std::move(remainders[i]);
  pending_lends_.erase(std::remove_if(pending_lends_.begin(), pending_lends_.end(),
                                      [](const auto& lend) { return lend->runs.empty(); }),
                       pending_lends_.end());
}

void Allocator::reclaim(const int64_t* chunks, int64_t count) {
  std::lock_guard<std::mutex> remap(remap_mu_);
  std::vector<ChunkRun> runs;
  std::vector<std::pair<chunk_id_t, std::vector<FencePtr>>> fences;
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    runs = validate_chunks_locked(chunks, count, false);
    arena_->remove_chunks_locked(runs);  // no allocation can land in them from here on
    set_states_locked(runs, HVMM_CHUNK_BUSY);
    for (const ChunkRun& run : runs) {
      for (chunk_id_t chunk = run.first; chunk < run.first + run.count; ++chunk) {
        fences.emplace_back(chunk, arena_->fences_locked(chunk));
      }
    }
  }
  try {
    // Event waits (never a device-wide sync), before the arena run is unmapped: the
    // streams that used these pages in the arena must be past the fences recorded at
    // their free. Decode's streams need no fence: its slices of these pages never left.
    for (const auto& [chunk, list] : fences) {
      for (const FencePtr& fence : list) backend_->wait_fence(fence->event);
    }
    arena_->converge_detached(runs);
  } catch (const std::exception& error) {
    roll_back(runs, error, HVMM_CHUNK_LENT, [&] { arena_->converge_attached(runs); });
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  for (const auto& [chunk, list] : fences) arena_->drop_fences_locked(chunk, list);
  set_states_locked(runs, HVMM_CHUNK_MAPPED);
}

va_t Allocator::arena_allocate(int64_t num_bytes) {
  if (num_bytes <= 0) throw_invalid("num_bytes=" + std::to_string(num_bytes) + " must be positive");
  const uint64_t pages = (static_cast<uint64_t>(num_bytes) + geometry_.page_bytes - 1) / geometry_.page_bytes;
  if (pages > geometry_.num_kv_pages()) {
    throw_invalid("num_bytes=" + std::to_string(num_bytes) + " exceeds the whole KV pool (" +
                  std::to_string(geometry_.num_kv_pages() * geometry_.page_bytes) + " bytes) and can never be served");
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  const int64_t slot = arena_->allocate_locked(pages);
  return slot < 0 ? 0 : arena_->base() + static_cast<uint64_t>(slot) * geometry_.page_bytes;
}

void Allocator::arena_free(va_t address, const uint64_t* streams, int64_t num_streams) {
  if (num_streams < 0 || (num_streams > 0 && streams == nullptr)) {
    throw_invalid("num_streams=" + std::to_string(num_streams) + " with " + (streams ? "a" : "no") + " stream array");
  }
  if (num_streams == 0) {
    std::lock_guard<std::mutex> lock(state_mu_);
    arena_->free_locked(address, false);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    arena_->free_locked(address, true);  // validate before recording anything
  }
  std::vector<FencePtr> fences;
  for (int64_t i = 0; i < num_streams; ++i) {
    const event_t event = backend_->record_fence(streams[i]);
    fences.push_back(std::make_shared<Fence>(*backend_, streams[i], event));
  }
  std::lock_guard<std::mutex> lock(state_mu_);
  const ChunkRun covered = arena_->free_locked(address, false);
  arena_->add_fences_locked(covered, fences);
}

SmallPool& Allocator::small_pool() {
  if (!small_) throw_invalid("the small pool is disabled (small_pool_bytes=0); create the allocator with a pool size");
  return *small_;
}

va_t Allocator::small_allocate(int64_t num_bytes) { return small_pool().allocate(num_bytes); }

void Allocator::small_free(va_t address, const uint64_t* streams, int64_t num_streams) {
  if (num_streams < 0 || (num_streams > 0 && streams == nullptr)) {
    throw_invalid("num_streams=" + std::to_string(num_streams) + " with " + (streams ? "a" : "no") + " stream array");
  }
  SmallPool& pool = small_pool();
  if (num_streams == 0) {
    pool.free(address);
    return;
  }
  pool.check_free(address);  // validate before recording anything
  pool.free_fenced(address, record_fences(*backend_, std::vector<stream_t>(streams, streams + num_streams)));
}

uint64_t Allocator::small_collect() { return small_pool().collect_passed(); }

hvmm_stats_t Allocator::stats() {
  hvmm_stats_t out{};
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    const uint64_t per_chunk = geometry_.pages_per_chunk;
    out.num_chunks = geometry_.num_chunks;
    for (chunk_id_t chunk = 0; chunk < geometry_.num_chunks; ++chunk) {
      const uint64_t used = arena_->used_pages(chunk);
      switch (states_[chunk]) {
        case HVMM_CHUNK_MAPPED: ++out.chunks_mapped; break;
        case HVMM_CHUNK_LENT:
          ++out.chunks_lent;
          if (used == 0) ++out.chunks_lent_idle;
          if (used > 0 && used < per_chunk) out.fragmentation_bytes += (per_chunk - used) * geometry_.page_bytes;
          break;
        case HVMM_CHUNK_BUSY: ++out.chunks_busy; break;
        case HVMM_CHUNK_LENDING: ++out.chunks_lending; break;
        default: ++out.chunks_broken; break;
      }
    }
    out.live_slots = kv_->total_live_slots();
    out.pages_kv_mapped = (out.chunks_mapped + out.chunks_lending) * per_chunk;
    out.pages_lent = out.chunks_lent * per_chunk;
    out.pages_lent_used = arena_->used_pages_total();
    out.bytes_lent = out.pages_lent * geometry_.page_bytes;
    out.arena_allocations = arena_->num_allocations();
    out.arena_used_bytes = arena_->used_pages_total() * geometry_.page_bytes;
    out.arena_largest_free_bytes = arena_->largest_free_run() * geometry_.page_bytes;
    out.fences_pending = arena_->num_fences_locked();
    for (const auto& lend : pending_lends_) out.fences_pending += lend->fences.size();
  }
  if (small_) {
    const SmallPool::Usage usage = small_->usage();
    out.small_pool_bytes = small_->bytes();
    out.small_used_bytes = usage.used_bytes;
    out.small_requested_bytes = usage.requested_bytes;
    out.small_allocations = usage.allocations;
    out.small_largest_free_bytes = usage.largest_free_bytes;
    out.small_pending_frees = usage.pending_frees;
    out.small_pending_bytes = usage.pending_bytes;
  }
  return out;
}

hvmm_counters_t Allocator::counters() const {
  hvmm_counters_t out{};
  uint64_t* fields[] = {&out.reserve, &out.free_range, &out.create, &out.release, &out.map, &out.unmap,
                        &out.set_access, &out.event_create, &out.fence_record, &out.fence_query, &out.fence_wait};
  static_assert(sizeof(fields) / sizeof(fields[0]) == kNumCallKinds, "hvmm_counters_t and CallKind disagree");
  for (int kind = 0; kind < kNumCallKinds; ++kind) *fields[kind] = backend_->count(static_cast<CallKind>(kind));
  out.create_at_init = create_at_init_;
  return out;
}

void Allocator::debug_backend_call(int32_t kind, va_t address, uint64_t bytes, int64_t page) {
  std::lock_guard<std::mutex> remap(remap_mu_);  // not in the middle of a move
  switch (static_cast<CallKind>(kind)) {
    case CallKind::kMap:
      if (page < 0 || static_cast<uint64_t>(page) >= pool_.num_pages()) {
        throw_invalid("page=" + std::to_string(page) + " is not a pool page [0, " + std::to_string(pool_.num_pages()) +
                      ")");
      }
      backend_->map(address, pool_.handle(static_cast<page_id_t>(page)), bytes);
      return;
    case CallKind::kUnmap: backend_->unmap(address, bytes); return;
    case CallKind::kSetAccess: backend_->set_access(address, bytes); return;
    default:
      throw_invalid("kind=" + std::to_string(kind) + " is not map (4), unmap (5) or set_access (6)");
  }
}

void Allocator::check_integrity() {
  std::lock_guard<std::mutex> remap(remap_mu_);
  std::lock_guard<std::mutex> lock(state_mu_);
  std::string violation;
  kv_->check(states_, violation);
  if (violation.empty()) arena_->check(states_, violation);
  if (violation.empty()) {
    // Every chunk being lent is in exactly one pending batch, and only those are.
    std::vector<uint32_t> batches(geometry_.num_chunks, 0);
    for (const auto& lend : pending_lends_) {
      for (const ChunkRun& run : lend->runs) {
        for (chunk_id_t chunk = run.first; chunk < run.first + run.count && chunk < geometry_.num_chunks; ++chunk) {
          ++batches[chunk];
        }
      }
    }
    for (chunk_id_t chunk = 0; chunk < geometry_.num_chunks && violation.empty(); ++chunk) {
      const uint32_t want = states_[chunk] == HVMM_CHUNK_LENDING ? 1 : 0;
      if (batches[chunk] != want) {
        violation = "chunk " + std::to_string(chunk) + " (" + chunk_state_name(states_[chunk]) + ") is in " +
                    std::to_string(batches[chunk]) + " pending lends, expected " + std::to_string(want);
      }
    }
  }
  if (violation.empty() && small_) small_->check(violation);
  if (violation.empty()) {
    // Across the tables: every page is mapped exactly where its owner's state says, so
    // none has leaked and only a lent chunk's pages are reachable twice (at their KV
    // slices and in the arena). The arena slots of broken chunks hold whatever the failed
    // move left; those chunks' pages are skipped.
    auto broken = [&](chunk_id_t chunk) { return states_[chunk] == HVMM_CHUNK_BROKEN; };
    std::vector<uint32_t> seen(geometry_.total_pages(), 0);
    const MappingTable& kv_table = kv_->table();
    for (uint64_t s = 0; s < kv_table.num_slots(); ++s) {
      if (kv_table.page_at(s) != kNoPage) ++seen[kv_table.page_at(s)];
    }
    const MappingTable& arena_table = arena_->table();
    uint64_t arena_dummies = 0;  // slots of the arena's dummy run (GeneralArena::check says which)
    for (uint64_t s = 0; s < arena_table.num_slots(); ++s) {
      if (arena_table.page_at(s) != kNoPage && !broken(s / geometry_.pages_per_chunk)) {
        ++seen[arena_table.page_at(s)];
        arena_dummies += arena_table.page_at(s) == geometry_.arena_dummy();
      }
    }
    if (small_) {
      for (uint64_t s = 0; s < small_->table().num_slots(); ++s) ++seen[small_->table().page_at(s)];
    }
    for (uint64_t page = 0; page < seen.size() && violation.empty(); ++page) {
      const bool is_kv = page < geometry_.num_kv_pages();
      if (is_kv && broken(page % geometry_.num_chunks)) continue;
      // A KV page: at its slice, and in the arena while its chunk is lent. The arena's
      // dummy run: only in the arena, over the reclaimed chunks (GeneralArena::check).
      const uint64_t want = is_kv ? 1 + (states_[page % geometry_.num_chunks] == HVMM_CHUNK_LENT ? 1 : 0)
                            : page == geometry_.arena_dummy() ? arena_dummies
                                                              : 1;
      if (seen[page] != want) {
        violation = "page " + std::to_string(page) + " is mapped " + std::to_string(seen[page]) + " times, expected " +
                    std::to_string(want) +
                    (seen[page] > want ? " (reachable where its owner's state says it is not)" : " (leaked)");
      }
    }
  }
  if (violation.empty() && (backend_->count(CallKind::kCreate) != create_at_init_ ||
                            backend_->count(CallKind::kRelease) != 0)) {
    violation = "physical pages were created or released after start-up";
  }
  if (!violation.empty()) throw_internal(violation);
}

}  // namespace harvest::vmm
