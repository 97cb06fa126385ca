// c_api.cpp — the exported hvmm_* functions: argument checks, and every C++ exception
// turned into a status plus hvmm_last_error() text. Nothing below may throw past here.
#include <new>
#include <string>
#include <utility>

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

// The entry points that hand back a list: `*out_count` is how many `items()` gives, at
// most `capacity` of them are copied to `out` (converted); a larger count tells the
// caller to call again with a larger array.
template <typename Out, typename Items, typename Convert>
void copy_out(Out* out, int64_t capacity, int64_t* out_count, Items&& items, Convert&& convert) {
  require(out_count, "out_count") = 0;
  if (capacity < 0 || (capacity > 0 && out == nullptr)) {
    harvest::vmm::throw_invalid("capacity=" + std::to_string(capacity) + " with " + (out ? "an" : "no") +
                                " output array");
  }
  const auto list = items();
  for (size_t i = 0; i < list.size() && static_cast<int64_t>(i) < capacity; ++i) out[i] = convert(list[i]);
  *out_count = static_cast<int64_t>(list.size());
}

template <typename Out, typename Items>
void copy_out(Out* out, int64_t capacity, int64_t* out_count, Items&& items) {
  copy_out(out, capacity, out_count, std::forward<Items>(items), [](const auto& item) { return static_cast<Out>(item); });
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

int hvmm_set_fence_streams(hvmm_allocator_t* allocator, const uint64_t* streams, int64_t count) {
  return guarded("set_fence_streams",
                 [&] { require(allocator, "allocator").impl.set_fence_streams(streams, count); });
}

int hvmm_fence_streams(hvmm_allocator_t* allocator, uint64_t* out, int64_t capacity, int64_t* out_count) {
  return guarded("fence_streams", [&] {
    copy_out(out, capacity, out_count, [&] { return require(allocator, "allocator").impl.fence_streams(); });
  });
}

int hvmm_lend(hvmm_allocator_t* allocator, const int64_t* chunks, int64_t count) {
  return guarded("lend", [&] { require(allocator, "allocator").impl.lend(chunks, count, true); });
}

int hvmm_lend_start(hvmm_allocator_t* allocator, const int64_t* chunks, int64_t count, int32_t* lent_now) {
  return guarded("lend_start", [&] {
    require(lent_now, "lent_now") = 0;
    *lent_now = require(allocator, "allocator").impl.lend(chunks, count, false) ? 1 : 0;
  });
}

int hvmm_lend_finish(hvmm_allocator_t* allocator, int64_t* out, int64_t capacity, int64_t* out_count) {
  return guarded("lend_finish", [&] {
    copy_out(out, capacity, out_count, [&] { return require(allocator, "allocator").impl.finish_lends(); });
  });
}

int hvmm_lend_cancel(hvmm_allocator_t* allocator, const int64_t* chunks, int64_t count) {
  return guarded("lend_cancel", [&] { require(allocator, "allocator").impl.cancel_lends(chunks, count); });
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

int hvmm_small_free(hvmm_allocator_t* allocator, uint64_t address, const uint64_t* streams, int64_t num_streams) {
  return guarded("small_free",
                 [&] { require(allocator, "allocator").impl.small_free(address, streams, num_streams); });
}

int hvmm_small_collect(hvmm_allocator_t* allocator, int64_t* out_collected) {
  return guarded("small_collect", [&] {
    require(out_collected, "out_collected") = 0;
    *out_collected = static_cast<int64_t>(require(allocator, "allocator").impl.small_collect());
  });
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

int hvmm_debug_record_calls(hvmm_allocator_t* allocator, int32_t on) {
  return guarded("hvmm_debug_record_calls",
                 [&] { require(allocator, "allocator").impl.backend().record_calls(on != 0); });
}

int hvmm_debug_call_log(hvmm_allocator_t* allocator, hvmm_call_record_t* out, int64_t capacity, int64_t* out_count) {
  return guarded("hvmm_debug_call_log", [&] {
    copy_out(
        out, capacity, out_count, [&] { return require(allocator, "allocator").impl.backend().call_log(); },
        [](const harvest::vmm::CallRecord& record) {
          return hvmm_call_record_t{static_cast<int32_t>(record.kind), record.result, record.address, record.bytes,
                                    record.stream, record.event};
        });
  });
}

int hvmm_debug_hold_fences(hvmm_allocator_t* allocator, int32_t held) {
  return guarded("hvmm_debug_hold_fences",
                 [&] { require(allocator, "allocator").impl.backend().hold_fences(held != 0); });
}

int hvmm_debug_backend_call(hvmm_allocator_t* allocator, int32_t kind, uint64_t address, uint64_t bytes,
                            int64_t page) {
  return guarded("hvmm_debug_backend_call", [&] {
    require(allocator, "allocator").impl.debug_backend_call(kind, address, bytes, page);
  });
}

}  // extern "C"
