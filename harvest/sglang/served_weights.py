"""The served model's weights as the trainer's frozen weights (same-base-model mode).

When the finetune job's base model is the checkpoint SGLang serves, the trainer need not
hold a second copy (FlexLLM's observation, arXiv:2402.18789; docs/design.md "Beyond
Harli"): SGLang's parameters are used in place. SGLang fuses projections that Hugging Face keeps apart, in a fixed row
order, so row slices of the fused tensors are the HF tensors (views, no copy):

    qkv_proj   [q | k | v] rows   -> q_proj, k_proj, v_proj   (weight, and bias for Qwen2)
    gate_up_proj [gate | up] rows -> gate_proj, up_proj

Every other parameter keeps its name. With tensor parallelism each rank holds its shard
(its heads' rows of q/k/v, its part of the intermediate size, its columns of o/down, its
rows of the padded vocabulary), which is exactly the shard the tensor-parallel trainer
trains on (harvest.train.tensor_parallel): the fused rows split by the per-rank sizes.
The trainer validates every tensor's shape and dtype before it starts and the runtime
falls back to a host copy, with a warning naming the tensor, if anything differs.
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
