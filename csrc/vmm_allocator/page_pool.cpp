#include "page_pool.h"

#include "errors.h"

namespace harvest::vmm {

PagePool::PagePool(Backend& backend, uint64_t num_pages, uint64_t wide_page, uint64_t wide_pages) {
  pages_.reserve(num_pages);
  for (uint64_t i = 0; i < num_pages; ++i) {
    pages_.emplace_back(backend, i == wide_page ? wide_pages : 1);  // throws; made pages released
  }
}

MappingTable::MappingTable(Backend& backend, const PagePool& pool, uint64_t num_slots)
    : backend_(backend),
      pool_(pool),
      page_bytes_(backend.page_bytes()),
      range_(backend, num_slots * backend.page_bytes()),
      page_(num_slots, kNoPage),
      length_(num_slots, 0),
      accessible_(num_slots, 0) {}

MappingTable::~MappingTable() {
  uint64_t slot = 0;
  while (slot < page_.size()) {
    if (length_[slot] == 0) {  // empty (a mapping always starts at its first slot)
      ++slot;
      continue;
    }
    uint64_t end = slot;
    while (end < page_.size() && length_[end] != 0) end += length_[end];
    try {
      backend_.unmap(slot_address(slot), (end - slot) * page_bytes_);
    } catch (const std::exception& e) {
      log_warning(std::string("unmapping at teardown: ") + e.what());
    }
    slot = end;
  }
}

void MappingTable::check_run(const char* what, uint64_t first, uint64_t count) const {
  if (count == 0 || first + count > page_.size()) {
    throw_internal(std::string(what) + ": slot run [" + std::to_string(first) + ", +" + std::to_string(count) +
                   ") outside the table of " + std::to_string(page_.size()));
  }
  uint64_t slot = first;
  while (slot < first + count) {
    if (length_[slot] == 0) {
      throw_internal(std::string(what) + ": slot " + std::to_string(slot) +
                     (page_[slot] == kNoPage ? " is not mapped" : " is inside a mapping that starts before it"));
    }
    slot += length_[slot];
  }
  if (slot != first + count) {
    throw_internal(std::string(what) + ": slot run [" + std::to_string(first) + ", +" + std::to_string(count) +
                   ") ends inside a mapping");
  }
}

void MappingTable::map(uint64_t slot, page_id_t page) {
  const uint64_t count = pool_.pages_of(page);
  bool empty = slot + count <= page_.size();
  for (uint64_t s = slot; empty && s < slot + count; ++s) empty = page_[s] == kNoPage;
  if (!empty) {
    throw_internal("map: slots [" + std::to_string(slot) + ", +" + std::to_string(count) +
                   ") are out of range or not all empty");
  }
  backend_.map(slot_address(slot), pool_.handle(page), count * page_bytes_);
  for (uint64_t s = slot; s < slot + count; ++s) {
    page_[s] = page;
    accessible_[s] = 0;
  }
  length_[slot] = static_cast<uint32_t>(count);
}

void MappingTable::unmap_run(uint64_t first, uint64_t count) {
  check_run("unmap", first, count);
  backend_.unmap(slot_address(first), count * page_bytes_);
  for (uint64_t slot = first; slot < first + count; ++slot) {
    page_[slot] = kNoPage;
    length_[slot] = 0;
    accessible_[slot] = 0;
  }
}

void MappingTable::set_access_run(uint64_t first, uint64_t count) {
  check_run("set_access", first, count);
  backend_.set_access(slot_address(first), count * page_bytes_);
  for (uint64_t slot = first; slot < first + count; ++slot) accessible_[slot] = 1;
}

uint64_t MappingTable::grant_access(uint64_t first, uint64_t end) {
  uint64_t calls = 0;
  uint64_t stretch = 0;       // first slot of the current stretch
  uint64_t needed_end = 0;    // end of its last mapping without access; 0: none yet
  auto flush = [&] {
    if (needed_end != 0) {
      set_access_run(stretch, needed_end - stretch);
      ++calls;
    }
    needed_end = 0;
  };
  uint64_t slot = first;
  while (slot < end) {
    if (length_[slot] == 0) {  // an empty slot ends the stretch (the driver refuses a hole)
      if (page_[slot] != kNoPage) throw_internal("grant_access: slot " + std::to_string(slot) + " cuts a mapping");
      flush();
      ++slot;
      continue;
    }
    const uint64_t next = slot + length_[slot];
    if (!accessible_[slot]) {
      if (needed_end == 0) stretch = slot;
      needed_end = next;
    } else if (needed_end == 0) {
      stretch = next;  // nothing to grant yet: leading accessible mappings stay out
    }
    slot = next;
  }
  if (slot != end) throw_internal("grant_access: the run ends inside a mapping");
  flush();
  return calls;
}

}  // namespace harvest::vmm
