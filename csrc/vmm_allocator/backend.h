// backend.h — the seven memory operations the allocator needs, behind one interface.
//
// Both backends give the same semantics, the CUDA driver's (cuda.h, group CUDA_VA):
// `reserve` makes an inaccessible virtual range; `create_page` commits one physical
// allocation of one page or more; `map` puts one allocation, from its first byte
// (cuMemMap's offset "currently must be zero"), at a page-aligned address inside a
// reserved range where nothing is mapped, and the new mapping has no access until
// `set_access` ("all mappings start with no accessibility setup"); `unmap` takes whole
// mappings out again (the range stays reserved; cuMemUnmap "cannot unmap a sub-range"
// of a mapping); `set_access` grants read/write over "a fully mapped address range"
// (several adjacent mappings may share one call, as NVIDIA's vectorAddMMAP sample does;
// a hole refuses it); and fences order reuse after the streams that used memory. The
// host backend checks these rules itself and refuses what the driver refuses, so a CPU
// run cannot pass with a call sequence a GPU would reject. Which backend is in use
// changes nothing above this file.
//
// Every public call is counted by kind (hvmm_counters_t) so tests and the benchmark can
// assert exactly how many driver calls an operation made, can be made to fail on
// purpose (inject_failure) to test rollback, and, while a test asks for it, is appended
// to a call log (kind, address, stream, event, outcome) so tests can check the order of
// calls, e.g. that no unmap comes before the fence it must follow. Failures throw Error
// naming the call.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace harvest::vmm {

using va_t = uint64_t;           // a virtual address (device or host)
using phys_handle_t = uint64_t;  // a backend's handle of one physical page
using stream_t = uint64_t;       // a CUstream (0: the legacy default stream)
using event_t = uint64_t;        // a backend's fence event handle

// Order matches the fields of hvmm_counters_t.
enum class CallKind : int {
  kReserve = 0,
  kFreeRange,
  kCreate,
  kRelease,
  kMap,
  kUnmap,
  kSetAccess,
  kEventCreate,
  kFenceRecord,
  kFenceQuery,
  kFenceWait,
  kCount,
};
constexpr int kNumCallKinds = static_cast<int>(CallKind::kCount);
const char* call_kind_name(CallKind kind);

// One backend call as the call log saw it (after it returned; failed calls are not logged).
struct CallRecord {
  CallKind kind;
  int32_t result;   // fence_query: 1 passed, 0 not yet; otherwise 0
  va_t address;     // reserve, free_range, map, unmap, set_access
  uint64_t bytes;   // reserve, free_range, map, unmap, set_access, create
  stream_t stream;  // fence_record
  event_t event;    // event_create, fence_record, fence_query, fence_wait
};

class Backend {
 public:
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  virtual ~Backend() = default;

  virtual const char* name() const = 0;
  uint64_t page_bytes() const { return page_bytes_; }

  va_t reserve(uint64_t bytes);
  void free_range(va_t va, uint64_t bytes);
  // One physical allocation of `pages` pages (one cuMemCreate).
  phys_handle_t create_page(uint64_t pages = 1);
  void release_page(phys_handle_t page);
  // `bytes` of the allocation `page`, from its start, at va (one cuMemMap); bytes must
  // not exceed the allocation.
  void map(va_t va, phys_handle_t page, uint64_t bytes);
  void unmap(va_t va, uint64_t bytes);       // whole adjacent mappings, no hole
  void set_access(va_t va, uint64_t bytes);  // whole adjacent mappings, no hole
  // A fence on `stream`; recycle it with release_fence once it has passed.
  event_t record_fence(stream_t stream);
  bool fence_passed(event_t event);
  void wait_fence(event_t event);
  void release_fence(event_t event) noexcept;

  // Tests only. The call log: `on` clears it and starts recording, !on stops.
  void record_calls(bool on);
  std::vector<CallRecord> call_log() const;
  // Tests only, host backend: while held, fences recorded stay pending (fence_passed
  // answers false, wait_fence blocks) until released; releasing passes them all. The
  // stand-in for a GPU stream still busy with queued work. The cuda backend refuses.
  virtual void hold_fences(bool held);

  uint64_t count(CallKind kind) const { return counts_[static_cast<int>(kind)].load(std::memory_order_relaxed); }
  // The (after_calls + 1)-th next call of `kind` fails; after_calls < 0 disarms.
  void inject_failure(CallKind kind, int64_t after_calls);

 protected:
  explicit Backend(uint64_t page_bytes) : page_bytes_(page_bytes) {
    for (auto& remaining : fail_after_) remaining.store(-1);
  }
  // The status a real failure of this backend's calls carries (driver or OS).
  virtual int failure_status() const = 0;
  virtual const char* call_text(CallKind kind) const = 0;

