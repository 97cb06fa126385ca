// hvmm.h — C ABI of libharvest_vmm, the unified KV / trainer page allocator.
//
// Design note
// -----------
// Rationale. SGLang reserves nearly all free device memory for its KV cache and hands
// out token slots by index, so memory it has reserved but not used is invisible to any
// other allocator. Harli (§4) takes that memory back with CUDA virtual memory: one pool
// of physical pages backs the KV cache and, whenever a whole run of token slots is free,
// the same physical pages are mapped at a second virtual address for the finetune
// trainer. Measured costs we design around (kvcached, A100, 2 MiB pages):
// cuMemCreate ~193 us, cuMemMap ~1.5 us, cuMemSetAccess ~36 us, cuMemUnmap ~26 us. So
// every physical page is created once at start-up, access is set once per fully mapped
// span (not per page), unmaps cover contiguous runs, and no call holds the GIL.
//
// A lent chunk's pages stay mapped at their KV slices: lending maps them a second time,
// into the trainer's arena, and reclaiming takes that second mapping away. The KV ranges
// are mapped once, at start-up, and never change: no KV slot is ever unmapped, so no
// decode kernel can fault on one, and no move waits to unmap one. What keeps decode off a
// lent chunk is the slot bookkeeping: its slots leave the serving side's free list (and
// hvmm_mark_slots, where the serving side feeds it, refuses them), and the padded rows of
// a batch write to the serving side's padding slot 0, in chunk 0, which is never lent
// (SGLang zeroes the padded rows' cache locations for exactly this reason;
// harvest.memory.lending keeps chunk 0). A padded row may still read a lent slot: it
// reads trainer bytes whose result is discarded.
//
// Driver calls per lend and reclaim of one chunk of P pages (P = 2 * num_layers; 64 for
// Llama-3-8B). Lend: P maps of the pages into the arena and one set-access over the
// chunk's arena run: P + 1 (65), one more (an unmap of the arena's dummy run) when the
// chunk was lent before. Reclaim: one unmap of the arena run, one map of the arena's
// dummy run, one set-access: 3. The P maps cannot shrink with one physical allocation per
// page: cuMemMap maps one allocation from offset 0 only ("offset currently must be zero").
//
// Approach. Vocabulary used throughout csrc/vmm_allocator:
//   page       one physical allocation of `page_bytes` (the driver's granularity,
//              2 MiB on current GPUs; configurable on the host backend).
//   KV range   the virtual range behind one layer's K (or V) buffer; range r is
//              2*layer + (0 for K, 1 for V) and starts at kv_base + r * kv_range_bytes.
//   chunk      a run of `tokens_per_chunk` token slots whose slice of every KV range is
//              exactly one page, so a chunk owns 2 * num_layers pages. Chunk c holds
//              slots [c * tokens_per_chunk, (c + 1) * tokens_per_chunk).
//   mapped     a chunk whose pages back its KV slices only (SGLang may use its slots).
//   lent       a chunk whose pages are also mapped into the general arena: the trainer
//              uses them, and the serving side may not mark its slots live.
//   lending    a chunk on its way to lent: the serving side no longer hands out its
//              slots, but kernels queued before the lend may still write its KV pages,
//              so the arena gets them only once the KV fences of the lend have passed.
//   general arena  the trainer's virtual range; chunk c's pages appear at
//              arena_base + c * chunk_bytes, so neighbouring lent chunks form one
//              contiguous run and a tensor may span them. Allocations are whole pages.
//              A reclaimed chunk's arena slots show the arena's dummy run (one
//              allocation of a chunk's pages, shared, mapped in one call), so a tensor
//              view that outlives its allocation's free and the reclaim reads and writes
//              the dummy: it never faults and never reaches the KV data.
//              The arena's range is unmapped only where no chunk was ever lent.
//   small pool a statically sized, always-mapped range with a buddy allocator at
//              2 KiB granularity for allocations under one page.
//   fence      an event recorded on a stream: "the work queued there so far". Recorded
//              on the KV streams (hvmm_set_fence_streams: every stream decode may run
//              on) before a lend hands a chunk's pages to the arena (decode work queued
//              before the lend may still write its slots), on the streams that used
//              freed arena pages (a reclaim waits for them before it unmaps the arena run:
//              cuMemUnmap does not wait for queued kernels, and one that touched an
//              unmapped page would fault and poison the context), and on the streams that
//              used a freed small-pool block (it is reused only after they pass). Fences are event waits or
//              queries, never a device-wide sync.
// Backends: `cuda` (driver VMM API through dlopen("libcuda.so.1")) and `host` (memfd
// pages mapped with mmap(MAP_SHARED|MAP_FIXED) into a reserved PROT_NONE range, so one
// physical page really appears at two virtual addresses). Everything above the backend
// is one code path. Lock order: GIL (released by ctypes) -> remap mutex (lend, finish,
// cancel, reclaim, check_integrity) -> state mutex (bookkeeping). The small pool has its
// own mutex; no driver call runs under it. Driver calls in lend/reclaim run outside the
// state mutex, on chunks marked lending or busy, and are rolled back on failure.
//
// Limitations. One device per allocator. Geometry is fixed at creation (per-token bytes
// must divide the page size). A chunk's pages always return to the same chunk (no page
// migration between chunks). The KV fences cover the streams the caller registered (by
// default the legacy default stream on the cuda backend, none on the host backend); work
// on any other stream that touches KV memory is not waited for. A driver failure
// whose rollback also fails leaves that chunk `broken` (never lent again; reported in
// the stats) rather than guessing.
//
// Conventions for every function: returns 0 on success and a non-zero status on
// failure; the failure's text (naming the driver call or syscall and its code, or the
// bad argument) is then available from hvmm_last_error() on the same thread. State is
// unchanged after any failure. Nothing aborts the process.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HVMM_EXPORT __attribute__((visibility("default")))

