"""The tensors a model computes at load (not in its checkpoint) are checked before training:
a garbage rotary table is a JobError at build, not a model trained on wrong positions."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from harvest.train.computed_buffers import check_computed_buffers
from harvest.train.errors import JobError


def _model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


@pytest.mark.parametrize("which", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_model_loaded_as_transformers_loads_it_passes(which, dtype, tiny_llama_path, tiny_qwen2_path):
    """In bf16/fp16 the float32 table holds values rounded to that dtype ([1, 0.3164, ...])."""
    check_computed_buffers(_model(tiny_llama_path if which == "llama" else tiny_qwen2_path, dtype))


def test_finite_garbage_in_the_rotary_table_is_named(tiny_llama_path):
    model = _model(tiny_llama_path)
    with torch.no_grad():
        model.model.rotary_emb.inv_freq[1:] = 0.0  # what fresh, unset pages hold
    with pytest.raises(JobError, match=r"^model_name_or_path: the loaded model's model.rotary_emb.inv_freq is "
                                       r"\[1, 0, 0, 0, \.\.\.\], its config gives \[1, 0.3162,") as refused:
        check_computed_buffers(model)
    assert "not read from the checkpoint" in str(refused.value)


def test_every_wrong_buffer_is_named_rotary_table_first(tiny_llama_path):
    model = _model(tiny_llama_path)
    model.model.register_buffer("scratch", torch.tensor([0.0, float("nan")]), persistent=False)
    with pytest.raises(JobError, match=r"the loaded model's model.scratch holds non-finite values; "):
        check_computed_buffers(model)
    with torch.no_grad():
        model.model.rotary_emb.original_inv_freq.fill_(float("nan"))
        model.model.rotary_emb.inv_freq.fill_(float("nan"))
    with pytest.raises(JobError, match=r"the loaded model's model.rotary_emb.inv_freq is \[nan, nan, nan, nan, \.\.\.\], "
                                       r"its config gives .*; model.scratch holds non-finite values; "
                                       r"model.rotary_emb.original_inv_freq holds non-finite values; "):
        check_computed_buffers(model)


def test_a_rope_variant_it_cannot_compute_is_left_alone(tiny_llama_path):
    model = _model(tiny_llama_path)
    model.model.rotary_emb.rope_type = {"full_attention": "default"}  # per-layer-type ropes: not one table
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.zero_()
    check_computed_buffers(model)


def test_a_process_whose_torch_factories_are_wrapped_is_refused_at_build(tiny_llama_path, tmp_path):
    """What the SGLang LoRA tests' sitecustomize once did to the server process: wrapped
    ``torch.arange`` and friends escape transformers' meta-device context, so the model's
    rotary table kept unset memory. The job fails at build with a JobError that says so;
    before the check it trained (garbage positions; a NaN loss at step 1 when the garbage
    held a NaN)."""
    from tests.train.trainer_helpers import job_dict

    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(tiny_llama_path, tmp_path / "out", max_steps=1)))
    # Unset memory is filled with NaN (torch's deterministic mode), not left as whatever
    # the allocator held: garbage that happened to look right would pass the build.
    script = textwrap.dedent(f"""
        import functools, torch
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        for name in ("tensor", "empty", "zeros", "ones", "arange", "full", "empty_strided", "as_tensor"):
            def without_pinning(*args, _factory=getattr(torch, name), **kwargs):
                kwargs.pop("pin_memory", None)
                return _factory(*args, **kwargs)
            setattr(torch, name, functools.wraps(getattr(torch, name))(without_pinning))
        from harvest.train.build import build_trainer
        from harvest.train.errors import JobError
        from harvest.train.job import load_job
        try:
            build_trainer(load_job({str(job)!r}))
        except JobError as exc:
            print("REFUSED", exc)
        else:
            print("BUILT")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert "REFUSED model_name_or_path: the loaded model's" in out.stdout, (out.stdout, out.stderr[-3000:])
    assert "model.rotary_emb.inv_freq is [nan, nan, nan, nan, ...], its config gives [1, 0.3162" in out.stdout
    assert "model.rotary_emb.original_inv_freq holds non-finite values" in out.stdout
