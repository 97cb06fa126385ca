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
                  ": its pages are (or are about to be) the trainer's, so KV written there would be lost "
                  "and would corrupt the trainer's tensors; reclaim (or cancel the lend of) the chunk first";
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

void KvArena::check(const std::vector<int32_t>& chunk_states, std::string& violation) const {
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
    if (state == HVMM_CHUNK_BUSY) {  // check_integrity holds the remap mutex: no move runs
      violation = "chunk " + std::to_string(chunk) + " is busy while no lend/reclaim runs";
      return;
    }
    // Only a mapped chunk's slots may be live: a lending chunk's pages are about to be
    // the trainer's, a lent, busy or broken chunk's are (or may be).
    if (state != HVMM_CHUNK_MAPPED && live != 0) {
      violation = std::string(chunk_state_name(state)) + " chunk " + std::to_string(chunk) + " has " +
                  std::to_string(live) + " live slots";
      return;
    }
    // Whatever the chunk's state, its slices hold its own pages: the KV side never moves.
    for (uint64_t range = 0; range < geometry_.num_ranges(); ++range) {
      const uint64_t s = slot(chunk, range);
      if (table_.page_at(s) != static_cast<int64_t>(s) || !table_.accessible(s)) {
        violation = "KV range " + std::to_string(range) + " at chunk " + std::to_string(chunk) + " (" +
                    chunk_state_name(state) + ") holds page " + std::to_string(table_.page_at(s)) +
                    (table_.accessible(s) ? "" : " without access") + ", expected page " + std::to_string(s);
        return;
      }
    }
  }
  if (violation.empty() && total != total_live_) {
    violation = "total live slots " + std::to_string(total_live_) + " but chunks add up to " + std::to_string(total);
  }
}

}  // namespace harvest::vmm
