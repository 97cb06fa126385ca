"""Shared by the transformers engine's tests: the tiny model on a device, what a request
decodes alone, and CUDA graphs emulated on CPU."""

from __future__ import annotations

import pytest

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def model_on(path, device):
    from harvest.engines.transformers.model import load_causal_lm

    return load_causal_lm(str(path), device, "float32", False).requires_grad_(False)


def solo_logits(model, prompt, steps, device):
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        cache, length, rows = out.past_key_values, len(prompt), []
        next_id = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            out = model(input_ids=next_id, past_key_values=cache, position_ids=torch.tensor([[length]], device=device),
                        use_cache=True)
            rows.append(out.logits[0, -1].float().cpu())
            next_id, cache, length = out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values, length + 1
    return rows


class EmulatedGraphBackend:
    """'Graphs' that re-run the captured step (CPU): the measurement's capture, replay,
    check and report run as on a GPU."""

    unavailable = None

    def __init__(self):
        self.next_run, self.used = None, 0

    def new_pool(self):
        return "pool"

    def new_graph(self):
        return {"run": None}

    def capture(self, graph, stream, pool):
        import contextlib

        graph["run"] = self.next_run
        return contextlib.nullcontext()

    def on_stream(self, stream):
        import contextlib

        return contextlib.nullcontext()

    def wait(self, stream, other):
        pass

    def synchronize(self, stream):
        pass

    def replay(self, graph):
        graph["run"]()

    def memory(self):
        self.used += 1 << 20
        return self.used // 2, self.used


def emulated_graphs():
    from harvest.engines.transformers.captured_graphs import CapturedLevelGraphs

    class EmulatedGraphs(CapturedLevelGraphs):
        def __init__(self, levels):
            super().__init__(levels, EmulatedGraphBackend())

        def capture(self, level, batch_size, run):
            self.backend.next_run = run
            return super().capture(level, batch_size, run)

    return EmulatedGraphs
