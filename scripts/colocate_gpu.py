#!/usr/bin/env python3
"""Co-location without SGLang: a transformers decode engine serving a slice of the Azure
trace, with the layer-split LoRA trainer beside it. The last stdout line is one JSON object.

    python scripts/colocate_gpu.py --model-path DIR --random-weights --device cuda \\
        --profile PROFILE.json [--modes decode-alone,harvest,static,trainer-alone] [--out-dir DIR]

Modes, run one after another in one process over the same requests:
  decode-alone   decode on the whole device, no trainer (the TPOT baseline);
  harvest        the system the SGLang server runs, built by harvest.colocate.assemble
                 (the same composition root) and stepped through Colocation.run_step: the
                 profile's predictor (refined online between trainer units and when
                 idle) and the QoS controller choose the SM level before every step and
                 open or close the trainer's gate; idle gaps give the trainer the most SMs;
  static         StaticMode: the ladder level nearest 60% decode SMs, trainer always on;
  trainer-alone  the trainer alone on the whole device for --trainer-alone-s seconds, and
                 on until it has completed an optimizer step (its rate counts whole steps);
  harvest-tight  harvest under a tight TPOT target (--tight-target-tpot-ms, else
                 --tight-target-factor x decode-alone's TPOT p50 in this run); every
                 serving mode also reports its violation rate at both targets;
  level-graphs   no trace, no trainer (issue 18, claim c): a static-cache decode step
                 (StaticDecodeBatch) per batch size and ladder level, eager on the level's
                 decode stream, then captured there as a CUDA graph (one per (level, batch
                 size), one shared pool: harvest.compute.level_graphs) and replayed; the
                 graph's logits checked against eager's, graph-on-level-k vs eager-on-level-k
                 vs graph-on-the-whole-GPU, memory each capture added. Without CUDA only
                 the eager figures are measured (the JSON says why).

Results are written as they exist (--out-dir): NAME-<mode>.json when a mode ends,
NAME.json the summary so far ("complete": false until the end), NAME-progress.json what
the running mode has measured, every 2 s. Each file is replaced atomically (--steps-out
too), and when a mode ends its steps and the summary are written before NAME-<mode>.json:
a reader that sees a mode's file sees everything written before it. SIGINT or SIGTERM (a
timeout) ends the run early: the interrupted mode's partial figures and the summary are
written first, the last stdout line is still the summary, and the exit status is 130.

Requests (harvest.replay's model): a window of the trace, arrival times scaled by
--time-scale, context and output lengths capped (--max-context, --max-generated). A
request joins the running batch at the first step boundary after its arrival (wall
clock) and leaves after ``generated - 1`` decode steps (its prefill ran on a prefill
instance and produced the first token). Its KV cache arrives as random values: a step's
cost does not depend on them (as with the model's random weights).

Engine of the serving modes, --graphs on (the default with CUDA; claim e): SlotDecodeBatch,
--max-batch-size slots of one transformers StaticCache (--max-context + --max-generated
columns); a request joins a free slot (its KV written there eagerly on the level in
force) and leaving frees it; a step computes the smallest bucket (--graph-buckets, and
--max-batch-size) holding the active slots, with per-slot positions, a per-slot 4-D mask
and a shared write column as static tensors updated on the device. One CUDA graph per
(level, bucket) is captured on the level's decode stream before the modes
(harvest.compute.level_graphs); every step replays the graph of the level the
partitioner is on (the QoS decision's) and the batch's bucket, eager on that stream where
there is none (always without CUDA). Each serving mode reports ``graphs`` (graphs
replayed), ``graph_steps``, ``eager_steps`` and, when false, ``graphs_reason``; the load
the scheduler sees is bucket x columns, what the step computes.

--graphs off: one forward of the Hugging Face model per step for the whole batch (greedy
token), eager (RaggedDecodeBatch: shapes change as requests join and leave). Requests of
different lengths share a left-padded KV cache
(transformers' DynamicCache, attention mask over the padding), so a step costs what a
uniform batch of the longest request costs; the load the scheduler sees is that padded
Σctx, n × (longest + 1), the quantity a transformers-engine profile measures. TPOT = a
step's latency, CUDA events on the decode stream around the forward (host timer on CPU),
as the scheduler sees it; ITL = the wall time between a request's tokens (control
decision, joins and leaves included). The stream is synchronised after each step, as a
serving loop reading its tokens does.

Trainer: harvest's LayerSplitTrainer (harvest.train.build.assemble_trainer, no
LlamaFactory) with LoRA on every linear layer of the served model, its frozen weights
shared with the decode engine (same-base-model mode: nothing swapped), synthetic token
batches; hosted by harvest.colocate.TrainerHost. Trainer tokens/s = tokens of completed
optimizer steps over the mode's wall time (granularity: one step, see trainer_steps).

On a CPU (--device cpu) the ladder is one shared level; the run exercises the same code
paths (tests/test_gpu_scripts.py runs it with the tiny model). Nothing here imports
sglang or llamafactory.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Before CUDA starts: harvest's streams (two per green-context level) need more hardware
# queues than the driver's default 8; 32 is the maximum (harvest.compute.device).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # a source checkout on PYTHONPATH-less runs
    sys.path.insert(0, str(ROOT))

from harvest.compute.static_decode import SlotDecodeBatch, StaticDecodeBatch, _cache_layers  # noqa: E402

MODES = ("decode-alone", "harvest", "static", "trainer-alone", "harvest-tight", "level-graphs")
DEFAULT_MODES = ("decode-alone", "harvest", "static", "trainer-alone")
STATIC_DECODE_FRACTION = 0.6


@dataclasses.dataclass(frozen=True)
class Request:
    request_id: int
    arrival_s: float
    context_tokens: int
    decode_steps: int


def load_requests(trace, start_s, duration_s, time_scale, max_context, max_generated) -> list[Request]:
    """The trace window as decode work; requests with one output token never reach decode."""
    from harvest.replay.trace import SAMPLE_TRACE, read_trace
    from harvest.replay.workload import TraceWindow, prepare

    window = TraceWindow(start_s=start_s, duration_s=duration_s, time_scale=time_scale)
    chosen = prepare(read_trace(trace or SAMPLE_TRACE), window)
    return [Request(i, r.arrival_s, max(1, min(r.context_tokens, max_context)), min(r.generated_tokens, max_generated) - 1)
            for i, r in enumerate(chosen) if min(r.generated_tokens, max_generated) > 1]


class RaggedDecodeBatch:
    """Requests of different lengths decoding together through one HF model: rows are
    right-aligned in a left-padded KV cache; each step appends one token per row."""

    def __init__(self, model, device, seed: int = 0):
        import torch

        self._torch = torch
        config = model.config
        self.model, self.config, self.device = model, config, torch.device(device)
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.request_ids: list[int] = []
        self.lengths: list[int] = []  # tokens each row holds in the KV cache
        self.last_logits = None
        self._cache = self._mask = self._next_ids = None

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def padded_length(self) -> int:
        return self._mask.shape[1] if self._mask is not None else 0

    @property
    def computed_rows(self) -> int:
        return self.num_requests

    def padded_sum_context(self) -> int:
        return self.num_requests * (self.padded_length + 1)  # the token being decoded included

    def sum_context(self) -> int:
        return sum(self.lengths) + self.num_requests

    def join(self, request_ids, context_lengths, prompts=None) -> None:
        """Add requests holding ``context_lengths`` tokens of KV: random values, or (tests)
        the prefill of ``prompts`` (lists of token ids)."""
        torch, F = self._torch, self._torch.nn.functional
        new_length = max(self.padded_length, *context_lengths)
        rows, first_ids = [], []
        with torch.inference_mode():
            if prompts is None:
                shape = (len(request_ids), self.kv_heads, new_length, self.head_dim)
                rows = [(torch.randn(shape, generator=self.generator, device=self.device, dtype=self.model.dtype),
                         torch.randn(shape, generator=self.generator, device=self.device, dtype=self.model.dtype))
                        for _ in range(self.config.num_hidden_layers)]
                first_ids = torch.randint(0, self.config.vocab_size, (len(request_ids), 1), generator=self.generator,
                                          device=self.device)
            else:
                prefills = [self.model(input_ids=torch.tensor([p], device=self.device), use_cache=True) for p in prompts]
                per_request = [_cache_layers(out.past_key_values) for out in prefills]
                for layer in range(self.config.num_hidden_layers):
                    rows.append(tuple(torch.cat([F.pad(kv[layer][i], (0, 0, new_length - kv[layer][i].shape[-2], 0))
                                                 for kv in per_request]) for i in (0, 1)))
                first_ids = torch.cat([out.logits[:, -1].argmax(-1, keepdim=True) for out in prefills])
            mask = torch.zeros((len(request_ids), new_length), dtype=torch.long, device=self.device)
            for row, length in enumerate(context_lengths):
                mask[row, new_length - length:] = 1
            if self.request_ids:
                pad = new_length - self.padded_length
                rows = [(torch.cat([F.pad(k, (0, 0, pad, 0)), new_k]), torch.cat([F.pad(v, (0, 0, pad, 0)), new_v]))
                        for (k, v), (new_k, new_v) in zip(_cache_layers(self._cache), rows)]
                mask = torch.cat([F.pad(self._mask, (pad, 0)), mask])
                first_ids = torch.cat([self._next_ids, first_ids])
            self._set(rows, mask, first_ids)
        self.request_ids += list(request_ids)
        self.lengths += list(context_lengths)

    def leave(self, request_ids) -> None:
        torch = self._torch
        gone = set(request_ids)
        keep = [i for i, rid in enumerate(self.request_ids) if rid not in gone]
        if not keep:
            self.request_ids, self.lengths, self._cache, self._mask, self._next_ids = [], [], None, None, None
            return
        lengths = [self.lengths[i] for i in keep]
        trim = self.padded_length - max(lengths)  # columns that are padding in every kept row
        index = torch.tensor(keep, device=self.device)
        with torch.inference_mode():
            rows = [(k.index_select(0, index)[:, :, trim:], v.index_select(0, index)[:, :, trim:])
                    for k, v in _cache_layers(self._cache)]
            self._set(rows, self._mask.index_select(0, index)[:, trim:], self._next_ids.index_select(0, index))
        self.request_ids = [self.request_ids[i] for i in keep]
        self.lengths = lengths

    def step(self) -> None:
        """One token for every request (on the caller's current stream)."""
        torch = self._torch
        with torch.inference_mode():
            positions = torch.tensor(self.lengths, device=self.device).unsqueeze(1)
            mask = torch.cat([self._mask, self._mask.new_ones((self.num_requests, 1))], dim=1)
            out = self.model(input_ids=self._next_ids, past_key_values=self._cache, attention_mask=mask,
                             position_ids=positions, use_cache=True, logits_to_keep=1)
            self.last_logits = out.logits[:, -1, :]
            self._next_ids = self.last_logits.argmax(dim=-1, keepdim=True)
        self._cache, self._mask = out.past_key_values, mask
        self.lengths = [length + 1 for length in self.lengths]

    def _set(self, rows, mask, next_ids) -> None:
        from transformers import DynamicCache

        self._cache = DynamicCache(ddp_cache_data=rows, config=self.config)
        self._mask, self._next_ids = mask, next_ids


class GraphStep:
    """The serving step with graphs on: the captured graph of (the level the partitioner
    is on, i.e. the one the QoS decision chose; the batch's bucket), replayed on that
    level's decode stream; eager there where no graph was captured (or without CUDA)."""

    def __init__(self, batch: SlotDecodeBatch, graphs, partitioner):
        self.batch, self.graphs, self.partitioner = batch, graphs, partitioner
        self.graph_steps = self.eager_steps = 0

    def __call__(self) -> None:
        batch = self.batch
        batch.check_room()
        bucket = batch.bucket
        if self.graphs.replay(self.partitioner.current_index, bucket, eager=lambda: batch.decode_step(bucket)):
            self.graph_steps += 1
        else:
            self.eager_steps += 1
        batch.after_step()


def capture_serving_graphs(batch: SlotDecodeBatch, graphs, ladder) -> dict:
    """One graph per (level, bucket) of the slot batch's step, each on the level's decode
    stream (the batch may be empty: inactive slots compute garbage, a join resets them)."""
    report = {"buckets": list(batch.buckets), "levels": ladder.num_levels, "captured": 0, "capture_s": 0.0,
              "unavailable": graphs.unavailable}
    if graphs.unavailable is None:
        for index in range(ladder.num_levels):
            for bucket in batch.buckets:
                capture = graphs.capture(index, bucket, lambda bucket=bucket: batch.decode_step(bucket))
                report["captured"] += 1
                report["capture_s"] += capture.seconds
        report["capture_s"] = round(report["capture_s"], 3)
        report["memory_by_level"] = {str(k): v for k, v in graphs.memory_by_level().items()}
    return report


def build_shared_trainer(decode_model, device, *, lora_rank=16, seq_len=512, samples_per_step=4, micro_batch=2, seed=0,
                         compile_layers="auto"):
    """harvest's LayerSplitTrainer for LoRA on ``decode_model``'s own frozen weights (no
    copy), built without LlamaFactory; synthetic batches of ``seq_len`` random tokens."""
    import torch
    from peft import LoraConfig, get_peft_model

    from harvest.train.build import TrainerSettings, assemble_trainer
    from harvest.train.job import HarvestOptions
    from harvest.train.weights import SharedTensorWeightSource

    config, dtype = decode_model.config, decode_model.dtype
    with torch.device("meta"):  # frozen weights come from the decode model: no second copy
        base = type(decode_model)(config)
    base = base.to(dtype).requires_grad_(False)
    base.model.rotary_emb = type(decode_model.model.rotary_emb)(config=config)  # real inv_freq buffers
    lora = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, lora)
    generator = torch.Generator().manual_seed(seed)
    for module in peft_model.modules():  # LoRA weights (on meta like their base layers) made real
        for name, param in list(module._parameters.items()):
            if param is not None and param.requires_grad:  # fp32 as LlamaFactory keeps them; B non-zero so A learns
                module._parameters[name] = torch.nn.Parameter(torch.randn(param.shape, generator=generator) * 0.02)
    tokens = torch.randint(0, config.vocab_size, (16 * samples_per_step, seq_len), generator=generator)
    dataset = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in tokens]

    def collate(features):
        return {key: torch.stack([f[key] for f in features]) for key in ("input_ids", "attention_mask", "labels")}

    on_gpu = torch.device(device).type == "cuda"
    settings = TrainerSettings(samples_per_step=samples_per_step, learning_rate=1e-4, seed=seed, max_steps=10**9,
                               fused_adamw=on_gpu, autocast_dtype=dtype if dtype == torch.bfloat16 else None)
    shared = SharedTensorWeightSource(dict(decode_model.state_dict()))
    return assemble_trainer(peft_model, dataset, collate, settings, HarvestOptions(micro_batch_size=micro_batch),
                            device=torch.device(device), weight_source=shared, max_sample_len=seq_len,
                            compile_layers=compile_layers)


