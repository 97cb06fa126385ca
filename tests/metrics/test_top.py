"""`harvest top`: the pure render of canned status documents (full, old-style, errors),
fetching from a real local HTTP server (errors as rows, never tracebacks), argument
errors, and the live view in a real terminal (tmux)."""

from __future__ import annotations

import copy
import http.server
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from harvest import cli
from harvest.metrics import top

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

FULL = {
    "model_name": "Qwen2.5-7B-Instruct",
    "snapshot_age_s": 0.4,
    "tpot_ms": {"p50": 31.2, "p99": 38.9, "window_steps": 512},
    "qos": {"target_tpot_ms": 50.0, "violation_rate": 0.004},
    "settings": {"target_tpot_ms": 40.0, "max_lend_fraction": 0.8},
    "level": {"index": 1, "decode_sms": 96, "trainer_sms": 36, "partitioner": "green contexts"},
    "kv": {"chunks_total": 64, "chunks_lent": 12, "chunks_lending": 0, "integrity_error": None},
    "trainer": {
        "state": "running", "job": "alpaca-lora", "jobs_done": 0, "jobs_total": 3, "operator_paused": False,
        "error": None, "stats": None,
        "jobs": [
            {"name": "alpaca-lora", "state": "running", "weight": 2, "global_step": 420, "total_steps": 1000,
             "progress": 0.42, "eta_s": 3725.0, "loss": 1.2345, "eval_loss": 1.3012, "tokens_seen": 123456,
             "trainer_s": 900.0, "share": 0.66, "deficit_s": 12.5, "serve_as": "alpaca",
             "adapter": {"name": "alpaca", "state": "loaded", "error": None}, "error": None},
            {"name": "code-lora", "state": "queued", "weight": 1, "global_step": 0, "total_steps": 500,
             "progress": 0.0, "eta_s": None, "loss": None, "eval_loss": None, "tokens_seen": 0,
             "trainer_s": 0.0, "share": 0.34, "deficit_s": -3.0, "serve_as": None, "adapter": None, "error": None},
            {"name": "bad-job", "state": "failed", "weight": 1, "global_step": 7, "total_steps": 100,
             "progress": 0.07, "eta_s": None, "loss": 9.9, "eval_loss": None, "tokens_seen": 10, "trainer_s": 3.0,
             "share": 0.0, "deficit_s": None, "serve_as": None, "adapter": None, "error": "CUDA out of memory"},
        ],
    },
}

# What a server from before tpot_ms/settings/model_name/trainer.jobs reports (status.py today).
OLD = {
    "snapshot_age_s": 0.2,
    "trainer": {"state": "running", "job": "/srv/jobs/alpaca.yaml", "jobs_done": 0, "jobs_total": 1,
                "operator_paused": False, "error": None,
                "stats": {"state": "running", "global_step": 30, "total_steps": 120, "loss": 2.5, "eval_loss": None,
                          "tokens_seen": 999}},
    "level": {"index": 0, "decode_sms": 132, "trainer_sms": 0, "partitioner": "one level"},
    "kv": {"chunks_total": 10, "chunks_lent": 3, "chunks_lending": 0, "tokens_per_chunk": 256, "integrity_error": None},
    "qos": {"target_tpot_ms": 40.0, "num_measurements": 10, "violation_rate": 0.0},
}


def text_of(results, width: int = 200) -> str:
    from rich.console import Console

    console = Console(record=True, width=width, color_system=None)
    console.print(top.render(results))
    return console.export_text()


def row_of(text: str, *words: str) -> str:
    lines = [line for line in text.splitlines() if all(w in line for w in words)]
    assert len(lines) == 1, f"expected one line with {words}:\n{text}"
    return lines[0]


def test_full_document_shows_every_field():
    text = text_of([top.ServerResult("http://gpu1:18400", status=FULL)])
    server = row_of(text, "gpu1:18400", "Qwen2.5-7B-Instruct")
    assert "31.2/38.9 ≤40" in server  # the run-time target (settings), not the configured 50
    assert "0.4%" in server and "96/36" in server and "12/64" in server and "running" in server and "0.4s" in server
    job = row_of(text, "alpaca-lora")
    for expected in ("running", "42%", "420/1000", "1h02m", "1.234 (1.301)", "66%", "+12s", "alpaca (loaded)"):
        assert expected in job, (expected, job)
    assert "████" in job  # 4 of 10 cells of the bar
    queued = row_of(text, "code-lora")
    assert "queued" in queued and "0/500" in queued and "34%" in queued and "-3s" in queued
    assert "bad-job: CUDA out of memory" in text
    assert "servers 1 up, 0 down · jobs 1 running · 0 violating TPOT target" in text


