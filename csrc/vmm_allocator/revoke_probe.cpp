// Can cuMemSetAccess take access away from a mapped range, and what does it cost?
//
// The way to fewer driver calls per lend that the allocator has not taken (docs/design.md
// §1, "the shadow mapping") maps every KV page a second time, chunk by chunk contiguous,
// and lends a chunk by granting the trainer its shadow run, reclaims it by revoking that
// grant. That is only safe if a revoked range really faults: otherwise a stray trainer
// write after a reclaim would land in KV that decode is using. The documentation says
// neither that PROT_NONE may be set on a mapping that had read/write, nor that kernels
// then fault. This probe asks the device, on one run of `pages` pages mapped twice:
//   1. a kernel writes through the first mapping, a copy reads it through the alias;
//   2. the alias is revoked (PROT_NONE, one call over the run): accepted?
//   3. the first mapping still works (a kernel writes, a copy reads it back);
//   4. the alias is granted again and works (a kernel writes through it, read through 1);
//   5. revoke and grant, `repeats` times each, timed (the cost a lend and a reclaim pay);
//   6. with `try_fault`, a kernel writes through the revoked alias: the context should
//      report the fault (CUDA_ERROR_ILLEGAL_ADDRESS). That leaves the context unusable, so
//      a caller runs this in a process it throws away (harvest.memory.revoke_probe does).
// Every resource is released on every path (RAII); after a fault the releases fail and
// are ignored, as the process is about to end.
#include <cuda.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "errors.h"
#include "hvmm.h"

namespace {

using harvest::DriverApi;

// The kernel each step uses: one thread stores `value` at `target` (a 32-bit word).
// PTX text, as the green-context spin kernel, so the library builds without nvcc.
//   extern "C" __global__ void harvest_poke(unsigned* target, unsigned value) { *target = value; }
const char kPokePtx[] = R"PTX(
.version 7.0
.target sm_60
.address_size 64

.visible .entry harvest_poke(
    .param .u64 harvest_poke_target,
    .param .u32 harvest_poke_value
)
{
    .reg .b32 %r<2>;
    .reg .b64 %rd<3>;

    ld.param.u64 %rd1, [harvest_poke_target];
    ld.param.u32 %r1, [harvest_poke_value];
    cvta.to.global.u64 %rd2, %rd1;
    st.global.u32 [%rd2], %r1;
    ret;
}
)PTX";

class Probe {
 public:
  Probe(const DriverApi* cu, hvmm_revoke_probe_t* out) : cu_(cu), out_(out) {}

  ~Probe() {
    // Reverse order of acquisition. After the deliberate fault every call fails (the
    // context is gone with the process about to end): only a failure without it is news.
    const char* failed = nullptr;
    auto note = [&failed](CUresult result, const char* call) {
      if (result != CUDA_SUCCESS && failed == nullptr) failed = call;
    };
    for (auto it = mapped_.rbegin(); it != mapped_.rend(); ++it) note(cu_->cuMemUnmap(it->first, it->second), "cuMemUnmap");
    for (auto it = pages_.rbegin(); it != pages_.rend(); ++it) note(cu_->cuMemRelease(*it), "cuMemRelease");
    for (auto it = ranges_.rbegin(); it != ranges_.rend(); ++it)
      note(cu_->cuMemAddressFree(it->first, it->second), "cuMemAddressFree");
    if (library_ != nullptr) note(cu_->cuLibraryUnload(library_), "cuLibraryUnload");
    if (switched_) note(cu_->cuCtxSetCurrent(previous_), "cuCtxSetCurrent");
    if (context_ != nullptr) note(cu_->cuDevicePrimaryCtxRelease(device_), "cuDevicePrimaryCtxRelease");
    if (failed != nullptr && !out_->fault_tried) {
      harvest::vmm::log_warning(std::string("hvmm_cuda_probe_revoke: releasing the probe's resources: ") + failed +
                                " failed");
    }
  }
  Probe(const Probe&) = delete;
  Probe& operator=(const Probe&) = delete;

