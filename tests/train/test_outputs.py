"""What a job leaves in output_dir is what LlamaFactory's tools read (trainer_log.jsonl,
trainer_state.json, training_loss.png), rolled back on resume; a diverging run stops at
the bad step keeping the last good checkpoint; checkpoints of another run never resume."""

from __future__ import annotations

import json
import math
import sys

import pytest

from harvest.train.errors import CheckpointError, JobError, TrainingDiverged
from harvest.train.gate import Gate
from tests.train.trainer_helpers import build, job_dict, log_lines, stop_after_units

LLAMAFACTORY_LOG_KEYS = {"current_steps", "total_steps", "loss", "lr", "epoch", "percentage", "elapsed_time",
                         "remaining_time"}


def test_log_and_state_in_llamafactory_format(tiny_llama_path, tmp_path):
    out = tmp_path / "out"
    trainer = build(tiny_llama_path, out, max_steps=6, logging_steps=2, plot_loss=True)
    losses = {}
    trainer.step_callbacks.append(lambda entry: losses.__setitem__(entry["step"], entry["loss"]))
    assert trainer.run(Gate()) == "finished"
    trainer.close()

    lines = log_lines(out)
    assert [line["current_steps"] for line in lines] == [2, 4, 6]
    assert all(LLAMAFACTORY_LOG_KEYS <= set(line) for line in lines)
    assert lines[0]["loss"] == pytest.approx((losses[1] + losses[2]) / 2, abs=1e-9)  # mean since the last line
    assert lines[-1]["total_steps"] == 6 and lines[-1]["percentage"] == 100.0

    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 6 and state["max_steps"] == 6
    assert [entry["step"] for entry in state["log_history"]] == [2, 4, 6]
    assert {"loss", "learning_rate", "grad_norm", "epoch"} <= set(state["log_history"][0])
    checkpoint_state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert checkpoint_state["global_step"] == 4 and len(checkpoint_state["log_history"]) == 2
    harvest_state = json.loads((out / "checkpoint-4" / "harvest_state.json").read_text())
    assert "trainer_state.json" in harvest_state["sha256"]  # verified on resume like the rest
    assert (out / "training_loss.png").stat().st_size > 1000  # LlamaFactory's plot_loss


def test_logging_strategy_no_and_first_step(tiny_llama_path, tmp_path):
    trainer = build(tiny_llama_path, tmp_path / "a", max_steps=4, logging_steps=3, logging_first_step=True)
    trainer.run(Gate())
    trainer.close()
    assert [line["current_steps"] for line in log_lines(tmp_path / "a")] == [1, 3]
    trainer = build(tiny_llama_path, tmp_path / "b", max_steps=2, logging_strategy="no")
    trainer.run(Gate())
    trainer.close()
    assert not (tmp_path / "b" / "trainer_log.jsonl").exists() or log_lines(tmp_path / "b") == []


