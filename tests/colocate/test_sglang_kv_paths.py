"""SGLang 0.5.23's runtime paths that change the KV pool's free lists, on a real CPU server
whose free KV chunks are lent to a running finetune job (docs/sglang-integration.md,
"Paths that touch the KV pool's free lists"; the server configurations harvest refuses
instead: tests/colocate/test_server_refusals.py). /flush_cache: test_sglang_colocation.py.

One server serves every path of the normal mode, with SGLang's decode retraction forced
every few steps (SGLANG_TEST_RETRACT) and its leak check run on every busy step as well
as when idle: forced retraction, aborts (one request, all, queued and running),
/pause_generation (retract, in place), /release_memory_occupation and
/resume_memory_occupation, /update_weights_from_disk and /update_weights_from_tensor. A
decode instance (fake KV transfer) runs forced retraction with its CPU backup
(--disaggregation-decode-retraction-backup cpu_tensor) and aborts.

After each path: the server answers, greedy outputs equal transformers' (the normal
server's), the chunks are still lent and harvest's idle integrity check passed after
the path (no slot of a lent chunk is in SGLang's free lists; the lending cache agrees
with the allocator), the trainer has no error, and no leak check fired.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
import urllib.request

import pytest
import yaml

from harvest import colocation_config
from harvest.sglang import server
from tests.colocate.test_sglang_colocation import _args, _generate_all, _prompts, _status, _wait_for

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = _prompts()[0][:16]
MAX_NEW_TOKENS = 12  # _generate_all's
LONG_NEW_TOKENS = 1500  # a request still running when aborted (~100 tokens/s here)
PAUSED_NEW_TOKENS = 200  # requests still running when generation pauses, a few steps in
CLEARED = "SGLang cleared its KV pool"  # harvest.sglang.kv_lending.after_pool_cleared's log line
# SGLang's decode retraction every 3rd step, and its pool leak check on every busy step
# (idle steps check always): any slot lost or counted twice kills the server.
CHECKED_ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1"}


def _harvest_config(directory, model_path, port):
    config = colocation_config.write(directory, model_path, metrics_port=port)
    values = yaml.safe_load(config.read_text())
    values["memory"] = {"integrity_check_interval_s": 0.5}  # a check soon after each path
    config.write_text(yaml.safe_dump(values))
    return config


@dataclasses.dataclass
class LentServer:
    srv: server.Server
    port: int

    def kv(self) -> dict:
        return _status(self.port)["kv"]

    def decode_steps(self) -> int:
        return _status(self.port)["steps"]

    def wait_decoding(self, steps_before: int, steps: int = 3) -> None:
        """Until decode ran ``steps`` steps since ``steps_before``: requests are running
        (not queued) and have tokens, however fast or slow this machine decodes."""
        assert _wait_for(lambda: self.decode_steps() >= steps_before + steps, timeout_s=120), _status(self.port)

    def log(self) -> str:
        return self.srv.log_path.read_text(errors="replace")

    def post_for_status(self, path: str, payload: dict) -> int:
        """POST to an endpoint that answers with an empty body (/abort_request)."""
        request = urllib.request.Request(self.srv.base_url + path, data=json.dumps(payload).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status

    def abort_all(self, replies) -> list[int]:
        """/abort_request {abort_all} until every reply is in: a request the server had not
        yet received at one call (its client thread or the tokenizer ran late on a loaded
        machine) is aborted by the next, instead of running to its length. The statuses."""
        statuses, deadline = [], time.monotonic() + 120
        while not all(reply.done() for reply in replies) and time.monotonic() < deadline:
            statuses.append(self.post_for_status("/abort_request", {"abort_all": True}))
            concurrent.futures.wait(replies, timeout=0.5)
        return statuses

    def pool_clears(self) -> int:
        return self.log().count(CLEARED)

    def assert_chunks_still_lent_after(self, integrity_checks_before: int) -> dict:
        """Once harvest's idle integrity check has run after the path: the server lives,
        chunks are lent, that check passed, no leak check fired."""
        status = _wait_for(lambda: (s := _status(self.port))["kv"]["integrity_checks_total"] > integrity_checks_before
                           and s, timeout_s=60)
        assert status, _status(self.port)
        assert self.srv.process.poll() is None
        assert status["kv"]["integrity_error"] is None and status["kv"]["chunks_lent"] > 0, status["kv"]
        assert status["trainer"]["error"] is None
        log = self.log()
        assert "leak detected" not in log.lower()
        harvest_problems = [line for line in log.splitlines() if "harvest pid=" in line and ("ERROR" in line or "WARNING" in line)]
        assert not harvest_problems, harvest_problems
        return status


def _launch_lent(model_path, directory, server_args, env_changes) -> tuple[server.Server, int]:
    port = server.free_port()
    config = _harvest_config(directory / "harvest", model_path, port)
    env = {**server.cpu_server_env(), **env_changes}
    srv = server.launch(server_args + ["--enable-harvest", "--harvest-config", str(config)],
                        log_path=directory / "sglang.log", env=env)
    lent = _wait_for(lambda: (s := _status(port))["kv"]["chunks_lent"] > 0
                     and (s["trainer"]["stats"] or {}).get("global_step", 0) > 0 and s, timeout_s=120)
    if not lent:
        srv.stop()
        pytest.fail(f"no chunk lent or no training step: {_status(port)}")
    return srv, port


@pytest.fixture(scope="module")
def lent_server(tiny_llama_path, tmp_path_factory):
    # At most 4 running requests: the rest wait in SGLang's queue (queued aborts).
    srv, port = _launch_lent(tiny_llama_path, tmp_path_factory.mktemp("kv_paths"),
                             _args(tiny_llama_path, "--max-running-requests", "4"), CHECKED_ENV)
    with srv:
        yield LentServer(srv, port)


@pytest.fixture(scope="module")
def expected(tiny_llama_path):
    """transformers' greedy continuations of PROMPTS."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for ids in PROMPTS:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def _generate(srv, ids, max_new_tokens, rid=None):
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    if rid is not None:
        payload["rid"] = rid
    return srv.post("/generate", payload, timeout=300)