enum hvmm_status {
  HVMM_OK = 0,
  HVMM_ERR_INVALID = 1,       // bad argument or state (the message says which)
  HVMM_ERR_NO_DRIVER = 2,     // no usable CUDA driver (host backend still works)
  HVMM_ERR_DRIVER = 3,        // a CUDA driver call failed
  HVMM_ERR_OS = 4,            // a syscall failed (host backend)
  HVMM_ERR_EXHAUSTED = 5,     // transient: no free page right now; nothing changed
  HVMM_ERR_INTERNAL = 6,      // an invariant broke or memory for bookkeeping ran out
};

HVMM_EXPORT const char* hvmm_version(void);
HVMM_EXPORT const char* hvmm_last_error(void);

// What the driver says about VMM on one device. Fails with HVMM_ERR_NO_DRIVER when no
// driver is present (the message says why).
typedef struct hvmm_cuda_probe {
  int driver_version;            // e.g. 12080
  int device_count;
  int vmm_supported;             // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
  uint64_t granularity_bytes;    // minimum cuMemCreate page size (2 MiB on current GPUs)
} hvmm_cuda_probe_t;

HVMM_EXPORT int hvmm_cuda_probe(int device_ordinal, hvmm_cuda_probe_t* out);

// ---------------------------------------------------------------- the allocator

enum hvmm_backend_kind { HVMM_BACKEND_HOST = 0, HVMM_BACKEND_CUDA = 1 };

// Sizes are signed so a negative value from Python is reported, not wrapped around.
typedef struct hvmm_config {
  int32_t backend;            // hvmm_backend_kind
  int32_t device_ordinal;     // cuda backend only
  int64_t page_bytes;         // 0: backend default (host 2 MiB, cuda the granularity)
  int64_t num_layers;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t dtype_bytes;
  int64_t max_tokens;         // rounded up to whole chunks
  int64_t small_pool_bytes;   // rounded up to whole pages; 0: no small pool
} hvmm_config_t;

typedef struct hvmm_geometry {
  int32_t backend;
  int32_t device_ordinal;
  uint64_t page_bytes;
  uint64_t num_layers;
  uint64_t bytes_per_token;   // one layer, K or V: kv_heads * head_dim * dtype_bytes
  uint64_t tokens_per_chunk;  // page_bytes / bytes_per_token
  uint64_t pages_per_chunk;   // 2 * num_layers
  uint64_t num_chunks;
  uint64_t token_capacity;    // num_chunks * tokens_per_chunk
  uint64_t chunk_bytes;       // pages_per_chunk * page_bytes
  uint64_t kv_range_bytes;    // one K or V range: num_chunks * page_bytes
  uint64_t kv_base;           // range r starts at kv_base + r * kv_range_bytes
  uint64_t arena_base;        // chunk c's pages at arena_base + c * chunk_bytes
  uint64_t arena_bytes;
  uint64_t small_base;
  uint64_t small_bytes;
  uint64_t small_pages;
  uint64_t total_pages;       // physical allocations created at start-up: the KV pages, the
                              // small pool's and the arena's dummy run (pages_per_chunk pages)
} hvmm_geometry_t;

