// cuda_driver.h — the CUDA driver API, opened at run time.
//
// Rationale: harvest's native libraries must build and load on machines with no CUDA
// driver (CI, developer laptops), and there is no stub libcuda.so to link against.
// Approach: dlopen("libcuda.so.1") once, take cuGetProcAddress from it, and resolve
// every entry point below at the ABI version named beside it (the `_vNNNN` of its
// PFN typedef in cudaTypedefs.h), so a newer driver cannot silently hand us a
// different signature. Entry points marked OPTIONAL may be missing (green contexts
// need a 12.4+ driver); calling one that is missing fails with a message naming the
// driver version it needs, never a crash.
// Limitations: needs a driver with cuGetProcAddress_v2 (CUDA 12.0+). Not reloaded:
// the table is filled once per process, thread-safely.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

namespace harvest {

// X(name, pfn_version, required): every driver call harvest makes, listed once.
#define HARVEST_CUDA_DRIVER_ENTRY_POINTS(X)           \
  X(cuInit, 2000, true)                               \
  X(cuDriverGetVersion, 2020, true)                   \
  X(cuGetErrorName, 6000, true)                       \
  X(cuGetErrorString, 6000, true)                     \
  X(cuDeviceGet, 2000, true)                          \
  X(cuDeviceGetCount, 2000, true)                     \
  X(cuDeviceGetName, 2000, true)                      \
  X(cuDeviceGetAttribute, 2000, true)                 \
  X(cuDeviceTotalMem, 3020, true)                     \
  X(cuDevicePrimaryCtxRetain, 7000, true)             \
  X(cuDevicePrimaryCtxRelease, 11000, true)           \
  X(cuCtxGetCurrent, 4000, true)                      \
  X(cuCtxSetCurrent, 4000, true)                      \
  X(cuCtxSynchronize, 2000, true)                     \
  X(cuMemAddressReserve, 10020, true)                 \
  X(cuMemAddressFree, 10020, true)                    \
  X(cuMemCreate, 10020, true)                         \
  X(cuMemRelease, 10020, true)                        \
  X(cuMemMap, 10020, true)                            \
  X(cuMemUnmap, 10020, true)                          \
  X(cuMemSetAccess, 10020, true)                      \
  X(cuMemGetAllocationGranularity, 10020, true)       \
  X(cuMemsetD8, 3020, true)                           \
  X(cuMemcpyDtoH, 3020, true)                         \
  X(cuMemcpyHtoD, 3020, true)                         \
  X(cuEventCreate, 2000, true)                        \
  X(cuEventRecord, 2000, true)                        \
  X(cuEventQuery, 2000, true)                         \
  X(cuEventSynchronize, 2000, true)                   \
  X(cuEventDestroy, 4000, true)                       \
  X(cuStreamCreate, 2000, true)                       \
  X(cuStreamDestroy, 4000, true)                      \
  X(cuStreamSynchronize, 2000, true)                  \
  X(cuStreamWaitEvent, 3020, true)                    \
  X(cuLibraryLoadData, 12000, true)                   \
  X(cuLibraryGetKernel, 12000, true)                  \
  X(cuLaunchKernel, 4000, true)                       \
  X(cuDeviceGetDevResource, 12040, false)             \
  X(cuDevSmResourceSplitByCount, 12040, false)        \
  X(cuDevResourceGenerateDesc, 12040, false)          \
  X(cuGreenCtxCreate, 12040, false)                   \
  X(cuGreenCtxDestroy, 12040, false)                  \
  X(cuGreenCtxGetDevResource, 12040, false)           \
  X(cuCtxFromGreenCtx, 12040, false)                  \
  X(cuGreenCtxRecordEvent, 12040, false)              \
  X(cuGreenCtxStreamCreate, 12050, false)

#define HARVEST_DECLARE_ENTRY(name, version, required) PFN_##name##_v##version name;
struct DriverApi {
  HARVEST_CUDA_DRIVER_ENTRY_POINTS(HARVEST_DECLARE_ENTRY)
  int driver_version = 0;  // cuDriverGetVersion, e.g. 12080 for 12.8
};
#undef HARVEST_DECLARE_ENTRY

// The process-wide table, or nullptr when no usable driver is present. On nullptr,
// driver_unavailable_reason() says why ("libcuda.so.1 not found: ...", "cuInit
// failed: CUDA_ERROR_NO_DEVICE ...", ...). cuInit(0) has been called on success.
const DriverApi* driver();
const std::string& driver_unavailable_reason();

// "cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory) at file.cpp:42" — the
// text every failed driver call is turned into. `call` is the call's source text.
std::string describe_cu_error(CUresult result, const char* call, const char* file, int line);

// Thread-local last-error text for the C ABI: functions return a non-zero status and
// the Python side reads the message with <lib>_last_error().
void set_last_error(const std::string& message);
const char* last_error();

}  // namespace harvest

// Evaluates a driver call; on failure records the error and returns `status_on_error`
// from the enclosing function. For C-ABI functions that return int status.
#define HARVEST_CU_CHECK_RETURN(expr, status_on_error)                                       \
  do {                                                                                       \
    CUresult harvest_cu_result_ = (expr);                                                    \
    if (harvest_cu_result_ != CUDA_SUCCESS) {                                                \
      ::harvest::set_last_error(                                                             \
          ::harvest::describe_cu_error(harvest_cu_result_, #expr, __FILE__, __LINE__));      \
      return (status_on_error);                                                              \
    }                                                                                        \
  } while (0)
