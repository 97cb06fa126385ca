"""Decoder layers compiled for the layer-split trainer's units (``trainer.compile``).

Eager units are bound by the host's operator dispatch; ``torch.compile`` (inductor) cuts
it several-fold. Invariants: each decoder layer is compiled in place (module, parameters,
PEFT wrappers and window swaps unchanged; the unit boundary stays outside the graph);
compilation runs on the trainer's thread while the job builds, never on the decode thread;
``auto`` compiles on CUDA and not on a CPU; a layer whose compilation fails (its forward
or its backward: both compile at its first forward call) runs eager from then on with its
``reason`` kept; tensor-parallel layers stay eager. Where ``pairs`` says so (by default on
a CPU, where it was measured faster) a layer's training units run as an explicit compiled
pair (harvest.train.compiled_pair: no dynamo or autograd runtime per call); its module call
is compiled as well (evaluation's no-grad calls, signatures no pair covers, a layer whose
pair cannot be built). A cache is never trusted over a
compilation: artifacts that fail to load are set aside and compiled again, and each torch
version has a cache directory of its own.

Rules and figures: docs/design.md §2, 'Compiled decoder layers'.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
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
    # Per layer, its training forward and backward as an explicit compiled pair
    # (harvest.train.compiled_pair; on a CPU with the default backend); empty: none.
    paired: list = dataclasses.field(default_factory=list)

    def status(self) -> dict[str, Any]:
        status = {"requested": self.requested, "layers_compiled": self.layers, "reason": self.reason}
        if self.paired:
            # What the pairs hold: a signature per input shape a layer met (few when the job
            # packs: docs/design.md), one compiled pair per distinct graph, and the units a
            # new shape sent past the per-layer limit to the dynamic-shape module call.
            pairs = [pair for layer in self.paired for pair in layer.pairs()]
            status.update(signatures=max(len(layer.pairs()) for layer in self.paired),
                          compiled_pairs=len({id(pair) for pair in pairs}),
                          units_past_signature_limit=sum(layer.past_limit for layer in self.paired))
        return status

    def paired_layer(self, index: int):
        """Layer ``index``'s `PairedLayer`, or None (it runs as a module)."""
        return self.paired[index] if self.paired else None


def wants_compile(requested: str, device: torch.device) -> bool:
    if requested not in COMPILE_CHOICES:
        raise ValueError(f"trainer.compile: {requested!r} is not one of {', '.join(COMPILE_CHOICES)}")
    return requested == "on" or (requested == "auto" and device.type == "cuda")


def harvest_cache_dir() -> Path:
    """Harvest's inductor cache for this torch: ``<cache>/torchinductor/<torch version>``.
    Inductor keys its artifacts by the torch build already, so another torch's are never
    loaded; a folder per version keeps them apart and lets an upgrade say so."""
    from harvest import config_env

    return config_env.cache_dir() / "torchinductor" / torch.__version__


