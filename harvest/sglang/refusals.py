"""The SGLang 0.5.23 server configurations harvest refuses to start with, each named by
the flag (or the object) that causes it and why.

``HarvestRuntime.attach`` asks :func:`problems` before it builds anything and refuses
with all of them at once: a server either runs every path that touches the KV pool's free
lists safely with chunks lent, or does not start (docs/sglang-integration.md, "Paths
that touch the KV pool's free lists"). A request is never refused here: every runtime
path of a server that started is safe with chunks lent.

Every ``ServerArgs`` field read here is in :data:`SGLANG_ATTRIBUTES`, resolved by the
plugin at load (harvest.sglang.plugin): a field another SGLang version renamed refuses
at start-up instead of reading as "off".
"""

from __future__ import annotations

SERVER_ARGS = "sglang.srt.server_args.ServerArgs"


class UnsupportedServer(RuntimeError):
    """harvest is enabled on a server configuration it refuses: SGLang does not start."""


# A KV tier beyond the device pool copies KV between device slots and host memory or
# storage on streams of its own, which harvest's lends do not fence: a chunk could be
# handed to the trainer while a copy of its slots still runs. (HiCache's and the decode offload's host pools
# need CUDA: they cannot be tried on CPU either.)
_KV_TIER = ("copies KV between the device pool and host memory or storage on streams of its own, which harvest's "
            "lends do not wait for (not checked with lent chunks)")

# (ServerArgs field, its flag, why harvest refuses it). A field counts as set when truthy.
REFUSED_FLAGS = (
    ("enable_memory_saver", "--enable-memory-saver",
     "/release_memory_occupation would release neither the KV cache (harvest backs it, outside the memory saver's "
     "region) nor the KV memory lent to the trainer, and releasing the weights would pull them from under a "
     "trainer that shares the served weights"),
    ("enable_hierarchical_cache", "--enable-hierarchical-cache", f"HiCache {_KV_TIER}"),
    ("enable_lmcache", "--enable-lmcache", f"LMCache {_KV_TIER}"),
    ("enable_flexkv", "--enable-flexkv", f"FlexKV {_KV_TIER}"),
    ("enable_unified_cache_external_linker", "--enable-unified-cache-external-linker", f"the external linker {_KV_TIER}"),
    ("disaggregation_decode_enable_offload_kvcache", "--disaggregation-decode-enable-offload-kvcache",
     f"decode KV offload {_KV_TIER}"),
    ("radix_cache_backend", "--radix-cache-backend",
     "a registered tree cache harvest has not checked (how it evicts, loads and frees KV slots)"),
    ("enable_pd_role_switch", "--enable-pd-role-switch",
     "a role switch tears down and rebuilds SGLang's disaggregation structures at runtime; not checked with lent "
     "chunks (only the RDMA transfer backends can switch)"),
)

SGLANG_ATTRIBUTES = [f"{SERVER_ARGS}.{field}" for field, _, _ in REFUSED_FLAGS] + [f"{SERVER_ARGS}.enable_dp_attention"]


def problems(scheduler) -> list[str]:
    """Why harvest cannot run on this scheduler's server (empty: it can)."""
    server_args = scheduler.server_args
    found = []
    if server_args.pp_size != 1 or server_args.dp_size != 1:
        found.append("harvest supports pp_size = dp_size = 1 (tensor parallelism only) for now")
    if server_args.tp_size > 1:
        found += tensor_parallel_problems(scheduler)
    if not scheduler.spec_algorithm.is_none():
        # A speculative step runs several forwards (draft, verify): harvest places and
        # times one forward per step.
        found.append("harvest does not support speculative decoding yet: run without --speculative-algorithm")
    found += flag_problems(server_args)
    token_allocator = scheduler.token_to_kv_pool_allocator
    for problem in (allocator_problem(token_allocator), kv_pool_problem(token_allocator.get_kvcache())):
        if problem is not None:
            found.append(problem)
    return found


def tensor_parallel_problems(scheduler) -> list[str]:
    """What stops harvest on a tensor-parallel server: each rank trains on its own shard,
    so the model must split evenly (a KV head replicated over ranks, as SGLang does when
    there are fewer KV heads than ranks, is not a shard), and SGLang's attention must be
    tensor-parallel too."""
    from harvest.train.errors import JobError
    from harvest.train.tensor_parallel import check_shardable

    server_args = scheduler.server_args
    found = []
    if server_args.enable_dp_attention:
        found.append("--enable-dp-attention: harvest supports plain tensor parallelism (attention split by heads); "
                     "run without --enable-dp-attention")
    try:
        check_shardable(scheduler.model_config.hf_config, server_args.tp_size)
    except JobError as exc:
        found.append(f"--tp {server_args.tp_size}: {str(exc).removeprefix('model_name_or_path: ')}")
    return found


def flag_problems(server_args) -> list[str]:
    found = []
    for field, flag, why in REFUSED_FLAGS:
        value = getattr(server_args, field)
        if value:
            given = flag if value is True else f"{flag} {value}"
            found.append(f"{given}: {why}; run without {flag}")
    return found


def allocator_problem(token_allocator) -> str | None:
    """harvest lends by taking token slots out of ``TokenToKVPoolAllocator``'s free list,
    and hooks that class's ``alloc``, ``check_decode_capacity`` and ``clear``: any other
    allocator (paged, hybrid, sparse, sharded, or a subclass that overrides them) would
    have page ids read as token slots, or free lists harvest does not see."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    if type(token_allocator) is TokenToKVPoolAllocator:
        return None
    name = type(token_allocator).__name__
    if token_allocator.page_size != 1:
        return (f"KV page size {token_allocator.page_size} ({name}; --page-size, or the attention backend's own "
                "choice): harvest lends from SGLang's page-size-1 TokenToKVPoolAllocator; run with --page-size 1 "
                "and an attention backend that supports it")
    return (f"SGLang's token allocator is {name} (a sliding-window or Mamba model's hybrid pool, --enable-hisparse, "
            "--enable-kv-cache-sharding, ...): harvest lends only from TokenToKVPoolAllocator, one full-attention "
            "pool of page size 1")


def kv_pool_problem(pool) -> str | None:
    # SGLang's post-capture KV sizing backs the pool with its own VMM (harvest's KV hook
    # never runs) and resizes it after graph capture (resize() -> clear()).
    if getattr(pool, "post_capture_active", False):
        return ("post-capture KV sizing (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1): SGLang backs and resizes the KV "
                "cache itself, harvest cannot back it; unset SGLANG_ENABLE_POST_CAPTURE_KV_SIZING")
    return None
