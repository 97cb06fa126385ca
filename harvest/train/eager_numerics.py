"""Inductor, keeping eager's fp32 numerics: the backend of the trainer's compiled layers on a CPU.

Compiled with plain inductor, a Llama decoder layer computes other bits than eager in two
places only (found by compiling one part of the layer at a time and comparing each
operator's outputs and gradients with eager's; docs/measurements.md, trainer section):

- reductions: inductor's generated loops sum in another order than ATen's ``sum`` and
  ``mean`` kernels. In a layer these are RMSNorm's mean of squares (forward) and the sum
  over the hidden dimension in its backward; about half the rows differ by an ulp.
- SiLU's backward: ATen's kernel computes ``1 + x * (1 - sigmoid)`` with a fused
  multiply-add, inductor (its C++ built with ``-ffp-contract=off``) with a multiply and
  an add; 18% of the elements differ by an ulp.

Everything else a layer runs (projections, LoRA, rotary embedding, attention, SiLU,
residual adds) inductor computes bit for bit as eager does. The two places' ulps grow
through the layers' backward: over 32 layers the LoRA gradients differed from eager's by
1.5e-5 (gradients up to 1.2), as much as fp32's own error against float64.

This backend leaves exactly those to ATen:
- a post-grad pass marks every ``sum`` with a ``harvest::eager_*`` op whose lowering is
  a call of ATen's kernel (inductor cannot fuse into it), and rewrites every ``mean`` as
  that sum divided by the count, which is what ATen's CPU mean computes; the pointwise
  work around them stays fused;
- ``silu_backward`` decomposes into a ``harvest::eager_silu_backward`` op lowered, the same
  way, as a call of ATen's kernel. (Leaving it out of the decomposition table instead
  makes inductor fall back to ATen by itself, but inductor refuses that fallback, as an
  error, whenever the environment variable ``CI`` is set: its own check that ops with a
  decomposition are decomposed. A backend must not depend on the environment.)

Its graphs' LoRA gradients then equal eager's bit for bit, and no slower: the few extra
kernel calls cost what inductor's size and alignment asserts did, which it leaves out
(dynamo's guards have checked the inputs' sizes and strides already).

Invariant: a cache key says which numerics an artifact has. Inductor keys its FX graph
and AOT autograd caches on its configuration, which holds the pass and its ``uuid()``
(this file's hash), but not on the decompositions: without the uuid, a graph compiled
earlier with plain inductor would be loaded for this backend, silently.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

# Decomposed into a call of ATen's kernel (fused multiply-add) rather than inductor's mul + add:
# ATen op -> (harvest op, its arguments after ``self``).
_KEPT_WHOLE = {"silu_backward.default": ("eager_silu_backward", "Tensor grad_output, Tensor self")}
# The reductions eager runs as ATen kernels -> the harvest op that calls that kernel (its schema).
_REDUCTIONS = {
    "sum.dim_IntList": ("eager_sum", "int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None"),
    "sum.default": ("eager_sum_all", "*, ScalarType? dtype=None"),
    "mean.dim": ("eager_mean", "int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None"),
    "mean.default": ("eager_mean_all", "*, ScalarType? dtype=None"),
}

_library: Any = None  # torch.library.Library("harvest", "FRAGMENT"): the reductions' ops, defined once
_library_lock = threading.Lock()  # jobs build (and compile) on threads of their own


@functools.cache
def backend():
    """The ``torch.compile`` backend: inductor with ATen's reductions and SiLU backward
    (one per process)."""
    from torch._inductor.compile_fx import compile_fx

    swaps = _define_ops()
    return functools.partial(compile_fx, decompositions=_decompositions(), config_patches={
        "post_grad_custom_post_pass": _eager_reductions_pass(swaps),
        # Inductor's checks of every input's and fallback output's sizes, strides and
        # alignment, in Python on each call (~30 us of a 700 us unit here): dynamo's
        # guards have checked the inputs' sizes and strides already, and the outputs are
        # ATen's.
        "size_asserts": False,
        "alignment_asserts": False,
        # Random numbers (LoRA dropout's masks) from ATen's generator, as eager draws them.
        "fallback_random": True,
    })


class _Decompositions(dict):
    """Inductor's decomposition table, ``_KEPT_WHOLE``'s ops decomposed into their harvest
    ops. Inductor's cache key pickles the table it is given, and some of its entries are
    C++ functions, which cannot be pickled (the FX graph cache would be bypassed: every
    layer compiled again in every process); this pickles as a call of `_decompositions`,
    and the pass's uuid covers what it holds."""

    def __reduce__(self):
        return _decompositions, ()


