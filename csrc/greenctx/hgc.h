// hgc.h — C ABI of libharvest_greenctx, SM partitioning with CUDA green contexts.
//
// Conventions: 0 on success, non-zero status on failure with the text (naming the
// driver call and its code) in hgc_last_error() on the same thread. Never aborts.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HGC_EXPORT __attribute__((visibility("default")))

enum hgc_status {
  HGC_OK = 0,
  HGC_ERR_INVALID = 1,       // bad argument (the message names the constraint)
  HGC_ERR_NO_DRIVER = 2,     // no usable CUDA driver
  HGC_ERR_DRIVER = 3,        // a driver call failed
  HGC_ERR_UNSUPPORTED = 4,   // driver older than green contexts (needs 12.4+)
};

HGC_EXPORT const char* hgc_version(void);
HGC_EXPORT const char* hgc_last_error(void);

typedef struct hgc_device_info {
  char name[256];
  int driver_version;            // e.g. 12080
  int sm_count;                  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
  int cc_major, cc_minor;        // compute capability
  uint64_t total_memory_bytes;
  int green_contexts_supported;  // driver has the green-context entry points
  // Partition constraints as the driver reports them (CUDA 13 headers); 0 when the
  // driver does not report them, in which case the caller applies the known arch rules.
  int min_sm_partition_size;
  int sm_coscheduled_alignment;
} hgc_device_info_t;

HGC_EXPORT int hgc_device_info(int device_ordinal, hgc_device_info_t* out);

#ifdef __cplusplus
}
#endif
