"""harvest's hooks into SGLang 0.5.23 internals (each target checked by the plugin at load).

The hooks are thin: each finds the process's :class:`~harvest.sglang.runtime.HarvestRuntime`
(created in ``Scheduler.__init__`` when harvest is enabled) on the scheduler, or the
:class:`~harvest.sglang.kv_lending.KvLendingController` on the token allocator, and hands it
the call. Without one (harvest disabled, or a process that is not a scheduler) they call
through.
"""

from __future__ import annotations

import dataclasses

from harvest import config_env

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
# The target model's forward of a step (forward + sampling), wherever the scheduler calls
# it from (overlap or not): it runs on the chosen level's decode stream.
FORWARD = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"

# Every SGLang attribute harvest hooks; the plugin resolves each at load and refuses to
# enable harvest if one is missing (another SGLang version moved it).
KV_POOL_CREATE = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal"
TOKEN_ALLOCATOR = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator"
FULL_POOL_INVARIANT = "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_full_pool"
# The main process's check of its children (any child's end: kill the server).
CHILD_WATCHDOG_CHECK = "sglang.srt.utils.watchdog.SubprocessWatchdog._check_processes"

TARGETS = [
    f"{SCHEDULER}.__init__",
    f"{SCHEDULER}.run_batch",
    FORWARD,
    f"{SCHEDULER}.on_idle",
    f"{SCHEDULER}.get_new_batch_prefill",
    KV_POOL_CREATE,
    f"{TOKEN_ALLOCATOR}.alloc",
    f"{TOKEN_ALLOCATOR}.check_decode_capacity",
    f"{TOKEN_ALLOCATOR}.clear",
    FULL_POOL_INVARIANT,
    CHILD_WATCHDOG_CHECK,
]

RUNTIME_ATTR = "_harvest_runtime"


def _scheduler_init(result, scheduler, *args, **kwargs):
    if not config_env.harvest_enabled():
        return result
    from harvest.sglang.runtime import HarvestRuntime

    runtime = HarvestRuntime.attach(scheduler)
    setattr(scheduler, RUNTIME_ATTR, runtime)
    setattr(scheduler.tp_worker, RUNTIME_ATTR, runtime)  # the forward hook's
    return result


def _run_batch(original, scheduler, batch, *args, **kwargs):
    runtime = getattr(scheduler, RUNTIME_ATTR, None)
    if runtime is None:
        return original(scheduler, batch, *args, **kwargs)
    return runtime.run_step(original, scheduler, batch, *args, **kwargs)


def _forward(original, worker, *args, **kwargs):
    runtime = getattr(worker, RUNTIME_ATTR, None)
    if runtime is None:
        return original(worker, *args, **kwargs)
    return runtime.run_forward(original, worker, *args, **kwargs)


def _on_idle(result, scheduler, *args, **kwargs):
    runtime = getattr(scheduler, RUNTIME_ATTR, None)
    if runtime is not None:
        runtime.on_idle()
    return result


def _token_alloc(original, allocator, need_size, *args, **kwargs):
    # SGLang's alloc returns None when the free slots are too few, having at most merged and
    # sorted its free lists (the same free slots): only then are lent chunks taken back and
    # it runs again (the common call costs harvest one comparison, not an extra size query).
    result = original(allocator, need_size, *args, **kwargs)
    if result is None and _took_lent_chunks_back(allocator, need_size):
        result = original(allocator, need_size, *args, **kwargs)
    if result is not None:
        from harvest.sglang.kv_lending import lending_of

        lending = lending_of(allocator)
        if lending is not None:
            lending.record_allocation(need_size)
    return result


def _new_batch_prefill(original, scheduler, *args, **kwargs):
    # SGLang admits from its queue only what fits beside its running requests' promised
    # decode: before it looks, lending notes that promise (reclaim ahead keeps it free) and
    # takes lent chunks back for a queue head they hold back (counted: an admission held).
    from harvest.sglang.kv_lending import lending_of

    lending = lending_of(scheduler.token_to_kv_pool_allocator)
    if lending is not None and lending.watches_admissions:
        from harvest.sglang.admission import demand_of

        running_batch = args[0] if args else kwargs["running_batch"]
        seen = lending.queue_seen if lending.demand_from_arrivals else None
        if lending.before_admission(demand_of(scheduler, running_batch, promised=lending.reclaim_ahead, seen=seen)):
            running_batch.batch_is_full = False  # the memory it was held for is back: look again
    return original(scheduler, *args, **kwargs)