# First: the module's server starts with the first test that asks for it, and is stopped
# only after the last; this one's server should not share the two cores with it.
def test_decode_instance_retraction_backup_and_aborts(tiny_llama_path, tmp_path):
    # Forced retraction on a decode instance backs each retracted request's KV up to CPU
    # tensors and loads it into newly allocated slots when it runs again. (The fake
    # transfer writes no prompt KV, so outputs are not compared; lengths are.)
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    def generate(room, max_new_tokens, rid=None):
        payload = {"input_ids": [5 + (room * 11 + j) % 300 for j in range(12 + room % 9)],
                   "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
                   "bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": room}
        if rid is not None:
            payload["rid"] = rid
        return lent.srv.post("/generate", payload, timeout=300)["meta_info"]

    srv, port = _launch_lent(tiny_llama_path, tmp_path, server.cpu_server_args(tiny_llama_path, decode_instance=True),
                             CHECKED_ENV)
    with srv:
        lent = LentServer(srv, port)
        checks = lent.kv()["integrity_checks_total"]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            completed = list(pool.map(lambda room: generate(room, 24), range(16)))
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            replies = [pool.submit(generate, 100 + i, LONG_NEW_TOKENS, f"long-{i}") for i in range(6)]
            time.sleep(1.5)
            every = lent.abort_all(replies)
            aborted = [reply.result() for reply in replies]
        lent.assert_chunks_still_lent_after(checks)
        log = lent.log()
    assert [(meta["finish_reason"]["type"], meta["completion_tokens"]) for meta in completed] == [("length", 24)] * 16
    assert every and set(every) == {200} and [meta["finish_reason"]["type"] for meta in aborted] == ["abort"] * 6
    assert "Testing retraction" in log and "'disaggregation_decode_retraction_backup': 'cpu_tensor'" in log


def test_forced_decode_retraction_keeps_outputs_and_lent_chunks(lent_server, expected):
    # retract_decode frees the retracted requests' own slots; the check before it
    # (check_decode_capacity) takes lent chunks back only when memory is short.
    checks = lent_server.kv()["integrity_checks_total"]
    assert _generate_all(lent_server.srv, PROMPTS, 8) == expected
    lent_server.assert_chunks_still_lent_after(checks)
    assert "Testing retraction" in lent_server.log()


