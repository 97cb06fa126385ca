// A fake CUDA driver (libcuda.so.1) for exercising harvest's driver paths on machines
// without a GPU. It models what the green-context code relies on: SM resources and
// split-by-count rounding (granularity FAKE_CUDA_GRANULARITY, default 8), green contexts
// and their streams, the primary context's reference count and the thread's current
// context. Every create/destroy is appended to FAKE_CUDA_LOG, and misuse (destroying a
// green context that still has streams, creating a stream with no current context,
// using a destroyed context) is logged as a line starting with "BAD".
//
// For libharvest_vmm's cuda backend it models the VMM calls (reserve, create, map,
// set-access, unmap, release, free; 2 MiB granularity; no memory behind the addresses)
// and events on streams: a test queues kernels on a stream and lets the GPU finish them
// (fake_finish_work); an event recorded on a stream passes once the work queued there
// before it has finished (cuEventQuery says CUDA_ERROR_NOT_READY until then;
// cuEventSynchronize is the host waiting for it, so the work finishes). A kernel queued
// with fake_queue_work may touch any address; one queued with fake_queue_work_in touches
// only [va, va + bytes). Each stream keeps the bounds of the union of what its unfinished
// kernels may touch (cleared once it has no unfinished kernel: fake_finish_work, or an
// event sync that reached its last kernel). cuMemUnmap of a range that overlaps what some
// stream's unfinished kernels may touch logs BAD (the fault that would poison a real
// context); an unmap elsewhere is fine while other work runs. Also BAD: a map over a
// mapped page, a map at a non-zero offset or longer than its allocation (allocations are
// whole multiples of the granularity), an unmap of a page that is not mapped, a
// set-access over a range that is not fully mapped (these also fail with
// CUDA_ERROR_INVALID_VALUE, as the driver does), an event created without
// CU_EVENT_DISABLE_TIMING and the use of a destroyed event.
// Map, unmap, set-access and every event call are logged in order.
//
// Knobs (environment): FAKE_CUDA_VERSION (default 12080), FAKE_CUDA_SMS (132),
// FAKE_CUDA_MISSING (comma-separated entry points to report as absent),
// FAKE_CUDA_FAIL_GREEN_CREATE_AT (the Nth cuGreenCtxCreate fails with out of memory).
// Entry points it does not model resolve to a stub returning CUDA_ERROR_NOT_SUPPORTED.
#include <cuda.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct FakeContext {
  int id;
  int green;
  unsigned sms;
  int destroyed;
  int live_streams;
} FakeContext;

typedef struct FakeStream {
  int id;
  FakeContext* context;
} FakeStream;

static FakeContext g_primary = {0, 0, 0, 0, 0};
static __thread CUcontext t_current = NULL;
static int g_next_id = 1;
static int g_primary_refs = 0, g_live_green = 0, g_live_streams = 0, g_green_creates = 0;

// VMM and events (libharvest_vmm's cuda backend).
#define FAKE_MAX_STREAMS 64
#define FAKE_MAX_MAPPED 4096
typedef struct FakeEvent {
  int id;
  int destroyed;
  int recorded;
  unsigned long long stream;
  long generation;  // the stream's queued-work count when recorded
} FakeEvent;
static struct {
  unsigned long long handle;
  long queued;    // kernels queued so far
  long finished;  // of which finished
  // What the unfinished kernels may touch: anything, or the bounds [lo, hi) of the union
  // of their ranges (empty when hi <= lo). Stale once finished == queued.
  int touches_any;
  unsigned long long lo, hi;
} g_work[FAKE_MAX_STREAMS];
static int g_work_streams = 0;
static unsigned long long g_mapped[FAKE_MAX_MAPPED];  // page addresses currently mapped
static int g_num_mapped = 0;
static CUdeviceptr g_next_va = 0x7f0000000000ull;
static int g_live_events = 0, g_live_reserves = 0, g_live_pages = 0, g_next_handle = 1;
#define FAKE_MAX_HANDLES 65536
static size_t g_handle_bytes[FAKE_MAX_HANDLES];  // each allocation's size, by handle

