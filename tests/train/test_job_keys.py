"""Every LlamaFactory key has one fate, and jobs are checked before anything starts
(`harvest train --check`): paths, hub ids, templates against the vocabulary, data files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harvest.train.errors import JobError
from harvest.train.job import load_job
from harvest.train.job_keys import KEY_FATES, Fate, judge, llamafactory_argument_fields, markdown_table
from tests.train.trainer_helpers import DATA_DIR, job_dict

DOCS = Path(__file__).resolve().parents[2] / "docs" / "jobs.md"


def test_every_llamafactory_key_has_a_fate():
    """A LlamaFactory upgrade that adds a key fails here until the key is decided."""
    fields = llamafactory_argument_fields()
    undecided = sorted(set(fields) - set(KEY_FATES))
    assert not undecided, f"LlamaFactory keys with no fate in harvest/train/job_keys.py: {undecided}"
    gone = sorted(set(KEY_FATES) - set(fields))
    assert not gone, f"fates for keys LlamaFactory no longer has: {gone}"
    assert len(fields) > 300  # the walk saw all five argument classes
    assert all(fate.reason for fate in KEY_FATES.values())


def test_docs_table_is_the_registry():
    text = DOCS.read_text()
    assert markdown_table() in text, "docs/jobs.md: regenerate the key table with python -m harvest.train.job_keys"


def test_keys_the_issue_found_ignored_now_have_a_fate():
    named = {"disable_shuffling": Fate.HONOURED, "warmup_steps": Fate.HONOURED, "logging_steps": Fate.HONOURED,
             "plot_loss": Fate.HONOURED, "report_to": Fate.HONOURED, "save_only_model": Fate.HONOURED,
             "loraplus_lr_ratio": Fate.HONOURED, "dataloader_num_workers": Fate.NOTED, "use_galore": Fate.REFUSED,
             "use_apollo": Fate.REFUSED, "use_badam": Fate.REFUSED, "use_adam_mini": Fate.HONOURED}
    assert {key: KEY_FATES[key].fate for key in named} == named


def test_judge_passes_defaults_refuses_and_notes_the_rest():
    fields = llamafactory_argument_fields()
    refusals, notes = judge({"use_dora": False, "streaming": False, "top_k": 50, "deepspeed": None}, fields)
    assert refusals == [] and notes == []  # defaults change nothing
    refusals, notes = judge({"use_dora": True, "top_k": 7, "ddp_timeout": 180000000}, fields)
    assert [key for key, _ in refusals] == ["use_dora"]
    assert refusals[0][1].startswith("use_dora: True is not supported by harvest: ")
    assert [note.split(":")[0] for note in notes] == ["top_k", "ddp_timeout"]


REFUSED_JOBS = [
    ({"use_dora": True}, r"^use_dora: True is not supported by harvest: "),
    ({"deepspeed": "ds_z3_config.json"}, r"^deepspeed: 'ds_z3_config.json' is not supported by harvest: distributed"),
    ({"streaming": True}, r"^streaming: True is not supported by harvest: "),
    ({"tf32": True}, r"^tf32: True is not supported by harvest: a process-wide switch"),
    ({"quantization_bit": 4}, r"^quantization_bit: 4 is not supported by harvest: quantized"),
    ({"use_galore": True}, r"^use_galore: True is not supported by harvest: LlamaFactory refuses"),
    ({"warmup_ratio": 0.1, "warmup_steps": 3}, r"^warmup_ratio and warmup_steps: give one of them"),
    ({"warmup_ratio": 2}, r"^warmup_ratio: must be a number in \[0, 1\)"),
    ({"lr_scheduler_type": "reduce_lr_on_plateau"}, r"^lr_scheduler_type: reduce_lr_on_plateau needs"),
    ({"do_train": False}, r"^do_train: false leaves nothing to do"),
]


@pytest.mark.parametrize("overrides, message", REFUSED_JOBS, ids=[m.split(":")[0].strip("^") for _, m in REFUSED_JOBS])
def test_refused_key_is_named_with_its_reason(overrides, message, tiny_llama_path, tmp_path):
    with pytest.raises(JobError, match=message):
        load_job(job_dict(tiny_llama_path, tmp_path / "out", **overrides))
    assert not (tmp_path / "out").exists()


def test_noted_keys_are_accepted_and_said(tiny_llama_path, tmp_path):
    job = load_job(job_dict(tiny_llama_path, tmp_path / "out", dataloader_num_workers=4, ddp_timeout=180000000,
                            warmup_ratio=0.1))
    assert any(note.startswith("dataloader_num_workers: 4 has no effect in harvest") for note in job.notes)
    assert any(note.startswith("ddp_timeout: 180000000 has no effect") for note in job.notes)
    assert job.training_args.warmup_steps == pytest.approx(0.1)  # warmup_ratio, as transformers 5 spells it


def _write_job(path: Path, **keys) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(keys))
    return path


def test_relative_paths_are_taken_from_the_job_file(tiny_llama_path, tmp_path, monkeypatch):
    jobs = tmp_path / "jobs"
    shutil.copytree(DATA_DIR, jobs / "mydata")
    job_file = _write_job(jobs / "job.yaml", model_name_or_path=str(tiny_llama_path), template="default",
                          dataset="tiny_alpaca", dataset_dir="mydata", output_dir="saves/run", lora_target="all")
    monkeypatch.chdir("/")  # a server's working directory
    job = load_job(job_file)
    assert job.data_args.dataset_dir == str(jobs / "mydata")
    assert job.output_dir == jobs / "saves" / "run"
    assert any("relative to the job file" in note for note in job.notes)


def test_dataset_dir_falls_back_to_the_working_directory(tiny_llama_path, tmp_path, monkeypatch):
    """``llamafactory-cli train examples/train_lora/x.yaml`` run from LlamaFactory's checkout:
    data/ is beside the working directory, not beside the job file."""
    shutil.copytree(DATA_DIR, tmp_path / "data")
    job_file = _write_job(tmp_path / "examples" / "job.yaml", model_name_or_path=str(tiny_llama_path),
                          template="default", dataset="tiny_alpaca", output_dir=str(tmp_path / "out"),
                          lora_target="all")
    monkeypatch.chdir(tmp_path)
    job = load_job(job_file)
    assert job.data_args.dataset_dir == str(tmp_path / "data")
    assert any("relative to the working directory" in note for note in job.notes)


def _fake_hub_cache(cache: Path, repo_id: str, model_dir: Path) -> Path:
    """The layout huggingface_hub leaves after a download: refs/main -> snapshots/<commit>/."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_hub_id_resolves_through_the_local_cache(tiny_llama_path, tmp_path):
    snapshot = _fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", Path(tiny_llama_path))
    job = load_job(job_dict("tiny-org/tiny-llama", tmp_path / "out", cache_dir=str(tmp_path / "hub")))
    assert Path(job.model_args.model_name_or_path) == snapshot
    assert any("found in the Hugging Face cache" in note for note in job.notes)