def test_aborts_of_running_and_queued_requests(lent_server, expected):
    # Aborted requests free only slots they hold, never a lent chunk's.
    checks = lent_server.kv()["integrity_checks_total"]
    rids = [f"long-{i}" for i in range(8)]  # 4 run, 4 wait
    steps = lent_server.decode_steps()
    with concurrent.futures.ThreadPoolExecutor(len(rids)) as pool:
        replies = [pool.submit(_generate, lent_server.srv, PROMPTS[i], LONG_NEW_TOKENS, rid) for i, rid in enumerate(rids)]
        lent_server.wait_decoding(steps)
        one = lent_server.post_for_status("/abort_request", {"rid": rids[0]})
        time.sleep(0.3)
        every = lent_server.abort_all(replies)
        outcomes = [reply.result()["meta_info"] for reply in replies]
    assert one == 200 and every and set(every) == {200}
    assert [meta["finish_reason"]["type"] for meta in outcomes] == ["abort"] * len(rids), outcomes
    assert any(meta["completion_tokens"] > 0 for meta in outcomes)  # some were running
    assert _generate_all(lent_server.srv, PROMPTS, 8) == expected
    lent_server.assert_chunks_still_lent_after(checks)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_generation_and_continue(lent_server, mode):
    # retract: every running request frees its slots and waits to run again (recomputed);
    # in place: nothing is freed, the scheduler stops until /continue_generation.
    prompts = PROMPTS[:6]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        undisturbed = [out["output_ids"] for out in pool.map(lambda ids: _generate(lent_server.srv, ids, PAUSED_NEW_TOKENS),
                                                               prompts)]
        checks, steps = lent_server.kv()["integrity_checks_total"], lent_server.decode_steps()
        replies = [pool.submit(_generate, lent_server.srv, ids, PAUSED_NEW_TOKENS) for ids in prompts]
        lent_server.wait_decoding(steps)
        paused = lent_server.srv.post("/pause_generation", {"mode": mode})
        in_flight = sum(not reply.done() for reply in replies)
        lent_while_paused = lent_server.kv()["chunks_lent"]
        time.sleep(1.0)
        resumed = lent_server.srv.post("/continue_generation", {})
        outputs = [reply.result()["output_ids"] for reply in replies]
    assert paused["status"] == resumed["status"] == "ok"
    assert in_flight and lent_while_paused > 0
    assert outputs == undisturbed
    lent_server.assert_chunks_still_lent_after(checks)


def test_release_and_resume_memory_occupation(lent_server, expected):
    # Without --enable-memory-saver (refused with harvest) the release flushes the cache
    # (clear(): the lent chunks' slots leave the free list again) and pauses nothing.
    checks, clears = lent_server.kv()["integrity_checks_total"], lent_server.pool_clears()
    assert lent_server.srv.post("/release_memory_occupation", {}) is None  # SGLang's reply has no body
    assert lent_server.srv.post("/resume_memory_occupation", {}) is None
    assert _wait_for(lambda: lent_server.pool_clears() == clears + 1, timeout_s=10)
    assert _generate_all(lent_server.srv, PROMPTS, 8) == expected
    lent_server.assert_chunks_still_lent_after(checks)


def _serialized(named_tensors) -> str:
    """SGLang's /update_weights_from_tensor payload from another process: CPU tensors in
    shared memory the server opens by name (file descriptors cannot be passed to it)."""
    import torch.multiprocessing
    from sglang.srt.utils import MultiprocessingSerializer

    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        return MultiprocessingSerializer.serialize(named_tensors, output_str=True)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def test_weight_updates_flush_with_chunks_lent(lent_server, expected, tiny_llama_path):
    # Each update loads in place, then flushes the cache (clear()).
    from safetensors.torch import load_file

    checks, clears = lent_server.kv()["integrity_checks_total"], lent_server.pool_clears()
    srv = lent_server.srv
    from_disk = srv.post("/update_weights_from_disk", {"model_path": str(tiny_llama_path)})
    assert from_disk["success"], from_disk
    assert _generate_all(srv, PROMPTS, 8) == expected

    lm_head = load_file(next(tiny_llama_path.glob("*.safetensors")))["lm_head.weight"]
    negated, original = [("lm_head.weight", -lm_head)], [("lm_head.weight", lm_head)]
    assert srv.post("/begin_weight_update", {})["success"]
    changed = srv.post("/update_weights_from_tensor", {"serialized_named_tensors": [_serialized(negated)]})
    changed_outputs = _generate_all(srv, PROMPTS, 8)
    restored = srv.post("/update_weights_from_tensor", {"serialized_named_tensors": [_serialized(original)]})
    restored_outputs = _generate_all(srv, PROMPTS, 8)
    assert srv.post("/end_weight_update", {})["success"]
    assert changed["success"] and restored["success"], (changed, restored)
    assert changed_outputs != expected and restored_outputs == expected  # the updates took effect
    assert _wait_for(lambda: lent_server.pool_clears() == clears + 3, timeout_s=10)
    lent_server.assert_chunks_still_lent_after(checks)
