"""SM partitioning between decode and the finetune trainer (docs/design.md §4).

``ladder`` plans the levels (pure Python, returning harvest.ladder's types),
``greenctx_lib`` binds csrc/greenctx, ``partitioner`` defines the interface and the
whole-device fallback, ``green_partitioner`` builds the ladder with CUDA green contexts,
and ``factory`` picks one. Decode CUDA graphs per level are the engines' own:
harvest.engines.transformers.captured_graphs, and SGLang's harvest.sglang.level_graphs.
Nothing here imports torch at module level.
"""

from harvest.compute.factory import create_partitioner
from harvest.compute.greenctx_lib import GreenContextError, GreenContextsUnavailable
from harvest.compute.ladder_planning import (
    DEFAULT_NUM_LEVELS,
    MAX_LEVELS,
    arch_constraints,
    device_constraints,
    plan_ladder,
)
from harvest.compute.partitioner import BasePartitioner, WholeDevicePartitioner

__all__ = [
    "DEFAULT_NUM_LEVELS",
    "MAX_LEVELS",
    "BasePartitioner",
    "GreenContextError",
    "GreenContextsUnavailable",
    "WholeDevicePartitioner",
    "arch_constraints",
    "create_partitioner",
    "device_constraints",
    "plan_ladder",
]
