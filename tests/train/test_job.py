"""Job definitions: LlamaFactory vocabulary plus a `harvest:` section; every bad input is a
clear error naming the field, raised before any training starts (nothing written)."""

from __future__ import annotations

import json

import pytest

from harvest.train.errors import JobError
from harvest.train.job import HarvestOptions, load_job
from tests.train.trainer_helpers import DATA_DIR, job_dict


def load_and_build(job: dict):
    from harvest.train.build import build_trainer

    return build_trainer(load_job(job))


BAD_JOBS = [
    ({"model_name_or_path": "/nonexistent/model"}, r"^model_name_or_path: '/nonexistent/model' is not a local"),
    ({"dataset": "no_such_set"}, r"^dataset: 'no_such_set' is not defined"),
    ({"dataset_dir": "/nonexistent"}, r"^dataset_dir: '/nonexistent' has no dataset_info.json"),
    ({"template": "no_such_template"}, r"^template: unknown LlamaFactory template 'no_such_template'"),
    ({"lora_target": "no_such_proj"}, r"^lora_target: 'no_such_proj' matches no module"),
    ({"cutoff_len": 0}, r"^cutoff_len: must be an integer > 0, got 0"),
    ({"per_device_train_batch_size": 0}, r"^per_device_train_batch_size: must be an integer > 0"),
    ({"gradient_accumulation_steps": 0}, r"^gradient_accumulation_steps: must be an integer > 0"),
    ({"max_steps": 0}, r"^max_steps: must be a positive integer"),
    ({"learning_rate": -1}, r"^learning_rate: must be a number > 0"),
    ({"finetuning_type": "full"}, r"^finetuning_type: 'full' is not supported"),
    ({"optim": "adamw_bnb_8bit"}, r"^optim: 'adamw_bnb_8bit' is not supported"),
    ({"fp16": True}, r"^fp16: not supported"),
    ({"save_strategy": "epoch"}, r"^save_strategy: 'epoch' is not supported"),
    ({"disable_gradient_checkpointing": False}, r"^disable_gradient_checkpointing: false is not supported"),
    ({"eval_strategy": "steps"}, r"^eval_strategy: 'steps' \(or do_eval\) needs evaluation data"),
    ({"bogus_key": 1}, r"^bogus_key: not a LlamaFactory training argument"),
    ({"harvest": {"bogus": 1}}, r"^unknown key\(s\) harvest\.bogus \(known: micro_batch_size, unit_target_ms, "),
    ({"harvest": {"micro_batch_size": 0}}, r"^harvest\.micro_batch_size=0: expected 'auto' or an integer >= 1; "),
    ({"harvest": {"window_stages": "some"}}, r"^harvest\.window_stages='some': expected 'all' or an integer >= 1; "),
    ({"harvest": {"device": "tpu"}}, r"^harvest\.device='tpu': expected auto, cpu, cuda or cuda:N; "),
    ({"harvest": {"unit_target_ms": 0}}, r"^harvest\.unit_target_ms=0: expected 'auto' or a finite number > 0\.0; "),
    ({"harvest": {"microbatches_per_pass": "auto"}}, r"^harvest\.microbatches_per_pass='auto': expected an integer >= 1; "),
    ({"harvest": {"memory_budget_mb": 0.05}}, r"^harvest.memory_budget_mb: 0.05 MiB cannot hold the trainer's"),
]


@pytest.mark.parametrize("overrides, message", BAD_JOBS, ids=[m.split(":")[0].strip("^") for _, m in BAD_JOBS])
def test_bad_job_is_refused_naming_the_field(overrides, message, tiny_llama_path, tmp_path):
    job = job_dict(tiny_llama_path, tmp_path / "out", **overrides)
    with pytest.raises(JobError, match=message):
        load_and_build(job)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_dataset_file_missing_is_named(tiny_llama_path, tmp_path):
    (tmp_path / "dataset_info.json").write_text(json.dumps({"gone": {"file_name": "gone.json"}}))
    job = job_dict(tiny_llama_path, tmp_path / "out", dataset="gone", dataset_dir=str(tmp_path))
    with pytest.raises(JobError, match=r"^dataset: 'gone' points to 'gone.json', which does not exist"):
        load_job(job)


