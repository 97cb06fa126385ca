// Calibration kernel (hgc_launch_spin_kernel): pure FP32 arithmetic whose run time is set
// only by how many SMs may run it, used to show that a partition of k SMs is real (a
// kernel takes about total/k times longer on it than on the whole GPU).
//
// It ships as PTX text so the library stays a plain C++ build (no nvcc) and the driver
// JIT-compiles it for whatever GPU is present. PTX ISA 7.0 / sm_60 keeps it loadable by
// every driver that has green contexts. The source it corresponds to:
//
//   extern "C" __global__ void harvest_spin(float* sink, int iterations, float never) {
//     float a = threadIdx.x * 1e-3f, b = a + 1, c = a + 2, d = a + 3;
//     for (int i = 0; i < iterations; ++i) {   // four independent dependent chains
//       a = fmaf(a, 0.9999f, 1e-4f); b = fmaf(b, ...); c = ...; d = ...;
//     }
//     float s = a + b + c + d;
//     if (s == never) sink[blockIdx.x] = s;  // `never` is unreachable (s > 0): no store
//   }                                        // happens, yet the loop cannot be dropped
#include <string>

#include "cuda_driver.h"
#include "handles.h"
#include "hgc.h"

namespace gc = harvest::greenctx;
using harvest::DriverApi;
using harvest::set_last_error;

namespace {

const char kSpinPtx[] = R"PTX(
.version 7.0
.target sm_60
.address_size 64

.visible .entry harvest_spin(
    .param .u64 harvest_spin_sink,
    .param .u32 harvest_spin_iterations,
    .param .f32 harvest_spin_never
)
{
    .reg .pred %p<3>;
    .reg .f32 %f<7>;
    .reg .b32 %r<4>;
    .reg .b64 %rd<4>;

    ld.param.u32 %r1, [harvest_spin_iterations];
    mov.u32 %r2, %tid.x;
    cvt.rn.f32.u32 %f1, %r2;
    mul.f32 %f1, %f1, 0f3A83126F;
    add.f32 %f2, %f1, 0f3F800000;
    add.f32 %f3, %f1, 0f40000000;
    add.f32 %f4, %f1, 0f40400000;
    setp.lt.s32 %p1, %r1, 1;
    @%p1 bra $DONE;
$LOOP:
    fma.rn.f32 %f1, %f1, 0f3F7FF972, 0f38D1B717;
    fma.rn.f32 %f2, %f2, 0f3F7FF972, 0f38D1B717;
    fma.rn.f32 %f3, %f3, 0f3F7FF972, 0f38D1B717;
    fma.rn.f32 %f4, %f4, 0f3F7FF972, 0f38D1B717;
    sub.s32 %r1, %r1, 1;
    setp.ne.s32 %p1, %r1, 0;
    @%p1 bra $LOOP;
$DONE:
    add.f32 %f5, %f1, %f2;
    add.f32 %f5, %f5, %f3;
    add.f32 %f5, %f5, %f4;
    ld.param.f32 %f6, [harvest_spin_never];
    setp.neu.f32 %p2, %f5, %f6;
    @%p2 bra $EXIT;
    ld.param.u64 %rd1, [harvest_spin_sink];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r3, %ctaid.x;
    mul.wide.u32 %rd2, %r3, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.f32 [%rd3], %f5;
$EXIT:
    ret;
}
)PTX";

struct LoadedKernel {
  CUkernel kernel = nullptr;
  std::string error;  // why `kernel` is null
};

LoadedKernel load_kernel(const DriverApi* cu) {
  LoadedKernel loaded;
  CUlibrary library = nullptr;
  CUresult r = cu->cuLibraryLoadData(&library, kSpinPtx, nullptr, nullptr, 0, nullptr, nullptr, 0);
  if (r != CUDA_SUCCESS) {
    loaded.error = harvest::describe_cu_error(r, "cuLibraryLoadData(spin kernel PTX)", __FILE__, __LINE__);
    return loaded;
  }
  r = cu->cuLibraryGetKernel(&loaded.kernel, library, "harvest_spin");
  if (r != CUDA_SUCCESS) {
    loaded.kernel = nullptr;
    loaded.error = harvest::describe_cu_error(r, "cuLibraryGetKernel(harvest_spin)", __FILE__, __LINE__);
  }
  return loaded;
}

// Loaded once per process (a function-local static: initialised once, thread-safely)
// and never unloaded: unloading at exit would race the driver's own teardown, and the
// library is a few hundred bytes.
const LoadedKernel& spin_kernel(const DriverApi* cu) {
  static const LoadedKernel loaded = load_kernel(cu);
  return loaded;
}

}  // namespace

extern "C" {

const char* hgc_spin_kernel_ptx(void) { return kSpinPtx; }

int hgc_launch_spin_kernel(uint64_t stream, int num_blocks, int iterations) {
  if (stream == 0) {
    // The legacy default stream would bind the launch to whatever context is current,
    // which defeats the point of measuring a particular partition.
    set_last_error("hgc_launch_spin_kernel: stream must be a real stream, not 0 (default stream)");
    return HGC_ERR_INVALID;
  }
  if (num_blocks < 1 || iterations < 1) {
    set_last_error("hgc_launch_spin_kernel: num_blocks (" + std::to_string(num_blocks) +
                   ") and iterations (" + std::to_string(iterations) + ") must be >= 1");
    return HGC_ERR_INVALID;
  }
  const DriverApi* cu = nullptr;
  if (int s = gc::require_driver(&cu); s != HGC_OK) return s;
  const LoadedKernel& loaded = spin_kernel(cu);
  if (loaded.kernel == nullptr) {
    set_last_error(loaded.error);
    return HGC_ERR_DRIVER;
  }
  CUdeviceptr sink = 0;  // never written: see the kernel's `never` guard
  float never = -1.0f;
  void* params[] = {&sink, &iterations, &never};
  // A CUkernel cast to CUfunction runs in the context of the stream it is launched on.
  HARVEST_CU_CHECK_RETURN(
      cu->cuLaunchKernel(reinterpret_cast<CUfunction>(loaded.kernel), static_cast<unsigned>(num_blocks),
                         1, 1, HGC_SPIN_THREADS, 1, 1, 0, reinterpret_cast<CUstream>(stream),
                         params, nullptr),
      HGC_ERR_DRIVER);
  return HGC_OK;
}

}  // extern "C"
