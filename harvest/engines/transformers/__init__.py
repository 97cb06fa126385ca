"""The transformers decode engine: a Hugging Face causal LM decoding batches of requests,
its steps captured as CUDA graphs per SM ladder level, and the serving loop of the GPU
co-location experiment (scripts/colocate_gpu.py) around it.

- ``model``: load the causal LM (or build it from its config with random weights); cache
  and stream helpers;
- ``ragged_batch``: :class:`RaggedDecodeBatch`, eager steps over a left-padded
  DynamicCache (shapes change as requests join and leave);
- ``static_batch``: :class:`SlotDecodeBatch` and :class:`StaticDecodeBatch`, steps that
  can be captured (one StaticCache, fixed addresses, no host read);
- ``captured_graphs``: :class:`CapturedLevelGraphs`, one CUDA graph per (ladder level,
  batch size), captured on the level's decode stream into one shared pool;
- ``graph_step``: the serving step with graphs on (the chosen level's graph for the
  batch's bucket) and their capture;
- ``level_graph_check``: the level-graphs measurement (does a graph replayed on a level
  keep to its SMs);
- ``shared_trainer``: harvest's layer-split LoRA trainer on the decode model's own weights;
- ``serving``: trace requests replayed in wall-clock time through a batch, and their
  TPOT/ITL summary;
- ``step_policies``: what each experiment mode does around a decode step;
- ``experiment_modes``: one mode of the experiment, start to end.

`harvest profile --engine transformers` (harvest.predict.profiler.hf_engine) loads its
model, builds its static batches and captures its graphs with these modules. Nothing here
imports torch, transformers or peft at module level, nor sglang or llamafactory at all.
"""
