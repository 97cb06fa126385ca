"""Co-location on a real SGLang server with tensor parallelism (--tp 2, one core per rank).

- greedy outputs of 200 requests are identical with harvest on and off, while both ranks
  lend and reclaim KV chunks: the same chunks, in the same order (the ranks' move
  digests agree at every step), and a burst takes lent chunks back on both; an operator's
  pause on rank 0's endpoint returns every chunk on both; stopping the server stops both
  trainers at the same step;
- the job trained by the two ranks, on their shards of the served weights, equals the same
  job trained offline on one rank (final adapter, 1e-5);
- a trainer fault on rank 1 stops rank 0's trainer too, every chunk comes back on both
  ranks, and the server answers as before.
"""

from __future__ import annotations

import re
import time

import pytest

from harvest import colocation_config
from harvest.sglang import server
from tests.colocate.test_sglang_colocation import (BURST, POOL_TOKENS, RETRACTION, _burst_needs_lent_memory, _generate_all,
                                                   _generate_at_once, _metrics, _operator, _prompts, _status,
                                                   _status_since, _wait_for)

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(1200)]

TP = 2


def _env(**extra):
    import os

    env = server.cpu_server_env()
    cores = sorted(os.sched_getaffinity(0))
    # One OpenMP core per rank (SGLang's CPU TP needs the binding); on a machine with one
    # core both ranks share it.
    env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[i % len(cores)]) for i in range(TP))
    env.update(extra)
    return env


def _args(model_path, *extra):
    args = server.cpu_server_args(model_path, max_total_tokens=POOL_TOKENS) + ["--disable-radix-cache", "--tp", str(TP)]
    return args + list(extra)


@pytest.fixture(scope="module")
def tp_reference_outputs(tiny_llama_path, tmp_path_factory):
    light, burst = _prompts()
    log = tmp_path_factory.mktemp("tp-reference") / "sglang.log"
    with server.launch(_args(tiny_llama_path), log_path=log, env=_env()) as srv:
        outputs = _generate_all(srv, light, 8), _generate_all(srv, burst, BURST)
    return outputs


def _ranks_agree(status) -> bool:
    tp = status["tensor_parallel"]
    return len(set(tp["moves_digest_by_rank"])) == 1 and len(set(tp["chunks_taken_by_rank"])) == 1


def test_outputs_identical_and_both_ranks_lend_and_reclaim_the_same_chunks(tiny_llama_path, tmp_path,
                                                                           tp_reference_outputs):
    port = server.free_port()
    config = colocation_config.write(tmp_path / "harvest", tiny_llama_path, metrics_port=port)
    light, burst = _prompts()
    with server.launch(_args(tiny_llama_path, "--enable-harvest", "--harvest-config", str(config)),
                       log_path=tmp_path / "sglang.log", env=_env()) as srv:
        status = _wait_for(lambda: (s := _status(port))["kv"]["chunks_lent"] > 0
                           and (s["trainer"]["stats"] or {}).get("global_step", 0) > 0 and s, timeout_s=240)
        assert status, _status(port)
        light_out = _generate_all(srv, light, 8)
        # The trainer runs in decode's idle gaps: wait for its step rather than assume one came.
        step_between = _wait_for(lambda: (s := _status(port))["trainer"]["stats"]["global_step"]
                                 > status["trainer"]["stats"]["global_step"] and s)
        assert step_between, "the trainer made no progress between bursts"
        relent = _wait_for(lambda: _burst_needs_lent_memory(s := _status(port), burst) and s, timeout_s=60)
        burst_out = _generate_at_once(srv, burst)
        after = _status_since(port, time.time())
        samples, _ = _metrics(port)
        # An operator's pause, on rank 0's endpoint, gives the memory back on both ranks.
        pause = _operator(port, "pause")
        paused = _wait_for(lambda: (s := _status(port))["tensor_parallel"]["chunks_taken_by_rank"] == [0] * TP and s)
        resume = _operator(port, "resume")
        relent_after_pause = _wait_for(lambda: (s := _status(port))["kv"]["chunks_lent"] > 0 and s)
    log = srv.log_path.read_text(errors="replace")
    assert (light_out, burst_out) == tp_reference_outputs
    assert status["tensor_parallel"]["size"] == TP and _ranks_agree(status), status["tensor_parallel"]
    assert relent and after["kv"]["reclaims_total"] > 0, after["kv"]  # the burst took lent chunks back
    assert _ranks_agree(after) and after["tensor_parallel"]["stopped"] is None, after["tensor_parallel"]
    assert after["tensor_parallel"]["moves_digest_by_rank"][0] != status["tensor_parallel"]["moves_digest_by_rank"][0]
    assert after["trainer"]["error"] is None
    assert after["trainer"]["stats"]["global_step"] >= step_between["trainer"]["stats"]["global_step"]
    assert "pool memory leak detected" not in log and RETRACTION not in log
    harvest_errors = [line for line in log.splitlines() if "harvest pid=" in line and "ERROR" in line]
    assert not harvest_errors, harvest_errors
    assert samples['harvest_kv_reclaims_total{}'] > 0 and samples['harvest_trainer_steps_total{"job_name": "job"}'] > 0
    assert pause[0] == 200 and paused and _ranks_agree(paused), pause
    assert resume[0] == 200 and relent_after_pause and _ranks_agree(relent_after_pause)
    # Stopping the server stops both trainers at the same step (a collective checkpoint).
    stopped = re.findall(r"harvest pid=(\d+)\] INFO trainer job .* stopped at step (\d+)", log)
    assert len(stopped) == TP and len({pid for pid, _ in stopped}) == TP and len({step for _, step in stopped}) == 1, \
        stopped


