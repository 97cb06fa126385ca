// backend_host.cpp — the VMM semantics on host memory, for CPU runs and the test suite.
//
// Physical allocations are page-multiple pieces of one memfd (committed with fallocate
// at creation, as cuMemCreate commits device memory). A reserved range is an anonymous
// PROT_NONE mapping; mapping an allocation replaces part of it with a
// MAP_SHARED|MAP_FIXED view of the memfd, so the same physical page can appear at several
// addresses exactly as on the device. Unmapping puts a PROT_NONE placeholder back (the
// range stays reserved; munmap would hand the addresses to the next mmap).
//
// The kernel would accept calls the CUDA driver refuses (MAP_FIXED silently replaces a
// mapping, mprotect over a PROT_NONE placeholder succeeds), so this backend keeps its own
// table of reservations, allocations and mappings and refuses, with EINVAL naming the
// rule, what cuda.h says the driver refuses: a map outside a reservation, over a mapped
// address or longer than its allocation; an unmap or set_access that does not cover
// whole mappings without a hole ("a fully mapped address range"; cuMemUnmap "cannot
// unmap a sub-range"). Like the driver, a fresh mapping has no access (PROT_NONE) until
// set_access.
//
// Host work is synchronous, so a fence has passed as soon as it is recorded, except while
// a test holds fences (hold_fences): then fences stay pending until released, as events
// on a GPU stream still busy with queued kernels do, so the paths that poll or wait on
// fences run on CPU too.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "backend.h"
#include "errors.h"

namespace harvest::vmm {
namespace {

constexpr uint64_t kDefaultHostPageBytes = 2ull << 20;  // the CUDA granularity

class HostBackend final : public Backend {
 public:
  HostBackend(int memfd, uint64_t page_bytes) : Backend(page_bytes), memfd_(memfd) {}

  ~HostBackend() override {
    destroy_pooled_events();
    if (::close(memfd_) != 0) log_warning(describe_errno("close(memfd)", errno));
  }

  const char* name() const override { return "host"; }

 protected:
  int failure_status() const override { return HVMM_ERR_OS; }

  const char* call_text(CallKind kind) const override {
    switch (kind) {
      case CallKind::kReserve: return "mmap(PROT_NONE reservation)";
      case CallKind::kFreeRange: return "munmap(reservation)";
      case CallKind::kCreate: return "fallocate(memfd page)";
      case CallKind::kRelease: return "fallocate(PUNCH_HOLE memfd page)";
      case CallKind::kMap: return "mmap(MAP_SHARED|MAP_FIXED memfd page)";
      case CallKind::kUnmap: return "mmap(MAP_FIXED PROT_NONE placeholder)";
      case CallKind::kSetAccess: return "mprotect(PROT_READ|PROT_WRITE)";
      default: return "host fence";
    }
  }

  va_t do_reserve(uint64_t bytes) override {
    // Aligned to the page, as cuMemAddressReserve(alignment = page) is: reserve one page
    // more, then give back the unaligned head and the tail.
    const uint64_t align = page_bytes();
    void* p = ::mmap(nullptr, bytes + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw Error(HVMM_ERR_OS, describe_errno(std::string(call_text(CallKind::kReserve)) + " of " +
                                                  std::to_string(bytes) + " bytes",
                                              errno));
    }
    const va_t raw = reinterpret_cast<va_t>(p);
    const va_t va = (raw + align - 1) / align * align;
    if (va > raw) ::munmap(p, va - raw);
    if (raw + align > va) ::munmap(reinterpret_cast<void*>(va + bytes), raw + align - va);
    std::lock_guard<std::mutex> lock(table_mu_);
    reservations_[va] = bytes;
    return va;
  }

  void do_free_range(va_t va, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(table_mu_);
    auto it = reservations_.find(va);
    if (it == reservations_.end() || it->second != bytes) {
      refuse(CallKind::kFreeRange, va, "not a reservation of " + std::to_string(bytes) + " bytes");
    }
    if (::munmap(reinterpret_cast<void*>(va), bytes) != 0) {
      throw Error(HVMM_ERR_OS, describe_errno(call_text(CallKind::kFreeRange), errno));
    }
    // Mappings still inside (a teardown after a failed unmap) go with the addresses.
    mappings_.erase(mappings_.lower_bound(va), mappings_.lower_bound(va + bytes));
    reservations_.erase(it);
  }

