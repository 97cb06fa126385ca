#include "small_pool.h"

#include <algorithm>

#include "errors.h"

namespace harvest::vmm {

SmallPool::SmallPool(Backend& backend, const PagePool& pool, const Geometry& geometry, page_id_t first_page,
                     uint64_t num_pages)
    : geometry_(geometry), table_(backend, pool, num_pages) {
  const uint64_t blocks_per_page = geometry.page_bytes / kBlockBytes;
  while ((1ull << top_order_) < blocks_per_page) ++top_order_;
  num_blocks_ = num_pages * blocks_per_page;
  if (num_blocks_ >= (1ull << 31)) throw_invalid("small_pool_bytes is too large (more than 2^31 blocks of 2 KiB)");
  for (uint64_t i = 0; i < num_pages; ++i) table_.map(i, static_cast<page_id_t>(first_page + i));
  table_.set_access_run(0, num_pages);
  next_.assign(num_blocks_, -1);
  prev_.assign(num_blocks_, -1);
  order_.assign(num_blocks_, 0);
  state_.assign(num_blocks_, kInterior);
  requested_.assign(num_blocks_, 0);
  free_head_.assign(top_order_ + 1, -1);
  for (uint64_t page = num_pages; page-- > 0;) {
    const int32_t head = static_cast<int32_t>(page * blocks_per_page);
    state_[head] = kFreeHead;
    order_[head] = static_cast<uint8_t>(top_order_);
    push_locked(head, top_order_);
  }
}

void SmallPool::push_locked(int32_t block, int order) {
  const int32_t head = free_head_[order];
  next_[block] = head;
  prev_[block] = -1;
  if (head != -1) prev_[head] = block;
  free_head_[order] = block;
  nonempty_orders_ |= 1ull << order;
}

void SmallPool::unlink_locked(int32_t block, int order) {
  const int32_t before = prev_[block];
  const int32_t after = next_[block];
  if (before != -1) {
    next_[before] = after;
  } else {
    free_head_[order] = after;
  }
  if (after != -1) prev_[after] = before;
  if (free_head_[order] == -1) nonempty_orders_ &= ~(1ull << order);
}

va_t SmallPool::allocate(int64_t num_bytes) {
  if (num_bytes <= 0) {
    throw_invalid("num_bytes=" + std::to_string(num_bytes) + " must be positive");
  }
  if (static_cast<uint64_t>(num_bytes) >= geometry_.page_bytes) {
    throw_invalid("num_bytes=" + std::to_string(num_bytes) + " is not under one page (" +
                  std::to_string(geometry_.page_bytes) + " bytes); allocate it from the general arena");
  }
  if (pending_count_.load(std::memory_order_relaxed) != 0) collect_passed();
  const uint64_t blocks = (static_cast<uint64_t>(num_bytes) + kBlockBytes - 1) / kBlockBytes;
  const int order = blocks <= 1 ? 0 : 64 - __builtin_clzll(blocks - 1);
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t candidates = nonempty_orders_ >> order;
  if (candidates == 0) return 0;
  int current = order + __builtin_ctzll(candidates);
  const int32_t block = free_head_[current];
  unlink_locked(block, current);
  while (current > order) {
    --current;
    const int32_t buddy = block + (1 << current);
    state_[buddy] = kFreeHead;
    order_[buddy] = static_cast<uint8_t>(current);
    push_locked(buddy, current);
  }
  state_[block] = kUsedHead;
  order_[block] = static_cast<uint8_t>(order);
  requested_[block] = static_cast<uint64_t>(num_bytes);
  used_bytes_ += kBlockBytes << order;
  requested_bytes_ += static_cast<uint64_t>(num_bytes);
  ++allocations_;
  return table_.base() + static_cast<uint64_t>(block) * kBlockBytes;
}

int32_t SmallPool::used_block_locked(va_t address) const {
  const va_t base = table_.base();
  if (address < base || address >= base + table_.bytes()) {
    throw_invalid(hex(address) + " is not in the small pool [" + hex(base) + ", " +
                  hex(base + table_.bytes()) + ") (unknown pointer)");
  }
  if ((address - base) % kBlockBytes != 0) {
    throw_invalid(hex(address) + " is not at a 2 KiB block start (unknown pointer)");
  }
  const int32_t block = static_cast<int32_t>((address - base) / kBlockBytes);
  if (state_[block] == kFreeHead) throw_invalid(hex(address) + " is already free (double free)");
  if (state_[block] == kPendingHead) {
    throw_invalid(hex(address) + " is already free (double free; it waits for the fences of its free)");
  }
  if (state_[block] != kUsedHead) {
    throw_invalid(hex(address) + " is inside a block, not an allocation's start (unknown pointer)");
  }
  return block;
}

void SmallPool::check_free(va_t address) const {
  std::lock_guard<std::mutex> lock(mu_);
  used_block_locked(address);
}

void SmallPool::free(va_t address) { free_fenced(address, {}); }

void SmallPool::free_fenced(va_t address, std::vector<FencePtr> fences) {
  std::lock_guard<std::mutex> lock(mu_);
  const int32_t block = used_block_locked(address);
  const uint64_t size = kBlockBytes << order_[block];
  if (fences.empty()) {
    used_bytes_ -= size;
    requested_bytes_ -= requested_[block];
    --allocations_;
    release_locked(block);
    return;
  }
  pending_.push_back({block, std::move(fences)});  // may throw: nothing changed yet
  used_bytes_ -= size;
  requested_bytes_ -= requested_[block];
  --allocations_;
  state_[block] = kPendingHead;
  pending_bytes_ += size;
  pending_count_.store(pending_.size(), std::memory_order_relaxed);
}

uint64_t SmallPool::collect_passed() {
  uint64_t collected = 0;
  for (;;) {
    int32_t block = -1;
    std::vector<FencePtr> fences;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pending_.empty()) break;
      block = pending_.front().block;
      fences = pending_.front().fences;  // queried below, without the pool's mutex
    }
    if (!all_passed(fences)) break;
    std::lock_guard<std::mutex> lock(mu_);
    // Another thread may have collected it meanwhile; only the front entry is ours to take.
    if (pending_.empty() || pending_.front().block != block) continue;
    pending_.pop_front();
    pending_bytes_ -= kBlockBytes << order_[block];
    pending_count_.store(pending_.size(), std::memory_order_relaxed);
    release_locked(block);
    ++collected;
  }
  return collected;
}

