// errors.h — how failures travel inside libharvest_vmm.
//
// Every failure is an `Error` carrying the C ABI status it maps to (hvmm.h); the C ABI
// layer (c_api.cpp) catches it and turns it into status + hvmm_last_error(). Exceptions
// never cross the C ABI and destructors never throw (they log through log_warning).
#pragma once

#include <stdexcept>
#include <string>

#include "hvmm.h"

namespace harvest::vmm {

class Error : public std::runtime_error {
 public:
  Error(int status, const std::string& message) : std::runtime_error(message), status_(status) {}
  int status() const { return status_; }

 private:
  int status_;
};

[[noreturn]] inline void throw_invalid(const std::string& message) { throw Error(HVMM_ERR_INVALID, message); }
[[noreturn]] inline void throw_internal(const std::string& message) { throw Error(HVMM_ERR_INTERNAL, message); }

// "mmap(MAP_FIXED) failed: ENOMEM (Cannot allocate memory, errno 12)"
std::string describe_errno(const std::string& call, int err);

// "0x7f0000200000"
std::string hex(unsigned long long value);

// For destructors and rollback paths that must not throw: one line on stderr.
void log_warning(const std::string& message) noexcept;

}  // namespace harvest::vmm