  int run(int device_ordinal, int pages, int repeats, int try_fault) {
    HARVEST_CU_CHECK_RETURN(cu_->cuDeviceGet(&device_, device_ordinal), HVMM_ERR_DRIVER);
    HARVEST_CU_CHECK_RETURN(cu_->cuDevicePrimaryCtxRetain(&context_, device_), HVMM_ERR_DRIVER);
    HARVEST_CU_CHECK_RETURN(cu_->cuCtxGetCurrent(&previous_), HVMM_ERR_DRIVER);
    HARVEST_CU_CHECK_RETURN(cu_->cuCtxSetCurrent(context_), HVMM_ERR_DRIVER);
    switched_ = true;
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device_;
    size_t page = 0;
    HARVEST_CU_CHECK_RETURN(cu_->cuMemGetAllocationGranularity(&page, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                            HVMM_ERR_DRIVER);
    out_->page_bytes = page;
    const size_t bytes = page * static_cast<size_t>(pages);
    CUdeviceptr primary = 0, alias = 0;
    HARVEST_CU_CHECK_RETURN(cu_->cuMemAddressReserve(&primary, bytes, page, 0, 0), HVMM_ERR_DRIVER);
    ranges_.emplace_back(primary, bytes);
    HARVEST_CU_CHECK_RETURN(cu_->cuMemAddressReserve(&alias, bytes, page, 0, 0), HVMM_ERR_DRIVER);
    ranges_.emplace_back(alias, bytes);
    for (int i = 0; i < pages; ++i) {
      CUmemGenericAllocationHandle handle = 0;
      HARVEST_CU_CHECK_RETURN(cu_->cuMemCreate(&handle, page, &prop, 0), HVMM_ERR_DRIVER);
      pages_.push_back(handle);
      const size_t offset = page * static_cast<size_t>(i);
      HARVEST_CU_CHECK_RETURN(cu_->cuMemMap(primary + offset, page, 0, handle, 0), HVMM_ERR_DRIVER);
      mapped_.emplace_back(primary + offset, page);
      HARVEST_CU_CHECK_RETURN(cu_->cuMemMap(alias + offset, page, 0, handle, 0), HVMM_ERR_DRIVER);
      mapped_.emplace_back(alias + offset, page);
    }
    CUmemAccessDesc read_write = {};
    read_write.location = prop.location;
    read_write.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUmemAccessDesc none = read_write;
    none.flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    HARVEST_CU_CHECK_RETURN(cu_->cuMemSetAccess(primary, bytes, &read_write, 1), HVMM_ERR_DRIVER);
    HARVEST_CU_CHECK_RETURN(cu_->cuMemSetAccess(alias, bytes, &read_write, 1), HVMM_ERR_DRIVER);

    HARVEST_CU_CHECK_RETURN(cu_->cuLibraryLoadData(&library_, kPokePtx, nullptr, nullptr, 0, nullptr, nullptr, 0),
                            HVMM_ERR_DRIVER);
    HARVEST_CU_CHECK_RETURN(cu_->cuLibraryGetKernel(&kernel_, library_, "harvest_poke"), HVMM_ERR_DRIVER);

    // A word in the run's last page: the whole run is covered by each call below.
    const size_t word = bytes - page + 64;
    int status = HVMM_OK;
    // 1. The alias reads what a kernel wrote through the first mapping.
    if ((status = poke_and_read(primary + word, alias + word, 0x1111u, &out_->alias_reads_primary)) != HVMM_OK)
      return status;
    // 2. Revoke the alias.
    auto started = std::chrono::steady_clock::now();
    out_->revoke_result = cu_->cuMemSetAccess(alias, bytes, &none, 1);
    out_->first_revoke_us = micros_since(started);
    if (out_->revoke_result != CUDA_SUCCESS) return HVMM_OK;  // the answer: refused
    // 3. The first mapping is untouched by the alias's revoke.
    if ((status = poke_and_read(primary + word, primary + word, 0x2222u, &out_->primary_works_after_revoke)) != HVMM_OK)
      return status;
    // 4. Granted again, the alias works.
    out_->regrant_result = cu_->cuMemSetAccess(alias, bytes, &read_write, 1);
    if (out_->regrant_result != CUDA_SUCCESS) return HVMM_OK;
    if ((status = poke_and_read(alias + word, primary + word, 0x3333u, &out_->alias_works_after_regrant)) != HVMM_OK)
      return status;
    // 5. What a reclaim (revoke) and a lend (grant) of the run would pay.
    std::vector<double> revoke_us, grant_us;
    for (int i = 0; i < repeats; ++i) {
      started = std::chrono::steady_clock::now();
      HARVEST_CU_CHECK_RETURN(cu_->cuMemSetAccess(alias, bytes, &none, 1), HVMM_ERR_DRIVER);
      revoke_us.push_back(micros_since(started));
      started = std::chrono::steady_clock::now();
      HARVEST_CU_CHECK_RETURN(cu_->cuMemSetAccess(alias, bytes, &read_write, 1), HVMM_ERR_DRIVER);
      grant_us.push_back(micros_since(started));
    }
    out_->revoke_us_median = median(revoke_us);
    out_->grant_us_median = median(grant_us);
    out_->timed_repeats = repeats;
    HARVEST_CU_CHECK_RETURN(cu_->cuMemSetAccess(alias, bytes, &none, 1), HVMM_ERR_DRIVER);
    // 6. A kernel writes through the revoked alias.
    if (try_fault) {
      out_->fault_tried = 1;
      CUresult launched = launch_poke(alias + word, 0x4444u);
      out_->write_after_revoke_result = launched != CUDA_SUCCESS ? launched : cu_->cuCtxSynchronize();
    }
    return HVMM_OK;
  }

 private:
  CUresult launch_poke(CUdeviceptr target, unsigned value) {
    void* args[] = {&target, &value};
    return cu_->cuLaunchKernel(reinterpret_cast<CUfunction>(kernel_), 1, 1, 1, 1, 1, 1, 0, nullptr, args, nullptr);
  }

  // A kernel stores `value` at `write`; a copy reads `read` back: *ok = 1 when it matches.
  int poke_and_read(CUdeviceptr write, CUdeviceptr read, unsigned value, int* ok) {
    HARVEST_CU_CHECK_RETURN(launch_poke(write, value), HVMM_ERR_DRIVER);
    HARVEST_CU_CHECK_RETURN(cu_->cuCtxSynchronize(), HVMM_ERR_DRIVER);
    unsigned seen = 0;
    HARVEST_CU_CHECK_RETURN(cu_->cuMemcpyDtoH(&seen, read, sizeof(seen)), HVMM_ERR_DRIVER);
    *ok = seen == value ? 1 : 0;
    return HVMM_OK;
  }

  static double micros_since(std::chrono::steady_clock::time_point started) {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - started).count();
  }

