"""One fleet job trained by two real SGLang servers on CPU, under request traffic.

Both servers run harvest with the same job file settings naming the same rendezvous and
``job_id`` (the first member to start hosts the store, ``host_store: auto``), periodic
sync every 2 s. While both serve requests:

- every request's greedy output equals a server's without harvest (the reference);
- no request fails and decode never retracts a request for lack of KV memory;
- the fleet averages: rounds with both members, both servers contribute tokens, the
  fleet's committed steps grow; /harvest/status, /metrics (harvest_fleet_*) and
  `harvest top` show it;
- the dashboard's fleet-job row answers per server and job in a real Prometheus scraping
  both servers (when the ``prometheus`` binary is on PATH);
- decode QoS during the traffic (TPOT p50/p99 against the target, violation rate) is
  recorded, printed and written to ``fleet-qos.json`` in the test's tmp dir. There is no
  timing assertion: the two servers and their trainers share 2 noisy cores here (the
  solo-job tests assert none either); ``HARVEST_FLEET_SOLO_BASELINE=1`` also runs the same
  traffic on two servers with a solo job each, for comparison.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from harvest import colocation_config
from harvest.sglang import server
from tests.colocate.test_sglang_colocation import RETRACTION
from tests.metrics.test_prometheus import _wait_for  # tolerates a server not answering yet

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]

NUM_PROMPTS = 24
MAX_NEW_TOKENS = 8
# Seconds of requests on both servers: in `make test` at least MIN_TRAFFIC_S (three sync
# intervals), ending once the fleet has shown everything the test checks (see
# `_traffic_shows_enough`; 8-15 s on an idle 2-core machine). MAX_TRAFFIC_S only bounds a
# fleet that never shows it, so a loaded machine, on which rounds and answers come slower,
# gets the time it needs. docs/fleet.md's QoS table is from HARVEST_FLEET_TRAFFIC_S=30
# runs (exactly that long: more steps behind each p99), and with the solo baseline
# (HARVEST_FLEET_SOLO_BASELINE=1) both run exactly TRAFFIC_S.
TRAFFIC_S = float(os.environ.get("HARVEST_FLEET_TRAFFIC_S", "15"))
FIXED_TRAFFIC = "HARVEST_FLEET_TRAFFIC_S" in os.environ or os.environ.get("HARVEST_FLEET_SOLO_BASELINE") == "1"
MIN_TRAFFIC_S = TRAFFIC_S if FIXED_TRAFFIC else 6.0
MAX_TRAFFIC_S = TRAFFIC_S if FIXED_TRAFFIC else 150.0
CLIENTS_PER_SERVER = 2
PAUSE_S = 0.15  # between one client's requests: decode is busy, not saturated (the trainer gets gaps)
TARGET_TPOT_MS = 40.0
JOB = "shared"
FLEET = {"job_id": "sglang-fleet", "sync": "periodic", "sync_interval_s": 2.0, "heartbeat_s": 0.5,
         "dead_after_s": 10.0, "collective_timeout_s": 20.0}


def _prompts():
    return [[5 + (i * 11 + j) % 300 for j in range(10 + i % 7)] for i in range(NUM_PROMPTS)]


def _generate(srv, ids):
    out = srv.post("/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}}, timeout=120)
    return out["output_ids"]


def _get_json(url, timeout=10.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def _status(port):
    return _get_json(f"http://127.0.0.1:{port}/harvest/status")


def _job(status):
    return next((job for job in (status.get("trainer") or {}).get("jobs") or [] if job["name"] == JOB), None)


def _fleet(port):
    job = _job(_status(port))
    return (job or {}).get("fleet")


def _metrics(port):
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, s.labels.get("job_name")): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _last_seq(port):
    steps = _get_json(f"http://127.0.0.1:{port}/harvest/steps?limit=1")["steps"]
    return steps[-1]["seq"] if steps else -1


def _steps_since(port, seq):
    return _get_json(f"http://127.0.0.1:{port}/harvest/steps?since_seq={seq}")["steps"]


def _quantile(ordered, q):
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _qos(steps, before, after):
    """Decode QoS of the traffic window: from its decode steps (/harvest/steps) and from
    the QoS counters' increase (/harvest/status ``qos``)."""
    decode = sorted(step["measured_ms"] for step in steps if step["is_decode"] and step["measured_ms"] is not None)
    measured = after["qos"]["num_measurements"] - before["qos"]["num_measurements"]
    violations = after["qos"]["num_violations"] - before["qos"]["num_violations"]
    return {
        "target_tpot_ms": after["qos"]["target_tpot_ms"],
        "decode_steps": len(decode),
        "tpot_p50_ms": round(_quantile(decode, 0.5), 3) if decode else None,
        "tpot_p99_ms": round(_quantile(decode, 0.99), 3) if decode else None,
        "decode_steps_over_target": sum(1 for ms in decode if ms > after["qos"]["target_tpot_ms"]),
        "steps_with_trainer": sum(1 for step in steps if step["is_decode"] and step["trainer_ran"]),
        "violation_rate": violations / measured if measured else None,  # the controller's own count
        "violation_rate_since_start": after["qos"]["violation_rate"],
    }


