"""The frozen-weight window: residency, swapping, reclaim between units, memory shortage."""

from __future__ import annotations

import pytest
import torch

from tests.train.trainer_helpers import build, lora_params, max_abs_diff, randomize_lora_b


def run_steps(trainer, num_steps: int) -> None:
    target = trainer.global_step + num_steps
    while trainer.global_step < target:
        trainer.run_one_unit()


def test_window_covering_all_stages_never_swaps(tiny_llama_path, tmp_path):
    trainer = build(tiny_llama_path, tmp_path, harvest={"window_stages": "all"})
    run_steps(trainer, 2)
    window = trainer.window
    assert window.num_loads == trainer.split.num_stages  # each stage copied in exactly once
    assert window.num_evictions == 0
    assert trainer.stats().window_bytes == sum(window.stage_bytes())


def test_one_stage_window_keeps_one_stage_and_evicts_to_meta(tiny_llama_path, tmp_path):
    trainer = build(tiny_llama_path, tmp_path, harvest={"window_stages": 1})
    for _ in range(6):  # embed, layer 0, layer 1, head fwd, head bwd (no swap), layer 1 bwd
        record = trainer.run_one_unit()
        resident = trainer.window.resident_stages()
        assert resident == [record.stage]
        # Evicted stages hold meta placeholders: any use would fail loudly.
        for layer_index, layer in enumerate(trainer.split.decoder.layers):
            device = layer.mlp.up_proj.base_layer.weight.device
            assert (device.type == "meta") == (layer_index + 1 not in resident)
    assert trainer.window.num_evictions >= 4


@pytest.mark.parametrize("compile_layers", ["off", pytest.param("on", marks=pytest.mark.slow)])
def test_resizing_the_window_between_units_keeps_results_identical(compile_layers, tiny_llama_path, tmp_path):
    # W = all: the forward units save no handles (nothing is evicted in the normal course),
    # then the window shrinks mid-step and the backward units still compute exactly.
    steady = build(tiny_llama_path, tmp_path / "steady", compile_layers=compile_layers)
    resized = build(tiny_llama_path, tmp_path / "resized", compile_layers=compile_layers)
    randomize_lora_b(steady)
    randomize_lora_b(resized)
    run_steps(steady, 2)

    for _ in range(7):  # into the first step's backward pass
        resized.run_one_unit()
    full_bytes = resized.stats().window_bytes
    held = resized.set_window_stages(1)  # reclaim: memory is freed before the call returns
    assert held < full_bytes and held == resized.stats().window_bytes
    assert len(resized.window.resident_stages()) <= 1
    for _ in range(5):
        resized.run_one_unit()
    resized.set_window_stages(3)  # grow again: loads happen as units need them
    run_steps(resized, 2 - resized.global_step)
    assert len(resized.window.resident_stages()) == 3
    assert resized.stats().window_stages == 3
    assert max_abs_diff(lora_params(steady.split.peft_model), lora_params(resized.split.peft_model)) == 0.0


def test_prefetch_backs_off_when_the_allocator_is_short(tiny_llama_path, tmp_path):
    """An allocator that can hold only one stage (the general arena with few lent chunks):
    W = 3 is asked for, prefetches fail transiently, training is still exact."""
    from harvest.train.build import build_trainer
    from harvest.train.job import load_job
    from harvest.train.window_memory import TorchWindowAllocator
    from tests.train.trainer_helpers import job_dict

    reference = build(tiny_llama_path, tmp_path / "ref")
    job = load_job(job_dict(tiny_llama_path, tmp_path / "short", harvest={"window_stages": 3}))
    largest = max(reference.window.stage_bytes())
    short = build_trainer(job, allocator=TorchWindowAllocator("cpu", limit_bytes=largest))
    randomize_lora_b(reference)
    randomize_lora_b(short)
    run_steps(reference, 1)
    run_steps(short, 1)
    assert short.window.held_bytes <= largest
    assert max_abs_diff(lora_params(reference.split.peft_model), lora_params(short.split.peft_model)) == 0.0


