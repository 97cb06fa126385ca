"""The trainer host's job queue without a server: jobs share the trainer by weight, one
unit at a time; submissions start without a restart; cancel, stop and faults end one job
or all, each with its checkpoint."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from harvest.colocate.job_queue import JobRefused, JobSpec
from harvest.colocate.trainer_host import TrainerHost
from harvest.schedule import TrainerState
from harvest.train.gate import GateAction
from tests.metrics.test_control import wait_for as wait_until

pytestmark = pytest.mark.timeout(120)


class Units:
    """Counts the units running at once across every fake trainer (must never exceed 1)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0


class FakeTrainer:
    """Runs ``total_steps`` units of ``unit_s`` (busy-waiting, as compute does) through
    its gate; reports progress like LayerSplitTrainer."""

    def __init__(self, units: Units, total_steps: int = 10**9, unit_s: float = 0.002, resumed_tokens: int = 0,
                 tokens_per_step: int = 10, micro_batch_size: int = 0):
        self.units = units
        self.total_steps = total_steps
        self.unit_s = unit_s
        self.global_step = 0
        self.tokens = resumed_tokens
        self.tokens_per_step = tokens_per_step
        self.micro_batch_size = micro_batch_size  # 0: reports no samples (one micro-batch of 1 per step otherwise)
        self.samples = 0
        self.checkpointed = False
        self.output_dir = None

    def stats(self):
        from harvest.train.stats import TrainerStats

        fields = {**{f: 0 for f in TrainerStats.__dataclass_fields__}, "fleet": None}
        return TrainerStats(**{**fields, "state": "running", "loss": 1.0, "global_step": self.global_step,
                               "total_steps": self.total_steps, "tokens_seen": self.tokens,
                               "samples_seen": self.samples, "micro_batch_size": self.micro_batch_size,
                               "learning_rate": None})

    def peek_next_unit_ready(self):
        return True

    def peek_next_unit(self):
        return None

    def run(self, gate, on_unit=None):
        while self.global_step < self.total_steps:
            decision = gate.acquire()
            if decision.action is GateAction.STOP:
                self.checkpointed = True
                return "stopped"
            with self.units.lock:
                self.units.running += 1
                self.units.most = max(self.units.most, self.units.running)
            end = time.perf_counter() + self.unit_s
            while time.perf_counter() < end:
                pass
            with self.units.lock:
                self.units.running -= 1
            self.global_step += 1
            self.tokens += self.tokens_per_step
            self.samples += self.micro_batch_size
            gate.unit_done(None)
            if on_unit is not None:
                on_unit(None)
            time.sleep(0)
        return "finished"


def spec(name, weight=1.0, output_dir=None):
    return JobSpec(Path(f"/jobs/{name}.yaml"), name, weight, None, Path(output_dir) if output_dir else None)


def started_host(trainers: dict, specs, **kwargs) -> TrainerHost:
    host = TrainerHost(list(specs), build=lambda path: trainers[Path(path).stem], nice=0, **kwargs)
    host.start()
    host.apply(True)
    return host


def wait_for(predicate, timeout_s=30.0):
    return wait_until(predicate, timeout_s)


def job(host, name):
    return jobs(host, name)[0]


def jobs(host, *names):
    """The named jobs' lines from ONE status read: values compared across jobs (shares that
    sum to 1, trainer time) must come from the same moment, as the trainer keeps running."""
    lines = {j["name"]: j for j in host.status().jobs}
    return [lines[name] for name in names]


def test_two_jobs_share_the_trainer_by_weight_one_unit_at_a_time():
    units = Units()
    trainers = {"a": FakeTrainer(units), "b": FakeTrainer(units)}
    host = started_host(trainers, [spec("a", 1), spec("b", 3)], quantum_s=0.05)
    try:
        assert wait_for(lambda: all(j["state"] == "running" for j in host.status().jobs))
        time.sleep(5.0)
        a, b = jobs(host, "a", "b")
        # Wall time per unit on a shared CI machine: scripts/bench_job_queue.py holds the 10 % target.
        assert b["trainer_s"] / (a["trainer_s"] + b["trainer_s"]) == pytest.approx(0.75, abs=0.12)
        assert units.most == 1, "two jobs ran units at once"
        assert a["share"] + b["share"] == pytest.approx(1.0)
        assert abs(a["deficit_s"]) < 1.0 and a["weight"] == 1 and b["weight"] == 3
    finally:
        host.shutdown(10)
    assert all(t.checkpointed for t in trainers.values())
    assert [j["state"] for j in host.status().jobs] == ["stopped", "stopped"]
    assert host.scheduler_state() is TrainerState.STOPPED


