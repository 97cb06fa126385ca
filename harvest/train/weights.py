"""Weight sources: where the trainer's frozen base-model weights come from.

Two sources exist. `HostCopyWeightSource` holds the checkpoint's weights in host memory
(pinned when the device is CUDA, so window loads are asynchronous); the window copies a
stage from it when the stage becomes resident. `SharedTensorWeightSource` wraps tensors
that already exist on the compute device — in same-base-model mode, the serving engine's
own weights — and the window uses them in place: no second copy, nothing swapped.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Iterable, Mapping

import torch

from harvest.train.errors import WeightSourceError


@dataclasses.dataclass(frozen=True)
class FrozenWeightSpec:
    """What the model expects for one frozen tensor."""

    name: str  # base model state-dict name, e.g. "model.layers.0.mlp.up_proj.weight"
    shape: tuple[int, ...]
    dtype: torch.dtype


class BaseWeightSource(abc.ABC):
    """Provides the frozen weights of the finetune base model.

    Contract:
    - Tensors are named by the base model's state-dict names (Hugging Face naming, PEFT's
      ``base_model.model.`` prefix and ``.base_layer`` removed), e.g.
      ``model.layers.0.self_attn.q_proj.weight``. Tied weights may be asked for under
      each of their names.
    - `tensor(name)` returns a tensor of the expected shape and dtype whose values never
      change while the trainer runs (the weights are frozen; the trainer never writes them).
    - `device_resident` is True when the tensors already live on the compute device: the
      window then uses them in place (no copy, no window memory, nothing to swap). False
      means host copies that the window copies into its own device memory.
    - `validate(specs, device)` raises `WeightSourceError` naming the first tensor that is
      missing or does not match; the trainer calls it before training starts.
    """

    device_resident: bool = False

    @abc.abstractmethod
    def tensor(self, name: str) -> torch.Tensor:
        """The frozen tensor called `name`."""

    def validate(self, specs: Iterable[FrozenWeightSpec], device: torch.device) -> None:
        for spec in specs:
            try:
                tensor = self.tensor(spec.name)
            except KeyError:
                raise WeightSourceError(f"weight source has no tensor {spec.name!r}") from None
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise WeightSourceError(
                    f"weight source tensor {spec.name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                    f"the model expects {spec.shape} {spec.dtype}")
            if self.device_resident and tensor.device != device:
                raise WeightSourceError(
                    f"weight source tensor {spec.name!r} is on {tensor.device}, the trainer runs on {device}")

    def host_bytes(self) -> int:
        """Host memory this source holds for the trainer (0 when it borrows tensors)."""
        return 0


class HostCopyWeightSource(BaseWeightSource):
    """The checkpoint's frozen weights, held in host memory (the default source).

    Built from the tensors the model was loaded with, so on a CPU-only run no extra copy
    is made; with `pin_memory` each tensor is copied once into page-locked memory so the
    window's host-to-device copies can run asynchronously on a copy stream.
    """

    device_resident = False

    def __init__(self, tensors: Mapping[str, torch.Tensor], pin_memory: bool = False):
        pinned: dict[int, torch.Tensor] = {}  # tied weights are pinned once
        self._tensors: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            host = tensor.detach()
            if host.device.type != "cpu":
                raise WeightSourceError(f"host weight {name!r} is on {host.device}, expected host memory")
            if pin_memory:
                host = pinned.setdefault(id(tensor), host.contiguous().pin_memory())
            self._tensors[name] = host

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def host_bytes(self) -> int:
        unique = {t.data_ptr(): t.numel() * t.element_size() for t in self._tensors.values()}
        return sum(unique.values())


class SharedTensorWeightSource(BaseWeightSource):
    """Existing device tensors used in place (same-base-model mode).

    `tensors` maps state-dict names to tensors that stay valid and unchanged for the
    trainer's lifetime, e.g. views into the serving engine's weights (a fused ``qkv_proj``
    weight's row slices are valid ``q_proj``/``k_proj``/``v_proj`` tensors).
    """

    device_resident = True

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = {name: tensor.detach() for name, tensor in tensors.items()}

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]
