// A fake CUDA driver (libcuda.so.1) for exercising libharvest_greenctx's driver paths
// on machines without a GPU. It models what the green-context code relies on: SM
// resources and split-by-count rounding (granularity FAKE_CUDA_GRANULARITY, default
// 8), green contexts and their streams, the primary context's reference count and the
// thread's current context. Every create/destroy is appended to FAKE_CUDA_LOG, and
// misuse (destroying a green context that still has streams, creating a stream with no
// current context, using a destroyed context) is logged as a line starting with "BAD".
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
  log_line("exit primary_refs=%d live_green=%d live_streams=%d", g_primary_refs, g_live_green, g_live_streams);
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