def _check_decode_capacity(original, allocator, *args, **kwargs):
    # SGLang asks this before every decode step (after evicting what its cache can); False
    # retracts requests. Lent chunks come back first: decode never retracts a request
    # because the trainer holds memory. (The cheap call first: it is True nearly always.)
    if original(allocator, *args, **kwargs):
        return True
    return _took_lent_chunks_back(allocator, kwargs["num_tokens"]) and original(allocator, *args, **kwargs)


def _token_clear(original, allocator, *args, **kwargs):
    # SGLang's clear() (flush_cache, memory release for a weight update) frees every slot,
    # lent ones too: SGLang would then hand out slots whose pages the trainer holds, and
    # its leak check kills the server (more free slots than the pool has).
    result = original(allocator, *args, **kwargs)
    from harvest.sglang.kv_lending import lending_of

    lending = lending_of(allocator)
    if lending is not None:
        lending.after_pool_cleared()
    return result


def _took_lent_chunks_back(allocator, need_tokens: int) -> bool:
    """After SGLang found too few free slots: take lent chunks back toward ``need_tokens``.
    True if any came back (only then can asking SGLang again change its answer)."""
    from harvest.sglang.kv_lending import lending_of

    lending = lending_of(allocator)
    return lending is not None and lending.ensure_available(need_tokens)


def _full_pool_invariant(original, checker, pool_stats, *args, **kwargs):
    # SGLang's leak check: available + evictable + ... == total. Lent slots, and those of
    # lends waiting for their fences, are out of the free list but accounted for (the
    # trainer holds them until reclaimed; a pending lend until it completes or is cancelled).
    from harvest.sglang.kv_lending import lending_of

    lending = lending_of(checker.token_to_kv_pool_allocator)
    if lending is not None and lending.num_taken:
        lent_tokens = lending.num_taken * lending.tokens_per_chunk
        pool_stats = dataclasses.replace(pool_stats, full_available_size=pool_stats.full_available_size + lent_tokens)
    return original(checker, pool_stats, *args, **kwargs)


_schedulers_first = None


def _check_children(original, watchdog, *args, **kwargs):
    # Main process: a child that a stop signal ended (the detokenizer, at a group SIGTERM)
    # must not take the server down while a scheduler still checkpoints its trainer
    # (harvest.sglang.shutdown.SchedulersFirst).
    global _schedulers_first
    processes, names = getattr(watchdog, "_processes", None), getattr(watchdog, "_names", None)
    if config_env.harvest_enabled() and processes is not None and names is not None:
        from harvest.sglang.shutdown import SchedulersFirst

        if _schedulers_first is None:
            _schedulers_first = SchedulersFirst()
        if _schedulers_first.hold(processes, names):
            return False
    return original(watchdog, *args, **kwargs)


def register(registry, hook_type) -> None:
    from harvest.sglang import kv_backing

    registry.register(f"{SCHEDULER}.__init__", _scheduler_init, hook_type.AFTER)
    registry.register(f"{SCHEDULER}.run_batch", _run_batch, hook_type.AROUND)
    registry.register(FORWARD, _forward, hook_type.AROUND)
    registry.register(f"{SCHEDULER}.on_idle", _on_idle, hook_type.AFTER)
    registry.register(f"{SCHEDULER}.get_new_batch_prefill", _new_batch_prefill, hook_type.AROUND)
    registry.register(KV_POOL_CREATE, kv_backing._create_buffers_normal, hook_type.AROUND)
    registry.register(f"{TOKEN_ALLOCATOR}.alloc", _token_alloc, hook_type.AROUND)
    registry.register(f"{TOKEN_ALLOCATOR}.check_decode_capacity", _check_decode_capacity, hook_type.AROUND)
    registry.register(f"{TOKEN_ALLOCATOR}.clear", _token_clear, hook_type.AROUND)
    registry.register(FULL_POOL_INVARIANT, _full_pool_invariant, hook_type.AROUND)
    registry.register(CHILD_WATCHDOG_CHECK, _check_children, hook_type.AROUND)