def test_a_late_submission_starts_without_a_restart_and_takes_its_share():
    units = Units()
    trainers = {"a": FakeTrainer(units), "late": FakeTrainer(units)}
    host = started_host(trainers, [spec("a")], quantum_s=0.05)
    try:
        assert wait_for(lambda: job(host, "a")["global_step"] > 50)
        run = host.submit(spec("late", 1))
        assert run.state == "building" or run.state == "running"
        assert wait_for(lambda: job(host, "late")["global_step"] > 50)
        time.sleep(2.0)
        a, late = jobs(host, "a", "late")
        # Joined at the others' virtual time: no back-pay for the time before it existed.
        assert late["share"] == pytest.approx(a["share"], abs=0.25)
        assert units.most == 1
    finally:
        host.shutdown(10)


def test_at_most_max_running_jobs_are_built_and_the_rest_wait_in_order():
    units = Units()
    trainers = {name: FakeTrainer(units, total_steps=200) for name in ("a", "b", "c")}
    built = []
    host = TrainerHost([spec("a"), spec("b"), spec("c")], nice=0, max_running=2,
                       build=lambda path: built.append(Path(path).stem) or trainers[Path(path).stem])
    host.start()
    host.apply(True)
    try:
        assert wait_for(lambda: len(built) == 2)
        assert job(host, "c")["state"] == "queued"
        assert wait_for(lambda: host.status().jobs_done == 3)
        assert built[:2] in (["a", "b"], ["b", "a"]) and built[2] == "c"
        assert host.scheduler_state() is TrainerState.FINISHED
        finished = job(host, "a")
        assert finished["progress"] == 1.0 and finished["eta_s"] is None and finished["steps_trained"] == 200
    finally:
        host.shutdown(10)


def test_cancel_a_queued_and_a_running_job():
    units = Units()
    trainers = {"a": FakeTrainer(units), "b": FakeTrainer(units)}
    host = started_host(trainers, [spec("a"), spec("b")], max_running=1)
    try:
        assert wait_for(lambda: job(host, "a")["state"] == "running")
        host.cancel("b")
        assert job(host, "b")["state"] == "cancelled"
        host.cancel("a")
        assert wait_for(lambda: job(host, "a")["state"] == "cancelled")
        assert trainers["a"].checkpointed and not trainers["b"].checkpointed
        with pytest.raises(JobRefused, match="no live job named 'a'"):
            host.cancel("a")
        # A cancelled job's name is free again: resubmitting resumes from its checkpoint.
        trainers["a"] = FakeTrainer(units)
        host.submit(spec("a"))
        assert wait_for(lambda: host.status().jobs[-1]["state"] == "running")
    finally:
        host.shutdown(10)


def test_names_and_output_folders_of_live_jobs_are_unique():
    host = TrainerHost([spec("a", output_dir="/out/a")], build=lambda path: None)
    with pytest.raises(JobRefused, match="a job named 'a' is already queued"):
        host.submit(spec("a"))
    with pytest.raises(JobRefused, match="output_dir /out/a is the output_dir of job 'a'"):
        host.submit(spec("b", output_dir="/out/a"))
    host.operator_stop()
    with pytest.raises(JobRefused, match="has been stopped"):
        host.submit(spec("c"))


def test_the_scheduler_pause_holds_every_job_and_resume_lets_the_active_one_run():
    units = Units()
    trainers = {"a": FakeTrainer(units), "b": FakeTrainer(units)}
    host = started_host(trainers, [spec("a"), spec("b")], quantum_s=0.02)
    try:
        assert wait_for(lambda: job(host, "b")["global_step"] > 10)
        host.apply(False)
        # Every job's thread parked at its gate: the unit in flight at the pause is done.
        assert all(run.gate.wait_until_parked(30) for run in host.runs)
        steps = (trainers["a"].global_step, trainers["b"].global_step)
        time.sleep(0.3)
        assert (trainers["a"].global_step, trainers["b"].global_step) == steps
        assert host.status().state is TrainerState.PAUSED
        host.apply(True)
        assert wait_for(lambda: trainers["a"].global_step + trainers["b"].global_step > sum(steps) + 20)
    finally:
        host.shutdown(10)


def test_a_failing_job_ends_alone_and_the_others_go_on():
    units = Units()
    faults = []
    good = FakeTrainer(units)

    def build(path):
        if Path(path).stem == "bad":
            raise MemoryError("no room for this job")
        return good

    host = TrainerHost([spec("bad"), spec("good")], build=build, on_fault=faults.append, nice=0)
    host.start()
    host.apply(True)
    try:
        assert wait_for(lambda: job(host, "bad")["state"] == "failed")
        assert "MemoryError: no room for this job" in job(host, "bad")["error"]
        assert wait_for(lambda: good.global_step > 20)
        assert len(faults) == 1 and host.scheduler_state() is TrainerState.RUNNING
    finally:
        host.shutdown(10)


