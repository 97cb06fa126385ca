// The SM ladder: split preview, creation, queries and teardown (see Note [SM ladder] in
// hgc.h). Every handle is owned by an RAII member, so an early return on any failure
// releases exactly what that call created.
#include <memory>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "handles.h"
#include "hgc.h"

namespace gc = harvest::greenctx;
using harvest::DriverApi;
using harvest::set_last_error;

namespace {

struct Level {
  int decode_sms = 0;
  int trainer_sms = 0;
  // Contexts are declared before streams so that streams are destroyed first.
  gc::GreenContext decode_context;
  gc::GreenContext trainer_context;
  gc::Stream decode_stream;
  gc::Stream trainer_stream;
};

}  // namespace

// Defined at global scope: the C header declares `struct hgc_ladder` opaque.
struct hgc_ladder {
  int device_ordinal = 0;
  int total_sms = 0;
  bool green_stream_api = false;
  gc::PrimaryContextRef primary;  // declared first: released after every level
  std::vector<Level> levels;
};

namespace {

// The device's whole SM resource: the input of every split.
int whole_device_sms(const DriverApi* cu, CUdevice device, CUdevResource* out) {
  *out = CUdevResource{};
  HARVEST_CU_CHECK_RETURN(cu->cuDeviceGetDevResource(device, out, CU_DEV_RESOURCE_TYPE_SM),
                          HGC_ERR_DRIVER);
  return HGC_OK;
}

int check_decode_request(int decode_sms, int total_sms) {
  if (decode_sms > total_sms) {
    set_last_error("decode_sms " + std::to_string(decode_sms) + " exceeds the device's " +
                   std::to_string(total_sms) + " SMs");
    return HGC_ERR_INVALID;
  }
  return HGC_OK;
}

// One split of the whole device: `group` gets >= decode_sms SMs (rounded up by the
// driver), `remainder` the rest. Both come from the same call, so they are disjoint.
int split_for_decode(const DriverApi* cu, const CUdevResource& whole, int decode_sms,
                     CUdevResource* group, CUdevResource* remainder) {
  *group = CUdevResource{};
  *remainder = CUdevResource{};
  unsigned num_groups = 1;
  HARVEST_CU_CHECK_RETURN(cu->cuDevSmResourceSplitByCount(group, &num_groups, &whole, remainder,
                                                          0, static_cast<unsigned>(decode_sms)),
                          HGC_ERR_DRIVER);
  const std::string asked = "a split of " + std::to_string(decode_sms) + " decode SMs from " +
                            std::to_string(whole.sm.smCount);
  if (num_groups != 1) {
    set_last_error(asked + " is not realisable: cuDevSmResourceSplitByCount made no group");
    return HGC_ERR_INVALID;
  }
  if (remainder->sm.smCount == 0) {
    set_last_error(asked + " leaves the trainer no SMs (the driver rounded the group up to " +
                   std::to_string(group->sm.smCount) + ")");
    return HGC_ERR_INVALID;
  }
  return HGC_OK;
}

// A green context over `resource`; `provisioned_sms` is what the context really got.
int create_green_context(const DriverApi* cu, CUdevice device, CUdevResource* resource,
                         gc::GreenContext* out, int* provisioned_sms) {
  CUdevResourceDesc desc = nullptr;
  HARVEST_CU_CHECK_RETURN(cu->cuDevResourceGenerateDesc(&desc, resource, 1), HGC_ERR_DRIVER);
  CUgreenCtx context = nullptr;
  HARVEST_CU_CHECK_RETURN(
      cu->cuGreenCtxCreate(&context, desc, device, CU_GREEN_CTX_DEFAULT_STREAM), HGC_ERR_DRIVER);
  *out = gc::GreenContext(context);
  CUdevResource got = {};
  HARVEST_CU_CHECK_RETURN(cu->cuGreenCtxGetDevResource(context, &got, CU_DEV_RESOURCE_TYPE_SM),
                          HGC_ERR_DRIVER);
  *provisioned_sms = static_cast<int>(got.sm.smCount);
  return HGC_OK;
}

// A non-blocking stream whose work runs on `context`'s SMs. cuGreenCtxStreamCreate
// (12.5+) ignores the current context; on 12.4 the context converted by
// cuCtxFromGreenCtx is made current for cuStreamCreate, then the previous one restored.
int create_green_stream(const DriverApi* cu, CUgreenCtx context, gc::Stream* out) {
  CUstream stream = nullptr;
  if (cu->cuGreenCtxStreamCreate != nullptr) {
    HARVEST_CU_CHECK_RETURN(cu->cuGreenCtxStreamCreate(&stream, context, CU_STREAM_NON_BLOCKING, 0),
                            HGC_ERR_DRIVER);
  } else {
    CUcontext converted = nullptr;
    HARVEST_CU_CHECK_RETURN(cu->cuCtxFromGreenCtx(&converted, context), HGC_ERR_DRIVER);
    gc::ScopedCurrentContext current(cu, converted);
    if (!current.ok()) return HGC_ERR_DRIVER;
    HARVEST_CU_CHECK_RETURN(cu->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), HGC_ERR_DRIVER);
  }
  *out = gc::Stream(stream);
  return HGC_OK;
}

