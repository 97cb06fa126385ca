// backend_cuda.cpp — the driver VMM API (cuMemAddressReserve / cuMemCreate / cuMemMap /
// cuMemSetAccess / cuMemUnmap) and CUDA events, reached through the dlopen'd driver
// table in csrc/common/cuda_driver.h, so this file builds and loads without a driver.
//
// Every call runs with the device's primary context current (the one PyTorch uses), set
// for the call and restored after, so the allocator can be driven from any thread.
// Pages are pinned device memory on one device; access is read/write for that device.
#include <cuda.h>

#include "backend.h"
#include "cuda_driver.h"
#include "errors.h"

#define HVMM_CU_THROW(expr)                                                                          \
  do {                                                                                               \
    CUresult hvmm_cu_result_ = (expr);                                                               \
    if (hvmm_cu_result_ != CUDA_SUCCESS) {                                                           \
      throw ::harvest::vmm::Error(HVMM_ERR_DRIVER, ::harvest::describe_cu_error(hvmm_cu_result_, #expr, \
                                                                                __FILE__, __LINE__)); \
    }                                                                                                \
  } while (0)

namespace harvest::vmm {
namespace {

// Makes `context` current on this thread for one scope, then restores the previous one.
class ContextScope {
 public:
  ContextScope(const DriverApi* cu, CUcontext context) : cu_(cu) {
    HVMM_CU_THROW(cu_->cuCtxGetCurrent(&previous_));
    if (previous_ != context) {
      HVMM_CU_THROW(cu_->cuCtxSetCurrent(context));
      switched_ = true;
    }
  }
  ~ContextScope() {
    if (switched_ && cu_->cuCtxSetCurrent(previous_) != CUDA_SUCCESS) {
      log_warning("cuCtxSetCurrent: could not restore the caller's CUDA context");
    }
  }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  const DriverApi* cu_;
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(const DriverApi* cu, CUdevice device, CUcontext context, uint64_t page_bytes)
      : Backend(page_bytes), cu_(cu), device_(device), context_(context) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device;
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }

  ~CudaBackend() override {
    destroy_pooled_events();
    if (cu_->cuDevicePrimaryCtxRelease(device_) != CUDA_SUCCESS) {
      log_warning("cuDevicePrimaryCtxRelease failed while tearing down the CUDA backend");
    }
  }

  const char* name() const override { return "cuda"; }

 protected:
  int failure_status() const override { return HVMM_ERR_DRIVER; }

  const char* call_text(CallKind kind) const override {
    switch (kind) {
      case CallKind::kReserve: return "cuMemAddressReserve";
      case CallKind::kFreeRange: return "cuMemAddressFree";
      case CallKind::kCreate: return "cuMemCreate";
      case CallKind::kRelease: return "cuMemRelease";
      case CallKind::kMap: return "cuMemMap";
      case CallKind::kUnmap: return "cuMemUnmap";
      case CallKind::kSetAccess: return "cuMemSetAccess";
      case CallKind::kEventCreate: return "cuEventCreate";
      case CallKind::kFenceRecord: return "cuEventRecord";
      case CallKind::kFenceQuery: return "cuEventQuery";
      default: return "cuEventSynchronize";
    }
  }

  va_t do_reserve(uint64_t bytes) override {
    ContextScope scope(cu_, context_);
    CUdeviceptr va = 0;
    HVMM_CU_THROW(cu_->cuMemAddressReserve(&va, bytes, page_bytes(), 0, 0));
    return static_cast<va_t>(va);
  }

  void do_free_range(va_t va, uint64_t bytes) override {
    ContextScope scope(cu_, context_);
    HVMM_CU_THROW(cu_->cuMemAddressFree(static_cast<CUdeviceptr>(va), bytes));
  }

  phys_handle_t do_create_page(uint64_t bytes) override {
    ContextScope scope(cu_, context_);
    CUmemGenericAllocationHandle handle = 0;
    HVMM_CU_THROW(cu_->cuMemCreate(&handle, bytes, &prop_, 0));
    return static_cast<phys_handle_t>(handle);
  }

  void do_release_page(phys_handle_t page) override {
    ContextScope scope(cu_, context_);
    HVMM_CU_THROW(cu_->cuMemRelease(static_cast<CUmemGenericAllocationHandle>(page)));
  }