# -- what each mode does around a decode step ------------------------------------------------
# These adapt the step timer (harvest.colocate.step_timer) to serve(): they depend on its
# shape in two places only, ``timer.time(tag, stream, run)`` and ``timer.completed()``
# yielding measurements with ``.tag`` and ``.seconds``, which serve().record pairs with
# the step that carried the tag (``last_step()``'s first item).
class FixedLevel:
    """decode-alone (the whole-device level, no trainer) and static (one partial level,
    trainer always on): the step on that level's decode stream, timed."""

    def __init__(self, partitioner, level_index: int, trainer_runs: bool, timer):
        self.level_index, self.trainer_runs, self.timer = level_index, trainer_runs, timer
        self.level = partitioner.select(level_index)
        self.num_steps = 0  # the tag of the latest step's measurement

    def run_step(self, load, step) -> None:
        self.num_steps += 1
        self.timer.time(self.num_steps, self.level.decode_stream, step)

    def completed(self) -> list:
        """Measurements (tag, seconds) of the steps finished since the last call."""
        return list(self.timer.completed())

    flush = completed

    def last_step(self) -> tuple[int, int, bool]:
        """(measurement tag, level index, trainer ran) of the latest step."""
        return self.num_steps, self.level_index, self.trainer_runs

    def idle(self) -> None:
        pass