def _decompositions() -> _Decompositions:
    from torch._inductor import config
    from torch._inductor.decomposition import select_decomp_table

    _define_ops()
    with config.patch(fallback_random=True):  # the table inductor would use with it (random ops kept)
        table = dict(select_decomp_table())
    for name, (op, _) in _KEPT_WHOLE.items():
        table[_aten(name)] = getattr(torch.ops.harvest, op).default
    return _Decompositions(table)


def _aten(name: str):
    packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


def _define_ops() -> dict:
    """``harvest::eager_sum`` and the like: ATen's reduction kernels (and SiLU's backward)
    behind ops inductor does not know, so it calls them as they are. Returns {ATen op:
    harvest op} of the reductions; a swapped node keeps its arguments (the same schema)."""
    with _library_lock:
        _define_ops_locked()
    return {_aten(name): getattr(torch.ops.harvest, op).default for name, (op, _) in _REDUCTIONS.items()}


def _define_ops_locked() -> None:
    global _library
    if _library is None:
        from torch._inductor.lowering import fallback_handler, register_lowering

        library = torch.library.Library("harvest", "FRAGMENT")
        signatures = {name: (op, f"Tensor self, {arguments}") for name, (op, arguments) in _REDUCTIONS.items()}
        signatures.update(_KEPT_WHOLE)
        for name, (op, arguments) in signatures.items():
            library.define(f"{op}({arguments}) -> Tensor")
            library.impl(op, _aten(name), "CompositeExplicitAutograd")
            # Lowered as a call of the ATen op itself (a fallback kernel, no Python in
            # between): the harvest op only marks the node, it never runs in the graph.
            register_lowering(getattr(torch.ops.harvest, op).default, type_promotion_kind=None)(
                fallback_handler(_aten(name), add_to_fallback_set=False))
        _library = library


@functools.cache
def _pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class EagerReductions(CustomGraphPass):
        """Post-grad pass: each ATen reduction node calls its harvest op instead."""

        def __init__(self, swaps: dict):
            self.swaps = swaps

        def __call__(self, graph: torch.fx.Graph) -> None:
            for node in list(graph.nodes):
                if node.op != "call_function" or node.target not in self.swaps:
                    continue
                count = _mean_count(node)
                if count is None:
                    node.target = self.swaps[node.target]
                    continue
                # ATen's CPU mean is its sum divided by the count: the sum is ATen's
                # kernel, the division (correctly rounded) inductor's.
                with graph.inserting_before(node):
                    total = graph.call_function(self.swaps[torch.ops.aten.sum.dim_IntList],
                                                (node.args[0], *_sum_arguments(node)),
                                                {k: v for k, v in node.kwargs.items() if k == "dtype"})
                    mean = graph.call_function(torch.ops.aten.div.Tensor, (total, count))
                total.meta.update(node.meta)
                mean.meta.update(node.meta)
                node.replace_all_uses_with(mean)
                graph.erase_node(node)

        def uuid(self) -> Any:
            return get_hash_for_files((__file__,))

    return EagerReductions


def _mean_count(node) -> int | None:
    """How many elements a ``mean`` node averages, when it is ATen's sum divided by that:
    None for a sum, a count that is symbolic, or a half-precision input (ATen sums that in
    fp32 and rounds after the division; such a mean calls ATen's mean instead)."""
    if node.target not in (torch.ops.aten.mean.dim, torch.ops.aten.mean.default):
        return None
    value = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if value is None or value.dtype not in (torch.float32, torch.float64):
        return None
    dims = _sum_arguments(node)[0] or range(value.dim())  # None or []: every dimension
    count = 1
    for dim in dims:
        size = value.shape[dim]
        if not isinstance(size, int):
            return None
        count *= size
    return count


def _sum_arguments(node) -> tuple:
    """(dims, keepdim) of a ``mean`` node, as ``sum.dim_IntList`` takes them."""
    if node.target is torch.ops.aten.mean.default:
        return None, False
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return dims, keepdim


def _eager_reductions_pass(swaps: dict):
    return _pass_class()(swaps)
