// handle.h — what the opaque hvmm_allocator_t of hvmm.h is (shared by the C ABI files).
#pragma once

#include "allocator.h"
#include "hvmm.h"

struct hvmm_allocator {
  explicit hvmm_allocator(const hvmm_config_t& config) : impl(config) {}
  harvest::vmm::Allocator impl;
};