def _launch(model_path, directory, harvest_keys):
    port = server.free_port()
    config = colocation_config.write(directory, model_path, metrics_port=port, target_tpot_ms=TARGET_TPOT_MS,
                                     jobs={JOB: harvest_keys})
    args = server.cpu_server_args(model_path, max_total_tokens=16384) + [
        "--disable-radix-cache", "--enable-harvest", "--harvest-config", str(config)]
    return server.launch(args, log_path=directory / "sglang.log"), port


def _launch_both(model_path, root, harvest_keys):
    """Two servers started together (their members join the fleet at about the same time)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        launches = [pool.submit(_launch, model_path, root / f"server{i}", harvest_keys) for i in range(2)]
        concurrent.futures.wait(launches)
    failed = [launch.exception() for launch in launches if launch.exception() is not None]
    if failed:
        for launch in launches:
            if launch.exception() is None:
                launch.result()[0].stop()
        raise failed[0]
    return [launch.result() for launch in launches]


class Traffic:
    """``CLIENTS_PER_SERVER`` clients per server, each cycling through the prompts with a
    pause between requests; every output and failure is kept."""

    def __init__(self, servers):
        self.servers = servers
        self.stop = threading.Event()
        self.results: list[tuple[int, int, list[int]]] = []  # (server, prompt, output)
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i, c), daemon=True)
                         for i in range(len(servers)) for c in range(CLIENTS_PER_SERVER)]

    def _client(self, index, client):
        prompts = _prompts()
        number = client * 5
        while not self.stop.is_set():
            prompt = number % len(prompts)
            try:
                output = _generate(self.servers[index], prompts[prompt])
                with self._lock:
                    self.results.append((index, prompt, output))
            except (urllib.error.URLError, OSError, KeyError, ValueError) as error:
                with self._lock:
                    self.failures.append(f"server{index} prompt {prompt}: {type(error).__name__}: {error}")
            number += 1
            self.stop.wait(PAUSE_S)

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=150)


def _dashboard_problems(prometheus, ports):
    """The dashboard's fleet-job queries, with every variable at All and with one server
    and job picked: what is wrong with each answer (tests/metrics/test_prometheus.py's
    check: not refused, not empty, one series per server and job, none merged)."""
    from tests.metrics.test_prometheus import _dashboard_queries, _problem, _substitute

    targets = {f"127.0.0.1:{port}" for port in ports}
    picked = sorted(targets)[0]
    problems, checked = [], 0
    for variables, instances in (({"instance": ".*", "job": ".*", "model_name": ".*", "job_name": ".*"}, targets),
                                 ({"instance": picked, "job": "harvest", "model_name": ".*", "job_name": JOB}, {picked})):
        for kind, title, legend, expr in _dashboard_queries():
            if "harvest_fleet_" not in expr:
                continue
            checked += 1
            problem = _problem(prometheus, kind, _substitute(expr, variables), instances, False, fleet_jobs=True)
            if problem is not None:
                problems.append(f"{title!r} [{legend}] {expr}: {problem}")
    assert checked >= 2 * 5, checked
    return problems


def _harvest_lines(log):
    return [line for line in log.splitlines() if "harvest pid=" in line and ("ERROR" in line or "WARNING" in line)]


def _fleet_lines(logs):
    """Both servers' fleet lines (rounds, who closed them with whom, drops): what a failure
    needs to be explained once the servers' logs are gone."""
    return [[line for line in log.splitlines() if "fleet job" in line] for log in logs]


