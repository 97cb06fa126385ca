// Device query: SM count, compute capability and green-context partition constraints.
#include <cstring>
#include <string>

#include "cuda_driver.h"
#include "handles.h"
#include "hgc.h"

namespace gc = harvest::greenctx;

extern "C" {

const char* hgc_version(void) { return "0.1.0"; }

const char* hgc_last_error(void) { return harvest::last_error(); }

int hgc_device_info(int device_ordinal, hgc_device_info_t* out) {
  if (out == nullptr) {
    harvest::set_last_error("hgc_device_info: out is NULL");
    return HGC_ERR_INVALID;
  }
  std::memset(out, 0, sizeof(*out));
  const harvest::DriverApi* cu = nullptr;
  if (int status = gc::require_driver(&cu); status != HGC_OK) return status;
  out->driver_version = cu->driver_version;
  CUdevice dev;
  if (int status = gc::get_device(cu, device_ordinal, &dev); status != HGC_OK) return status;
  HARVEST_CU_CHECK_RETURN(cu->cuDeviceGetName(out->name, sizeof(out->name) - 1, dev),
                          HGC_ERR_DRIVER);
  HARVEST_CU_CHECK_RETURN(
      cu->cuDeviceGetAttribute(&out->sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
      HGC_ERR_DRIVER);
  HARVEST_CU_CHECK_RETURN(
      cu->cuDeviceGetAttribute(&out->cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
      HGC_ERR_DRIVER);
  HARVEST_CU_CHECK_RETURN(
      cu->cuDeviceGetAttribute(&out->cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
      HGC_ERR_DRIVER);
  size_t total = 0;
  HARVEST_CU_CHECK_RETURN(cu->cuDeviceTotalMem(&total, dev), HGC_ERR_DRIVER);
  out->total_memory_bytes = total;

  out->green_contexts_supported = gc::missing_green_context_entry_points(cu).empty();
  // minSmPartitionSize and smCoscheduledAlignment are CUDA 13 additions to the SM
  // resource; an older driver's bytes at those offsets are not defined for us, so they
  // are read only from a 13.0+ driver and only when plausible. 0 = "not reported".
  if (out->green_contexts_supported && cu->driver_version >= 13000) {
    CUdevResource sm = {};
    HARVEST_CU_CHECK_RETURN(cu->cuDeviceGetDevResource(dev, &sm, CU_DEV_RESOURCE_TYPE_SM),
                            HGC_ERR_DRIVER);
    const unsigned device_sms = sm.sm.smCount;
    if (sm.sm.minSmPartitionSize > 0 && sm.sm.minSmPartitionSize <= device_sms &&
        sm.sm.smCoscheduledAlignment > 0 && sm.sm.smCoscheduledAlignment <= device_sms) {
      out->min_sm_partition_size = static_cast<int>(sm.sm.minSmPartitionSize);
      out->sm_coscheduled_alignment = static_cast<int>(sm.sm.smCoscheduledAlignment);
    }
  }
  return HGC_OK;
}

}  // extern "C"
