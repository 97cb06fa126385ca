#!/usr/bin/env python3
"""The summary of a gpu_validate.sh run: OUT_DIR/summary.json from what the steps wrote.

    python3 scripts/gpu_validate_summary.py OUT_DIR

Run after every step (so a call cut short still has one) and at the end. Standard library
only. ``summary.json`` holds every step's status, the JSON each step left, the GPU tests'
outcomes, and ``claims``: for each figure (a)-(l) of docs/gpu-validation.md the numbers
found and the file they come from, or why it was not measured (step not run, failed,
skipped, or a CPU rehearsal, whose numbers are no GPU figures). Nothing is invented: a
claim with no file behind it says "not measured". ``goals``: issue 39's targets for round
two (parts 4 and 5), each with the value found, its file and key, and ``met`` (true, false,
or null where nothing was measured or only a CPU rehearsal ran).
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
    # round two (issue 39)
    "h": "the trainer on the GPU, Llama-3-8B shape: eager vs compiled tokens/s and host us per layer unit, one run",
    "i": "claim (f) with the compiled trainer: harvest vs StaticMode vs trainer alone at 40 ms and a tight target, QoS",
    "j": "lend/reclaim per chunk and per page, alone and under decode kernels, driver calls per lend/reclaim",
    "k": "a paged profile over the Azure sample's grid: stage-1/stage-2 MAPE, steps outside the grid, fleet replay",
    "l": "a burst of long prompts in the co-location experiment: urgent reclaims and the decode delay they add",
}
# Why claim (l) has no step: what would measure it does not run on the GPU machine.
NO_BURST_STEP = ("no step of the plan measures it: scripts/colocate_gpu.py has no KV lending and no burst of long "
                 "prompts, and scripts/bench_lending.py (which has both) needs SGLang, which the GPU machine lacks")
# Issue 39's goals for round two: (name, claim, what, comparison, target).
GOALS = (
    ("trainer_alone_tokens_per_s", "i", "the compiled trainer alone, tokens/s", ">=", 12000),
    ("compiled_vs_peft", "h", "the compiled trainer's tokens/s over plain PEFT's, same run", ">=", 1.0),
    ("harvest_vs_static_trainer", "i", "harvest's trainer tokens/s over StaticMode's", ">=", 1.5),
    ("harvest_violation_rate_40ms", "i", "harvest's TPOT violations at 40 ms", "<=", 0.0),
    ("lend_reclaim_ms_per_chunk", "j", "the slower of a lend and a reclaim of one chunk, ms (every figure found)", "<=", 1.5),
    ("steps_outside_grid_fraction", "k", "the replay's decode steps outside the paged profile's grid", "<", 0.05),
)


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


def _get(data, *keys):
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _per(value, count):
    return None if value is None or not count else round(value / count, 3)


def lend_figures(vmm: dict, profile: dict | None) -> dict | None:
    """Claim (j): bench_vmm's lend/reclaim of one chunk alone (and in a 96-chunk pool), of
    4 chunks under decode kernels, per chunk and per page; the paged profile's memory
    section (one chunk under decode-like load). ms."""
    pages = vmm.get("pages_per_chunk")
    figures = {}
    if vmm.get("lend_us_median") is not None:
        under = vmm.get("under_load_chunks_per_call") or 4
        ms = {"lend_alone": vmm.get("lend_us_median"), "reclaim_alone": vmm.get("reclaim_us_median"),
              "lend_alone_large_pool": vmm.get("lend_us_median_large_pool"),
              "reclaim_alone_large_pool": vmm.get("reclaim_us_median_large_pool"),
              "lend_under_load": _per(vmm.get("under_load_lend_done_us_median"), under),
              "reclaim_under_load": _per(vmm.get("under_load_reclaim_us_median"), under)}
        figures["bench_vmm"] = {
            "backend": vmm.get("backend"), "page_bytes": vmm.get("page_bytes"), "pages_per_chunk": pages,
            "ms_per_chunk": {k: _per(v, 1000) for k, v in ms.items()},
            "us_per_page": {k: _per(v, pages) for k, v in ms.items()},
            "driver_calls_per_lend": vmm.get("driver_calls_per_lend"),
            "driver_calls_per_reclaim": vmm.get("driver_calls_per_reclaim"),
            "driver_calls_per_lend_again": vmm.get("driver_calls_per_lend_again"),
            "large_pool_chunks": vmm.get("large_pool_chunks"),
            "under_load_chunks_per_call": vmm.get("under_load_chunks_per_call"),
            "under_load_busy_fraction": vmm.get("under_load_busy_fraction"),
            "under_load_fault": vmm.get("under_load_fault"), "under_load_checksum_ok": vmm.get("under_load_checksum_ok"),
            "fuzz_violations": vmm.get("fuzz_violations"), "create_calls_after_init": vmm.get("create_calls_after_init")}
    memory = (profile or {}).get("memory")
    if memory:
        pages = memory.get("pages_per_chunk")
        figures["profile_memory_section"] = {
            "chunk_bytes": memory.get("chunk_bytes"), "pages_per_chunk": pages,
            "lend_ms_per_chunk": memory.get("lend_ms_per_chunk"), "reclaim_ms_per_chunk": memory.get("reclaim_ms_per_chunk"),
            "lend_us_per_page": _per(1000 * memory["lend_ms_per_chunk"], pages) if "lend_ms_per_chunk" in memory else None,
            "reclaim_us_per_page": _per(1000 * memory["reclaim_ms_per_chunk"], pages)
            if "reclaim_ms_per_chunk" in memory else None}
    return figures or None


def paged_figures(profile: dict | None, predictor: dict, replay: dict, fleet: dict) -> dict | None:
    """Claim (k): the paged profile's grid and fit, its held-out MAPE, the replays."""
    figures = {}
    if profile:
        figures["profile"] = {**profile_figures(profile), "grid": profile.get("grid"),
                              "profiled_range": profile.get("profiled_range"),
                              "command_line": _get(profile, "provenance", "command_line")}
    if predictor:
        figures["held_out"] = {k: predictor.get(k) for k in ("stage1_mape", "stage2_mape", "held_out_points", "folds",
                                                              "predict_ns_median", "decision_ns_median")}
    if replay:
        runs = replay.get("runs") or [{}]
        harvest = _get(runs[0], "policies", "harvest") or {}
        figures["replay"] = {
            **{k: replay.get(k) for k in ("steps_outside_profile_fraction", "steps_outside_profile_policy",
                                          "steps_outside_profile_warning", "headline")},
            "harvest_tpot_p99_ms": _get(harvest, "metrics", "tpot_p99_ms"),
            "harvest_steps_outside_profile_fraction": _get(harvest, "metrics", "steps_outside_profile_fraction"),
            "harvest_memory": {k: v for k, v in (harvest.get("memory") or {}).items() if k != "series"} or None}
    if fleet:
        auto = _get(fleet, "fleet", "auto") or {}
        figures["fleet"] = {"steps_outside_profile_fraction": fleet.get("steps_outside_profile_fraction"),
                            "servers_auto": auto.get("num_servers"), "target_tpot_ms": auto.get("target_tpot_ms"),
                            "max_queue_delay_s": auto.get("max_queue_delay_s"), "probes": auto.get("probes")}
    return figures or None