def _traffic_shows_enough(traffic, statuses, at_start, seen, prometheus):
    """The traffic has shown what the fleet test checks of it: each server answered 10
    requests, held a round with both members and committed steps during it, and (when a
    Prometheus scrapes them) the fleet series have 3 samples each in the dashboard's rate
    window. Polled once a second: the traffic then ends early."""
    with traffic._lock:
        answered = [sum(1 for index, _, _ in traffic.results if index == i) for i in range(len(statuses))]
    if min(answered) < 10 or traffic.failures:
        return False
    for index, status in enumerate(statuses):
        fleet = _job(status)["fleet"]
        if not (fleet["rounds"] > at_start[index]["rounds"] and fleet["rounds"] >= 2 and fleet["round"] >= 2
                and fleet["committed_steps"] > at_start[index]["committed_steps"]
                and any(view["members"] == 2 for view in seen[index])):
            return False
    if prometheus is None:
        return True
    from tests.metrics.test_prometheus import RATE_INTERVAL

    now = time.time()
    answer = prometheus.query(f'count_over_time(harvest_fleet_rounds_total{{job_name="{JOB}"}}[{RATE_INTERVAL}]) >= 3',
                              at=now)
    if answer.get("status") != "success" or len(answer["data"]["result"]) != len(statuses):
        return False
    prometheus.evaluated_at = now  # the dashboard's queries are checked at this moment, not later
    return True


@pytest.fixture(scope="module")
def reference(plain_server_outputs):
    """Greedy outputs of every prompt by a server without harvest (computed once, on the
    server tests/colocate/test_sglang_colocation.py's reference comes from: tests/conftest.py)."""
    return plain_server_outputs["fleet"]


def _serve_traffic(ports, servers, on_poll=None, enough=None):
    """Requests on both servers for MAX_TRAFFIC_S seconds, or for at least MIN_TRAFFIC_S and
    until ``enough(traffic, statuses)``; (traffic, per-server QoS, statuses before and
    after, seconds of traffic). ``on_poll(index, status)`` once a second per server meanwhile."""
    seqs = [_last_seq(port) for port in ports]
    before = [_status(port) for port in ports]
    started = time.monotonic()
    with Traffic(servers) as traffic:
        while time.monotonic() - started < MAX_TRAFFIC_S:
            time.sleep(1.0)
            statuses = [_status(port) for port in ports]
            if on_poll is not None:
                for index, status in enumerate(statuses):
                    on_poll(index, status)
            if (enough is not None and time.monotonic() - started >= MIN_TRAFFIC_S
                    and enough(traffic, statuses)):
                break
        traffic_s = time.monotonic() - started
    after = [_status(port) for port in ports]
    qos = [_qos(_steps_since(port, seq), b, a) for port, seq, b, a in zip(ports, seqs, before, after)]
    return traffic, qos, before, after, traffic_s


def _check_outputs(traffic, reference):
    assert not traffic.failures, traffic.failures[:10]
    assert len(traffic.results) >= 10 * len(traffic.servers), len(traffic.results)
    wrong = [(index, prompt) for index, prompt, output in traffic.results if output != reference[prompt]]
    assert not wrong, f"{len(wrong)} of {len(traffic.results)} outputs differ from the reference: {wrong[:10]}"
    per_server = [sum(1 for index, _, _ in traffic.results if index == i) for i in range(len(traffic.servers))]
    assert all(per_server), per_server
    return per_server


def _write_numbers(tmp_path, name, numbers):
    path = tmp_path / name
    path.write_text(json.dumps(numbers, indent=1))
    print(f"\n{json.dumps(numbers, indent=1)}\nwritten to {path}")


