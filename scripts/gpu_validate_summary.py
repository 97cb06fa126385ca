#!/usr/bin/env python3
"""The summary of a gpu_validate.sh run: OUT_DIR/summary.json from what the steps wrote.

    python3 scripts/gpu_validate_summary.py OUT_DIR

Run after every step (so a call cut short still has one) and at the end. Standard library
only. ``summary.json`` holds every step's status, the JSON each step left, the GPU tests'
outcomes, and ``claims``: for each figure (a)-(g) of docs/gpu-validation.md the numbers
found and the file they come from, or why it was not measured (step not run, failed,
skipped, or a CPU rehearsal, whose numbers are no GPU figures). Nothing is invented: a
claim with no file behind it says "not measured".
"""

from __future__ import annotations

import csv
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

CLAIMS = {
    "a": "VMM lend/reclaim on CUDA under concurrent decode kernels: no fault, call counts, us",
    "b": "green-context partitions limit SMs: spin kernel and a real decode step per level",
    "c": "decode CUDA graphs captured per level respect their partition",
    "d": "a measured profile: stage-1 / stage-2 MAPE",
    "e": "QoS under co-location, decode CUDA graphs on: TPOT violation rate at 40 ms and at a tight target",
    "f": "trainer throughput: harvest vs StaticMode vs trainer alone, same run",
    "g": "tensor parallel (tp = 2, NCCL): the trainer's losses and adapter equal tp = 1's; a fault on one rank stops both",
}


def load(out: Path, name: str):
    path = out / name
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


