#include "general_arena.h"

#include <algorithm>

#include "errors.h"

namespace harvest::vmm {

GeneralArena::GeneralArena(Backend& backend, const PagePool& pool, const Geometry& geometry)
    : backend_(backend),
      geometry_(geometry),
      table_(backend, pool, geometry.num_kv_pages()),
      used_pages_(geometry.num_chunks, 0),
      fences_(geometry.num_chunks) {}

void GeneralArena::converge_attached(const std::vector<ChunkRun>& runs) { converge(runs, false); }

void GeneralArena::converge_detached(const std::vector<ChunkRun>& runs) { converge(runs, true); }

void GeneralArena::converge(const std::vector<ChunkRun>& runs, bool to_dummy) {
  const uint64_t per_chunk = geometry_.pages_per_chunk;
  const int64_t dummy = geometry_.arena_dummy();
  // Attached: each slot its own page. Detached: the dummy run, one mapping over the chunk.
  auto target = [&](uint64_t s) {
    return to_dummy ? dummy : static_cast<int64_t>(geometry_.kv_page(s / per_chunk, s % per_chunk));
  };
  for (const ChunkRun& run : runs) {
    const uint64_t first = run.first * per_chunk;
    const uint64_t end = (run.first + run.count) * per_chunk;
    // 1. Unmap what is there but should not be (one call per sub-run; normally the run).
    //    A mapping is wholly right or wholly wrong, so the sub-runs never cut one.
    uint64_t s = first;
    while (s < end) {
      const int64_t page = table_.page_at(s);
      if (page == kNoPage || page == target(s)) {
        ++s;
        continue;
      }
      uint64_t sub_end = s;
      while (sub_end < end && table_.page_at(sub_end) != kNoPage && table_.page_at(sub_end) != target(sub_end)) {
        ++sub_end;
      }
      table_.unmap_run(s, sub_end - s);
      s = sub_end;
    }
    // 2. Map the target into every empty slot: the own page per slot, or the dummy run
    //    once per chunk (after step 1 a chunk holds the dummy run whole or nothing).
    if (to_dummy) {
      for (uint64_t c = first; c < end; c += per_chunk) {
        if (table_.page_at(c) == kNoPage) table_.map(c, static_cast<page_id_t>(dummy));
      }
    } else {
      for (s = first; s < end; ++s) {
        if (table_.page_at(s) == kNoPage) table_.map(s, static_cast<page_id_t>(target(s)));
      }
    }
    // 3. One access call over the run (none when every mapping there has access). Only
    //    the run's own slots: the calls never touch the trainer's other allocations.
    table_.grant_access(first, end);
  }
}

void GeneralArena::insert_free_run_locked(uint64_t first, uint64_t length) {
  auto next = free_runs_.lower_bound(first);
  if (next != free_runs_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      first = prev->first;
      length += prev->second;
      free_runs_.erase(prev);
    }
  }
  if (next != free_runs_.end() && next->first == first + length) {
    length += next->second;
    free_runs_.erase(next);
  }
  free_runs_[first] = length;
}

void GeneralArena::add_chunks_locked(const std::vector<ChunkRun>& runs) {
  const uint64_t per_chunk = geometry_.pages_per_chunk;
  for (const ChunkRun& run : runs) insert_free_run_locked(run.first * per_chunk, run.count * per_chunk);
}

void GeneralArena::remove_chunks_locked(const std::vector<ChunkRun>& runs) {
  const uint64_t per_chunk = geometry_.pages_per_chunk;
  // Check every run before changing any, so a broken invariant leaves nothing half-done.
  auto containing = [&](uint64_t first, uint64_t end) {
    auto it = free_runs_.upper_bound(first);
    if (it == free_runs_.begin() || std::prev(it)->first + std::prev(it)->second < end) {
      throw_internal("remove_chunks: pages [" + std::to_string(first) + ", " + std::to_string(end) +
                     ") of a reclaimed chunk are not all free");
    }
    return std::prev(it);
  };
  for (const ChunkRun& run : runs) containing(run.first * per_chunk, (run.first + run.count) * per_chunk);
  for (const ChunkRun& run : runs) {
    const uint64_t first = run.first * per_chunk;
    const uint64_t end = (run.first + run.count) * per_chunk;
    auto it = containing(first, end);
    const uint64_t run_first = it->first;
    const uint64_t run_end = it->first + it->second;
    free_runs_.erase(it);
    if (run_first < first) free_runs_[run_first] = first - run_first;
    if (end < run_end) free_runs_[end] = run_end - end;
  }
}

