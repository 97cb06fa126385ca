"""Benchmark of the layer-split trainer. The last stdout line (with --json) is one JSON object.

Default (CPU, `--model cpu-bench`): a random Llama checkpoint built with
harvest.tiny_model (hidden 512, 4 layers, 8 heads / 4 KV heads, intermediate 1376; the
64-hidden test model would measure Python overhead, not training) and a generated
alpaca dataset (~250-token samples), loaded through the LlamaFactory job path. Three
learners train on the same batches in the same run, interleaved round by round: plain
PEFT (forward + backward + clip + AdamW on the whole batch), the layer-split trainer with
every stage resident (W = all) and with a one-stage window (W = 1). Reports

  step_ratio_vs_peft   median step time, layer-split W=all / plain PEFT     (target <= 1.10)
  step_ratio_swapping  median step time, W=1 / W=all
  grad_max_abs_diff    LoRA gradients of step 1, layer-split (W=all and W=1) vs PEFT
  loss_abs_diff        step-1 loss, same comparison
  units_per_step, unit_ms_median (forward/backward units, W=all)

The micro-batch equals the job's batch (one micro-batch per step), so both sides do the
same matrix work; the trainer's extra cost is its per-unit machinery.

GPU (`--device cuda --model llama3-8b`): a Llama-3-8B-shaped model with random bf16
weights built in host memory (no checkpoint needed), LoRA r=16 on all linear layers,
synthetic token batches, trained with W = all and W = 2. Reports tokens/s for each, the
median unit device time (CUDA events, compute only), and the copy/compute overlap: the
fraction of host-to-device copy time hidden under compute, 1 - exposed / copy, where
exposed = step device time - sum of unit compute times. `--model small-synthetic` runs
the same path with a small shape (it also runs on CPU, where copies are synchronous and
the overlap is 0 by construction).
"""

from __future__ import annotations

import argparse
import json
import os
import random
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

SYNTHETIC_SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "small-synthetic": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1024, rope_theta=10000.0),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object (last line)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default=None, choices=["cpu-bench", *SYNTHETIC_SHAPES],
                        help="default: cpu-bench on cpu, llama3-8b on cuda")
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per learner (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU intra-op threads (default 1: steadier on shared cores)")
    parser.add_argument("--batch", type=int, default=None, help="samples per step (default 4 cpu, 8 cuda)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 256 cpu, 1024 cuda)")
    args = parser.parse_args()

    import torch

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    model = args.model or ("cpu-bench" if args.device == "cpu" else "llama3-8b")
    if model == "cpu-bench":
        result = bench_vs_peft(args)
    else:
        result = bench_synthetic(args, model)
    threads = torch.get_num_threads() if args.device == "cpu" else None
    result.update(device=args.device, model=model, torch_threads=threads)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


# -- CPU: layer-split vs plain PEFT ---------------------------------------------------------
def bench_vs_peft(args) -> dict:
    from harvest.tiny_model import TinyModelSpec, ensure_tiny_model

    spec = TinyModelSpec(family="llama", hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4)
    model_path = ensure_tiny_model(spec)
    batch = args.batch or 4
    seq_len = args.seq_len or 256
    work = Path(tempfile.mkdtemp(prefix="harvest-bench-trainer-"))
    data_dir = _write_dataset(work / "data", num_samples=batch * (args.rounds + args.warmup + 2), words=seq_len)
    common = dict(seq_len=seq_len, batch=batch, data_dir=data_dir, model_path=model_path)
    split_all = _build(work / "all", window="all", **common)
    split_one = _build(work / "one", window=1, **common)
    _randomize_lora_b(split_all)
    _copy_lora(split_all, split_one)
    peft, optimizer = _reference(split_all, work / "ref", **common)

    # Step 1: correctness against plain PEFT on the same batch.
    ref_loss, ref_grads = _peft_forward_backward(peft, split_all, 0)
    diffs, loss_diffs = [], []
    for trainer in (split_all, split_one):
        _run_until_optimizer(trainer)
        grads = {n: p.grad.detach().clone() for n, p in _lora(trainer.split.peft_model)}
        trainer.run_one_unit()
        diffs.append(max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads))
        loss_diffs.append(abs(trainer.stats().loss - ref_loss))
    _peft_update(peft, optimizer)

    times = {"peft": [], "all": [], "one": []}
    unit_ms, units_per_step = [], []
    learners = list(times)
    from tqdm import tqdm

    for round_index in tqdm(range(args.warmup + args.rounds), desc="bench rounds", file=sys.stderr):
        step = round_index + 1
        for name in learners[round_index % 3:] + learners[: round_index % 3]:  # rotate the order
            if name == "peft":
                started = time.perf_counter()
                _peft_forward_backward(peft, split_all, step)
                _peft_update(peft, optimizer)
                elapsed = time.perf_counter() - started
            else:
                trainer = split_all if name == "all" else split_one
                records, started = [], time.perf_counter()
                while trainer.global_step == step:
                    records.append(trainer.run_one_unit())
                elapsed = time.perf_counter() - started
                if name == "all" and round_index >= args.warmup:
                    unit_ms += [r.host_ms for r in records if r.kind.value != "optimizer"]
                    units_per_step.append(len(records))
            if round_index >= args.warmup:
                times[name].append(elapsed)
    median = {name: statistics.median(values) for name, values in times.items()}
    return dict(
        step_ratio_vs_peft=median["all"] / median["peft"],
        step_ratio_swapping=median["one"] / median["all"],
        grad_max_abs_diff=max(diffs),
        loss_abs_diff=max(loss_diffs),
        units_per_step=statistics.median(units_per_step),
        unit_ms_median=statistics.median(unit_ms),
        step_ms_median={name: value * 1e3 for name, value in median.items()},
        micro_batch_size=split_all.micro_batch_size, samples_per_step=batch, seq_len_max=seq_len,
        model_shape=f"llama hidden {spec.hidden_size}, {spec.num_hidden_layers} layers, intermediate "
                    f"{spec.intermediate_size}, heads {spec.num_attention_heads}/{spec.num_key_value_heads}, "
                    f"LoRA r=16 all linear, fp32",
        rounds=args.rounds,
    )


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


