#include "errors.h"

#include <cstdio>
#include <cstring>

namespace harvest::vmm {

std::string describe_errno(const std::string& call, int err) {
  const char* name = strerrorname_np(err);
  const char* text = strerrordesc_np(err);
  return call + " failed: " + (name != nullptr ? name : "errno") + " (" +
         (text != nullptr ? text : "unknown error") + ", errno " + std::to_string(err) + ")";
}

std::string hex(unsigned long long value) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", value);
  return buf;
}

void log_warning(const std::string& message) noexcept {
  std::fprintf(stderr, "harvest vmm: warning: %s\n", message.c_str());
}

}  // namespace harvest::vmm
