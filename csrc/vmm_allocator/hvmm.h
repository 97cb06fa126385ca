// hvmm.h — C ABI of libharvest_vmm, the unified KV / trainer page allocator.
//
// Conventions for every function: returns 0 on success and a non-zero status on
// failure; the failure's text (naming the driver call or syscall and its code) is then
// available from hvmm_last_error() on the same thread. Nothing aborts the process.
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

#ifdef __cplusplus
}
#endif