def junit(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        cases = ET.parse(path).getroot().iter("testcase")
    except ET.ParseError:
        return None
    outcome, reasons = {}, {}
    for case in cases:
        kind = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        key = f"{case.get('classname')}::{case.get('name')}"
        outcome[key] = "passed" if kind is None else kind.tag
        if kind is not None and kind.tag == "skipped":
            reasons[kind.get("message", "")] = reasons.get(kind.get("message", ""), 0) + 1
    values = list(outcome.values())
    return {"counts": {k: values.count(k) for k in sorted(set(values))},
            "not_passed": {k: v for k, v in outcome.items() if v != "passed"}, "skip_reasons": reasons}


VALIDATION_MARK = "GPU-VALIDATION "


def validation_lines(path: Path) -> list[dict]:
    """The ``GPU-VALIDATION name {json}`` lines tests/compute/test_greenctx_gpu.py prints.

    Under ``pytest -s`` a line rarely starts with the mark: pytest writes the test file's
    name or the progress dots of the tests before it first
    (``tests/compute/test_greenctx_gpu.py GPU-VALIDATION ladder {...}``,
    ``..GPU-VALIDATION scaling {...}``), so the mark is looked for anywhere in the line and
    the JSON read from just after the name, whatever follows it.
    """
    if not path.is_file():
        return []
    found, decoder = [], json.JSONDecoder()
    for line in path.read_text(errors="replace").splitlines():
        start = line.find(VALIDATION_MARK)
        if start < 0:
            continue
        name, _, rest = line[start + len(VALIDATION_MARK):].partition(" ")
        try:
            values, _ = decoder.raw_decode(rest.lstrip())
        except ValueError:
            continue
        if name:
            found.append({"name": name, "values": values})
    return found


def profile_figures(profile: dict) -> dict:
    levels = profile["ladder"]["levels"]
    biggest = max((s["batch_size"], s["context_length"]) for s in profile["samples"])
    return {
        "stage1_quality": [{"decode_sms": levels[i]["decode_sms"], **lv["quality"]} for i, lv in enumerate(profile["stage1"])],
        "stage2_quality": profile["stage2"]["combined"]["quality"],
        # A decode step of the model, time vs decode SMs (solo, largest grid point).
        "decode_step_ms_vs_decode_sms": [
            [levels[s["level"]]["decode_sms"], round(s["latency_s"] * 1e3, 3)] for s in profile["samples"]
            if s["stage"] == "solo" and (s["batch_size"], s["context_length"]) == biggest],
        "largest_point": biggest,
        "device": profile.get("provenance", {}).get("device_name"),
    }


def claims(out: Path, run: dict, steps: dict, summary: dict) -> dict:
    on_gpu = run.get("device") == "cuda"
    rehearsal = "" if on_gpu else f"CPU rehearsal ({run.get('device_reason', 'no CUDA device')}): not a GPU figure"

    def entry(claim: str, step_names: list[str], files: list[str], figures) -> dict:
        ran = [steps[n] for n in step_names if n in steps]
        result = {"claim": CLAIMS[claim], "steps": step_names, "files": files}
        if not ran:
            result["not_measured"] = "step not run in this part"
        elif figures in (None, {}, []):
            bad = "; ".join(f"{s['step']}: {s['status']}" for s in ran if s["status"] != "ok")
            result["not_measured"] = f"no figures in {', '.join(files)}" + (f" ({bad})" if bad else "")
        else:
            result["figures"] = figures
            if rehearsal:
                result["not_measured"] = rehearsal
        return result

    vmm = summary.get("bench_vmm") or {}
    vmm_figures = {k: v for k, v in vmm.items() if k.startswith(("lend", "reclaim", "map_", "unmap_", "access_",
                                                                  "under_load_", "fuzz_", "create_"))}
    if vmm_figures:
        vmm_figures["backend"] = vmm.get("backend")
        tests = summary.get("gpu_tests") or {}
        memory = {k: v for k, v in (tests.get("not_passed") or {}).items() if "memory" in k}
        vmm_figures["device_allocator_tests_not_passed"] = memory
    graphs = (summary.get("level_graphs") or {}).get("modes", {}).get("level-graphs") or {}
    decode_per_level = {bs: [[r["decode_sms"], r["eager_ms"]] for r in data["levels"]]
                        for bs, data in (graphs.get("batch_sizes") or {}).items()}
    partition = {"spin_kernel": [line for line in summary.get("gpu_validation", [])
                                 if line["name"] in ("ladder", "scaling", "isolation")],
                 "decode_step_ms_per_level_by_batch_size": decode_per_level}
    if summary.get("profile"):
        partition["profile_decode_step_ms_vs_decode_sms"] = summary["profile"]["decode_step_ms_vs_decode_sms"]
    if not partition["spin_kernel"] and not decode_per_level:
        partition = None
    graph_rows = {bs: [{k: r.get(k) for k in ("decode_sms", "eager_ms", "graph_ms", "graph_over_whole_graph",
                                               "eager_over_whole_eager", "partition_respected", "verdict",
                                               "graph_max_abs_diff_vs_eager")} for r in data["levels"]]
                  for bs, data in (graphs.get("batch_sizes") or {}).items()
                  if any(r.get("graph_ms") is not None for r in data["levels"])}
    graph_figures = {"by_batch_size": graph_rows, "memory_by_level": graphs.get("memory_by_level")} if graph_rows else None
    colocate = (summary.get("colocate") or {}).get("modes") or {}
    qos = {mode: {k: r.get(k) for k in ("tpot_ms_p50", "tpot_ms_p99", "violation_rate", "violation_rate_at",
                                        "itl_ms_p99", "trainer_step_fraction", "interrupted", "graphs",
                                        "graph_steps", "eager_steps", "graphs_reason")}
           for mode, r in colocate.items() if "tpot_ms_p50" in r}
    rates = {mode: r.get("trainer_tokens_per_s") for mode, r in colocate.items()
             if r.get("trainer_tokens_per_s") is not None}
    ratios = {k: v for k, v in (summary.get("colocate") or {}).items() if "_trainer_vs_" in k}
    predictor = summary.get("bench_predictor") or {}
    profile = summary.get("profile")
    profile_figures_ = None
    if profile:
        profile_figures_ = {"stage1": profile["stage1_quality"], "stage2": profile["stage2_quality"],
                            "held_out": {k: predictor.get(k) for k in ("stage1_mape", "stage2_mape") if k in predictor}}
    why_no_graphs = graphs.get("graphs_unavailable")
    tp_trainer, tp_fault = summary.get("tp_trainer") or {}, summary.get("tp_fault") or {}
    tp_figures = None
    if "max_loss_diff" in tp_trainer or "outcomes" in tp_fault:
        tp_figures = {**{k: tp_trainer.get(k) for k in ("max_loss_diff", "max_adapter_diff", "tp_seconds",
                                                         "tp1_seconds", "outcomes") if k in tp_trainer},
                      "fault_outcomes": tp_fault.get("outcomes")}
    result = {
        "a": entry("a", ["bench-vmm", "gpu-tests"], ["bench-vmm.json", "gpu-tests.xml"], vmm_figures),
        "b": entry("b", ["greenctx", "level-graphs"], ["greenctx.stdout.txt", "level-graphs.json"], partition),
        "c": entry("c", ["level-graphs"], ["level-graphs.json"], graph_figures),
        "d": entry("d", ["profile", "bench-predictor"], [run.get("profile", "profile"), "bench-predictor.json"],
                   profile_figures_),
        "e": entry("e", ["colocate"], ["colocate.json", "colocate-steps.json"], qos),
        "f": entry("f", ["colocate"], ["colocate.json"], {"trainer_tokens_per_s": rates, **ratios} if rates else None),
        "g": entry("g", ["tp-trainer", "tp-fault"], ["tp-trainer.json", "tp-fault.json"], tp_figures),
    }
    skipped = tp_trainer.get("skipped") or tp_fault.get("skipped")
    if skipped and "figures" not in result["g"]:
        result["g"]["not_measured"] = skipped
    if why_no_graphs and "figures" not in result["c"] and "level-graphs" in steps:
        result["c"]["not_measured"] = why_no_graphs
    if vmm.get("backend") == "host" and "figures" in result["a"]:
        result["a"]["not_measured"] = "bench-vmm ran the host backend: " + (rehearsal or "no CUDA device")
    return result


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    run = load(out, "run.json") or {}
    rows = list(csv.DictReader((out / "steps.tsv").open(), delimiter="\t")) if (out / "steps.tsv").is_file() else []
    steps = {row["step"]: row for row in rows}  # the last run of a step (part all runs build twice)
    summary = {"run": run, "steps": rows, "doctor": load(out, "doctor.json"), "bench_vmm": load(out, "bench-vmm.json"),
               "level_graphs": load(out, "level-graphs.json"), "bench_predictor": load(out, "bench-predictor.json"),
               "colocate": load(out, "colocate.json"), "tp_trainer": load(out, "tp-trainer.json"),
               "tp_fault": load(out, "tp-fault.json")}
    for name, xml in (("greenctx_tests", "greenctx.xml"), ("gpu_tests", "gpu-tests.xml")):
        summary[name] = junit(out / xml)
    summary["gpu_validation"] = (validation_lines(out / "greenctx.stdout.txt")
                                 + validation_lines(out / "gpu-tests.stdout.txt"))
    profile = load(out, run.get("profile", "cuda-llama3-8b-transformers.json"))
    summary["profile"] = profile_figures(profile) if profile else None
    summary["claims"] = claims(out, run, steps, summary)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out / "summary.json")
    for row in rows:
        print(f"{row['step']:16} {row['status']:34} {row['seconds']:>5}s of {row.get('timeout_s') or '-':>4}s")
    for claim, data in summary["claims"].items():
        state = data.get("not_measured") or "measured"
        print(f"({claim}) {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