  static double median(std::vector<double> values) {
    if (values.empty()) return -1.0;
    std::sort(values.begin(), values.end());
    const size_t mid = values.size() / 2;
    return values.size() % 2 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
  }

  const DriverApi* cu_;
  hvmm_revoke_probe_t* out_;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
  CUcontext previous_ = nullptr;
  bool switched_ = false;
  CUlibrary library_ = nullptr;
  CUkernel kernel_ = nullptr;
  std::vector<std::pair<CUdeviceptr, size_t>> ranges_;
  std::vector<CUmemGenericAllocationHandle> pages_;
  std::vector<std::pair<CUdeviceptr, size_t>> mapped_;
};

}  // namespace

extern "C" {

int hvmm_cuda_probe_revoke(int device_ordinal, int pages, int repeats, int try_fault, hvmm_revoke_probe_t* out) {
  if (out == nullptr || pages < 1 || repeats < 0) {
    harvest::set_last_error("hvmm_cuda_probe_revoke: out must not be NULL, pages >= 1, repeats >= 0 (got pages=" +
                            std::to_string(pages) + ", repeats=" + std::to_string(repeats) + ")");
    return HVMM_ERR_INVALID;
  }
  std::memset(out, 0, sizeof(*out));
  out->pages = pages;
  out->alias_reads_primary = out->primary_works_after_revoke = out->alias_works_after_regrant = -1;
  out->regrant_result = -1;
  out->revoke_result = -1;
  out->first_revoke_us = out->revoke_us_median = out->grant_us_median = -1.0;
  const DriverApi* cu = harvest::driver();
  if (cu == nullptr) {
    harvest::set_last_error(harvest::driver_unavailable_reason());
    return HVMM_ERR_NO_DRIVER;
  }
  Probe probe(cu, out);
  return probe.run(device_ordinal, pages, repeats, try_fault);
}

const char* hvmm_poke_kernel_ptx(void) { return kPokePtx; }

const char* hvmm_cu_error_name(int result) {
  const DriverApi* cu = harvest::driver();
  const char* name = nullptr;
  if (cu == nullptr || cu->cuGetErrorName(static_cast<CUresult>(result), &name) != CUDA_SUCCESS || name == nullptr)
    return "unknown CUresult";
  return name;
}

}  // extern "C"
