"""A decoder layer's training forward and backward as an explicit pair of compiled functions (CPU).

Through ``torch.compile`` a layer unit still pays, per call, dynamo's guards and AOT
autograd's runtime (an autograd Function saving ~46 tensors; the autograd engine and
AccumulateGrad in the backward unit): half of a compiled unit's host time on a CPU
(docs/measurements.md). The trainer runs each layer's forward and backward units itself,
so it calls the compiled graphs directly: the forward returns the output and the tensors
the backward needs; the backward takes those and the output's gradient and returns the
input's and the trainable parameters' gradients, which `SavedForBackward.backward` adds
into ``.grad`` as AccumulateGrad would (the first micro-batch sets, later ones add).

A pair is made by AOT autograd's own stages as ``torch.compile`` runs them below dynamo
(joint capture with the backend's decompositions, inductor's partitioner and compilers
under the backend's configuration), keeping the two compiled functions, not the runtime
around them; only when AOT's metadata says the calling convention is the plain one
(`_check_plain`: no input mutated, no output aliasing an input, only tensors saved).

Invariants:
- Numerics are the backend's: the same graphs, partition and kernels as the layer compiled
  by ``torch.compile``, so a step equals eager's bit for bit (harvest.train.eager_numerics).
- A pair is specific to what its graph was traced with (`PairedLayer._signature`: the
  inputs' shapes, strides, dtypes and requires_grad, the modules' training flags, autocast,
  deterministic mode). A new signature traces again (layers whose traced graphs are equal
  share one compiled pair); past `MAX_SIGNATURES` a layer runs it through its
  ``torch.compile`` call, which handles changing shapes. Parameters, read from the modules
  at each call, keep their shapes, dtypes and layouts for the job (the window's views too).
- Saved tensors go through the saved-tensor hooks in effect at the forward, as autograd's
  would (the weight window's handles where it needs them); the others are checked against
  in-place changes (their version counters) as autograd checks them.
- Random numbers (LoRA dropout) are drawn by the compiled forward as eager draws them;
  building a pair draws none (tracing is on fake tensors) and leaves the process's
  generator alone (other threads draw from it while a pair builds).

The pair is device-agnostic: inductor with the backend's decompositions and configuration
(harvest.train.eager_numerics' on a CPU, plain ``"inductor"`` on CUDA). Where it is used by
default is measured per device (harvest.train.compiled_units, ``pairs``).

Why a unit is not also a CUDA graph (docs/design.md, 'Compiled decoder layers'): a graph's
kernels run in the green context they were captured in, and the trainer changes partition
from one unit to the next, so each layer would need a capture per partition, each holding
its own saved activations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import torch
from torch import nn

MAX_SIGNATURES = 4  # per layer; each new one costs a trace (~0.8 s per layer on the 2-core CI machine)
BUILD_TIMER = "harvest.compiled_pair.build"  # the name its builds are timed under (dynamo_timed)


@dataclasses.dataclass(eq=False)
class _Pair:
    forward: Callable  # [*parameters, *inputs] -> [output, *saved]
    backward: Callable  # [*saved, output gradient] -> a gradient (or None) per forward input
    num_parameters: int
    trainable: tuple[int, ...]  # the parameters that get gradients
    grad_layout: tuple[tuple[int, ...], tuple[int, ...]]  # the output gradient's (shape, stride) traced
    # The saved tensors sharing memory with an input (found at the first call: which outputs
    # are inputs or their views is the graph's): their versions are checked as autograd does.
    version_checked: tuple[int, ...] | None = None


class PairCompiler:
    """Builds pairs for a job's layers; layers whose traced graphs are equal share a pair.
    ``backend``: ``"inductor"``, or ``functools.partial(compile_fx, decompositions=...,
    config_patches=...)`` (harvest.train.eager_numerics'): the graphs are compiled as that
    backend compiles them under ``torch.compile``."""

    def __init__(self, backend: Any):
        from torch._inductor import compile_fx as inductor
        from torch._inductor.decomposition import select_decomp_table

        if backend == "inductor":
            # As compile_fx passes its default: a function its FX graph cache pickles by name.
            self.get_decomp_fn, self.config_patches = select_decomp_table, {}
        elif isinstance(backend, functools.partial) and backend.func is inductor.compile_fx:
            # A table its cache can pickle into the key (eager_numerics' pickles as a call).
            self.get_decomp_fn = inductor._ConstantDecompTable(backend.keywords["decompositions"])
            self.config_patches = backend.keywords.get("config_patches") or {}
        else:
            raise ValueError(f"explicit compiled pairs need inductor as the backend, not {backend!r}")
        self.decompositions = self.get_decomp_fn()
        self._by_graph: dict[tuple, _Pair] = {}
        self.gave_up = False  # a pair failed to build: every layer's units go through its module call

    def build(self, layer: nn.Module, names: list[str], call: Callable, tensors: list[torch.Tensor]) -> _Pair:
        from torch._dynamo.utils import dynamo_timed

        # Not under fork_rng: tracing on fake tensors draws nothing (tests/train/
        # test_compiled_pair.py checks it), and putting the process's generator back after
        # a build would rewind what other threads drew meanwhile (decode's sampling,
        # another job's dropout: the generator is the process's, not this thread's).
        with dynamo_timed(BUILD_TIMER):
            return self._build(layer, names, call, tensors)

    def _build(self, layer, names, call, tensors) -> _Pair:
        import torch._functorch.aot_autograd as aot
        from torch._inductor import compile_fx as inductor
        from torch._inductor import config as inductor_config
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv
        from torch.nn.utils.stateless import _reparametrize_module

        num_parameters = len(names)

        def layer_function(*flat):
            # The layer's own forward, not its torch.compile wrapper, over the given parameters.
            with _reparametrize_module(layer, dict(zip(names, flat[:num_parameters]))):
                return (call(*flat[num_parameters:]),)

        aot_config = aot.AOTConfig(
            fw_compiler=None, bw_compiler=None, inference_compiler=None, partition_fn=None,
            decompositions=self.decompositions, num_params_buffers=0, aot_id=next(aot.AOT_COUNTER),
            keep_inference_input_mutations=False, dynamic_shapes=False, aot_autograd_arg_pos_to_source=None,
            is_export=False, no_tangents=False, force_non_lazy_backward_lowering=True)
        compiled: dict[str, Any] = {}
        inner = functools.partial(inductor.compile_fx_inner, get_decomp_fn=self.get_decomp_fn)

        def forward_compiler(graph, example_inputs):
            compiled["metadata"] = torch._guards.TracingContext.get().fw_metadata
            compiled["inputs"] = len(example_inputs)
            compiled["extra"] = _compiler_config_extra(graph)
            compiled["forward"] = inductor.compile_fx_forward(
                graph, example_inputs, num_orig_model_outputs=1, num_example_inputs=len(tensors),
                compiler_config_extra=compiled["extra"], inner_compile=inner)
            return compiled["forward"]

        def backward_compiler(graph, example_inputs):
            tangent = example_inputs[-1]  # the output's gradient: the backward's last input
            compiled["grad_layout"] = (tuple(tangent.shape), tuple(tangent.stride()))
            compiled["backward"] = inductor.compile_fx_backward(
                graph, example_inputs, compiler_config_extra=compiled["extra"], inner_compile=inner)
            return compiled["backward"]

        with inductor_config.patch(self.config_patches), contextlib.ExitStack() as stack:
            flat_function, _ = aot.create_tree_flattened_fn(layer_function, tuple(tensors), {})
            # A shape environment with no symbol in it (static shapes, as the signature is):
            # inductor's FX graph cache keys on one and bypasses graphs traced without.
            shape_env = ShapeEnv()
            fake_mode = FakeTensorMode(shape_env=shape_env)
            fake_tensors, input_indices = aot.process_inputs(tensors, aot_config, fake_mode, shape_env,
                                                             ignore_shape_env=True)
            stack.enter_context(torch._guards.tracing(torch._guards.TracingContext(fake_mode)))
            state = aot.create_aot_state(stack, flat_function, fake_tensors,
                                         [aot.PlainAOTInput(i) for i in range(len(fake_tensors))],
                                         aot_config, fake_mode, shape_env)
            state.fw_metadata.act_input_indices = input_indices
            capture = aot.aot_stage1_graph_capture(state, flat_function)
            compiled["subclasses"] = capture.maybe_subclass_meta
            graph_key = self._graph_key(capture.graph_module, tensors)
            if graph_key is not None and graph_key in self._by_graph:
                return self._by_graph[graph_key]
            aot.aot_stage2_compile(state, capture, inductor.partition_fn, forward_compiler, backward_compiler, None)
        metadata = compiled["metadata"]
        _check_plain(metadata, compiled, len(tensors))
        pair = _Pair(compiled["forward"], compiled["backward"], num_parameters,
                     tuple(i for i in range(num_parameters) if tensors[i].requires_grad), compiled["grad_layout"])
        if graph_key is not None:
            self._by_graph[graph_key] = pair
        return pair

    @staticmethod
    def _graph_key(graph_module, tensors) -> tuple | None:
        """The traced joint graph's code and inputs: equal keys, equal computations. None
        (not shared) when the graph holds constants of its own, which the code does not show."""
        if any(node.op == "get_attr" for node in graph_module.graph.nodes):
            return None
        return graph_module.code, tuple(_meta(t) for t in tensors)


def _compiler_config_extra(graph):
    """Inductor's per-graph settings (CUDA graphs off unless configured, the device index):
    computed from the graph, or, in an older torch whose function takes ``config``, from
    inductor's configuration."""
    import inspect

    from torch._inductor import compile_fx as inductor
    from torch._inductor import config as inductor_config

    create = inductor.create_compiler_config_extra
    return create(inductor_config if "config" in inspect.signature(create).parameters else graph)


def _check_plain(metadata, compiled: dict, num_inputs: int) -> None:
    """Refuse (ValueError: the layers then run through their torch.compile call, saying
    why) a graph whose runtime calling convention is not the plain one this module calls it by."""
    problems = []
    if compiled.get("backward") is None:
        problems.append("no backward graph")
    if compiled.get("inputs") != num_inputs:
        problems.append("inputs deduplicated or added")
    if any(info.mutates_data or info.mutates_metadata for info in metadata.input_info):
        problems.append("an input is mutated")
    if len(metadata.output_info) != 1 or metadata.output_info[0].output_type.name != "non_alias":
        problems.append("the output aliases an input")
    if metadata.num_intermediate_bases or metadata.num_symints_saved_for_bw or metadata.tokens \
            or metadata.num_opaque_objects_saved_for_bw or metadata.num_graphsafe_rng_states:
        problems.append("more than tensors saved (symbolic sizes, effect tokens or RNG states)")
    if compiled.get("subclasses") is not None:
        problems.append("tensor subclasses")
    if problems:
        raise ValueError("the layer's graph needs AOT autograd's runtime: " + ", ".join(problems))


def _sharing_an_input(saved: list, tensors: list) -> tuple[int, ...]:
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    return tuple(i for i, s in enumerate(saved) if torch.is_tensor(s) and s.untyped_storage().data_ptr() in storages)


def _meta(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.requires_grad


class PairedLayer:
    """One decoder layer's training forward through its pairs (one per signature).
    ``on_failure(error)``: a pair could not be built; True: build it again (once), False:
    the job's layers' units go through their module calls from then on (their
    ``torch.compile`` call, eager where that cannot compile either; harvest.train.compiled_units
    says why in the status, and sets ``_compiled_call_impl`` to None for an eager layer,
    which this follows)."""

    def __init__(self, layer: nn.Module, compiler: PairCompiler, on_failure: Callable[[BaseException], bool]):
        self.layer = layer
        self.compiler = compiler
        self.on_failure = on_failure
        named = list(layer.named_parameters())
        self._names = [name for name, _ in named]
        # Where each parameter lives: the weight window swaps the tensors in place.
        self._homes = [_home(layer, name) for name in self._names]
        self._modules = list(layer.modules())
        self._pairs: dict[tuple, _Pair] = {}
        self.calls = 0  # forward units run through a pair
        self.past_limit = 0  # forward units of a new signature past MAX_SIGNATURES (run by the module call)

    def forward(self, hidden: torch.Tensor, attention_mask, position_ids, position_embeddings):
        """(output, `SavedForBackward`), or None: the caller runs the layer itself (no pair
        could be built, it failed to compile, or it has met more signatures than
        `MAX_SIGNATURES`)."""
        if self.compiler.gave_up or self.layer._compiled_call_impl is None \
                or not isinstance(position_embeddings, tuple):
            return None  # no pair for it, or eager; or not a (cos, sin) rotary layer
        cos, sin = position_embeddings
        inputs = [hidden, attention_mask, position_ids, cos, sin]
        if not all(t is None or type(t) is torch.Tensor for t in inputs):
            return None  # a block mask or a tensor subclass: the module call handles those
        signature = self._signature(inputs)
        pair = self._pairs.get(signature)
        parameters = [module._parameters[attr] for module, attr in self._homes]
        if pair is None:
            if len(self._pairs) >= MAX_SIGNATURES:
                self.past_limit += 1
                return None
            for attempt in range(2):
                try:
                    pair = self._pairs[signature] = self._build(parameters, inputs)
                    break
                except Exception as failure:  # any error of the build (nothing of the call has run)
                    if not self.on_failure(failure) or attempt:
                        # A decoder's layers are alike: what fails for one fails for every
                        # one (one failed trace per job, not one per layer).
                        self.compiler.gave_up = True
                        return None
        # As AOT autograd calls it: under no_grad (the graph records nothing, so no input
        # needs detaching) and without autocast (the traced graph has its casts).
        flat = parameters + [t for t in inputs if t is not None]
        with torch.no_grad(), torch._C._DisableAutocast():
            outputs = pair.forward(list(flat))
        self.calls += 1
        return outputs[0], SavedForBackward(pair, parameters, list(outputs[1:]), flat, hidden.requires_grad)

    def pairs(self) -> list[_Pair]:
        """The compiled pairs this layer has traced, one per signature (shared with layers
        whose graphs are equal)."""
        return list(self._pairs.values())

    def _build(self, parameters, inputs) -> _Pair:
        present = [t is not None for t in inputs]
        layer = self.layer

        def call(*tensors):
            it = iter(tensors)
            hidden, mask, position_ids, cos, sin = (next(it) if here else None for here in present)
            output = layer._call_impl(hidden, attention_mask=mask, position_ids=position_ids,
                                      position_embeddings=(cos, sin))
            return output[0] if isinstance(output, tuple) else output  # older layers return (hidden, ...)

        return self.compiler.build(layer, self._names, call, parameters + [t for t in inputs if t is not None])

    def _signature(self, inputs) -> tuple:
        device = inputs[0].device.type
        return (tuple(None if t is None else (t.shape, t.stride(), t.dtype) for t in inputs),
                inputs[0].requires_grad, tuple(m.training for m in self._modules),
                torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device),
                torch.are_deterministic_algorithms_enabled())


class SavedForBackward:
    """What a layer's forward unit keeps for its backward unit: the pair and its saved tensors."""

    def __init__(self, pair: _Pair, parameters: list, saved: list, inputs: list, input_requires_grad: bool):
        self.pair = pair
        # Only the trainable ones: a frozen weight kept here would keep an evicted window
        # buffer alive (the window's invariant); those the backward needs are in ``saved``.
        self.trainable = [parameters[i] for i in pair.trainable]
        self.input_requires_grad = input_requires_grad
        if pair.version_checked is None:
            pair.version_checked = _sharing_an_input(saved, inputs)
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.unpack = None
        if hooks is not None:  # what autograd would have done with them: the window's handles
            pack, self.unpack = hooks
            saved = [pack(t) for t in saved]
            self.versions = None  # autograd checks no tensor saved through hooks
        else:
            self.versions = [saved[i]._version for i in pair.version_checked]
        self.saved = saved

    def backward(self, grad_output: torch.Tensor) -> torch.Tensor | None:
        """Accumulate the trainable parameters' gradients; return the input's gradient
        (None when the input needs none)."""
        pair, saved = self.pair, self.saved
        self.saved = None  # freed as the graph frees them, once used
        if self.unpack is not None:
            saved = [self.unpack(t) for t in saved]
        elif any(saved[i]._version != v for i, v in zip(pair.version_checked, self.versions)):
            raise RuntimeError("a tensor a compiled layer saved for its backward was modified in place "
                               "between its forward and backward units")
        shape, stride = pair.grad_layout
        if grad_output.stride() != stride:  # the layout the backward was traced with, as AOT autograd makes it
            grad_output = torch.empty_strided(shape, stride, dtype=grad_output.dtype,
                                              device=grad_output.device).copy_(grad_output)
        with torch.no_grad(), torch._C._DisableAutocast():
            grads = pair.backward([*saved, grad_output])
        for parameter, index in zip(self.trainable, pair.trainable):
            if grads[index] is not None:  # None: the output does not depend on it (autograd adds nothing)
                _accumulate(parameter, grads[index])
        return grads[pair.num_parameters] if self.input_requires_grad else None


def _accumulate(parameter: torch.Tensor, grad: torch.Tensor) -> None:
    """Autograd's AccumulateGrad: the first gradient becomes ``.grad`` (copied into the
    parameter's layout if it has another), later ones are added in place."""
    if parameter.grad is None:
        if grad.stride() != parameter.stride():
            grad = torch.empty_strided(parameter.shape, parameter.stride(), dtype=grad.dtype,
                                       device=grad.device).copy_(grad)
        parameter.grad = grad
    else:
        parameter.grad.add_(grad)


def _home(layer: nn.Module, name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = name.rpartition(".")
    return layer.get_submodule(module_name), attr
