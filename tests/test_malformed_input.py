"""Malformed input to every `harvest` command: a clean error, or it is a bug.

A clean error: exit status 2, one line on stderr naming the file, flag or field and the
bad value, no traceback, nothing started or written. Each row runs the real entry point
(``python -m harvest.cli``) in a subprocess from an empty folder, after ``setup`` put the
row's input files there. The cases found by feeding each command bad input by hand; the
commands' own test files hold many more of their kind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HARVEST = [sys.executable, "-m", "harvest.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def tiny_model() -> str:
    from harvest.tiny_model import TINY_LLAMA, ensure_tiny_model

    return str(ensure_tiny_model(TINY_LLAMA))


def job_yaml(folder: Path, output_dir: str = "out", **overrides) -> None:
    """A valid job over the tiny model and the tests' tiny dataset, with ``overrides``."""
    import yaml

    from tests.train.trainer_helpers import job_dict

    (folder / "job.yaml").write_text(yaml.safe_dump(job_dict(tiny_model(), output_dir, **overrides)))


def write(name: str, text: str):
    return lambda folder: (folder / name).write_text(text)


def nothing(folder: Path) -> None:
    pass


REPLAY = ["replay", "--no-progress", "--no-plots", "--max-requests", "5"]

# (id, setup, argv (str.format'ed with model=the tiny model), stderr fragments)
CASES = [
    # YAML that does not parse: one line with its line and column, not PyYAML's four
    ("train job not YAML", write("job.yaml", "a: [1\n"), ["train", "--check", "job.yaml"],
     ["job file 'job.yaml' is not valid YAML: line 2, column 1: "]),
    ("launch config not YAML", write("c.yaml", "qos: [1\n"), ["launch", "--config", "c.yaml", "--", "--model-path", "{model}"],
     ["c.yaml is not valid YAML: line 2, column 1: "]),
    # LlamaFactory's import-time 'Version checking has been disabled' line came first
    ("train empty job", write("job.yaml", ""), ["train", "--check", "job.yaml"],
     ["job file 'job.yaml': model_name_or_path: required"]),
    ("train output_dir under a file", lambda d: (write("f", "x")(d), job_yaml(d, output_dir="f/run")),
     ["train", "--check", "job.yaml"], ["output_dir: '", "/f/run' lies below '", "/f', which is a file"]),
    ("train output_dir not writable", lambda d: job_yaml(d, output_dir="/proc/x"),
     ["train", "--check", "job.yaml"], ["output_dir: '/proc/x' cannot be written"]),
    # replay: flags that were ignored, and absurd errors that reached the scheduler first
    ("replay --router without --servers", nothing, [*REPLAY, "--router", "round-robin"],
     ["--router 'round-robin'", "--servers"]),
    ("replay --policies empty", nothing, [*REPLAY, "--policies", ""], ["--policies ''"]),
    ("replay --error-scale absurd", nothing, [*REPLAY, "--error-scale", "1e300"], ["--error-scale"]),
    ("replay --error-noise absurd", nothing, [*REPLAY, "--error-noise", "1e308"], ["--error-noise"]),
    # profile: each used to load the model (or measure the whole grid) before failing, rc 1
    ("profile --device unknown", nothing, ["profile", "--model-path", "{model}", "--device", "tpu"], ["--device 'tpu'"]),
    ("profile --out a folder", lambda d: (d / "p.json").mkdir(), ["profile", "--model-path", "{model}", "--out", "p.json"],
     ["--out p.json is a folder"]),
    ("profile --out not writable", nothing, ["profile", "--model-path", "{model}", "--out", "/proc/x/p.json"],
     ["--out /proc/x/p.json cannot be written"]),
    ("profile --report not writable", nothing, ["profile", "--model-path", "{model}", "--out", "p.json", "--report",
                                               "/proc/x.png"], ["--report /proc/x.png cannot be written"]),
    ("profile --lora-rank 0", nothing, ["profile", "--model-path", "{model}", "--out", "p.json", "--lora-rank", "0"],
     ["--lora-rank=0"]),
    ("profile --finetune-model missing", nothing, ["profile", "--model-path", "{model}", "--out", "p.json",
                                                   "--finetune-model", "nope"], ["--finetune-model nope"]),
    ("profile --finetune-job missing", nothing, ["profile", "--model-path", "{model}", "--out", "p.json",
                                                 "--finetune-job", "nope.yaml"], ["--finetune-job nope.yaml"]),
    ("profile --finetune-job not YAML", write("j.yaml", "a: [1\n"), ["profile", "--model-path", "{model}", "--out",
                                                                    "p.json", "--finetune-job", "j.yaml"],
     ["--finetune-job j.yaml: is not valid YAML: line 2, column 1"]),
    ("profile --finetune-job a list", write("j.yaml", "- 1\n"), ["profile", "--model-path", "{model}", "--out",
                                                                "p.json", "--finetune-job", "j.yaml"],
     ["--finetune-job j.yaml: expected a YAML mapping"]),
    # demo: NaN passed `<= 0`, and the rest failed once its SGLang server was up (or after it)
    ("demo --target-tpot-ms nan", nothing, ["demo", "--target-tpot-ms", "nan"], ["--target-tpot-ms=nan"]),
    ("demo --time-scale inf", nothing, ["demo", "--time-scale", "inf"], ["--time-scale=inf"]),
    ("demo --out-dir not writable", nothing, ["demo", "--out-dir", "/proc/x"], ["--out-dir /proc/x cannot be written"]),
    ("demo --profile truncated", write("p.json", "{"), ["demo", "--profile", "p.json"], ["--profile p.json", "not valid JSON"]),
    ("demo --model-path missing", nothing, ["demo", "--model-path", "nope", "--profile", "p.json"], ["--model-path nope"]),
    # launch: a model path that is no folder started SGLang, which died in a traceback
    ("launch --model-path missing", nothing, ["launch", "--", "--model-path", "/nonexistent/model"],
     ["--model-path /nonexistent/model: no such folder"]),
    ("replay --out-dir not writable", nothing, ["replay", "--no-progress", "--max-requests", "5", "--out-dir", "/proc/x"],
     ["--out-dir /proc/x cannot be written"]),
]


@pytest.mark.parametrize("name, setup, argv, fragments", CASES, ids=[case[0] for case in CASES])
def test_malformed_input_is_a_clean_error(tmp_path, name, setup, argv, fragments):
    setup(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    argv = [arg.format(model=tiny_model()) if "{model}" in arg else arg for arg in argv]
    done = subprocess.run([*HARVEST, *argv], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"harvest {argv[0]}: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert sorted(tmp_path.rglob("*")) == before, "files were written"