  virtual va_t do_reserve(uint64_t bytes) = 0;
  virtual void do_free_range(va_t va, uint64_t bytes) = 0;
  virtual phys_handle_t do_create_page(uint64_t bytes) = 0;
  virtual void do_release_page(phys_handle_t page) = 0;
  virtual void do_map(va_t va, phys_handle_t page, uint64_t bytes) = 0;
  virtual void do_unmap(va_t va, uint64_t bytes) = 0;
  virtual void do_set_access(va_t va, uint64_t bytes) = 0;
  virtual event_t do_create_event() = 0;
  virtual void do_destroy_event(event_t event) noexcept = 0;
  virtual void do_record_fence(event_t event, stream_t stream) = 0;
  virtual bool do_fence_passed(event_t event) = 0;
  virtual void do_wait_fence(event_t event) = 0;

  // Subclass destructors call this first: it destroys pooled events while the
  // subclass (and its driver context) still exists.
  void destroy_pooled_events() noexcept;

 private:
  void before_call(CallKind kind);
  void log_call(const CallRecord& record);

  uint64_t page_bytes_;
  std::array<std::atomic<uint64_t>, kNumCallKinds> counts_{};
  std::array<std::atomic<int64_t>, kNumCallKinds> fail_after_{};
  std::atomic<bool> any_injection_{false};
  std::mutex event_pool_mu_;
  std::vector<event_t> event_pool_;  // recorded-and-passed events, ready for reuse
  std::atomic<bool> logging_{false};
  mutable std::mutex log_mu_;
  std::vector<CallRecord> log_;
};

// One recorded event: "the work queued on `stream` up to here". Shared by everything it
// fences (every chunk an arena allocation spanned, a lend batch, a small-pool block) and
// recycled into the backend's event pool when the last holder drops it (RAII: the event
// is destroyed with the pool at teardown).
struct Fence {
  Fence(Backend& backend, stream_t stream, event_t event) : backend(backend), stream(stream), event(event) {}
  ~Fence() { backend.release_fence(event); }
  Fence(const Fence&) = delete;
  Fence& operator=(const Fence&) = delete;
  Backend& backend;
  stream_t stream;
  event_t event;
};
using FencePtr = std::shared_ptr<Fence>;

// A fence on each of `streams`; on a failure the ones already recorded are recycled.
std::vector<FencePtr> record_fences(Backend& backend, const std::vector<stream_t>& streams);
// Whether every fence has passed (one query each, stopping at the first pending one).
bool all_passed(const std::vector<FencePtr>& fences);

// page_bytes: a power of two, a multiple of the OS page size (host) or of the device's
// VMM granularity (cuda); 0 picks the default. Throws Error on a bad value or when the
// backend cannot start (no driver, device without VMM, ...).
std::unique_ptr<Backend> make_host_backend(uint64_t page_bytes);
std::unique_ptr<Backend> make_cuda_backend(int device_ordinal, uint64_t page_bytes);

// ------------------------------------------------------------ RAII for backend handles
// Non-copyable, movable; destructors release and log failures, never throw. Teardown
// order (Allocator): mapping tables (each unmaps, then frees its virtual range), then
// the physical pages, then the backend.

class VaRange {
 public:
  VaRange() = default;
  VaRange(Backend& backend, uint64_t bytes);
  VaRange(VaRange&& other) noexcept;
  VaRange& operator=(VaRange&& other) noexcept;
  VaRange(const VaRange&) = delete;
  VaRange& operator=(const VaRange&) = delete;
  ~VaRange();

  va_t base() const { return base_; }
  uint64_t bytes() const { return bytes_; }

 private:
  void reset() noexcept;
  Backend* backend_ = nullptr;
  va_t base_ = 0;
  uint64_t bytes_ = 0;
};

class PhysPage {
 public:
  PhysPage() = default;
  explicit PhysPage(Backend& backend, uint64_t pages = 1);
  PhysPage(PhysPage&& other) noexcept;
  PhysPage& operator=(PhysPage&& other) noexcept;
  PhysPage(const PhysPage&) = delete;
  PhysPage& operator=(const PhysPage&) = delete;
  ~PhysPage();

  phys_handle_t handle() const { return handle_; }
  uint64_t pages() const { return pages_; }

 private:
  void reset() noexcept;
  Backend* backend_ = nullptr;
  phys_handle_t handle_ = 0;
  uint64_t pages_ = 0;
};

}  // namespace harvest::vmm
