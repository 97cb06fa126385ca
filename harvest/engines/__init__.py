"""Decode engines harvest runs itself, beside the SGLang server's (harvest.sglang adapts
SGLang's own engine).

``transformers``: Hugging Face decode batches, their per-level CUDA graphs and what the
GPU co-location experiment serves with them (scripts/colocate_gpu.py); the profiler's
``--engine transformers`` (harvest.predict.profiler.hf_engine) times the same batches.
"""
