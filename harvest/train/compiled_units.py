"""Decoder layers compiled for the layer-split trainer's units (``trainer.compile``).

Eager units are bound by the host's operator dispatch; ``torch.compile`` (inductor) cuts
it several-fold. Invariants: each decoder layer is compiled in place (module, parameters,
PEFT wrappers and window swaps unchanged; the unit boundary stays outside the graph);
compilation runs on the trainer's thread while the job builds, never on the decode thread;
``auto`` compiles on CUDA and not on a CPU; a layer whose compilation fails runs eager from
then on with its ``reason`` kept; tensor-parallel layers stay eager.

Rules and figures: docs/design.md §2, 'Compiled decoder layers'.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import nn

from harvest.logs import get_logger

logger = get_logger(__name__)

COMPILE_CHOICES = ("auto", "on", "off")


@dataclasses.dataclass
class CompiledLayers:
    """Which decoder layers run compiled, and why the others do not."""

    requested: str  # auto | on | off
    layers: int = 0  # layers compiled (those that failed to compile are not counted)
    reason: str | None = None  # why some or all layers run eager; None: all compiled, or compile off

    def status(self) -> dict[str, Any]:
        return {"requested": self.requested, "layers_compiled": self.layers, "reason": self.reason}


def wants_compile(requested: str, device: torch.device) -> bool:
    if requested not in COMPILE_CHOICES:
        raise ValueError(f"trainer.compile: {requested!r} is not one of {', '.join(COMPILE_CHOICES)}")
    return requested == "on" or (requested == "auto" and device.type == "cuda")


def use_harvest_cache() -> None:
    """Inductor's artifacts under harvest's cache directory, unless the operator chose a
    directory. Inductor writes its default (a folder under /tmp) into the variable the first
    time anything asks for it, so a value equal to that default is inductor's, not the
    operator's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from harvest import config_env

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(config_env.cache_dir() / "torchinductor")


def compile_layers(layers: list[nn.Module], requested: str, device: torch.device, *, tensor_parallel: bool = False,
                   backend: Any = None) -> CompiledLayers:
    """Compile each of ``layers`` in place when ``requested`` (and the device) says so.
    ``backend`` None: `default_backend(device)`."""
    state = CompiledLayers(requested)
    if not wants_compile(requested, device):
        return state
    if tensor_parallel:
        state.reason = "tensor-parallel layers run eager (their collectives wait in Python between operators)"
        logger.info("trainer.compile: %s", state.reason)
        return state
    use_harvest_cache()
    import torch._dynamo

    # Every job a server builds is a new model: dynamo's per-code limit on recompilations
    # (8) would otherwise, a few jobs of different shapes later, run every layer eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if backend is None:
        backend = default_backend(device)
    for layer in layers:
        layer.compile(backend=backend, dynamic=None)
        _guard_first_call(layer, state)
        state.layers += 1
    return state


def default_backend(device: torch.device) -> Any:
    """On a CPU, inductor keeping eager's fp32 numerics (harvest.train.eager_numerics: the
    compiled layers' gradients equal eager's bit for bit); on CUDA, plain inductor (its
    units were measured that way, and a bf16 step's rounding differs from eager's anyway)."""
    if device.type == "cpu":
        from harvest.train import eager_numerics

        return eager_numerics.backend()
    return "inductor"


# The errors of a compilation (not of the computation): dynamo's and the backend's.
def _compile_errors() -> tuple[type[BaseException], ...]:
    import torch._dynamo.exc as dynamo_exc

    errors: list[type[BaseException]] = [dynamo_exc.TorchDynamoException]
    try:
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    except ImportError:  # older torch: inductor's errors reach us as BackendCompilerFailed
        pass
    return tuple(errors)


def _guard_first_call(layer: nn.Module, state: CompiledLayers) -> None:
    """A layer whose compilation fails goes back to eager and runs the same call again
    (a compilation fails before anything of the call has run)."""
    compiled_call = layer._compiled_call_impl
    errors = _compile_errors()

    def call(*args, **kwargs):
        try:
            return compiled_call(*args, **kwargs)
        except errors as exc:
            layer._compiled_call_impl = None
            state.layers -= 1
            state.reason = f"a decoder layer could not compile and runs eager: {_describe(exc)}"
            logger.warning("trainer.compile: %s", state.reason)
            return layer._call_impl(*args, **kwargs)

    layer._compiled_call_impl = call


def _describe(exc: BaseException) -> str:
    """The error and its root cause, one line each at most (dynamo wraps a backend's error)."""
    def line(error: BaseException) -> str:
        text = str(error).strip()
        return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__

    root, seen = exc, {id(exc)}
    while True:
        inner = getattr(root, "inner_exception", None) or root.__cause__  # BackendCompilerFailed keeps it apart
        if inner is None or id(inner) in seen:
            break
        root = inner
        seen.add(id(root))
    return line(exc) if root is exc else f"{line(exc)} ({line(root)})"
