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
TARGETS = [
    f"{SCHEDULER}.__init__",
    f"{SCHEDULER}.run_batch",
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


def register(registry, hook_type) -> None:
    registry.register(f"{SCHEDULER}.__init__", _scheduler_init, hook_type.AFTER)
    registry.register(f"{SCHEDULER}.run_batch", _run_batch, hook_type.AROUND)