  phys_handle_t do_create_page(uint64_t bytes) override {
    uint64_t offset = next_offset_.fetch_add(bytes);
    if (::fallocate(memfd_, 0, static_cast<off_t>(offset), static_cast<off_t>(bytes)) != 0) {
      throw Error(HVMM_ERR_OS, describe_errno(std::string(call_text(CallKind::kCreate)) + " at offset " +
                                                  std::to_string(offset),
                                              errno));
    }
    std::lock_guard<std::mutex> lock(table_mu_);
    allocations_[offset] = bytes;
    return offset;
  }

  void do_release_page(phys_handle_t page) override {
    uint64_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(table_mu_);
      auto it = allocations_.find(page);
      if (it == allocations_.end()) refuse(CallKind::kRelease, page, "not a live allocation");
      bytes = it->second;
      allocations_.erase(it);
    }
    if (::fallocate(memfd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(page),
                    static_cast<off_t>(bytes)) != 0) {
      throw Error(HVMM_ERR_OS, describe_errno(call_text(CallKind::kRelease), errno));
    }
  }

  void do_map(va_t va, phys_handle_t page, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(table_mu_);
    check_aligned(CallKind::kMap, va, bytes);
    auto allocation = allocations_.find(page);
    if (allocation == allocations_.end()) refuse(CallKind::kMap, va, "handle is not a live allocation");
    if (bytes > allocation->second) {
      refuse(CallKind::kMap, va, std::to_string(bytes) + " bytes of an allocation of " +
                                     std::to_string(allocation->second));
    }
    check_reserved(CallKind::kMap, va, bytes);
    auto next = mappings_.lower_bound(va);
    const bool overlaps_next = next != mappings_.end() && next->first < va + bytes;
    const bool overlaps_prev = next != mappings_.begin() && std::prev(next)->first + std::prev(next)->second > va;
    if (overlaps_next || overlaps_prev) {
      refuse(CallKind::kMap, va, "something is already mapped in [" + hex(va) + ", " + hex(va + bytes) +
                                     ") (cuMemMap maps only where nothing is mapped)");
    }
    void* p = ::mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, memfd_,
                     static_cast<off_t>(page));
    if (p == MAP_FAILED) {
      throw Error(HVMM_ERR_OS, describe_errno(std::string(call_text(CallKind::kMap)) + " at " + hex(va), errno));
    }
    mappings_[va] = bytes;
  }

