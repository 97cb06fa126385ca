"""`harvest fleet-store HOST:PORT`: host a fleet's c10d TCPStore in a process of its own.

Members host the store themselves by default (the first to start on the rendezvous
host); the fleet then lives only as long as that member. A dedicated store outlives any
member: start it first, and give the members ``host_store: never``.
"""

from __future__ import annotations

import re
import signal
import sys
import threading

HELP = "host a fleet job's rendezvous store (a c10d TCPStore) until stopped"


def add_arguments(parser) -> None:
    parser.add_argument("endpoint", help="HOST:PORT to listen on (the members' harvest.fleet.rendezvous)")


def run(args) -> int:
    from harvest.fleet.options import ENDPOINT_PATTERN

    if not re.fullmatch(ENDPOINT_PATTERN, args.endpoint):
        print(f"harvest fleet-store: {args.endpoint!r}: expected HOST:PORT", file=sys.stderr)
        return 2
    import datetime

    import torch.distributed as dist

    host, _, port = args.endpoint.rpartition(":")
    try:
        store = dist.TCPStore(host.strip("[]"), int(port), is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
    except (RuntimeError, dist.DistError) as error:
        print(f"harvest fleet-store: cannot listen on {args.endpoint}: {error}", file=sys.stderr)
        return 1
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    print(f"harvest fleet-store: serving on {host}:{store.port} (Ctrl-C to stop)", flush=True)
    while not stopped.wait(1.0):
        pass
    return 0