class RecordingTimer:
    """The colocation's step timer, also keeping what it hands out for this report."""

    def __init__(self, timer):
        self.timer, self.measures_late, self.measured = timer, timer.measures_late, []

    def time(self, tag, stream, run, *args, **kwargs):
        return self.timer.time(tag, stream, run, *args, **kwargs)

    @property
    def outstanding(self) -> int:
        return self.timer.outstanding

    def completed(self):
        done = self.timer.completed()
        self.measured.extend(done)
        return done


class HarvestMode:
    """harvest: the system the SGLang server runs (harvest.colocate.assemble), every step
    through :meth:`Colocation.run_step`."""

    def __init__(self, colocation):
        from harvest.schedule import TrainerAction

        self.colocation, self._run = colocation, TrainerAction.RUN
        self.timer = colocation.timer = RecordingTimer(colocation.timer)

    @property
    def level(self):
        return self.colocation.control.level

    def run_step(self, load, step) -> None:
        self.colocation.run_step(load, step)

    def completed(self) -> list:
        """The measurements (tag, seconds) the colocation has fed back since the last
        call (a late timer's arrive at the next step)."""
        measured, self.timer.measured = self.timer.measured, []
        return measured

    def flush(self) -> list:
        """At the end: the last step's latency too (it feeds no decision)."""
        self.timer.completed()
        return self.completed()

    def last_step(self) -> tuple[int, int, bool]:
        """(measurement tag, level index, trainer ran) of the latest step."""
        decision = self.colocation.control.last_decision
        return decision.step, decision.level_index, decision.trainer_action is self._run

    def idle(self) -> None:
        self.colocation.on_idle()


def static_level_index(ladder) -> int:
    """The partial level nearest STATIC_DECODE_FRACTION decode SMs (the only level when shared)."""
    partial = list(ladder.trainer_levels) or list(range(ladder.num_levels))
    return min(partial, key=lambda i: abs(ladder.decode_fraction(i) - STATIC_DECODE_FRACTION))


