// c_api.cpp — the exported hvmm_* functions: argument checks, and every C++ exception
// turned into a status plus hvmm_last_error() text. Nothing below may throw past here.
#include <new>
#include <string>

#include "cuda_driver.h"
#include "errors.h"
#include "handle.h"

namespace {

template <typename Body>
int guarded(const char* function, Body&& body) noexcept {
  try {
    body();
    return HVMM_OK;
  } catch (const harvest::vmm::Error& e) {
    harvest::set_last_error(std::string(function) + ": " + e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    harvest::set_last_error(std::string(function) + ": out of host memory for bookkeeping");
    return HVMM_ERR_INTERNAL;
  } catch (const std::exception& e) {
    harvest::set_last_error(std::string(function) + ": " + e.what());
    return HVMM_ERR_INTERNAL;
  }
}

template <typename T>
T& require(T* pointer, const char* name) {
  if (pointer == nullptr) harvest::vmm::throw_invalid(std::string(name) + " is NULL");
  return *pointer;
}

}  // namespace

extern "C" {

int hvmm_create(const hvmm_config_t* config, hvmm_allocator_t** out) {
  return guarded("hvmm_create", [&] {
    require(out, "out") = nullptr;
    *out = new hvmm_allocator(require(config, "config"));
  });
}

int hvmm_destroy(hvmm_allocator_t* allocator) {
  return guarded("hvmm_destroy", [&] { delete &require(allocator, "allocator"); });
}

int hvmm_geometry(hvmm_allocator_t* allocator, hvmm_geometry_t* out) {
  return guarded("hvmm_geometry", [&] { require(out, "out") = require(allocator, "allocator").impl.describe(); });
}

int hvmm_mark_slots(hvmm_allocator_t* allocator, const int64_t* slots, int64_t count, int32_t live) {
  return guarded(live ? "mark_slots_live" : "mark_slots_free",
                 [&] { require(allocator, "allocator").impl.mark_slots(slots, count, live != 0); });
}

int hvmm_chunk_info(hvmm_allocator_t* allocator, int64_t chunk, hvmm_chunk_info_t* out) {
  return guarded("hvmm_chunk_info",
                 [&] { require(out, "out") = require(allocator, "allocator").impl.chunk_info(chunk); });
}

int hvmm_chunk_table(hvmm_allocator_t* allocator, hvmm_chunk_info_t* out, int64_t capacity) {
  return guarded("hvmm_chunk_table", [&] { require(allocator, "allocator").impl.chunk_table(out, capacity); });
}

int hvmm_can_lend(hvmm_allocator_t* allocator, int64_t chunk, int32_t* ok) {
  return guarded("can_lend", [&] { require(ok, "ok") = require(allocator, "allocator").impl.can_lend(chunk); });
}

int hvmm_can_reclaim(hvmm_allocator_t* allocator, int64_t chunk, int32_t* ok) {
  return guarded("can_reclaim", [&] { require(ok, "ok") = require(allocator, "allocator").impl.can_reclaim(chunk); });
}

int hvmm_lend(hvmm_allocator_t* allocator, const int64_t* chunks, int64_t count) {
  return guarded("lend", [&] { require(allocator, "allocator").impl.lend(chunks, count); });
}

int hvmm_reclaim(hvmm_allocator_t* allocator, const int64_t* chunks, int64_t count) {
  return guarded("reclaim", [&] { require(allocator, "allocator").impl.reclaim(chunks, count); });
}

int hvmm_arena_alloc(hvmm_allocator_t* allocator, int64_t num_bytes, uint64_t* out_address) {
  int status = guarded("arena_alloc", [&] {
    require(out_address, "out_address") = require(allocator, "allocator").impl.arena_allocate(num_bytes);
  });
  if (status == HVMM_OK && *out_address == 0) {
    harvest::set_last_error("arena_alloc: no run of " + std::to_string(num_bytes) +
                            " bytes of lent pages is free right now (lend more chunks or free arena memory)");
    return HVMM_ERR_EXHAUSTED;
  }
  return status;
}

int hvmm_arena_free(hvmm_allocator_t* allocator, uint64_t address, const uint64_t* streams, int64_t num_streams) {
  return guarded("arena_free",
                 [&] { require(allocator, "allocator").impl.arena_free(address, streams, num_streams); });
}

int hvmm_small_alloc(hvmm_allocator_t* allocator, int64_t num_bytes, uint64_t* out_address) {
  int status = guarded("small_alloc", [&] {
    require(out_address, "out_address") = require(allocator, "allocator").impl.small_allocate(num_bytes);
  });
  if (status == HVMM_OK && *out_address == 0) {
    harvest::set_last_error("small_alloc: no free block of " + std::to_string(num_bytes) +
                            " bytes in the small pool right now");
    return HVMM_ERR_EXHAUSTED;
  }
  return status;
}

int hvmm_small_free(hvmm_allocator_t* allocator, uint64_t address) {
  return guarded("small_free", [&] { require(allocator, "allocator").impl.small_free(address); });
}

int hvmm_stats(hvmm_allocator_t* allocator, hvmm_stats_t* out) {
  return guarded("hvmm_stats", [&] { require(out, "out") = require(allocator, "allocator").impl.stats(); });
}

int hvmm_counters(hvmm_allocator_t* allocator, hvmm_counters_t* out) {
  return guarded("hvmm_counters", [&] { require(out, "out") = require(allocator, "allocator").impl.counters(); });
}

int hvmm_check_integrity(hvmm_allocator_t* allocator) {
  return guarded("check_integrity", [&] { require(allocator, "allocator").impl.check_integrity(); });
}

int hvmm_debug_inject_failure(hvmm_allocator_t* allocator, int32_t kind, int64_t after_calls) {
  return guarded("hvmm_debug_inject_failure", [&] {
    if (kind < 0 || kind >= harvest::vmm::kNumCallKinds) {
      harvest::vmm::throw_invalid("kind=" + std::to_string(kind) + " is not a call kind (0 .. " +
                                  std::to_string(harvest::vmm::kNumCallKinds - 1) + ")");
    }
    require(allocator, "allocator").impl.backend().inject_failure(static_cast<harvest::vmm::CallKind>(kind),
                                                                 after_calls);
  });
}

}  // extern "C"
