"""Co-location on a real SGLang server on CPU, with the tiny model and a real LoRA job.

- greedy outputs of 200 requests are identical with harvest on (trainer running, KV
  chunks lent and reclaimed) and off;
- a burst that needs the lent memory gets it back (reclaim, the allocator's work on the
  lending thread; its admission counted as held by lent memory) with no failed request and
  no retracted one;
- the trainer makes progress between bursts;
- /metrics on harvest's port exports the harvest_* metrics and they move;
- a trainer that raises mid-step leaves the server serving, with everything reclaimed;
- stopping the server (SIGTERM to its process group, or to its main process only)
  checkpoints the trainer first.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from harvest import colocation_config
from harvest.sglang import server
from harvest.train.trainer_cpu import usable_cores

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]

NUM_REQUESTS = 200
BURST = 64  # concurrent long requests: more KV than the pool has without the lent chunks


def _prompts():
    light = [[5 + (i * 7 + j) % 300 for j in range(12 + i % 9)] for i in range(NUM_REQUESTS - BURST)]
    burst = [[5 + (i * 13 + j) % 300 for j in range(230)] for i in range(BURST)]
    return light, burst


MAX_NEW_TOKENS = 12
SAMPLING = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
POOL_TOKENS = 16384  # _args' --max-total-tokens


def _generate_all(srv, prompts, workers):
    def one(ids):
        return srv.post("/generate", {"input_ids": ids, "sampling_params": SAMPLING})["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, prompts))


def _generate_at_once(srv, prompts):
    """Every prompt in one /generate request. SGLang's tokenizer manager sends a batch of
    token ids to the scheduler as one message, so the whole batch is in its queue at one
    admission round. Concurrent requests instead arrive as fast as the machine lets them:
    on a loaded machine they trickle in, and a lending thread that keeps up with them
    leaves no admission held and, with few chunks lent, may take nothing back at all."""
    return [out["output_ids"] for out in srv.post("/generate", {"input_ids": prompts, "sampling_params": SAMPLING})]


def _burst_needs_lent_memory(status, burst) -> bool:
    """The chunks lent now hold more than the pool can spare beside the burst: sent at once,
    it is not admitted until some of them come back."""
    kv = status["kv"]
    return POOL_TOKENS - kv["chunks_lent"] * kv["tokens_per_chunk"] < sum(len(ids) + MAX_NEW_TOKENS for ids in burst)


def _status(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/harvest/status", timeout=10) as response:
        return json.loads(response.read())


def _status_since(port, since, timeout_s=30.0):
    """The first /harvest/status snapshot taken after ``since`` (time.time()): the endpoint
    serves the engine's latest snapshot (every 0.5 s, when the engine gets to it), so a
    read right after some traffic may still describe the server before it."""
    def fresh():
        status = _status(port)
        return time.time() - status["snapshot_age_s"] > since and status

    return _wait_for(fresh, timeout_s=timeout_s, interval_s=0.1) or _status(port)


def _operator(port, action):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/harvest/{action}", method="POST", data=b"")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _metrics(port):
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    # Every harvest series carries model_name (the served model): keyed without it here.
    return {s.name + json.dumps({k: v for k, v in s.labels.items() if k != "model_name"}, sort_keys=True): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}, \
        {f.name: f.type for f in text_string_to_metric_families(text)}


def _wait_for(predicate, timeout_s=60.0, interval_s=0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()




def _args(model_path, *extra):
    # No radix cache, as on a decode instance: cached prefixes hold slots that are evictable
    # but not free, and harvest lends only free chunks (it never evicts SGLang's cache).
    args = server.cpu_server_args(model_path, max_total_tokens=POOL_TOKENS) + ["--disable-radix-cache"]
    return args + list(extra)


@pytest.fixture(scope="module")
def reference_outputs(plain_server_outputs):
    """(light, burst) greedy outputs of a server without harvest (tests/conftest.py: the
    same server answers tests/fleet/test_sglang_fleet.py's reference; it checks that the
    pool fits the burst without harvest: no retraction)."""
    return plain_server_outputs["colocation"]


RETRACTION = "KV cache pool is full. Retract requests"  # SGLang's warning when decode runs out of KV


def test_outputs_identical_reclaim_progress_and_metrics(tiny_llama_path, tmp_path, reference_outputs):
    port = server.free_port()
    # The allocator's work on the lending thread (a GPU's default; a CPU's is the scheduler
    # thread), so a real server runs it, its flush and its shutdown.
    config = colocation_config.write(tmp_path / "harvest", tiny_llama_path, metrics_port=port,
                                     config_keys={"memory": {"lending_thread": True}})
    light, burst = _prompts()
    with server.launch(_args(tiny_llama_path, "--enable-harvest", "--harvest-config", str(config)), log_path=tmp_path / "sglang.log") as srv:
        # The trainer builds on its own thread; KV chunks are lent while the server idles.
        status = _wait_for(lambda: (s := _status(port))["kv"]["chunks_lent"] > 0 and s["trainer"]["stats"] and s["trainer"]["stats"]["global_step"] > 0 and s)
        assert status, _status(port)
        lent_before = status["kv"]["chunks_lent"]
        light_out = _generate_all(srv, light, 8)
        step_between = _wait_for(lambda: (s := _status(port))["trainer"]["stats"]["global_step"] > status["trainer"]["stats"]["global_step"] and s)
        assert step_between, "the trainer made no progress between bursts"
        lent_before_burst = _wait_for(lambda: (s := _status(port))["kv"]["chunks_lent"] >= lent_before
                                      and _burst_needs_lent_memory(s, burst) and s)
        burst_out = _generate_at_once(srv, burst)
        after = _status_since(port, time.time())  # metrics come from the same (or a later) snapshot
        samples, types = _metrics(port)
        # /flush_cache clears SGLang's pool (every slot free again) while chunks are lent:
        # they stay out of its free list, and the server lives and answers the same.
        relent = _wait_for(lambda: (s := _status(port))["kv"]["chunks_lent"] > 0 and s)
        flush_code, flush_body = srv.get("/flush_cache")
        flushed_out = _generate_all(srv, light[:16], 4)
        after_flush = _status_since(port, time.time())
        log = srv.log_path.read_text(errors="replace")
    assert (light_out, burst_out) == reference_outputs
    assert relent and flush_code == 200, (flush_code, flush_body)
    assert flushed_out == reference_outputs[0][:16] and after_flush["kv"]["integrity_error"] is None
    assert "pool memory leak detected" not in log
    assert lent_before_burst and after["kv"]["reclaims_total"] > 0, after["kv"]  # the burst took lent chunks back
    assert after["kv"]["lending_thread"] is True and after["kv"]["reclaim_ahead"] is True
    # The burst's admission found lent memory in its way: taken back at once, counted.
    assert after["kv"]["admissions_held_total"] >= 1 and after["kv"]["urgent_reclaims_total"] >= 1, after["kv"]
    assert after["trainer"]["error"] is None and after["trainer"]["stats"]["global_step"] > status["trainer"]["stats"]["global_step"]
    # Decode's torch threads and the trainer's fit the cores together (one each here).
    decode_threads, trainer_threads = after["decode_cpu_threads"], after["trainer_cpu_threads"]
    assert decode_threads == 1 or decode_threads + trainer_threads <= usable_cores(), (decode_threads, trainer_threads)
    harvest_errors = [line for line in log.splitlines() if "harvest pid=" in line and ("ERROR" in line or "WARNING" in line)]
    assert not harvest_errors, harvest_errors
    assert RETRACTION not in log  # decode never retracts a request because the trainer holds memory
    # Metrics: harvest's names and types, and the values moved.
    assert types["harvest_decode_step_seconds"] == "histogram" and types["harvest_kv_lends"] == "counter"
    assert samples['harvest_decode_step_seconds_count{}'] > 0
    assert after["unmeasured_steps"] == 0, after  # every step's forward went through harvest's forward hook
    assert samples['harvest_kv_lends_total{}'] >= lent_before and samples['harvest_kv_reclaims_total{}'] > 0
    assert samples['harvest_trainer_tokens_total{"job_name": "job"}'] > 0
    assert samples['harvest_trainer_steps_total{"job_name": "job"}'] > 0
    assert samples['harvest_qos_target_seconds{}'] == pytest.approx(0.040)


def test_pause_gives_the_memory_back_and_stop_ends_lending(tiny_llama_path, tmp_path, reference_outputs):
    port = server.free_port()
    config = colocation_config.write(tmp_path / "harvest", tiny_llama_path, metrics_port=port)
    light, burst = _prompts()
    with server.launch(_args(tiny_llama_path, "--enable-harvest", "--harvest-config", str(config)), log_path=tmp_path / "sglang.log") as srv:
        lent = _wait_for(lambda: (s := _status(port))["kv"]["chunks_lent"] > 0 and (s["trainer"]["stats"] or {}).get("global_step", 0) > 0 and s, timeout_s=120)
        assert lent, _status(port)
        pause = _operator(port, "pause")
        paused = _wait_for(lambda: (s := _status(port))["kv"]["chunks_lent"] == 0 and s)
        resume = _operator(port, "resume")
        relent = _wait_for(lambda: (s := _status(port))["kv"]["chunks_lent"] > 0 and s)
        stop = _operator(port, "stop")
        stopped = _wait_for(lambda: (s := _status(port))["kv"]["chunks_lent"] == 0 and s["trainer"]["state"] == "stopped" and s, timeout_s=120)
        burst_out = _generate_all(srv, burst, BURST)
        idle = _wait_for(lambda: False, timeout_s=2.0)  # idle ticks in which lending would happen
        after = _status(port)
        refused = [_operator(port, action) for action in ("resume", "pause", "stop")]
    assert pause[0] == 200 and pause[1]["trainer"] == "paused", pause
    assert paused and paused["trainer"]["state"] == "paused", paused
    assert resume[0] == 200 and relent, resume
    assert stop[0] == 200 and stopped, stop
    assert burst_out == reference_outputs[1] and not idle
    assert after["kv"]["chunks_lent"] == 0 and after["kv"]["integrity_error"] is None  # nothing lent again after stop
    assert [code for code, _ in refused] == [409, 409, 409], refused


def test_trainer_fault_leaves_the_server_serving(tiny_llama_path, tmp_path, reference_outputs, monkeypatch):
    port = server.free_port()
    config = colocation_config.write(tmp_path / "harvest", tiny_llama_path, metrics_port=port)
    env = server.cpu_server_env()
    env["HARVEST_FAULT_AFTER_UNITS"] = "40"
    light, _ = _prompts()
    with server.launch(_args(tiny_llama_path, "--enable-harvest", "--harvest-config", str(config)), log_path=tmp_path / "sglang.log", env=env) as srv:
        failed = _wait_for(lambda: (s := _status(port))["trainer"]["state"] == "failed" and s, timeout_s=120)
        assert failed, _status(port)
        outputs = _generate_all(srv, light[:40], 8)
        after = _status_since(port, time.time())
        samples, _ = _metrics(port)
    assert "InjectedTrainerFault" in failed["trainer"]["error"]
    assert outputs == reference_outputs[0][:40]  # still serving, same answers
    assert after["kv"]["chunks_lent"] == 0  # everything lent came back
    assert samples['harvest_trainer_faults_total{}'] == 1


def test_same_base_model_trains_on_the_served_weights(tiny_llama_path, tmp_path, reference_outputs):
    port = server.free_port()
    config = colocation_config.write(tmp_path / "harvest", tiny_llama_path, metrics_port=port, share_served_weights=True)
    light, _ = _prompts()
    with server.launch(_args(tiny_llama_path, "--enable-harvest", "--harvest-config", str(config)), log_path=tmp_path / "sglang.log") as srv:
        status = _wait_for(lambda: ((s := _status(port))["trainer"]["stats"] or {}).get("global_step", 0) > 0 and s, timeout_s=120)
        assert status, _status(port)
        outputs = _generate_all(srv, light[:60], 8)
        after = _status_since(port, time.time())
        log = srv.log_path.read_text(errors="replace")
    assert "trains on the served weights in place" in log
    assert status["trainer"]["stats"]["window_bytes"] == 0  # no second copy of the frozen weights
    assert after["trainer"]["stats"]["global_step"] >= status["trainer"]["stats"]["global_step"]
    assert after["trainer"]["error"] is None
    assert outputs == reference_outputs[0][:60]  # training never touched the served weights


def test_metrics_also_in_sglang_multiprocess_metrics(tiny_llama_path, tmp_path):
    # With --enable-metrics SGLang sets PROMETHEUS_MULTIPROC_DIR; harvest's values then land
    # in that directory too, so SGLang's own /metrics (another process) serves them.
    port = server.free_port()
    config = colocation_config.write(tmp_path / "harvest", tiny_llama_path, metrics_port=port)
    args = _args(tiny_llama_path, "--enable-metrics", "--enable-harvest", "--harvest-config", str(config))
    with server.launch(args, log_path=tmp_path / "sglang.log") as srv:
        for i in range(4):
            srv.post("/generate", {"input_ids": [5 + i, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        sglang_text = _wait_for(lambda: (t := srv.get("/metrics")[1]) and "harvest_decode_step_seconds_count" in t and t, timeout_s=30)
        # harvest's endpoint serves a snapshot at most metrics.publish_interval_s old.
        own = _wait_for(lambda: (m := _metrics(port)[0])['harvest_decode_step_seconds_count{}'] >= 4 and m, timeout_s=60)
    assert sglang_text, "harvest_* metrics missing from SGLang's /metrics"
    assert "harvest_qos_target_seconds" in sglang_text
    assert own and own['harvest_decode_step_seconds_count{}'] >= 4


@pytest.mark.parametrize("signal_to", ["process group", "main process", "detokenizer first"])
def test_server_shutdown_checkpoints_the_trainer(tiny_llama_path, tmp_path, signal_to):
    # save_steps far away: any checkpoint on disk was written because the server stopped.
    port = server.free_port()
    config = colocation_config.write(tmp_path / "harvest", tiny_llama_path, metrics_port=port, save_steps=100_000)
    srv = server.launch(_args(tiny_llama_path, "--enable-harvest", "--harvest-config", str(config)), log_path=tmp_path / "sglang.log")
    try:
        status = _wait_for(lambda: ((s := _status(port))["trainer"]["stats"] or {}).get("global_step", 0) >= 2 and s, timeout_s=120)
        assert status, _status(port)
        if signal_to == "detokenizer first":
            # A group signal where the detokenizer's end reaches SGLang's watchdog (which
            # polls every second and kills the whole server) well before the scheduler has
            # checkpointed: as on a loaded machine, or with a slow checkpoint write.
            (detokenizer,) = srv.processes("sglang::detokenizer")
            os.kill(detokenizer, signal.SIGTERM)
            assert _wait_for(lambda: not srv.processes("sglang::detokenizer"), timeout_s=30)
            time.sleep(3)
            assert srv.process.poll() is None, srv.log_tail()  # held back: the scheduler still runs
        if signal_to in ("process group", "detokenizer first"):  # Ctrl-C, systemd: the scheduler gets it itself
            os.killpg(srv.process.pid, signal.SIGTERM)
        else:  # kill <pid>, Kubernetes: SGLang's graceful path (drain, ShutdownReq)
            os.kill(srv.process.pid, signal.SIGTERM)
        srv.process.wait(timeout=90)
    finally:
        srv.stop()
    log = srv.log_path.read_text(errors="replace")
    steps = [int(p.name.split("-")[1]) for p in (tmp_path / "harvest" / "adapter").glob("checkpoint-*")]
    assert steps and max(steps) >= status["trainer"]["stats"]["global_step"], log[-3000:]
    assert (tmp_path / "harvest" / "adapter" / f"checkpoint-{max(steps)}" / "harvest_state.json").is_file()
    # Group signal: the scheduler's handler stops the trainer; the scheduler then passes the
    # signal on, unless SGLang's ShutdownReq ends its loop first (both race; either is fine).
    assert "did not stop within" not in log and "trainer fault" not in log


def test_a_job_as_llamafactory_users_write_it_trains_and_evaluates_in_the_server(tiny_llama_path, tmp_path):
    """Relative output_dir, evaluation, logging_steps and preprocessing workers, in a decode
    server: outputs beside the job file, eval_loss in LlamaFactory's log, workers capped."""
    port = server.free_port()
    job_keys = {"output_dir": "saves/lora", "max_steps": 4, "val_size": 0.25, "eval_strategy": "steps",
                "eval_steps": 2, "logging_steps": 1, "preprocessing_num_workers": 4, "plot_loss": True}
    config = colocation_config.write(tmp_path / "harvest", tiny_llama_path, metrics_port=port, job_keys=job_keys)
    with server.launch(_args(tiny_llama_path, "--enable-harvest", "--harvest-config", str(config)),
                       log_path=tmp_path / "sglang.log") as srv:
        done = _wait_for(lambda: (s := _status(port))["trainer"]["stats"] and s["trainer"]["stats"]["state"] == "finished"
                         and s, timeout_s=300)
        log = srv.log_path.read_text(errors="replace")
    assert done, _status(port)
    assert done["trainer"]["stats"]["eval_loss"] is not None
    output_dir = tmp_path / "harvest" / "saves" / "lora"  # relative to the job file, not the server's cwd
    lines = [json.loads(line) for line in (output_dir / "trainer_log.jsonl").read_text().splitlines()]
    assert [line["current_steps"] for line in lines if "loss" in line] == [1, 2, 3, 4]
    assert [line["current_steps"] for line in lines if "eval_loss" in line] == [2, 4]
    assert (output_dir / "adapter_model.safetensors").is_file() and (output_dir / "training_loss.png").is_file()
    assert "preprocessing_num_workers: 4 is capped to none inside a decode server" in log
