"""Same-base-model mode: SGLang's served parameters, unfused, are exactly the checkpoint's
tensors (as views, no copy), for the Llama and the Qwen2 (q/k/v biases) tiny models.

SGLang's process-wide state allows one model runner per process, so each model is checked
in its own interpreter (this file's ``__main__``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def check(model_path: str) -> None:
    import os

    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    from pathlib import Path

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from harvest.predict.profiler.engines import EngineConfig
    from harvest.predict.profiler.sglang_engine import SglangDecodeEngine
    from harvest.sglang.served_weights import served_weight_tensors

    checkpoint = load_file(str(Path(model_path) / "model.safetensors"))
    engine = SglangDecodeEngine(EngineConfig(model_path, "cpu", "float32", False, max_batch_size=2, max_context_tokens=64))
    try:
        model = engine.runner.model
        served = served_weight_tensors(model, AutoConfig.from_pretrained(model_path))
        missing = set(checkpoint) - set(served)
        assert not missing, missing
        for name, tensor in checkpoint.items():
            assert torch.equal(served[name], tensor), name
        fused = dict(model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"]
        k_proj = served["model.layers.0.self_attn.k_proj.weight"]
        assert k_proj.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr(), "a copy, not a view"
    finally:
        engine.close()
    print("served weights OK")


@pytest.mark.sglang
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_served_tensors_equal_the_checkpoint(family, request):
    model_path = request.getfixturevalue(f"tiny_{family}_path")
    out = subprocess.run([sys.executable, __file__, str(model_path)], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0 and "served weights OK" in out.stdout, out.stderr[-3000:]


def test_same_checkpoint(tmp_path):
    from harvest.sglang.served_weights import same_checkpoint

    assert same_checkpoint(tmp_path, str(tmp_path) + "/")
    assert not same_checkpoint(tmp_path, tmp_path.parent)


if __name__ == "__main__":
    check(sys.argv[1])
