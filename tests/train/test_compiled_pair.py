"""Decoder layers' training units as explicit compiled pairs (harvest.train.compiled_pair), fp32 on CPU.

- A step through the pairs equals the eager step bit for bit (gradients accumulated over
  two micro-batches, LoRA dropout's masks, a one-stage window whose saved frozen weights
  are stage handles); the gradients are accumulated as autograd's AccumulateGrad does.
- A layer whose pair cannot be built trains through its torch.compile call, with the reason
  in the status; so does a signature past the pairs' limit. The pair built as on CUDA
  (plain inductor) equals the eager step to fp32 rounding.
- A saved input changed in place between the forward and backward units is refused, as
  autograd refuses it.
"""

from __future__ import annotations

import pytest
import torch

from harvest.train import compiled_pair
from harvest.train.stats import UnitKind
from tests.train.trainer_helpers import build, lora_grads, max_abs_diff, randomize_lora_b, run_until_optimizer

pytestmark = pytest.mark.timeout(900)


def _step_grads(trainer, seed=5):
    randomize_lora_b(trainer)
    torch.manual_seed(seed)  # the same dropout masks in both trainers
    run_until_optimizer(trainer)
    return lora_grads(trainer.split.peft_model)


def _pair_calls(trainer) -> list[int]:
    return [paired.calls for paired in trainer.split.compiled.paired]