enum hvmm_chunk_state {
  HVMM_CHUNK_MAPPED = 0,      // backs its KV slots
  HVMM_CHUNK_LENT = 1,        // mapped into the general arena
  HVMM_CHUNK_BUSY = 2,        // a lend or reclaim is moving it right now
  HVMM_CHUNK_BROKEN = 3,      // a driver failure left it unusable (see the stats)
  HVMM_CHUNK_LENDING = 4,     // lend started, its pages wait for the lend's KV fences
};

typedef struct hvmm_chunk_info {
  int32_t state;              // hvmm_chunk_state
  int32_t fence_pending;      // lent: some stream that used it has not passed its event;
                              // lending: some KV stream has not passed the lend's event
  uint64_t live_slots;        // token slots marked live (mapped chunks only)
  uint64_t used_pages;        // arena pages of this chunk inside live allocations
} hvmm_chunk_info_t;

typedef struct hvmm_stats {
  uint64_t num_chunks;
  uint64_t chunks_mapped;
  uint64_t chunks_lent;
  uint64_t chunks_lent_idle;       // lent with no page in use: reclaimable
  uint64_t chunks_busy;
  uint64_t chunks_broken;
  uint64_t live_slots;
  uint64_t pages_kv_mapped;        // pages serving the KV cache (mapped and lending chunks)
  uint64_t pages_lent;             // pages mapped into the general arena
  uint64_t pages_lent_used;        // ... inside live allocations
  uint64_t bytes_lent;
  uint64_t fragmentation_bytes;    // free pages of lent chunks that are partly used
  uint64_t arena_allocations;
  uint64_t arena_used_bytes;
  uint64_t arena_largest_free_bytes;
  uint64_t small_pool_bytes;
  uint64_t small_used_bytes;       // rounded to blocks
  uint64_t small_requested_bytes;  // as asked for
  uint64_t small_allocations;
  uint64_t small_largest_free_bytes;
  uint64_t fences_pending;         // arena and lend events not yet known to have passed
  uint64_t chunks_lending;         // lends waiting for their KV fences (hvmm_lend_finish)
  uint64_t small_pending_frees;    // small-pool blocks freed with fences not yet seen to pass
  uint64_t small_pending_bytes;    // ... their bytes (neither used nor free)
} hvmm_stats_t;

// Backend calls by kind since creation, and how many creates start-up made.
typedef struct hvmm_counters {
  uint64_t reserve;
  uint64_t free_range;
  uint64_t create;
  uint64_t release;
  uint64_t map;
  uint64_t unmap;
  uint64_t set_access;
  uint64_t event_create;
  uint64_t fence_record;
  uint64_t fence_query;
  uint64_t fence_wait;
  uint64_t create_at_init;
} hvmm_counters_t;

typedef struct hvmm_allocator hvmm_allocator_t;

HVMM_EXPORT int hvmm_create(const hvmm_config_t* config, hvmm_allocator_t** out);
HVMM_EXPORT int hvmm_destroy(hvmm_allocator_t* allocator);
HVMM_EXPORT int hvmm_geometry(hvmm_allocator_t* allocator, hvmm_geometry_t* out);

// Token-slot liveness, as the serving side's slot allocator reports it. A lent chunk's
// slots cannot be marked live; freeing a slot that is not live is an error. All slots
// are checked before any count changes.
// Optional: the live-slot rule (no lend of a chunk with live slots) holds only for slots
// marked here. harvest does not mark SGLang's slots: SGLang's free lists are the
// authority on which slots are free (marking would be a foreign call on every alloc and
// free of every step), so harvest.sglang.kv_lending lends a chunk only after taking all
// its slots out of SGLang's free list, and its check_integrity requires every count here
// to stay 0. This allocator is the authority on chunk state (mapped/lent/busy/broken).
HVMM_EXPORT int hvmm_mark_slots(hvmm_allocator_t* allocator, const int64_t* slots, int64_t count,
                                int32_t live);