def test_weights_change_at_run_time():
    units = Units()
    trainers = {"a": FakeTrainer(units), "b": FakeTrainer(units)}
    host = started_host(trainers, [spec("a"), spec("b")], quantum_s=0.05)
    try:
        assert wait_for(lambda: all(j["state"] == "running" for j in host.status().jobs))
        host.set_weight("a", 4)
        start = {j["name"]: j["trainer_s"] for j in host.status().jobs}
        time.sleep(3.0)
        gained = {j["name"]: j["trainer_s"] - start[j["name"]] for j in host.status().jobs}
        assert gained["a"] / (gained["a"] + gained["b"]) == pytest.approx(0.8, abs=0.08)
        with pytest.raises(JobRefused, match="no live job named 'zzz'"):
            host.set_weight("zzz", 1)
        with pytest.raises(ValueError, match="weight must be a positive number"):
            host.set_weight("a", 0)
    finally:
        host.shutdown(10)


def test_counters_of_a_resumed_job_start_from_its_checkpoint():
    units = Units()
    trainers = {"a": FakeTrainer(units, total_steps=30, resumed_tokens=5000)}
    host = started_host(trainers, [spec("a")])
    try:
        assert wait_for(lambda: job(host, "a")["state"] == "finished")
        a = job(host, "a")
        assert a["tokens_seen"] == 5300 and a["tokens_trained"] == 300
    finally:
        host.shutdown(10)


def test_a_periodic_fleet_jobs_line_counts_this_servers_steps_and_the_fleets_eta():
    import dataclasses
    import types

    from harvest.colocate.job_queue import JobRun
    from harvest.colocate.job_status import job_line
    from harvest.train.stats import TrainerStats

    fields = {**{f: 0 for f in TrainerStats.__dataclass_fields__}, "state": "running", "loss": 1.0}
    fleet = {"sync": "periodic", "steps_trained": 7, "eta_s": 12.5}
    stats = TrainerStats(**{**fields, "global_step": 40, "total_steps": 100, "fleet": fleet})
    run = JobRun(0, spec("f"))
    run.state, run.running_since, run.trainer = "running", time.monotonic() - 1.0, types.SimpleNamespace(stats=lambda: stats)
    line = job_line(run, active=True, host_paused=False, starved=False, share=1.0, deficit_s=0.0)
    # Progress is the fleet's (40 of 100), the steps trained are this server's, the ETA the fleet's pace.
    assert (line["progress"], line["steps_trained"], line["eta_s"], line["fleet"]) == (0.4, 7, 12.5, fleet)
    solo = dataclasses.replace(stats, fleet=None)
    run.trainer = types.SimpleNamespace(stats=lambda: solo)
    line = job_line(run, active=True, host_paused=False, starved=False, share=1.0, deficit_s=0.0)
    assert line["steps_trained"] == 40 and line["eta_s"] == pytest.approx(1.5, rel=0.5) and line["fleet"] is None


def test_each_job_is_checked_once_against_the_profiles_co_run_units_and_a_mismatch_is_in_its_line():
    units = Units()
    trainers = {"big": FakeTrainer(units, total_steps=40, tokens_per_step=4 * 512, micro_batch_size=4),
                "same": FakeTrainer(units, total_steps=40, tokens_per_step=2 * 512, micro_batch_size=2)}
    checked = []

    def corun_check(micro_batch_tokens, job):
        checked.append((job, micro_batch_tokens))
        return f"{job}: {micro_batch_tokens:.0f} tokens" if micro_batch_tokens > 1024 else None

    host = started_host(trainers, [spec("big"), spec("same")], quantum_s=0.01, corun_check=corun_check)
    try:
        assert wait_for(lambda: all(j["state"] == "finished" for j in host.status().jobs))
    finally:
        host.shutdown()
    # Once per job, after its first step, with its mean tokens per micro-batch.
    assert sorted(checked) == [("job big", 2048.0), ("job same", 1024.0)]
    big, same = jobs(host, "big", "same")
    assert big["corun_mismatch"] == "job big: 2048 tokens" and same["corun_mismatch"] is None


def test_a_job_that_reports_no_samples_is_not_called_a_mismatch():
    units = Units()
    calls = []
    host = started_host({"a": FakeTrainer(units, total_steps=5)}, [spec("a")],
                        corun_check=lambda tokens, job: calls.append(job) or "never")
    try:
        assert wait_for(lambda: job(host, "a")["state"] == "finished")
    finally:
        host.shutdown()
    assert calls == [] and job(host, "a")["corun_mismatch"] is None
