"""Benchmark of the layer-split trainer. The last stdout line (with --json) is one JSON object.

CPU (the default, `--model cpu-bench` or `--model cpu-deep`): a random Llama checkpoint
built with harvest.tiny_model and a generated alpaca dataset (~250-token samples), loaded
through the LlamaFactory job path. Shapes (512-token vocabulary; `--layers N` for quick runs):

  cpu-bench  hidden 512, 4 layers, 8 heads / 4 KV heads, intermediate 1376, 4 samples of
             256 tokens per step: a width where the matrix work matters
  cpu-deep   hidden 64, 32 layers, 4 heads / 2 KV heads, intermediate 128, 2 samples of
             64 tokens per step: a unit's time is host work, as for small units on a GPU

Four learners train on the same batches in one run, interleaved round by round (the
order rotates each round): plain PEFT (forward + backward + clip + AdamW on the whole
batch), the layer-split trainer with every stage resident (W = all) eager, the same
compiled (``trainer.compile: on``: every decoder layer through ``torch.compile``; on a
CPU with harvest.train.eager_numerics' backend, its training units calling the compiled
graphs as an explicit pair, harvest.train.compiled_pair), eager with a one-stage window (W = 1):

  tokens_per_s_peft / _eager / _compiled   non-padding tokens / median step time (W = all)
  compiled_vs_peft     tokens_per_s_compiled / tokens_per_s_peft (the GPU path; issue 35's
                       target >= 1.0 in `targets` there)
  step_ratio_vs_peft   median step time, layer-split W=all eager / plain PEFT  (target <= 1.10)
  step_ratio_swapping  median step time, W=1 / W=all (eager)
  grad_max_abs_diff    LoRA gradients of step 1, layer-split eager (W=all and W=1) vs PEFT
  loss_abs_diff        step-1 loss, same comparison
  compiled_grad_max_abs_diff  LoRA gradients of step 1, compiled vs eager (W = all; fp32);
                       _rel_diff: |diff| / |eager| (2-norms, largest over the tensors);
                       lora_grad_max_abs their scale; grad_fp32_error_eager / _compiled: max
                       abs difference to the same step in float64 (plain PEFT)
  host_us_per_layer_unit_eager / _compiled   median UnitRecord.host_ms of the `layer.N`
                       units, forward and backward alike, over the timed steps
  ops_per_layer_eager / _compiled   operators dispatched for one layer's forward + backward unit
  compile_s            seconds spent compiling (dynamo's timers: frames, lazily compiled
                       backward graphs, on a CPU the layers' explicit pairs: a trace per
                       layer, harvest.train.compiled_pair), at the layers' first calls, before the
                       timed steps (`compiles_in_timed_steps`: 0); from inductor's cache
                       (`compile_cache`: its folder, hits and misses) unless `--cold-compile`
  targets              the issue's CPU targets, true or false: ops compiled <= 0.3 x eager,
                       host time per layer unit <= 0.5 x eager, gradient difference <= 1e-5
  units_per_step, unit_ms_median (forward/backward units, W=all eager)

The operators are counted as scripts/bench_layer_unit.py counts them for a bare layer
(torch.profiler CPU events, the top-level ``aten::`` ones: an ``aten::`` event with no
``aten::`` ancestor), on one step after the timed ones: the trainer's units run one at a
time through ``trainer.run_one_unit()``, and only the two units of the middle decoder
layer (its forward, then later its backward) run inside a profiler, one each. So the
count is exactly what the trainer dispatches for that layer's units: the layer itself
plus what the trainer does around it (the unit boundary's detach, the window's saved-
tensor hooks where it needs them: not at W = all in PyTorch's memory,
``torch.autograd.backward``); `ops_layer_units` splits it into forward and backward and
lists each variant's operators by name.

The micro-batch equals the job's batch (one micro-batch per step), so all learners do the
same matrix work; the trainer's extra cost is its per-unit machinery.

GPU (`--device cuda --model llama3-8b`): a Llama-3-8B-shaped model, random bf16 weights
built in host memory, LoRA r=16 on all linear layers, synthetic batches; W = all eager,
W = all compiled (twice: the compiled layers' two runtimes, below), and W = 2 eager, one
learner after the other (each needs the model's 16 GB), each with the micro-batch the
trainer sizes for it (`details`). The two runtimes of the same compiled layers:
``torch.compile``'s ("module": dynamo's guards, AOT autograd's runtime) and the explicit
compiled pair ("pair", harvest.train.compiled_pair); `compiled_runtime` names the one
``trainer.compile: on`` uses on the device (CUDA: module, CPU: pair), whose figures are
the `_compiled` keys; `tokens_per_s_compiled_pair` / `_module`,
`host_us_per_layer_unit_compiled_pair` / `_module`, `ops_per_layer_compiled_pair` /
`_module`, `compiled_pair_vs_module` (tokens/s) and `compiled_pair_grad_max_abs_diff` (vs
eager) compare them; `compile_other` is the other learner's compile status. Reports tokens/s,
the median unit device time (CUDA events), the copy/compute overlap (1 - exposed / copy,
exposed = step device time - sum of unit compute times), and the keys above for eager vs
compiled (the gradient difference in bf16: its 1e-5 target is not applied, `targets`
holds null). Plain PEFT first, as a user runs it: the same weights (same seed) on the
device, the whole step's batch in one forward and backward under bf16 autocast, fused
AdamW (`details.peft`; halved into accumulated micro-batches only if the device runs out
of memory, `details.peft.micro_batch_size` says so), its weights freed before the
trainers'; `compiled_vs_peft` and `targets.compiled_ge_1.0x_peft` compare the compiled
trainer with it. `--model small-synthetic`: the same path with a small shape (also on
CPU, where copies are synchronous: overlap 0). `--dtype` sets a synthetic model's weights
and autocast (bf16 on CUDA, fp32 on a CPU by default); with `--fp32-reference` a bf16
run also takes step 1 eager in fp32 on the same (bf16-valued) weights and reports each
learner's LoRA gradients' relative error against it (`grad_fp32_rel_error_eager`,
`_compiled_pair`, `_compiled_module`): whether compiling moves the gradients further from
the arithmetic bf16 rounds than eager's own rounding does.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import copy
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Before CUDA starts: harvest's streams (two per green-context level) need more hardware
# queues than the driver's default 8; 32 is the maximum (harvest.compute.device).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

CPU_SHAPES = {
    "cpu-bench": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4),
    "cpu-deep": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=32, num_attention_heads=4,
                     num_key_value_heads=2),
}
# (samples per step, tokens per sample): cpu-deep's 128 tokens per unit keep its matrix work
# (hidden 64) far below the host's per-operator cost.
CPU_BATCH = {"cpu-bench": (4, 256), "cpu-deep": (2, 64)}
SYNTHETIC_SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "small-synthetic": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1024, rope_theta=10000.0),
}
# The targets for the compiled layer units (CPU run).
OPS_TARGET, HOST_TARGET, GRAD_TARGET = 0.3, 0.5, 1e-5


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object (last line)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default=None, choices=[*CPU_SHAPES, *SYNTHETIC_SHAPES],
                        help="default: cpu-bench on cpu, llama3-8b on cuda")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per learner (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per learner before the timed ones")
    parser.add_argument("--cold-compile", action="store_true",
                        help="compile from an empty inductor cache (a new temporary directory)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU intra-op threads (default 1: steadier on shared cores)")
    parser.add_argument("--batch", type=int, default=None,
                        help="samples per step (default 4 cpu-bench, 2 cpu-deep and small-synthetic, 8 cuda)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sample (default 256 cpu-bench, 64 cpu-deep, 128 small-synthetic, 1024 cuda)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="synthetic models: weights and autocast (auto: bfloat16 on CUDA, float32 on a CPU)")
    parser.add_argument("--fp32-reference", action="store_true",
                        help="synthetic models in bfloat16: also step 1 in fp32 on the same (bf16-valued) weights, "
                             "and each learner's LoRA gradients' relative error against it (grad_fp32_rel_error_*)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or (args.layers is not None and args.layers < 1):
        parser.error("--rounds and --layers must be >= 1, --warmup >= 0")
    if (args.model in CPU_SHAPES or (args.model is None and args.device == "cpu")) \
            and (args.dtype != "auto" or args.fp32_reference):
        parser.error("--dtype and --fp32-reference apply to the synthetic models (llama3-8b, small-synthetic)")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.fp32_reference and args.dtype == "float32":
        parser.error("--fp32-reference compares a bfloat16 run with fp32: --dtype bfloat16 (the default on cuda)")

    import torch

    model = args.model or ("cpu-bench" if args.device == "cpu" else "llama3-8b")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"bench_trainer: --device cuda: no CUDA device here (torch {torch.__version__}); "
              f"run it on a GPU machine, or leave --device out for the CPU benchmark", file=sys.stderr)
        return 2
    if model in CPU_SHAPES and args.device != "cpu":
        print(f"bench_trainer: --model {model} runs on the CPU only (on CUDA: --model llama3-8b or "
              f"small-synthetic)", file=sys.stderr)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.cold_compile:  # before harvest.train.compiled_units sets its default
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="harvest-bench-inductor-")
        atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    if model in CPU_SHAPES:
        result = bench_vs_peft(args, model)
    else:
        result = bench_synthetic(args, model)
    threads = torch.get_num_threads() if args.device == "cpu" else None
    result.update(device=args.device, model=model, torch_threads=threads, torch_version=torch.__version__)
    if args.device == "cuda":
        result["device_name"] = torch.cuda.get_device_name(0)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


# -- CPU: layer-split (eager, compiled) vs plain PEFT --------------------------------------------
def bench_vs_peft(args, model_name: str) -> dict:
    from harvest.tiny_model import TinyModelSpec, ensure_tiny_model

    shape = dict(CPU_SHAPES[model_name])
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    spec = TinyModelSpec(family="llama", **shape)
    model_path = ensure_tiny_model(spec)
    batch = args.batch or CPU_BATCH[model_name][0]
    seq_len = args.seq_len or CPU_BATCH[model_name][1]
    work = Path(tempfile.mkdtemp(prefix="harvest-bench-trainer-"))  # datasets and checkpoints nobody reads after
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    data_dir = _write_dataset(work / "data", num_samples=batch * (args.rounds + args.warmup + 3), words=seq_len)
    common = dict(seq_len=seq_len, batch=batch, data_dir=data_dir, model_path=model_path)
    split_all = _build(work / "all", window="all", compile_layers="off", **common)
    split_compiled = _build(work / "compiled", window="all", compile_layers="on", **common)
    split_one = _build(work / "one", window=1, compile_layers="off", **common)
    trainers = {"all": split_all, "compiled": split_compiled, "one": split_one}
    _randomize_lora_b(split_all.split.peft_model)
    _copy_lora(split_all, split_one)
    _copy_lora(split_all, split_compiled)
    peft, optimizer = _reference(split_all, work / "ref", **common)

    # Step 1: correctness against plain PEFT (eager) and against eager (compiled), same batch.
    # The compiled learner compiles its layers here, at their first calls.
    ref_loss, ref_grads = _peft_forward_backward(peft, split_all, 0)
    step1_grads, step1_loss = {}, {}
    for name, trainer in trainers.items():
        _run_until_optimizer(trainer)
        step1_grads[name] = {n: p.grad.detach().clone() for n, p in _lora(trainer.split.peft_model)}
        trainer.run_one_unit()
        step1_loss[name] = trainer.stats().loss
    diffs = [_max_abs_diff(step1_grads[name], ref_grads) for name in ("all", "one")]
    loss_diffs = [abs(step1_loss[name] - ref_loss) for name in ("all", "one")]
    compiled_diff = _max_abs_diff(step1_grads["compiled"], step1_grads["all"])
    compiled_rel_diff = _max_rel_diff(step1_grads["compiled"], step1_grads["all"])
    # fp32's own error at this gradient scale: the same step in float64 (plain PEFT).
    grads_fp64 = _peft_forward_backward(copy.deepcopy(peft).double(), split_all, 0)[1]
    _peft_update(peft, optimizer)

    learners = ["peft", "all", "compiled", "one"]
    times = {name: [] for name in learners}
    layer_unit_ms = {"all": [], "compiled": []}
    unit_ms, units_per_step, step_tokens = [], [], []
    compiles_before_timed = None
    from tqdm import tqdm

    for round_index in tqdm(range(args.warmup + args.rounds), desc="bench rounds", file=sys.stderr):
        step = round_index + 1
        timed = round_index >= args.warmup
        if timed and compiles_before_timed is None:
            compiles_before_timed = _dynamo_compiles()
        for name in learners[round_index % len(learners):] + learners[: round_index % len(learners)]:
            if name == "peft":
                started = time.perf_counter()
                _peft_forward_backward(peft, split_all, step)
                _peft_update(peft, optimizer)
                elapsed = time.perf_counter() - started
            else:
                trainer = trainers[name]
                records, started = [], time.perf_counter()
                while trainer.global_step == step:
                    records.append(trainer.run_one_unit())
                elapsed = time.perf_counter() - started
                if timed and name in layer_unit_ms:
                    layer_unit_ms[name] += [r.host_ms for r in records if r.stage_name.startswith("layer.")]
                if timed and name == "all":
                    unit_ms += [r.host_ms for r in records if r.kind.value != "optimizer"]
                    units_per_step.append(len(records))
                    step_tokens.append(sum(r.num_tokens for r in records if r.stage_name == "embed"
                                           and r.kind.value == "forward"))
            if timed:
                times[name].append(elapsed)
    compiles_in_timed = _dynamo_compiles() - compiles_before_timed

    # One more step of the two W=all learners: their middle layer's units under the profiler.
    middle = spec.num_hidden_layers // 2
    ops = {name: _layer_unit_ops(trainers[name], middle) for name in ("all", "compiled")}

    median = {name: statistics.median(values) for name, values in times.items()}
    tokens = statistics.median(step_tokens)
    result = dict(
        tokens_per_s_peft=tokens / median["peft"],
        tokens_per_s_eager=tokens / median["all"],
        tokens_per_s_compiled=tokens / median["compiled"],
        **_compiled_keys(ops, layer_unit_ms, compiled_diff, compiles_in_timed, split_compiled.stats().compile,
                         apply_grad_target=True),
        compiled_grad_max_rel_diff=compiled_rel_diff,
        lora_grad_max_abs=max(float(g.abs().max()) for g in step1_grads["all"].values()),
        grad_fp32_error_eager=_max_abs_diff(step1_grads["all"], grads_fp64),
        grad_fp32_error_compiled=_max_abs_diff(step1_grads["compiled"], grads_fp64),
        step_ratio_vs_peft=median["all"] / median["peft"],
        step_ratio_compiled_vs_peft=median["compiled"] / median["peft"],
        step_ratio_swapping=median["one"] / median["all"],
        grad_max_abs_diff=max(diffs),
        loss_abs_diff=max(loss_diffs),
        units_per_step=statistics.median(units_per_step),
        unit_ms_median=statistics.median(unit_ms),
        step_ms_median={name: value * 1e3 for name, value in median.items()},
        tokens_per_step=tokens,
        micro_batch_size=split_all.micro_batch_size, samples_per_step=batch, seq_len_max=seq_len,
        model_shape=f"llama hidden {spec.hidden_size}, {spec.num_hidden_layers} layers, intermediate "
                    f"{spec.intermediate_size}, heads {spec.num_attention_heads}/{spec.num_key_value_heads}, "
                    f"vocab {spec.vocab_size}, LoRA r=16 all linear, fp32",
        rounds=args.rounds, warmup=args.warmup,
    )
    for trainer in trainers.values():
        trainer.close()
    return result


def _compiled_keys(ops, layer_unit_ms, compiled_diff, compiles_in_timed, compile_status,
                   apply_grad_target: bool) -> dict:
    """The eager-vs-compiled keys both paths report, with the targets computed from them."""
    ops_eager = ops["all"]["forward"] + ops["all"]["backward"]
    ops_compiled = ops["compiled"]["forward"] + ops["compiled"]["backward"]
    host_eager = statistics.median(layer_unit_ms["all"]) * 1e3
    host_compiled = statistics.median(layer_unit_ms["compiled"]) * 1e3
    return dict(
        ops_per_layer_eager=ops_eager,
        ops_per_layer_compiled=ops_compiled,
        host_us_per_layer_unit_eager=round(host_eager, 1),
        host_us_per_layer_unit_compiled=round(host_compiled, 1),
        compiled_grad_max_abs_diff=compiled_diff,
        compile_s=round(_compile_seconds(), 2),
        compiles_in_timed_steps=compiles_in_timed,
        compile_cache=_compile_cache(),
        compile=compile_status,
        targets={
            "ops_compiled_le_0.3x_eager": ops_compiled <= OPS_TARGET * ops_eager,
            "host_us_compiled_le_0.5x_eager": host_compiled <= HOST_TARGET * host_eager,
            "compiled_grad_diff_le_1e-5": compiled_diff <= GRAD_TARGET if apply_grad_target else None,
        },
        dynamo_frames_compiled=_dynamo_compiles(),
        ops_layer_units={
            "layer": ops["all"]["layer"],
            "eager": {"forward": ops["all"]["forward"], "backward": ops["all"]["backward"],
                      "by_name": ops["all"]["by_name"]},
            "compiled": {"forward": ops["compiled"]["forward"], "backward": ops["compiled"]["backward"],
                         "by_name": ops["compiled"]["by_name"]},
        },
    )


def _max_abs_diff(grads: dict, reference: dict) -> float:
    return max(float((grads[n].float() - reference[n].float()).abs().max()) for n in grads)


def _max_rel_diff(grads: dict, reference: dict) -> float:
    """The largest over the LoRA tensors of |grad - reference| / |reference| (2-norms)."""
    return max(float((grads[n].float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
               for n, ref in reference.items())


def _dynamo_compiles() -> int:
    """Compilations so far in this process: frames dynamo compiled (a compilation or a
    recompilation each), backward graphs compiled at their first call, and the layers'
    explicit pairs built (harvest.train.compiled_pair: a trace each, compiled or shared)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return int(counters["frames"]["ok"]) + sum(len(compilation_time_metrics.get(name, []))
                                               for name in (_LAZY_BACKWARD, _PAIR_BUILD))