int64_t GeneralArena::allocate_locked(uint64_t num_pages) {
  auto best = free_runs_.end();
  for (auto it = free_runs_.begin(); it != free_runs_.end(); ++it) {
    if (it->second >= num_pages && (best == free_runs_.end() || it->second < best->second)) best = it;
  }
  if (best == free_runs_.end()) return -1;
  const uint64_t first = best->first;
  const uint64_t rest = best->second - num_pages;
  free_runs_.erase(best);
  if (rest > 0) free_runs_[first + num_pages] = rest;
  allocations_[first] = num_pages;
  for (uint64_t s = first; s < first + num_pages; ++s) ++used_pages_[s / geometry_.pages_per_chunk];
  used_pages_total_ += num_pages;
  return static_cast<int64_t>(first);
}

std::string GeneralArena::describe_address(va_t address) const {
  const va_t base = table_.base();
  if (address < base || address >= base + table_.bytes()) {
    return hex(address) + " is not in the general arena [" + hex(base) + ", " + hex(base + table_.bytes()) +
           ") (unknown pointer)";
  }
  const uint64_t offset = address - base;
  if (offset % geometry_.page_bytes != 0) {
    return hex(address) + " is not the start of an allocation (not page aligned; unknown pointer)";
  }
  const uint64_t s = offset / geometry_.page_bytes;
  auto inside = allocations_.upper_bound(s);
  if (inside != allocations_.begin()) {
    --inside;
    if (s < inside->first + inside->second) {
      return hex(address) + " points inside the allocation starting at " +
             hex(base + inside->first * geometry_.page_bytes) + " (unknown pointer; pass the allocation's start)";
    }
  }
  auto free_run = free_runs_.upper_bound(s);
  if (free_run != free_runs_.begin() && s < std::prev(free_run)->first + std::prev(free_run)->second) {
    return hex(address) + " is already free (double free)";
  }
  return hex(address) + " is in chunk " + std::to_string(s / geometry_.pages_per_chunk) +
         ", which is not lent (unknown pointer, or freed before its chunk was reclaimed: double free)";
}

ChunkRun GeneralArena::free_locked(va_t address, bool dry_run) {
  const va_t base = table_.base();
  auto it = allocations_.end();
  if (address >= base && address < base + table_.bytes() && (address - base) % geometry_.page_bytes == 0) {
    it = allocations_.find((address - base) / geometry_.page_bytes);
  }
  if (it == allocations_.end()) throw_invalid(describe_address(address));
  const uint64_t first = it->first;
  const uint64_t length = it->second;
  const uint64_t per_chunk = geometry_.pages_per_chunk;
  const ChunkRun chunks{first / per_chunk, (first + length - 1) / per_chunk - first / per_chunk + 1};
  if (dry_run) return chunks;
  allocations_.erase(it);
  for (uint64_t s = first; s < first + length; ++s) --used_pages_[s / per_chunk];
  used_pages_total_ -= length;
  insert_free_run_locked(first, length);
  return chunks;
}

void GeneralArena::add_fences_locked(const ChunkRun& chunks, const std::vector<FencePtr>& fences) {
  for (chunk_id_t chunk = chunks.first; chunk < chunks.first + chunks.count; ++chunk) {
    std::vector<FencePtr>& list = fences_[chunk];
    for (const FencePtr& fence : fences) {
      // A later event on the same stream implies the earlier one: keep one per stream.
      auto same_stream = std::find_if(list.begin(), list.end(),
                                      [&](const FencePtr& f) { return f->stream == fence->stream; });
      if (same_stream != list.end()) {
        *same_stream = fence;
      } else {
        list.push_back(fence);
      }
    }
  }
}

void GeneralArena::drop_fences_locked(chunk_id_t chunk, const std::vector<FencePtr>& passed) {
  std::vector<FencePtr>& list = fences_[chunk];
  auto has_passed = [&](const FencePtr& f) { return std::find(passed.begin(), passed.end(), f) != passed.end(); };
  list.erase(std::remove_if(list.begin(), list.end(), has_passed), list.end());
}

uint64_t GeneralArena::num_fences_locked() const {
  uint64_t total = 0;
  for (const auto& list : fences_) total += list.size();
  return total;
}