int build_whole_device_level(const DriverApi* cu, CUcontext primary, int total_sms, Level* level) {
  gc::ScopedCurrentContext current(cu, primary);
  if (!current.ok()) return HGC_ERR_DRIVER;
  CUstream stream = nullptr;
  HARVEST_CU_CHECK_RETURN(cu->cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), HGC_ERR_DRIVER);
  level->decode_stream = gc::Stream(stream);
  level->decode_sms = total_sms;
  level->trainer_sms = 0;
  return HGC_OK;
}

int build_partial_level(const DriverApi* cu, CUdevice device, const CUdevResource& whole,
                        int decode_sms, Level* level) {
  CUdevResource group, remainder;
  if (int s = split_for_decode(cu, whole, decode_sms, &group, &remainder); s != HGC_OK) return s;
  if (int s = create_green_context(cu, device, &group, &level->decode_context, &level->decode_sms);
      s != HGC_OK) {
    return s;
  }
  if (int s = create_green_context(cu, device, &remainder, &level->trainer_context,
                                   &level->trainer_sms);
      s != HGC_OK) {
    return s;
  }
  if (int s = create_green_stream(cu, level->decode_context.get(), &level->decode_stream);
      s != HGC_OK) {
    return s;
  }
  return create_green_stream(cu, level->trainer_context.get(), &level->trainer_stream);
}

int check_ladder_request(const int* decode_sms, int num_levels, hgc_ladder_t** out) {
  if (out == nullptr || decode_sms == nullptr) {
    set_last_error("hgc_ladder_create: decode_sms and out must not be NULL");
    return HGC_ERR_INVALID;
  }
  if (num_levels < 1 || num_levels > HGC_MAX_LEVELS) {
    set_last_error("hgc_ladder_create: num_levels is " + std::to_string(num_levels) +
                   "; a ladder has 1 to " + std::to_string(HGC_MAX_LEVELS) + " levels");
    return HGC_ERR_INVALID;
  }
  for (int i = 0; i < num_levels; ++i) {
    if (decode_sms[i] < 1) {
      set_last_error("hgc_ladder_create: decode_sms[" + std::to_string(i) + "] is " +
                     std::to_string(decode_sms[i]) + "; decode needs at least 1 SM");
      return HGC_ERR_INVALID;
    }
    if (i > 0 && decode_sms[i] <= decode_sms[i - 1]) {
      set_last_error("hgc_ladder_create: decode_sms must be strictly ascending (entry " +
                     std::to_string(i) + " is " + std::to_string(decode_sms[i]) +
                     " after " + std::to_string(decode_sms[i - 1]) + ")");
      return HGC_ERR_INVALID;
    }
  }
  return HGC_OK;
}

int drain(const DriverApi* cu, const gc::Stream& stream, const char* what, int level, int status) {
  if (!stream) return status;
  CUresult r = cu->cuStreamSynchronize(stream.get());
  if (r == CUDA_SUCCESS) return status;
  std::string call = std::string("cuStreamSynchronize(level ") + std::to_string(level) + " " + what +
                     " stream)";
  std::string message = harvest::describe_cu_error(r, call.c_str(), __FILE__, __LINE__);
  gc::log_teardown_failure(r, call.c_str());
  if (status == HGC_OK) set_last_error(message);
  return HGC_ERR_DRIVER;
}

}  // namespace

// The driver, green-context support, the device and its whole SM resource: what every
// entry point below needs before it can plan or split.
static int open_device_sms(int device_ordinal, const DriverApi** cu, CUdevice* device, CUdevResource* whole) {
  if (int s = gc::require_driver(cu); s != HGC_OK) return s;
  if (int s = gc::require_green_contexts(*cu); s != HGC_OK) return s;
  if (int s = gc::get_device(*cu, device_ordinal, device); s != HGC_OK) return s;
  return whole_device_sms(*cu, *device, whole);
}