# dynamo_timed's names for a frame's compilation, a backward graph's lazy compilation and
# a compiled pair's build.
_FRAME_COMPILE, _LAZY_BACKWARD = "_compile.compile_inner", "backward._backward_impl"
_PAIR_BUILD = "harvest.compiled_pair.build"  # harvest.train.compiled_pair.BUILD_TIMER


def _compile_seconds() -> float:
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(sum(compilation_time_metrics.get(name, []))
                     for name in (_FRAME_COMPILE, _LAZY_BACKWARD, _PAIR_BUILD)))


def _compile_cache() -> dict:
    from torch._dynamo.utils import counters

    return {"fx_graph_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
            "fx_graph_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
            "aot_autograd_hits": int(counters["aot_autograd"]["autograd_cache_hit"]),
            "aot_autograd_misses": int(counters["aot_autograd"]["autograd_cache_miss"]),
            "dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}


def _layer_unit_ops(trainer, layer_index: int) -> dict:
    """Run one whole step of ``trainer`` unit by unit; the forward and the backward unit of
    decoder layer ``layer_index`` (micro-batch 0) each run inside a profiler. Returns their
    top-level aten operator counts, and the operators of both by name."""
    from torch.profiler import ProfilerActivity, profile

    from bench_layer_unit import top_level_aten_ops  # this script's folder is on sys.path: one way of counting

    stage_name = f"layer.{layer_index}"
    step = trainer.global_step
    counts, by_name = {}, collections.Counter()
    while trainer.global_step == step:
        unit = trainer.next_unit()
        if unit.kind.value in ("forward", "backward") and unit.micro_batch == 0 \
                and trainer.split.stage_names[unit.stage] == stage_name:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                record = trainer.run_one_unit()
            assert record.stage_name == stage_name and record.kind == unit.kind, (record, unit)
            found = top_level_aten_ops(prof)
            counts[unit.kind.value] = sum(found.values())
            by_name.update(found)
        else:
            trainer.run_one_unit()
    if set(counts) != {"forward", "backward"}:
        raise RuntimeError(f"the step ran no forward and backward unit of {stage_name}: {counts}")
    return dict(counts, layer=stage_name, by_name=dict(by_name.most_common()))


def _write_dataset(data_dir: Path, num_samples: int, words: int) -> Path:
    from harvest.tiny_model import CORPUS

    vocabulary = CORPUS.split()
    rng = random.Random(0)
    samples = [{"instruction": " ".join(rng.choices(vocabulary, k=12)), "input": "",
                "output": " ".join(rng.choices(vocabulary, k=words))} for _ in range(num_samples)]
    data_dir.mkdir(parents=True)
    (data_dir / "bench.json").write_text(json.dumps(samples))
    (data_dir / "dataset_info.json").write_text(json.dumps({"bench": {"file_name": "bench.json"}}))
    return data_dir


def _job(output_dir, window, seq_len, batch, data_dir, model_path) -> dict:
    return dict(model_name_or_path=str(model_path), template="default", dataset="bench", dataset_dir=str(data_dir),
                lora_rank=16, lora_alpha=32, lora_target="all", lora_dropout=0.0, cutoff_len=seq_len,
                learning_rate=1e-4, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                max_steps=1000, save_steps=100000, output_dir=str(output_dir), seed=0,
                harvest={"micro_batch_size": batch, "window_stages": window})


def _build(output_dir, compile_layers="off", **kwargs):
    from harvest.train.build import build_trainer
    from harvest.train.job import load_job

    trainer = build_trainer(load_job(_job(output_dir, **kwargs)), compile_layers=compile_layers)
    trainer.output_dir = None  # no checkpoint or log writes inside timed steps
    trainer.train_log = None
    return trainer


def _reference(trainer, output_dir, **kwargs):
    import torch

    from harvest.train.job import load_job

    from llamafactory.model import load_model, load_tokenizer

    job = load_job(_job(output_dir, window="all", **kwargs))
    model_args = copy.copy(job.model_args)
    model_args.device_map = {"": "cpu"}
    model = load_model(load_tokenizer(model_args)["tokenizer"], model_args, job.finetuning_args, is_trainable=True)
    _copy_lora(trainer, model)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)