def goals(result: dict, summary: dict, on_gpu: bool, rehearsal: str) -> dict:
    """Issue 39's goals against the figures of claims (i), (j), (k), and issue 35's
    compiled trainer against plain PEFT (claim h)."""
    colocate = summary.get("colocate_compiled") or {}
    modes = colocate.get("modes") or {}
    j = (result["j"].get("figures") or {})
    # The driver's work: bench_vmm's lend/reclaim alone (12- and 96-chunk pools) and the
    # profile's under decode-like load (its fence stream idle). bench_vmm's under-load
    # figures also wait for the decode work queued before the lend: reported, not judged.
    chunk_ms = [v for k, v in (_get(j, "bench_vmm", "ms_per_chunk") or {}).items()
                if v is not None and "_alone" in k]
    chunk_ms += [v for k, v in (j.get("profile_memory_section") or {}).items() if k.endswith("ms_per_chunk") and v is not None]
    values = {
        "compiled_vs_peft": ((summary.get("bench_trainer") or {}).get("compiled_vs_peft"),
                             "bench-trainer.json: compiled_vs_peft"),
        "trainer_alone_tokens_per_s": (_get(modes, "trainer-alone", "trainer_tokens_per_s"),
                                       "colocate-compiled.json: modes.trainer-alone.trainer_tokens_per_s"),
        "harvest_vs_static_trainer": (colocate.get("harvest_trainer_vs_static"),
                                      "colocate-compiled.json: harvest_trainer_vs_static"),
        "harvest_violation_rate_40ms": (_get(modes, "harvest", "violation_rate_at", "target", "violation_rate"),
                                        "colocate-compiled.json: modes.harvest.violation_rate_at.target"),
        "lend_reclaim_ms_per_chunk": (max(chunk_ms) if chunk_ms else None,
                                      "lend-costs.json (alone, both pools) and the paged profile's memory section (under decode-like load)"),
        "steps_outside_grid_fraction": ((summary.get("replay") or {}).get("steps_outside_profile_fraction"),
                                        "replay.json: steps_outside_profile_fraction"),
    }
    found = {}
    for name, claim, what, op, target in GOALS:
        value, source = values[name]
        entry = {"claim": claim, "goal": f"{what} {op} {target}", "value": value, "from": source, "met": None}
        if value is None:
            entry["not_measured"] = result[claim].get("not_measured") or "no figure"
        elif not on_gpu:
            entry["not_measured"] = rehearsal
        else:
            entry["met"] = {">=": value >= target, "<=": value <= target, "<": value < target}[op]
        found[name] = entry
    return found


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
    trainer = summary.get("bench_trainer") or {}
    trainer_figures = None
    if "tokens_per_s_eager" in trainer:
        trainer_figures = {k: trainer.get(k) for k in (
            "model", "device_name", "num_layers", "samples_per_step", "seq_len", "dtype", "tokens_per_s_eager",
            "tokens_per_s_compiled", "tokens_per_s_w2", "tokens_per_s_peft", "compiled_vs_peft", "peft_skipped",
            "host_us_per_layer_unit_eager", "host_us_per_layer_unit_compiled", "ops_per_layer_eager",
            "ops_per_layer_compiled", "unit_ms_median_w_all", "unit_ms_median_compiled", "unit_ms_median_w2",
            "copy_compute_overlap_w2", "compile_s", "compiles_in_timed_steps", "compiled_grad_max_rel_diff", "compile",
            # The compiled layers' two runtimes (torch.compile's "module", the explicit "pair"), side by side.
            "compiled_runtime", "tokens_per_s_compiled_pair", "tokens_per_s_compiled_module", "compiled_pair_vs_module",
            "host_us_per_layer_unit_compiled_pair", "host_us_per_layer_unit_compiled_module",
            "ops_per_layer_compiled_pair", "ops_per_layer_compiled_module", "compiled_pair_grad_max_abs_diff",
            "compile_other")}
        trainer_figures["micro_batch_size"] = {k: v.get("micro_batch_size") for k, v in (trainer.get("details") or {}).items()}
        if trainer.get("tokens_per_s_eager") and trainer.get("tokens_per_s_compiled"):
            trainer_figures["compiled_over_eager"] = round(trainer["tokens_per_s_compiled"] / trainer["tokens_per_s_eager"], 3)
    compiled = summary.get("colocate_compiled") or {}
    compiled_modes = compiled.get("modes") or {}
    compiled_figures = None
    if compiled_modes:
        compiled_figures = {
            "qos": {mode: {k: r.get(k) for k in ("tpot_ms_p50", "tpot_ms_p99", "violation_rate_at", "trainer_step_fraction",
                                                 "prediction_error", "steps_by_level", "graph_steps", "eager_steps")}
                    for mode, r in compiled_modes.items() if "tpot_ms_p50" in r},
            "trainer_tokens_per_s": {mode: r.get("trainer_tokens_per_s") for mode, r in compiled_modes.items()
                                     if r.get("trainer_tokens_per_s") is not None},
            "trainer_compile": {mode: r.get("trainer_compile") for mode, r in compiled_modes.items() if r.get("trainer_compile")},
            **{k: v for k, v in compiled.items() if "_trainer_vs_" in k},
            "targets_ms": compiled.get("targets_ms"), "profile": compiled.get("profile"), "trainer": compiled.get("trainer")}
        if not compiled_figures["trainer_tokens_per_s"] and not compiled_figures["qos"]:
            compiled_figures = None
    paged = summary.get("profile_paged_raw")
    result["h"] = entry("h", ["bench-trainer"], ["bench-trainer.json"], trainer_figures)
    result["i"] = entry("i", ["colocate-compiled"], ["colocate-compiled.json", "colocate-compiled-steps.json"],
                        compiled_figures)
    result["j"] = entry("j", ["lend-costs", "profile-paged"], ["lend-costs.json", run.get("paged_profile", "paged profile")],
                        lend_figures(summary.get("lend_costs") or {}, paged))
    result["k"] = entry("k", ["profile-paged", "predictor-paged", "replay", "replay-fleet"],
                        [run.get("paged_profile", "paged profile"), "predictor-paged.json", "replay.json", "replay-fleet.json"],
                        paged_figures(paged, summary.get("predictor_paged") or {}, summary.get("replay") or {},
                                      summary.get("replay_fleet") or {}))
    result["l"] = {"claim": CLAIMS["l"], "steps": [], "files": [], "not_measured": NO_BURST_STEP}
    memory = _get(result["k"], "figures", "replay", "harvest_memory")
    if memory:  # what the replay simulates with the profile's lend/reclaim costs: a model, not a measurement
        result["l"]["simulated_by_replay"] = {k: memory.get(k) for k in (
            "urgent_reclaims", "urgent_reclaim_chunks", "reclaim_delay_ms_p99", "reclaim_delay_ms_max", "chunks_lent_mean")}
    if (summary.get("lend_costs") or {}).get("backend") == "host" and "figures" in result["j"]:
        result["j"]["not_measured"] = "lend-costs ran the host backend: " + (rehearsal or "no CUDA device")
    result["goals"] = goals(result, summary, on_gpu, rehearsal)
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
               "tp_fault": load(out, "tp-fault.json"), "bench_trainer": load(out, "bench-trainer.json"),
               "colocate_compiled": load(out, "colocate-compiled.json"), "lend_costs": load(out, "lend-costs.json"),
               "predictor_paged": load(out, "predictor-paged.json"), "replay": load(out, "replay.json"),
               "replay_fleet": load(out, "replay-fleet.json")}
    for name, xml in (("greenctx_tests", "greenctx.xml"), ("gpu_tests", "gpu-tests.xml")):
        summary[name] = junit(out / xml)
    summary["gpu_validation"] = (validation_lines(out / "greenctx.stdout.txt")
                                 + validation_lines(out / "gpu-tests.stdout.txt"))
    profile = load(out, run.get("profile", "cuda-llama3-8b-transformers.json"))
    summary["profile"] = profile_figures(profile) if profile else None
    summary["profile_paged_raw"] = load(out, run.get("paged_profile", "cuda-llama3-8b-transformers-paged.json"))
    claims_ = claims(out, run, steps, summary)
    del summary["profile_paged_raw"]  # its figures are claim (k)'s; the file is beside the summary
    summary["goals"] = claims_.pop("goals")
    summary["claims"] = claims_
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(out / "summary.json")
    for row in rows:
        print(f"{row['step']:16} {row['status']:34} {row['seconds']:>5}s of {row.get('timeout_s') or '-':>4}s")
    for claim, data in summary["claims"].items():
        state = data.get("not_measured") or "measured"
        print(f"({claim}) {state}")
    for goal in summary["goals"].values():
        if goal["value"] is not None:
            met = {True: "met", False: "NOT met", None: "not judged: " + goal.get("not_measured", "")}[goal["met"]]
            print(f"goal {goal['goal']}: {goal['value']} ({met})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
