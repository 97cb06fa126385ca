// handles.h — RAII owners of the driver handles libharvest_greenctx creates, and the
// checks every entry point shares (driver present, green contexts available).
//
// Every owner is non-copyable and movable; its destructor releases the handle, logs a
// failure to stderr and never throws. Teardown order inside a ladder (reverse of
// creation): streams, then the green contexts they belong to (cuGreenCtxDestroy does not
// destroy their streams, and a stream outliving its context leaks), then the ladder's
// reference on the primary context.
#pragma once

#include <string>
#include <utility>

#include "cuda_driver.h"

namespace harvest::greenctx {

// Writes "harvest greenctx: <call> failed during teardown: <name> ..." to stderr.
void log_teardown_failure(CUresult result, const char* call);

// "12.4" for 12040.
std::string format_driver_version(int version);

// Each returns an hgc_status and records the message on failure.
int require_driver(const DriverApi** out);
int get_device(const DriverApi* cu, int device_ordinal, CUdevice* out);
// Names of the green-context entry points this driver lacks ("" when it has them all).
std::string missing_green_context_entry_points(const DriverApi* cu);
// HGC_ERR_UNSUPPORTED with "green contexts need a CUDA driver >= 12.4 ..." when missing.
int require_green_contexts(const DriverApi* cu);

template <typename Traits>
class UniqueHandle {
 public:
  using handle_type = typename Traits::handle_type;

  UniqueHandle() = default;
  explicit UniqueHandle(handle_type handle) : handle_(handle) {}
  ~UniqueHandle() { reset(); }
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;
  UniqueHandle(UniqueHandle&& other) noexcept : handle_(std::exchange(other.handle_, handle_type{})) {}
  UniqueHandle& operator=(UniqueHandle&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, handle_type{});
    }
    return *this;
  }

  handle_type get() const { return handle_; }
  explicit operator bool() const { return handle_ != handle_type{}; }
  void reset() {
    if (handle_ != handle_type{}) Traits::release(std::exchange(handle_, handle_type{}));
  }

 private:
  handle_type handle_{};
};

struct StreamTraits {
  using handle_type = CUstream;
  static void release(CUstream stream);
};
struct GreenContextTraits {
  using handle_type = CUgreenCtx;
  static void release(CUgreenCtx context);
};

// A CUstream harvest created (cuGreenCtxStreamCreate or cuStreamCreate).
using Stream = UniqueHandle<StreamTraits>;
// A CUgreenCtx from cuGreenCtxCreate (holds its own reference on the primary context).
using GreenContext = UniqueHandle<GreenContextTraits>;

// One reference on a device's primary context (cuDevicePrimaryCtxRetain/Release).
class PrimaryContextRef {
 public:
  PrimaryContextRef() = default;
  ~PrimaryContextRef() { reset(); }
  PrimaryContextRef(const PrimaryContextRef&) = delete;
  PrimaryContextRef& operator=(const PrimaryContextRef&) = delete;
  PrimaryContextRef(PrimaryContextRef&& other) noexcept
      : device_(other.device_), context_(std::exchange(other.context_, nullptr)) {}
  PrimaryContextRef& operator=(PrimaryContextRef&& other) noexcept {
    if (this != &other) {
      reset();
      device_ = other.device_;
      context_ = std::exchange(other.context_, nullptr);
    }
    return *this;
  }

  int retain(const DriverApi* cu, CUdevice device);  // hgc_status
  CUcontext get() const { return context_; }
  void reset();

 private:
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;  // non-null while the reference is held
};

// Makes `context` current on this thread and restores the previous one on scope exit.
// Check ok() after construction; on failure the message is recorded.
class ScopedCurrentContext {
 public:
  ScopedCurrentContext(const DriverApi* cu, CUcontext context);
  ~ScopedCurrentContext();
  ScopedCurrentContext(const ScopedCurrentContext&) = delete;
  ScopedCurrentContext& operator=(const ScopedCurrentContext&) = delete;
  bool ok() const { return entered_; }

 private:
  const DriverApi* cu_;
  CUcontext previous_ = nullptr;
  bool entered_ = false;
};

}  // namespace harvest::greenctx