def test_resume_rolls_the_log_back_to_the_checkpoint(tiny_llama_path, tmp_path):
    out = tmp_path / "out"
    overrides = dict(max_steps=6, save_steps=2)
    first = build(tiny_llama_path, out, **overrides)
    units_per_step = len(first._plan(2))
    # Steps 1-3 complete, step 4 half done; the stop checkpoints step 3.
    assert first.run(stop_after_units(3 * units_per_step + 3)) == "stopped"
    first.close()
    assert [line["current_steps"] for line in log_lines(out)] == [1, 2, 3]
    # Lose checkpoint-3 (as a kill would have): the log has a step the resume will redo.
    import shutil

    shutil.rmtree(out / "checkpoint-3")
    resumed = build(tiny_llama_path, out, **overrides)
    assert resumed.global_step == 2
    assert [line["current_steps"] for line in log_lines(out)] == [1, 2]  # rolled back before training
    assert resumed.run(Gate()) == "finished"
    resumed.close()
    assert [line["current_steps"] for line in log_lines(out)] == [1, 2, 3, 4, 5, 6]
    state = json.loads((out / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"]] == [1, 2, 3, 4, 5, 6]


def _diverging(trainer, rate: float = 1e30):
    """``trainer`` with a learning rate no job may set (load_job refuses it), so that its
    first updates overflow the weights: what a bad rate did before the check refused it."""
    for group in trainer.optimizer.param_groups:
        group["lr"] = rate
    trainer.scheduler.base_lrs = [rate] * len(trainer.optimizer.param_groups)
    return trainer


def test_non_finite_loss_stops_before_the_update_keeping_the_last_good_step(tiny_llama_path, tmp_path):
    out = tmp_path / "out"
    trainer = _diverging(build(tiny_llama_path, out, max_steps=20, save_steps=100, max_grad_norm=0.0,
                               harvest={"window_stages": "all"}))
    with pytest.raises(TrainingDiverged, match=r"^learning_rate: step (\d+) has a non-finite loss") as diverged:
        trainer.run(Gate())
    bad_step = int(diverged.value.args[0].split("step ")[1].split(" ")[0])
    assert trainer.global_step == bad_step - 1 >= 1
    params = [p for p in trainer.split.peft_model.parameters() if p.requires_grad]
    assert all(bool(p.isfinite().all()) for p in params)  # the bad update never happened
    from safetensors.torch import load_file

    saved = load_file(str(out / f"checkpoint-{bad_step - 1}" / "adapter_model.safetensors"))
    assert all(bool(t.isfinite().all()) for t in saved.values())
    assert all(math.isfinite(line["loss"]) for line in log_lines(out))


def test_a_non_finite_loss_before_any_update_names_the_model_not_the_learning_rate(tiny_llama_path, tmp_path):
    trainer = build(tiny_llama_path, tmp_path / "out", max_steps=4, save_steps=100, harvest={"window_stages": "all"})
    trainer.window.source.tensor("model.norm.weight").fill_(float("nan"))  # the frozen weights the window copies in
    with pytest.raises(TrainingDiverged, match=r"^model_name_or_path: step 1 has a non-finite loss \(nan\) before "
                                               r"any weight was updated, so not because of learning_rate"):
        trainer.run(Gate())
    assert trainer.global_step == 0 and not (tmp_path / "out" / "checkpoint-1").exists()


def test_harvest_train_exits_nonzero_on_divergence(tiny_llama_path, tmp_path, capsys, monkeypatch):
    import yaml

    from harvest.cli import main
    from harvest.train import build as build_module

    built = build_module.build_trainer
    monkeypatch.setattr(build_module, "build_trainer", lambda job, **kwargs: _diverging(built(job, **kwargs)))
    job = job_dict(tiny_llama_path, tmp_path / "out", max_steps=20, max_grad_norm=0.0)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["train", "--no-progress", str(tmp_path / "job.yaml")]) == 3
    err = capsys.readouterr().err
    assert "learning_rate: step" in err and "non-finite loss" in err and "Traceback" not in err, err


def test_stale_checkpoints_of_an_older_run(tiny_llama_path, tmp_path):
    """The issue's case: a longer run left checkpoint-9 and -12; a 6-step run with
    overwrite_output_dir removes them, and the next run without overwrite resumes from
    its own checkpoint, never 'at step 12 of 6'."""
    out = tmp_path / "out"
    old = build(tiny_llama_path, out, max_steps=12, save_steps=3)
    old.run(Gate())
    old.close()
    assert (out / "checkpoint-12").is_dir() and (out / "checkpoint-9").is_dir()

    # Without overwrite, the 6-step job would resume from checkpoint-12: refused, named.
    with pytest.raises(CheckpointError, match=r"checkpoint-12' is at step 12, beyond this job's 6 steps"):
        build(tiny_llama_path, out, max_steps=6, save_steps=3)
    from harvest.train.job import load_job
    from harvest.train.plan import check_job

    with pytest.raises(CheckpointError, match=r"beyond this job's 6 steps"):  # --check says it too
        check_job(load_job(job_dict(tiny_llama_path, out, max_steps=6, save_steps=3)))

    fresh = build(tiny_llama_path, out, max_steps=6, save_steps=3, overwrite_output_dir=True)
    assert fresh.global_step == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == []  # removed before this run writes
    fresh.run(stop_after_units(4 * len(fresh._plan(2)) + 1))  # stops during step 5: checkpoint-4
    fresh.close()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]

    resumed = build(tiny_llama_path, out, max_steps=6, save_steps=3)
    assert resumed.global_step == 4
    assert resumed.run(Gate()) == "finished"
    resumed.close()
    assert [line["current_steps"] for line in log_lines(out)] == [1, 2, 3, 4, 5, 6]


def test_checkpoint_of_a_different_job_definition_is_refused(tiny_llama_path, tmp_path):
    out = tmp_path / "out"
    first = build(tiny_llama_path, out, max_steps=2)
    first.run(Gate())
    first.close()
    with pytest.raises(CheckpointError, match=r"written by a different job: learning_rate was 0.001"):
        build(tiny_llama_path, out, max_steps=4, learning_rate=5e-4)


def test_save_only_model_checkpoints_hold_the_adapter_and_refuse_to_resume(tiny_llama_path, tmp_path):
    out = tmp_path / "out"
    trainer = build(tiny_llama_path, out, max_steps=4, save_only_model=True)
    trainer.run(stop_after_units(2 * len(trainer._plan(2)) + 1))
    trainer.close()
    files = {p.name for p in (out / "checkpoint-2").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.json"} <= files
    assert not files & {"optimizer.pt", "scheduler.pt", "rng_state.pth"}
    with pytest.raises(CheckpointError, match=r"saved with save_only_model: true .* cannot be resumed exactly"):
        build(tiny_llama_path, out, max_steps=4, save_only_model=True)


def test_report_to_a_reporter_that_is_not_installed_is_refused(tiny_llama_path, tmp_path):
    from harvest.train.job import load_job

    pytest.importorskip("transformers")
    if "tensorboard" in sys.modules or _installed("tensorboard") or _installed("tensorboardX"):
        pytest.skip("tensorboard is installed here")
    with pytest.raises(JobError, match=r"^report_to: TensorBoardCallback cannot report here: .*tensorboard"):
        load_job(job_dict(tiny_llama_path, tmp_path / "out", report_to="tensorboard"))
    assert not (tmp_path / "out").exists()


def test_installed_reporter_receives_the_logs(tiny_llama_path, tmp_path, monkeypatch):
    """report_to drives Hugging Face's reporter callbacks; a registered one gets every log."""
    from transformers import TrainerCallback
    from transformers.integrations import integration_utils

    received = []

    class RecordingReporter(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            received.append((state.global_step, dict(logs)))

    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, "recording", RecordingReporter)
    trainer = build(tiny_llama_path, tmp_path / "out", max_steps=3, report_to="recording")
    trainer.run(Gate())
    trainer.close()
    assert [step for step, _ in received] == [1, 2, 3]
    assert all("loss" in logs and "learning_rate" in logs for _, logs in received)


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
