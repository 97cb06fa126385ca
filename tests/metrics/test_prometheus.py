"""Every dashboard query, evaluated by a real Prometheus scraping two real servers.

Two CPU SGLang servers with harvest enabled and a real LoRA job each (the tiny model, the
demo dataset, an evaluation set so eval_loss exists), distinct harvest metrics ports, some
requests so decode steps happen; a Prometheus (temporary config and storage) scrapes both
harvest endpoints every second as job "harvest". Then every query of
harvest/metrics/dashboards/harvest.json, with Grafana's variables substituted, goes through
Prometheus's HTTP API, once with every variable at All (".*") and once with one server,
model and job picked. A query fails the test when Prometheus refuses it, when its result is
empty, or when it duplicates or merges series: fleet panels give one series; every other
series carries its ``instance`` (and per-job ones their ``job_name``), no two series share
their labels, and every selected server is there.

``make test`` installs Prometheus (the Debian package, 2.42 on bookworm) when it is missing
(scripts/ensure_test_tools.sh); alone: ``.venv/bin/python -m pytest -m prometheus
tests/metrics/test_prometheus.py`` (about 2 minutes).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from harvest import colocation_config
from harvest.sglang import server

pytestmark = [
    pytest.mark.prometheus, pytest.mark.slow, pytest.mark.sglang, pytest.mark.timeout(900),
    pytest.mark.skipif(shutil.which("prometheus") is None,
                       reason="the prometheus binary is not on PATH (scripts/ensure_test_tools.sh installs it: apt-get install prometheus)"),
]

DASHBOARD = Path(__file__).resolve().parents[2] / "harvest" / "metrics" / "dashboards" / "harvest.json"
RATE_INTERVAL = "15s"  # what Grafana's $__rate_interval gives for a 1 s scrape interval at this zoom
SCRAPES_IN_WINDOW = 5  # scrapes of each server within RATE_INTERVAL before the queries (a rate needs 2)
SCRAPED_WITHIN_S = 120  # the longest wait for them
# Metrics NVML feeds: absent on a machine without an NVIDIA driver (nothing is faked).
GPU_ONLY = ("harvest_gpu_",)
# Metrics of jobs a fleet of servers trains together: these servers' jobs train alone
# (tests/fleet/test_sglang_fleet.py checks the fleet series on two servers sharing a job).
FLEET_JOB_ONLY = ("harvest_fleet_",)
# A job with an evaluation set, evaluating often: harvest_trainer_eval_loss exists early.
EVAL_KEYS = {"val_size": 4, "eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 2}


def _get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def _wait_for(predicate, timeout_s: float, interval_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (urllib.error.URLError, OSError, KeyError, TypeError, ValueError):
            value = None
        if value:
            return value
        time.sleep(interval_s)
    return None


def _job_ready(status: dict) -> bool:
    """The server's job has trained and evaluated (the per-job series all have values)."""
    stats = (status.get("trainer") or {}).get("stats") or {}
    return stats.get("global_step", 0) >= 2 and stats.get("eval_loss") is not None


class Prometheus:
    def __init__(self, directory: Path, targets: list[str]):
        self.port = server.free_port()
        config = directory / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "harvest", "static_configs": [{"targets": targets}]}],
        }))
        self.log_path = directory / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"], stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self.evaluated_at: float | None = None  # where queries are evaluated (None: now)
        if not _wait_for(lambda: urllib.request.urlopen(self.url + "/-/ready", timeout=2).status == 200, 60, 0.5):
            self.stop()
            raise RuntimeError(f"prometheus not ready after 60 s:\n{self.log_tail()}")

    def query(self, expr: str, at: float | None = None) -> dict:
        """The API's whole answer (status, data or error) of an instant query at Unix time
        ``at``, else at ``evaluated_at``, else now."""
        at = self.evaluated_at if at is None else at
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr, **({"time": at} if at else {})})
        try:
            return _get_json(url)
        except urllib.error.HTTPError as exc:  # 400/422: the error is in the body
            return json.loads(exc.read())

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


def _launch(model_path: Path, directory: Path) -> tuple[server.Server, int]:
    metrics_port = server.free_port()
    config = colocation_config.write(directory, model_path, metrics_port=metrics_port, job_keys=EVAL_KEYS)
    args = server.cpu_server_args(model_path, max_total_tokens=8192) + [
        "--disable-radix-cache", "--enable-harvest", "--harvest-config", str(config)]
    return server.launch(args, log_path=directory / "sglang.log"), metrics_port