def _fleet_view(**fields):
    """A fleet job's ``fleet`` section (harvest.fleet.member.FleetMember.stats())."""
    return {"member_id": "gpu1-4242-a1b2c3", "job_id": "shared-lora", "sync": "periodic", "joined": True, "rank": 0,
            "rounds": 10, "rounds_failed": 0, "rounds_missed": 0, "round": 12, "members": 3, "tokens_contributed": 4096,
            "last_round_at": 1_700_000_000.0, "last_round_tokens": 1024, "steps_requeued": 0, "hosted_store": True,
            "staleness_s": 4.2, "committed_steps": 340, "unsynced_steps": 5, "total_steps": 1000, **fields}


def _with_fleet_job(fleet: dict, **job_fields) -> dict:
    """FULL with a fleet job beside the solo ones: progress is the fleet's (committed steps
    plus this member's unsynced ones, as the trainer reports it)."""
    document = copy.deepcopy(FULL)
    step = fleet["committed_steps"] + fleet["unsynced_steps"]
    document["trainer"]["jobs"].append(
        {"name": "shared-lora", "state": "running", "weight": 1, "global_step": step, "total_steps": 1000,
         "progress": step / 1000, "eta_s": 600.0, "loss": 1.5, "eval_loss": None, "tokens_seen": 5000, "trainer_s": 40.0,
         "share": 0.2, "deficit_s": 0.0, "serve_as": None, "adapter": None, "error": None, "fleet": fleet, **job_fields})
    return document


def test_a_fleet_job_shows_its_fleet_view_and_the_fleets_progress():
    results = [top.ServerResult("http://gpu1:18400", status=_with_fleet_job(_fleet_view())),
               top.ServerResult("http://gpu2:18400", status=_with_fleet_job(
                   _fleet_view(rank=1, staleness_s=65.0, rounds_failed=2, committed_steps=338, unsynced_steps=1))),
               top.ServerResult("http://gpu3:18400", status=_with_fleet_job(
                   _fleet_view(joined=False, rounds=0, round=0, members=0, staleness_s=None, committed_steps=0,
                               unsynced_steps=0)))]
    text = text_of(results, width=220)
    assert "fleet" in row_of(text, "job", "state", "progress")  # the column's header
    first = row_of(text, "gpu1:18400", "shared-lora")
    for expected in ("r12 3 members 4s ago", "34%", "345/1000", "running"):
        assert expected in first, (expected, first)
    second = row_of(text, "gpu2:18400", "shared-lora")
    assert "r12 3 members 1m05s ago 2 failed" in second and "339/1000" in second, second
    assert "joining" in row_of(text, "gpu3:18400", "shared-lora")
    assert "alpaca-lora" in row_of(text, "gpu1:18400", "alpaca-lora", " - ")  # a solo job: no fleet view
    # A finished fleet job: no staleness (its member no longer syncs); one member: singular.
    done = _with_fleet_job(_fleet_view(members=1, committed_steps=1000, unsynced_steps=0, staleness_s=300.0),
                           state="finished", eta_s=None)
    row = row_of(text_of([top.ServerResult("http://gpu1:18400", status=done)]), "shared-lora")
    assert "r12 1 member" in row and "members" not in row and " ago" not in row and "100%" in row, row


def test_without_a_fleet_job_there_is_no_fleet_column_and_a_narrow_terminal_drops_it_before_loss():
    assert "fleet" not in text_of([top.ServerResult("http://gpu1:18400", status=FULL)], width=200)
    status = _with_fleet_job(_fleet_view())
    wide = text_of([top.ServerResult("http://gpu1:18400", status=status)], width=200)
    assert "r12 3 members" in wide
    narrow = text_of([top.ServerResult("http://gpu1:18400", status=status)], width=80)
    assert "r12" not in narrow and "1.234" in row_of(narrow, "alpaca-lora") and "345/1000" in row_of(narrow, "shared-lora")
    assert max(len(line.rstrip()) for line in narrow.splitlines()) <= 80


