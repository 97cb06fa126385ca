"""`harvest replay --servers auto`: the smallest fleet that holds the target, found by
doubling then bisecting (harvest/replay/fleet_size.py), deterministic on the sample."""

from __future__ import annotations

import json

import pytest

from harvest.cli import main
from harvest.replay import fleet_size, profile_source, synthetic, trainer_model, workload
from harvest.replay.router import ALL_ROUTERS
from harvest.replay.trace import SAMPLE_TRACE, read_trace

from tests.replay.helpers import settings

# the sample at six times its rate, the extra requests' sizes resampled: one server's queue
# grows to a minute, two servers' to seconds; from four on the queues hold, but harvest's
# lending work on the scheduler thread (7 ms a chunk, between steps) keeps some servers'
# TPOT p99 over 40 ms up to 13 servers: 14 hold it
BUSY = ["--rate-scale", "6", "--rate-scale-sizes", "resample"]
# Lending inline on the scheduler thread, the reserve alone (no reclaim ahead): each lend
# and reclaim delays the next decode step by its 7 ms, so the fleet is sized by TPOT, over
# several bisection steps (the default lending thread's fleet: the last test).
INLINE = ["--memory", "lending_thread=false", "--memory", "reclaim_ahead=false"]


def run_cli(capsys, *argv):
    code = main(["replay", "--trace", str(SAMPLE_TRACE), "--profile", "synthetic-a100", "--no-plots", "--no-progress",
                 "--memory", "reclaim_ms_per_chunk=7", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_servers_auto_on_the_busy_sample_picks_the_smallest_fleet_and_reports_every_policy_there(capsys):
    code, out, err = run_cli(capsys, "--servers", "auto", "--json", *BUSY, *INLINE)
    assert code == 0, err
    data = json.loads(out)
    auto = data["fleet"]["auto"]
    assert auto["num_servers"] == data["fleet"]["num_servers"] == 14 and auto["policy"] == "harvest"
    probes = {p["num_servers"]: p for p in auto["probes"]}
    assert [p["num_servers"] for p in auto["probes"]] == [1, 2, 4, 8, 16, 12, 14, 13]  # doubling, then bisection
    assert [n for n, p in probes.items() if p["holds"]] == [16, 14]
    assert probes[2]["queue_delay_p99_worst_s"] > 1.0 >= probes[4]["queue_delay_p99_worst_s"]
    assert probes[13]["tpot_p99_worst_ms"] > 40.0 and probes[13]["servers_violating"] > 0
    assert probes[14]["tpot_p99_worst_ms"] <= 40.0 and probes[14]["servers_violating"] == 0
    for routed in data["fleet"]["runs"][0]["routers"].values():
        policies = routed["policies"]
        assert set(policies) == {"harvest", "separate", "static", "decode-only"}
        harvest = policies["harvest"]
        assert harvest["num_gpus"] == 14
        assert len(harvest["memory"]["urgent_reclaims_per_server"]) == 14
        assert harvest["memory"]["urgent_reclaims"] == sum(harvest["memory"]["urgent_reclaims_per_server"])
        assert "finetune_per_gpu" in policies["static"]["metrics"] and "violation_rate" in policies["static"]["metrics"]
    # the same again: deterministic
    code, again, _ = run_cli(capsys, "--servers", "auto", "--json", *BUSY, *INLINE)
    assert json.loads(again)["fleet"]["auto"] == auto


def test_the_text_report_says_what_was_chosen_and_why(capsys):
    code, out, err = run_cli(capsys, "--servers", "auto", "--router", "least-loaded", "--policies", "harvest,static", *BUSY,
                             *INLINE)
    assert code == 0, err
    line = next(line for line in out.splitlines() if "servers auto:" in line)
    # least-loaded spreads the bursts better than round-robin: one server fewer
    assert line.startswith("  servers auto: 13, the smallest fleet with every harvest server within the 40 ms target")
    assert "under least-loaded" in line and "1: not held" in line and "13: holds" in line
    assert "a fleet of 13 decode servers" in out and "harvest memory:" in out


def test_no_fleet_up_to_max_servers_exits_1_saying_so(capsys):
    code, out, err = run_cli(capsys, "--servers", "auto", "--max-servers", "2", *BUSY)
    assert code == 1 and out == ""
    assert "servers auto: no fleet of 1 .. 2 servers holds" in err and "2: not held" in err


def test_a_load_one_server_holds_is_sized_to_one():
    profile = profile_source.from_profile(synthetic.harli_a100_llama3_8b(), "synthetic-a100")
    requests = workload.prepare(read_trace(SAMPLE_TRACE), workload.TraceWindow(max_requests=60))
    sized = fleet_size.size(requests, profile, trainer_model.build(profile), settings(max_batch=256, kv=160_000), ALL_ROUTERS)
    assert sized.num_servers == 1 and [p.num_servers for p in sized.probes] == [1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-servers", "4"], "--max-servers 4: sizes a fleet; give --servers auto with it"),
        (["--servers", "3", "--max-queue-delay-s", "1"], "--max-queue-delay-s 1: sizes a fleet"),
        (["--servers", "auto", "--max-servers", "0"], "--max-servers=0: must be an integer >= 1"),
        (["--servers", "auto", "--max-queue-delay-s", "-1"], "--max-queue-delay-s=-1.0: must be"),
    ],
)
def test_bad_auto_options_exit_2_naming_the_option(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and err.startswith("harvest replay: ") and message in err, err


def test_servers_takes_a_number_or_auto(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_cli(capsys, "--servers", "many")
    assert exit_.value.code == 2 and "'many': expected a number of servers or auto" in capsys.readouterr().err


def test_with_the_lending_thread_lending_delays_no_step_and_the_busy_sample_needs_fewer_servers(capsys):
    """The defaults (a GPU server's: lending thread, reclaim ahead): the busy sample's fleet is
    sized by its queueing alone, no longer by lending work on the decode thread."""
    code, out, err = run_cli(capsys, "--servers", "auto", "--json", *BUSY)
    assert code == 0, err
    auto = json.loads(out)["fleet"]["auto"]
    probes = {p["num_servers"]: p for p in auto["probes"]}
    assert auto["num_servers"] == 3 and [n for n, p in probes.items() if p["holds"]] == [4, 3]
    assert probes[2]["queue_delay_p99_worst_s"] > 1.0 and probes[2]["tpot_p99_worst_ms"] <= 40.0
    harvest = json.loads(out)["fleet"]["runs"][0]["routers"]["round-robin"]["policies"]["harvest"]["memory"]
    assert harvest["scheduled_delay_s_total"] == 0.0 and harvest["reclaim_s_total"] > 0
