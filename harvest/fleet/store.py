"""The fleet's meeting point: one c10d ``TCPStore`` (torch.distributed's own key-value
store, the one torchrun's c10d rendezvous uses), reached at ``harvest.fleet.rendezvous``.

Whoever starts first on the rendezvous host hosts it (``host_store: auto``); a host that
dies takes the store with it, so a fleet that must outlive any one member runs
``harvest fleet-store HOST:PORT`` there instead (``host_store: never`` on the members).
Every key of a job lives under ``harvest/<job_id>/``.
"""

from __future__ import annotations

import datetime
import socket



class FleetError(RuntimeError):
    """The fleet cannot be joined or a member cannot go on (names the cause)."""


def _is_local(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    if address.startswith("127."):
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))  # only an address of this machine binds
        return True
    except OSError:
        return False


def open_store(host: str, port: int, *, may_host: bool, timeout_s: float):
    """(store, hosted): host the store if allowed and this machine is ``host`` and the port
    is free, else connect as a client (waiting up to ``timeout_s`` for the host)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if may_host and _is_local(host):
        try:
            return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout), True
        except dist.DistNetworkError as error:
            if "EADDRINUSE" not in str(error) and "address already in use" not in str(error):
                raise FleetError(f"harvest.fleet.rendezvous {host}:{port}: cannot host the store: {error}") from None
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout), False
    except (RuntimeError, dist.DistError) as error:
        raise FleetError(f"harvest.fleet.rendezvous {host}:{port}: no store answered within {timeout_s:g} s "
                         f"({error}); start one member on that host or `harvest fleet-store {host}:{port}`") from None


def job_store(store, job_id: str):
    import torch.distributed as dist

    return dist.PrefixStore(f"harvest/{job_id}/", store)