def test_yaml_job_file_reads_numbers_like_llamafactory(tiny_llama_path, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(f"""
model_name_or_path: {tiny_llama_path}
template: default
dataset: tiny_alpaca
dataset_dir: {DATA_DIR}
lora_target: all
learning_rate: 1e-4
output_dir: {tmp_path / 'out'}
harvest:
  micro_batch_size: auto
  window_stages: 2
  memory_budget_mb: 64
""")
    job = load_job(path)
    assert job.training_args.learning_rate == pytest.approx(1e-4)
    assert job.harvest == HarvestOptions(micro_batch_size=None, window_stages=2, memory_budget_mb=64.0)
    assert job.model_args.model_name_or_path == str(tiny_llama_path)
    with pytest.raises(JobError, match="does not exist"):
        load_job(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("model_name_or_path: [unclosed\n")
    with pytest.raises(JobError, match="not valid YAML"):
        load_job(tmp_path / "broken.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(JobError, match="must be a mapping"):
        load_job(tmp_path / "list.yaml")


def test_a_bad_field_in_a_job_file_names_the_file(tiny_llama_path, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({**job_dict(tiny_llama_path, tmp_path / "out"), "lora_rank": -1}))
    with pytest.raises(JobError, match=rf"^job file '{path}': lora_rank: must be an integer > 0, got -1$"):
        load_job(path)


def test_memory_budget_sets_the_window(tiny_llama_path, tmp_path):
    """A budget that holds the resident LoRA state plus two stages gives W = 2."""
    probe = load_and_build(job_dict(tiny_llama_path, tmp_path / "probe"))
    stage_bytes = sorted(probe.window.stage_bytes(), reverse=True)
    resident = 4 * sum(p.numel() * 4 for p in probe.trainable_params)
    budget_mb = (resident + stage_bytes[0] + stage_bytes[1] + 1024) / 2**20
    trainer = load_and_build(job_dict(tiny_llama_path, tmp_path / "out", harvest={"memory_budget_mb": budget_mb}))
    assert trainer.window.capacity == 2
    trainer.run_one_unit()
    assert trainer.window.held_bytes <= stage_bytes[0] + stage_bytes[1]


def test_auto_micro_batch_size_is_measured_within_the_job_batch(tiny_llama_path, tmp_path):
    trainer = load_and_build(job_dict(tiny_llama_path, tmp_path / "out", harvest={"micro_batch_size": "auto"}))
    assert 1 <= trainer.micro_batch_size <= 4
    tiny = load_and_build(job_dict(tiny_llama_path, tmp_path / "tiny",
                                   harvest={"micro_batch_size": "auto", "unit_target_ms": 1e-6}))
    assert tiny.micro_batch_size == 1  # a target no unit can meet: the smallest micro-batch


def test_cli_reports_bad_job_with_exit_code_2(tiny_llama_path, tmp_path, capsys):
    from harvest import cli

    path = tmp_path / "job.yaml"
    path.write_text(f"model_name_or_path: {tiny_llama_path}\ndataset: tiny_alpaca\ndataset_dir: {DATA_DIR}\n"
                    f"output_dir: {tmp_path / 'out'}\ncutoff_len: 0\n")
    assert cli.main(["train", str(path)]) == 2
    assert "cutoff_len: must be an integer > 0" in capsys.readouterr().err


@pytest.mark.parametrize("micro_batch_size, noted", [(1, True), (2, False), ("auto", False)])
def test_padding_that_carries_loss_with_another_split_is_noted(micro_batch_size, noted, tiny_llama_path, tmp_path):
    job = load_job(job_dict(tiny_llama_path, tmp_path, ignore_pad_token_for_loss=False,
                            harvest={"micro_batch_size": micro_batch_size}))
    notes = [n for n in job.notes if n.startswith("ignore_pad_token_for_loss: false")]
    assert len(notes) == int(noted)
    if noted:
        assert "micro_batch_size 1 and per_device_train_batch_size 2" in notes[0] and "differs" in notes[0]