  void do_unmap(va_t va, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(table_mu_);
    check_whole_mappings(CallKind::kUnmap, va, bytes);
    void* p = ::mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw Error(HVMM_ERR_OS, describe_errno(std::string(call_text(CallKind::kUnmap)) + " at " + hex(va), errno));
    }
    mappings_.erase(mappings_.lower_bound(va), mappings_.lower_bound(va + bytes));
  }

  void do_set_access(va_t va, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(table_mu_);
    check_whole_mappings(CallKind::kSetAccess, va, bytes);
    if (::mprotect(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE) != 0) {
      throw Error(HVMM_ERR_OS,
                  describe_errno(std::string(call_text(CallKind::kSetAccess)) + " at " + hex(va), errno));
    }
  }

  event_t do_create_event() override { return next_event_.fetch_add(1); }
  void do_destroy_event(event_t) noexcept override {}

  void do_record_fence(event_t event, stream_t) override {
    std::lock_guard<std::mutex> lock(fence_mu_);
    if (held_) {
      pending_.insert(event);
    } else {
      pending_.erase(event);  // a recycled event recorded again
    }
  }

  bool do_fence_passed(event_t event) override {
    std::lock_guard<std::mutex> lock(fence_mu_);
    return pending_.count(event) == 0;
  }

  void do_wait_fence(event_t event) override {
    std::unique_lock<std::mutex> lock(fence_mu_);
    fence_passed_.wait(lock, [&] { return pending_.count(event) == 0; });
  }

 public:
  void hold_fences(bool held) override {
    {
      std::lock_guard<std::mutex> lock(fence_mu_);
      held_ = held;
      if (!held) pending_.clear();
    }
    if (!held) fence_passed_.notify_all();
  }

 private:
  // The driver's refusal (CUDA_ERROR_INVALID_VALUE) as this backend's: EINVAL, naming the
  // call, the address and the rule.
  [[noreturn]] void refuse(CallKind kind, uint64_t where, const std::string& why) const {
    throw Error(HVMM_ERR_OS, describe_errno(std::string(call_text(kind)) + " at " + hex(where) + ": " + why +
                                                " (the CUDA driver refuses this too)",
                                            EINVAL));
  }

  void check_aligned(CallKind kind, va_t va, uint64_t bytes) const {
    if (bytes == 0 || va % page_bytes() != 0 || bytes % page_bytes() != 0) {
      refuse(kind, va, std::to_string(bytes) + " bytes: address and size must be non-zero multiples of the page (" +
                           std::to_string(page_bytes()) + ")");
    }
  }

  // [va, va + bytes) inside one reservation.
  void check_reserved(CallKind kind, va_t va, uint64_t bytes) const {
    auto it = reservations_.upper_bound(va);
    if (it == reservations_.begin() || std::prev(it)->first + std::prev(it)->second < va + bytes) {
      refuse(kind, va, "[" + hex(va) + ", " + hex(va + bytes) + ") is not inside one reserved range");
    }
  }

  // [va, va + bytes) is exactly a run of adjacent whole mappings: it starts where one
  // starts, every byte is mapped, and it ends where one ends.
  void check_whole_mappings(CallKind kind, va_t va, uint64_t bytes) const {
    check_aligned(kind, va, bytes);
    check_reserved(kind, va, bytes);
    va_t at = va;
    auto it = mappings_.find(va);
    if (it == mappings_.end()) {
      refuse(kind, va, "no mapping starts at " + hex(va) + " (not mapped, or inside a mapping: a sub-range)");
    }
    while (at < va + bytes) {
      if (it == mappings_.end() || it->first != at) {
        refuse(kind, va, "[" + hex(va) + ", " + hex(va + bytes) + ") is not fully mapped: nothing is mapped at " +
                             hex(at));
      }
      at += it->second;
      ++it;
    }
    if (at != va + bytes) {
      refuse(kind, va, "[" + hex(va) + ", " + hex(va + bytes) + ") ends inside the mapping that ends at " + hex(at) +
                           " (a sub-range)");
    }
  }

  int memfd_;
  mutable std::mutex table_mu_;
  std::map<va_t, uint64_t> reservations_;              // base -> bytes
  std::unordered_map<phys_handle_t, uint64_t> allocations_;  // memfd offset -> bytes
  std::map<va_t, uint64_t> mappings_;                  // start -> bytes, non-overlapping
  std::mutex fence_mu_;
  std::condition_variable fence_passed_;
  bool held_ = false;
  std::unordered_set<event_t> pending_;  // recorded while held, not yet released
  std::atomic<uint64_t> next_offset_{0};
  std::atomic<event_t> next_event_{1};  // 0 means "no event"
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(uint64_t page_bytes) {
  if (page_bytes == 0) page_bytes = kDefaultHostPageBytes;
  const uint64_t os_page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  if ((page_bytes & (page_bytes - 1)) != 0 || page_bytes < os_page) {
    throw_invalid("page_bytes=" + std::to_string(page_bytes) +
                  " must be a power of two and at least the OS page size (" + std::to_string(os_page) +
                  "); use e.g. 65536 or 2097152");
  }
  int fd = ::memfd_create("harvest-vmm-pages", MFD_CLOEXEC);
  if (fd < 0) throw Error(HVMM_ERR_OS, describe_errno("memfd_create", errno));
  return std::make_unique<HostBackend>(fd, page_bytes);
}

}  // namespace harvest::vmm
