"""A LoRA job trained by the tensor-parallel trainer on N ranks against the same job on one.

    python -m tests.train.tp_parity --tp 2 --device cpu [--fault-rank 1] [--builder peft] --json

Rank processes (torch.multiprocessing, gloo on CPU, NCCL on CUDA) each build the job
(through LlamaFactory; or, ``--builder peft``, as plain PEFT over harvest's tiny Llama
with synthetic tokens, for machines without LlamaFactory such as the GPU one) and keep
their shard; rank 0 writes the checkpoints and the final
adapter, which must equal the tp = 1 run's (loss per step and adapter tensors, 1e-5).
With ``--fault-rank R`` rank R's trainer raises after a few units and every other rank's
trainer must leave with PeerTrainerFault (told by a shared event, as the runtime's step
agreement tells it). Used by tests/train/test_tensor_parallel.py and by the GPU
validation script's tp = 2 part.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

FAULT_AFTER_UNITS = 7


def _job(model_path, output_dir, device: str, steps: int = 4, **overrides) -> dict:
    from tests.train.trainer_helpers import job_dict

    job_file = os.environ.get("HARVEST_TP_PARITY_JOB")  # a job file of one's own instead
    if job_file:
        import yaml

        job = yaml.safe_load(Path(job_file).read_text())
        job.update(output_dir=str(output_dir), max_steps=steps, save_steps=steps)
        job.setdefault("harvest", {})["device"] = device
        return job
    return job_dict(model_path, output_dir, max_grad_norm=0.05, harvest={"micro_batch_size": 2, "device": device},
                    max_steps=steps, save_steps=steps, **overrides)


def _peft_trainer(job: dict, tp=None):
    """The job's shape without LlamaFactory: harvest's tiny Llama with PEFT LoRA on every
    projection, synthetic tokens, the same optimizer settings."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from harvest.train.build import TrainerSettings, assemble_trainer
    from harvest.train.job import HarvestOptions

    torch.manual_seed(job["seed"])  # LoRA A's initial values: the same in every process, as LlamaFactory seeds
    model = AutoModelForCausalLM.from_pretrained(job["model_name_or_path"], dtype=torch.float32)
    model.requires_grad_(False)
    lora = LoraConfig(r=job["lora_rank"], lora_alpha=job["lora_alpha"], lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, lora)
    batch = job["per_device_train_batch_size"] * job["gradient_accumulation_steps"]
    tokens = torch.randint(5, 400, (batch * job["max_steps"], 48), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids} for ids in tokens]

    def collate(features):
        return {key: torch.stack([f[key] for f in features]) for key in ("input_ids", "attention_mask", "labels")}

    settings = TrainerSettings(samples_per_step=batch, learning_rate=job["learning_rate"], seed=job["seed"],
                               max_steps=job["max_steps"], max_grad_norm=job["max_grad_norm"],
                               output_dir=Path(job["output_dir"]))
    options = HarvestOptions(micro_batch_size=job["harvest"]["micro_batch_size"], device=job["harvest"]["device"])
    return assemble_trainer(peft_model, dataset, collate, settings, options, device=job["harvest"]["device"], tp=tp)


def _train(job: dict, tp=None, gate=None, builder: str = "llamafactory") -> tuple:
    from harvest.train.build import build_trainer
    from harvest.train.gate import Gate
    from harvest.train.job import load_job
    from tests.train.trainer_helpers import randomize_lora_b

    trainer = build_trainer(load_job(job), tp=tp) if builder == "llamafactory" else _peft_trainer(job, tp)
    # LoRA B starts at zero (every LoRA A gradient would be zero): the same values on every
    # rank, drawn whole and split.
    with trainer._whole():
        randomize_lora_b(trainer)
    entries = []
    trainer.step_callbacks.append(entries.append)
    started = time.perf_counter()
    trainer.run(gate or Gate())
    return trainer, entries, time.perf_counter() - started


def _rank_main(rank: int, size: int, store_file: str, model_path: str, output_dir: str, device: str, fault_rank: int,
               result_dir: str, fault_event, builder: str, steps: int) -> None:
    import datetime

    import torch.distributed as dist

    from harvest.colocate.job_gates import FaultInjectingGate
    from harvest.train.gate import Gate
    from harvest.train.tensor_parallel import PeerTrainerFault, TensorParallel

    os.environ.update(HF_HUB_OFFLINE="1", DISABLE_VERSION_CHECK="1")
    cuda = device.startswith("cuda")
    if cuda:
        import torch

        torch.cuda.set_device(rank)
    # A file store: the ranks meet without a TCP port picked in advance (one picked free and
    # bound again by the spawned rank 0 a few seconds later may be taken meanwhile).
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store_file}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(minutes=5))
    group = dist.new_group(list(range(size)), backend="nccl" if cuda else "gloo")
    control = dist.new_group(list(range(size)), backend="gloo") if cuda else None
    tp = TensorParallel(rank, size, group, control_group=control)
    rank_device = f"cuda:{rank}" if cuda else "cpu"
    result = {"rank": rank}
    gate = Gate()
    if rank == fault_rank:
        gate = FaultInjectingGate(gate, FAULT_AFTER_UNITS)
    elif fault_rank >= 0:
        def watch():  # the runtime's step agreement, in miniature
            fault_event.wait()
            tp.abort(f"rank {fault_rank}'s trainer faulted")
        threading.Thread(target=watch, daemon=True).start()
    try:
        trainer, entries, seconds = _train(_job(model_path, output_dir, rank_device, steps), tp, gate, builder)
        result.update(outcome="finished", losses=[e["loss"] for e in entries],
                      grad_norms=[e["grad_norm"] for e in entries], seconds=seconds, agree_wait_s=tp.waited_s,
                      checkpoint_step=trainer.stats().checkpoint_step)
    except PeerTrainerFault as exc:
        result.update(outcome="peer_fault", error=str(exc))
    except Exception as exc:  # noqa: BLE001 - the injected fault
        result.update(outcome="fault", error=f"{type(exc).__name__}: {exc}")
        fault_event.set()
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(result))
    if fault_rank < 0:
        dist.destroy_process_group()
        return
    # Leave only once every rank has its outcome: this process's end closes its connections,
    # which fails a peer's pending operation, and the outcome measured here is the one the
    # peer's runtime decides from its step agreement (the product gives that one a moment,
    # TensorParallel._ABORT_GRACE_S, but the test does not lean on that alone).
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not all(Path(result_dir, f"rank{r}.json").exists() for r in range(size)):
        time.sleep(0.05)
    os._exit(0)  # a group with an abandoned operation: no orderly teardown