def _send_requests(servers: list[server.Server], stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        for srv in servers:
            try:
                srv.post("/generate", {"input_ids": [5 + i % 50, 6, 7, 8, 9], "sampling_params": {
                    "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}, timeout=60)
            except (urllib.error.URLError, OSError):
                pass
        i += 1
        stop.wait(0.2)


@pytest.fixture(scope="module")
def fleet(tiny_llama_path, tmp_path_factory):
    """(prometheus, {instance: status}) once Prometheus holds SCRAPES_IN_WINDOW scrapes, in
    the rate window, of two servers that decode and train."""
    root = tmp_path_factory.mktemp("fleet")
    servers: list[server.Server] = []
    prometheus = None
    stop = threading.Event()
    sender = None
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            launches = [pool.submit(_launch, tiny_llama_path, root / f"server{i}") for i in range(2)]
            started = []
            for launch in launches:
                try:
                    started.append(launch.result())
                except Exception:
                    for other in launches:
                        if other.done() and other.exception() is None:
                            other.result()[0].stop()
                    raise
        servers = [srv for srv, _ in started]
        ports = [port for _, port in started]
        sender = threading.Thread(target=_send_requests, args=(servers, stop), daemon=True)
        sender.start()
        for srv, port in started:
            ready = _wait_for(lambda port=port: _job_ready(_get_json(f"http://127.0.0.1:{port}/harvest/status")), 300, 0.25)
            assert ready, f"the job on {srv.base_url} did not train and evaluate in 300 s:\n{srv.log_tail()}"
        targets = [f"127.0.0.1:{port}" for port in ports]
        prometheus = Prometheus(root, targets)
        up = _wait_for(lambda: len([r for r in prometheus.query('up{job="harvest"} == 1')["data"]["result"]]) == 2, 60, 0.25)
        assert up, f"prometheus does not scrape both servers:\n{prometheus.log_tail()}"
        scraped = _wait_for(lambda: _scraped_busy(prometheus, len(targets)), SCRAPED_WITHIN_S, 0.5)
        assert scraped, f"no {SCRAPES_IN_WINDOW} scrapes of both busy servers in {SCRAPED_WITHIN_S} s:\n{prometheus.log_tail()}"
        # Every test queries at that moment: a rate window that held decode and training
        # then may not later, when a loaded machine left the niced trainer no time in it.
        prometheus.evaluated_at = scraped
        statuses = {target: _get_json(f"http://{target}/harvest/status") for target in targets}
        yield prometheus, statuses
    finally:
        stop.set()
        if sender is not None:
            sender.join(timeout=90)
        if prometheus is not None:
            prometheus.stop()
        with concurrent.futures.ThreadPoolExecutor(max(1, len(servers))) as pool:
            list(pool.map(lambda srv: srv.stop(), servers))  # both at once


def _scraped_busy(prometheus: Prometheus, num_servers: int) -> float | None:
    """The Unix time at which the rate window held SCRAPES_IN_WINDOW scrapes of every
    server, over which each decoded and trained (what the dashboard's rates need to have a
    value, two samples, and the fleet row's latency and tokens/s to be above 0): now, or
    None if it did not."""
    window, now = RATE_INTERVAL, time.time()
    conditions = (
        f'count_over_time(up{{job="harvest"}}[{window}]) >= {SCRAPES_IN_WINDOW}',
        f'sum by (instance) (increase(harvest_decode_step_seconds_count{{job="harvest"}}[{window}])) > 0',
        f'sum by (instance) (rate(harvest_trainer_tokens_total{{job="harvest"}}[{window}])) > 0',
    )
    busy = all(len(prometheus.query(expr, at=now)["data"]["result"]) == num_servers for expr in conditions)
    return now if busy else None


def _dashboard_queries() -> list[tuple[str, str, str, str]]:
    """(row kind: fleet / server / job, panel title, legend, expression) of every query."""
    kind, out = "server", []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["type"] == "row":
            title = panel["title"].lower()
            kind = "fleet" if title.startswith("fleet") else "job" if title.startswith("jobs") else "server"
            continue
        out.extend((kind, panel["title"], t.get("legendFormat", ""), t["expr"]) for t in panel.get("targets", []))
    return out


def _substitute(expr: str, variables: dict[str, str]) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__range", "5m")
    for name in sorted(variables, key=len, reverse=True):  # $job_name before $job
        expr = expr.replace("$" + name, variables[name])
    assert "$" not in expr, expr
    return expr


def _problem(prometheus: Prometheus, kind: str, expr: str, instances: set[str], on_gpu: bool,
             fleet_jobs: bool = False) -> str | None:
    """What is wrong with the answer to ``expr`` (variables substituted), or None.
    ``fleet_jobs``: the servers run a fleet job (its series must be there too)."""
    answer = prometheus.query(expr)
    if answer.get("status") != "success":
        return f"refused: {answer.get('error')}"
    result = answer["data"]["result"]
    if not result:
        if not on_gpu and any(name in expr for name in GPU_ONLY):
            return None  # no NVML here
        if not fleet_jobs and any(name in expr for name in FLEET_JOB_ONLY):
            return None  # no fleet job here
        return "empty"
    labels = [{k: v for k, v in series["metric"].items() if k != "__name__"} for series in result]
    if kind == "fleet":
        return None if len(result) == 1 else f"{len(result)} series where the fleet has one: {labels}"
    # One series per labelled dimension and server: the same server twice (another scrape
    # job, another model label) or a series without its server is a merge.
    identities = [tuple(sorted((k, v) for k, v in lab.items() if k not in ("job", "model_name"))) for lab in labels]
    if len(set(identities)) != len(identities):
        return f"duplicated series: {labels}"
    if any("instance" not in lab for lab in labels):
        return f"series without their instance (merged across servers): {labels}"
    if {lab["instance"] for lab in labels} != instances:
        return f"servers {sorted({lab['instance'] for lab in labels})}, expected {sorted(instances)}"
    if kind == "job" and any("job_name" not in lab for lab in labels):
        return f"per-job series without job_name: {labels}"
    return None


def _problems(prometheus: Prometheus, variables: dict[str, str], instances: set[str], on_gpu: bool) -> list[str]:
    problems = []
    for kind, title, legend, expr in _dashboard_queries():
        problem = _problem(prometheus, kind, _substitute(expr, variables), instances, on_gpu)
        if problem is not None:
            problems.append(f"{title!r} [{legend}] {expr}: {problem}")
    return problems


def test_the_check_catches_merged_duplicated_empty_and_refused_queries(fleet):
    prometheus, statuses = fleet
    instances = set(statuses)
    bad = {
        "sum(rate(harvest_decode_step_seconds_count[15s]))": "merged across servers",
        "histogram_quantile(0.99, sum by (le) (rate(harvest_decode_step_seconds_bucket[15s])))": "merged across servers",
        'harvest_qos_target_seconds or label_replace(harvest_qos_target_seconds, "job", "again", "", "")': "duplicated",
        'harvest_qos_target_seconds{instance="nowhere"}': "empty",
        "rate(harvest_decode_step_seconds_count[1m)": "refused",
    }
    for expr, expected in bad.items():
        assert expected in (_problem(prometheus, "server", expr, instances, on_gpu=False) or ""), expr
    assert "where the fleet has one" in _problem(prometheus, "fleet", "harvest_qos_target_seconds", instances, False)
    assert _problem(prometheus, "server", "harvest_qos_target_seconds", instances, False) is None


def test_every_dashboard_query_answers_per_server_with_every_variable_at_all(fleet):
    prometheus, statuses = fleet
    on_gpu = not all(info["metric"]["device"].startswith("cpu")
                     for info in prometheus.query("harvest_build_info")["data"]["result"])
    variables = {"instance": ".*", "job": ".*", "model_name": ".*", "job_name": ".*"}
    problems = _problems(prometheus, variables, set(statuses), on_gpu)
    assert not problems, "\n".join(problems)


def test_every_dashboard_query_answers_for_one_picked_server_model_and_job(fleet):
    prometheus, statuses = fleet
    info = prometheus.query("harvest_build_info")["data"]["result"]
    assert {series["metric"]["instance"] for series in info} == set(statuses)
    assert all(series["metric"].get("model_name") for series in info), info  # the constant label
    picked = sorted(statuses)[0]
    model_name = next(series["metric"]["model_name"] for series in info if series["metric"]["instance"] == picked)
    job_names = prometheus.query(f'harvest_job_state{{instance="{picked}"}}')["data"]["result"]
    assert job_names, "no per-job series"
    variables = {"instance": picked, "job": "harvest", "model_name": model_name,
                 "job_name": job_names[0]["metric"]["job_name"]}
    on_gpu = not info[0]["metric"]["device"].startswith("cpu")
    problems = _problems(prometheus, variables, {picked}, on_gpu)
    assert not problems, "\n".join(problems)


def test_the_fleet_row_counts_both_servers_and_latency_is_measured(fleet):
    prometheus, statuses = fleet
    values = {}
    for kind, title, legend, expr in _dashboard_queries():
        if kind == "fleet":
            result = prometheus.query(_substitute(expr, {"instance": ".*", "job": ".*", "model_name": ".*", "job_name": ".*"}))
            values[legend] = float(result["data"]["result"][0]["value"][1])
    assert values["up"] == 2 and values["seen in range"] == 2, values
    assert math.isfinite(values["worst p99 over servers"]) and values["worst p99 over servers"] > 0, values
    assert values["tightest target"] == pytest.approx(0.040), values
    assert values["tokens/s, all servers"] > 0, values
