"""The tensors a model computes when it loads, checked before a trainer uses them.

A few tensors are not in the checkpoint but computed while the model is built
(non-persistent buffers, chiefly the rotary embedding's ``inv_freq``, filled in place after
a meta-device build). In a process shared with a serving engine, global torch state (a
wrapped factory function escaping torch's device context) can leave them uninitialised
without any error, and the trainer would train on garbage positions. Checked: every
floating buffer is finite, and every rotary embedding's frequencies equal what its config
gives (recomputed as transformers' ``_init_weights`` does); a failure is a JobError saying
what happened. Cheap: the buffers are small.
"""

from __future__ import annotations

import torch

from harvest.train.errors import JobError

_PROCESS_HINT = ("it was computed at load, not read from the checkpoint: something in this process changed torch's "
                 "factory functions or default device while the model loaded (a sitecustomize or plugin that wraps "
                 "torch.*?)")


def check_computed_buffers(model: torch.nn.Module) -> None:
    """JobError naming every rotary embedding whose frequencies differ from its config's,
    then every other floating buffer that is not finite: all of them, in the model's
    order, so what is named does not depend on what the unset memory held."""
    problems: list[str] = []
    named: set[str] = set()
    # A model loaded in bf16 or fp16 keeps a float32 table holding values rounded to that
    # dtype (transformers computes it under the load's default dtype): equal to the config's
    # within that dtype's precision. Garbage is nowhere near (zeros, 1e-41, 1e14, NaN).
    rtol = max([1e-5] + [torch.finfo(p.dtype).eps for p in model.parameters() if p.is_floating_point()])
    for module_name, module in model.named_modules():
        expected = _rope_frequencies(module)
        if expected is None:
            continue
        actual = module.inv_freq.detach().to("cpu", torch.float32)
        if actual.shape != expected.shape or not torch.allclose(actual, expected, rtol=rtol, atol=0.0):
            name = f"{module_name}.inv_freq" if module_name else "inv_freq"
            problems.append(f"{name} is {_head(actual)}, its config gives {_head(expected)}")
            named.add(name)
    for name, buffer in model.named_buffers():
        if name in named or not buffer.is_floating_point() or buffer.device.type == "meta":
            continue
        if not bool(torch.isfinite(buffer).all()):
            problems.append(f"{name} holds non-finite values")
    if problems:
        raise JobError(f"model_name_or_path: the loaded model's {'; '.join(problems)}; {_PROCESS_HINT}")


def _rope_frequencies(module: torch.nn.Module) -> torch.Tensor | None:
    """What transformers' ``_init_weights`` writes into a rotary embedding's ``inv_freq``,
    or None for a module that is not one (or whose rope type it cannot compute here)."""
    if "RotaryEmbedding" not in type(module).__name__ or not hasattr(module, "original_inv_freq"):
        return None
    if not isinstance(getattr(module, "inv_freq", None), torch.Tensor) or module.inv_freq.device.type == "meta":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = getattr(module, "rope_type", None)
    if not isinstance(rope_type, str) or getattr(module, "config", None) is None:
        return None
    compute = {"axial": getattr(module, "compute_axial_rope_parameters", None),
               "default": getattr(module, "compute_default_rope_parameters", None),
               **ROPE_INIT_FUNCTIONS}.get(rope_type)
    if compute is None:
        return None
    try:
        with torch.device("cpu"):
            frequencies, _ = compute(module.config)
    except (AttributeError, KeyError, TypeError, ValueError):  # a variant transformers computes otherwise
        return None
    if not isinstance(frequencies, torch.Tensor):
        return None
    return frequencies.detach().to("cpu", torch.float32)


def _head(values: torch.Tensor) -> str:
    shown = ", ".join(f"{v:.4g}" for v in values.flatten()[:4].tolist())
    return f"[{shown}{', ...' if values.numel() > 4 else ''}]"
