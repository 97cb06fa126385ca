// backend.cpp — call counting, failure injection, the call log, the fence-event pool and
// the RAII handle types shared by both backends.
#include "backend.h"

#include "errors.h"

namespace harvest::vmm {

const char* call_kind_name(CallKind kind) {
  static const char* const kNames[kNumCallKinds] = {
      "reserve", "free_range", "create", "release", "map", "unmap",
      "set_access", "event_create", "fence_record", "fence_query", "fence_wait",
  };
  int index = static_cast<int>(kind);
  return index >= 0 && index < kNumCallKinds ? kNames[index] : "unknown";
}

void Backend::inject_failure(CallKind kind, int64_t after_calls) {
  fail_after_[static_cast<int>(kind)].store(after_calls < 0 ? -1 : after_calls);
  bool any = false;
  for (const auto& remaining : fail_after_) any = any || remaining.load() >= 0;
  any_injection_.store(any);
}

void Backend::before_call(CallKind kind) {
  counts_[static_cast<int>(kind)].fetch_add(1, std::memory_order_relaxed);
  if (!any_injection_.load(std::memory_order_relaxed)) return;
  std::atomic<int64_t>& remaining = fail_after_[static_cast<int>(kind)];
  int64_t now = remaining.load();
  if (now < 0) return;
  if (now > 0) {
    remaining.store(now - 1);
    return;
  }
  inject_failure(kind, -1);
  throw Error(failure_status(), std::string(call_text(kind)) +
                                    " failed: injected failure (hvmm_debug_inject_failure, " +
                                    call_kind_name(kind) + ")");
}

void Backend::log_call(const CallRecord& record) {
  if (!logging_.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(log_mu_);
  log_.push_back(record);
}

void Backend::record_calls(bool on) {
  std::lock_guard<std::mutex> lock(log_mu_);
  if (on) log_.clear();
  logging_.store(on);
}

std::vector<CallRecord> Backend::call_log() const {
  std::lock_guard<std::mutex> lock(log_mu_);
  return log_;
}

void Backend::hold_fences(bool) {
  throw_invalid(std::string("holding fences is a test hook of the host backend; the ") + name() +
                " backend's fences pass when the GPU gets there");
}

va_t Backend::reserve(uint64_t bytes) {
  before_call(CallKind::kReserve);
  const va_t va = do_reserve(bytes);
  log_call({CallKind::kReserve, 0, va, bytes, 0, 0});
  return va;
}

void Backend::free_range(va_t va, uint64_t bytes) {
  before_call(CallKind::kFreeRange);
  do_free_range(va, bytes);
  log_call({CallKind::kFreeRange, 0, va, bytes, 0, 0});
}

phys_handle_t Backend::create_page(uint64_t pages) {
  if (pages == 0) throw_internal("create_page: an allocation of 0 pages");
  before_call(CallKind::kCreate);
  const phys_handle_t page = do_create_page(pages * page_bytes_);
  log_call({CallKind::kCreate, 0, 0, pages * page_bytes_, 0, 0});
  return page;
}

void Backend::release_page(phys_handle_t page) {
  before_call(CallKind::kRelease);
  do_release_page(page);
  log_call({CallKind::kRelease, 0, 0, page_bytes_, 0, 0});
}

void Backend::map(va_t va, phys_handle_t page, uint64_t bytes) {
  before_call(CallKind::kMap);
  do_map(va, page, bytes);
  log_call({CallKind::kMap, 0, va, bytes, 0, 0});
}

void Backend::unmap(va_t va, uint64_t bytes) {
  before_call(CallKind::kUnmap);
  do_unmap(va, bytes);
  log_call({CallKind::kUnmap, 0, va, bytes, 0, 0});
}

void Backend::set_access(va_t va, uint64_t bytes) {
  before_call(CallKind::kSetAccess);
  do_set_access(va, bytes);
  log_call({CallKind::kSetAccess, 0, va, bytes, 0, 0});
}

event_t Backend::record_fence(stream_t stream) {
  event_t event = 0;
  {
    std::lock_guard<std::mutex> lock(event_pool_mu_);
    if (!event_pool_.empty()) {
      event = event_pool_.back();
      event_pool_.pop_back();
    }
  }
  if (event == 0) {
    before_call(CallKind::kEventCreate);
    event = do_create_event();
    log_call({CallKind::kEventCreate, 0, 0, 0, 0, event});
  }
  try {
    before_call(CallKind::kFenceRecord);
    do_record_fence(event, stream);
  } catch (...) {
    release_fence(event);
    throw;
  }
  log_call({CallKind::kFenceRecord, 0, 0, 0, stream, event});
  return event;
}

bool Backend::fence_passed(event_t event) {
  before_call(CallKind::kFenceQuery);
  const bool passed = do_fence_passed(event);
  log_call({CallKind::kFenceQuery, passed ? 1 : 0, 0, 0, 0, event});
  return passed;
}

void Backend::wait_fence(event_t event) {
  before_call(CallKind::kFenceWait);
  do_wait_fence(event);
  log_call({CallKind::kFenceWait, 0, 0, 0, 0, event});
}

void Backend::release_fence(event_t event) noexcept {
  try {
    std::lock_guard<std::mutex> lock(event_pool_mu_);
    event_pool_.push_back(event);
  } catch (...) {
    do_destroy_event(event);  // out of memory for the pool: drop it instead
  }
}

void Backend::destroy_pooled_events() noexcept {
  std::lock_guard<std::mutex> lock(event_pool_mu_);
  for (event_t event : event_pool_) do_destroy_event(event);
  event_pool_.clear();
}

std::vector<FencePtr> record_fences(Backend& backend, const std::vector<stream_t>& streams) {
  std::vector<FencePtr> fences;
  fences.reserve(streams.size());
  for (stream_t stream : streams) {
    const event_t event = backend.record_fence(stream);
    try {
      fences.push_back(std::make_shared<Fence>(backend, stream, event));
    } catch (...) {
      backend.release_fence(event);  // no Fence owns it yet
      throw;
    }
  }
  return fences;
}

bool all_passed(const std::vector<FencePtr>& fences) {
  for (const FencePtr& fence : fences) {
    if (!fence->backend.fence_passed(fence->event)) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------- RAII

VaRange::VaRange(Backend& backend, uint64_t bytes) : backend_(&backend), bytes_(bytes) {
  base_ = backend.reserve(bytes);
}

VaRange::VaRange(VaRange&& other) noexcept
    : backend_(other.backend_), base_(other.base_), bytes_(other.bytes_) {
  other.backend_ = nullptr;
}

VaRange& VaRange::operator=(VaRange&& other) noexcept {
  if (this != &other) {
    reset();
    backend_ = other.backend_;
    base_ = other.base_;
    bytes_ = other.bytes_;
    other.backend_ = nullptr;
  }
  return *this;
}

VaRange::~VaRange() { reset(); }

void VaRange::reset() noexcept {
  if (backend_ == nullptr) return;
  try {
    backend_->free_range(base_, bytes_);
  } catch (const std::exception& e) {
    log_warning(std::string("releasing a virtual range: ") + e.what());
  }
  backend_ = nullptr;
}

PhysPage::PhysPage(Backend& backend, uint64_t pages) : backend_(&backend), pages_(pages) {
  handle_ = backend.create_page(pages);
}

PhysPage::PhysPage(PhysPage&& other) noexcept
    : backend_(other.backend_), handle_(other.handle_), pages_(other.pages_) {
  other.backend_ = nullptr;
}

PhysPage& PhysPage::operator=(PhysPage&& other) noexcept {
  if (this != &other) {
    reset();
    backend_ = other.backend_;
    handle_ = other.handle_;
    pages_ = other.pages_;
    other.backend_ = nullptr;
  }
  return *this;
}

PhysPage::~PhysPage() { reset(); }

void PhysPage::reset() noexcept {
  if (backend_ == nullptr) return;
  try {
    backend_->release_page(handle_);
  } catch (const std::exception& e) {
    log_warning(std::string("releasing a physical page: ") + e.what());
  }
  backend_ = nullptr;
}

}  // namespace harvest::vmm
