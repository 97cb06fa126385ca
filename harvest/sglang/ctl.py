"""`harvest ctl`: change a running harvest server from the command line, through its
control endpoint (harvest.sglang.endpoint_server), as kvcached's ``kvctl`` does for its limits.

    harvest ctl [--server URL] jobs
    harvest ctl submit JOB.yaml | cancel NAME | publish NAME [--as ADAPTER]
    harvest ctl set --target-tpot-ms 35 --max-lend-fraction 0.5 --weight NAME=3
    harvest ctl pause | resume | stop

Exit status: 0 when the server did it, 1 when it refused (the reply's ``error`` on
stderr), 2 for a bad command line; ``--json`` prints the reply as is. Standard library
only: it runs on an operator's machine without torch or SGLang.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from harvest import addresses, config_env

HELP = "change a running harvest server: its job queue, adapters served, QoS target, lend fraction, weights"
DEFAULT_PORT = 18400  # metrics.port's default (harvest.config imports more than ctl needs)
DEFAULT_SERVER = f"http://127.0.0.1:{DEFAULT_PORT}"
# A submission waits for the server's job check (LlamaFactory's imports, the dataset's
# preprocessing): minutes on a busy server.
SUBMIT_TIMEOUT_S = 660.0
TIMEOUT_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=DEFAULT_SERVER, type=server_url,
                        help=f"the server's harvest endpoint, [http(s)://]HOST[:PORT], an IPv6 HOST in brackets "
                             f"(port {DEFAULT_PORT} when none is given; default {DEFAULT_SERVER})")
    parser.add_argument("--api-key", default=config_env.client_api_key(),
                        help=f"SGLang's admin (or API) key when the server has one (default: ${config_env.CLIENT_API_KEY_VAR})")
    parser.add_argument("--json", action="store_true", help="print the server's JSON reply")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("jobs", help="list the job queue")
    for name, text in (("pause", "pause the trainer (its lent KV memory goes back to decode)"),
                       ("resume", "resume the trainer"),
                       ("stop", "checkpoint every job and stop the trainer until the server restarts")):
        actions.add_parser(name, help=text)
    submit = actions.add_parser("submit", help="queue a LlamaFactory job file (a path on the server's machine)")
    submit.add_argument("job", help="the job YAML (made absolute here: the server reads it from its own disk)")
    cancel = actions.add_parser("cancel", help="cancel a job: queued, it never starts; running, it checkpoints and ends")
    cancel.add_argument("name")
    publish = actions.add_parser("publish", help="serve a job's adapter (final, else its latest checkpoint) from the "
                                                 "same SGLang server (started with --enable-lora)")
    publish.add_argument("name")
    publish.add_argument("--as", dest="served_name", default=None,
                         help="the LoRA name requests use (default: the job's serve_as, else its name)")
    change = actions.add_parser("set", help="change run-time settings (all checked first, then all applied)")
    change.add_argument("--target-tpot-ms", type=float, default=None, help="the QoS target of decode steps")
    change.add_argument("--max-lend-fraction", type=float, default=None,
                        help="the largest share of the KV pool lent to the trainer (lowering it takes chunks back now)")
    change.add_argument("--weight", action="append", default=[], metavar="NAME=WEIGHT",
                        help="a job's fair-share weight (repeatable)")


def run(args) -> int:
    base = args.server  # server_url, as argparse's type
    try:
        method, path, body, timeout_s = request_of(args)
    except ValueError as exc:
        print(f"harvest ctl: error: {exc}", file=sys.stderr)
        return 2
    code, reply = call(base, method, path, body, api_key=args.api_key, timeout_s=timeout_s)
    if args.json:
        print(json.dumps(reply, indent=2))
    if code is None or code >= 300:
        reason = reply.get("error") if isinstance(reply, dict) else None
        print(f"harvest ctl: {base}{path}: {reason or f'HTTP {code}'}", file=sys.stderr)
        return 1
    if not args.json:
        print(describe(args.action, reply))
    return 0


def server_url(text: str) -> str:
    """``--server``'s type: the base URL ``http(s)://host:port`` (a path given is dropped:
    the routes are absolute). A bad value: argparse.ArgumentTypeError (exit 2)."""
    try:
        address = addresses.parse_address(text, url=True, default_port=DEFAULT_PORT)
    except addresses.AddressError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return f"{address.scheme or 'http'}://{address.netloc}"


def request_of(args) -> tuple[str, str, dict | None, float]:
    """(method, route, JSON body, timeout) of the command line's action."""
    action = args.action
    if action == "jobs":
        return "GET", "/harvest/jobs", None, TIMEOUT_S
    if action in ("pause", "resume", "stop"):
        return "POST", f"/harvest/{action}", None, TIMEOUT_S
    if action == "submit":
        path = Path(args.job).expanduser().resolve()
        return "POST", "/harvest/jobs", {"path": str(path)}, SUBMIT_TIMEOUT_S
    quoted = urllib.parse.quote(getattr(args, "name", "") or "", safe="")
    if action == "cancel":
        return "POST", f"/harvest/jobs/{quoted}/cancel", None, TIMEOUT_S
    if action == "publish":
        body = {"as": args.served_name} if args.served_name else None
        return "POST", f"/harvest/jobs/{quoted}/publish", body, TIMEOUT_S
    if action == "set":
        body = {}
        if args.target_tpot_ms is not None:
            body["target_tpot_ms"] = args.target_tpot_ms
        if args.max_lend_fraction is not None:
            body["max_lend_fraction"] = args.max_lend_fraction
        weights = {}
        for item in args.weight:
            name, sep, value = item.partition("=")
            try:
                weights[name] = float(value)
            except ValueError:
                sep = ""
            if not sep or not name:
                raise ValueError(f"--weight takes NAME=WEIGHT, got {item!r}")
        if weights:
            body["weights"] = weights
        if not body:
            raise ValueError("set: nothing to set (--target-tpot-ms, --max-lend-fraction, --weight NAME=W)")
        return "POST", "/harvest/settings", body, TIMEOUT_S
    raise ValueError(f"unknown action {action!r}")