extern "C" {

int hgc_split_preview(int device_ordinal, int decode_sms, int* realised_decode_sms,
                      int* realised_trainer_sms) {
  if (realised_decode_sms == nullptr || realised_trainer_sms == nullptr) {
    set_last_error("hgc_split_preview: output pointers must not be NULL");
    return HGC_ERR_INVALID;
  }
  if (decode_sms < 1) {
    set_last_error("hgc_split_preview: decode_sms is " + std::to_string(decode_sms) +
                   "; decode needs at least 1 SM");
    return HGC_ERR_INVALID;
  }
  const DriverApi* cu = nullptr;
  CUdevice device;
  CUdevResource whole;
  if (int s = open_device_sms(device_ordinal, &cu, &device, &whole); s != HGC_OK) return s;
  const int total = static_cast<int>(whole.sm.smCount);
  if (int s = check_decode_request(decode_sms, total); s != HGC_OK) return s;
  if (decode_sms == total) {
    *realised_decode_sms = total;
    *realised_trainer_sms = 0;
    return HGC_OK;
  }
  CUdevResource group, remainder;
  if (int s = split_for_decode(cu, whole, decode_sms, &group, &remainder); s != HGC_OK) return s;
  *realised_decode_sms = static_cast<int>(group.sm.smCount);
  *realised_trainer_sms = static_cast<int>(remainder.sm.smCount);
  return HGC_OK;
}

int hgc_ladder_create(int device_ordinal, const int* decode_sms, int num_levels,
                      hgc_ladder_t** out) {
  if (int s = check_ladder_request(decode_sms, num_levels, out); s != HGC_OK) return s;
  const DriverApi* cu = nullptr;
  CUdevice device;
  CUdevResource whole;
  if (int s = open_device_sms(device_ordinal, &cu, &device, &whole); s != HGC_OK) return s;

  auto ladder = std::make_unique<hgc_ladder>();
  ladder->device_ordinal = device_ordinal;
  ladder->total_sms = static_cast<int>(whole.sm.smCount);
  ladder->green_stream_api = cu->cuGreenCtxStreamCreate != nullptr;
  // Every request is checked against the device before anything is created.
  for (int i = 0; i < num_levels; ++i) {
    if (int s = check_decode_request(decode_sms[i], ladder->total_sms); s != HGC_OK) return s;
  }
  // Green contexts retain the primary context themselves; this reference keeps it alive
  // for the whole-device level's stream and avoids repeated primary-context set-up.
  if (int s = ladder->primary.retain(cu, device); s != HGC_OK) return s;
  ladder->levels.resize(static_cast<size_t>(num_levels));
  for (int i = 0; i < num_levels; ++i) {
    Level& level = ladder->levels[static_cast<size_t>(i)];
    int s = decode_sms[i] == ladder->total_sms
                ? build_whole_device_level(cu, ladder->primary.get(), ladder->total_sms, &level)
                : build_partial_level(cu, device, whole, decode_sms[i], &level);
    if (s != HGC_OK) {
      set_last_error("level " + std::to_string(i) + " (" + std::to_string(decode_sms[i]) +
                     " decode SMs): " + harvest::last_error());
      return s;  // `ladder` releases every level built so far
    }
  }
  *out = ladder.release();
  return HGC_OK;
}

int hgc_ladder_get_info(const hgc_ladder_t* ladder, hgc_ladder_info_t* out) {
  if (ladder == nullptr || out == nullptr) {
    set_last_error("hgc_ladder_get_info: ladder and out must not be NULL");
    return HGC_ERR_INVALID;
  }
  out->device_ordinal = ladder->device_ordinal;
  out->total_sms = ladder->total_sms;
  out->num_levels = static_cast<int>(ladder->levels.size());
  out->green_stream_api = ladder->green_stream_api ? 1 : 0;
  return HGC_OK;
}

int hgc_ladder_get_level(const hgc_ladder_t* ladder, int index, hgc_level_info_t* out) {
  if (ladder == nullptr || out == nullptr) {
    set_last_error("hgc_ladder_get_level: ladder and out must not be NULL");
    return HGC_ERR_INVALID;
  }
  if (index < 0 || index >= static_cast<int>(ladder->levels.size())) {
    set_last_error("hgc_ladder_get_level: index " + std::to_string(index) + " out of range (" +
                   std::to_string(ladder->levels.size()) + " levels)");
    return HGC_ERR_INVALID;
  }
  const Level& level = ladder->levels[static_cast<size_t>(index)];
  out->decode_sms = level.decode_sms;
  out->trainer_sms = level.trainer_sms;
  out->decode_stream = reinterpret_cast<uint64_t>(level.decode_stream.get());
  out->trainer_stream = reinterpret_cast<uint64_t>(level.trainer_stream.get());
  return HGC_OK;
}

int hgc_ladder_destroy(hgc_ladder_t* ladder) {
  if (ladder == nullptr) return HGC_OK;
  std::unique_ptr<hgc_ladder> owned(ladder);
  const DriverApi* cu = harvest::driver();
  int status = HGC_OK;
  if (cu != nullptr) {
    // Drain first: destroying a green context under running work is undefined, and
    // cuStreamDestroy alone returns before the stream's work has finished.
    for (size_t i = 0; i < owned->levels.size(); ++i) {
      status = drain(cu, owned->levels[i].decode_stream, "decode", static_cast<int>(i), status);
      status = drain(cu, owned->levels[i].trainer_stream, "trainer", static_cast<int>(i), status);
    }
  }
  return status;  // `owned` now destroys streams, contexts, then the primary reference
}

}  // extern "C"
