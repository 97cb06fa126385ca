// Device query: SM count, compute capability and green-context partition constraints.
#include <cstring>
#include <string>

#include "cuda_driver.h"
#include "hgc.h"

extern "C" {

const char* hgc_version(void) { return "0.1.0"; }

const char* hgc_last_error(void) { return harvest::last_error(); }

int hgc_device_info(int device_ordinal, hgc_device_info_t* out) {
  if (out == nullptr) {
    harvest::set_last_error("hgc_device_info: out is NULL");
    return HGC_ERR_INVALID;
  }
  std::memset(out, 0, sizeof(*out));
  const harvest::DriverApi* cu = harvest::driver();
  if (cu == nullptr) {
    harvest::set_last_error(harvest::driver_unavailable_reason());
    return HGC_ERR_NO_DRIVER;
  }
  out->driver_version = cu->driver_version;
  int count = 0;
  HARVEST_CU_CHECK_RETURN(cu->cuDeviceGetCount(&count), HGC_ERR_DRIVER);
  if (device_ordinal < 0 || device_ordinal >= count) {
    harvest::set_last_error("hgc_device_info: device " + std::to_string(device_ordinal) +
                            " out of range (" + std::to_string(count) + " devices)");
    return HGC_ERR_INVALID;
  }
  CUdevice dev;
  HARVEST_CU_CHECK_RETURN(cu->cuDeviceGet(&dev, device_ordinal), HGC_ERR_DRIVER);
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

  out->green_contexts_supported =
      cu->cuDeviceGetDevResource != nullptr && cu->cuDevSmResourceSplitByCount != nullptr &&
      cu->cuGreenCtxCreate != nullptr && cu->cuDevResourceGenerateDesc != nullptr;
  if (out->green_contexts_supported) {
    CUdevResource sm = {};
    HARVEST_CU_CHECK_RETURN(cu->cuDeviceGetDevResource(dev, &sm, CU_DEV_RESOURCE_TYPE_SM),
                            HGC_ERR_DRIVER);
    out->min_sm_partition_size = static_cast<int>(sm.sm.minSmPartitionSize);
    out->sm_coscheduled_alignment = static_cast<int>(sm.sm.smCoscheduledAlignment);
  }
  return HGC_OK;
}

}  // extern "C"