def test_two_servers_train_one_fleet_job_while_serving(tiny_llama_path, tmp_path, reference):
    rendezvous = f"127.0.0.1:{server.free_port()}"
    harvest_keys = {"fleet": {"rendezvous": rendezvous, **FLEET}}
    started = time.monotonic()
    (srv0, port0), (srv1, port1) = _launch_both(tiny_llama_path, tmp_path, harvest_keys)
    servers, ports = [srv0, srv1], [port0, port1]
    seen: list[list[dict]] = [[], []]  # every fleet view polled, per server
    prometheus = None
    try:
        # Both members joined, a round held both, and both trained something.
        joined = _wait_for(lambda: all((f := _fleet(port)) and f["joined"] and f["members"] == 2
                                       and f["tokens_contributed"] > 0 for port in ports), 300)
        assert joined, [_fleet(port) for port in ports] + [srv.log_tail() for srv in servers]
        ready_s = time.monotonic() - started
        if shutil.which("prometheus") is not None:
            from tests.metrics.test_prometheus import Prometheus

            prometheus = Prometheus(tmp_path, [f"127.0.0.1:{port}" for port in ports])
        at_start = [_fleet(port) for port in ports]
        traffic, qos, before, after, traffic_s = _serve_traffic(
            ports, servers, on_poll=lambda index, status: seen[index].append(_job(status)["fleet"]),
            enough=lambda traffic, statuses: _traffic_shows_enough(traffic, statuses, at_start, seen, prometheus))
        at_end = [_job(status)["fleet"] for status in after]
        metrics = [_metrics(port) for port in ports]
        dashboard = _dashboard_problems(prometheus, ports) if prometheus is not None else None
        top = subprocess.run([sys.executable, "-m", "harvest.cli", "top", "--once", *(f"127.0.0.1:{p}" for p in ports)],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "220"})
        logs = [srv.log_path.read_text(errors="replace") for srv in servers]
    finally:
        if prometheus is not None:
            prometheus.stop()
        # The member hosting the store last: the other leaves while the store is still there.
        hosts = [i for i in (0, 1) if (_wait_for(lambda i=i: _fleet(ports[i]), 1) or {}).get("hosted_store")]
        for index in sorted((0, 1), key=lambda i: i in hosts):
            servers[index].stop(timeout=60)

    numbers = {
        "servers": [{
            "store_host": at_end[index]["hosted_store"],
            "requests": sum(1 for i, _, _ in traffic.results if i == index),
            "tokens_contributed": at_end[index]["tokens_contributed"],
            "tokens_contributed_during_traffic": at_end[index]["tokens_contributed"] - at_start[index]["tokens_contributed"],
            "rounds": at_end[index]["rounds"], "rounds_during_traffic": at_end[index]["rounds"] - at_start[index]["rounds"],
            "rounds_failed": at_end[index]["rounds_failed"], "rounds_missed": at_end[index]["rounds_missed"],
            "fleet_round": at_end[index]["round"], "members": at_end[index]["members"],
            "committed_steps_before_traffic": at_start[index]["committed_steps"],
            "committed_steps_after_traffic": at_end[index]["committed_steps"],
            "max_staleness_s_seen": max((f["staleness_s"] for f in seen[index] if f["staleness_s"] is not None),
                                        default=None),
            "trainer_tokens_seen": _job(after[index])["tokens_seen"],
            **qos[index]} for index in (0, 1)],
        "traffic_s": round(traffic_s, 1), "clients_per_server": CLIENTS_PER_SERVER, "pause_s": PAUSE_S,
        "sync_interval_s": FLEET["sync_interval_s"], "ready_s": round(ready_s, 1),
    }
    _write_numbers(tmp_path, "fleet-qos.json", numbers)

    # Serving is unaffected: the reference's greedy outputs, nothing failed, nothing retracted.
    _check_outputs(traffic, reference)
    for log in logs:
        assert RETRACTION not in log
    # The fleet averaged: both servers in rounds of two, during the traffic too.
    for index in (0, 1):
        fleet = at_end[index]
        assert fleet["job_id"] == FLEET["job_id"] and fleet["sync"] == "periodic", fleet
        assert fleet["rounds"] >= 2 and fleet["round"] >= 2 and fleet["rounds"] > at_start[index]["rounds"], fleet
        assert any(view["members"] == 2 for view in seen[index]), (seen[index], _fleet_lines(logs))
        assert fleet["tokens_contributed"] > 0, fleet
        assert fleet["rounds_failed"] == 0, (fleet, _harvest_lines(logs[index]))
        assert fleet["committed_steps"] > at_start[index]["committed_steps"], (at_start[index], fleet)
        assert fleet["member_id"] != at_end[1 - index]["member_id"]
        # The job's progress is the fleet's: committed steps plus this member's unsynced ones.
        job = _job(after[index])
        assert job["global_step"] == min(job["total_steps"], fleet["committed_steps"] + fleet["unsynced_steps"]), job
        assert job["state"] == "running" and job["error"] is None, job
    assert [f["hosted_store"] for f in at_end].count(True) == 1, at_end
    assert not any(_harvest_lines(log) for log in logs), [_harvest_lines(log) for log in logs]
    # Both logged their rounds with two members.
    for log in logs:
        assert "member(s)" in log and " 2 member(s)" in log, log[-3000:]
    # /metrics: the fleet series of the job, per server.
    for index, samples in enumerate(metrics):
        assert samples[("harvest_fleet_members", JOB)] == 2, index
        assert samples[("harvest_fleet_round", JOB)] >= 2
        assert samples[("harvest_fleet_tokens_contributed_total", JOB)] > 0
        assert samples[("harvest_fleet_rounds_total", JOB)] >= 2
        assert samples[("harvest_fleet_rounds_failed_total", JOB)] == 0
        assert samples[("harvest_fleet_committed_steps", JOB)] > 0
        assert 0 <= samples[("harvest_fleet_staleness_seconds", JOB)] < 60
    # The dashboard's fleet-job row, through a real Prometheus.
    if dashboard is None:
        print("prometheus is not on PATH: the dashboard's fleet-job queries were not run")
    assert not dashboard, "\n".join(dashboard)
    # harvest top: the job on both servers with its fleet view.
    assert top.returncode == 0, top.stderr
    rows = [line for line in top.stdout.splitlines() if JOB in line]
    assert len(rows) == 2 and all("2 members" in row for row in rows), top.stdout