def serve(requests, batch, policy, max_batch_size, steps=None, on_progress=None, progress_every_s=2.0,
          step=None) -> dict:
    """Replay ``requests`` in wall-clock time through ``batch`` under ``policy``; a decode
    step is ``step()`` (graphs on: a :class:`GraphStep`), by default ``batch.step``. Every
    change to the batch runs on the decode stream in force and is synchronised, so the
    next step may run on another level's stream. Measured steps are appended to
    ``steps`` (the caller's list: what was measured survives an interrupt);
    ``on_progress(steps, wall_s)`` is called every ``progress_every_s`` seconds."""
    from harvest.colocate import StepLoad

    arrivals, queue = collections.deque(requests), collections.deque()
    left: dict[int, int] = {}
    steps = [] if steps is None else steps
    unmeasured: dict[int, tuple] = {}  # steps whose latency has not arrived yet, by measurement tag

    def record(measurement) -> None:
        # Paired by tag: a measurement the timer dropped leaves its step out, never shifts the others.
        entry = unmeasured.pop(measurement.tag, None)
        if entry is not None:
            step_start, itl_s, batch_size, real_sum, padded_sum, level_index, trainer_ran = entry
            steps.append((step_start, measurement.seconds, itl_s, batch_size, real_sum, padded_sum, level_index,
                          trainer_ran))

    start = time.perf_counter()
    next_progress = progress_every_s
    last_token = None  # when the batch last produced tokens (or stopped being empty)
    while arrivals or queue or batch.num_requests:
        now = time.perf_counter() - start
        if on_progress is not None and now >= next_progress:
            on_progress(steps, now)
            next_progress = now + progress_every_s
        while arrivals and arrivals[0].arrival_s <= now:
            queue.append(arrivals.popleft())
        joining = [queue.popleft() for _ in range(min(len(queue), max_batch_size - batch.num_requests))]
        if joining:
            if not batch.num_requests:
                last_token = now
            stream = policy.level.decode_stream  # the level in force (a new one is chosen per step)
            with on_stream(stream):
                batch.join([r.request_id for r in joining], [r.context_tokens for r in joining])
            if stream is not None:
                stream.synchronize()
            left.update((r.request_id, r.decode_steps) for r in joining)
        if not batch.num_requests:
            last_token = None
            policy.idle()
            time.sleep(min(0.005, max(0.0, arrivals[0].arrival_s - now)))
            continue
        # The load the scheduler sees is the work the step computes (a slot batch: its bucket).
        load = StepLoad(batch.computed_rows, batch.padded_sum_context(), True)
        real_sum, num_requests = batch.sum_context(), batch.num_requests
        step_start = time.perf_counter() - start
        policy.run_step(load, batch.step if step is None else step)
        level = policy.level
        if level.decode_stream is not None:
            level.decode_stream.synchronize()
        step_end = time.perf_counter() - start
        tag, level_index, trainer_ran = policy.last_step()
        unmeasured[tag] = (step_start, step_end - last_token, num_requests, real_sum, load.sum_context,
                           level_index, trainer_ran)
        for measured in policy.completed():
            record(measured)
        last_token = step_end
        done = []
        for rid in batch.request_ids:
            left[rid] -= 1
            if left[rid] == 0:
                done.append(rid)
        if done:
            with on_stream(level.decode_stream):
                batch.leave(done)
            if level.decode_stream is not None:
                level.decode_stream.synchronize()
    wall_s = time.perf_counter() - start
    for measured in policy.flush():  # a late timer's last step
        record(measured)
    return {"wall_s": wall_s, "steps": steps, "unmeasured_steps": len(unmeasured)}


def on_stream(stream):
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def summarize(served: dict, target_ms: float, num_requests: int, targets: dict | None = None) -> dict:
    """TPOT = a decode step's latency (CUDA events on the decode stream), as Harli and the
    scheduler measure it. ITL = the inter-token latency the batch's requests see: wall time
    from the previous step's end (or the batch's first join) to this step's end, so it adds
    the control decision, joins and leaves between steps. ``targets`` (name -> ms): the
    violation rate at each of them too (``violation_rate_at``)."""
    import numpy as np

    steps = served["steps"]
    if not steps:
        return {"steps": 0, "requests": num_requests, "wall_s": round(served["wall_s"], 2)}
    tpot_ms, itl_ms = np.array([s[1] for s in steps]) * 1e3, np.array([s[2] for s in steps]) * 1e3
    sizes = [s[3] for s in steps]

    def ms(values, q):
        return round(float(np.percentile(values, q)), 3)

    result = {
        "tpot_ms_p50": ms(tpot_ms, 50), "tpot_ms_p99": ms(tpot_ms, 99), "tpot_ms_max": round(float(tpot_ms.max()), 3),
        "violation_rate": round(float(np.mean(tpot_ms > target_ms)), 5),
        "itl_ms_p50": ms(itl_ms, 50), "itl_ms_p99": ms(itl_ms, 99),
        "itl_violation_rate": round(float(np.mean(itl_ms > target_ms)), 5),
        "steps": len(steps), "requests": num_requests, "decode_tokens": sum(sizes),
        "decode_tokens_per_s": round(sum(sizes) / served["wall_s"], 1),
        "batch_size_mean": round(float(np.mean(sizes)), 2),
        "padded_over_real_context": round(sum(s[5] for s in steps) / max(1, sum(s[4] for s in steps)), 3),
        "trainer_step_fraction": round(float(np.mean([s[7] for s in steps])), 4),
        "steps_by_level": {str(k): v for k, v in sorted(collections.Counter(s[6] for s in steps).items())},
        "wall_s": round(served["wall_s"], 2),
        "unmeasured_steps": served.get("unmeasured_steps"),  # None: cut short before the count
    }
    if targets:
        result["violation_rate_at"] = {name: {"target_ms": round(value, 3),
                                              "violation_rate": round(float(np.mean(tpot_ms > value)), 5)}
                                       for name, value in targets.items()}
    return result


# -- per-level CUDA graphs of a static-cache decode step (issue 18, claim c) ------------------
def _median_step_ms(batch, graphs, level_index, stream, graph: bool, warmup: int, repeats: int, on_cuda: bool) -> float:
    """Median latency of one step of ``batch`` on level ``level_index`` (graph replay or
    eager on its decode stream): CUDA events on that stream, a host timer on CPU."""
    import statistics

    import torch

    with on_stream(stream):
        batch.reset()
    for _ in range(warmup):
        batch.run(graphs, level_index, stream, graph=graph)
    samples = []
    for _ in range(repeats):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            batch.run(graphs, level_index, stream, graph=graph)
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            batch.run(graphs, level_index, stream, graph=graph)
            samples.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(samples), 4)