def test_old_style_document_and_missing_fields():
    text = text_of([top.ServerResult("http://old:18400", status=OLD),
                    top.ServerResult("http://bare:18400", status={"trainer": None})])
    server = row_of(text, "old:18400", "≤40")
    assert "-/- ≤40" in server and "132/0" in server and "3/10" in server and "0.0%" in server
    job = row_of(text, "/srv/jobs/alpaca.yaml")  # the one current job, from trainer.job + stats
    assert "25%" in job and "30/120" in job and "2.500" in job
    assert "absent" in row_of(text, "bare:18400")
    failed = copy.deepcopy(OLD)
    failed["trainer"].update(state="failed", error="OOM in layer 3")
    text = text_of([top.ServerResult("http://old:18400", status=failed)])
    assert text.count("OOM in layer 3") == 1 and "old:18400 trainer: OOM in layer 3" in text


def test_violation_integrity_stale_and_error_rows_are_marked():
    from rich.console import Console

    hot = copy.deepcopy(FULL)
    hot["tpot_ms"]["p99"] = 55.0
    hot["kv"]["integrity_error"] = "chunk 3 mapped twice"
    hot["kv"]["urgent_reclaims_total"] = 4  # decode waited for lent memory four times
    hot["snapshot_age_s"] = 30.0
    hot["trainer"]["jobs"][0]["adapter"] = {"name": "alpaca", "state": "failed", "error": "rank too large"}
    results = [top.ServerResult("http://hot:18400", status=hot),
               top.ServerResult("http://dead:18400", error="connection refused"),
               top.ServerResult("http://locked:18400", error="401 unauthorized (--api-key or HARVEST_API_KEY)")]
    text = text_of(results)
    assert "12/64 4 urgent INTEGRITY" in row_of(text, "hot:18400", "Qwen")
    hot["kv"]["admissions_held_total"] = 3  # three of them admissions that lent memory held back
    wide = text_of([top.ServerResult("http://hot:18400", status=hot)], width=200)
    assert "12/64 4 urgent (3 adm) INTEGRITY" in row_of(wide, "hot:18400", "Qwen")
    assert "connection refused" in row_of(text, "dead:18400") and "401 unauthorized" in row_of(text, "locked:18400")
    assert "alpaca failed" in row_of(text, "alpaca-lora", "running") and "alpaca-lora adapter: rank too large" in text
    assert "servers 1 up, 2 down · jobs 1 running · 1 violating TPOT target" in text
    console = Console(record=True, width=200, color_system="truecolor")
    console.print(top.render(results))
    styles = {str(seg.style) for seg in console._record_buffer if seg.text in ("55.0", "31.2")}
    assert any("red" in s for s in styles) and any("green" in s for s in styles)


def test_a_narrow_terminal_loses_whole_columns_least_useful_first():
    wide = text_of([top.ServerResult("http://gpu1:18400", status=FULL)], width=200)
    assert "weight" in wide and "████" in wide and "gpu1:18400   alpaca-lora" not in wide  # one server: no server column
    text = text_of([top.ServerResult("http://gpu1:18400", status=FULL)], width=80)
    job = row_of(text, "alpaca-lora")
    assert "42% 420/1000" in job and "1h02m" in job and "…" not in job  # whole cells, no ellipsis
    assert "████" not in text and "weight" not in text and "adapter" not in text
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80


@pytest.mark.parametrize("seconds, expected", [(None, "-"), (0.4, "0s"), (59, "59s"), (61, "1m01s"),
                                               (3725, "1h02m"), (2 * 86400 + 4 * 3600, "2d04h"), (-3, "-3s")])
def test_duration(seconds, expected):
    assert top.duration(seconds) == expected


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:9000", "http://127.0.0.1:9000"), ("gpu1", "http://gpu1:18400"),
    ("http://gpu1:1/harvest/status", "http://gpu1:1"), ("https://gpu1:443/", "https://gpu1:443"),
    ("[::1]:9000", "http://[::1]:9000"), ("https://gpu1/proxy/harvest/status", "https://gpu1:18400/proxy")])
def test_server_url(text, expected):
    assert top.server_url(text) == expected


@pytest.mark.parametrize("argv, message", [
    (["--interval", "0"], "--interval"), (["--interval", "abc"], "--interval"), (["--interval", "nan"], "--interval"),
    (["--timeout", "-1"], "--timeout"), (["gpu1:notaport"], "port must be 1-65535"),
    (["ftp://gpu1:1"], "'ftp://gpu1:1' is not [http(s)://]HOST[:PORT] (the scheme must be http or https)")])
