"""The trainer orders its work across SM partitions' streams on the device
(harvest.train.trainer.order_after): a move to another stream waits for the last one's
work there, never on the host."""

from __future__ import annotations

from harvest.train.trainer import order_after


class RecordingStream:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def wait_stream(self, other) -> None:
        self.calls.append((self.name, "waits for", other.name))

    def synchronize(self) -> None:
        self.calls.append((self.name, "synchronize"))


def test_a_move_to_another_stream_waits_on_the_device_for_the_last_one():
    calls: list = []
    a, b, c = (RecordingStream(name, calls) for name in "abc")
    last = None
    for stream in (a, a, b, b, c, a):  # the streams the gate hands out, unit by unit
        order_after(stream, last)
        last = stream
    # One device-side wait per move, each on the stream just left: one order over all of them.
    assert calls == [("b", "waits for", "a"), ("c", "waits for", "b"), ("a", "waits for", "c")]


def test_no_stream_no_order():
    calls: list = []
    a = RecordingStream("a", calls)
    order_after(None, a)  # CPU: no streams
    order_after(a, None)  # the first unit
    assert calls == []
