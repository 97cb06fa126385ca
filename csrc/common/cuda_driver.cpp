#include "cuda_driver.h"

#include <dlfcn.h>

#include <mutex>

namespace harvest {
namespace {

DriverApi g_api;
const DriverApi* g_api_ptr = nullptr;
std::string g_unavailable_reason = "driver not probed yet";
std::once_flag g_once;
thread_local std::string t_last_error;

void load_driver() {
  // RTLD_NOW: fail here, not at first call, if the library is broken. The handle is
  // never closed: entry points stay valid for the life of the process.
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    g_unavailable_reason = std::string("libcuda.so.1 not found (no NVIDIA driver): ") +
                           (why != nullptr ? why : "dlopen failed");
    return;
  }
  auto get_proc = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    g_unavailable_reason = "driver too old: cuGetProcAddress_v2 missing (needs CUDA 12.0+ driver)";
    return;
  }
  std::string missing;
  bool required_missing = false;
#define HARVEST_RESOLVE_ENTRY(name, version, required)                                 \
  {                                                                                    \
    void* fn = nullptr;                                                                \
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;       \
    CUresult r = get_proc(#name, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &found);  \
    if (r != CUDA_SUCCESS || found != CU_GET_PROC_ADDRESS_SUCCESS) fn = nullptr;       \
    g_api.name = reinterpret_cast<PFN_##name##_v##version>(fn);                        \
    if (fn == nullptr && (required)) {                                                 \
      required_missing = true;                                                         \
      missing += std::string(missing.empty() ? "" : ", ") + #name;                     \
    }                                                                                  \
  }
  HARVEST_CUDA_DRIVER_ENTRY_POINTS(HARVEST_RESOLVE_ENTRY)
#undef HARVEST_RESOLVE_ENTRY
  if (required_missing) {
    g_unavailable_reason = "driver lacks required entry points: " + missing;
    return;
  }
  g_api.cuDriverGetVersion(&g_api.driver_version);
  CUresult r = g_api.cuInit(0);
  if (r != CUDA_SUCCESS) {
    g_unavailable_reason = describe_cu_error(r, "cuInit(0)", __FILE__, __LINE__);
    return;
  }
  g_api_ptr = &g_api;
  g_unavailable_reason.clear();
}

}  // namespace

const DriverApi* driver() {
  std::call_once(g_once, load_driver);
  return g_api_ptr;
}

const std::string& driver_unavailable_reason() {
  std::call_once(g_once, load_driver);
  return g_unavailable_reason;
}

std::string describe_cu_error(CUresult result, const char* call, const char* file, int line) {
  const char* name = nullptr;
  const char* text = nullptr;
  // g_api may be only partly filled (cuInit failing); the two error helpers are
  // resolved before cuInit runs, so use them whenever present.
  if (g_api.cuGetErrorName != nullptr) g_api.cuGetErrorName(result, &name);
  if (g_api.cuGetErrorString != nullptr) g_api.cuGetErrorString(result, &text);
  std::string message = std::string(call) + " failed: " +
                        (name != nullptr ? name : "CUDA_ERROR_" + std::to_string(result)) +
                        " (" + (text != nullptr ? text : "no description") + ", code " +
                        std::to_string(static_cast<int>(result)) + ")";
  message += std::string(" at ") + file + ":" + std::to_string(line);
  return message;
}

void set_last_error(const std::string& message) { t_last_error = message; }
const char* last_error() { return t_last_error.c_str(); }

}  // namespace harvest