def test_no_window_memory_is_transient_and_leaves_state_unchanged(tiny_llama_path, tmp_path):
    from harvest.train.build import build_trainer
    from harvest.train.errors import WindowMemoryUnavailable
    from harvest.train.job import load_job
    from harvest.train.window_memory import TorchWindowAllocator
    from tests.train.trainer_helpers import job_dict

    allocator = TorchWindowAllocator("cpu", limit_bytes=0)
    job = load_job(job_dict(tiny_llama_path, tmp_path, harvest={"window_stages": 1, "micro_batch_size": 4}))
    trainer = build_trainer(job, allocator=allocator)
    before = trainer.next_unit()
    with pytest.raises(WindowMemoryUnavailable, match="embed"):
        trainer.run_one_unit()
    assert trainer.next_unit() == before and trainer.stats().units_run == 0
    allocator.limit_bytes = None  # decode gave memory back
    record = trainer.run_one_unit()
    assert (record.kind.value, record.stage) == ("forward", 0)


def test_stats_report_window_and_resident_bytes(tiny_llama_path, tmp_path):
    trainer = build(tiny_llama_path, tmp_path, harvest={"window_stages": 2})
    run_steps(trainer, 1)
    stats = trainer.stats()
    trainable = sum(p.numel() * 4 for p in trainer.trainable_params)
    assert stats.window_stages == 2
    assert stats.window_bytes == sum(trainer.window.stage_bytes()[s] for s in trainer.window.resident_stages())
    # Weights, grads, Adam m and v, plus AdamW's per-parameter step counters.
    extra = stats.resident_bytes - stats.window_bytes - 4 * trainable
    assert 0 <= extra <= 8 * len(trainer.trainable_params)
    assert stats.global_step == 1 and stats.samples_seen == 4 and stats.tokens_seen > 0
    sizes = sorted(trainer.window.stage_bytes(), reverse=True)
    assert trainer.window.capacity_for_bytes(sizes[0] + sizes[1]) == 2
    assert trainer.window.capacity_for_bytes(sizes[0] - 1) == 0
    assert stats.units_run == len(trainer.split.pass_stages()) * 2 + 1


def test_saved_weight_handles_survive_relocation():
    """Autograd saves handles into window buffers, so backward sees the weights at their new
    address after the stage was evicted and loaded again."""
    from torch import nn

    from harvest.train.weights import HostCopyWeightSource
    from harvest.train.window import StageLayout, WeightWindow
    from harvest.train.window_memory import TorchWindowAllocator

    layers = [nn.Linear(8, 8, bias=True) for _ in range(2)]
    host = {}
    frozen = []
    for index, layer in enumerate(layers):
        layer.requires_grad_(False)
        entries = [(f"l{index}.{attr}", layer, attr, getattr(layer, attr).detach().clone())
                   for attr in ("weight", "bias")]
        host.update({name: tensor for name, _, _, tensor in entries})
        frozen.append(entries)
    expected_weight = host["l0.weight"].clone()
    layouts = [StageLayout.build(i, f"layer.{i}", entries) for i, entries in enumerate(frozen)]
    window = WeightWindow(layouts, HostCopyWeightSource(host), TorchWindowAllocator("cpu"), capacity=1)
    x = torch.randn(3, 8, requires_grad=True)
    window.prepare(0, iter([1]))
    with window.saved_tensor_hooks():
        y = layers[0](x)
    window.prepare(1, iter([0]))  # evicts layer 0
    assert layers[0].weight.device.type == "meta"
    occupied = [torch.empty(layouts[0].num_bytes, dtype=torch.uint8) for _ in range(4)]  # likely the old address
    window.prepare(0, iter([]))  # back, most likely at another address
    del occupied
    torch.autograd.backward(y, torch.ones_like(y))
    assert torch.allclose(x.grad, torch.ones(3, 8) @ expected_weight)


