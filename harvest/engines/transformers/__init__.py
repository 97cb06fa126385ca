"""The transformers decode engine: a Hugging Face causal LM decoding batches of requests,
its steps captured as CUDA graphs per SM ladder level, and the serving loop of the GPU
co-location experiment (scripts/colocate_gpu.py) around it.

`harvest profile --engine transformers` (harvest.predict.profiler.hf_engine) loads its
model, builds its static (or ``--kv paged``, paged) batches and captures its graphs with
these modules. Nothing here imports torch, transformers or peft at module level, nor
sglang or llamafactory at all.
One line per module: docs/structures.md, 'harvest/engines/transformers/'.
"""
