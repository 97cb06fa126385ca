// RAII owners and shared checks of libharvest_greenctx (see handles.h).
#include "handles.h"

#include <cstdio>

#include "hgc.h"

namespace harvest::greenctx {

void log_teardown_failure(CUresult result, const char* call) {
  std::string message = describe_cu_error(result, call, __FILE__, __LINE__);
  std::fprintf(stderr, "harvest greenctx: teardown: %s\n", message.c_str());
}

std::string format_driver_version(int version) {
  return std::to_string(version / 1000) + "." + std::to_string((version % 1000) / 10);
}

int require_driver(const DriverApi** out) {
  const DriverApi* cu = driver();
  if (cu == nullptr) {
    set_last_error("no driver: " + driver_unavailable_reason());
    return HGC_ERR_NO_DRIVER;
  }
  *out = cu;
  return HGC_OK;
}

int get_device(const DriverApi* cu, int device_ordinal, CUdevice* out) {
  int count = 0;
  HARVEST_CU_CHECK_RETURN(cu->cuDeviceGetCount(&count), HGC_ERR_DRIVER);
  if (device_ordinal < 0 || device_ordinal >= count) {
    set_last_error("device " + std::to_string(device_ordinal) + " out of range (" +
                   std::to_string(count) + " devices visible)");
    return HGC_ERR_INVALID;
  }
  HARVEST_CU_CHECK_RETURN(cu->cuDeviceGet(out, device_ordinal), HGC_ERR_DRIVER);
  return HGC_OK;
}

std::string missing_green_context_entry_points(const DriverApi* cu) {
  // cuGreenCtxStreamCreate (12.5) is not listed: streams fall back to cuCtxFromGreenCtx +
  // cuStreamCreate on a 12.4 driver.
  const std::pair<const char*, bool> needed[] = {
      {"cuDeviceGetDevResource", cu->cuDeviceGetDevResource != nullptr},
      {"cuDevSmResourceSplitByCount", cu->cuDevSmResourceSplitByCount != nullptr},
      {"cuDevResourceGenerateDesc", cu->cuDevResourceGenerateDesc != nullptr},
      {"cuGreenCtxCreate", cu->cuGreenCtxCreate != nullptr},
      {"cuGreenCtxDestroy", cu->cuGreenCtxDestroy != nullptr},
      {"cuGreenCtxGetDevResource", cu->cuGreenCtxGetDevResource != nullptr},
      {"cuCtxFromGreenCtx", cu->cuCtxFromGreenCtx != nullptr},
  };
  std::string missing;
  for (const auto& [name, present] : needed) {
    if (!present) missing += std::string(missing.empty() ? "" : ", ") + name;
  }
  return missing;
}

int require_green_contexts(const DriverApi* cu) {
  std::string missing = missing_green_context_entry_points(cu);
  if (missing.empty()) return HGC_OK;
  set_last_error("green contexts need a CUDA driver >= 12.4 (this driver is " +
                 format_driver_version(cu->driver_version) + "; missing " + missing + ")");
  return HGC_ERR_UNSUPPORTED;
}

void StreamTraits::release(CUstream stream) {
  const DriverApi* cu = driver();
  if (cu == nullptr) return;
  CUresult r = cu->cuStreamDestroy(stream);
  if (r != CUDA_SUCCESS) log_teardown_failure(r, "cuStreamDestroy");
}

void GreenContextTraits::release(CUgreenCtx context) {
  const DriverApi* cu = driver();
  if (cu == nullptr || cu->cuGreenCtxDestroy == nullptr) return;
  CUresult r = cu->cuGreenCtxDestroy(context);
  if (r != CUDA_SUCCESS) log_teardown_failure(r, "cuGreenCtxDestroy");
}

int PrimaryContextRef::retain(const DriverApi* cu, CUdevice device) {
  reset();
  CUcontext context = nullptr;
  HARVEST_CU_CHECK_RETURN(cu->cuDevicePrimaryCtxRetain(&context, device), HGC_ERR_DRIVER);
  device_ = device;
  context_ = context;
  return HGC_OK;
}

void PrimaryContextRef::reset() {
  if (context_ == nullptr) return;
  context_ = nullptr;
  const DriverApi* cu = driver();
  if (cu == nullptr) return;
  CUresult r = cu->cuDevicePrimaryCtxRelease(device_);
  if (r != CUDA_SUCCESS) log_teardown_failure(r, "cuDevicePrimaryCtxRelease");
}

ScopedCurrentContext::ScopedCurrentContext(const DriverApi* cu, CUcontext context) : cu_(cu) {
  CUresult r = cu_->cuCtxGetCurrent(&previous_);
  if (r != CUDA_SUCCESS) {
    set_last_error(describe_cu_error(r, "cuCtxGetCurrent(&previous)", __FILE__, __LINE__));
    return;
  }
  r = cu_->cuCtxSetCurrent(context);
  if (r != CUDA_SUCCESS) {
    set_last_error(describe_cu_error(r, "cuCtxSetCurrent(context)", __FILE__, __LINE__));
    return;
  }
  entered_ = true;
}

ScopedCurrentContext::~ScopedCurrentContext() {
  if (!entered_) return;
  CUresult r = cu_->cuCtxSetCurrent(previous_);
  if (r != CUDA_SUCCESS) log_teardown_failure(r, "cuCtxSetCurrent(previous)");
}

}  // namespace harvest::greenctx