def _peft_forward_backward(model, trainer, step):
    features = [trainer.batches.dataset[i] for i in trainer.batches.step_indices(step)]
    batch = trainer.batches.collate(features)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.detach().clone() for n, p in _lora(model)}


def _peft_update(model, optimizer) -> None:
    import torch

    torch.nn.utils.clip_grad_norm_([p for _, p in _lora(model)], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _lora(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _randomize_lora_b(model) -> None:
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in _lora(model):
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


def _copy_lora(trainer, target) -> None:
    import torch

    source = dict(_lora(trainer.split.peft_model))
    model = target.split.peft_model if hasattr(target, "split") else target
    with torch.no_grad():
        for name, param in _lora(model):
            param.copy_(source[name])


def _run_until_optimizer(trainer) -> None:
    while trainer.next_unit().kind.value != "optimizer":
        trainer.run_one_unit()


# -- synthetic models (the GPU path) ----------------------------------------------------------
def bench_synthetic(args, shape_name: str) -> dict:
    import torch

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    batch = args.batch or (8 if cuda else 2)
    seq_len = args.seq_len or (1024 if cuda else 128)
    dtype = getattr(torch, args.dtype)
    shape = dict(SYNTHETIC_SHAPES[shape_name])
    if args.layers is not None:
        shape["num_hidden_layers"] = args.layers
    timed_from = 1 + args.warmup  # step 1 (gradients, compilation) and the warm-up are untimed
    steps = timed_from + args.rounds + 1  # the last: operators of the middle layer's units
    # One learner after the other: each holds the model's weights (16 GB for the 8B shape).
    # "compiled" is what trainer.compile: on runs on the device; "compiled_other" the other
    # runtime of the same compiled layers (compiled pairs on CUDA, torch.compile's on a CPU).
    from harvest.train.compiled_units import pairs_by_default

    default_pairs = pairs_by_default(device)
    runtime = {True: "pair", False: "module"}
    # Both runtimes of the compiled layers by name, whichever is the device's default.
    by_runtime = {runtime[default_pairs]: "compiled", runtime[not default_pairs]: "compiled_other"}
    learners = {"all": ("all", "off", None), "compiled": ("all", "on", None),
                "compiled_other": ("all", "on", not default_pairs), 2: (2, "off", None)}
    compared = ("all", "compiled", "compiled_other")  # their gradients, unit times and operators
    results, grads, ops, layer_unit_ms = {}, {}, {}, {}
    compile_status, compiles_in_timed = {}, 0
    results["peft"] = _bench_plain_peft(shape, device, dtype, batch, seq_len, timed_from, args.rounds)
    for key, (window, compile_layers, pairs) in learners.items():
        trainer = _synthetic_trainer(shape, window, device, dtype, batch, seq_len, steps, compile_layers, pairs)
        trainer.window.record_copy_timing = True
        _run_until_optimizer(trainer)
        if key in compared:
            grads[key] = {n: p.grad.detach().float().cpu() for n, p in _lora(trainer.split.peft_model)}
        trainer.run_one_unit()
        step_records = []
        for step in range(1, timed_from + args.rounds):
            if step == timed_from:
                compiles_before = _dynamo_compiles()
            trainer.window.copy_events.clear()
            records = []
            while trainer.global_step == step:
                records.append(trainer.run_one_unit())
            if cuda:
                torch.cuda.synchronize(device)
            if step >= timed_from:
                step_records.append((records, list(trainer.window.copy_events)))
        compiles_in_timed += _dynamo_compiles() - compiles_before
        results[key] = _summarize(step_records, batch * seq_len, device)
        results[key]["micro_batch_size"] = trainer.micro_batch_size
        results[key]["window_bytes"] = trainer.stats().window_bytes
        if key in compared:
            layer_unit_ms[key] = [r.host_ms for records, _ in step_records for r in records
                                  if r.stage_name.startswith("layer.")]
            ops[key] = _layer_unit_ops(trainer, shape["num_hidden_layers"] // 2)
        if key in ("compiled", "compiled_other"):
            compile_status[key] = trainer.stats().compile
        trainer.close()
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    fp32_errors = {}
    if args.fp32_reference:
        # Step 1 once more, eager in fp32 on the learners' weights (their bf16 values):
        # how far each learner's bf16 gradients are from the arithmetic they round.
        # The same `steps` as the learners: the data order (a shuffle over the dataset) with it.
        trainer = _synthetic_trainer(shape, "all", device, dtype, batch, seq_len, steps, "off", upcast=True)
        _run_until_optimizer(trainer)
        reference = {n: p.grad.detach().float().cpu() for n, p in _lora(trainer.split.peft_model)}
        trainer.close()
        del trainer
        gc.collect()
        names = {"eager": "all", **{f"compiled_{name}": key for name, key in by_runtime.items()}}
        fp32_errors = {f"grad_fp32_rel_error_{name}": _max_rel_diff(grads[key], reference)
                       for name, key in names.items()}
    compiled_diff = _max_abs_diff(grads["compiled"], grads["all"])
    keys = _compiled_keys(ops, layer_unit_ms, compiled_diff, compiles_in_timed, compile_status["compiled"],
                          apply_grad_target=dtype == torch.float32)
    compiled_vs_peft = results["compiled"]["tokens_per_s"] / results["peft"]["tokens_per_s"]
    keys["targets"]["compiled_ge_1.0x_peft"] = compiled_vs_peft >= 1.0
    return dict(
        tokens_per_s_peft=results["peft"]["tokens_per_s"],
        tokens_per_s_eager=results["all"]["tokens_per_s"],
        tokens_per_s_compiled=results["compiled"]["tokens_per_s"],
        compiled_vs_peft=compiled_vs_peft,
        **keys,
        compiled_runtime=runtime[default_pairs],
        **{f"tokens_per_s_compiled_{name}": results[key]["tokens_per_s"] for name, key in by_runtime.items()},
        **{f"host_us_per_layer_unit_compiled_{name}": round(statistics.median(layer_unit_ms[key]) * 1e3, 1)
           for name, key in by_runtime.items()},
        **{f"ops_per_layer_compiled_{name}": ops[key]["forward"] + ops[key]["backward"]
           for name, key in by_runtime.items()},
        compiled_pair_vs_module=results[by_runtime["pair"]]["tokens_per_s"] / results[by_runtime["module"]]["tokens_per_s"],
        compiled_pair_grad_max_abs_diff=_max_abs_diff(grads[by_runtime["pair"]], grads["all"]),
        compile_other=compile_status["compiled_other"],
        **fp32_errors,
        compiled_grad_max_rel_diff=_max_rel_diff(grads["compiled"], grads["all"]),
        lora_grad_max_abs=max(float(g.abs().max()) for g in grads["all"].values()),
        tokens_per_s_w_all=results["all"]["tokens_per_s"], tokens_per_s_w2=results[2]["tokens_per_s"],
        unit_ms_median_w_all=results["all"]["unit_ms_median"], unit_ms_median_w2=results[2]["unit_ms_median"],
        unit_ms_median_compiled=results["compiled"]["unit_ms_median"],
        copy_compute_overlap_w2=results[2]["overlap"], details={str(k): v for k, v in results.items()},
        samples_per_step=batch, seq_len=seq_len, dtype=str(dtype), rounds=args.rounds, warmup=args.warmup,
        num_layers=shape["num_hidden_layers"],
    )


def _synthetic_peft_model(shape, seq_len, dtype, device, home):
    """The shape's Llama with random weights at ``dtype`` in ``home`` memory (the trainers:
    the host, which they copy from; plain PEFT: the device), LoRA r=16 on every linear
    layer in fp32 (as LlamaFactory keeps it), the same values on every call."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**shape, max_position_embeddings=max(8192, seq_len), tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Random weights at the final dtype (16 GB for the 8B shape, no fp32 detour and no
    # checkpoint on disk), drawn on the benchmark's device.
    model = model.to(dtype).to_empty(device=home)
    _fill_normal(model, device, std=0.02, seed=0)
    model.model.rotary_emb = LlamaRotaryEmbedding(config).to(home)  # to_empty left its inv_freq buffer uninitialised
    model.requires_grad_(False)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    torch.manual_seed(0)  # LoRA A's initialisation: the same in every learner
    peft_model = get_peft_model(model, lora)
    for param in peft_model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    _randomize_lora_b(peft_model)  # B is zero at init: gradients would reach only B
    return peft_model


def _bench_plain_peft(shape, device, dtype, batch, seq_len, warmup_steps, rounds) -> dict:
    """Plain PEFT on the device, as a user trains with it: one forward and backward of the
    step's batch under autocast, gradient clipping, fused AdamW. Halves the micro-batch
    (accumulating gradients) only when the device runs out of memory."""
    import torch

    cuda = device.type == "cuda"
    model = _synthetic_peft_model(shape, seq_len, dtype, device, home=device)
    params = [p for _, p in _lora(model)]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=cuda)
    generator = torch.Generator().manual_seed(2)
    micro_batch = batch

    def step() -> float:
        ids = torch.randint(0, shape["vocab_size"], (batch, seq_len), generator=generator).to(device)
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        for part in ids.split(micro_batch):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = model(input_ids=part, labels=part).loss
            (loss * part.shape[0] / batch).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    times = []
    try:
        while len(times) < warmup_steps + rounds:
            try:
                times.append(step())
                continue
            except torch.OutOfMemoryError:
                if micro_batch == 1:
                    raise
            # Outside the handler: the failed step's tensors went with its traceback.
            optimizer.zero_grad(set_to_none=True)
            micro_batch, times = micro_batch // 2, []
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        del model, optimizer, params
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    step_s = statistics.median(times[warmup_steps:])
    return dict(tokens_per_s=batch * seq_len / step_s, step_ms_median=step_s * 1e3, micro_batch_size=micro_batch)


def _synthetic_trainer(shape, window, device, dtype, batch, seq_len, steps, compile_layers, compile_pairs=None,
                       upcast=False):
    """``upcast``: the weights drawn at ``dtype`` (the same values as the other learners'),
    then trained in fp32 without autocast: the reference of --fp32-reference."""
    import torch

    from harvest.train.build import TrainerSettings, assemble_trainer
    from harvest.train.job import HarvestOptions

    peft_model = _synthetic_peft_model(shape, seq_len, dtype, device, home="cpu")
    if upcast:
        peft_model, dtype = peft_model.float(), torch.float32
    token_generator = torch.Generator().manual_seed(1)
    dataset = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
               for ids in torch.randint(0, shape["vocab_size"], (batch * steps, seq_len), generator=token_generator)]

    def collate(features):
        return {key: torch.stack([f[key] for f in features]) for key in ("input_ids", "attention_mask", "labels")}

    settings = TrainerSettings(samples_per_step=batch, learning_rate=1e-4, max_steps=steps, max_grad_norm=1.0,
                               autocast_dtype=torch.bfloat16 if dtype == torch.bfloat16 else None,
                               fused_adamw=device.type == "cuda")
    options = HarvestOptions(window_stages=None if window == "all" else window)
    # The micro-batch sizing runs units here: a compiled learner compiles its layers here.
    return assemble_trainer(peft_model, dataset, collate, settings, options, device=device,
                            record_device_events=device.type == "cuda", compile_layers=compile_layers,
                            compile_pairs=compile_pairs)


def _fill_normal(model, device, std: float, seed: int) -> None:
    """Every parameter of ``model`` (in host memory) from N(0, std²), drawn on ``device``
    one parameter at a time and copied in. The host draws about 2 x 10^8 samples a second
    on one core: the 8B shape's 8 x 10^9 took ~40 s per learner there, three learners per
    run, out of a GPU session's 15 minutes; a GPU draws them in milliseconds (the copies
    to host memory take a few seconds). The same seed gives every learner the same weights."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            drawn = torch.empty(param.shape, dtype=param.dtype, device=device).normal_(0.0, std, generator=generator)
            param.copy_(drawn)
            del drawn


def _summarize(step_records, tokens_per_step, device) -> dict:
    step_s, unit_ms, overlaps = [], [], []
    for records, copies in step_records:
        units = [r for r in records if r.kind.value != "optimizer"]
        if device.type == "cuda":
            compute = [r.device_ms() for r in records]
            wall = records[0].device_events[0].elapsed_time(records[-1].device_events[1])
            copy_ms = sum(start.elapsed_time(end) for start, end, _ in copies)
            exposed = max(0.0, wall - sum(compute))
            if copy_ms > 0:
                overlaps.append(max(0.0, min(1.0, 1.0 - exposed / copy_ms)))
            step_s.append(wall / 1e3)
            unit_ms += [r.device_ms() for r in units]
        else:
            step_s.append(sum(r.host_ms for r in records) / 1e3)
            unit_ms += [r.host_ms for r in units]
            overlaps.append(0.0)  # CPU copies are synchronous
    return dict(tokens_per_s=tokens_per_step / statistics.median(step_s), unit_ms_median=statistics.median(unit_ms),
                overlap=statistics.median(overlaps) if overlaps else None, units_per_step=len(step_records[0][0]))


if __name__ == "__main__":
    sys.exit(main())
