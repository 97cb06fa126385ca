"""Ports handed to a server that binds them later stay out of the range the OS gives
outgoing connections (and out of SGLang's own pick for its NCCL/gloo port)."""

from __future__ import annotations

import socket

from harvest.sglang import server


def test_free_ports_are_bindable_and_below_the_ephemeral_range():
    ports = [server.free_port() for _ in range(20)]
    low, high = server.FREE_PORT_RANGE
    assert all(low <= port <= min(high, server._ephemeral_low() - 1) for port in ports), ports
    assert len(set(ports)) > 1  # picked at random, not the same port every time
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(server, "FREE_PORT_RANGE", (busy, busy))
        monkeypatch.setattr(server, "_ephemeral_low", lambda: 65536)
        port = server.free_port()
        assert port != busy  # the only candidate is taken: the OS's pick instead
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
