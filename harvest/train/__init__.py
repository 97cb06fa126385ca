"""harvest.train: the layer-split LoRA trainer (docs/design.md §2; Harli, arXiv:2511.11729, §4.3 and §6.1).

Import the pieces from their modules; this package imports nothing heavy by itself.
Entry points: `job.load_job` (LlamaFactory job file -> `TrainJob`), `build.build_trainer`
(`TrainJob` -> `LayerSplitTrainer`), `gate.Gate` / `gate.BaseGate` (scheduler control),
`window_memory.BaseWindowAllocator` (window memory), `weights.BaseWeightSource`
(frozen-weight source, e.g. the serving engine's tensors).
"""
