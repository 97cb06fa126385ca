"""The co-location runtime, independent of the serving engine.

One decode step reads like the spec (STYLE.md): ``decision = control.before_step(load)``
(predict every level, let the QoS scheduler decide, select the SM level, open or close the
trainer's gate), the engine runs the step, ``control.after_step(measured)`` (feedback to
the scheduler, the online predictor and the metrics). The SGLang plugin
(harvest.sglang.runtime) and the standalone GPU harness (scripts/colocate_gpu.py) both
drive this package.
"""

from harvest.colocate.controller import StepController, StepLoad
from harvest.colocate.step_timer import CpuStepTimer, CudaStepTimer, make_step_timer
from harvest.colocate.trainer_host import TrainerHost

__all__ = ["StepController", "StepLoad", "TrainerHost", "CpuStepTimer", "CudaStepTimer", "make_step_timer"]