  void do_map(va_t va, phys_handle_t page, uint64_t bytes) override {
    ContextScope scope(cu_, context_);
    // Offset 0: cuMemMap's offset "currently must be zero" (cuda.h), so a mapping always
    // starts at its allocation's first byte.
    HVMM_CU_THROW(cu_->cuMemMap(static_cast<CUdeviceptr>(va), bytes, 0,
                                static_cast<CUmemGenericAllocationHandle>(page), 0));
  }

  void do_unmap(va_t va, uint64_t bytes) override {
    ContextScope scope(cu_, context_);
    HVMM_CU_THROW(cu_->cuMemUnmap(static_cast<CUdeviceptr>(va), bytes));
  }

  void do_set_access(va_t va, uint64_t bytes) override {
    ContextScope scope(cu_, context_);
    HVMM_CU_THROW(cu_->cuMemSetAccess(static_cast<CUdeviceptr>(va), bytes, &access_, 1));
  }

  event_t do_create_event() override {
    ContextScope scope(cu_, context_);
    CUevent event = nullptr;
    HVMM_CU_THROW(cu_->cuEventCreate(&event, CU_EVENT_DISABLE_TIMING));
    return reinterpret_cast<event_t>(event);
  }

  void do_destroy_event(event_t event) noexcept override {
    try {
      ContextScope scope(cu_, context_);
      if (cu_->cuEventDestroy(reinterpret_cast<CUevent>(event)) != CUDA_SUCCESS) {
        log_warning("cuEventDestroy failed for a fence event");
      }
    } catch (const std::exception& e) {
      log_warning(std::string("destroying a fence event: ") + e.what());
    }
  }

  void do_record_fence(event_t event, stream_t stream) override {
    ContextScope scope(cu_, context_);
    HVMM_CU_THROW(cu_->cuEventRecord(reinterpret_cast<CUevent>(event), reinterpret_cast<CUstream>(stream)));
  }

  bool do_fence_passed(event_t event) override {
    ContextScope scope(cu_, context_);
    CUresult result = cu_->cuEventQuery(reinterpret_cast<CUevent>(event));
    if (result == CUDA_ERROR_NOT_READY) return false;
    HVMM_CU_THROW(result);
    return true;
  }

  void do_wait_fence(event_t event) override {
    ContextScope scope(cu_, context_);
    HVMM_CU_THROW(cu_->cuEventSynchronize(reinterpret_cast<CUevent>(event)));
  }

 private:
  const DriverApi* cu_;
  CUdevice device_;
  CUcontext context_;
  CUmemAllocationProp prop_ = {};
  CUmemAccessDesc access_ = {};
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device_ordinal, uint64_t page_bytes) {
  const DriverApi* cu = driver();
  if (cu == nullptr) throw Error(HVMM_ERR_NO_DRIVER, driver_unavailable_reason());
  int device_count = 0;
  HVMM_CU_THROW(cu->cuDeviceGetCount(&device_count));
  if (device_ordinal < 0 || device_ordinal >= device_count) {
    throw_invalid("device_ordinal=" + std::to_string(device_ordinal) + " is out of range (" +
                  std::to_string(device_count) + " CUDA devices visible)");
  }
  CUdevice device = 0;
  HVMM_CU_THROW(cu->cuDeviceGet(&device, device_ordinal));
  int vmm_supported = 0;
  HVMM_CU_THROW(cu->cuDeviceGetAttribute(&vmm_supported,
                                         CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device));
  if (!vmm_supported) {
    throw_invalid("device " + std::to_string(device_ordinal) +
                  " does not support CUDA virtual memory management; use the host backend");
  }
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  size_t granularity = 0;
  HVMM_CU_THROW(cu->cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  if (page_bytes == 0) page_bytes = granularity;
  if ((page_bytes & (page_bytes - 1)) != 0 || page_bytes % granularity != 0) {
    throw_invalid("page_bytes=" + std::to_string(page_bytes) +
                  " must be a power of two and a multiple of the device's VMM granularity (" +
                  std::to_string(granularity) + "); pass 0 for the granularity");
  }
  CUcontext context = nullptr;
  HVMM_CU_THROW(cu->cuDevicePrimaryCtxRetain(&context, device));
  try {
    return std::make_unique<CudaBackend>(cu, device, context, page_bytes);
  } catch (...) {
    cu->cuDevicePrimaryCtxRelease(device);
    throw;
  }
}

}  // namespace harvest::vmm