def test_backward_without_its_stage_resident_fails_loudly():
    from torch import nn

    from harvest.train.weights import HostCopyWeightSource
    from harvest.train.window import StageLayout, WeightWindow
    from harvest.train.window_memory import TorchWindowAllocator

    layers = [nn.Linear(4, 4, bias=False).requires_grad_(False) for _ in range(2)]
    entries = [[(f"l{i}.weight", layer, "weight", layer.weight.detach().clone())] for i, layer in enumerate(layers)]
    host = {e[0][0]: e[0][3] for e in entries}
    layouts = [StageLayout.build(i, f"layer.{i}", e) for i, e in enumerate(entries)]
    window = WeightWindow(layouts, HostCopyWeightSource(host), TorchWindowAllocator("cpu"), capacity=1)
    x = torch.randn(2, 4, requires_grad=True)
    window.prepare(0, iter([]))
    with window.saved_tensor_hooks():
        y = layers[0](x)
    window.prepare(1, iter([]))
    with pytest.raises(RuntimeError, match="layer.0"):
        y.sum().backward()


def test_weights_used_in_place_need_no_saved_tensor_hooks():
    """A device-resident source (the served weights, trained on in place) never puts a
    weight in a window buffer: the unit's forward saves its tensors without harvest's hooks
    (a Python call per saved tensor, ~40 per layer unit, for nothing)."""
    from torch import nn

    from harvest.train.weights import SharedTensorWeightSource
    from harvest.train.window import StageLayout, WeightWindow
    from harvest.train.window_memory import TorchWindowAllocator

    layer = nn.Linear(4, 4, bias=False).requires_grad_(False)
    entries = [("l0.weight", layer, "weight", layer.weight.detach().clone())]
    window = WeightWindow([StageLayout.build(0, "layer.0", entries)],
                          SharedTensorWeightSource({"l0.weight": entries[0][3]}), TorchWindowAllocator("cpu"))
    packed = []
    window._pack = lambda tensor: packed.append(tensor) or tensor
    x = torch.randn(2, 4, requires_grad=True)
    with window.saved_tensor_hooks():
        y = layer(x)
    y.sum().backward()
    assert packed == [] and x.grad is not None


def _two_linear_stages(allocator=None, capacity=None):
    from torch import nn

    from harvest.train.weights import HostCopyWeightSource
    from harvest.train.window import StageLayout, WeightWindow
    from harvest.train.window_memory import TorchWindowAllocator

    layers = [nn.Linear(8, 8, bias=False).requires_grad_(False) for _ in range(2)]
    entries = [[(f"l{i}.weight", layer, "weight", layer.weight.detach().clone())] for i, layer in enumerate(layers)]
    layouts = [StageLayout.build(i, f"layer.{i}", e) for i, e in enumerate(entries)]
    host = {e[0][0]: e[0][3] for e in entries}
    window = WeightWindow(layouts, HostCopyWeightSource(host), allocator or TorchWindowAllocator("cpu"),
                          capacity=capacity)
    return layers, host, window


def test_saved_tensor_hooks_only_where_an_eviction_could_reuse_memory_autograd_views():
    from harvest.train.window_memory import TorchWindowAllocator

    class LentMemory(TorchWindowAllocator):  # a released chunk goes back to its lender at once
        reuses_viewed_memory = True

    cases = {"every stage resident, PyTorch's memory": (None, None, False),
             "W below the stages": (None, 1, True),
             "every stage resident, lent memory": (LentMemory("cpu"), None, True)}
    for name, (allocator, capacity, expected) in cases.items():
        layers, _, window = _two_linear_stages(allocator, capacity)
        packed = []
        pack = window._pack
        window._pack = lambda tensor, pack=pack: packed.append(tensor) or pack(tensor)
        window.prepare(0, iter([1]))
        x = torch.randn(2, 8, requires_grad=True)
        with window.saved_tensor_hooks():
            y = layers[0](x)
        y.sum().backward()
        assert window.needs_saved_tensor_hooks() is expected, name
        assert bool(packed) is expected, name


