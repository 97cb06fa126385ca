// backend_host.cpp — the VMM semantics on host memory, for CPU runs and the test suite.
//
// Physical pages are page_bytes-sized pieces of one memfd (committed with fallocate at
// creation, as cuMemCreate commits device memory). A reserved range is an anonymous
// PROT_NONE mapping; mapping a page replaces part of it with a MAP_SHARED|MAP_FIXED view
// of the memfd, so the same physical page can appear at several addresses exactly as on
// the device. Unmapping puts a PROT_NONE placeholder back (the range stays reserved;
// munmap would hand the addresses to the next mmap). Host work is synchronous, so a fence
// has passed as soon as it is recorded, except while a test holds fences (hold_fences):
// then fences stay pending until released, as events on a GPU stream still busy with
// queued kernels do, so the paths that poll or wait on fences run on CPU too.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <mutex>
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
    void* p = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw Error(HVMM_ERR_OS, describe_errno(std::string(call_text(CallKind::kReserve)) + " of " +
                                                  std::to_string(bytes) + " bytes",
                                              errno));
    }
    return reinterpret_cast<va_t>(p);
  }

  void do_free_range(va_t va, uint64_t bytes) override {
    if (::munmap(reinterpret_cast<void*>(va), bytes) != 0) {
      throw Error(HVMM_ERR_OS, describe_errno(call_text(CallKind::kFreeRange), errno));
    }
  }

  phys_handle_t do_create_page() override {
    uint64_t offset = next_offset_.fetch_add(page_bytes());
    if (::fallocate(memfd_, 0, static_cast<off_t>(offset), static_cast<off_t>(page_bytes())) != 0) {
      throw Error(HVMM_ERR_OS, describe_errno(std::string(call_text(CallKind::kCreate)) + " at offset " +
                                                  std::to_string(offset),
                                              errno));
    }
    return offset;
  }

  void do_release_page(phys_handle_t page) override {
    if (::fallocate(memfd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(page),
                    static_cast<off_t>(page_bytes())) != 0) {
      throw Error(HVMM_ERR_OS, describe_errno(call_text(CallKind::kRelease), errno));
    }
  }

  void do_map(va_t va, phys_handle_t page) override {
    void* want = reinterpret_cast<void*>(va);
    void* p = ::mmap(want, page_bytes(), PROT_NONE, MAP_SHARED | MAP_FIXED, memfd_, static_cast<off_t>(page));
    if (p == MAP_FAILED) {
      throw Error(HVMM_ERR_OS, describe_errno(std::string(call_text(CallKind::kMap)) + " at " + hex(va), errno));
    }
  }

  void do_unmap(va_t va, uint64_t bytes) override {
    void* want = reinterpret_cast<void*>(va);
    void* p = ::mmap(want, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw Error(HVMM_ERR_OS, describe_errno(std::string(call_text(CallKind::kUnmap)) + " at " + hex(va), errno));
    }
  }

  void do_set_access(va_t va, uint64_t bytes) override {
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
  int memfd_;
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
