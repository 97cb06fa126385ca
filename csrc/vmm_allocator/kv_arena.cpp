#include "kv_arena.h"

#include "errors.h"

namespace harvest::vmm {

KvArena::KvArena(Backend& backend, const PagePool& pool, const Geometry& geometry)
    : geometry_(geometry),
      table_(backend, pool, geometry.num_kv_pages()),
      slot_live_(geometry.token_capacity(), 0),
      live_per_chunk_(geometry.num_chunks, 0) {
  for (uint64_t s = 0; s < table_.num_slots(); ++s) table_.map(s, static_cast<page_id_t>(s));
  table_.set_access_run(0, table_.num_slots());
}

void KvArena::mark_slots_locked(const int64_t* slots, int64_t count, bool live,
                                const std::vector<int32_t>& chunk_states) {
  const uint64_t capacity = geometry_.token_capacity();
  auto undo = [&](int64_t applied) {
    for (int64_t j = 0; j < applied; ++j) {
      uint64_t s = static_cast<uint64_t>(slots[j]);
      slot_live_[s] = live ? 0 : 1;
      if (live) {
        --live_per_chunk_[s / geometry_.tokens_per_chunk];
        --total_live_;
      } else {
        ++live_per_chunk_[s / geometry_.tokens_per_chunk];
        ++total_live_;
      }
    }
  };
  for (int64_t i = 0; i < count; ++i) {
    const int64_t signed_slot = slots[i];
    std::string problem;
    if (signed_slot < 0 || static_cast<uint64_t>(signed_slot) >= capacity) {
      problem = "slot " + std::to_string(signed_slot) + " is out of range [0, " + std::to_string(capacity) + ")";
    } else {
      const uint64_t s = static_cast<uint64_t>(signed_slot);
      const chunk_id_t chunk = s / geometry_.tokens_per_chunk;
      if (live && chunk_states[chunk] != HVMM_CHUNK_MAPPED) {
        problem = "slot " + std::to_string(s) + " belongs to chunk " + std::to_string(chunk) + ", which is " +
                  chunk_state_name(chunk_states[chunk]) +
                  ": its KV pages are not (or soon not) mapped, so KV written there would be lost; reclaim (or "
                  "cancel the lend of) the chunk first";
      } else if (live && slot_live_[s]) {
        problem = "slot " + std::to_string(s) + " is already live (allocated twice?)";
      } else if (!live && !slot_live_[s]) {
        problem = "slot " + std::to_string(s) + " is not live (freed twice, or never marked live)";
      }
    }
    if (!problem.empty()) {
      undo(i);
      throw_invalid(problem + (i > 0 ? "; no slot of this call was changed" : ""));
    }
    const uint64_t s = static_cast<uint64_t>(signed_slot);
    slot_live_[s] = live ? 1 : 0;
    if (live) {
      ++live_per_chunk_[s / geometry_.tokens_per_chunk];
      ++total_live_;
    } else {
      --live_per_chunk_[s / geometry_.tokens_per_chunk];
      --total_live_;
    }
  }
}

void KvArena::converge_to_dummy(const std::vector<ChunkRun>& runs) { converge(runs, true); }

void KvArena::converge_to_pages(const std::vector<ChunkRun>& runs) { converge(runs, false); }

void KvArena::converge(const std::vector<ChunkRun>& runs, bool to_dummy) {
  if (runs.empty()) return;
  const int64_t dummy = geometry_.dummy_page();
  auto target = [&](uint64_t s) { return to_dummy ? dummy : static_cast<int64_t>(s); };
  for (uint64_t range = 0; range < geometry_.num_ranges(); ++range) {
    for (const ChunkRun& run : runs) {
      const uint64_t first = slot(run.first, range);
      const uint64_t end = first + run.count;
      // 1. Unmap what is there but should not be (one call per sub-run; normally the run).
      uint64_t s = first;
      while (s < end) {
        int64_t page = table_.page_at(s);
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
      // 2. Map the target page into every empty slot.
      for (s = first; s < end; ++s) {
        if (table_.page_at(s) == kNoPage) table_.map(s, static_cast<page_id_t>(target(s)));
      }
    }
  }
  // 3. Access for every new mapping, in one call from the runs' first slot in range 0 to
  //    their last in the last range. Between them lie other chunks' slots, each mapped
  //    (its page or the dummy: no KV slot is ever left empty outside a move), which makes
  //    the span "a fully mapped address range" as cuMemSetAccess requires; covering their
  //    mappings again grants the read/write they already have. Only an empty slot (a
  //    broken chunk's leftover) splits the call.
  const ChunkRun& last = runs.back();
  table_.grant_access(slot(runs.front().first, 0), slot(last.first + last.count - 1, geometry_.num_ranges() - 1) + 1);
}

void KvArena::check(const std::vector<int32_t>& chunk_states, std::string& violation) const {
  const int64_t dummy = geometry_.dummy_page();
  uint64_t total = 0;
  for (chunk_id_t chunk = 0; chunk < geometry_.num_chunks && violation.empty(); ++chunk) {
    const int32_t state = chunk_states[chunk];
    uint64_t live = 0;
    const uint64_t first_slot = chunk * geometry_.tokens_per_chunk;
    for (uint64_t t = 0; t < geometry_.tokens_per_chunk; ++t) live += slot_live_[first_slot + t];
    total += live;
    if (live != live_per_chunk_[chunk]) {
      violation = "chunk " + std::to_string(chunk) + ": live-slot count " + std::to_string(live_per_chunk_[chunk]) +
                  " but " + std::to_string(live) + " slots are live";
      return;
    }
    if (state == HVMM_CHUNK_BROKEN) continue;
    // A chunk being lent still backs its KV slots: its pages leave once its fences pass.
    const bool backs_kv = state == HVMM_CHUNK_MAPPED || state == HVMM_CHUNK_LENDING;
    if (!backs_kv && state != HVMM_CHUNK_LENT) {
      violation = "chunk " + std::to_string(chunk) + " is " + chunk_state_name(state) + " while no lend/reclaim runs";
      return;
    }
    if (state != HVMM_CHUNK_MAPPED && live != 0) {
      violation = std::string(chunk_state_name(state)) + " chunk " + std::to_string(chunk) + " has " +
                  std::to_string(live) + " live slots";
      return;
    }
    for (uint64_t range = 0; range < geometry_.num_ranges(); ++range) {
      const uint64_t s = slot(chunk, range);
      const int64_t want = backs_kv ? static_cast<int64_t>(s) : dummy;
      if (table_.page_at(s) != want || !table_.accessible(s)) {
        violation = "KV range " + std::to_string(range) + " at chunk " + std::to_string(chunk) + " (" +
                    chunk_state_name(state) + ") holds page " + std::to_string(table_.page_at(s)) +
                    (table_.accessible(s) ? "" : " without access") + ", expected page " + std::to_string(want);
        return;
      }
    }
  }
  if (violation.empty() && total != total_live_) {
    violation = "total live slots " + std::to_string(total_live_) + " but chunks add up to " + std::to_string(total);
  }
}

}  // namespace harvest::vmm
