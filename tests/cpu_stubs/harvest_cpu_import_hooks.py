"""Import hooks for the CPU environment (installed by scripts/setup_env.sh via a .pth file).

The PyPI torchvision wheel is a CUDA build: its ``_C.so`` needs ``libtorch_cuda.so``, so
on the CPU torch it fails to load and ``import torchvision`` then dies with
``operator torchvision::nms does not exist`` (its meta registrations assume the op).
SGLang 0.5.23 imports torchvision at module level (``sglang/srt/multimodal``), so it is
needed even for text models. Before torchvision's first import this hook defines the
``torchvision::nms`` op with a plain-torch CPU kernel, and ``qnms`` as a schema only
(the two ops whose absence breaks the import; no text-model path calls them).

The hook is lazy: it costs nothing until something imports torchvision, so the many
short Python processes of the test suite do not pay for importing torch at start-up.
"""

from __future__ import annotations

import importlib.abc
import sys


def _nms_cpu(dets, scores, iou_threshold: float):
    import torch

    if dets.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    x1, y1, x2, y2 = dets.unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    order = scores.argsort(descending=True)
    keep = []
    while order.numel() > 0:
        i = order[0]
        keep.append(int(i))
        rest = order[1:]
        w = (torch.minimum(x2[i], x2[rest]) - torch.maximum(x1[i], x1[rest])).clamp(min=0)
        h = (torch.minimum(y2[i], y2[rest]) - torch.maximum(y1[i], y1[rest])).clamp(min=0)
        inter = w * h
        iou = inter / (areas[i] + areas[rest] - inter)
        order = rest[iou <= iou_threshold]
    return torch.tensor(keep, dtype=torch.long)


def _qnms_unavailable(dets, scores, iou_threshold: float):
    raise NotImplementedError("torchvision::qnms is not available with the CPU stand-in")


def _define_torchvision_ops() -> None:
    import torch

    try:
        torch.ops.torchvision.nms.default  # already defined (a working torchvision)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.impl("nms", _nms_cpu, "CPU")
    # qnms (quantized boxes) only needs to exist for torchvision's fake registration.
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.impl("qnms", _qnms_unavailable, "CPU")
    # Keep the Library object alive: dropping it unregisters the op.
    sys.modules[__name__]._torchvision_lib = lib


class _TorchvisionFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        _define_torchvision_ops()
        return None  # let the normal finders import the real package


def install() -> None:
    if not any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionFinder())
