"""`harvest train --check` and the build refuse the same jobs with the same message: both
run harvest.train.plan.ready_job, and the build runs it before the model loads.

Each row is a job change and/or an output_dir set-up; `check_job` (what --check, harvest
launch, the plugin's pre-flight and ``harvest ctl submit`` run) must raise the row's
message, and `build_trainer` the same message, without loading the model (the loader is
replaced by one that fails the test)."""

from __future__ import annotations

import hashlib
import json
import re
import types
from pathlib import Path

import pytest
import torch
import yaml

from harvest.train.errors import CheckpointError, JobError
from tests.train.trainer_helpers import job_dict

FLEET = {"rendezvous": "127.0.0.1:29599", "job_id": "agree"}


def _checkpoint(output_dir: Path, step: int, job: dict, *, torn: bool = False, corrupt: bool = False,
                model_only: bool = False) -> None:
    """A checkpoint-``step`` as save_checkpoint lays it out (placeholder tensors: neither the
    check nor the build reads them before refusing), written by ``job``."""
    from harvest.train.checkpoint import FORMAT_VERSION, STATE_FILE
    from harvest.train.job import load_job

    path = output_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    names = ["adapter_config.json", "adapter_model.safetensors"]
    names += [] if model_only else ["optimizer.pt", "scheduler.pt", "rng_state.pth"]
    for name in names:
        (path / name).write_bytes(name.encode())
    sha = {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in names}
    if corrupt:
        (path / "adapter_model.safetensors").write_bytes(b"edited")
    if torn:
        return
    state = {"format_version": FORMAT_VERSION, "global_step": step, "job": load_job(job).fingerprint(),
             "model_only": model_only, "sha256": sha, "micro_batch_size": 2, "total_steps": 4}
    (path / STATE_FILE).write_text(json.dumps(state, sort_keys=True))


def _written_by(**overrides):
    """An output_dir set-up: checkpoint-2 of the default job changed by ``overrides``."""
    def setup(model, out):
        _checkpoint(out, 2, job_dict(model, out, **overrides))
    return setup


def _no_cuda_device(name: str) -> str:
    if not torch.cuda.is_available():
        return rf"^harvest\.device: '{name}' requested but CUDA is not available here$"
    return rf"^harvest\.device: '{name}' requested but this process sees \d+ CUDA device\(s\)"


# (id, job changes, output_dir set-up (model, out) or None, tensor-parallel ranks, message)
ROWS = [
    # load_job: single keys, before anything else (every caller runs it first)
    ("fp16", {"fp16": True}, None, 1, r"^fp16: not supported by the layer-split trainer"),
    ("learning_rate too high", {"learning_rate": 1e30}, None, 1,
     r"^learning_rate: 1e\+30 is above 1\.0, beyond any rate a LoRA finetune trains at"),
    ("learning_rate infinite", {"learning_rate": float("inf")}, None, 1, r"^learning_rate: must be a finite number"),
    ("output_dir is a file", {}, lambda model, out: out.write_text("x"), 1, r"^output_dir: '.*out' is a file"),
    # ready_job: the device
    ("device index", {"harvest": {"device": "cuda:99"}}, None, 1, _no_cuda_device("cuda:99")),
    # ready_job: what a tensor-parallel trainer cannot run
    ("tp optim", {"optim": "adafactor"}, None, 2, r"^optim: 'adafactor' does not update a shard"),
    ("tp muon", {"use_muon": True}, None, 2, r"^use_muon: not supported with tensor parallelism"),
    ("tp unshardable model", {}, None, 3, r"^model_name_or_path: 4 attention heads do not split over 3"),
    # ready_job: what a fleet member cannot run
    ("fleet on tp", {"harvest": {"fleet": FLEET}}, None, 2, r"^harvest\.fleet: a fleet job on a tensor-parallel"),
    ("fleet overwrite", {"harvest": {"fleet": FLEET}, "overwrite_output_dir": True}, None, 1,
     r"^overwrite_output_dir: a fleet's members share output_dir"),
    ("fleet eval", {"harvest": {"fleet": FLEET}, "eval_strategy": "steps", "eval_steps": 2, "val_size": 0.2}, None, 1,
     r"^eval_strategy: evaluation during a fleet job is not supported"),
    ("fleet without id", {"harvest": {"fleet": {"rendezvous": "127.0.0.1:29599"}}}, None, 1,
     r"^harvest\.fleet\.job_id: a job that is not read from a file needs a job_id"),
    # ready_job: template against the vocabulary, the data
    ("template vocabulary", {"template": "qwen"}, None, 1, r"^template: 'qwen' needs tokens the model's vocabulary"),
    ("data file truncated", {"dataset": "broken"}, "truncated data", 1,
     r"^dataset: \['broken'\] could not be loaded from '.*broken\.json'"),
    # ready_job: the checkpoint the run would resume, against the job's fingerprint
    ("checkpoint of another job", {"lora_rank": 8}, _written_by(), 1,
     r"checkpoint-2' was written by a different job: lora_rank was 4, the job says 8; refusing to resume$"),
    ("checkpoint of another rate", {}, _written_by(learning_rate=5e-4), 1,
     r"written by a different job: learning_rate was 0\.0005, the job says 0\.001"),
    ("checkpoint beyond the steps", {}, lambda model, out: _checkpoint(out, 12, job_dict(model, out)), 1,
     r"checkpoint-12' is at step 12, beyond this job's 4 steps"),
    ("checkpoint torn", {}, lambda model, out: _checkpoint(out, 2, job_dict(model, out), torn=True), 1,
     r"checkpoint-2' has no harvest_state\.json"),
    ("checkpoint corrupt", {}, lambda model, out: _checkpoint(out, 2, job_dict(model, out), corrupt=True), 1,
     r"checkpoint-2' is corrupt: adapter_model\.safetensors does not match"),
    ("checkpoint model only", {}, lambda model, out: _checkpoint(out, 2, job_dict(model, out), model_only=True), 1,
     r"checkpoint-2' was saved with save_only_model: true"),
]