def _adapter(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def default_builder() -> str:
    import importlib.util

    return "llamafactory" if importlib.util.find_spec("llamafactory") is not None else "peft"


def check(tp: int, device: str = "cpu", fault_rank: int = -1, work_dir: Path | None = None,
          builder: str | None = None, steps: int = 4, family: str = "llama") -> dict:
    """Train on ``tp`` ranks and on one; return the comparison (and timings). ``family``:
    harvest's tiny "llama" or "qwen2" (q/k/v biases, split with their rows). Without
    ``work_dir`` the work goes to a temporary folder, removed afterwards."""
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="harvest-tp-") as scratch:
            return check(tp, device, fault_rank, Path(scratch), builder, steps, family)
    builder = builder or default_builder()
    import torch.multiprocessing as mp

    from harvest.tiny_model import TINY_LLAMA, TINY_QWEN2, ensure_tiny_model

    model_path = ensure_tiny_model({"llama": TINY_LLAMA, "qwen2": TINY_QWEN2}[family])
    work = Path(work_dir)
    report: dict = {"tp": tp, "device": device, "builder": builder, "family": family}
    if fault_rank < 0:
        ref_device = "cuda:0" if device.startswith("cuda") else "cpu"
        _, ref_entries, ref_s = _train(_job(model_path, work / "tp1", ref_device, steps), builder=builder)
        report["tp1_losses"] = [e["loss"] for e in ref_entries]
        report["tp1_seconds"] = round(ref_s, 3)
    results = work / "results"
    results.mkdir(parents=True, exist_ok=True)
    context = mp.get_context("spawn")
    fault_event = context.Event()
    store_file = Path(tempfile.mkdtemp(prefix="store-", dir=work)).resolve() / "store"
    procs = [context.Process(target=_rank_main, args=(r, tp, str(store_file), str(model_path), str(work / f"tp{tp}"),
                                                     device, fault_rank, str(results), fault_event, builder, steps))
             for r in range(tp)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=600)
        if proc.is_alive():
            proc.kill()
    ranks = {}
    for r in range(tp):
        path = results / f"rank{r}.json"
        ranks[r] = json.loads(path.read_text()) if path.exists() else {"outcome": "no result (hung or crashed)"}
    report["outcomes"] = {str(r): ranks[r]["outcome"] for r in ranks}
    if fault_rank >= 0:
        report["errors"] = {str(r): ranks[r].get("error") for r in ranks}
        return report
    losses = ranks[0].get("losses", [])
    report["tp_losses"] = losses
    report["tp_seconds"] = round(ranks[0].get("seconds", float("nan")), 3)
    report["ranks_agree_on_losses"] = all(ranks[r].get("losses") == losses for r in ranks)
    # Rank 0 writes; every rank's trainer returns from a checkpoint only once it is on disk.
    report["checkpoint_step_by_rank"] = [ranks[r].get("checkpoint_step") for r in sorted(ranks)]
    report["max_loss_diff"] = max((abs(a - b) for a, b in zip(losses, report["tp1_losses"])), default=float("inf"))
    if len(losses) != len(report["tp1_losses"]):
        report["max_loss_diff"] = float("inf")
    ref, got = _adapter(work / "tp1"), _adapter(work / f"tp{tp}")
    report["adapter_keys_equal"] = sorted(ref) == sorted(got)
    report["max_adapter_diff"] = max((float((ref[k].float() - got[k].float()).abs().max()) for k in ref if k in got),
                                     default=float("inf"))
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fault-rank", type=int, default=-1)
    parser.add_argument("--builder", choices=["llamafactory", "peft"], default=None,
                        help="how each rank builds the job (default: llamafactory when installed)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--family", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < args.tp:
            # The tp = 2 part of the GPU validation on a one-GPU machine: nothing to measure.
            print(json.dumps({"tp": args.tp, "device": args.device,
                              "skipped": f"needs {args.tp} GPUs (one per rank), this machine has {found}"}))
            return 0
    report = check(args.tp, args.device, args.fault_rank, builder=args.builder, steps=args.steps,
                   family=args.family)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    if args.fault_rank >= 0:
        others = [o for r, o in report["outcomes"].items() if int(r) != args.fault_rank]
        return 0 if report["outcomes"][str(args.fault_rank)] == "fault" and all(o == "peer_fault" for o in others) else 1
    ok = report["max_loss_diff"] <= 1e-5 and report["max_adapter_diff"] <= 1e-5 and report["adapter_keys_equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