@pytest.mark.skipif(os.environ.get("HARVEST_FLEET_SOLO_BASELINE") != "1",
                    reason="a baseline for the fleet test's QoS numbers: HARVEST_FLEET_SOLO_BASELINE=1 runs it")
def test_solo_job_baseline_under_the_same_traffic(tiny_llama_path, tmp_path, reference):
    """The same two servers and traffic, each server with a job of its own (no fleet)."""
    (srv0, port0), (srv1, port1) = _launch_both(tiny_llama_path, tmp_path, {})
    servers, ports = [srv0, srv1], [port0, port1]
    try:
        ready = _wait_for(lambda: all((_job(_status(port)) or {}).get("global_step", 0) > 0 for port in ports), 300)
        assert ready, [srv.log_tail() for srv in servers]
        at_start = [_job(_status(port)) for port in ports]
        traffic, qos, _, after, traffic_s = _serve_traffic(ports, servers)
        logs = [srv.log_path.read_text(errors="replace") for srv in servers]
    finally:
        for srv in servers:
            srv.stop(timeout=60)
    numbers = {"servers": [{
        "requests": sum(1 for i, _, _ in traffic.results if i == index),
        "tokens_trained_during_traffic": _job(after[index])["tokens_seen"] - at_start[index]["tokens_seen"],
        "steps_during_traffic": _job(after[index])["global_step"] - at_start[index]["global_step"],
        **qos[index]} for index in (0, 1)],
        "traffic_s": round(traffic_s, 1), "clients_per_server": CLIENTS_PER_SERVER, "pause_s": PAUSE_S}
    _write_numbers(tmp_path, "solo-qos.json", numbers)
    _check_outputs(traffic, reference)
    for log in logs:
        assert RETRACTION not in log
    print("median TPOT p99 over servers:", statistics.median(q["tpot_p99_ms"] for q in qos))