def test_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["top", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_defaults(monkeypatch):
    monkeypatch.setenv(top.config_env.CLIENT_API_KEY_VAR, "sekrit")
    args = cli.build_parser().parse_args(["top"])
    assert args.urls == [] and args.interval == 1.0 and not args.once and args.api_key == "sekrit"


class CannedServer:
    """/harvest/status from a document the test changes; ``code`` and ``api_key`` make it
    answer as a starting or a locked server."""

    def __init__(self, document: dict):
        self.document = document
        self.code = 200
        self.api_key: str | None = None
        canned = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if canned.api_key and self.headers.get("Authorization") != f"Bearer {canned.api_key}":
                    code, body = 401, {"error": "unauthorized"}
                elif self.path != top.STATUS_PATH:
                    code, body = 404, {"error": "not found"}
                else:
                    code, body = canned.code, canned.document if canned.code == 200 else {"error": "starting"}
                payload = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def canned():
    server = CannedServer(copy.deepcopy(FULL))
    yield server
    server.close()


def _free_port() -> int:
    """A port nothing listens on, below the ephemeral range: one from the OS's range may be
    an outgoing connection's by the time it is dialed (or this very dial's: a connection to
    itself, not a refusal)."""
    from harvest.sglang.server import free_port

    return free_port()


def test_fetch_reports_each_failure_as_a_reason(canned):
    assert top.fetch(canned.url).status["model_name"] == "Qwen2.5-7B-Instruct"
    canned.code = 503
    assert top.fetch(canned.url).error == "503 starting"
    canned.code, canned.api_key = 200, "k"
    assert top.fetch(canned.url).error.startswith("401 unauthorized")
    assert top.fetch(canned.url, api_key="k").status is not None
    assert top.fetch(f"http://127.0.0.1:{_free_port()}").error == "connection refused"


def test_a_silent_server_does_not_stall_the_others(canned):
    silent = socket.socket()  # accepts connections (backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        poller = top.Poller([f"http://127.0.0.1:{silent.getsockname()[1]}", canned.url], None, timeout_s=0.5)
        started = time.monotonic()
        silent_result, ok = poller.poll()
        assert time.monotonic() - started < 2.0
        assert ok.status is not None and "no answer within 0.5 s" in silent_result.error
    finally:
        silent.close()


def test_once_prints_a_frame_and_exits(canned, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli.main(["top", canned.url.removeprefix("http://"), "--once"]) == 0
    out = capsys.readouterr().out
    assert "alpaca-lora" in out and "42%" in out and "31.2/38.9" in out
    dead = f"127.0.0.1:{_free_port()}"
    assert cli.main(["top", canned.url, dead, "--once"]) == 1
    assert "connection refused" in row_of(capsys.readouterr().out, dead)


def _capture(tmux: list[str]) -> str:
    return subprocess.run([*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True).stdout


def _wait_for(tmux: list[str], predicate, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    screen = ""
    while time.monotonic() < deadline:
        screen = _capture(tmux)
        if predicate(screen):
            return screen
        time.sleep(0.2)
    raise AssertionError(f"the view did not show what was expected within {timeout_s} s; screen:\n{screen}")


def test_live_view_in_a_real_terminal_refreshes(canned):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not on PATH: the live view needs a real terminal to test")
    tmux = ["tmux", "-L", f"harvest-top-{uuid.uuid4().hex[:12]}", "-f", "/dev/null"]
    # The shell stays after `top` exits, to show its exit status.
    command = f"{sys.executable} -m harvest.cli top {canned.url} --interval 0.3; echo top exited $?; sleep 60"
    try:
        subprocess.run([*tmux, "new-session", "-d", "-s", "top", "-x", "200", "-y", "50", "-c", str(ROOT), command],
                       check=True, timeout=10)
        screen = _wait_for(tmux, lambda s: "alpaca-lora" in s and "42%" in s)
        assert "31.2/38.9" in screen and "420/1000" in screen
        assert "Traceback" not in screen

        canned.document["trainer"]["jobs"][0].update(progress=0.87, global_step=870)
        canned.document["tpot_ms"]["p99"] = 44.4
        screen = _wait_for(tmux, lambda s: "87%" in s)
        assert "870/1000" in screen and "31.2/44.4" in screen and "1 violating TPOT target" in screen

        canned.code = 503  # restarting: a row with the reason, the view goes on
        screen = _wait_for(tmux, lambda s: "503 starting" in s)
        assert "servers 0 up, 1 down" in screen

        subprocess.run([*tmux, "send-keys", "-t", "top", "C-c"], check=True, timeout=10)
        screen = _wait_for(tmux, lambda s: "top exited" in s, timeout_s=10)
        assert "top exited 0" in screen and "Traceback" not in screen and "harvest servers" not in screen
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, timeout=10)
