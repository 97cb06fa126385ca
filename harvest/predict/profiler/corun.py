"""Finetune work that runs beside the timed decode steps (the co-run stage).

The profiler only needs "the finetune job, running on the trainer's side of the level,
back to back, until told to stop" and a count of the units it finished (proof that it
ran concurrently). Two workloads provide that: harvest's layer-split trainer driven
through its gate (:mod:`.trainer_workload`, when a job file is given) and a plain PEFT
LoRA training step on the finetune base model (:mod:`.peft_workload`). The profile's
``provenance.finetune.workload`` names the one used.
"""

from __future__ import annotations

import abc
import threading
from typing import Any

from harvest.compute.device import on_stream
from harvest.logs import get_logger
from harvest.train import trainer_cpu
from harvest.train.trainer_cpu import DEFAULT_TRAINER_CPU_THREADS, DEFAULT_TRAINER_NICE

logger = get_logger(__name__)


class CoRunError(RuntimeError):
    """The co-run workload failed or cannot run as asked."""


class BaseCoRunWorkload(abc.ABC):
    """Contract:
    - ``phases``: the trainer phases the workload can be held in while decode is timed —
      ``("forward", "backward")`` when it can run only forward or only backward units
      (the profiler then measures each and may fit one stage-2 model per phase), or
      ``("mixed",)`` when its units alternate as in training.
    - ``start(phase, stream)`` returns once the first unit has completed (the workload
      is warm and really running) and keeps running units back to back in a background
      thread, on ``stream`` (None: the thread's current stream).
    - ``units_done`` counts finished units since construction (read from any thread).
    - ``tokens_per_unit``: mean training tokens per unit (a micro-batch's tokens over the
      units that train on it), to turn a unit rate into tokens/s.
    - ``micro_batch_tokens``: mean non-padding tokens per micro-batch, the size of the
      units decode was measured beside (the profile records it; a server compares its
      jobs' with it); None before any micro-batch ran.
    - ``wait_for_unit_after(units)`` returns once more than ``units`` units are done
      (True), or when the workload stopped running or ``timeout_s`` passed first (False):
      what ends a measurement window at the end of a unit.
    - ``stop()`` returns after the unit in flight ends; it re-raises the background
      thread's failure as CoRunError. ``close()`` frees the model.
    - ``cpu_threads`` and ``nice``: torch CPU threads and nice increment of the workload's
      thread, as harvest's trainer thread has them (``trainer.cpu_threads``,
      ``trainer.nice``); decode's threads are left as they are.
    """

    cpu_threads: int = DEFAULT_TRAINER_CPU_THREADS
    nice: int = DEFAULT_TRAINER_NICE

    name: str
    description: str
    base_model: str
    phases: tuple[str, ...]

    @property
    @abc.abstractmethod
    def units_done(self) -> int: ...

    @property
    @abc.abstractmethod
    def tokens_per_unit(self) -> float: ...

    @property
    def micro_batch_tokens(self) -> float | None:
        return None

    @abc.abstractmethod
    def start(self, phase: str, stream: Any = None) -> None: ...

    @abc.abstractmethod
    def wait_for_unit_after(self, units: int, timeout_s: float | None = None) -> bool: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional
        pass


class UnitLoopWorkload(BaseCoRunWorkload):
    """A workload defined by ``run_unit(phase)``; this class runs it in a thread."""

    UNIT_TIMEOUT_S = 600.0  # the longest a unit may take, the first one (warm-up) included

    def __init__(self) -> None:
        self._units = 0
        self._thread: threading.Thread | None = None
        self._looping = False  # the thread runs units (False once it stopped or failed)
        self._progress = threading.Condition()  # notified on each unit and when the loop ends
        self._stop_event = threading.Event()
        self._error: BaseException | None = None

    @abc.abstractmethod
    def run_unit(self, phase: str) -> None:
        """One unit of ``phase``, synchronously (device work finished on return)."""

    @property
    def units_done(self) -> int:
        return self._units

    def wait_for_unit_after(self, units: int, timeout_s: float | None = None) -> bool:
        with self._progress:
            self._progress.wait_for(lambda: self._units > units or not self._looping,
                                    self.UNIT_TIMEOUT_S if timeout_s is None else timeout_s)
            return self._units > units

    def start(self, phase: str, stream: Any = None) -> None:
        if phase not in self.phases:
            raise CoRunError(f"{self.name}: phase {phase!r} is not one of {self.phases}")
        if self._thread is not None:
            raise CoRunError(f"{self.name}: already running")
        self._stop_event.clear()
        self._error = None
        serving_threads = trainer_cpu.process_default()
        units, self._looping = self._units, True
        self._thread = threading.Thread(target=self._loop, args=(phase, stream), name=f"harvest-corun-{self.name}", daemon=True)
        self._thread.start()
        started = self.wait_for_unit_after(units)
        trainer_cpu.restore_process_default(serving_threads)  # the loop limited its own thread first
        if not started and self._error is None:
            self.stop()
            raise CoRunError(f"{self.name}: no unit finished within {self.UNIT_TIMEOUT_S:.0f} s")
        if self._error is not None:
            self.stop()

    def _loop(self, phase: str, stream: Any) -> None:
        context = on_stream(stream)
        try:
            trainer_cpu.claim_trainer_thread(self.cpu_threads, self.nice)
            with context:
                while not self._stop_event.is_set():
                    self.run_unit(phase)
                    with self._progress:
                        self._units += 1
                        self._progress.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the profiling thread in stop()
            self._error = exc
        finally:
            with self._progress:
                self._looping = False
                self._progress.notify_all()

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        self._stop_event.set()
        if thread is not None:
            thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise CoRunError(f"{self.name} failed while running beside decode: {error!r}") from error