HVMM_EXPORT int hvmm_chunk_info(hvmm_allocator_t* allocator, int64_t chunk, hvmm_chunk_info_t* out);
// Every chunk's info at once (out has room for num_chunks entries); fence_pending here
// means "has fences not yet known to have passed" (no driver query).
HVMM_EXPORT int hvmm_chunk_table(hvmm_allocator_t* allocator, hvmm_chunk_info_t* out, int64_t capacity);
// Query first, mutate second: *ok is 1 when lend/reclaim of this chunk would succeed.
HVMM_EXPORT int hvmm_can_lend(hvmm_allocator_t* allocator, int64_t chunk, int32_t* ok);
HVMM_EXPORT int hvmm_can_reclaim(hvmm_allocator_t* allocator, int64_t chunk, int32_t* ok);
// The streams whose queued work may touch KV memory (CUstream values; 0 is the legacy
// default stream): every stream decode may run on. A lend records an event on each and
// hands the chunks' pages to the arena only once they have passed. Replaces the previous
// set (duplicates are dropped); count 0 fences nothing. Defaults: {0} on the cuda backend,
// none on host.
HVMM_EXPORT int hvmm_set_fence_streams(hvmm_allocator_t* allocator, const uint64_t* streams, int64_t count);
// The current set: *out_count streams, the first `capacity` of them copied to out.
HVMM_EXPORT int hvmm_fence_streams(hvmm_allocator_t* allocator, uint64_t* out, int64_t capacity,
                                   int64_t* out_count);

// Lend / reclaim a set of chunks as one batch (access is set once per contiguous run).
// Either every chunk moves or none does. A lend records a fence on every KV stream and
// waits for it (an event wait) before it maps the pages into the arena; a reclaim waits
// for the fences of the chunks' arena frees before it unmaps the arena run.
HVMM_EXPORT int hvmm_lend(hvmm_allocator_t* allocator, const int64_t* chunks, int64_t count);
HVMM_EXPORT int hvmm_reclaim(hvmm_allocator_t* allocator, const int64_t* chunks, int64_t count);
// A lend that never blocks: records the KV fences and queries them; *lent_now is 1 when
// they had all passed and the chunks are lent, 0 when the batch is left LENDING (the
// arena cannot hand its pages out yet) for hvmm_lend_finish.
HVMM_EXPORT int hvmm_lend_start(hvmm_allocator_t* allocator, const int64_t* chunks, int64_t count,
                                int32_t* lent_now);
// Completes, as one batch, every pending lend whose fences have all passed (one query per
// fence, no wait). The chunks lent by this call, ascending: *out_count of them, the first
// `capacity` copied to out (num_chunks always suffices). On a failure they stay LENDING.
HVMM_EXPORT int hvmm_lend_finish(hvmm_allocator_t* allocator, int64_t* out, int64_t capacity, int64_t* out_count);
// Gives LENDING chunks back to the KV cache (nothing was mapped yet: no driver call).
HVMM_EXPORT int hvmm_lend_cancel(hvmm_allocator_t* allocator, const int64_t* chunks, int64_t count);

// General arena: whole pages, contiguous in virtual memory. HVMM_ERR_EXHAUSTED when no
// run of lent pages is long enough (transient; nothing changed). Free records a fence
// on each given stream (CUstream values; ignored by the host backend).
HVMM_EXPORT int hvmm_arena_alloc(hvmm_allocator_t* allocator, int64_t num_bytes, uint64_t* out_address);
HVMM_EXPORT int hvmm_arena_free(hvmm_allocator_t* allocator, uint64_t address, const uint64_t* streams,
                                int64_t num_streams);

// Small pool: sizes 1 .. page_bytes-1, rounded up to 2 KiB * 2^k. Free records a fence
// on each given stream (CUstream values; ignored by the host backend) and the block is
// reused only once all have passed (alloc collects such frees first, oldest first);
// with no stream it is free at once (the caller orders reuse, e.g. one stream only).
HVMM_EXPORT int hvmm_small_alloc(hvmm_allocator_t* allocator, int64_t num_bytes, uint64_t* out_address);
HVMM_EXPORT int hvmm_small_free(hvmm_allocator_t* allocator, uint64_t address, const uint64_t* streams,
                                int64_t num_streams);