void SmallPool::release_locked(int32_t block) {
  int order = order_[block];
  while (order < top_order_) {
    const int32_t buddy = block ^ (1 << order);
    if (state_[buddy] != kFreeHead || order_[buddy] != order) break;
    unlink_locked(buddy, order);
    state_[std::max(block, buddy)] = kInterior;
    block = std::min(block, buddy);
    ++order;
  }
  state_[block] = kFreeHead;
  order_[block] = static_cast<uint8_t>(order);
  push_locked(block, order);
}

SmallPool::Usage SmallPool::usage() const {
  std::lock_guard<std::mutex> lock(mu_);
  Usage usage;
  usage.used_bytes = used_bytes_;
  usage.requested_bytes = requested_bytes_;
  usage.allocations = allocations_;
  usage.largest_free_bytes = nonempty_orders_ == 0 ? 0 : kBlockBytes << (63 - __builtin_clzll(nonempty_orders_));
  usage.pending_frees = pending_.size();
  usage.pending_bytes = pending_bytes_;
  return usage;
}

void SmallPool::check(std::string& violation) const {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t blocks_per_page = 1ull << top_order_;
  std::vector<uint64_t> free_per_order(top_order_ + 1, 0);
  uint64_t used = 0;
  uint64_t requested = 0;
  uint64_t allocations = 0;
  uint64_t pending = 0;
  uint64_t pending_heads = 0;
  for (uint64_t s = 0; s < table_.num_slots(); ++s) {
    if (!table_.accessible(s)) {
      violation = "small pool: page slot " + std::to_string(s) + " is not mapped with access";
      return;
    }
  }
  // Walk each page's blocks head by head: they must tile the page exactly.
  for (uint64_t b = 0; b < num_blocks_;) {
    const int order = order_[b];
    const uint64_t size = 1ull << order;
    const bool fits_page = (b % blocks_per_page) + size <= blocks_per_page;
    if (state_[b] == kInterior || order > top_order_ || b % size != 0 || !fits_page) {
      violation = "small pool: block " + std::to_string(b) + " is not a well-formed head (state " +
                  std::to_string(state_[b]) + ", order " + std::to_string(order) + ")";
      return;
    }
    for (uint64_t inner = b + 1; inner < b + size; ++inner) {
      if (state_[inner] != kInterior) {
        violation = "small pool: block " + std::to_string(inner) + " is a head inside block " + std::to_string(b);
        return;
      }
    }
    if (state_[b] == kFreeHead) {
      ++free_per_order[order];
      const uint64_t buddy = b ^ size;
      if (order < top_order_ && state_[buddy] == kFreeHead && order_[buddy] == order) {
        violation = "small pool: free buddies " + std::to_string(b) + " and " + std::to_string(buddy) +
                    " were not merged";
        return;
      }
    } else if (state_[b] == kPendingHead) {
      pending += kBlockBytes << order;
      ++pending_heads;
    } else {
      used += kBlockBytes << order;
      requested += requested_[b];
      ++allocations;
    }
    b += size;
  }
  uint64_t listed_pending = 0;
  for (const PendingFree& entry : pending_) {
    if (entry.block < 0 || static_cast<uint64_t>(entry.block) >= num_blocks_ || state_[entry.block] != kPendingHead ||
        entry.fences.empty()) {
      violation = "small pool: waiting free of block " + std::to_string(entry.block) +
                  " is not a pending block with fences";
      return;
    }
    ++listed_pending;
  }
  if (listed_pending != pending_heads || pending != pending_bytes_ || pending_count_.load() != pending_.size()) {
    violation = "small pool: " + std::to_string(pending_heads) + " blocks (" + std::to_string(pending) +
                " bytes) wait for fences but the queue lists " + std::to_string(listed_pending) + " (" +
                std::to_string(pending_bytes_) + " bytes)";
    return;
  }
  if (used != used_bytes_ || requested != requested_bytes_ || allocations != allocations_) {
    violation = "small pool: counters (used " + std::to_string(used_bytes_) + ", requested " +
                std::to_string(requested_bytes_) + ", allocations " + std::to_string(allocations_) +
                ") do not match the blocks (" + std::to_string(used) + ", " + std::to_string(requested) + ", " +
                std::to_string(allocations) + ")";
    return;
  }
  uint64_t free_bytes = 0;
  for (int k = 0; k <= top_order_; ++k) free_bytes += free_per_order[k] * (kBlockBytes << k);
  if (used + pending + free_bytes != table_.bytes()) {
    violation = "small pool: used + waiting + free bytes do not add up to the pool size";
    return;
  }
  for (int k = 0; k <= top_order_; ++k) {
    uint64_t listed = 0;
    int32_t previous = -1;
    for (int32_t b = free_head_[k]; b != -1; b = next_[b]) {
      if (state_[b] != kFreeHead || order_[b] != k || prev_[b] != previous || ++listed > free_per_order[k]) {
        violation = "small pool: free list of order " + std::to_string(k) + " is corrupt at block " + std::to_string(b);
        return;
      }
      previous = b;
    }
    if (listed != free_per_order[k] || ((nonempty_orders_ >> k) & 1) != (listed != 0 ? 1u : 0u)) {
      violation = "small pool: free list of order " + std::to_string(k) + " holds " + std::to_string(listed) +
                  " blocks, expected " + std::to_string(free_per_order[k]) + " (or its non-empty bit is wrong)";
      return;
    }
  }
}

}  // namespace harvest::vmm