static int env_int(const char* name, int fallback) {
  const char* value = getenv(name);
  return value != NULL && *value != '\0' ? atoi(value) : fallback;
}

static void log_line(const char* format, ...) {
  const char* path = getenv("FAKE_CUDA_LOG");
  if (path == NULL) return;
  FILE* file = fopen(path, "a");
  if (file == NULL) return;
  va_list args;
  va_start(args, format);
  vfprintf(file, format, args);
  va_end(args);
  fputc('\n', file);
  fclose(file);
}

static void report_at_exit(void) {
  log_line("exit primary_refs=%d live_green=%d live_streams=%d live_events=%d live_reserves=%d live_pages=%d "
           "mapped=%d", g_primary_refs, g_live_green, g_live_streams, g_live_events, g_live_reserves, g_live_pages,
           g_num_mapped);
}

static int context_id(CUcontext context) { return context == NULL ? -1 : ((FakeContext*)context)->id; }

// Test hook, read through ctypes: the id of this thread's current context (-1: none).
int fake_current_context_id(void) { return context_id(t_current); }

static CUresult fake_cuInit(unsigned flags) {
  static int registered = 0;
  if (!registered) atexit(report_at_exit);
  registered = 1;
  g_primary.sms = (unsigned)env_int("FAKE_CUDA_SMS", 132);
  return CUDA_SUCCESS;
}
static CUresult fake_cuDriverGetVersion(int* version) {
  *version = env_int("FAKE_CUDA_VERSION", 12080);
  return CUDA_SUCCESS;
}
static CUresult fake_cuGetErrorName(CUresult error, const char** name) {
  switch (error) {
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *name = "CUDA_ERROR_NOT_SUPPORTED"; break;
    default: *name = "CUDA_ERROR_UNKNOWN";
  }
  return CUDA_SUCCESS;
}
static CUresult fake_cuGetErrorString(CUresult error, const char** text) {
  *text = "fake driver error";
  return CUDA_SUCCESS;
}
static CUresult fake_cuDeviceGetCount(int* count) {
  *count = 1;
  return CUDA_SUCCESS;
}
static CUresult fake_cuDeviceGet(CUdevice* device, int ordinal) {
  if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
  *device = 0;
  return CUDA_SUCCESS;
}
static CUresult fake_cuDeviceGetName(char* name, int length, CUdevice device) {
  snprintf(name, (size_t)length, "Fake GPU");
  return CUDA_SUCCESS;
}
static CUresult fake_cuDeviceGetAttribute(int* value, CUdevice_attribute attribute, CUdevice device) {
  switch (attribute) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = (int)g_primary.sms; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *value = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
    default: *value = 0;
  }
  return CUDA_SUCCESS;
}
static CUresult fake_cuDeviceTotalMem(size_t* bytes, CUdevice device) {
  *bytes = (size_t)80 << 30;
  return CUDA_SUCCESS;
}
static CUresult fake_cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  g_primary_refs++;
  *context = (CUcontext)&g_primary;
  log_line("primary_retain refs=%d", g_primary_refs);
  return CUDA_SUCCESS;
}
static CUresult fake_cuDevicePrimaryCtxRelease(CUdevice device) {
  if (g_primary_refs == 0) log_line("BAD primary_release without a reference");
  g_primary_refs--;
  log_line("primary_release refs=%d", g_primary_refs);
  return CUDA_SUCCESS;
}
static CUresult fake_cuCtxGetCurrent(CUcontext* context) {
  *context = t_current;
  return CUDA_SUCCESS;
}
static CUresult fake_cuCtxSetCurrent(CUcontext context) {
  t_current = context;
  return CUDA_SUCCESS;
}
static CUresult fake_cuDeviceGetDevResource(CUdevice device, CUdevResource* resource, CUdevResourceType type) {
  if (type != CU_DEV_RESOURCE_TYPE_SM) return CUDA_ERROR_INVALID_VALUE;
  memset(resource, 0, sizeof(*resource));
  resource->type = CU_DEV_RESOURCE_TYPE_SM;
  resource->sm.smCount = g_primary.sms;
  resource->sm.minSmPartitionSize = 8;
  resource->sm.smCoscheduledAlignment = 8;
  return CUDA_SUCCESS;
}
static CUresult fake_cuDevSmResourceSplitByCount(CUdevResource* result, unsigned* num_groups,
                                                 const CUdevResource* input, CUdevResource* remaining,
                                                 unsigned flags, unsigned min_count) {
  if (num_groups == NULL || input == NULL || input->type != CU_DEV_RESOURCE_TYPE_SM) return CUDA_ERROR_INVALID_VALUE;
  unsigned granularity = (unsigned)env_int("FAKE_CUDA_GRANULARITY", 8);
  unsigned group = min_count < granularity ? granularity : min_count;
  group = (group + granularity - 1) / granularity * granularity;
  if (group > input->sm.smCount) {
    *num_groups = 0;
    return CUDA_SUCCESS;
  }
  if (result == NULL) {
    *num_groups = input->sm.smCount / group;
    return CUDA_SUCCESS;
  }
  result[0] = *input;
  result[0].sm.smCount = group;
  if (remaining != NULL) {
    *remaining = *input;
    remaining->sm.smCount = input->sm.smCount - group;
  }
  *num_groups = 1;
  log_line("split asked=%u group=%u remainder=%u", min_count, group, input->sm.smCount - group);
  return CUDA_SUCCESS;
}
static CUresult fake_cuDevResourceGenerateDesc(CUdevResourceDesc* desc, CUdevResource* resources, unsigned count) {
  if (count != 1 || resources[0].sm.smCount == 0) return CUDA_ERROR_INVALID_VALUE;
  unsigned* sms = malloc(sizeof(unsigned));  // descriptors are never freed by the real API either
  *sms = resources[0].sm.smCount;
  *desc = (CUdevResourceDesc)sms;
  return CUDA_SUCCESS;
}
static CUresult fake_cuGreenCtxCreate(CUgreenCtx* out, CUdevResourceDesc desc, CUdevice device, unsigned flags) {
  if (flags != CU_GREEN_CTX_DEFAULT_STREAM) return CUDA_ERROR_INVALID_VALUE;
  if (++g_green_creates == env_int("FAKE_CUDA_FAIL_GREEN_CREATE_AT", 0)) return CUDA_ERROR_OUT_OF_MEMORY;
  FakeContext* context = calloc(1, sizeof(FakeContext));
  context->id = g_next_id++;
  context->green = 1;
  context->sms = *(unsigned*)desc;
  g_live_green++;
  *out = (CUgreenCtx)context;
  log_line("green_create id=%d sms=%u", context->id, context->sms);
  return CUDA_SUCCESS;
}
static CUresult fake_cuGreenCtxDestroy(CUgreenCtx green) {
  FakeContext* context = (FakeContext*)green;
  if (context->destroyed) log_line("BAD green_destroy twice id=%d", context->id);
  if (context->live_streams > 0) log_line("BAD green_destroy id=%d with %d live streams", context->id, context->live_streams);
  context->destroyed = 1;
  g_live_green--;
  log_line("green_destroy id=%d", context->id);
  return CUDA_SUCCESS;
}
static CUresult fake_cuGreenCtxGetDevResource(CUgreenCtx green, CUdevResource* resource, CUdevResourceType type) {
  memset(resource, 0, sizeof(*resource));
  resource->type = CU_DEV_RESOURCE_TYPE_SM;
  resource->sm.smCount = ((FakeContext*)green)->sms;
  return CUDA_SUCCESS;
}
static CUresult fake_cuCtxFromGreenCtx(CUcontext* context, CUgreenCtx green) {
  *context = (CUcontext)green;
  return CUDA_SUCCESS;
}
static CUresult new_stream(CUstream* out, FakeContext* context, const char* how) {
  if (context->destroyed) log_line("BAD stream_create in destroyed context id=%d", context->id);
  FakeStream* stream = calloc(1, sizeof(FakeStream));
  stream->id = g_next_id++;
  stream->context = context;
  context->live_streams++;
  g_live_streams++;
  *out = (CUstream)stream;
  log_line("stream_create id=%d context=%d green=%d via=%s", stream->id, context->id, context->green, how);
  return CUDA_SUCCESS;
}
static CUresult fake_cuStreamCreate(CUstream* out, unsigned flags) {
  if (t_current == NULL) {
    log_line("BAD stream_create with no current context");
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  if (flags != CU_STREAM_NON_BLOCKING) log_line("BAD stream_create flags=%u", flags);
  return new_stream(out, (FakeContext*)t_current, "cuStreamCreate");
}
static CUresult fake_cuGreenCtxStreamCreate(CUstream* out, CUgreenCtx green, unsigned flags, int priority) {
  if (flags != CU_STREAM_NON_BLOCKING) return CUDA_ERROR_INVALID_VALUE;
  return new_stream(out, (FakeContext*)green, "cuGreenCtxStreamCreate");
}
static CUresult fake_cuStreamSynchronize(CUstream handle) {
  FakeStream* stream = (FakeStream*)handle;
  if (stream->context->destroyed) log_line("BAD sync on stream %d of a destroyed context", stream->id);
  log_line("stream_sync id=%d", stream->id);
  return CUDA_SUCCESS;
}
static CUresult fake_cuStreamDestroy(CUstream handle) {
  FakeStream* stream = (FakeStream*)handle;
  if (stream->context->destroyed) log_line("BAD stream_destroy id=%d after its context", stream->id);
  stream->context->live_streams--;
  g_live_streams--;
  log_line("stream_destroy id=%d", stream->id);
  return CUDA_SUCCESS;
}
static CUresult fake_cuLibraryLoadData(CUlibrary* library, const void* code, CUjit_option* options, void** values,
                                       unsigned num_options, CUlibraryOption* library_options,
                                       void** library_values, unsigned num_library_options) {
  if (strstr((const char*)code, ".entry harvest_spin(") == NULL) return CUDA_ERROR_INVALID_VALUE;
  *library = (CUlibrary)&g_primary;
  log_line("library_load");
  return CUDA_SUCCESS;
}
static CUresult fake_cuLibraryGetKernel(CUkernel* kernel, CUlibrary library, const char* name) {
  if (strcmp(name, "harvest_spin") != 0) return CUDA_ERROR_NOT_FOUND;
  *kernel = (CUkernel)&g_primary;
  return CUDA_SUCCESS;
}
static CUresult fake_cuLaunchKernel(CUfunction function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                    unsigned by, unsigned bz, unsigned shared, CUstream handle, void** params,
                                    void** extra) {
  FakeStream* stream = (FakeStream*)handle;
  if (stream == NULL || params == NULL) return CUDA_ERROR_INVALID_VALUE;
  log_line("launch grid=%u block=%u stream=%d context=%d iterations=%d never=%g", gx, bx, stream->id,
           stream->context->id, *(int*)params[1], *(float*)params[2]);
  return CUDA_SUCCESS;
}
// -- VMM -------------------------------------------------------------------------------
static const size_t kFakeGranularity = (size_t)2 << 20;

static int work_index(unsigned long long handle) {
  for (int i = 0; i < g_work_streams; ++i) {
    if (g_work[i].handle == handle) return i;
  }
  if (g_work_streams == FAKE_MAX_STREAMS) return -1;
  g_work[g_work_streams].handle = handle;
  g_work[g_work_streams].queued = g_work[g_work_streams].finished = 0;
  g_work[g_work_streams].touches_any = 0;
  g_work[g_work_streams].lo = g_work[g_work_streams].hi = 0;
  return g_work_streams++;
}

// One more kernel on stream i; it may touch anything (any = 1) or [va, va + bytes).
static void queue_kernel(int i, int any, unsigned long long va, unsigned long long bytes) {
  if (g_work[i].finished >= g_work[i].queued) {  // nothing unfinished: start a new union
    g_work[i].touches_any = 0;
    g_work[i].lo = g_work[i].hi = 0;
  }
  g_work[i].queued++;
  if (any) {
    g_work[i].touches_any = 1;
  } else if (bytes > 0) {
    const int empty = g_work[i].hi <= g_work[i].lo;
    if (empty || va < g_work[i].lo) g_work[i].lo = va;
    if (empty || va + bytes > g_work[i].hi) g_work[i].hi = va + bytes;
  }
}

// Test hooks, read through ctypes: a kernel is queued on the stream with this CUstream
// value that may touch any address (fake_queue_work) or only [va, va + bytes)
// (fake_queue_work_in); the GPU finishes everything queued on it (fake_finish_work).
void fake_queue_work(unsigned long long stream) {
  int i = work_index(stream);
  if (i < 0) return;
  queue_kernel(i, 1, 0, 0);
  log_line("work_queued stream=%llu queued=%ld", stream, g_work[i].queued);
}
void fake_queue_work_in(unsigned long long stream, unsigned long long va, unsigned long long bytes) {
  int i = work_index(stream);
  if (i < 0) return;
  queue_kernel(i, 0, va, bytes);
  log_line("work_queued stream=%llu queued=%ld va=%llu bytes=%llu", stream, g_work[i].queued, va, bytes);
}
void fake_finish_work(unsigned long long stream) {
  int i = work_index(stream);
  if (i < 0) return;
  g_work[i].finished = g_work[i].queued;
  g_work[i].touches_any = 0;
  g_work[i].lo = g_work[i].hi = 0;
  log_line("work_finished stream=%llu", stream);
}

// Whether stream i's unfinished kernels may touch some byte of [va, va + bytes).
static int work_may_touch(int i, unsigned long long va, unsigned long long bytes) {
  if (g_work[i].finished >= g_work[i].queued || bytes == 0) return 0;
  if (g_work[i].touches_any) return 1;
  return va < g_work[i].hi && g_work[i].lo < va + bytes;
}

static int mapped_index(unsigned long long page) {
  for (int i = 0; i < g_num_mapped; ++i) {
    if (g_mapped[i] == page) return i;
  }
  return -1;
}

static CUresult fake_cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                                   CUmemAllocationGranularity_flags option) {
  *granularity = kFakeGranularity;
  return CUDA_SUCCESS;
}
static CUresult fake_cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                         unsigned long long flags) {
  if (size == 0 || size % kFakeGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
  *ptr = g_next_va;
  g_next_va += size + kFakeGranularity;  // a gap between reservations
  g_live_reserves++;
  log_line("mem_reserve va=%llu bytes=%zu", (unsigned long long)*ptr, size);
  return CUDA_SUCCESS;
}
static CUresult fake_cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  g_live_reserves--;
  log_line("mem_free_range va=%llu bytes=%zu", (unsigned long long)ptr, size);
  return CUDA_SUCCESS;
}
static CUresult fake_cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                                 unsigned long long flags) {
  if (size == 0 || size % kFakeGranularity != 0) {
    log_line("BAD mem_create of %zu bytes (not a multiple of the granularity)", size);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (g_next_handle < FAKE_MAX_HANDLES) g_handle_bytes[g_next_handle] = size;
  *handle = (CUmemGenericAllocationHandle)g_next_handle++;
  g_live_pages++;
  return CUDA_SUCCESS;
}
static CUresult fake_cuMemRelease(CUmemGenericAllocationHandle handle) {
  g_live_pages--;
  return CUDA_SUCCESS;
}
static CUresult fake_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                              unsigned long long flags) {
  if (offset != 0) {
    log_line("BAD mem_map at offset %zu (cuMemMap: currently must be zero)", offset);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (handle < FAKE_MAX_HANDLES && size > g_handle_bytes[handle]) {
    log_line("BAD mem_map of %zu bytes of an allocation of %zu", size, g_handle_bytes[handle]);
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (size_t at = 0; at < size; at += kFakeGranularity) {
    unsigned long long page = (unsigned long long)ptr + at;
    if (mapped_index(page) >= 0) {
      log_line("BAD mem_map over the mapped page %llu", page);
    } else if (g_num_mapped < FAKE_MAX_MAPPED) {
      g_mapped[g_num_mapped++] = page;
    }
  }
  log_line("mem_map va=%llu bytes=%zu handle=%llu", (unsigned long long)ptr, size, (unsigned long long)handle);
  return CUDA_SUCCESS;
}
static CUresult fake_cuMemUnmap(CUdeviceptr ptr, size_t size) {
  for (int i = 0; i < g_work_streams; ++i) {
    if (work_may_touch(i, (unsigned long long)ptr, (unsigned long long)size)) {
      log_line("BAD mem_unmap va=%llu bytes=%zu while stream %llu has %ld unfinished kernels that may touch it",
               (unsigned long long)ptr, size, g_work[i].handle, g_work[i].queued - g_work[i].finished);
    }
  }
  for (size_t at = 0; at < size; at += kFakeGranularity) {
    int i = mapped_index((unsigned long long)ptr + at);
    if (i < 0) {
      log_line("BAD mem_unmap of the unmapped page %llu", (unsigned long long)ptr + at);
    } else {
      g_mapped[i] = g_mapped[--g_num_mapped];
    }
  }
  log_line("mem_unmap va=%llu bytes=%zu", (unsigned long long)ptr, size);
  return CUDA_SUCCESS;
}
static CUresult fake_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  for (size_t at = 0; at < size; at += kFakeGranularity) {
    if (mapped_index((unsigned long long)ptr + at) < 0) {
      log_line("BAD mem_set_access va=%llu bytes=%zu over the unmapped page %llu (not a fully mapped range)",
               (unsigned long long)ptr, size, (unsigned long long)ptr + at);
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  log_line("mem_set_access va=%llu bytes=%zu", (unsigned long long)ptr, size);
  return CUDA_SUCCESS;
}

// -- events ------------------------------------------------------------------------------
static int event_ready(const FakeEvent* event) {
  if (!event->recorded) return 1;
  int i = work_index(event->stream);
  return i < 0 || g_work[i].finished >= event->generation;
}
static int check_event(const FakeEvent* event, const char* call) {
  if (event == NULL || event->destroyed) {
    log_line("BAD %s on a destroyed or null event", call);
    return 0;
  }
  return 1;
}
static CUresult fake_cuEventCreate(CUevent* out, unsigned flags) {
  if (flags != CU_EVENT_DISABLE_TIMING) log_line("BAD event_create flags=%u (fences need no timing)", flags);
  FakeEvent* event = calloc(1, sizeof(FakeEvent));
  event->id = g_next_id++;
  g_live_events++;
  *out = (CUevent)event;
  log_line("event_create id=%d", event->id);
  return CUDA_SUCCESS;
}
static CUresult fake_cuEventRecord(CUevent handle, CUstream stream) {
  FakeEvent* event = (FakeEvent*)handle;
  if (!check_event(event, "event_record")) return CUDA_ERROR_INVALID_HANDLE;
  int i = work_index((unsigned long long)stream);
  event->recorded = 1;
  event->stream = (unsigned long long)stream;
  event->generation = i < 0 ? 0 : g_work[i].queued;
  log_line("event_record id=%d stream=%llu", event->id, event->stream);
  return CUDA_SUCCESS;
}
static CUresult fake_cuEventQuery(CUevent handle) {
  FakeEvent* event = (FakeEvent*)handle;
  if (!check_event(event, "event_query")) return CUDA_ERROR_INVALID_HANDLE;
  int ready = event_ready(event);
  log_line("event_query id=%d stream=%llu ready=%d", event->id, event->stream, ready);
  return ready ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
static CUresult fake_cuEventSynchronize(CUevent handle) {
  FakeEvent* event = (FakeEvent*)handle;
  if (!check_event(event, "event_sync")) return CUDA_ERROR_INVALID_HANDLE;
  if (event->recorded) {  // the host waits until the GPU has done the work before the event
    int i = work_index(event->stream);
    if (i >= 0 && g_work[i].finished < event->generation) g_work[i].finished = event->generation;
  }
  log_line("event_sync id=%d stream=%llu", event->id, event->stream);
  return CUDA_SUCCESS;
}
static CUresult fake_cuEventDestroy(CUevent handle) {
  FakeEvent* event = (FakeEvent*)handle;
  if (!check_event(event, "event_destroy")) return CUDA_ERROR_INVALID_HANDLE;
  event->destroyed = 1;  // never freed: a later use is reported, not a crash
  g_live_events--;
  log_line("event_destroy id=%d", event->id);
  return CUDA_SUCCESS;
}

static CUresult fake_unmodelled(void) { return CUDA_ERROR_NOT_SUPPORTED; }

#define ENTRY(name) {#name, (void*)fake_##name}
static const struct {
  const char* name;
  void* function;
} kEntries[] = {
    ENTRY(cuInit), ENTRY(cuDriverGetVersion), ENTRY(cuGetErrorName), ENTRY(cuGetErrorString),
    ENTRY(cuDeviceGetCount), ENTRY(cuDeviceGet), ENTRY(cuDeviceGetName), ENTRY(cuDeviceGetAttribute),
    ENTRY(cuDeviceTotalMem), ENTRY(cuDevicePrimaryCtxRetain), ENTRY(cuDevicePrimaryCtxRelease),
    ENTRY(cuCtxGetCurrent), ENTRY(cuCtxSetCurrent), ENTRY(cuDeviceGetDevResource),
    ENTRY(cuDevSmResourceSplitByCount), ENTRY(cuDevResourceGenerateDesc), ENTRY(cuGreenCtxCreate),
    ENTRY(cuGreenCtxDestroy), ENTRY(cuGreenCtxGetDevResource), ENTRY(cuCtxFromGreenCtx),
    ENTRY(cuStreamCreate), ENTRY(cuGreenCtxStreamCreate), ENTRY(cuStreamSynchronize), ENTRY(cuStreamDestroy),
    ENTRY(cuLibraryLoadData), ENTRY(cuLibraryGetKernel), ENTRY(cuLaunchKernel),
    ENTRY(cuMemGetAllocationGranularity), ENTRY(cuMemAddressReserve), ENTRY(cuMemAddressFree), ENTRY(cuMemCreate),
    ENTRY(cuMemRelease), ENTRY(cuMemMap), ENTRY(cuMemUnmap), ENTRY(cuMemSetAccess), ENTRY(cuEventCreate),
    ENTRY(cuEventRecord), ENTRY(cuEventQuery), ENTRY(cuEventSynchronize), ENTRY(cuEventDestroy),
};

static int is_missing(const char* symbol) {
  const char* missing = getenv("FAKE_CUDA_MISSING");
  if (missing == NULL) return 0;
  size_t length = strlen(symbol);
  for (const char* p = missing; (p = strstr(p, symbol)) != NULL; p += length) {
    int starts = p == missing || p[-1] == ',';
    int ends = p[length] == '\0' || p[length] == ',';
    if (starts && ends) return 1;
  }
  return 0;
}

CUresult cuGetProcAddress(const char* symbol, void** function, int version, cuuint64_t flags,
                          CUdriverProcAddressQueryResult* status) {
  *function = NULL;
  if (is_missing(symbol)) {
    if (status != NULL) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
  }
  *function = (void*)fake_unmodelled;
  for (size_t i = 0; i < sizeof(kEntries) / sizeof(kEntries[0]); ++i) {
    if (strcmp(kEntries[i].name, symbol) == 0) *function = kEntries[i].function;
  }
  if (status != NULL) *status = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}