def use_harvest_cache() -> None:
    """Inductor's artifacts under `harvest_cache_dir`, unless the operator chose a
    directory. Inductor writes its default (a folder under /tmp) into the variable the first
    time anything asks for it, so a value equal to that default is inductor's, not the
    operator's. Other torch versions' folders beside it are named once in a warning."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        directory = harvest_cache_dir()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(directory)
        _warn_of_other_versions(directory)


_warned_versions: set[Path] = set()


# A folder of another torch's artifacts: named by its version ("2.11.0", "2.13.0+cu128").
_TORCH_VERSION_NAME = re.compile(r"^\d+\.\d+\.\d+")


def _warn_of_other_versions(directory: Path) -> None:
    try:
        others = sorted(p.name for p in directory.parent.iterdir()
                        if p.name != directory.name and ".aside-" not in p.name)
    except OSError:
        return
    if not others or directory.parent in _warned_versions:
        return
    _warned_versions.add(directory.parent)
    versions = [name for name in others if _TORCH_VERSION_NAME.match(name)]
    # Anything else there is inductor's own layout (its hashed folders, fxgraph, aotautograd)
    # from a harvest that kept one cache for every torch: counted, not listed.
    unversioned = len(others) - len(versions)
    parts = []
    if versions:
        parts.append(f"compiled artifacts of torch {', '.join(versions)} under {directory.parent} are not used by "
                     f"torch {torch.__version__}")
    if unversioned:
        parts.append(f"{unversioned} entries directly under {directory.parent} (an earlier harvest's cache for every "
                     "torch version) are not used")
    logger.warning("trainer.compile: %s (compiled again into %s; delete them to reclaim the disk)",
                   "; ".join(parts), directory)


def compile_layers(layers: list[nn.Module], requested: str, device: torch.device, *, tensor_parallel: bool = False,
                   backend: Any = None, pairs: bool | None = None) -> CompiledLayers:
    """Compile each of ``layers`` in place when ``requested`` (and the device) says so.
    ``backend`` None: `default_backend(device)`. ``pairs``: training units through explicit
    compiled pairs (an inductor backend); None: where measured faster, a CPU with the
    default backend (CUDA keeps ``torch.compile``'s runtime until a GPU measures pairs:
    ``scripts/bench_trainer.py --device cuda``, ``tokens_per_s_compiled_pair``)."""
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
    # A layer's backward compiles with its forward, at its first forward call, where a
    # failure still leaves the layer to run eager (lazily, at its first backward, a failure
    # would end the job mid-step). Process-wide; it changes nothing for graphs that need no
    # backward (serving's).
    import torch._functorch.config

    torch._functorch.config.force_non_lazy_backward_lowering = True
    if pairs is None:
        pairs = backend is None and pairs_by_default(device)
    if backend is None:
        backend = default_backend(device)
    compiler = None
    if pairs:
        from harvest.train import compiled_pair

        compiler = compiled_pair.PairCompiler(backend)
    for layer in layers:
        # Compiled as a module too: evaluation's no-grad calls, and signatures no pair covers.
        layer.compile(backend=backend, dynamic=None)
        _guard_first_call(layer, state)
        state.layers += 1
        if compiler is not None:
            state.paired.append(compiled_pair.PairedLayer(layer, compiler, functools.partial(_pair_failed, state)))
    return state


def pairs_by_default(device: torch.device) -> bool:
    """Whether a layer's training units run as explicit compiled pairs with the default
    backend: where they were measured faster, a CPU (docs/measurements.md); CUDA keeps
    ``torch.compile``'s runtime until a GPU measures pairs."""
    return device.type == "cpu"


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
    (a compilation fails before anything of the call has run). A failure to load an
    artifact from the cache is not the layer's: the cache is set aside and the call
    compiles again, once per process."""
    compiled_call = layer._compiled_call_impl
    errors = _compile_errors()

    def call(*args, **kwargs):
        try:
            return compiled_call(*args, **kwargs)
        except errors as exc:
            failure = exc
        if _set_aside_cache_named_in(failure):
            try:
                return compiled_call(*args, **kwargs)
            except errors as exc:
                failure = exc
        _run_eager(layer, state, failure)
        return layer._call_impl(*args, **kwargs)

    layer._compiled_call_impl = call


def _run_eager(layer: nn.Module, state: CompiledLayers, failure: BaseException) -> None:
    """``layer`` runs eager from now on (its module call and its pair), the reason kept."""
    if layer._compiled_call_impl is None:
        return  # already eager, counted and said
    layer._compiled_call_impl = None
    state.layers -= 1
    state.reason = f"a decoder layer could not compile and runs eager: {_describe(failure)}"
    logger.warning("trainer.compile: %s", state.reason)


def _pair_failed(state: CompiledLayers, failure: BaseException) -> bool:
    """A layer's pair could not be built: True to build it again (the failure was a cache
    artifact's, now set aside), else its units go through its ``torch.compile`` call (which
    runs eager, saying so, if that cannot compile either)."""
    if _set_aside_cache_named_in(failure):
        return True
    state.reason = f"a decoder layer's compiled pair could not be built; its units run through torch.compile: " \
                   f"{_describe(failure)}"
    logger.warning("trainer.compile: %s", state.reason)
    return False


_cache_set_aside = False  # at most once per process: a second failure is the layer's own


def _set_aside_cache_named_in(exc: BaseException) -> bool:
    """When ``exc`` (or an error under it) names a file of inductor's cache (an artifact
    that would not load: truncated by a crash, damaged on disk), compile into a fresh cache
    from now on and return True. Harvest's own cache folder is renamed ``*.aside-<time>``
    (the next start finds a fresh one); an operator's (TORCHINDUCTOR_CACHE_DIR) is left as
    it is and this process compiles into a temporary folder."""
    global _cache_set_aside
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch._inductor.utils import clear_caches

    directory = Path(cache_dir())
    if _cache_set_aside or str(directory) not in _chain_text(exc):
        return False
    _cache_set_aside = True
    if directory == Path(os.path.abspath(harvest_cache_dir())):
        aside = directory.with_name(f"{directory.name}.aside-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        directory.rename(aside)
        directory.mkdir(parents=True)
        where = f"moved aside to {aside}"
    else:
        fresh = tempfile.mkdtemp(prefix="harvest-inductor-")
        atexit.register(shutil.rmtree, fresh, ignore_errors=True)  # this process's only: gone with it
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh
        where = f"left as it is (TORCHINDUCTOR_CACHE_DIR is the operator's); this process compiles into {fresh}"
    clear_caches()  # inductor's in-memory caches point into the old folder
    logger.warning("trainer.compile: a compiled artifact in the cache %s would not load (%s); the cache is %s, "
                   "and the layer compiles again", directory, _describe(exc), where)
    return True


def _errors_under(exc: BaseException, *, implicit: bool = False):
    """``exc``, then each error it wraps (BackendCompilerFailed keeps its cause apart, in
    ``inner_exception``), once each; ``implicit``: also errors raised while handling
    another (``__context__``)."""
    seen, current = set(), exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = (getattr(current, "inner_exception", None) or current.__cause__
                   or (current.__context__ if implicit else None))


def _chain_text(exc: BaseException) -> str:
    """The messages of ``exc`` and every error under it."""
    return "\n".join(str(error) for error in _errors_under(exc, implicit=True))


_DESCRIBED_LINE_CHARS = 300


def _describe(exc: BaseException) -> str:
    """The error and its root cause, one line each at most (dynamo wraps a backend's error),
    each cut to a few hundred characters: BackendCompilerFailed's first line spells out the
    backend with its whole decomposition table (some 150 kB), which a log line or
    /harvest/status must not carry."""
    def line(error: BaseException) -> str:
        text = str(error).strip()
        if not text:
            return type(error).__name__
        first = text.splitlines()[0]
        if len(first) > _DESCRIBED_LINE_CHARS:
            first = first[:_DESCRIBED_LINE_CHARS] + f"... ({len(first) - _DESCRIBED_LINE_CHARS} more characters)"
        return f"{type(error).__name__}: {first}"

    *_, root = _errors_under(exc)
    return line(exc) if root is exc else f"{line(exc)} ({line(root)})"
