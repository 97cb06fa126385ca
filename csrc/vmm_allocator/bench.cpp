// bench.cpp — hvmm_bench_small_pool: small-pool alloc+free against glibc malloc+free on
// the same random sequence, timed in C++ so Python call overhead does not hide the
// difference (scripts/bench_vmm.py reports the ratio of the medians).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "errors.h"
#include "handle.h"

namespace {

using harvest::vmm::throw_invalid;

struct Op {
  int64_t bytes;  // > 0: allocate into `slot`; 0: free `slot`
  int64_t slot;
};

std::vector<Op> make_sequence(uint64_t seed, int64_t pairs, int64_t max_live, int64_t min_bytes, int64_t max_bytes) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(std::log(static_cast<double>(min_bytes)),
                                                  std::log(static_cast<double>(max_bytes)));
  std::vector<Op> ops;
  ops.reserve(static_cast<size_t>(2 * pairs));
  std::vector<int64_t> live;
  std::vector<int64_t> idle;
  for (int64_t slot = max_live; slot-- > 0;) idle.push_back(slot);
  int64_t allocated = 0;
  while (allocated < pairs || !live.empty()) {
    const bool can_alloc = allocated < pairs && !idle.empty();
    if (can_alloc && (live.empty() || (rng() & 1) != 0)) {
      const int64_t slot = idle.back();
      idle.pop_back();
      const auto bytes = static_cast<int64_t>(std::exp(log_size(rng)));
      ops.push_back({std::clamp(bytes, min_bytes, max_bytes), slot});
      live.push_back(slot);
      ++allocated;
    } else {
      const size_t index = rng() % live.size();
      ops.push_back({0, live[index]});
      idle.push_back(live[index]);
      live[index] = live.back();
      live.pop_back();
    }
  }
  return ops;
}

inline void escape(void* pointer) { asm volatile("" : : "g"(pointer) : "memory"); }

double run_pool(harvest::vmm::SmallPool& pool, const std::vector<Op>& ops, std::vector<uint64_t>& slots) {
  const auto start = std::chrono::steady_clock::now();
  for (const Op& op : ops) {
    if (op.bytes > 0) {
      const uint64_t address = pool.allocate(op.bytes);
      if (address == 0) {
        for (uint64_t& live : slots) {
          if (live != 0) pool.free(live);
          live = 0;
        }
        throw_invalid("the small pool ran out during the benchmark; lower max_live or max_bytes");
      }
      slots[op.slot] = address;
    } else {
      pool.free(slots[op.slot]);
      slots[op.slot] = 0;
    }
  }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
}

double run_malloc(const std::vector<Op>& ops, std::vector<void*>& slots) {
  const auto start = std::chrono::steady_clock::now();
  for (const Op& op : ops) {
    if (op.bytes > 0) {
      void* pointer = std::malloc(static_cast<size_t>(op.bytes));
      escape(pointer);
      slots[op.slot] = pointer;
    } else {
      std::free(slots[op.slot]);
    }
  }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

}  // namespace

extern "C" int hvmm_bench_small_pool(hvmm_allocator_t* allocator, uint64_t seed, int64_t pairs, int64_t max_live,
                                     int64_t min_bytes, int64_t max_bytes, int64_t reps, hvmm_small_bench_t* out) {
  try {
    if (allocator == nullptr || out == nullptr) throw_invalid("allocator and out must not be NULL");
    harvest::vmm::SmallPool& pool = allocator->impl.small_pool();
    const auto page_bytes = static_cast<int64_t>(allocator->impl.describe().page_bytes);
    if (pairs <= 0 || max_live <= 0 || reps <= 0) {
      throw_invalid("pairs, max_live and reps must be positive (got " + std::to_string(pairs) + ", " +
                    std::to_string(max_live) + ", " + std::to_string(reps) + ")");
    }
    if (min_bytes <= 0 || min_bytes > max_bytes || max_bytes >= page_bytes) {
      throw_invalid("need 0 < min_bytes <= max_bytes < page_bytes (" + std::to_string(page_bytes) + "), got " +
                    std::to_string(min_bytes) + ", " + std::to_string(max_bytes));
    }
    const std::vector<Op> ops = make_sequence(seed, pairs, max_live, min_bytes, max_bytes);
    std::vector<uint64_t> pool_slots(static_cast<size_t>(max_live), 0);
    std::vector<void*> malloc_slots(static_cast<size_t>(max_live), nullptr);
    run_pool(pool, ops, pool_slots);  // warm-up: first-touch of metadata and heap pages
    run_malloc(ops, malloc_slots);
    std::vector<double> pool_ns;
    std::vector<double> malloc_ns;
    for (int64_t rep = 0; rep < reps; ++rep) {
      if (rep % 2 == 0) {
        pool_ns.push_back(run_pool(pool, ops, pool_slots) / static_cast<double>(pairs));
        malloc_ns.push_back(run_malloc(ops, malloc_slots) / static_cast<double>(pairs));
      } else {
        malloc_ns.push_back(run_malloc(ops, malloc_slots) / static_cast<double>(pairs));
        pool_ns.push_back(run_pool(pool, ops, pool_slots) / static_cast<double>(pairs));
      }
    }
    out->pool_ns_per_pair_median = median(pool_ns);
    out->malloc_ns_per_pair_median = median(malloc_ns);
    out->pairs = pairs;
    out->reps = reps;
    return HVMM_OK;
  } catch (const harvest::vmm::Error& e) {
    harvest::set_last_error(std::string("hvmm_bench_small_pool: ") + e.what());
    return e.status();
  } catch (const std::exception& e) {
    harvest::set_last_error(std::string("hvmm_bench_small_pool: ") + e.what());
    return HVMM_ERR_INTERNAL;
  }
}
