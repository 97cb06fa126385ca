"""`harvest replay` over bad traces, bad profiles and unusable output directories.

Every case either replays correctly (checked against the clean input) or exits 2 with a
short message naming the file and the line and column (a trace) or the JSON path (a
profile): never a traceback, never rc 0 with garbage. The real CLI entry runs in-process
(``harvest.cli.main``), and once as a subprocess.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

from harvest.cli import main
from harvest.replay import synthetic
from harvest.replay.trace import SAMPLE_TRACE

HEADER = b"TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROWS = b"2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n2023-11-16 18:15:51.2224670,879,55\n"


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("profiles") / "a100.json"
    synthetic.harli_a100_llama3_8b().save(path)
    return path


@pytest.fixture(scope="module")
def profile_data(profile_path):
    return json.loads(profile_path.read_text())


def replay(capsys, *argv) -> tuple[int, str, str]:
    code = main(["replay", "--no-progress", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code: int, err: str, *expected: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("harvest replay: "), err
    assert len(err.strip().splitlines()) <= 3, err
    for text in expected:
        assert text in err, err


def replay_json(capsys, trace, profile, *argv) -> dict:
    code, out, err = replay(capsys, "--trace", str(trace), "--profile", str(profile), "--no-plots", "--json", *argv)
    assert code == 0, err
    data = json.loads(out.strip().splitlines()[-1])
    data.pop("trace")
    for run in data["runs"]:
        run.pop("wall_s")
    return data


# -- traces -------------------------------------------------------------------------------

BAD_TRACES = [
    ("empty file", b"", ":1: empty file; expected the header TIMESTAMP,ContextTokens,GeneratedTokens"),
    ("header only", HEADER, ":1: no request rows after the header"),
    ("missing column", b"TIMESTAMP,ContextTokens\n0,1\n", ":1: missing column(s) GeneratedTokens"),
    ("column twice", b"TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens\n0,5,5,5\n", ":1: column(s) ContextTokens named more than once"),
    ("ragged row, short", HEADER + b"0,1,2\n1,5\n", ":3: 2 field(s), the header has 3"),
    ("ragged row, long", HEADER + b"0,1,2\n1,5,6,7\n", ":3: 4 field(s), the header has 3"),
    ("cut off mid-row", HEADER + ROWS + b"2023-11-16 18:15:59.0000000,12", ":5: 2 field(s), the header has 3"),
    ("non-UTF-8 byte", HEADER + b"0,1,2\n1,5\xe9,6\n", ":3: byte 0xe9 in column ContextTokens (byte 4 of the line) is not UTF-8"),
    ("UTF-16", (HEADER + ROWS).decode().encode("utf-16"), ":1: the file is UTF-16; save the trace as UTF-8"),
    ("binary", bytes(range(256)), ":2: byte 0x80 in column field 2 (byte 118 of the line) is not UTF-8"),
    ("unterminated quote", HEADER + b'0,"1,2\n1,2,3\n', ":3: not valid CSV: unexpected end of data"),
    ("field over the CSV limit", HEADER + b"0," + b"1" * 200_000 + b",2\n", ":2: not valid CSV: field larger than field limit"),
    # nan/inf timestamps used to be taken: nan compares false, so the sort check passed and
    # the window dropped the request silently
    ("nan timestamp", HEADER + b"0,1,2\nnan,5,6\n2,3,4\n", ":3: TIMESTAMP='nan' is not a finite time"),
    ("first timestamp nan", HEADER + b"NaN,5,6\n2,3,4\n", ":2: TIMESTAMP='NaN' is not a finite time"),
    ("inf timestamp", HEADER + b"0,1,2\n-inf,5,6\n", ":3: TIMESTAMP='-inf' is not a finite time"),
    ("1e309 timestamp", HEADER + b"0,1,2\n1e309,5,6\n", ":3: TIMESTAMP='1e309' is more than 1e+09 s after line 2's"),
    ("timestamps too far apart", HEADER + b"0,1,2\n1e300,5,6\n", ":3: TIMESTAMP='1e300' is more than 1e+09 s"),
    ("negative timestamp", HEADER + b"-1,1,2\n", ":2: TIMESTAMP='-1' is negative"),
    ("unsorted", HEADER + b"5,1,2\n4,3,2\n", ":3: TIMESTAMP goes backwards (rows must be sorted by time)"),
    ("two timestamp formats", HEADER + b"2023-11-16 18:15:46.68,1,2\n1700000000,5,6\n", ":3: TIMESTAMP='1700000000' is seconds, line 2's date"),
    ("exponent in a date's fraction", HEADER + b"2023-11-16 18:15:46.1e5,1,2\n", ":2: TIMESTAMP='2023-11-16 18:15:46.1e5' is not a timestamp"),
    ("date cut short", HEADER + b"2023-11-16 18:1,1,2\n", ":2: TIMESTAMP='2023-11-16 18:1' is not a timestamp"),
    ("count not an integer", HEADER + b"0,x,2\n", ":2: ContextTokens='x' is not an integer"),
    ("count with a fraction", HEADER + b"0,5.0,2\n", ":2: ContextTokens='5.0' is not an integer"),
    ("count with an underscore", HEADER + b"0,1_000,2\n", ":2: ContextTokens='1_000' is not an integer"),
    ("count in other digits", "TIMESTAMP,ContextTokens,GeneratedTokens\n0,\u0661\u0662,2\n".encode(), ":2: ContextTokens='١٢' is not an integer"),
    ("empty count", HEADER + b"0,,2\n", ":2: ContextTokens='' is not an integer"),
    ("negative count", HEADER + b"0,1,2\n1,3,-2\n", ":3: GeneratedTokens=-2 is negative"),
    ("zero context", HEADER + b"0,0,20\n", ":2: ContextTokens=0: must be >= 1"),
    # used to overflow the simulator's int64 arrays (a traceback) or pass as a dropped request
    ("count overflowing int64", HEADER + b"0,1,2\n1,5," + b"9" * 30 + b"\n", ":3: GeneratedTokens='999999999999999999999999999999' is more than 2147483647 tokens"),
    ("count of 400 digits", HEADER + b"0," + b"9" * 400 + b",2\n", ":2: ContextTokens='9999999999999999999999999999999999999'... is more than"),
    ("count over int32", HEADER + b"0,1,2147483648\n", ":2: GeneratedTokens='2147483648' is more than 2147483647 tokens"),
]


@pytest.mark.parametrize("name, body, message", BAD_TRACES, ids=[c[0] for c in BAD_TRACES])
def test_bad_trace_exits_2_naming_the_file_and_line(tmp_path, profile_path, capsys, name, body, message):
    trace = tmp_path / "trace.csv"
    trace.write_bytes(body)
    code, out, err = replay(capsys, "--trace", str(trace), "--profile", str(profile_path), "--no-plots")
    assert_refused(code, err, f"{trace}{message}")
    assert out == ""


@pytest.mark.parametrize(
    "name, body",
    [
        ("CRLF line ends, as the Azure trace", HEADER.replace(b"\n", b"\r\n") + ROWS.replace(b"\n", b"\r\n")),
        ("no newline after the last row", HEADER + ROWS.rstrip(b"\n")),
        ("blank and blank-looking lines", HEADER + ROWS.replace(b"\n", b"\n\n   \n", 1)),
        ("extra columns", b"TIMESTAMP,ContextTokens,GeneratedTokens,Model\n" + ROWS.replace(b"\n", b",llama\n")),
        ("columns reordered", b"GeneratedTokens,TIMESTAMP,ContextTokens\n" + b"".join(
            b"%s,%s,%s\n" % (g, t, c) for t, c, g in (row.split(b",") for row in ROWS.splitlines())
        )),
        ("spaces around the names and values", b"TIMESTAMP , ContextTokens , GeneratedTokens\n" + ROWS.replace(b",", b" , ")),
        ("an explicit UTC zone", HEADER + b"".join(row.replace(b",", b"Z,", 1) + b"\n" for row in ROWS.splitlines())),
    ],
)
def test_harmless_trace_variants_replay_like_the_clean_trace(tmp_path, profile_path, capsys, name, body):
    clean = tmp_path / "clean.csv"
    clean.write_bytes(HEADER + ROWS)
    variant = tmp_path / "variant.csv"
    variant.write_bytes(body)
    assert replay_json(capsys, variant, profile_path) == replay_json(capsys, clean, profile_path)


def test_trace_with_a_utf8_bom_replays_identically_to_the_same_trace_without(tmp_path, profile_path, capsys):
    """Windows exports of the Azure trace start with a BOM; it used to hide the TIMESTAMP column."""
    with_bom = tmp_path / "bom.csv"
    with_bom.write_bytes(b"\xef\xbb\xbf" + SAMPLE_TRACE.read_bytes())
    with_data = replay_json(capsys, with_bom, profile_path)
    assert with_data == replay_json(capsys, SAMPLE_TRACE, profile_path)
    assert with_data["runs"][0]["num_requests"] == 300


def test_duplicate_timestamps_and_zero_output_requests_are_replayed(tmp_path, profile_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_bytes(HEADER + b"0,100,20\n0,100,20\n0,50,0\n0,50,1\n")
    run = replay_json(capsys, trace, profile_path)["runs"][0]
    decode_only = run["policies"]["decode-only"]["metrics"]
    assert run["num_requests"] == 4
    assert decode_only["requests_finished"] == 2 and decode_only["requests_prefill_only"] == 2


def test_unreadable_traces_exit_2_naming_the_file(tmp_path, profile_path, capsys):
    base = ["--profile", str(profile_path), "--no-plots"]
    for trace, message in (
        (tmp_path / "absent.csv", "No such file or directory"),
        (tmp_path, "Is a directory"),
    ):
        code, _, err = replay(capsys, "--trace", str(trace), *base)
        assert_refused(code, err, f"cannot read trace {trace}: {message}")
    locked = tmp_path / "locked.csv"
    locked.write_bytes(HEADER + ROWS)
    locked.chmod(0)
    if os.access(locked, os.R_OK):
        pytest.skip("running as a user who can read a mode-000 file (root)")
    code, _, err = replay(capsys, "--trace", str(locked), *base)
    assert_refused(code, err, f"cannot read trace {locked}: Permission denied")


def test_a_request_larger_than_the_kv_pool_exits_2_naming_the_trace_and_its_line(tmp_path, profile_path, capsys):
    """It used to be dropped silently (counted in requests_dropped): the pool could never run it."""
    trace = tmp_path / "huge.csv"
    trace.write_bytes(HEADER + b"0,374,44\n1,150000,10001\n2,879,55\n")
    base = ["--trace", str(trace), "--profile", str(profile_path), "--no-plots"]
    code, out, err = replay(capsys, *base)
    assert_refused(code, err, f"{trace}:3: a request of 150000 prompt + 10001 output tokens needs 160001 tokens of KV",
                   "--kv-capacity-tokens 160000")
    assert out == ""
    for ok in (["--kv-capacity-tokens", "160001"], ["--max-requests", "1"], ["--servers", "2"]):  # bigger pool, or left out
        code, out, err = replay(capsys, *base, *ok)
        assert code == (2 if ok[0] == "--servers" else 0), err
    # one output token: prefill only, it never reaches decode
    trace.write_bytes(HEADER + b"0,374,44\n1,170000,1\n")
    code, out, err = replay(capsys, *base)
    assert code == 0, err


# -- profiles -----------------------------------------------------------------------------


def _set(data: dict, path: tuple, value) -> dict:
    data = copy.deepcopy(data)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


def _without(data: dict, path: tuple) -> dict:
    data = copy.deepcopy(data)
    target = data
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return data


# (id, JSON text from the good profile's data, what the message must name after the file)
BAD_PROFILES = [
    # used to replay with rc 0 and a negative TPOT p99
    ("negative stage-2 slope", lambda d: json.dumps(_set(d, ("stage2", "combined", "k1"), -1.0)), "profile.stage2.combined.k1=-1.0: must be >= 0"),
    ("negative stage-2 intercept share", lambda d: json.dumps(_set(d, ("stage2", "combined", "b1"), -1.0)), "profile.stage2.combined.b1=-1.0: must be >= 0"),
    ("negative stage-1 slope", lambda d: json.dumps(_set(d, ("stage1", 5, "b0"), -1.0)), "profile.stage1[5].b0=-1.0: seconds per request must be >= 0"),
    ("stage 1 below zero", lambda d: json.dumps(_set(d, ("stage1", 1, "c0"), -1.0)), "profile.stage1[1].c0=-1.0: predicts -1 s for the smallest decode step"),
    ("NaN", lambda d: json.dumps(_set(d, ("stage1", 2, "k0"), "NAN")).replace('"NAN"', "NaN"), "profile.stage1[2].k0: NaN is not valid JSON"),
    ("Infinity", lambda d: json.dumps(_set(d, ("samples", 4, "step_latencies_s", 0), "INF")).replace('"INF"', "Infinity"), "profile.samples[4].step_latencies_s[0]: Infinity is not valid JSON"),
    ("1e309", lambda d: json.dumps(_set(d, ("profiled_range", "max_sum_context"), "BIG")).replace('"BIG"', "1e309"), "profile.profiled_range.max_sum_context: expected a finite number, got inf"),
    ("integer of 400 digits", lambda d: json.dumps(_set(d, ("stage2", "combined", "b1"), 10**400)), "profile.stage2.combined.b1: expected a finite number, got an integer of 1329 bits"),
    ("count over 64 bits", lambda d: json.dumps(_set(d, ("batch_size_buckets", 0), 2**64)), "profile.batch_size_buckets[0]: expected an integer within 64 bits"),
    ("bucket table too large to build", lambda d: json.dumps(_set(d, ("batch_size_buckets", 34), 2**40)), "profile.batch_size_buckets[34]=1099511627776: larger than any CUDA-graph capture size"),
    ("key given twice", lambda d: json.dumps(d).replace('"k1": 1.3', '"k1": 1.3, "k1": -1.3', 1), "profile.stage2.combined: names 'k1' twice"),
    ("string for a number", lambda d: json.dumps(_set(d, ("stage1", 0, "b0"), "fast")), "profile.stage1[0].b0: expected a finite number, got 'fast'"),
    ("object for a list", lambda d: json.dumps(_set(d, ("stage1",), {})), "profile.stage1: expected a list, got an object"),
    ("bool for an integer", lambda d: json.dumps(_set(d, ("grid", "batch_sizes", 0), True)), "profile.grid.batch_sizes[0]: expected an integer, got True"),
    ("zero batch size", lambda d: json.dumps(_set(d, ("grid", "batch_sizes", 0), 0)), "profile.grid: batch_sizes[0]=0: must be > 0"),
    ("missing section", lambda d: json.dumps(_without(d, ("stage1",))), "profile: missing field(s) stage1"),
    ("missing field", lambda d: json.dumps(_without(d, ("stage2", "combined", "k1"))), "profile.stage2.combined: missing field(s) k1"),
    ("too few stage-1 fits", lambda d: json.dumps(_set(d, ("stage1",), d["stage1"][:3])), "profile.stage1: 3 entries for a ladder of 6 levels"),
    ("a list, not a profile", lambda d: "[1, 2]", "profile: expected a JSON object, got list"),
    ("empty file", lambda d: "", "profile is not valid JSON: Expecting value: line 1 column 1"),
    ("truncated", lambda d: json.dumps(d)[:5000], "profile is not valid JSON: "),
    ("nested too deeply", lambda d: "[" * 100_000, "profile is not valid JSON"),
    ("co-run on the whole-device level", lambda d: json.dumps(_set(d, ("samples",), d["samples"] + [dict(next(s for s in d["samples"] if s["stage"] == "corun"), level=5)])), "profile.samples[132]: a co-run sample at level 5, where the trainer has no SMs"),
]


@pytest.mark.parametrize("name, text, message", BAD_PROFILES, ids=[c[0] for c in BAD_PROFILES])
def test_bad_profile_exits_2_naming_the_file_and_json_path(tmp_path, profile_data, capsys, name, text, message):
    profile = tmp_path / "bad.json"
    profile.write_text(text(profile_data))
    code, out, err = replay(capsys, "--trace", str(SAMPLE_TRACE), "--profile", str(profile), "--no-plots")
    assert_refused(code, err, f"{profile}: {message}")
    assert out == ""


def test_profile_without_stage2_is_checked_like_any_other(tmp_path, capsys):
    """Its missing stage 2 used to skip every other check: a negative stage-1 slope replayed."""
    data = synthetic.without_stage2(synthetic.harli_a100_llama3_8b())
    data["stage1"][5]["k0"] = -1e-6
    profile = tmp_path / "solo.json"
    profile.write_text(json.dumps(data))
    code, _, err = replay(capsys, "--trace", str(SAMPLE_TRACE), "--profile", str(profile), "--no-plots")
    assert_refused(code, err, f"{profile}: profile.stage1[5].k0=-1e-06: seconds per context token must be >= 0")


def test_profile_bytes_and_files(tmp_path, profile_path, capsys):
    base = ["--trace", str(SAMPLE_TRACE), "--no-plots"]
    latin = tmp_path / "latin.json"
    latin.write_bytes(profile_path.read_bytes().replace(b'"sglang"', b'"sglang\xff"', 1))
    code, _, err = replay(capsys, *base, "--profile", str(latin))
    assert_refused(code, err, f"{latin}: line ", "byte 0xff is not UTF-8")
    for path, message in ((tmp_path / "absent.json", "No such file or directory"), (tmp_path, "Is a directory")):
        code, _, err = replay(capsys, *base, "--profile", str(path))
        assert_refused(code, err, f"cannot read profile {path}: {message}")
    with_bom = tmp_path / "bom.json"
    with_bom.write_bytes(b"\xef\xbb\xbf" + profile_path.read_bytes())
    clean = replay_json(capsys, SAMPLE_TRACE, profile_path, "--max-requests", "40")
    with_bom_data = replay_json(capsys, SAMPLE_TRACE, with_bom, "--max-requests", "40")
    assert with_bom_data["profile"].pop("label") == "bom.json" and clean["profile"].pop("label") == "a100.json"
    assert with_bom_data == clean


def test_coefficients_predicting_absurd_steps_exit_2_instead_of_inf_results(tmp_path, profile_data, capsys):
    """Before: rc 0 with NaN batch means and an astronomical TPOT (the clock overflowed)."""
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps(_set(profile_data, ("stage1", 5, "c0"), 1e306)))
    code, _, err = replay(capsys, "--trace", str(SAMPLE_TRACE), "--profile", str(profile), "--no-plots", "--policies", "decode-only")
    assert_refused(code, err, "slow.json: profile.stage1[5] predicts 1e+306 s for one decode step of 256 requests holding 160000 tokens")
    code, _, err = replay(capsys, "--trace", str(SAMPLE_TRACE), "--profile", "synthetic-a100", "--no-plots",
                          "--policies", "static", "--error-scale", "1e300")
    assert_refused(code, err, "a simulated decode step took", "--error-scale")


# -- output directory ---------------------------------------------------------------------


def test_out_dir_that_is_a_file_exits_2_before_replaying(tmp_path, profile_path, capsys):
    """It used to replay for minutes, then die in the PNG writer with FileExistsError."""
    blocker = tmp_path / "out"
    blocker.write_text("not a directory")
    base = ["--trace", str(SAMPLE_TRACE), "--profile", str(profile_path)]
    code, out, err = replay(capsys, *base, "--out-dir", str(blocker))
    assert_refused(code, err, f"--out-dir {blocker} is a file, not a folder")
    code, out, err = replay(capsys, *base, "--out-dir", str(blocker / "sub"))
    assert_refused(code, err, f"--out-dir {blocker / 'sub'} lies below '{blocker}', which is a file")
    assert out == "" and blocker.read_text() == "not a directory"


def test_the_installed_entry_point_prints_one_line_and_no_traceback(tmp_path, profile_path):
    trace = tmp_path / "ragged.csv"
    trace.write_bytes(HEADER + b"0,1,2\n1,5\n")
    done = subprocess.run(
        [sys.executable, "-m", "harvest.cli", "replay", "--trace", str(trace), "--profile", str(profile_path), "--no-plots"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"harvest replay: {trace}:3: 2 field(s), the header has 3 (TIMESTAMP,ContextTokens,GeneratedTokens)\n"