// Collects fenced frees whose fences have passed now (alloc does so too); *out_collected:
// how many blocks became free.
HVMM_EXPORT int hvmm_small_collect(hvmm_allocator_t* allocator, int64_t* out_collected);

HVMM_EXPORT int hvmm_stats(hvmm_allocator_t* allocator, hvmm_stats_t* out);
HVMM_EXPORT int hvmm_counters(hvmm_allocator_t* allocator, hvmm_counters_t* out);
// Every pool's invariants (no page mapped twice, owned + free == total, free lists
// consistent, counts add up). HVMM_ERR_INTERNAL with the first violation otherwise.
HVMM_EXPORT int hvmm_check_integrity(hvmm_allocator_t* allocator);

// Tests only: the (after_calls + 1)-th next backend call of `kind` fails as the real call
// would (kind: index of the field in hvmm_counters_t, reserve = 0 ... fence_wait = 10).
// after_calls < 0 disarms.
HVMM_EXPORT int hvmm_debug_inject_failure(hvmm_allocator_t* allocator, int32_t kind, int64_t after_calls);

// Tests only: the backend call log. on = 1 clears it and starts recording every backend
// call (after it returns), 0 stops; hvmm_debug_call_log copies the first `capacity`
// records to out and says how many there are.
typedef struct hvmm_call_record {
  int32_t kind;      // as for hvmm_debug_inject_failure: reserve = 0 ... fence_wait = 10
  int32_t result;    // fence_query: 1 passed, 0 not yet; otherwise 0
  uint64_t address;  // reserve, free_range, map, unmap, set_access
  uint64_t bytes;    // reserve, free_range, create, map, unmap, set_access
  uint64_t stream;   // fence_record
  uint64_t event;    // event_create, fence_record, fence_query, fence_wait
} hvmm_call_record_t;

HVMM_EXPORT int hvmm_debug_record_calls(hvmm_allocator_t* allocator, int32_t on);
HVMM_EXPORT int hvmm_debug_call_log(hvmm_allocator_t* allocator, hvmm_call_record_t* out, int64_t capacity,
                                    int64_t* out_count);
// Tests only, host backend: held = 1 keeps every fence recorded from now on pending (as on
// a GPU stream still busy) until held = 0 passes them all; a wait on a held fence blocks
// until then (release it from another thread). HVMM_ERR_INVALID on the cuda backend.
HVMM_EXPORT int hvmm_debug_hold_fences(hvmm_allocator_t* allocator, int32_t held);

// Tests only: one raw backend call past every allocator check, to show that the backend
// refuses what the CUDA driver refuses (the host backend checks the driver's rules
// itself). kind: map (4), unmap (5) or set_access (6), as for hvmm_debug_inject_failure;
// map maps `bytes` of pool page `page` (a page id, see geometry.h) at `address`. A call
// that succeeds changes the mappings behind the allocator's back: only for refusals.
HVMM_EXPORT int hvmm_debug_backend_call(hvmm_allocator_t* allocator, int32_t kind, uint64_t address, uint64_t bytes,
                                        int64_t page);

// Benchmark (scripts/bench_vmm.py): one random sequence of `pairs` allocations and as
// many frees (sizes log-uniform in [min_bytes, max_bytes], at most `max_live` live at a
// time), replayed `reps` times on this allocator's small pool and on glibc malloc/free,
// alternating. Medians of nanoseconds per alloc+free pair.
typedef struct hvmm_small_bench {
  double pool_ns_per_pair_median;
  double malloc_ns_per_pair_median;
  int64_t pairs;
  int64_t reps;
} hvmm_small_bench_t;

HVMM_EXPORT int hvmm_bench_small_pool(hvmm_allocator_t* allocator, uint64_t seed, int64_t pairs, int64_t max_live,
                                      int64_t min_bytes, int64_t max_bytes, int64_t reps, hvmm_small_bench_t* out);

#ifdef __cplusplus
}
#endif
