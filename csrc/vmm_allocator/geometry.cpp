#include "geometry.h"

#include <string>

#include "errors.h"

namespace harvest::vmm {
namespace {

// Page ids are 32-bit; far beyond any device (2^31 pages of 2 MiB = 4 PiB).
constexpr uint64_t kMaxPages = 1ull << 31;

void require_positive(const char* field, int64_t value, const char* fix) {
  if (value <= 0) {
    throw_invalid(std::string(field) + "=" + std::to_string(value) + " must be positive; " + fix);
  }
}

}  // namespace

std::vector<ChunkRun> runs_of_sorted(const std::vector<int64_t>& chunks) {
  std::vector<ChunkRun> runs;
  for (int64_t chunk : chunks) {
    if (!runs.empty() && runs.back().first + runs.back().count == static_cast<uint64_t>(chunk)) {
      ++runs.back().count;
    } else {
      runs.push_back({static_cast<chunk_id_t>(chunk), 1});
    }
  }
  return runs;
}

const char* chunk_state_name(int32_t state) {
  switch (state) {
    case HVMM_CHUNK_MAPPED: return "mapped";
    case HVMM_CHUNK_LENT: return "lent";
    case HVMM_CHUNK_BUSY: return "busy (a lend or reclaim is moving it)";
    case HVMM_CHUNK_BROKEN: return "broken";
    case HVMM_CHUNK_LENDING: return "being lent (its KV fences have not all passed)";
    default: return "unknown";
  }
}

void validate_config(const hvmm_config_t& config) {
  if (config.backend != HVMM_BACKEND_HOST && config.backend != HVMM_BACKEND_CUDA) {
    throw_invalid("backend=" + std::to_string(config.backend) + " is unknown; use 0 (host) or 1 (cuda)");
  }
  require_positive("num_layers", config.num_layers, "pass the model's number of transformer layers");
  require_positive("kv_heads", config.kv_heads, "pass the model's number of KV heads (per tensor-parallel rank)");
  require_positive("head_dim", config.head_dim, "pass the model's attention head dimension");
  require_positive("dtype_bytes", config.dtype_bytes, "pass the KV cache element size (2 for fp16/bf16)");
  require_positive("max_tokens", config.max_tokens, "pass the KV cache's token capacity");
  if (config.page_bytes < 0) {
    throw_invalid("page_bytes=" + std::to_string(config.page_bytes) +
                  " must not be negative; pass 0 for the backend's default");
  }
  if (config.small_pool_bytes < 0) {
    throw_invalid("small_pool_bytes=" + std::to_string(config.small_pool_bytes) +
                  " must not be negative; pass 0 for no small-tensor pool");
  }
  if (config.kv_heads > (1 << 20) || config.head_dim > (1 << 20) || config.dtype_bytes > 64 ||
      config.num_layers > (1 << 20)) {
    throw_invalid("model shape (num_layers=" + std::to_string(config.num_layers) +
                  ", kv_heads=" + std::to_string(config.kv_heads) + ", head_dim=" + std::to_string(config.head_dim) +
                  ", dtype_bytes=" + std::to_string(config.dtype_bytes) + ") is implausibly large");
  }
}

Geometry compute_geometry(const hvmm_config_t& config, uint64_t page_bytes) {
  Geometry g;
  g.page_bytes = page_bytes;
  g.num_layers = static_cast<uint64_t>(config.num_layers);
  g.bytes_per_token = static_cast<uint64_t>(config.kv_heads) * static_cast<uint64_t>(config.head_dim) *
                      static_cast<uint64_t>(config.dtype_bytes);
  if (page_bytes % g.bytes_per_token != 0) {
    throw_invalid("per-token bytes " + std::to_string(g.bytes_per_token) + " (kv_heads " +
                  std::to_string(config.kv_heads) + " x head_dim " + std::to_string(config.head_dim) +
                  " x dtype_bytes " + std::to_string(config.dtype_bytes) + ") do not divide the page size " +
                  std::to_string(page_bytes) +
                  ": a chunk's slice of each KV range must be exactly one page; choose a page size that is a "
                  "multiple of the per-token bytes");
  }
  g.tokens_per_chunk = page_bytes / g.bytes_per_token;
  g.pages_per_chunk = 2 * g.num_layers;
  const uint64_t max_tokens = static_cast<uint64_t>(config.max_tokens);
  g.num_chunks = max_tokens / g.tokens_per_chunk + (max_tokens % g.tokens_per_chunk != 0 ? 1 : 0);
  const uint64_t small_bytes = static_cast<uint64_t>(config.small_pool_bytes);
  g.small_pages = small_bytes / page_bytes + (small_bytes % page_bytes != 0 ? 1 : 0);
  if (g.num_chunks > kMaxPages / g.pages_per_chunk || g.total_pages() > kMaxPages) {
    throw_invalid("max_tokens=" + std::to_string(max_tokens) + " and small_pool_bytes=" +
                  std::to_string(small_bytes) + " need more than 2^31 pages of " + std::to_string(page_bytes) +
                  " bytes; lower them");
  }
  return g;
}

}  // namespace harvest::vmm
