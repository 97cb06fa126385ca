"""harvest's hooks into SGLang 0.5.23 internals (each target checked by the plugin at load).

The hooks are thin: each finds the process's :class:`~harvest.sglang.runtime.HarvestRuntime`
(created in ``Scheduler.__init__`` when harvest is enabled) and hands it the call. Without
a runtime (harvest disabled, or a process that is not a scheduler) they call through.
"""

from __future__ import annotations

from harvest import config_env

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"

# Every SGLang attribute harvest hooks; the plugin resolves each at load and refuses to
# enable harvest if one is missing (another SGLang version moved it).
KV_POOL_CREATE = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal"
TOKEN_ALLOCATOR = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator"
POOL_INVARIANT = "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_pool_invariant"

TARGETS = [
    f"{SCHEDULER}.__init__",
    f"{SCHEDULER}.run_batch",
    f"{SCHEDULER}.on_idle",
    KV_POOL_CREATE,
    f"{TOKEN_ALLOCATOR}.alloc",
    f"{TOKEN_ALLOCATOR}.check_decode_capacity",
    POOL_INVARIANT,
]

RUNTIME_ATTR = "_harvest_runtime"


def _scheduler_init(result, scheduler, *args, **kwargs):
    if not config_env.harvest_enabled():
        return result
    from harvest.sglang.runtime import HarvestRuntime

    setattr(scheduler, RUNTIME_ATTR, HarvestRuntime.attach(scheduler))
    return result


def _run_batch(original, scheduler, batch, *args, **kwargs):
    runtime = getattr(scheduler, RUNTIME_ATTR, None)
    if runtime is None:
        return original(scheduler, batch, *args, **kwargs)
    return runtime.run_step(original, scheduler, batch, *args, **kwargs)


def _on_idle(result, scheduler, *args, **kwargs):
    runtime = getattr(scheduler, RUNTIME_ATTR, None)
    if runtime is not None:
        runtime.on_idle()
    return result


# The token allocator does not know its scheduler; the runtime registers its lending
# controller here (one scheduler, one allocator per process: tp_size 1).
_lending_by_allocator: dict[int, object] = {}


def _token_alloc(original, allocator, need_size, *args, **kwargs):
    # SGLang's alloc returns None when the free slots are too few, having at most merged and
    # sorted its free lists (the same free slots): only then are lent chunks taken back and
    # it runs again (the common call costs harvest one comparison, not an extra size query).
    result = original(allocator, need_size, *args, **kwargs)
    if result is None and _took_lent_chunks_back(allocator, need_size):
        result = original(allocator, need_size, *args, **kwargs)
    return result


def _check_decode_capacity(original, allocator, *args, **kwargs):
    # SGLang asks this before every decode step (after evicting what its cache can); False
    # retracts requests. Lent chunks come back first: decode never retracts a request
    # because the trainer holds memory. (The cheap call first: it is True nearly always.)
    if original(allocator, *args, **kwargs):
        return True
    return _took_lent_chunks_back(allocator, kwargs["num_tokens"]) and original(allocator, *args, **kwargs)


def _took_lent_chunks_back(allocator, need_tokens: int) -> bool:
    """After SGLang found too few free slots: take lent chunks back toward ``need_tokens``.
    True if any came back (only then can asking SGLang again change its answer)."""
    lending = _lending_by_allocator.get(id(allocator))
    return lending is not None and lending.ensure_available(need_tokens)


def register_lending(token_allocator, lending) -> None:
    _lending_by_allocator[id(token_allocator)] = lending


def _pool_invariant(original, pool_name, available, *args, **kwargs):
    # SGLang's idle leak check: available + evictable + ... == total. Lent slots are out of
    # the free list but accounted for (the trainer holds them until reclaimed).
    if pool_name == "full":
        available += sum(lending.num_lent * lending.tokens_per_chunk for lending in _lending_by_allocator.values())
    return original(pool_name, available, *args, **kwargs)


def register(registry, hook_type) -> None:
    from harvest.sglang import kv_backing

    registry.register(f"{SCHEDULER}.__init__", _scheduler_init, hook_type.AFTER)
    registry.register(f"{SCHEDULER}.run_batch", _run_batch, hook_type.AROUND)
    registry.register(f"{SCHEDULER}.on_idle", _on_idle, hook_type.AFTER)
    registry.register(KV_POOL_CREATE, kv_backing._create_buffers_normal, hook_type.AROUND)
    registry.register(f"{TOKEN_ALLOCATOR}.alloc", _token_alloc, hook_type.AROUND)
    registry.register(f"{TOKEN_ALLOCATOR}.check_decode_capacity", _check_decode_capacity, hook_type.AROUND)
    registry.register(POOL_INVARIANT, _pool_invariant, hook_type.AROUND)