def test_the_two_ranks_train_the_job_one_rank_trains(tiny_llama_path, tmp_path):
    """On the served shards in place (same base model): every step's loss and the finished
    adapter equal an offline tp = 1 run of the same job.

    SGD: with AdamW from LoRA's zero B, the first steps' LoRA A gradients are near Adam's
    epsilon, where the update amplifies float32 rounding of the shards' different
    summation order (2.5e-5 on this job, docs/tensor-parallel.md); AdamW parity is
    checked offline with B randomized (tests/train/test_tensor_parallel.py)."""
    from safetensors.torch import load_file

    from harvest.train.job import load_job
    from tests.train.trainer_helpers import log_lines, offline_losses

    port = server.free_port()
    steps = 6
    config = colocation_config.write(tmp_path / "harvest", tiny_llama_path, metrics_port=port, max_steps=steps,
                                     save_steps=steps, share_served_weights=True,
                                     job_keys={"lora_dropout": 0.0, "optim": "sgd", "learning_rate": 0.5,
                                               "logging_steps": 1})
    with server.launch(_args(tiny_llama_path, "--enable-harvest", "--harvest-config", str(config)),
                       log_path=tmp_path / "sglang.log", env=_env()) as srv:
        done = _wait_for(lambda: (s := _status(port))["trainer"]["state"] == "finished" and s, timeout_s=300)
        assert done, _status(port)
        log = srv.log_path.read_text(errors="replace")
    assert log.count("trains on the served weights in place") == TP  # every rank, on its own shard
    job = load_job(tmp_path / "harvest" / "job.yaml")
    served = load_file(str(job.output_dir / "adapter_model.safetensors"))
    offline_dir = tmp_path / "offline"
    offline = offline_losses(tmp_path / "harvest" / "job.yaml", offline_dir)
    reference = load_file(str(offline_dir / "adapter_model.safetensors"))
    served_losses = [entry["loss"] for entry in log_lines(job.output_dir) if "loss" in entry]
    assert len(served_losses) == len(offline) == steps
    assert max(abs(a - b) for a, b in zip(served_losses, offline)) <= 1e-5, (served_losses, offline)
    assert sorted(served) == sorted(reference)
    assert max(float(reference[k].abs().max()) for k in reference if "lora_B" in k) > 1e-3  # it learned something
    diff = max(float((served[k] - reference[k]).abs().max()) for k in reference)
    assert diff <= 1e-5, diff


def test_a_trainer_fault_on_rank_1_stops_both_and_returns_every_chunk(tiny_llama_path, tmp_path, tp_reference_outputs):
    port = server.free_port()
    config = colocation_config.write(tmp_path / "harvest", tiny_llama_path, metrics_port=port)
    env = _env(HARVEST_FAULT_AFTER_UNITS="40", HARVEST_FAULT_RANK="1")
    light, _ = _prompts()
    with server.launch(_args(tiny_llama_path, "--enable-harvest", "--harvest-config", str(config)),
                       log_path=tmp_path / "sglang.log", env=env) as srv:
        failed = _wait_for(lambda: (s := _status(port))["trainer"]["state"] == "failed"
                           and s["tensor_parallel"]["chunks_taken_by_rank"] == [0] * TP and s, timeout_s=240)
        assert failed, _status(port)
        outputs = _generate_all(srv, light[:40], 8)
        after = _status_since(port, time.time())
        samples, _ = _metrics(port)
        log = srv.log_path.read_text(errors="replace")
    assert "rank 1" in failed["trainer"]["error"] and "PeerTrainerFault" in failed["trainer"]["error"], failed["trainer"]
    assert "InjectedTrainerFault" in log  # rank 1's own fault, in its log lines
    assert outputs == tp_reference_outputs[0][:40]  # both ranks still serving, same answers
    assert after["kv"]["chunks_lent"] == 0 and after["tensor_parallel"]["chunks_taken_by_rank"] == [0] * TP
    assert _ranks_agree(after)
    assert samples['harvest_trainer_faults_total{}'] == 1
