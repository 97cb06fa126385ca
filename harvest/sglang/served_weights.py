"""The served model's weights as the trainer's frozen weights (same-base-model mode).

When the job's base model is the checkpoint SGLang serves, the trainer uses SGLang's
parameters in place (docs/design.md §2). SGLang fuses projections in a fixed row order, so
row slices of the fused tensors are the HF tensors (views, no copy): ``qkv_proj`` ->
q/k/v_proj, ``gate_up_proj`` -> gate/up_proj; every other parameter keeps its name. With
tensor parallelism each rank's shard is exactly the one the tensor-parallel trainer trains
on. Invariant: every tensor's shape and dtype is validated before the trainer starts, and
the runtime falls back to a host copy, with a warning naming the tensor, if any differs.
"""

from __future__ import annotations

from pathlib import Path


def same_checkpoint(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return False


def served_weight_tensors(model, hf_config, tp_size: int = 1) -> dict:
    """HF state-dict names -> tensors of SGLang's ``model`` (this rank's shard with
    ``tp_size`` ranks; views, nothing copied)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    q_rows = hf_config.num_attention_heads * head_dim // tp_size
    kv_rows = hf_config.num_key_value_heads * head_dim // tp_size
    inter = hf_config.intermediate_size // tp_size
    tensors = {}
    for name, param in model.named_parameters():
        tensor = param.detach()
        if ".qkv_proj." in name:
            prefix, suffix = name.split(".qkv_proj.")
            tensors[f"{prefix}.q_proj.{suffix}"] = tensor[:q_rows]
            tensors[f"{prefix}.k_proj.{suffix}"] = tensor[q_rows:q_rows + kv_rows]
            tensors[f"{prefix}.v_proj.{suffix}"] = tensor[q_rows + kv_rows:q_rows + 2 * kv_rows]
        elif ".gate_up_proj." in name:
            prefix, suffix = name.split(".gate_up_proj.")
            tensors[f"{prefix}.gate_proj.{suffix}"] = tensor[:inter]
            tensors[f"{prefix}.up_proj.{suffix}"] = tensor[inter:2 * inter]
        else:
            tensors[name] = tensor
    return tensors