def test_a_shrink_between_a_forward_without_handles_and_its_backward_keeps_the_backward_exact():
    """Every stage resident in PyTorch's memory: the forward saves the weight itself. The
    window then shrinks and evicts that stage; its buffer lives on, unchanged, until the
    backward has run (PyTorch reuses no memory a tensor views)."""
    layers, host, window = _two_linear_stages()
    window.prepare(0, iter([1]))
    window.prepare(1, iter([]))
    assert not window.needs_saved_tensor_hooks()
    x = torch.randn(3, 8, requires_grad=True)
    with window.saved_tensor_hooks():
        y = layers[0](x)
    held = window.held_bytes
    window.set_capacity(1)  # keeps stage 1, the one prepared last
    assert window.resident_stages() == [1] and layers[0].weight.device.type == "meta"
    assert window.held_bytes < held  # counted as released at once
    occupied = [torch.full((window.stages[0].num_bytes,), 255, dtype=torch.uint8) for _ in range(8)]
    torch.autograd.backward(y, torch.ones_like(y))
    del occupied
    assert torch.equal(x.grad, torch.ones(3, 8) @ host["l0.weight"])
    assert window.needs_saved_tensor_hooks()  # W = 1 now: the next forward saves handles


def test_shrinking_a_full_window_keeps_the_stages_needed_soonest():
    """With every stage resident, prepare() works out no order; a shrink before the next
    unit still keeps the prepared stage and those right after it."""
    from torch import nn

    from harvest.train.weights import HostCopyWeightSource
    from harvest.train.window import StageLayout, WeightWindow
    from harvest.train.window_memory import TorchWindowAllocator

    layers = [nn.Linear(4, 4, bias=False).requires_grad_(False) for _ in range(5)]
    entries = [[(f"l{i}.weight", layer, "weight", layer.weight.detach().clone())] for i, layer in enumerate(layers)]
    layouts = [StageLayout.build(i, f"layer.{i}", e) for i, e in enumerate(entries)]
    window = WeightWindow(layouts, HostCopyWeightSource({e[0][0]: e[0][3] for e in entries}),
                          TorchWindowAllocator("cpu"), capacity=5)
    window.prepare(0, iter([1, 2, 3, 4]))
    assert window.resident_stages() == [0, 1, 2, 3, 4]
    loads = window.num_loads
    window.prepare(3, iter([3, 4, 4, 2, 1, 0]))  # all resident: nothing to do
    assert window.num_loads == loads and window.num_evictions == 0
    window.set_capacity(3)
    assert window.resident_stages() == [2, 3, 4]  # 3, then 4, then 2: the next three distinct
    window.prepare(4, iter([2, 1, 0]))  # W = 3 < 5: the order is kept at once
    window.set_capacity(2)
    assert window.resident_stages() == [2, 4]


def test_trainable_weights_written_between_a_forward_and_its_backward_keep_the_hooks():
    """A fleet member applies a round's weights in place between two units, possibly
    between a forward unit and its backward: without hooks autograd's version check
    refuses that backward (every member of a periodic fleet died of it), so the trainer
    asks for the hooks whenever another thread may write its trainable weights."""
    from torch import nn

    layers, _, window = _two_linear_stages()
    window.prepare(0, iter([1]))
    window.prepare(1, iter([]))
    assert not window.needs_saved_tensor_hooks()  # every stage resident: no hooks on their own account
    lora = nn.Linear(8, 8, bias=False)  # a trainable weight beside the frozen one
    x = torch.randn(2, 8, requires_grad=True)

    def forward_then_apply_then_backward(**hooks):
        with window.saved_tensor_hooks(**hooks):
            y = lora(torch.relu(layers[0](x)))
        with torch.no_grad():
            lora.weight.add_(1.0)  # the round's weights, written in place between the units
        y.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        forward_then_apply_then_backward()
    forward_then_apply_then_backward(weights_change_between_units=True)
    assert x.grad is not None and lora.weight.grad is not None
