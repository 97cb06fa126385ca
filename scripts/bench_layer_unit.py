"""Benchmark of one decoder-layer unit, eager vs compiled. The last stdout line (with --json)
is one JSON object.

The layer-split trainer runs a step as units: every decoder layer's forward, in order,
then every layer's backward, in reverse. This measures such units on one Llama decoder
layer with PEFT LoRA on every linear projection (HF transformers + PEFT modules, what the
trainer runs), as the trainer runs them: ``--layers`` forward units of the layer (each on
a fresh leaf input, the unit boundary's ``detach().requires_grad_()``), then their
backward units in reverse. Variants, each timed on the same inputs:

  eager      the modules as they are
  compiled   ``torch.compile(layer)`` with the trainer's backend (inductor; on a CPU keeping
             eager's fp32 numerics, harvest.train.eager_numerics)
  graphs     ``torch.compile(layer, mode="reduce-overhead")``: inductor, replayed as CUDA
             graphs (cudagraph trees); CUDA only

Reported per variant: the host time to issue one unit (µs; a unit whose host time exceeds
its device time is host-bound: the GPU waits for Python), the device time of one unit
(ms, CUDA events; on a CPU the host time is the unit's time), operators dispatched per
forward + backward unit (torch.profiler's top-level ``aten::`` events), the first call's
seconds (compilation), the LoRA gradients' relative difference to eager, and the tokens/s
of a ``--model-layers``-layer model made of such units (forward + backward of every layer;
the embedding, head and optimizer are left out, so this is an upper bound).

    python scripts/bench_layer_unit.py --device cuda --shape llama3-8b --json
    python scripts/bench_layer_unit.py --shape tiny --variants eager,compiled --json   # CPU
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      rope_theta=500000.0, model_layers=32),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 rope_theta=10000.0, model_layers=32),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_layer(shape: str, dtype, device: str, lora_rank: int, seed: int):
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    fields = dict(SHAPES[shape])
    fields.pop("model_layers")
    config = LlamaConfig(**fields, num_hidden_layers=1, vocab_size=1024, attn_implementation="sdpa")
    torch.manual_seed(seed)
    layer = LlamaDecoderLayer(config, layer_idx=0).to(device=device, dtype=dtype)
    for param in layer.parameters():
        param.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=LORA_TARGETS,
                                       lora_dropout=0.0), layer)
    layer.to(device=device, dtype=dtype)
    lora = [p for name, p in layer.named_parameters() if "lora_" in name]
    with torch.no_grad():
        for param in lora:  # LoRA B is zero at init: random, so every LoRA weight gets a gradient
            param.normal_(0.0, 0.02)
        for param in lora:
            param.requires_grad_(True)
    rotary = LlamaRotaryEmbedding(config=config).to(device)
    return config, layer, rotary, lora


class Timing:
    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()


def run_units(layer, inputs, position_embeddings, grads, new_step=False):
    """Forward units over ``inputs`` (one per layer), then backward units in reverse; returns
    (host seconds per forward unit, per backward unit, events per unit or None).
    ``new_step``: tell cudagraph trees a training step begins (its graphs' outputs from
    earlier steps may be overwritten; those of this step's forward units may not)."""
    import torch

    if new_step:
        torch.compiler.cudagraph_mark_step_begin()
    cuda = inputs[0].is_cuda
    outputs, leaves, fwd_host, bwd_host, events = [], [], [], [], []
    for x in inputs:
        leaf = x.detach().requires_grad_(True)
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            start.record()
        t0 = time.perf_counter()
        out = layer(leaf, position_embeddings=position_embeddings)
        out = out[0] if isinstance(out, tuple) else out
        fwd_host.append(time.perf_counter() - t0)
        if cuda:
            end.record()
            events.append(("forward", start, end))
        outputs.append(out)
        leaves.append(leaf)
    for out, grad in zip(reversed(outputs), reversed(grads)):
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            start.record()
        t0 = time.perf_counter()
        out.backward(grad)
        bwd_host.append(time.perf_counter() - t0)
        if cuda:
            end.record()
            events.append(("backward", start, end))
    return fwd_host, bwd_host, events


def count_ops(layer, x, position_embeddings, grad, new_step=False) -> int:
    """Top-level aten operators the host dispatches for one forward + backward unit."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if new_step:
        torch.compiler.cudagraph_mark_step_begin()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        leaf = x.detach().requires_grad_(True)
        out = layer(leaf, position_embeddings=position_embeddings)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
    return sum(top_level_aten_ops(prof).values())


def top_level_aten_ops(prof) -> collections.Counter:
    """Operators the host dispatched, by name: ``aten::`` events of a torch.profiler run with
    no ``aten::`` ancestor (bench_trainer.py counts the trainer's units the same way)."""
    found = collections.Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            found[event.name] += 1
    return found


def measure_variant(name, layer, lora, inputs, position_embeddings, grads, timing, rounds, warmup):
    graphs = name == "graphs"

    for param in lora:
        param.grad = None
    t0 = time.perf_counter()
    run_units(layer, inputs[:1], position_embeddings, grads[:1], graphs)  # compiles (and records graphs) here
    timing.sync()
    first_call_s = time.perf_counter() - t0
    for _ in range(warmup):
        run_units(layer, inputs, position_embeddings, grads, graphs)
    timing.sync()
    for param in lora:
        param.grad = None
    run_units(layer, inputs[:1], position_embeddings, grads[:1], graphs)
    timing.sync()
    reference_grads = [p.grad.detach().float().clone() for p in lora]
    fwd_host, bwd_host, fwd_dev, bwd_dev, walls = [], [], [], [], []
    for _ in range(rounds):
        timing.sync()
        t0 = time.perf_counter()
        f, b, events = run_units(layer, inputs, position_embeddings, grads, graphs)
        timing.sync()
        walls.append(time.perf_counter() - t0)
        fwd_host += f
        bwd_host += b
        for kind, start, end in events:
            (fwd_dev if kind == "forward" else bwd_dev).append(start.elapsed_time(end) / 1e3)
    try:
        ops = count_ops(layer, inputs[0], position_embeddings, grads[0], graphs)
    except Exception as exc:  # noqa: BLE001 - the timings stand without the count
        print(f"{name}: operators not counted: {type(exc).__name__}: {exc}", file=sys.stderr)
        ops = None
    timing.sync()
    result = {
        "first_call_s": round(first_call_s, 3),
        "host_us_forward_unit": round(statistics.median(fwd_host) * 1e6, 1),
        "host_us_backward_unit": round(statistics.median(bwd_host) * 1e6, 1),
        "ops_per_layer_unit": ops,
        "wall_s_per_layer_fwd_bwd": statistics.median(walls) / len(inputs),
    }
    if fwd_dev:
        result["device_ms_forward_unit"] = round(statistics.median(fwd_dev) * 1e3, 3)
        result["device_ms_backward_unit"] = round(statistics.median(bwd_dev) * 1e3, 3)
    return result, reference_grads


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object (last line)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: llama3-8b on cuda, tiny on cpu")
    parser.add_argument("--variants", default=None,
                        help="comma-separated of eager, compiled, graphs (default: all three on cuda, eager,compiled on cpu)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4, help="forward units before the backward units, per round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: bfloat16 on cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_layer_unit: --device cuda: no CUDA device here", file=sys.stderr)
        return 2
    shape = args.shape or ("llama3-8b" if args.device == "cuda" else "tiny")
    variants = (args.variants or ("eager,compiled,graphs" if args.device == "cuda" else "eager,compiled")).split(",")
    unknown = [v for v in variants if v not in ("eager", "compiled", "graphs")]
    if unknown or not variants:
        print(f"bench_layer_unit: --variants {args.variants}: each one of eager, compiled, graphs", file=sys.stderr)
        return 2
    if "graphs" in variants and args.device != "cuda":
        print("bench_layer_unit: the graphs variant needs --device cuda", file=sys.stderr)
        return 2
    if "eager" not in variants:
        variants.insert(0, "eager")  # the reference for the gradient comparison
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    device = "cuda:0" if args.device == "cuda" else "cpu"
    config, layer, rotary, lora = build_layer(shape, dtype, device, args.lora_rank, args.seed)
    generator = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    tokens = args.micro_batch * args.seq_len
    inputs = [torch.randn(args.micro_batch, args.seq_len, config.hidden_size, generator=generator).to(device, dtype)
              for _ in range(args.layers)]
    grads = [torch.randn(args.micro_batch, args.seq_len, config.hidden_size, generator=generator).to(device, dtype)
             * 1e-2 for _ in range(args.layers)]
    position_ids = torch.arange(args.seq_len, device=device).unsqueeze(0).expand(args.micro_batch, -1)
    position_embeddings = rotary(inputs[0], position_ids)
    timing = Timing(device)
    model_layers = SHAPES[shape]["model_layers"]

    result = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "shape": shape,
              "dtype": str(dtype).replace("torch.", ""), "tokens_per_unit": tokens, "lora_rank": args.lora_rank,
              "layers_per_round": args.layers, "rounds": args.rounds, "torch": torch.__version__, "variants": {}}
    reference = None
    for variant in variants:
        torch._dynamo.reset()
        if variant == "eager":
            module = layer
        elif variant == "graphs":
            module = torch.compile(layer, mode="reduce-overhead", dynamic=False)
        else:  # the trainer's backend (harvest.train.compiled_units): on a CPU, eager's numerics
            from harvest.train.compiled_units import default_backend

            module = torch.compile(layer, backend=default_backend(torch.device(args.device)), dynamic=False)
        try:
            measured, grads_now = measure_variant(variant, module, lora, inputs, position_embeddings, grads, timing,
                                                  args.rounds, args.warmup)
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, the others still run
            result["variants"][variant] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"{variant}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        if reference is None:
            reference = grads_now
        diff = max(float((g - r).norm() / r.norm().clamp_min(1e-30)) for g, r in zip(grads_now, reference))
        measured["lora_grad_rel_diff_vs_eager"] = diff
        unit_s = measured.pop("wall_s_per_layer_fwd_bwd")
        measured["ms_per_layer_fwd_bwd"] = round(unit_s * 1e3, 3)
        measured["tokens_per_s_model"] = round(tokens / (unit_s * model_layers), 1)
        result["variants"][variant] = measured
        print(f"{variant}: {json.dumps(measured)}", file=sys.stderr)
    eager = result["variants"].get("eager", {})
    for variant, measured in result["variants"].items():
        if variant != "eager" and "error" not in measured and "error" not in eager:
            measured["speedup_vs_eager"] = round(eager["ms_per_layer_fwd_bwd"] / measured["ms_per_layer_fwd_bwd"], 3)
            if measured["ops_per_layer_unit"] and eager["ops_per_layer_unit"]:
                measured["ops_vs_eager"] = round(measured["ops_per_layer_unit"] / eager["ops_per_layer_unit"], 3)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0 if all("error" not in v for v in result["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
