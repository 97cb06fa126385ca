"""`harvest demo`'s summary explains the level indices of its decisions from the server's
own ladder (``/harvest/status`` ``level.ladder``): it names exactly the levels that ladder
has, whatever the device, and no level the ladder lacks (there is no level -1: pauses
count on the whole-device level)."""

from __future__ import annotations

import re

import pytest

from harvest import demo
from harvest.colocate.status import StatusReporter
from harvest.compute.ladder_planning import plan_ladder
from harvest.ladder import Ladder

LADDERS = {
    "cpu": Ladder.whole_device(1, "CPU device"),
    "h100, default levels": plan_ladder(132, (9, 0)),
    "h100, 2 levels": plan_ladder(132, (9, 0), levels=2),
    "a100, 5 levels": plan_ladder(108, (8, 0), levels=5),
}


def _status(ladder: Ladder | None, step: int) -> dict:
    levels = range(1 if ladder is None else ladder.num_levels)
    return {
        "trainer": {"stats": {"global_step": step, "tokens_seen": 64 * step, "tokens_per_s": 80.0, "loss": 1.25}},
        "kv": {"chunks_lent": 2, "lends_total": 5, "reclaims_total": 3},
        "qos": {"decisions_by_level": {str(index): 10 + index for index in levels}, "decisions_by_reason": {"fits": 9}},
        "level": {"partitioner": "described" if ladder is None else ladder.describe(),
                  **({} if ladder is None else {"ladder": ladder.to_dict()})},
    }


def _summary(final: dict, tmp_path, capsys) -> str:
    results = [{"ok": True, "tokens": 4}, {"ok": True, "tokens": 4}]
    steps = [{"measured_ms": ms, "is_decode": True} for ms in (20.0, 30.0, 50.0)]
    report = demo._report(results, _status(None, 0), final, steps, 40.0)
    demo._print_report(report, None, tmp_path / "report.json")
    return capsys.readouterr().out


def _levels_named(summary: str) -> set[int]:
    """Every level index the summary mentions: the decision counts' keys and the legend's."""
    line = next(line for line in summary.splitlines() if "decisions by level" in line)
    return {int(i) for i in re.findall(r"'(-?\d+)': \d+", line)} | {int(i) for i in re.findall(r"(-?\d+) = ", line)}


@pytest.mark.parametrize("name", list(LADDERS))
def test_the_summary_names_exactly_the_ladders_levels(name, tmp_path, capsys):
    ladder = LADDERS[name]
    summary = _summary(_status(ladder, 7), tmp_path, capsys)
    assert _levels_named(summary) == set(range(ladder.num_levels))
    legend = demo.level_legend(ladder.to_dict())
    assert f"{ladder.whole_device_index} = decode" in legend  # the level a pause counts on is explained
    for index, level in enumerate(ladder.levels[:-1]):
        assert f"{index} = decode {level.decode_sms}/trainer {level.trainer_sms} SMs" in legend


def test_a_server_without_the_ladder_gets_no_legend(tmp_path, capsys):
    summary = _summary(_status(None, 7), tmp_path, capsys)
    line = next(line for line in summary.splitlines() if "decisions by level" in line)
    assert line.strip() == "decisions by level   {'0': 10}"


def test_the_servers_status_carries_the_ladder_the_summary_reads(tmp_path, capsys):
    from tests.colocate.test_step_accounting import _colocation

    colocation = _colocation()
    status = StatusReporter(colocation).status()
    assert status["level"]["ladder"] == colocation.partitioner.ladder.to_dict()
    final = {**_status(colocation.partitioner.ladder, 7), "level": status["level"]}
    assert _levels_named(_summary(final, tmp_path, capsys)) == {0}
