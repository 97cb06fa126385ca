"""What each mode of the GPU co-location experiment does around a decode step.

These adapt the step timer (harvest.colocate.step_timer) to
:func:`harvest.engines.transformers.serving.serve`: they depend on its shape in two
places only, ``timer.time(tag, stream, run)`` and ``timer.completed()`` yielding
measurements with ``.tag`` and ``.seconds``, which ``serve()``'s record pairs with the
step that carried the tag (``last_step()``'s first item).
"""

from __future__ import annotations

STATIC_DECODE_FRACTION = 0.6  # StaticMode's level: the one nearest 60% decode SMs


class FixedLevel:
    """decode-alone (the whole-device level, no trainer) and static (one partial level,
    trainer always on): the step on that level's decode stream, timed."""

    def __init__(self, partitioner, level_index: int, trainer_runs: bool, timer):
        self.level_index, self.trainer_runs, self.timer = level_index, trainer_runs, timer
        self.level = partitioner.select(level_index)
        self.num_steps = 0  # the tag of the latest step's measurement

    def run_step(self, load, step) -> None:
        self.num_steps += 1
        self.timer.time(self.num_steps, self.level.decode_stream, step)

    def completed(self) -> list:
        """Measurements (tag, seconds) of the steps finished since the last call."""
        return list(self.timer.completed())

    flush = completed

    def last_step(self) -> tuple[int, int, bool]:
        """(measurement tag, level index, trainer ran) of the latest step."""
        return self.num_steps, self.level_index, self.trainer_runs

    def idle(self) -> None:
        pass


class RecordingTimer:
    """The colocation's step timer, also keeping what it hands out for this report."""

    def __init__(self, timer):
        self.timer, self.measures_late, self.measured = timer, timer.measures_late, []

    def time(self, tag, stream, run, *args, **kwargs):
        return self.timer.time(tag, stream, run, *args, **kwargs)

    @property
    def outstanding(self) -> int:
        return self.timer.outstanding

    def completed(self):
        done = self.timer.completed()
        self.measured.extend(done)
        return done


class HarvestMode:
    """harvest: the system the SGLang server runs (harvest.colocate.assemble), every step
    through :meth:`Colocation.run_step`."""

    def __init__(self, colocation):
        from harvest.schedule import TrainerAction

        self.colocation, self._run = colocation, TrainerAction.RUN
        # Both read the timer: the colocation times each step, its rank decision feeds the
        # measurements back.
        self.timer = colocation.timer = colocation.decides.timer = RecordingTimer(colocation.timer)

    @property
    def level(self):
        return self.colocation.step_controller.level

    def run_step(self, load, step) -> None:
        self.colocation.run_step(load, step)

    def completed(self) -> list:
        """The measurements (tag, seconds) the colocation has fed back since the last
        call (a late timer's arrive at the next step)."""
        measured, self.timer.measured = self.timer.measured, []
        return measured

    def flush(self) -> list:
        """At the end: the last step's latency too (it feeds no decision)."""
        self.timer.completed()
        return self.completed()

    def last_step(self) -> tuple[int, int, bool]:
        """(measurement tag, level index, trainer ran) of the latest step."""
        decision = self.colocation.step_controller.last_decision
        return decision.step, decision.level_index, decision.trainer_action is self._run

    def idle(self) -> None:
        self.colocation.on_idle()


def static_level_index(ladder) -> int:
    """The partial level nearest STATIC_DECODE_FRACTION decode SMs (the only level when shared)."""
    partial = list(ladder.trainer_levels) or list(range(ladder.num_levels))
    return min(partial, key=lambda i: abs(ladder.decode_fraction(i) - STATIC_DECODE_FRACTION))
