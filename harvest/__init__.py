"""harvest: LoRA finetuning in the idle SMs and KV memory of an SGLang decode instance.

The core (memory, compute, predict, schedule, train) imports with torch, numpy and
scikit-learn only; SGLang, LlamaFactory and prometheus-client are imported where used.
"""

__version__ = "0.1.0"
