#include "page_pool.h"

#include "errors.h"

namespace harvest::vmm {

PagePool::PagePool(Backend& backend, uint64_t num_pages) {
  pages_.reserve(num_pages);
  for (uint64_t i = 0; i < num_pages; ++i) pages_.emplace_back(backend);  // throws; made pages released
}

MappingTable::MappingTable(Backend& backend, const PagePool& pool, uint64_t num_slots)
    : backend_(backend),
      pool_(pool),
      page_bytes_(backend.page_bytes()),
      range_(backend, num_slots * backend.page_bytes()),
      page_(num_slots, kNoPage),
      accessible_(num_slots, 0) {}

MappingTable::~MappingTable() {
  uint64_t slot = 0;
  while (slot < page_.size()) {
    if (page_[slot] == kNoPage) {
      ++slot;
      continue;
    }
    uint64_t end = slot;
    while (end < page_.size() && page_[end] != kNoPage) ++end;
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
  for (uint64_t slot = first; slot < first + count; ++slot) {
    if (page_[slot] == kNoPage) {
      throw_internal(std::string(what) + ": slot " + std::to_string(slot) + " is not mapped");
    }
  }
}

void MappingTable::map(uint64_t slot, page_id_t page) {
  if (slot >= page_.size() || page_[slot] != kNoPage) {
    throw_internal("map: slot " + std::to_string(slot) + " is out of range or already mapped");
  }
  backend_.map(slot_address(slot), pool_.handle(page));
  page_[slot] = page;
  accessible_[slot] = 0;
}

void MappingTable::unmap_run(uint64_t first, uint64_t count) {
  check_run("unmap", first, count);
  backend_.unmap(slot_address(first), count * page_bytes_);
  for (uint64_t slot = first; slot < first + count; ++slot) {
    page_[slot] = kNoPage;
    accessible_[slot] = 0;
  }
}

void MappingTable::set_access_run(uint64_t first, uint64_t count) {
  check_run("set_access", first, count);
  backend_.set_access(slot_address(first), count * page_bytes_);
  for (uint64_t slot = first; slot < first + count; ++slot) accessible_[slot] = 1;
}

}  // namespace harvest::vmm