def test_hub_id_missing_from_the_cache_says_where_it_looked(tmp_path):
    with pytest.raises(JobError, match=r"^model_name_or_path: 'meta-llama/Meta-Llama-3-8B-Instruct' is not a local "
                                       r"model directory .* and not in the local Hugging Face cache; looked in .*"
                                       + str(tmp_path / "hub")):
        load_job(job_dict("meta-llama/Meta-Llama-3-8B-Instruct", tmp_path / "out", cache_dir=str(tmp_path / "hub")))


def test_output_dir_problems_are_named_before_anything_runs(tiny_llama_path, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(JobError, match=r"^output_dir: '.*a_file' is a file, not a folder"):
        load_job(job_dict(tiny_llama_path, a_file))
    with pytest.raises(JobError, match=r"^output_dir: '.*a_file/run' lies below '.*a_file', which is a file"):
        load_job(job_dict(tiny_llama_path, a_file / "run"))
    with pytest.raises(JobError, match=r"^output_dir: '/proc/harvest-run' cannot be written"):
        load_job(job_dict(tiny_llama_path, "/proc/harvest-run"))


def test_template_that_outgrows_the_vocabulary_is_caught_by_the_check(tiny_llama_path, tmp_path):
    from harvest.train.plan import check_job

    # The tiny tokenizer has no <|im_end|>: LlamaFactory adds it and only warns.
    job = load_job(job_dict(tiny_llama_path, tmp_path / "out", template="qwen"))
    with pytest.raises(JobError, match=r"^template: 'qwen' needs tokens the model's vocabulary lacks \(.*<\|im_end\|>"):
        check_job(job)


@pytest.mark.parametrize("content, message", [
    ("[]", r"^dataset: 'broken' has no samples: '.*broken.json' is empty"),
    ("", r"^dataset: 'broken' has no samples: '.*broken.json' is empty"),
    ('[{"instruction": "say hello", "input": "", "output": "hel',
     r"^dataset: \['broken'\] could not be loaded from '.*broken.json': "),
], ids=["empty-list", "empty-file", "truncated"])
def test_bad_data_file_is_named_before_training(content, message, tiny_llama_path, tmp_path):
    from harvest.train.plan import check_job

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps({"broken": {"file_name": "broken.json"}}))
    (tmp_path / "data" / "broken.json").write_text(content)
    with pytest.raises(JobError, match=message):
        check_job(load_job(job_dict(tiny_llama_path, tmp_path / "out", dataset="broken",
                                    dataset_dir=str(tmp_path / "data"))))
    assert not (tmp_path / "out").exists()


def test_check_prints_the_plan_and_writes_nothing(tiny_llama_path, tmp_path, capsys):
    from harvest.cli import main

    job_file = _write_job(tmp_path / "job.yaml", **{k: v for k, v in job_dict(
        tiny_llama_path, tmp_path / "out", max_steps=-1, num_train_epochs=2.0).items() if k != "harvest"})
    assert main(["train", "--check", str(job_file)]) == 0
    out = capsys.readouterr().out
    assert "16 training samples" in out
    assert "8 optimizer steps of 4 samples (4 per epoch, 2.00 epochs)" in out
    assert "start       fresh" in out
    assert not (tmp_path / "out").exists()
    bad = _write_job(tmp_path / "bad.yaml", **{**job_dict(tiny_llama_path, tmp_path / "out"), "use_dora": True,
                                                "harvest": {}})
    assert main(["train", "--check", str(bad)]) == 2
    assert "use_dora: True is not supported by harvest" in capsys.readouterr().err


def test_preprocessing_workers_are_capped_inside_a_server(tiny_llama_path, tmp_path):
    standalone = load_job(job_dict(tiny_llama_path, tmp_path / "out", preprocessing_num_workers=16))
    served = load_job(job_dict(tiny_llama_path, tmp_path / "out", preprocessing_num_workers=16), in_server=True)
    assert standalone.data_args.preprocessing_num_workers == 16
    assert served.data_args.preprocessing_num_workers is None
    assert any(note.startswith("preprocessing_num_workers: 16 is capped to none inside a decode server")
               for note in served.notes)
