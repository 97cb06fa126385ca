"""`harvest top`: a live terminal view of one or many harvest servers (like htop, or
kvcached's kvtop), from each server's ``GET /harvest/status``.

Three layers, so the view is testable without a terminal or a server:
:func:`fetch` turns one poll into a :class:`ServerResult` (never raises: a dead, locked
or starting server is a row with its reason), :class:`Poller` polls every server at once
on daemon threads, and :func:`render` is a pure function of the results.

Every field of the status document may be absent or null: servers older than the field,
servers without jobs, servers still starting. Cheap to import (the CLI imports every
command to build its parser): rich is imported where used.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from harvest import addresses, config_env
from harvest.metrics.registry import ENDED_JOB_STATES

HELP = "live view of harvest servers: TPOT vs target, SM level, lent KV, finetune jobs"
DEFAULT_URL = "http://127.0.0.1:18400"
DEFAULT_PORT = 18400
STATUS_PATH = "/harvest/status"
STALE_SNAPSHOT_S = 5.0  # a snapshot older than this: the engine thread is not publishing
BAR_WIDTH = 10


@dataclass(frozen=True)
class ServerResult:
    """One poll of one server: its status document, or why there is none."""

    url: str
    status: dict | None = None
    error: str | None = None


def server_url(text: str) -> str:
    """``host``, ``host:port`` or ``http(s)://host[:port][/harvest/status]`` -> the base URL
    (port 18400 when none is given); an IPv6 host in brackets. argparse's type for URL."""
    try:
        address = addresses.parse_address(text.strip(), url=True, default_port=DEFAULT_PORT)
    except addresses.AddressError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    path = address.path.rstrip("/").removesuffix(STATUS_PATH)  # a reverse proxy's prefix stays
    return f"{address.scheme or 'http'}://{address.netloc}{path}"


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds > 0, e.g. 1.0")
    return value