def call(base: str, method: str, path: str, body: dict | None = None, *, api_key: str | None = None,
         timeout_s: float = TIMEOUT_S) -> tuple[int | None, dict]:
    """(HTTP status or None when unreachable, the JSON reply or {"error": why})."""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(base + path, method=method, data=data)
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, _json(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _json(exc.read())
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return None, {"error": f"cannot reach the harvest endpoint ({reason})"}


def _json(body: bytes):
    try:
        return json.loads(body) if body else {}
    except ValueError:
        return {"error": body[:500].decode(errors="replace")}


def describe(action: str, reply: dict) -> str:
    """One or a few human lines of the server's reply."""
    if action == "jobs":
        jobs = reply.get("jobs") or []
        if not jobs:
            return "no jobs"
        lines = [f"{'JOB':<20} {'STATE':<10} {'WEIGHT':>6} {'STEP':>13} {'SHARE':>6} {'LOSS':>8}  ADAPTER"]
        for job in jobs:
            step = f"{job.get('global_step', 0)}/{job.get('total_steps') or '?'}"
            loss = job.get("loss")
            adapter = job.get("adapter") or {}
            lines.append(f"{job.get('name', '?'):<20} {job.get('state', '?'):<10} {job.get('weight', 0):>6g} "
                         f"{step:>13} {100 * (job.get('share') or 0):>5.1f}% "
                         f"{'-' if loss is None else f'{loss:.4f}':>8}  "
                         f"{adapter.get('name', '-')} {adapter.get('state', '')}".rstrip())
        return "\n".join(lines)
    if action == "set":
        return "\n".join(reply.get("changed") or []) or json.dumps(reply)
    return ", ".join(f"{key}: {value}" for key, value in reply.items())