def graph_verdict(row: dict, whole: dict, total_sms: int, min_slowdown: float = 1.1) -> tuple[bool | None, str]:
    """Does the graph replayed on a partial level keep to its SMs? A graph that escaped
    its green context would run on every SM, as fast as the same step's graph on the
    whole GPU; one that keeps to its level is slower. So: clearly slower (x``min_slowdown``
    or more) keeps to the level; not clearly slower on a level with at most half the SMs
    escapes (a decode step loses bandwidth as well as compute there: x1.29 on 56 of 132
    H100 SMs at batch 8 of an 8B model); not clearly slower on a larger level cannot tell
    (a memory-bound step may not need every SM).

    Eager decode is no reference: on a GPU, transformers' eager step of an 8B model is
    bound by the host's kernel launches (H100: a whole-GPU eager step 1.8-2.5 times its
    graph), so its time per level measures the host, not the SMs; it is reported beside."""
    if row.get("graph_ms") is None or whole.get("graph_ms") is None:
        return None, "no graph measured"
    graph = row["graph_ms"] / whole["graph_ms"]
    eager = row["eager_ms"] / whole["eager_ms"]
    seen = f"graph x{graph:.2f} slower than on the whole GPU (eager x{eager:.2f})"
    if graph >= min_slowdown:
        return True, f"{seen}: the graph keeps to the level"
    if 2 * row["decode_sms"] <= total_sms:
        return False, f"{seen} on {row['decode_sms']} of {total_sms} SMs: the graph escapes the level"
    return None, f"inconclusive: {seen} on {row['decode_sms']} of {total_sms} SMs"


def measure_level_graphs(args, ctx) -> dict:
    """Claim (c) (and (b) for a real decode step): for each batch size and ladder level, a
    static-cache decode step eager on the level's stream, then captured there (one graph
    per (level, batch size), one pool) and replayed; the graph's tokens checked against
    eager's; graph-on-level-k vs eager-on-level-k vs graph-on-the-whole-GPU."""
    import torch

    from harvest.compute.level_graphs import LevelGraphs

    partitioner, model, on_cuda = ctx["partitioner"], ctx["model"], ctx["device_type"] == "cuda"
    ladder = partitioner.ladder
    graphs = LevelGraphs(ladder.levels)
    warmup, repeats = 2, args.graph_repeats
    result = {"engine": "transformers StaticCache, 4-D boolean mask, greedy token (decode_step of StaticDecodeBatch)",
              "context_length": args.graph_context, "repeats": repeats, "graphs_unavailable": graphs.unavailable,
              "whole_device_level": ladder.whole_device_index, "batch_sizes": {}}
    ctx["live"] = result  # what an interrupt leaves
    sink = ctx["sink"]
    try:
        for batch_size in args.graph_batch_sizes:
            batch = StaticDecodeBatch(model, ctx["device"], batch_size, args.graph_context,
                                      max_steps=warmup + repeats + 2, seed=args.seed)
            rows: list[dict] = []
            result["batch_sizes"][str(batch_size)] = {"levels": rows}
            for index, level in enumerate(ladder.levels):
                stream = level.decode_stream
                row = {"level": index, "decode_sms": level.decode_sms, "trainer_sms": level.trainer_sms}
                rows.append(row)
                row["eager_ms"] = _median_step_ms(batch, graphs, index, stream, False, warmup, repeats, on_cuda)
                with on_stream(stream):
                    batch.reset()
                    batch.run(graphs, index, stream, graph=False)
                    eager_logits = batch.last_logits.float().clone()
                capture = graphs.capture(index, batch_size, batch.decode_step)
                if capture is not None:
                    row["capture_s"] = round(capture.seconds, 3)
                    row["capture_reserved_bytes"] = capture.reserved_bytes
                    row["capture_allocated_bytes"] = capture.allocated_bytes
                    with on_stream(stream):
                        batch.reset()
                    batch.run(graphs, index, stream, graph=True)
                    if stream is not None:
                        stream.synchronize()
                    row["graph_max_abs_diff_vs_eager"] = float((batch.last_logits.float() - eager_logits).abs().max())
                    row["graph_ms"] = _median_step_ms(batch, graphs, index, stream, True, warmup, repeats, on_cuda)
                    row["graph_over_eager"] = round(row["graph_ms"] / row["eager_ms"], 4)
                sink.progress("level-graphs", result)
            whole = rows[ladder.whole_device_index]
            for row in rows:
                row["eager_over_whole_eager"] = round(row["eager_ms"] / whole["eager_ms"], 4)
                if row.get("graph_ms") is not None:
                    row["graph_over_whole_graph"] = round(row["graph_ms"] / whole["graph_ms"], 4)
                if row is not whole:
                    row["partition_respected"], row["verdict"] = graph_verdict(row, whole, ladder.total_sms)
            del batch
            if on_cuda:
                torch.cuda.synchronize()
    finally:
        result["memory_by_level"] = {str(k): v for k, v in graphs.memory_by_level().items()}
        graphs.close()
    if graphs.unavailable is not None:
        result["skipped"] = f"graph figures: {graphs.unavailable}; eager decode per level measured"
    return result


