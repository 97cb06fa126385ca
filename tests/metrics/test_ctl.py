"""`harvest ctl` against the real control endpoint process (the engine faked at the
command socket): each action's route and body, exit statuses, refusals with reasons."""

from __future__ import annotations

import argparse

import pytest

from harvest.sglang import ctl
from tests.metrics.test_control import start

pytestmark = pytest.mark.timeout(120)


def parse(*argv):
    parser = argparse.ArgumentParser()
    ctl.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "expected"), [
    (["jobs"], ("GET", "/harvest/jobs", None)),
    (["pause"], ("POST", "/harvest/pause", None)),
    (["cancel", "my job"], ("POST", "/harvest/jobs/my%20job/cancel", None)),
    (["publish", "a", "--as", "bot"], ("POST", "/harvest/jobs/a/publish", {"as": "bot"})),
    (["publish", "a"], ("POST", "/harvest/jobs/a/publish", None)),
    (["set", "--target-tpot-ms", "35", "--weight", "a=3", "--weight", "b=0.5"],
     ("POST", "/harvest/settings", {"target_tpot_ms": 35.0, "weights": {"a": 3.0, "b": 0.5}})),
    (["set", "--max-lend-fraction", "0.25"], ("POST", "/harvest/settings", {"max_lend_fraction": 0.25})),
])
def test_each_action_has_its_route_and_body(argv, expected):
    method, path, body, _ = ctl.request_of(parse(*argv))
    assert (method, path, body) == expected


def test_submit_sends_the_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    method, path, body, timeout_s = ctl.request_of(parse("submit", "jobs/a.yaml"))
    assert (method, path, body) == ("POST", "/harvest/jobs", {"path": str(tmp_path / "jobs" / "a.yaml")})
    assert timeout_s > 600  # the server's job check may take minutes


@pytest.mark.parametrize(("argv", "message"), [
    (["set"], "nothing to set"),
    (["set", "--weight", "a"], "NAME=WEIGHT"),
    (["set", "--weight", "=3"], "NAME=WEIGHT"),
    (["set", "--weight", "a=x"], "NAME=WEIGHT"),
])
def test_bad_command_lines_exit_2_with_the_reason(argv, message, capsys):
    assert ctl.run(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_server_urls():
    assert ctl.server_url("127.0.0.1:18400") == "http://127.0.0.1:18400"
    assert ctl.server_url("https://h:1/x") == "https://h:1"
    assert ctl.server_url("gpu1") == "http://gpu1:18400" and ctl.server_url("[::1]:5") == "http://[::1]:5"
    assert parse("jobs").server == ctl.DEFAULT_SERVER
    with pytest.raises(argparse.ArgumentTypeError, match="the scheme must be http or https"):
        ctl.server_url("ftp://h:1")


def test_an_unreachable_server_exits_1_with_the_reason(capsys):
    args = parse("--server", "127.0.0.1:1", "jobs")
    assert ctl.run(args) == 1
    assert "cannot reach the harvest endpoint" in capsys.readouterr().err


def test_actions_through_the_endpoint_reach_the_engine_with_their_arguments(tmp_path, capsys):
    replies = {"cancel": (200, {"job": "a", "state": "cancelling (checkpoint first)"}),
               "set": (400, {"error": "max_lend_fraction=2: expected a finite number in [0.0, 1.0]"}),
               "publish": (202, {"job": "a", "adapter": "bot", "state": "loading"})}
    endpoint, engine = start(tmp_path, replies=replies)
    server = f"127.0.0.1:{endpoint.port}"
    try:
        assert ctl.run(parse("--server", server, "cancel", "a")) == 0
        assert "cancelling" in capsys.readouterr().out
        assert ctl.run(parse("--server", server, "set", "--max-lend-fraction", "2")) == 1
        assert "max_lend_fraction=2" in capsys.readouterr().err
        assert ctl.run(parse("--server", server, "publish", "a", "--as", "bot")) == 0
        # A submission the server's job check refuses never reaches the engine.
        assert ctl.run(parse("--server", server, "submit", str(tmp_path / "missing.yaml"))) == 1
        assert "does not exist" in capsys.readouterr().err
    finally:
        engine.close()
        endpoint.close()
    assert engine.calls == ["cancel", "set", "publish"]
    assert engine.args == [{"name": "a"}, {"max_lend_fraction": 2.0}, {"as": "bot", "name": "a"}]


def test_the_jobs_list_reads_as_a_table():
    reply = {"jobs": [{"name": "a", "state": "running", "weight": 3, "global_step": 42, "total_steps": 100,
                       "share": 0.75, "loss": 1.25, "adapter": {"name": "bot", "state": "served"}},
                      {"name": "b", "state": "queued", "weight": 1, "global_step": 0, "total_steps": None}]}
    text = ctl.describe("jobs", reply)
    assert "42/100" in text and "75.0%" in text and "bot served" in text and "0/?" in text
    assert ctl.describe("jobs", {"jobs": []}) == "no jobs"
    assert ctl.describe("set", {"changed": ["target_tpot_ms 40 -> 35"]}) == "target_tpot_ms 40 -> 35"