@pytest.mark.slow
@pytest.mark.parametrize("window_stages, lora_dropout", [("all", 0.1), (1, 0.0)])
def test_a_step_through_the_pairs_equals_the_eager_step(window_stages, lora_dropout, tiny_llama_path, tmp_path):
    harvest = {"window_stages": window_stages, "micro_batch_size": 2}
    eager = build(tiny_llama_path, tmp_path / "eager", compile_layers="off", harvest=harvest,
                  lora_dropout=lora_dropout, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    paired = build(tiny_llama_path, tmp_path / "paired", compile_layers="on", harvest=harvest,
                   lora_dropout=lora_dropout, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    expected = _step_grads(eager)
    got = _step_grads(paired)

    assert len(paired._step.micro_batches) == 2  # the second micro-batch's gradients add to the first's
    assert max_abs_diff(got, expected) == 0.0
    assert max(float(g.abs().max()) for g in expected.values()) > 1e-3  # not vacuous
    # Every layer's forward units ran as pairs (one per micro-batch), none through autograd.
    assert _pair_calls(paired) == [2] * paired.split.num_layers
    shapes = {tuple(mb.input_ids.shape) for mb in paired._step.micro_batches}
    status = paired.stats().compile
    assert status == {"requested": "on", "layers_compiled": paired.split.num_layers, "reason": None,
                      "signatures": len(shapes), "compiled_pairs": status["compiled_pairs"],
                      "units_past_signature_limit": 0}
    # Layer 0's input needs no gradient (a graph of its own); the layers after it share theirs.
    assert len(shapes) <= status["compiled_pairs"] <= 2 * len(shapes)


@pytest.mark.slow
def test_pairs_compiled_as_on_cuda_equal_the_eager_step(tiny_llama_path, tmp_path, monkeypatch):
    """The pair under CUDA's configuration (plain "inductor": its default decompositions and
    settings), here on a CPU: every layer unit runs through a pair, and the step equals
    eager's to fp32 rounding (inductor's own kernels, not eager_numerics')."""
    from torch._inductor.decomposition import select_decomp_table

    from harvest.train import compiled_units, split_model

    def compile_layers(layers, requested, device, **kwargs):
        return compiled_units.compile_layers(layers, requested, device, **{**kwargs, "backend": "inductor",
                                                                            "pairs": True})

    expected = _step_grads(build(tiny_llama_path, tmp_path / "eager", compile_layers="off"))
    monkeypatch.setattr(split_model, "compile_layers", compile_layers)
    paired = build(tiny_llama_path, tmp_path / "paired", compile_layers="on")
    got = _step_grads(paired)

    assert _pair_calls(paired) == [len(paired._step.micro_batches)] * paired.split.num_layers
    assert paired.stats().compile["reason"] is None and paired.stats().compile["units_past_signature_limit"] == 0
    # Inductor's default table by name, as compile_fx passes it: its FX graph cache can key on it.
    assert paired.split.compiled.paired[0].compiler.get_decomp_fn is select_decomp_table
    assert max_abs_diff(got, expected) <= 1e-5
    assert max(float(g.abs().max()) for g in expected.values()) > 1e-3  # not vacuous


def test_saved_frozen_weights_are_stage_handles_where_the_window_needs_them(tiny_llama_path, tmp_path):
    from harvest.train.window import _WeightHandle

    trainer = build(tiny_llama_path, tmp_path / "one", compile_layers="on", harvest={"window_stages": 1})
    assert trainer.window.needs_saved_tensor_hooks()
    randomize_lora_b(trainer)
    while trainer.next_unit().kind == UnitKind.FORWARD:
        trainer.run_one_unit()
    saved = trainer._step.micro_batches[0].pair_saved
    assert sorted(saved) == [1, 2]  # both decoder layers' stages
    for stage_saved in saved.values():
        handles = [t for t in stage_saved.saved if isinstance(t, _WeightHandle)]
        assert handles and not any(torch.is_tensor(t) and t.device.type == "meta" for t in stage_saved.saved)
    run_until_optimizer(trainer)  # the backward units rebuild them from the window
    assert all(p.grad is not None for p in trainer.trainable_params)


def test_gradients_accumulate_as_autograds_accumulate_grad():
    parameter = torch.nn.Parameter(torch.zeros(3, 4))
    first, second = torch.randn(3, 4), torch.randn(4, 3).t()  # the second in another layout
    expected = torch.nn.Parameter(torch.zeros(3, 4))
    (expected * 1).backward(first.clone())
    (expected * 1).backward(second.clone())

    compiled_pair._accumulate(parameter, first)
    assert parameter.grad is first  # the first gradient becomes .grad, as autograd steals it
    compiled_pair._accumulate(parameter, second)
    assert parameter.grad is first and torch.equal(parameter.grad, expected.grad)  # added in place

    fresh = torch.nn.Parameter(torch.zeros(3, 4))
    compiled_pair._accumulate(fresh, second)  # a first gradient in another layout: copied into the parameter's
    assert fresh.grad.stride() == fresh.stride() and torch.equal(fresh.grad, second)


def test_a_layer_whose_pair_cannot_be_built_trains_through_torch_compile_and_says_why(tiny_llama_path, tmp_path,
                                                                                       monkeypatch):
    builds = []

    def fails(self, *args):
        builds.append(1)
        raise RuntimeError("this pair builds nothing")

    monkeypatch.setattr(compiled_pair.PairCompiler, "_build", fails)
    eager = build(tiny_llama_path, tmp_path / "eager", compile_layers="off")
    trainer = build(tiny_llama_path, tmp_path / "fails", compile_layers="on")
    expected = _step_grads(eager)
    assert max_abs_diff(_step_grads(trainer), expected) == 0.0
    _step_grads(trainer)
    assert len(builds) == 1  # the layers are alike: one failure, and no layer tries again

    status = trainer.stats().compile
    assert status["layers_compiled"] == trainer.split.num_layers  # still compiled: torch.compile's runtime
    assert "compiled pair could not be built; its units run through torch.compile" in status["reason"]
    assert "this pair builds nothing" in status["reason"]
    assert all(layer._compiled_call_impl is not None for layer in trainer.split.decoder.layers)
    assert _pair_calls(trainer) == [0, 0]


def test_inductors_per_graph_settings_come_from_the_graph_or_from_older_torchs_configuration(monkeypatch):
    from torch._inductor import compile_fx as inductor
    from torch._inductor import config as inductor_config

    seen = []
    monkeypatch.setattr(inductor, "create_compiler_config_extra", lambda gm: seen.append(gm))
    compiled_pair._compiler_config_extra("graph")
    monkeypatch.setattr(inductor, "create_compiler_config_extra", lambda config: seen.append(config))
    compiled_pair._compiler_config_extra("graph")
    assert seen == ["graph", inductor_config]


def test_signatures_past_the_limit_run_through_the_layers_compiled_call(tiny_llama_path, tmp_path, monkeypatch):
    monkeypatch.setattr(compiled_pair, "MAX_SIGNATURES", 0)
    eager = build(tiny_llama_path, tmp_path / "eager", compile_layers="off")
    trainer = build(tiny_llama_path, tmp_path / "module", compile_layers="on")
    expected = _step_grads(eager)
    assert max_abs_diff(_step_grads(trainer), expected) == 0.0
    assert _pair_calls(trainer) == [0, 0]
    status = trainer.stats().compile
    assert status == {"requested": "on", "layers_compiled": 2, "reason": None, "signatures": 0, "compiled_pairs": 0,
                      "units_past_signature_limit": 2 * len(trainer._step.micro_batches)}


def test_a_saved_input_changed_in_place_before_the_backward_is_refused(tiny_llama_path, tmp_path):
    trainer = build(tiny_llama_path, tmp_path / "paired", compile_layers="on")
    randomize_lora_b(trainer)
    while trainer.next_unit().kind == UnitKind.FORWARD:
        trainer.run_one_unit()
    with torch.no_grad():  # what autograd's version check is there for
        for parameter in trainer.trainable_params:
            parameter.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        while trainer.next_unit().kind != UnitKind.OPTIMIZER:
            trainer.run_one_unit()


class _Layer(torch.nn.Module):
    """A decoder layer's call signature over a small computation (a projection, SiLU, a residual)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, hidden, attention_mask=None, position_ids=None, position_embeddings=None):
        cos, sin = position_embeddings
        return hidden + torch.nn.functional.silu(self.proj(hidden * cos + sin))


def _pair_step(layer, paired, inputs, grad):
    hidden, cos, sin = inputs
    leaf = hidden.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    if paired is None:
        output = layer(leaf, position_embeddings=(cos, sin))
        output.backward(grad)
        return [output.detach(), leaf.grad, layer.proj.weight.grad, layer.proj.bias.grad]
    output, saved = paired.forward(leaf, None, None, (cos, sin))
    input_grad = saved.backward(grad)
    return [output, input_grad, layer.proj.weight.grad, layer.proj.bias.grad]


def test_a_pair_whose_cached_artifacts_do_not_load_sets_the_cache_aside(tmp_path, monkeypatch):
    """The compile cache's rule (harvest.train.compiled_units) holds for pairs: artifacts
    that do not load are set aside and the pair compiles again, never runs eager for it."""
    from torch._inductor.utils import clear_caches

    from harvest.train import compiled_units

    monkeypatch.setenv("HARVEST_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(compiled_units, "_cache_set_aside", False)
    clear_caches()
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 4, 16, generator=generator) for _ in range(3)]
    grad = torch.randn(2, 4, 16, generator=generator)
    torch.manual_seed(0)
    expected = _pair_step(_Layer(), None, inputs, grad)

    def compiled_layer():
        torch.manual_seed(0)
        layer = _Layer()
        state = compiled_units.compile_layers([layer], "on", torch.device("cpu"))
        return layer, state

    layer, state = compiled_layer()
    assert [torch.equal(a, b) for a, b in zip(_pair_step(layer, state.paired[0], inputs, grad), expected)] == [True] * 4
    cache = tmp_path / "cache" / "torchinductor" / torch.__version__
    for path in [p for p in cache.rglob("*.py") if p.is_file()]:
        path.write_text("def call(args):\n    return (\n")  # what a crash mid-write leaves
    clear_caches()  # a new process: only the files remain
    try:
        layer, state = compiled_layer()
        got = _pair_step(layer, state.paired[0], inputs, grad)
    finally:
        clear_caches()
    assert [torch.equal(a, b) for a, b in zip(got, expected)] == [True] * 4
    assert state.status() == {"requested": "on", "layers_compiled": 1, "reason": None, "signatures": 1,
                              "compiled_pairs": 1, "units_past_signature_limit": 0} and state.paired[0].calls == 1
    assert len([p for p in cache.parent.iterdir() if ".aside-" in p.name]) == 1


def test_building_a_pair_neither_draws_nor_rewinds_the_processs_generator(tiny_llama_path, tmp_path, monkeypatch):
    """In a server other threads draw from the process's generator while a job's pairs
    build (decode's sampling, another job's dropout). A build draws nothing itself, and must
    not put the generator back afterwards: what another thread drew during the build would
    be drawn again."""
    unchanged_by_tracing, state_during, state_after = [], [], []
    real_trace, real_build = compiled_pair.PairCompiler._build, compiled_pair.PairCompiler.build

    def trace_beside_another_thread(self, *args):
        before = torch.get_rng_state()
        pair = real_trace(self, *args)
        unchanged_by_tracing.append(torch.equal(before, torch.get_rng_state()))
        torch.rand(1)  # what another thread draws while the build runs
        state_during.append(torch.get_rng_state())
        return pair

    def build_and_record(self, *args):
        pair = real_build(self, *args)
        state_after.append(torch.get_rng_state())
        return pair

    monkeypatch.setattr(compiled_pair.PairCompiler, "_build", trace_beside_another_thread)
    monkeypatch.setattr(compiled_pair.PairCompiler, "build", build_and_record)
    trainer = build(tiny_llama_path, tmp_path / "paired", compile_layers="on", lora_dropout=0.1)
    while trainer.next_unit().kind == UnitKind.FORWARD:
        trainer.run_one_unit()
    assert state_during and unchanged_by_tracing == [True] * len(state_during)
    assert all(torch.equal(d, a) for d, a in zip(state_during, state_after))  # not put back
