// Capability probe: the one question doctor and start-up ask before building pools.
#include "cuda_driver.h"
#include "hvmm.h"

extern "C" {

const char* hvmm_version(void) { return "0.1.0"; }

const char* hvmm_last_error(void) { return harvest::last_error(); }

int hvmm_cuda_probe(int device_ordinal, hvmm_cuda_probe_t* out) {
  if (out == nullptr) {
    harvest::set_last_error("hvmm_cuda_probe: out is NULL");
    return HVMM_ERR_INVALID;
  }
  *out = hvmm_cuda_probe_t{};
  const harvest::DriverApi* cu = harvest::driver();
  if (cu == nullptr) {
    harvest::set_last_error(harvest::driver_unavailable_reason());
    return HVMM_ERR_NO_DRIVER;
  }
  out->driver_version = cu->driver_version;
  HARVEST_CU_CHECK_RETURN(cu->cuDeviceGetCount(&out->device_count), HVMM_ERR_DRIVER);
  if (device_ordinal < 0 || device_ordinal >= out->device_count) {
    harvest::set_last_error("hvmm_cuda_probe: device " + std::to_string(device_ordinal) +
                            " out of range (" + std::to_string(out->device_count) + " devices)");
    return HVMM_ERR_INVALID;
  }
  CUdevice dev;
  HARVEST_CU_CHECK_RETURN(cu->cuDeviceGet(&dev, device_ordinal), HVMM_ERR_DRIVER);
  HARVEST_CU_CHECK_RETURN(
      cu->cuDeviceGetAttribute(&out->vmm_supported,
                               CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
      HVMM_ERR_DRIVER);
  if (out->vmm_supported) {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    size_t granularity = 0;
    HARVEST_CU_CHECK_RETURN(cu->cuMemGetAllocationGranularity(
                                &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                            HVMM_ERR_DRIVER);
    out->granularity_bytes = granularity;
  }
  return HVMM_OK;
}

}  // extern "C"
