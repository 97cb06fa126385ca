"""`harvest fleet-store HOST:PORT`: host a fleet's c10d TCPStore in a process of its own.

Members host the store themselves by default (the first to start on the rendezvous
host); the fleet then lives only as long as that member. A dedicated store outlives any
member: start it first, and give the members ``host_store: never``.
"""

from __future__ import annotations

import signal
import sys
import threading

from harvest import addresses

HELP = "host a fleet job's rendezvous store (a c10d TCPStore) until stopped"
ANY_PORT = "any free port"


def add_arguments(parser) -> None:
    parser.add_argument("endpoint", type=addresses.address_type(zero=ANY_PORT),
                        help="HOST:PORT or [IPv6]:PORT to listen on (the members' harvest.fleet.rendezvous; "
                             f"port 0: {ANY_PORT}, printed)")


def run(args) -> int:
    import datetime

    import torch.distributed as dist

    endpoint: addresses.Address = args.endpoint
    try:
        store = dist.TCPStore(endpoint.host, endpoint.port, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
    except (RuntimeError, dist.DistError) as error:
        print(f"harvest fleet-store: cannot listen on {endpoint}: {error}", file=sys.stderr)
        return 1
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    served = addresses.Address(endpoint.host, store.port)
    print(f"harvest fleet-store: serving on {served} (Ctrl-C to stop)", flush=True)
    while not stopped.wait(1.0):
        pass
    return 0
