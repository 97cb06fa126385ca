"""The co-location runtime, independent of the serving engine.

:func:`~harvest.colocate.assemble.assemble` builds it from a ``harvest.yaml`` and the
engine's adapter (the SGLang runtime and scripts/colocate_gpu.py both do). One decode step
reads like the rule (docs/design.md, "Architecture"), in :meth:`~harvest.colocate.colocation.Colocation.run_step`:
``control.before_step(load)`` (predict every level, let the QoS scheduler decide, select
the SM level, open or close the trainer's gate) returns the step's plan, the engine runs
the step as the plan says (on the level's decode stream, with its decode graphs),
``control.after_step(plan.step, measured)`` (feedback to the scheduler, the online
predictor and the metrics), then the KV lending check.
"""

from harvest.colocate.step_controller import StepController, StepLoad, StepPlan
from harvest.colocate.step_timer import CpuStepTimer, CudaStepTimer, make_step_timer
from harvest.colocate.trainer_host import TrainerHost

__all__ = ["StepController", "StepLoad", "StepPlan", "TrainerHost", "CpuStepTimer", "CudaStepTimer", "make_step_timer"]