uint64_t GeneralArena::largest_free_run() const {
  uint64_t largest = 0;
  for (const auto& run : free_runs_) largest = std::max(largest, run.second);
  return largest;
}

void GeneralArena::check(const std::vector<int32_t>& chunk_states, std::string& violation) const {
  const uint64_t per_chunk = geometry_.pages_per_chunk;
  const uint64_t num_slots = table_.num_slots();
  // 0: not available, 1: free, 2: allocated. Every slot of a lent chunk must be 1 or 2
  // exactly once; no other slot may be either.
  std::vector<uint8_t> owner(num_slots, 0);
  std::vector<uint64_t> used(geometry_.num_chunks, 0);
  uint64_t previous_end = 0;
  bool first_run = true;
  for (const auto& [first, length] : free_runs_) {
    if (length == 0 || first + length > num_slots || (!first_run && first <= previous_end)) {
      violation = "general arena: free run [" + std::to_string(first) + ", +" + std::to_string(length) +
                  ") is empty, out of range, overlapping or not coalesced with its neighbour";
      return;
    }
    first_run = false;
    previous_end = first + length;
    for (uint64_t s = first; s < first + length; ++s) owner[s] = 1;
  }
  uint64_t used_total = 0;
  for (const auto& [first, length] : allocations_) {
    if (length == 0 || first + length > num_slots) {
      violation = "general arena: allocation at slot " + std::to_string(first) + " is empty or out of range";
      return;
    }
    for (uint64_t s = first; s < first + length; ++s) {
      if (owner[s] != 0) {
        violation = "general arena: page slot " + std::to_string(s) + " is in two places (allocation at slot " +
                    std::to_string(first) + (owner[s] == 1 ? " and a free run)" : " and another allocation)");
        return;
      }
      owner[s] = 2;
      ++used[s / per_chunk];
    }
    used_total += length;
  }
  if (used_total != used_pages_total_) {
    violation = "general arena: used-page total " + std::to_string(used_pages_total_) + " but allocations hold " +
                std::to_string(used_total);
    return;
  }
  for (chunk_id_t chunk = 0; chunk < geometry_.num_chunks; ++chunk) {
    const bool lent = chunk_states[chunk] == HVMM_CHUNK_LENT;
    if (used[chunk] != used_pages_[chunk]) {
      violation = "general arena: chunk " + std::to_string(chunk) + " counts " + std::to_string(used_pages_[chunk]) +
                  " used pages but allocations hold " + std::to_string(used[chunk]);
      return;
    }
    if (chunk_states[chunk] == HVMM_CHUNK_BROKEN) continue;
    if (!lent && !fences_[chunk].empty()) {
      violation = "general arena: chunk " + std::to_string(chunk) + " is not lent but has fences";
      return;
    }
    for (uint64_t page = 0; page < per_chunk; ++page) {
      const uint64_t s = chunk * per_chunk + page;
      if ((owner[s] != 0) != lent) {
        violation = "general arena: page slot " + std::to_string(s) + " of " + (lent ? "lent" : "unlent") +
                    " chunk " + std::to_string(chunk) + (lent ? " is neither free nor allocated" : " is in use");
        return;
      }
      // Lent: its own page, one mapping per page. Not lent: nothing (never lent) or the
      // arena's dummy run (reclaimed), one mapping over the whole chunk.
      const int64_t held = table_.page_at(s);
      const int64_t own = static_cast<int64_t>(geometry_.kv_page(chunk, page));
      const int64_t dummy = geometry_.arena_dummy();
      const uint64_t want_length = lent ? 1 : (page == 0 ? per_chunk : 0);
      const bool right_page = lent ? held == own : held == kNoPage || held == dummy;
      const bool right_mapping = held == kNoPage || table_.mapping_slots(s) == want_length;
      if (!right_page || !right_mapping || (held != kNoPage && !table_.accessible(s))) {
        violation = "general arena: slot " + std::to_string(s) + " holds page " + std::to_string(held) +
                    (held != kNoPage && !table_.accessible(s) ? " without access" : "") +
                    (right_mapping ? "" : " in a mapping of the wrong extent") + ", expected " +
                    (lent ? std::to_string(own)
                          : "none or the arena's dummy run " + std::to_string(dummy) + " over the chunk") +
                    " (chunk " + std::to_string(chunk) + " is " + (lent ? "lent" : "not lent") + ")";
        return;
      }
    }
  }
}

}  // namespace harvest::vmm