def _build(output_dir, **kwargs):
    from harvest.train.build import build_trainer
    from harvest.train.job import load_job

    trainer = build_trainer(load_job(_job(output_dir, **kwargs)))
    trainer.output_dir = None  # no checkpoint or log writes inside timed steps
    trainer.train_log = None
    return trainer


def _reference(trainer, output_dir, **kwargs):
    import copy

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


def _randomize_lora_b(trainer) -> None:
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in _lora(trainer.split.peft_model):
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
    batch = args.batch or (8 if device.type == "cuda" else 2)
    seq_len = args.seq_len or (1024 if device.type == "cuda" else 128)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SYNTHETIC_SHAPES[shape_name]
    results = {}
    for window in ("all", 2):
        trainer = _synthetic_trainer(shape, window, device, dtype, batch, seq_len, steps=args.warmup + args.rounds + 1)
        trainer.window.record_copy_timing = True
        step_records = []
        for step in range(args.warmup + args.rounds):
            trainer.window.copy_events.clear()
            records = []
            while trainer.global_step == step:
                records.append(trainer.run_one_unit())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= args.warmup:
                step_records.append((records, list(trainer.window.copy_events)))
        results[window] = _summarize(step_records, batch * seq_len, device)
        results[window]["micro_batch_size"] = trainer.micro_batch_size
        results[window]["window_bytes"] = trainer.stats().window_bytes
        trainer.close()
        del trainer
    return dict(
        tokens_per_s_w_all=results["all"]["tokens_per_s"], tokens_per_s_w2=results[2]["tokens_per_s"],
        unit_ms_median_w_all=results["all"]["unit_ms_median"], unit_ms_median_w2=results[2]["unit_ms_median"],
        copy_compute_overlap_w2=results[2]["overlap"], details={str(k): v for k, v in results.items()},
        samples_per_step=batch, seq_len=seq_len, dtype=str(dtype), rounds=args.rounds,
    )


def _synthetic_trainer(shape, window, device, dtype, batch, seq_len, steps):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from harvest.train.build import TrainerSettings, assemble_trainer
    from harvest.train.job import HarvestOptions

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**shape, max_position_embeddings=max(8192, seq_len), tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Random weights straight in host memory at the final dtype (16 GB for the 8B shape, no
    # fp32 detour and no checkpoint on disk).
    model = model.to(dtype).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    model.model.rotary_emb = LlamaRotaryEmbedding(config)  # to_empty left its inv_freq buffer uninitialised
    model.requires_grad_(False)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, lora)
    for param in peft_model.parameters():
        if param.requires_grad:
            param.data = param.data.float()  # LoRA weights in fp32, as LlamaFactory keeps them
    token_generator = torch.Generator().manual_seed(1)
    dataset = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
               for ids in torch.randint(0, shape["vocab_size"], (batch * steps, seq_len), generator=token_generator)]

    def collate(features):
        return {key: torch.stack([f[key] for f in features]) for key in ("input_ids", "attention_mask", "labels")}

    settings = TrainerSettings(samples_per_step=batch, learning_rate=1e-4, max_steps=steps, max_grad_norm=1.0,
                               autocast_dtype=torch.bfloat16 if dtype == torch.bfloat16 else None,
                               fused_adamw=device.type == "cuda")
    options = HarvestOptions(window_stages=None if window == "all" else window)
    return assemble_trainer(peft_model, dataset, collate, settings, options, device=device,
                            max_sample_len=seq_len, record_device_events=device.type == "cuda")


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