def fetch(url: str, api_key: str | None = None, timeout_s: float = 1.0) -> ServerResult:
    """GET ``url``/harvest/status once; every failure becomes ``error``, a short reason."""
    request = urllib.request.Request(url + STATUS_PATH, headers={"Accept": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            document = json.loads(response.read())
    except urllib.error.HTTPError as e:
        return ServerResult(url, error=_http_reason(e))
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, ConnectionRefusedError):
            return ServerResult(url, error="connection refused")
        if isinstance(reason, TimeoutError):
            return ServerResult(url, error=f"no answer within {timeout_s:g} s")
        return ServerResult(url, error=str(getattr(reason, "strerror", None) or reason))
    except TimeoutError:
        return ServerResult(url, error=f"no answer within {timeout_s:g} s")
    except (OSError, ValueError) as e:  # reset connections, bad JSON, ...
        return ServerResult(url, error=f"{type(e).__name__}: {e}")
    if not isinstance(document, dict):
        return ServerResult(url, error="not a status document (JSON is not an object)")
    return ServerResult(url, status=document)


def _http_reason(error: urllib.error.HTTPError) -> str:
    if error.code == 401:
        return f"401 unauthorized (--api-key or {config_env.CLIENT_API_KEY_VAR})"
    if error.code == 503:
        return "503 starting"
    return f"{error.code} {error.reason}"


class Poller:
    """Polls every server at once. A server whose last fetch has not answered yet gets no
    second one: a hung server (DNS without timeout, half-open socket) costs one thread,
    shows as "no answer", and never delays the rows of the others."""

    def __init__(self, urls: list[str], api_key: str | None, timeout_s: float):
        self.urls = list(urls)
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._last = {url: ServerResult(url, error="connecting") for url in self.urls}

    def _start(self, url: str) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work():
            try:
                future.set_result(fetch(url, self.api_key, self.timeout_s))
            except BaseException as e:  # noqa: BLE001 (fetch returns its errors; this is a last resort)
                future.set_result(ServerResult(url, error=f"{type(e).__name__}: {e}"))

        # Daemon threads: Ctrl-C exits at once even while a fetch hangs.
        threading.Thread(target=work, name=f"harvest-top {url}", daemon=True).start()
        return future

    def poll(self) -> list[ServerResult]:
        for url in self.urls:
            if url not in self._pending:
                self._pending[url] = self._start(url)
        concurrent.futures.wait(list(self._pending.values()), timeout=self.timeout_s + 0.25)
        for url, future in list(self._pending.items()):
            if future.done():
                self._last[url] = future.result()
                del self._pending[url]
            else:
                self._last[url] = ServerResult(url, error=f"no answer within {self.timeout_s:g} s")
        return [self._last[url] for url in self.urls]


# ---- reading a status document (every field optional) ----

def _get(mapping, *keys):
    for key in keys:
        if not isinstance(mapping, dict):
            return None
        mapping = mapping.get(key)
    return mapping


def _number(value) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def target_tpot_ms(status: dict) -> float | None:
    """The run-time target (``settings``) where the server reports one, else the configured one."""
    return _number(_get(status, "settings", "target_tpot_ms")) or _number(_get(status, "qos", "target_tpot_ms"))


def violating(status: dict) -> bool:
    """Recent decode steps over target: p99 of the recent window above the current target
    (not ``qos.violation_rate``, which counts since the server started)."""
    p99, target = _number(_get(status, "tpot_ms", "p99")), target_tpot_ms(status)
    return p99 is not None and target is not None and p99 > target


def jobs_of(status: dict) -> list[dict]:
    """``trainer.jobs``; for a server from before per-job status, its one current job
    built from ``trainer.job`` and ``trainer.stats``."""
    trainer = status.get("trainer")
    if not isinstance(trainer, dict):
        return []
    jobs = trainer.get("jobs")
    if isinstance(jobs, list):
        return [job for job in jobs if isinstance(job, dict)]
    if not trainer.get("job"):
        return []
    stats = trainer.get("stats") or {}
    step, total = _number(stats.get("global_step")), _number(stats.get("total_steps"))
    return [{"name": trainer["job"], "state": trainer.get("state"), "global_step": step, "total_steps": total,
             "progress": step / total if step is not None and total else None, "loss": stats.get("loss"),
             "eval_loss": stats.get("eval_loss"), "tokens_seen": stats.get("tokens_seen")}]  # its error: the trainer's line


# ---- formatting ----

def duration(seconds) -> str:
    """12s, 4m05s, 3h12m, 2d04h."""
    seconds = _number(seconds)
    if seconds is None:
        return "-"
    s = int(round(abs(seconds)))
    sign = "-" if seconds < 0 and s else ""
    if s < 60:
        return f"{sign}{s}s"
    if s < 3600:
        return f"{sign}{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{sign}{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{sign}{s // 86400}d{s % 86400 // 3600:02d}h"


def _short(url: str) -> str:
    return url.split("://", 1)[-1]


def _fixed(value, digits: int) -> str:
    value = _number(value)
    return "-" if value is None else f"{value:.{digits}f}"


def _percent(value, digits: int = 0) -> str:
    value = _number(value)
    return "-" if value is None else f"{100 * value:.{digits}f}%"


STATE_STYLES = {"running": "green", "building": "cyan", "queued": "blue", "starved": "yellow", "paused": "yellow",
                "finished": "bold green", "stopped": "dim", "cancelled": "dim", "failed": "bold red", "absent": "dim"}


def _state(state):
    from rich.text import Text

    state = str(state) if state is not None else "-"
    return Text(state, style=STATE_STYLES.get(state, ""))


def _tpot(status: dict):
    from rich.text import Text

    target = target_tpot_ms(status)
    text = Text()
    for i, key in enumerate(("p50", "p99")):
        value = _number(_get(status, "tpot_ms", key))
        style = "" if value is None or target is None else ("red" if value > target else "green")
        text.append("/" if i else "")
        text.append(_fixed(value, 1), style=style)
    text.append(f" ≤{target:g}" if target is not None else "", style="dim")
    return text


def _kv(status: dict):
    from rich.text import Text

    kv = status.get("kv") if isinstance(status.get("kv"), dict) else {}
    lent, total = _number(kv.get("chunks_lent")), _number(kv.get("chunks_total"))
    text = Text("-" if total is None else f"{'-' if lent is None else int(lent)}/{int(total)}")
    urgent = _number(kv.get("urgent_reclaims_total"))
    if urgent:  # serving waited for lent memory: the free target did not cover an arrival
        held = _number(kv.get("admissions_held_total"))  # of which admissions lent memory held back
        text.append(f" {int(urgent)} urgent" + (f" ({int(held)} adm)" if held else ""), style="yellow")
    if kv.get("integrity_error"):
        text.append(" INTEGRITY", style="bold red")
    return text


def _level(status: dict) -> str:
    level = status.get("level") if isinstance(status.get("level"), dict) else {}
    decode, trainer = _number(level.get("decode_sms")), _number(level.get("trainer_sms"))
    if decode is None and trainer is None:
        return "-"
    return f"{'-' if decode is None else int(decode)}/{'-' if trainer is None else int(trainer)}"


def _age(status: dict):
    from rich.text import Text

    age = _number(status.get("snapshot_age_s"))
    return Text("-" if age is None else f"{age:.1f}s", style="yellow" if age is not None and age > STALE_SNAPSHOT_S else "")


def _progress(job: dict, bar: bool):
    from rich.text import Text

    progress = _number(job.get("progress"))
    step, total = _number(job.get("global_step")), _number(job.get("total_steps"))
    if progress is None and step is not None and total:
        progress = step / total
    text = Text()
    if progress is not None:
        progress = min(max(progress, 0.0), 1.0)
        if bar:
            filled = int(round(progress * BAR_WIDTH))
            text.append("█" * filled, style="green").append("░" * (BAR_WIDTH - filled) + " ", style="dim")
        text.append(f"{100 * progress:3.0f}%")
    if step is not None:
        text.append(f" {int(step)}/{int(total) if total else '?'}", style="dim")
    return text if text else Text("-")


def _adapter(job: dict):
    from rich.text import Text

    adapter = job.get("adapter") if isinstance(job.get("adapter"), dict) else None
    if adapter is None:
        return Text(job.get("serve_as") or "-")
    text = Text(str(adapter.get("name") or job.get("serve_as") or "?"))
    if adapter.get("error"):
        return text.append(" failed", style="bold red")
    return text.append(f" ({adapter['state']})", style="dim") if adapter.get("state") else text


def _fleet(job: dict):
    """A fleet job's view from this server, compactly: ``r12 3 members 4s ago`` (the
    fleet's round, members in this server's last round, time since it); ``joining``
    before its first round; ``-`` for a job trained alone."""
    from rich.text import Text

    fleet = job.get("fleet") if isinstance(job.get("fleet"), dict) else None
    if fleet is None:
        return Text("-")
    if not fleet.get("joined"):
        return Text("joining", style="cyan")
    number, members = _number(fleet.get("round")), _number(fleet.get("members"))
    text = Text(f"r{'?' if number is None else int(number)} {'?' if members is None else int(members)} "
                f"member{'' if members == 1 else 's'}")
    stale = _number(fleet.get("staleness_s"))
    if stale is not None and job.get("state") not in ENDED_JOB_STATES:
        text.append(f" {duration(stale)} ago", style="dim")
    failed = _number(fleet.get("rounds_failed"))
    if failed:
        text.append(f" {int(failed)} failed", style="yellow")
    return text


def _server_row(server: str, status: dict) -> dict:
    trainer = status.get("trainer") if isinstance(status.get("trainer"), dict) else None
    return {"server": server, "model": str(status.get("model_name") or "-"), "TPOT p50/p99": _tpot(status),
            "viol": _percent(_get(status, "qos", "violation_rate"), 1), "SMs d/t": _level(status), "KV lent": _kv(status),
            "trainer": _state(trainer.get("state") if trainer else "absent"), "age": _age(status)}


def _job_row(server: str, job: dict) -> dict:
    from rich.text import Text

    loss = _fixed(job.get("loss"), 3)
    if _number(job.get("eval_loss")) is not None:
        loss += f" ({job['eval_loss']:.3f})"
    weight, deficit = _number(job.get("weight")), _number(job.get("deficit_s"))
    return {"server": server, "job": str(job.get("name") or "?"), "state": _state(job.get("state")),
            "weight": "-" if weight is None else f"{weight:g}", "progress": _progress(job, bar=True),
            "percent": _progress(job, bar=False),
            "ETA": "done" if job.get("state") == "finished" else duration(job.get("eta_s")), "loss (eval)": loss,
            "share": _percent(job.get("share")),
            "deficit": Text("-" if deficit is None else ("+" if deficit > 0 else "") + duration(deficit),
                            style="yellow" if deficit is not None and deficit > 0 else ""),
            "adapter": _adapter(job), "fleet": _fleet(job)}


SERVER_COLUMNS = ("server", "model", "TPOT p50/p99", "viol", "SMs d/t", "KV lent", "trainer", "age")
# "fleet": shown when a job is a fleet job (several servers train it; its progress is the fleet's).
JOB_COLUMNS = ("server", "job", "state", "weight", "progress", "ETA", "loss (eval)", "fleet", "share", "deficit",
               "adapter")
LEFT = ("server", "model", "trainer", "job", "state", "progress", "fleet", "adapter")
# On a narrow terminal whole columns go, least useful first ("bar": the progress bar,
# leaving the percent), rather than rich cutting every column down to an ellipsis.
SERVER_DROP_ORDER = ("age", "viol", "SMs d/t")
JOB_DROP_ORDER = ("bar", "weight", "deficit", "adapter", "share", "fleet", "loss (eval)", "ETA")


class _Fitted:
    """A table that keeps as many columns as the console's width lets it show whole."""

    def __init__(self, title: str, columns: tuple, rows: list[dict], drop_order: tuple, dropped: tuple = ()):
        self.title, self.columns, self.rows = title, columns, rows
        self.drop_order, self.dropped = drop_order, dropped

    def table(self, dropped: set):
        from rich import box
        from rich.table import Table

        table = Table(title=self.title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
        shown = [c for c in self.columns if c not in dropped]
        for column in shown:
            table.add_column(column, justify="left" if column in LEFT else "right", no_wrap=True, overflow="ellipsis")
        for row in self.rows:
            table.add_row(*(row.get("percent" if c == "progress" and "bar" in dropped else c, "") for c in shown))
        return table

    def __rich_console__(self, console, options):
        from rich.measure import Measurement

        unbounded = options.update(max_width=10_000)  # Measurement.get clamps to the width it is given
        for num_dropped in range(len(self.drop_order) + 1):
            table = self.table({*self.dropped, *self.drop_order[:num_dropped]})
            if Measurement.get(console, unbounded, table).maximum <= options.max_width:
                break
        yield table


def render(results: list[ServerResult]):
    """The whole view: servers table, jobs table, errors, a totals line. Pure: a function of
    the results (the width it is drawn at picks the columns)."""
    from rich.console import Group
    from rich.text import Text

    server_rows, job_rows, problems = [], [], []
    num_up = num_running = num_violating = 0
    any_fleet = False
    for result in results:
        server = _short(result.url)
        status = result.status
        if status is None:
            server_rows.append({"server": server, "model": Text(result.error or "no status", style="red")})
            continue
        num_up += 1
        num_violating += violating(status)
        server_rows.append(_server_row(server, status))
        trainer = status.get("trainer") if isinstance(status.get("trainer"), dict) else {}
        if trainer.get("error") and not isinstance(trainer.get("jobs"), list):
            problems.append(Text(f"{server} trainer: {trainer['error']}", style="red"))
        for job in jobs_of(status):
            job_rows.append(_job_row(server, job))
            any_fleet = any_fleet or isinstance(job.get("fleet"), dict)
            num_running += job.get("state") == "running"
            for what, error in (("", job.get("error")), (" adapter", _get(job, "adapter", "error"))):
                if error:
                    problems.append(Text(f"{server} {job.get('name')}{what}: {error}", style="red"))

    footer = Text()
    footer.append(f"servers {num_up} up", style="green" if num_up else "")
    footer.append(f", {len(results) - num_up} down", style="red" if len(results) > num_up else "")
    footer.append(f" · jobs {num_running} running · ")
    footer.append(f"{num_violating} violating TPOT target", style="red" if num_violating else "")
    parts = [_Fitted("harvest servers", SERVER_COLUMNS, server_rows, SERVER_DROP_ORDER)]
    if job_rows:  # with one server, no server column; without a fleet job, no fleet column
        hidden = (() if len(results) > 1 else ("server",)) + (() if any_fleet else ("fleet",))
        parts.append(_Fitted("finetune jobs", JOB_COLUMNS, job_rows, JOB_DROP_ORDER, hidden))
    return Group(*parts, *problems, footer)


# ---- the command ----

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("urls", nargs="*", type=server_url, metavar="URL",
                        help=f"control endpoints: [http(s)://]HOST[:PORT], an IPv6 HOST in brackets (port {DEFAULT_PORT} when "
                             f"none is given; default {DEFAULT_URL})")
    parser.add_argument("--interval", type=_positive_seconds, default=1.0, metavar="SECONDS",
                        help="seconds between polls (default 1.0)")
    parser.add_argument("--timeout", type=_positive_seconds, default=1.0, metavar="SECONDS",
                        help="how long one server may take to answer before its row says so (default 1.0)")
    parser.add_argument("--once", action="store_true",
                        help="print one frame and exit (status 1 when a server did not answer): for scripts")
    parser.add_argument("--api-key", default=config_env.client_api_key(),
                        help=f"Bearer token for servers started with --api-key/--admin-api-key (default ${config_env.CLIENT_API_KEY_VAR})")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    poller = Poller(args.urls or [DEFAULT_URL], args.api_key, args.timeout)
    console = Console()
    try:
        if args.once:
            results = poller.poll()
            console.print(render(results))
            return 0 if all(r.status is not None for r in results) else 1
        # The alternate screen, as htop: no scrollback filled at one frame a second, the
        # shell's screen back on exit, and a frame taller than the terminal is cropped
        # instead of scrolling (Live's in-place redraw breaks on that).
        with Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                started = time.monotonic()
                live.update(render(poller.poll()), refresh=True)
                time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return 0
