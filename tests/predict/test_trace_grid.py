"""`harvest profile --grid-from-trace`: the grid chosen from the steps a trace produces on
one decode instance (harvest.replay's model), the limits a grid must fit (the instance's,
the model's positions, the device's memory), and bad input refused before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from harvest import cli
from harvest.predict.profiler import grid_capacity, session
from harvest.predict.profiler.partial import partial_path
from harvest.predict.profiler.trace_grid import (
    TraceGridError,
    TraceSteps,
    capture_size,
    choose_grid,
    context_multiple,
    trace_steps,
)
from harvest.replay import synthetic
from harvest.replay.trace import SAMPLE_TRACE

STEPS_PER_POINT = 3 + 10 + 1  # the default warm-up + timed steps + the prefill's token
LLAMA3_8B = {  # config.json fields of Llama-3-8B
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def sample_steps() -> TraceSteps:
    # The synthetic A100 profile times the steps: the committed profiles/ may change.
    return trace_steps(SAMPLE_TRACE, "synthetic-a100", 256, 160_000)


def _steps(batch, sums, max_batch=256, kv=160_000) -> TraceSteps:
    return TraceSteps("t.csv", 10, np.asarray(batch, dtype=np.int64), np.asarray(sums, dtype=np.int64), ("decode-only",),
                      "p.json", max_batch, kv)


# -- the grid chosen from the sample trace ----------------------------------------------------


def test_sample_trace_grid_is_deterministic_and_spaced_where_the_steps_are(sample_steps):
    again = trace_steps(SAMPLE_TRACE, "synthetic-a100", 256, 160_000)
    assert np.array_equal(sample_steps.batch_sizes, again.batch_sizes)
    assert np.array_equal(sample_steps.sum_contexts, again.sum_contexts)
    grid = choose_grid(sample_steps, STEPS_PER_POINT, kv_capacity_tokens=160_000)
    assert grid == choose_grid(again, STEPS_PER_POINT, kv_capacity_tokens=160_000)
    assert sample_steps.policies == ("harvest", "separate", "static", "decode-only")
    assert grid.batch_sizes == (1, 8, 24, 64) and grid.context_lengths == (64, 1088, 1200)
    assert len(grid.batch_sizes) * len(grid.context_lengths) <= 12  # as many points as the default grid

    b, s = sample_steps.batch_sizes, sample_steps.sum_contexts
    # spaced where the steps are: the inner batch sizes are the steps' terciles, rounded to capture sizes
    terciles = np.quantile(b, [1 / 3, 2 / 3], method="nearest")
    assert list(grid.batch_sizes[1:3]) == [capture_size(int(t), "nearest") for t in terciles]
    assert (b < grid.batch_sizes[1]).mean() < 0.5 and (b > grid.batch_sizes[2]).mean() < 0.5
    # the middle context: the steps' median tokens per request, lying between the ends here
    # (1090; where it does not, their geometric mean: the next test)
    median = float(np.quantile(s / b, 0.5, method="nearest"))
    assert grid.context_lengths[0] < median < grid.context_lengths[-1]
    assert grid.context_lengths[1] == context_multiple(median, "nearest")
    # covers the steps' extremes: the measured range holds every step
    assert grid.batch_sizes[0] <= b.min() and grid.batch_sizes[-1] >= b.max()
    assert grid.batch_sizes[-1] * (grid.context_lengths[-1] + 1) >= s.max()
    assert grid.batch_sizes[0] * (grid.context_lengths[0] + STEPS_PER_POINT) <= s.min()
    assert grid.covered_fraction == 1.0
    # and reaches no further than the largest step needs (one rounding step past it)
    assert grid.batch_sizes[-1] * (grid.context_lengths[-1] - 16) < s.max()


def test_the_report_is_a_header_and_one_line_per_axis(sample_steps):
    lines = choose_grid(sample_steps, STEPS_PER_POINT).lines(sample_steps)
    assert len(lines) == 3
    assert lines[0].startswith(f"grid from {SAMPLE_TRACE}: its 300 requests at their recorded rate through one decode instance")
    assert "step latencies from synthetic-a100" in lines[0] and "100.0 % of them inside" in lines[0]
    assert lines[1].startswith("  batch sizes 1,8,24,64: the steps' batch sizes at quantiles 0, 1/3, 2/3, 1 are 1,6,20,63")
    assert lines[2].startswith("  context lengths 64,1088,1200 (tokens per request): 64 keeps the smallest step's")
    assert "1088 is the steps' median tokens per request (1090)" in lines[2]


def test_a_median_outside_the_ends_gives_their_geometric_mean():
    # per request: 500 at batch size 1, 100 in three steps of 10, 2000 in one: the median (100)
    # lies under the smallest context (480: the smallest step's Σctx less a point's steps)
    steps = _steps([1, 10, 10, 10, 10], [500, 1000, 1000, 1000, 20000], max_batch=100, kv=100_000)
    grid = choose_grid(steps, STEPS_PER_POINT)
    low, middle, high = grid.context_lengths
    assert (low, high) == (480, 1264) and middle == context_multiple((low * high) ** 0.5, "nearest") == 784
    assert "784 lies between them (geometric mean; the steps' median tokens per request, 100, is not)" in grid.lines(steps)[2]


def test_a_grid_chosen_from_a_trace_covers_the_replay_of_that_trace(sample_steps, tmp_path, capsys):
    """The synthetic profile measured on the chosen grid has the same latencies as the one
    that timed the steps: `harvest replay` of the trace finds no step outside its range."""
    grid = choose_grid(sample_steps, STEPS_PER_POINT)
    default = synthetic.harli_a100_llama3_8b()
    profile = synthetic.build_profile(
        default.ladder, synthetic.harli_a100_solo(), synthetic.HARLI_A100_CORUN,
        grid=synthetic.Grid(grid.batch_sizes, grid.context_lengths), device_name="synthetic: the sample's grid",
    )
    path = tmp_path / "covering.json"
    profile.save(path)
    code = cli.main(["replay", "--trace", str(SAMPLE_TRACE), "--profile", str(path), "--no-plots", "--json", "--no-progress",
                     "--memory", "reclaim_ms_per_chunk=7"])  # the profile has no reclaim figure: no warning about it
    captured = capsys.readouterr()
    assert code == 0 and "warning" not in captured.err
    data = json.loads(captured.out.strip().splitlines()[-1])
    assert data["steps_outside_profile_fraction"] == 0.0 and data["steps_outside_profile_warning"] is False


# -- the choice, rule by rule -----------------------------------------------------------------


def test_rounding_to_capture_sizes_and_context_multiples():
    assert [capture_size(v, "nearest") for v in (1, 3, 5, 7, 9, 13, 20, 100)] == [1, 4, 4, 8, 8, 16, 24, 104]
    assert capture_size(3, "down") == 2 and capture_size(3, "up") == 4 and capture_size(103, "up") == 104
    assert capture_size(17, "down") == 16 and capture_size(0.5, "down") == 1
    assert context_multiple(78, "down") == 64 and context_multiple(1077.5, "up") == 1088 and context_multiple(990, "nearest") == 992
    assert context_multiple(7.2, "down") == 7 and context_multiple(0.2, "down") == 1


def test_the_largest_batch_is_capped_by_the_instance_and_the_largest_context_by_its_kv():
    steps = _steps([1, 5, 9, 100], [500, 5000, 9000, 99_000], max_batch=100, kv=100_000)
    grid = choose_grid(steps, STEPS_PER_POINT, kv_capacity_tokens=100_000)
    assert grid.batch_sizes[-1] == 100  # 104 would be the capture size: over --max-batch-size
    assert grid.context_lengths[-1] == 992  # ceil(99000/100) = 990 -> 992
    capped = choose_grid(_steps([1, 100], [500, 99_990], max_batch=100, kv=100_000), STEPS_PER_POINT, kv_capacity_tokens=100_000)
    assert capped.context_lengths[-1] == 1000  # 1008 would hold 100_800 > 100_000 tokens
    assert "no more at batch size 100 under --kv-capacity-tokens 100000" in capped.context_why


def test_one_batch_size_in_every_step_gets_a_second_and_an_explicit_axis_is_kept():
    grid = choose_grid(_steps([1, 1, 1], [200, 300, 400]), STEPS_PER_POINT)
    assert grid.batch_sizes == (1, 2) and "2 added: stage 1 needs two batch sizes" in grid.batch_why
    with pytest.raises(TraceGridError, match="every step has batch size 1 and --max-batch-size 1 allows no larger one"):
        choose_grid(_steps([1, 1], [200, 300], max_batch=1), STEPS_PER_POINT)
    given = choose_grid(_steps([1, 5, 9, 40], [500, 5000, 9000, 40_000]), STEPS_PER_POINT, batch_sizes=(4, 16))
    assert given.batch_sizes == (4, 16) and given.batch_why == "as --batch-sizes gave them"
    assert given.context_lengths[-1] == 2512  # 40000 / 16 = 2500 -> 2512: around the given batch sizes
    assert given.covered_fraction == 0.5  # the steps of batch size 5 and 9: inside the given [4, 16]
    both = choose_grid(_steps([1, 2], [100, 200]), STEPS_PER_POINT, batch_sizes=(4, 8), context_lengths=(64, 128))
    assert both.context_why == "as --context-lengths gave them"


# -- through the command ------------------------------------------------------------------------


@pytest.fixture
def no_profiling(monkeypatch):
    """session.profile replaced: what it would have been given, and whether it ran."""
    calls = []
    monkeypatch.setattr(session, "profile", lambda args, model_path, measure: calls.append(args) or 0)
    return calls


def _profile(tmp_path, *argv) -> int:
    return cli.main(["profile", "--model-path", "tiny-llama", "--engine", "transformers", "--out", str(tmp_path / "p.json"), *argv])


def test_the_command_profiles_the_chosen_grid_and_says_why(tmp_path, capsys, no_profiling, tiny_llama_path):
    code = _profile(tmp_path, "--grid-from-trace", str(SAMPLE_TRACE), "--grid-profile", "synthetic-a100")
    out = capsys.readouterr().out
    assert code == 0 and len(no_profiling) == 1
    assert no_profiling[0].batch_sizes == (1, 8, 24, 64) and no_profiling[0].context_lengths == (64, 1088, 1200)
    lines = out.splitlines()
    assert lines[0].startswith(f"harvest profile: grid from {SAMPLE_TRACE}")
    assert lines[1].startswith("  batch sizes 1,8,24,64: ") and lines[2].startswith("  context lengths 64,1088,1200 ")
    # the instance's limits bound the simulated steps, so the grid; an explicit axis is kept
    code = _profile(tmp_path, "--grid-from-trace", str(SAMPLE_TRACE), "--grid-profile", "synthetic-a100",
                    "--max-batch-size", "8", "--kv-capacity-tokens", "4000", "--context-lengths", "32,256")
    assert code == 0, capsys.readouterr().err
    args = no_profiling[-1]
    assert max(args.batch_sizes) <= 8 and args.context_lengths == (32, 256)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--grid-from-trace", "{tmp}/absent.csv"], "harvest profile: --grid-from-trace: cannot read trace {tmp}/absent.csv: No such file"),
        (["--grid-from-trace", "{tmp}/bad.csv"], "harvest profile: --grid-from-trace: {tmp}/bad.csv:3: ContextTokens='many' is not an integer"),
        (["--grid-from-trace", "{tmp}"], "cannot read trace {tmp}: Is a directory"),
        (["--grid-from-trace", str(SAMPLE_TRACE), "--grid-profile", "{tmp}/absent.json"], "--grid-profile: cannot read profile {tmp}/absent.json"),
        (["--grid-profile", "synthetic-a100"], "--grid-profile synthetic-a100: times the steps of --grid-from-trace"),
        (["--max-batch-size", "0"], "--max-batch-size=0: must be an integer >= 1"),
        (["--kv-capacity-tokens", "-5"], "--kv-capacity-tokens=-5: must be an integer >= 1"),
        (["--batch-sizes", "4,512", "--max-batch-size", "256"],
         "--batch-sizes 4,512 x --context-lengths 64,128,256,512 (default): batch size 512 is over --max-batch-size 256"),
        (["--batch-sizes", "4,256", "--context-lengths", "64,1024", "--kv-capacity-tokens", "160000"],
         "its largest point holds 256 x 1024 = 262144 context tokens, more than --kv-capacity-tokens 160000"),
        (["--context-lengths", "64,4096"],
         "--context-lengths 64,4096: 4096 tokens per request + the 14 steps a point decodes exceed the model's "
         "max_position_embeddings 2048 (config.json)"),
        (["--batch-sizes", "4,100000000", "--context-lengths", "64,1000"],
         "--batch-sizes 4,100000000 x --context-lengths 64,1000: its largest point, 100000000 requests x 1000 tokens "
         "(+14 decode steps), needs 48351.3 GiB of KV cache (512 B/token: K and V x 2 layers x 2 KV heads x 16 dims x float32"),
    ],
)
def test_bad_input_exits_2_naming_the_file_or_flag_and_nothing_starts(argv, message, tmp_path, capsys, no_profiling, tiny_llama_path):
    (tmp_path / "bad.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.5,374,44\n1.0,many,10\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code = _profile(tmp_path, *argv)
    err = capsys.readouterr().err
    assert code == 2 and message.replace("{tmp}", str(tmp_path)) in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert no_profiling == [] and not partial_path(tmp_path / "p.json").exists()


def test_a_chosen_grid_the_device_cannot_hold_is_refused_naming_the_trace_and_the_bounds(tmp_path, capsys, no_profiling,
                                                                                        tiny_llama_path, monkeypatch):
    monkeypatch.setattr(grid_capacity, "device_free_bytes", lambda device: 2**20)  # a device with 1 MiB free
    code = _profile(tmp_path, "--grid-from-trace", str(SAMPLE_TRACE), "--grid-profile", "synthetic-a100")
    err = capsys.readouterr().err
    assert code == 2 and no_profiling == []
    assert err.startswith(f"harvest profile: the grid from --grid-from-trace {SAMPLE_TRACE} (batch sizes 1,8,24,64 x context "
                          "lengths 64,1088,1200; bound it with --max-batch-size/--kv-capacity-tokens): its largest point, "
                          "64 requests x 1200 tokens (+14 decode steps), needs 37.9 MiB of KV cache (512 B/token"), err
    assert "and cpu has 1.0 MiB free" in err


# -- what a grid needs --------------------------------------------------------------------------


def test_kv_and_weights_are_worked_out_from_config_json():
    per_token, how = grid_capacity.kv_bytes_per_token(LLAMA3_8B, "bfloat16")
    assert per_token == 131072 == 2 * 32 * 8 * 128 * 2  # harvest replay's Llama-3-8B figure
    assert how == "K and V x 32 layers x 8 KV heads x 128 dims x bfloat16"
    assert grid_capacity.weight_bytes(LLAMA3_8B, "bfloat16") == pytest.approx(2 * 8.03e9, rel=0.01)
    latent = grid_capacity.kv_bytes_per_token({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, "bfloat16")
    assert latent[0] == 61 * 576 * 2
    assert grid_capacity.kv_bytes_per_token({}, "bfloat16") is None and grid_capacity.weight_bytes({"hidden_size": 8}, "float32") is None


def test_memory_check_counts_the_largest_point_and_the_engine_pool():
    def problem(free_gib, engine="transformers", tp=1, device="cuda:0"):
        return grid_capacity.memory_problem(LLAMA3_8B, "bfloat16", engine, tp, (1, 256), (64, 1024), 14, device,
                                            int(free_gib * 2**30), "--batch-sizes 1,256 x --context-lengths 64,1024")

    # 256 x (1024 + 14) tokens x 128 KiB = 32.4 GiB of KV, ~15 GiB of weights
    assert problem(48.0) is None
    refused = problem(46.0)
    assert refused.startswith("--batch-sizes 1,256 x --context-lengths 64,1024: its largest point, 256 requests x 1024 tokens "
                              "(+14 decode steps), needs 32.4 GiB of KV cache (131072 B/token")
    assert "beside about 15.0 GiB of weights, and cuda:0 has 46.0 GiB free" in refused
    assert problem(48.0, engine="sglang") is not None  # its pool adds 64 tokens per request: 34.4 GiB
    assert problem(24.0, tp=2) is None and "per rank of 2" in problem(23.0, tp=2)
    assert grid_capacity.memory_problem({}, "bfloat16", "sglang", 1, (1, 2), (1, 2), 14, "cpu", 1, "x") is None  # nothing to go on


def test_the_device_memory_is_known_on_this_machine():
    free = grid_capacity.device_free_bytes("cpu")
    assert free is None or free > 2**20


def test_help_says_how_the_flags_combine():
    env = {**os.environ, "COLUMNS": "1000"}  # no wrapping: argparse would hyphenate flags
    out = subprocess.run([sys.executable, "-m", "harvest.cli", "profile", "--help"], capture_output=True, text=True, timeout=60,
                         env=env).stdout
    flat = " ".join(out.split())
    assert "--grid-from-trace TRACE" in flat and "--batch-sizes or --context-lengths given with it are kept" in flat
    assert "--max-batch-size and --kv-capacity-tokens are the simulated instance's, so no point exceeds them" in flat


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_profile_measured_on_the_chosen_grid_covers_the_traces_steps(tmp_path, tiny_llama_path):
    """End to end on the tiny model, the instance bounded small so the grid is: the profile
    measures exactly the grid printed, and its range holds every step the grid came from."""
    out = tmp_path / "traced.json"
    bounds = ["--max-batch-size", "4", "--kv-capacity-tokens", "2000"]
    cmd = [sys.executable, "-m", "harvest.cli", "profile", "--model-path", "tiny-llama", "--engine", "transformers",
           "--grid-from-trace", str(SAMPLE_TRACE), "--grid-profile", "synthetic-a100", *bounds, "--warmup", "1",
           "--repeats", "2", "--torch-threads", "1", "--trainer-alone-s", "0.3", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    from harvest.predict.schema import Profile

    profile = Profile.load(out)
    steps = trace_steps(SAMPLE_TRACE, "synthetic-a100", 4, 2000)
    chosen = choose_grid(steps, 1 + 2 + 1, kv_capacity_tokens=2000)
    assert (profile.grid.batch_sizes, profile.grid.context_lengths) == (chosen.batch_sizes, chosen.context_lengths)
    assert f"batch sizes {','.join(map(str, chosen.batch_sizes))}: " in result.stdout
    assert "--grid-from-trace" in profile.provenance.command_line
    r = profile.profiled_range
    inside = ((steps.batch_sizes >= r.min_batch_size) & (steps.batch_sizes <= r.max_batch_size)
              & (steps.sum_contexts >= r.min_sum_context) & (steps.sum_contexts <= r.max_sum_context))
    assert inside.mean() >= chosen.covered_fraction > 0.99


def test_an_axis_given_beside_a_trace_is_checked_against_the_instance_it_was_replayed_on(tmp_path, capsys, no_profiling,
                                                                                          tiny_llama_path):
    code = _profile(tmp_path, "--grid-from-trace", str(SAMPLE_TRACE), "--grid-profile", "synthetic-a100", "--batch-sizes", "4,512")
    err = capsys.readouterr().err
    assert code == 2 and no_profiling == []
    assert f"the grid from --grid-from-trace {SAMPLE_TRACE} (batch sizes 4,512 x context lengths " in err
    assert "batch size 512 is over --max-batch-size 256, more requests than the decode instance batches" in err