def _truncated_data(tmp_path: Path) -> dict:
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({"broken": {"file_name": "broken.json"}}))
    (data / "broken.json").write_text('[{"instruction": "say hello", "input": "", "output": "hel')
    return {"dataset_dir": str(data)}


def _refusal(run) -> Exception:
    with pytest.raises((JobError, CheckpointError)) as refused:
        run()
    return refused.value


@pytest.fixture
def no_model_load(monkeypatch):
    """The build may not get as far as loading the model."""
    import llamafactory.model

    def load_model(*args, **kwargs):
        raise AssertionError("the build loaded the model before refusing")

    monkeypatch.setattr(llamafactory.model, "load_model", load_model)


@pytest.mark.parametrize("changes, setup, tp_size, message", [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_check_and_build_refuse_alike(changes, setup, tp_size, message, tiny_llama_path, tmp_path, no_model_load):
    from harvest.train.build import build_trainer
    from harvest.train.job import load_job
    from harvest.train.plan import check_job

    out = tmp_path / "out"
    if setup == "truncated data":
        changes = {**changes, **_truncated_data(tmp_path)}
    elif setup is not None:
        setup(tiny_llama_path, out)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    checked = _refusal(lambda: check_job(load_job(job_dict(tiny_llama_path, out, **changes)), tp_size=tp_size))
    tp = types.SimpleNamespace(size=tp_size, rank=0) if tp_size > 1 else None
    built = _refusal(lambda: build_trainer(load_job(job_dict(tiny_llama_path, out, **changes)), tp=tp))
    assert re.search(message, str(checked)), str(checked)
    assert (type(built), str(built)) == (type(checked), str(checked))
    assert "\n" not in str(checked)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written or removed


def test_a_fine_job_passes_both_and_resumes_its_own_checkpoint(tiny_llama_path, tmp_path, no_model_load):
    """The other side of the table: what the check accepts the build takes to the model load."""
    from harvest.train.build import build_trainer
    from harvest.train.job import load_job
    from harvest.train.plan import check_job

    out = tmp_path / "out"
    _checkpoint(out, 2, job_dict(tiny_llama_path, out))
    plan = check_job(load_job(job_dict(tiny_llama_path, out)))
    assert plan.start == f"resumes from {out / 'checkpoint-2'} at step 2"
    with pytest.raises(AssertionError, match="the build loaded the model"):
        build_trainer(load_job(job_dict(tiny_llama_path, out)))


def _job_file(tmp_path: Path, model, **changes) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_dict(model, tmp_path / "out", **changes)))
    return path


@pytest.mark.parametrize("case", ["device", "checkpoint"])
@pytest.mark.parametrize("check", [True, False], ids=["--check", "train"])
def test_harvest_train_refuses_in_one_line_naming_file_and_field(case, check, tiny_llama_path, tmp_path, capsys,
                                                                  no_model_load):
    from harvest.cli import main

    if case == "device":
        job = _job_file(tmp_path, tiny_llama_path, harvest={"device": "cuda:99"})
        expected = _no_cuda_device("cuda:99").lstrip("^")
    else:
        _checkpoint(tmp_path / "out", 4, job_dict(tiny_llama_path, tmp_path / "out"))
        job = _job_file(tmp_path, tiny_llama_path, lora_rank=8)
        expected = (rf"checkpoint '{re.escape(str(tmp_path / 'out' / 'checkpoint-4'))}' was written by a different "
                    r"job: lora_rank was 4, the job says 8; refusing to resume$")
    rc = main(["train", *(["--check"] if check else []), "--no-progress", str(job)])
    captured = capsys.readouterr()
    ours = [line for line in captured.err.splitlines() if line.startswith("harvest train:")]
    assert rc == 2 and len(ours) == 1 and "Traceback" not in captured.err, captured.err
    assert re.match(rf"harvest train: job file '{re.escape(str(job))}': {expected}", ours[0]), ours[0]
    assert "ready to train" not in captured.out