# -- results written as they exist -------------------------------------------------------------
def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: a reader sees the old file or the new
    one, never half of one (written beside it, then renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class ResultSink:
    """Writes results the moment they exist (nothing when ``out_dir`` is None):
    ``NAME-<mode>.json`` when a mode finishes (or is interrupted), ``NAME.json`` the summary
    so far (``complete`` false until the end), ``NAME-progress.json`` what the running mode
    has measured, every few seconds. Each file is replaced atomically."""

    def __init__(self, out_dir: Path | None, name: str, min_interval_s: float = 2.0):
        self.out_dir, self.name, self.min_interval_s = out_dir, name, min_interval_s
        self._last_progress = 0.0
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)

    def _write(self, filename: str, data) -> None:
        if self.out_dir is not None:
            write_atomically(self.out_dir / filename, json.dumps(data, indent=1))

    def progress(self, mode: str, data, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_progress >= self.min_interval_s:
            self._last_progress = now
            self._write(f"{self.name}-progress.json", {"mode": mode, "at": time.strftime("%H:%M:%S"), "so_far": data})

    def mode_done(self, mode: str, result: dict) -> None:
        """Write a finished mode's file: last, after its steps and the summary (a reader
        polling for it may read those at once)."""
        self._write(f"{self.name}-{mode}.json", result)

    def summary(self, summary: dict) -> None:
        self._write(f"{self.name}.json", summary)


# -- the modes --------------------------------------------------------------------------------
SERVING_MODES = ("decode-alone", "harvest", "static", "harvest-tight")
TRAINER_MODES = ("harvest", "static", "trainer-alone", "harvest-tight")
PROFILE_MODES = ("harvest", "harvest-tight")


def target_for(mode: str, args, ctx) -> float:
    if mode != "harvest-tight":
        return args.target_tpot_ms
    tight = ctx["targets"].get("tight")
    if tight is None:
        raise RuntimeError("harvest-tight: no tight target (give --tight-target-tpot-ms, or run decode-alone first "
                           "for --tight-target-factor x its TPOT p50)")
    return tight


def run_mode(mode, args, ctx) -> dict:
    if mode == "level-graphs":
        return measure_level_graphs(args, ctx)
    import torch

    from harvest.colocate import TrainerHost, make_step_timer
    from harvest.schedule import TrainerState

    trainer, partitioner, sink = ctx["trainer"], ctx["partitioner"], ctx["sink"]
    job = Path(f"colocated-lora-{mode}")
    target = target_for(mode, args, ctx)
    colocation = host = None
    if mode in PROFILE_MODES:  # the system the server runs, from the same composition root
        from harvest.colocate.assemble import EngineAdapter, assemble

        engine = EngineAdapter(device=ctx["device"], model_path=args.model_path, model_dtype=ctx["dtype"],
                               build_trainer=lambda _job: trainer, jobs=(job,))
        colocation = assemble(harvest_config(args, target), engine, partitioner=partitioner)
        colocation.start()
        host = colocation.trainer_host
    elif mode != "decode-alone":
        host = TrainerHost([job], build=lambda _job: trainer)
        host.start()
    interrupted = False
    try:
        if host is not None:
            deadline = time.monotonic() + 60
            while host.scheduler_state() is TrainerState.BUILDING and time.monotonic() < deadline:
                time.sleep(0.01)
        before = trainer.stats()
        if ctx["device_type"] == "cuda":
            torch.cuda.reset_peak_memory_stats()
        steps: list = []
        served: dict = {}  # serve()'s result, once it ends
        started = time.perf_counter()
        result = {"target_tpot_ms": round(target, 3)}
        try:
            if mode == "trainer-alone":
                host.apply(True, ctx["alone_stream"])
                try:
                    time.sleep(args.trainer_alone_s)
                    # Its rate counts completed optimizer steps: on until one is in the
                    # window (however slow the device), unless the trainer ended (failed).
                    # Both counters: the trainer updates them one after the other.
                    while host.live and _no_step_since(before, trainer.stats()):
                        time.sleep(0.01)
                finally:
                    host.apply(False)
            else:
                if mode == "decode-alone":
                    policy = FixedLevel(partitioner, partitioner.ladder.whole_device_index, False,
                                        make_step_timer(ctx["device_type"]))
                elif mode == "static":
                    policy = FixedLevel(partitioner, static_level_index(partitioner.ladder), True,
                                        make_step_timer(ctx["device_type"]))
                    host.apply(True, policy.level.trainer_stream)
                else:
                    policy = HarvestMode(colocation)

                def progress(so_far, wall_s):
                    sink.progress(mode, summarize({"wall_s": wall_s, "steps": so_far}, target, len(ctx["requests"])))

                graph_step = ctx.get("graph_step")
                if graph_step is not None:
                    graph_step.graph_steps = graph_step.eager_steps = 0
                served = serve(ctx["requests"], ctx["batch"], policy, args.max_batch_size, steps=steps,
                               on_progress=progress, step=graph_step)
        except KeyboardInterrupt:
            interrupted = True
            result["interrupted"] = True
        wall_s = time.perf_counter() - started
        if mode != "trainer-alone":
            if mode == "decode-alone" and steps and args.tight_target_tpot_ms is None:
                import numpy as np

                p50 = float(np.percentile([s[1] for s in steps], 50)) * 1e3
                ctx["targets"]["tight"] = round(args.tight_target_factor * p50, 3)
            partial = {"wall_s": wall_s, "steps": steps, "unmeasured_steps": served.get("unmeasured_steps")}
            result.update(summarize(partial, target, len(ctx["requests"]), targets=ctx["targets"]))
            result.update(serving_graphs_report(ctx))
            ctx["step_log"][mode] = steps
            if colocation is not None:
                result.update(qos=colocation.control.qos.stats().to_dict(), prediction_error=colocation.refiner.error,
                              control_us_per_step=round(colocation.profiler.summary()["hook_overhead_us_per_step"], 2))
        else:
            result["wall_s"] = round(wall_s, 2)
        after = trainer.stats()  # before the trainer stops: work after wall_s is not counted
        result.update(trainer_tokens_per_s=None, trainer_steps=0)
        if host is not None:
            result.update(trainer_tokens_per_s=round((after.tokens_seen - before.tokens_seen) / wall_s, 1),
                          trainer_steps=after.global_step - before.global_step, trainer_compile=after.compile)
        if ctx["device_type"] == "cuda":
            result["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if interrupted:  # written before the trainer's shutdown, which may outlast the kill
            ctx["record_interrupted"](mode, result)
            raise KeyboardInterrupt
    finally:
        timeout_s = 5.0 if interrupted else 60.0
        if colocation is not None:
            colocation.close(trainer_timeout_s=timeout_s)
        elif host is not None:
            host.shutdown(timeout_s=timeout_s)
    if host is not None:
        status = host.status()
        result["trainer_state"] = status.state
        if status.error:
            result["trainer_error"] = status.error
    return result


def _no_step_since(before, now) -> bool:
    """No optimizer step (its tokens counted) completed between two TrainerStats."""
    return now.global_step == before.global_step or now.tokens_seen == before.tokens_seen


def harvest_config(args, target_tpot_ms: float | None = None):
    """The harvest.yaml this run stands for: the QoS target and the profile (jobs are
    built here, not from files)."""
    from harvest.config import HarvestConfig
    from harvest.schedule import SchedulerConfig

    target = args.target_tpot_ms if target_tpot_ms is None else target_tpot_ms
    return HarvestConfig(qos=SchedulerConfig(target_tpot_ms=target), profile=args.profile,
                         allow_profile_mismatch=args.allow_profile_mismatch)


def serving_graphs_report(ctx) -> dict:
    """What a serving mode's decode steps ran: ``graphs`` true when captured graphs were
    replayed (``graph_steps``; ``eager_steps`` ran eagerly for want of one), else why not."""
    step, captured = ctx.get("graph_step"), ctx.get("serving_graphs") or {}
    if step is None:
        return {"graphs": False, "graphs_reason": "--graphs off: the ragged eager batch",
                "decode_engine": "transformers eager, DynamicCache (ragged batch; no CUDA graphs in the serving loop)"}
    batch = step.batch
    engine = (f"transformers StaticCache slot batch ({batch.max_batch_size} slots x {batch.max_length} columns, "
              f"buckets {','.join(map(str, batch.buckets))}), ")
    report = {"graphs": step.graph_steps > 0, "graph_steps": step.graph_steps, "eager_steps": step.eager_steps}
    if step.graph_steps:
        report["decode_engine"] = engine + "per-(level, bucket) CUDA graph replayed on the chosen level's stream"
    else:
        report["graphs_reason"] = captured.get("unavailable") or "no graph was replayed"
        report["decode_engine"] = engine + "eager on the chosen level's stream (the graphs' fallback)"
    return report


def warm_up(batch, trainer, partitioner, on_cuda) -> None:
    """First launches on each green context load kernels and create handles: keep them out
    of the timed modes. ``trainer`` None: decode only."""
    import torch

    cap = getattr(batch, "max_context", 32)
    for level in partitioner.ladder.levels:
        with on_stream(level.decode_stream):
            batch.join([-1, -2], [min(16, cap), min(32, cap)])
            for _ in range(min(3, getattr(batch, "max_steps", 3))):
                batch.step()
            batch.leave([-1, -2])
        if trainer is not None:
            for _ in range(3):
                trainer.run_one_unit(level.trainer_stream)  # None: the current stream (all SMs)
        if on_cuda:
            torch.cuda.synchronize()
    if trainer is not None:
        # One whole optimizer step: every unit kind has run (a compiled trainer compiles its
        # layers' forward and backward graphs here, not in the first timed mode).
        step = trainer.stats().global_step
        while trainer.stats().global_step == step:
            trainer.run_one_unit()
        if on_cuda:
            torch.cuda.synchronize()


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, comma-separated")
    return values


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="model directory (config.json; weights unless --random-weights)")
    parser.add_argument("--random-weights", action="store_true", help="build the model from config.json with random weights")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--profile", type=Path, default=None, help="latency profile (`harvest profile`) for the harvest modes")
    parser.add_argument("--allow-profile-mismatch", action="store_true", help="use a profile of another device/model/ladder (warns)")
    parser.add_argument("--levels", type=int, default=5, help="SM ladder levels (must match the profile's; default 5)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--target-tpot-ms", type=float, default=40.0)
    parser.add_argument("--tight-target-tpot-ms", type=float, default=None,
                        help="harvest-tight's target (default: --tight-target-factor x decode-alone's TPOT p50)")
    parser.add_argument("--tight-target-factor", type=float, default=1.25)
    parser.add_argument("--trace", type=Path, default=None, help="Azure-format trace CSV (default: the bundled sample)")
    parser.add_argument("--trace-start-s", type=float, default=0.0)
    parser.add_argument("--trace-seconds", type=float, default=30.0, help="length of the trace window replayed per mode")
    parser.add_argument("--time-scale", type=float, default=1.0, help="factor on arrival times (2: half the rate)")
    parser.add_argument("--max-context", type=int, default=1024, help="cap on a request's context tokens")
    parser.add_argument("--max-generated", type=int, default=128, help="cap on a request's output tokens")
    parser.add_argument("--max-batch-size", type=int, default=48)
    parser.add_argument("--trainer-alone-s", type=float, default=30.0,
                        help="trainer-alone's seconds (then on until an optimizer step completed)")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--trainer-seq-len", type=int, default=512)
    parser.add_argument("--trainer-batch", type=int, default=4, help="samples per optimizer step")
    parser.add_argument("--trainer-micro-batch", type=int, default=2)
    parser.add_argument("--trainer-compile", choices=["auto", "on", "off"], default="auto",
                        help="the trainer's decoder layers compiled (harvest.yaml trainer.compile); auto: on with CUDA")
    parser.add_argument("--graphs", choices=["auto", "on", "off"], default="auto",
                        help="serving modes: on = the slot batch, its step a per-(level, bucket) CUDA graph replayed "
                             "on the chosen level (eager where none: without CUDA); off = the ragged eager batch; "
                             "auto: on with CUDA")
    parser.add_argument("--graph-buckets", type=_int_list, default=[8, 16, 32],
                        help="graphs on: batch-size buckets below --max-batch-size (one graph per level and bucket)")
    parser.add_argument("--graph-batch-sizes", type=_int_list, default=[8, 32],
                        help="level-graphs: batch sizes, one graph per (level, batch size)")
    parser.add_argument("--graph-context", type=int, default=512, help="level-graphs: context tokens per request")
    parser.add_argument("--graph-repeats", type=int, default=20, help="level-graphs: timed steps per measurement")
    parser.add_argument("--steps-out", type=Path, default=None, help="write every step of every mode here (JSON)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="write NAME.json (summary so far), NAME-<mode>.json and NAME-progress.json here as they exist")
    parser.add_argument("--name", default="colocate", help="file name prefix under --out-dir")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="CPU intra-op threads (1 is steadier on a small shared machine)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"--modes: {','.join(unknown) or 'empty'} (choose from {', '.join(MODES)})")
    if any(m in PROFILE_MODES for m in modes) and args.profile is None:
        parser.error("--profile is required for the harvest mode (make one with `harvest profile`)")

    import signal

    import torch

    from harvest.compute import create_partitioner
    from harvest.predict.profiler.hf_engine import load_causal_lm

    device_type = "cuda" if args.device.startswith("cuda") else "cpu"
    if device_type == "cuda" and not torch.cuda.is_available():
        print(f"colocate_gpu: --device {args.device}: no CUDA device here", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a timeout's TERM ends the run as INT does: results first
    device = str(torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device))
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device_type == "cuda" else "float32")
    torch.manual_seed(args.seed)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    elif device_type == "cpu":  # as the server does: decode keeps the cores the trainer leaves
        from harvest.colocate.colocation import leave_cores_to_trainer

        leave_cores_to_trainer(harvest_config(args).trainer.cpu_threads)
    sink = ResultSink(args.out_dir, args.name)
    targets = {"target": args.target_tpot_ms}
    if args.tight_target_tpot_ms is not None:
        targets["tight"] = args.tight_target_tpot_ms
    ctx = {"device_type": device_type, "device": device, "dtype": dtype, "step_log": {}, "sink": sink,
           "targets": targets, "requests": [], "trainer": None}
    results: dict = {}
    interrupted = False
    partitioner = None
    started = time.perf_counter()

    def summary(complete: bool, cut: bool = False) -> dict:
        return make_summary(args, ctx, results, complete, interrupted or cut, time.perf_counter() - started)

    def record_interrupted(mode: str, result: dict) -> None:
        results[mode] = result
        write_steps(args.steps_out, ctx["step_log"])
        sink.summary(summary(False, cut=True))
        sink.mode_done(mode, result)  # last: whoever sees it sees the rest

    ctx["record_interrupted"] = record_interrupted

    try:
        partitioner = ctx["partitioner"] = create_partitioner(device, levels=args.levels)
        ctx["alone_stream"] = torch.cuda.Stream(device) if device_type == "cuda" else None
        if any(m in SERVING_MODES or m in TRAINER_MODES for m in modes):
            ctx["requests"] = load_requests(args.trace, args.trace_start_s, args.trace_seconds, args.time_scale,
                                            args.max_context, args.max_generated)
        model = ctx["model"] = load_causal_lm(args.model_path, device, dtype, args.random_weights).requires_grad_(False)
        graphs_on = args.graphs == "on" or (args.graphs == "auto" and device_type == "cuda")
        serving = any(m in SERVING_MODES for m in modes)
        ctx["graphs"] = graphs_on and serving
        if graphs_on and serving:
            ctx["batch"] = SlotDecodeBatch(model, device, args.max_batch_size, args.max_context, args.max_generated,
                                           buckets=args.graph_buckets, seed=args.seed)
        else:
            ctx["batch"] = RaggedDecodeBatch(model, device, seed=args.seed)
        if any(m in TRAINER_MODES for m in modes):
            ctx["trainer"] = build_shared_trainer(model, device, lora_rank=args.lora_rank, seq_len=args.trainer_seq_len,
                                                  samples_per_step=args.trainer_batch,
                                                  micro_batch=args.trainer_micro_batch, seed=args.seed,
                                                  compile_layers=args.trainer_compile)
        if any(m != "level-graphs" for m in modes):
            warm_up(ctx["batch"], ctx["trainer"], partitioner, device_type == "cuda")
        if graphs_on and serving:
            from harvest.compute.level_graphs import LevelGraphs

            print("colocate_gpu: capturing the serving step's graphs ...", file=sys.stderr, flush=True)
            serving_graphs = ctx["serving_graph_set"] = LevelGraphs(partitioner.ladder.levels)
            ctx["serving_graphs"] = capture_serving_graphs(ctx["batch"], serving_graphs, partitioner.ladder)
            ctx["graph_step"] = GraphStep(ctx["batch"], serving_graphs, partitioner)
            print(f"colocate_gpu: serving graphs: {json.dumps(ctx['serving_graphs'])}", file=sys.stderr, flush=True)
        sink.summary(summary(False))
        for mode in modes:  # a failed mode is recorded; the others still run
            print(f"colocate_gpu: mode {mode} ...", file=sys.stderr, flush=True)
            ctx["live"] = None
            mode_started = time.perf_counter()
            try:  # a bad profile fails the harvest mode only
                results[mode] = run_mode(mode, args, ctx)
            except KeyboardInterrupt:
                if mode not in results:  # cut outside a serving loop (level-graphs, start-up of a mode)
                    record_interrupted(mode, {**(ctx.get("live") or {}), "interrupted": True,
                                              "wall_s": round(time.perf_counter() - mode_started, 2)})
                raise
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                results[mode] = {"error": f"{type(exc).__name__}: {exc}"}
                ctx["batch"].leave(list(ctx["batch"].request_ids))
            write_steps(args.steps_out, ctx["step_log"])
            sink.summary(summary(False))
            sink.mode_done(mode, results[mode])  # last: whoever sees it sees the rest
            print(f"colocate_gpu: {mode}: {json.dumps(results[mode])}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("colocate_gpu: interrupted; writing what was measured", file=sys.stderr, flush=True)
    finally:
        final = summary(complete=not interrupted)
        write_steps(args.steps_out, ctx["step_log"])
        sink.summary(final)  # after the steps: a complete summary means complete steps
        print(json.dumps(final), flush=True)
        if ctx.get("serving_graph_set") is not None:
            if device_type == "cuda":
                torch.cuda.synchronize()
            ctx["serving_graph_set"].close()
        if partitioner is not None:
            partitioner.close()
    if interrupted:
        return 130
    return 1 if any("error" in result for result in results.values()) else 0


def write_steps(path: Path | None, step_log: dict) -> None:
    if path is None:
        return
    fields = ("start_s", "tpot_s", "itl_s", "batch_size", "sum_context", "padded_sum_context", "level", "trainer_ran")
    write_atomically(path, json.dumps({m: [dict(zip(fields, s)) for s in steps] for m, steps in step_log.items()}))


def make_summary(args, ctx, results: dict, complete: bool, interrupted: bool, wall_s: float) -> dict:
    import torch

    partitioner = ctx.get("partitioner")
    trainer = ctx.get("trainer")
    summary = {
        "complete": complete, "interrupted": interrupted, "wall_s": round(wall_s, 1),
        "device": torch.cuda.get_device_name(ctx["device"]) if ctx["device_type"] == "cuda" else "cpu",
        "model": Path(args.model_path).name, "dtype": ctx["dtype"], "engine": "transformers",
        "target_tpot_ms": args.target_tpot_ms, "targets_ms": dict(ctx["targets"]),
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "profile": str(args.profile) if args.profile else None,
        "serving_graphs_on": ctx.get("graphs"), "serving_graphs": ctx.get("serving_graphs"),
        "trace": {"path": str(args.trace) if args.trace else "bundled sample", "start_s": args.trace_start_s,
                  "seconds": args.trace_seconds, "time_scale": args.time_scale, "requests": len(ctx["requests"]),
                  "max_context": args.max_context, "max_generated": args.max_generated},
        "modes": results,
    }
    if partitioner is not None:
        summary.update(ladder=[(lv.decode_sms, lv.trainer_sms) for lv in partitioner.ladder.levels],
                       partitioner=partitioner.description, static_level=static_level_index(partitioner.ladder))
    if trainer is not None:
        summary["trainer"] = {"lora_rank": args.lora_rank, "seq_len": args.trainer_seq_len,
                              "samples_per_step": args.trainer_batch, "micro_batch": trainer.micro_batch_size,
                              "weights": "shared with the decode model"}
    rate = {mode: result.get("trainer_tokens_per_s") for mode, result in results.items()}
    for mode, baseline, name in (("harvest", "trainer-alone", "alone"), ("static", "trainer-alone", "alone"),
                                 ("harvest", "static", "static"), ("harvest-tight", "trainer-alone", "alone")):
        if rate.get(mode) is not None and rate.get(baseline):
            summary[f"{mode}_trainer_vs_{name}"] = round(rate[mode] / rate[baseline], 4)
    return summary


if __name__ == "__main__":
    sys.exit(main())
