#!/usr/bin/env bash
# GPU validation of harvest (issue 9; docs/gpu-validation.md): build the native libraries,
# run the GPU tests and the CUDA benchmarks, profile a Llama-3-8B-shaped model with random
# weights and run the co-location experiment. Every result (JSON, PNG, logs) goes into
# OUT_DIR; a failed step is recorded (exit code + log) and the next step still runs;
# OUT_DIR/summary.json lists every step and the figures it produced.
#
#   scripts/gpu_validate.sh OUT_DIR [--part core|colocate|all] [--budget-s N] [--archive FILE]
#
#   --part core      build, doctor, GPU tests, bench_vmm (CUDA), bench_trainer (CUDA)
#   --part colocate  build, doctor, harvest profile, bench_predictor, colocate_gpu
#   --part all       both (default); estimated (never run): core 7-8 min, colocate 6
#   --budget-s N     stop starting steps so the whole run ends within N seconds (default
#                    570 for one part: a device-tool call is limited to 600 s; 1200 for
#                    all); a step that would not fit is recorded as skipped
#   --archive FILE   after every step, write OUT_DIR as a .tar.gz to FILE (so a run cut
#                    short still returns what it measured)
#
# Needs: python3 with torch (CUDA), transformers, peft, scikit-learn, numpy, matplotlib,
# pytest; cmake and a C++ compiler; the CUDA headers. Not sglang, not LlamaFactory.
# Re-runnable: steps overwrite their own files; the native build is incremental.
set -u -o pipefail

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

[[ $# -ge 1 && $1 != -* ]] || usage
OUT_DIR=$1
shift
PART=all
BUDGET_S=
ARCHIVE=
while [[ $# -gt 0 ]]; do
  case $1 in
    --part) PART=${2:-}; shift 2 ;;
    --budget-s) BUDGET_S=${2:-}; shift 2 ;;
    --archive) ARCHIVE=${2:-}; shift 2 ;;
    *) usage ;;
  esac
done
case $PART in core | colocate | all) ;; *) echo "gpu_validate: --part $PART: one of core, colocate, all" >&2; exit 2 ;; esac
[[ -n $BUDGET_S ]] || { [[ $PART == all ]] && BUDGET_S=1200 || BUDGET_S=570; }
[[ $BUDGET_S =~ ^[0-9]+$ ]] || { echo "gpu_validate: --budget-s $BUDGET_S: a whole number of seconds" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
[[ -z $ARCHIVE || $ARCHIVE == /* ]] || ARCHIVE=$PWD/$ARCHIVE
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 DISABLE_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
STARTED=$(date +%s)
STEPS_TSV=$OUT_DIR/steps.tsv
printf 'step\tstatus\trc\tseconds\tstdout\tstderr\n' >"$STEPS_TSV"
SUMMARY_RESERVE_S=20 # kept back for the summary and the archive

archive() {
  [[ -n $ARCHIVE ]] || return 0
  tar -czf "$ARCHIVE.tmp" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")" && mv -f "$ARCHIVE.tmp" "$ARCHIVE"
}

# step NAME TIMEOUT_S MIN_S -- COMMAND...: run COMMAND with stdout/stderr in OUT_DIR/NAME.*,
# its last stdout line saved as OUT_DIR/NAME.json when it is a JSON object.
step() {
  local name=$1 timeout_s=$2 min_s=$3
  shift 4
  local left=$((BUDGET_S - SUMMARY_RESERVE_S - ($(date +%s) - STARTED)))
  ((timeout_s > left)) && timeout_s=$left
  local stdout=$OUT_DIR/$name.stdout.txt stderr=$OUT_DIR/$name.stderr.txt status rc
  rm -f "$OUT_DIR/$name.json"
  if ((timeout_s < min_s)); then
    printf '%s\tskipped (budget: %ss left)\t\t0\t\t\n' "$name" "$left" >>"$STEPS_TSV"
    echo "== $name: skipped, ${left}s of the budget left (needs ${min_s}s)"
    return
  fi
  echo "== $name (timeout ${timeout_s}s): $*"
  local began
  began=$(date +%s)
  timeout --signal=INT --kill-after=20 "$timeout_s" "$@" >"$stdout" 2>"$stderr"
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="timeout (${timeout_s}s)" ;;
    *) status=failed ;;
  esac
  "$PYTHON" - "$stdout" >"$OUT_DIR/$name.json" 2>/dev/null <<'PY' || rm -f "$OUT_DIR/$name.json"
import json, sys
text = open(sys.argv[1]).read().strip()
try:
    result = json.loads(text)  # the whole output (harvest doctor --json) ...
except ValueError:
    result = json.loads(text.splitlines()[-1])  # ... or its last line (the benchmarks)
assert isinstance(result, dict)
json.dump(result, sys.stdout, indent=1)
PY
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(($(date +%s) - began))" "$name.stdout.txt" "$name.stderr.txt" >>"$STEPS_TSV"
  echo "   $status (rc $rc, $(($(date +%s) - began))s)"
  [[ $status == ok ]] || tail -n 5 "$stderr" | sed 's/^/   | /'
  archive
}

# A plain CMake build (no pip, no scikit-build-core), installed outside the source tree;
# HARVEST_NATIVE_DIR points harvest/native.py at it. Incremental while BUILD_DIR survives.
BUILD_DIR=${HARVEST_GPU_BUILD_DIR:-${TMPDIR:-/tmp}/harvest-gpu-validate}
NATIVE_DIR=$BUILD_DIR/install/harvest/_native
build_native() {
  cmake -S . -B "$BUILD_DIR/build" -DCMAKE_BUILD_TYPE=Release &&
    cmake --build "$BUILD_DIR/build" -j "$(nproc)" &&
    cmake --install "$BUILD_DIR/build" --prefix "$BUILD_DIR/install" &&
    HARVEST_NATIVE_DIR=$NATIVE_DIR "$PYTHON" -c \
      'from harvest import native; [print(native.library_path(n)) for n in native.LIBRARY_NAMES]'
}

write_model_config() {
  # Llama-3-8B's architecture; the profile and colocate_gpu.py build it with random weights
  # on the GPU (latency does not depend on weight values).
  mkdir -p "$1"
  cat >"$1/config.json" <<'JSON'
{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
  "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "attention_bias": false, "mlp_bias": false, "tie_word_embeddings": false, "initializer_range": 0.02,
  "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"
}
JSON
}

MODEL_DIR=$OUT_DIR/model/llama3-8b
PROFILE=$OUT_DIR/cuda-llama3-8b-transformers.json
LEVELS=5 # 24/56/80/104 decode SMs + whole GPU on a 132-SM H100/H200; 80 is the 60/40 StaticMode level

echo "gpu_validate: part $PART, budget ${BUDGET_S}s, results in $OUT_DIR"
export -f build_native
export PYTHON BUILD_DIR NATIVE_DIR
step build 240 30 -- bash -c build_native
[[ -d $NATIVE_DIR ]] && export HARVEST_NATIVE_DIR=$NATIVE_DIR
step doctor 60 10 -- "$PYTHON" -m harvest.cli doctor --json
nvidia-smi >"$OUT_DIR/nvidia-smi.txt" 2>&1 || true

if [[ $PART == core || $PART == all ]]; then
  step gpu-tests 300 60 -- "$PYTHON" -m pytest -m gpu -s -rA -p no:cacheprovider --continue-on-collection-errors \
    --junitxml="$OUT_DIR/gpu-tests.xml" tests/memory tests/compute tests/train tests/test_native.py tests/test_gpu_scripts.py
  # Lend/reclaim on Llama-3-8B's KV geometry (32 layers: 64 pages of 2 MiB per chunk); the
  # on-device fuzz keeps to the GPU test's 20k operations (100k run on the host backend).
  step bench-vmm 150 30 -- "$PYTHON" scripts/bench_vmm.py --backend cuda --num-layers 32 --fuzz-ops 20000 --json
  step bench-trainer 360 120 -- "$PYTHON" scripts/bench_trainer.py --device cuda --model llama3-8b --rounds 6 --json
fi

if [[ $PART == colocate || $PART == all ]]; then
  write_model_config "$MODEL_DIR"
  rm -f "$PROFILE" # never co-locate with a stale profile (an interrupted profile resumes from its .partial.jsonl)
  step profile 330 120 -- "$PYTHON" -m harvest.cli profile --model-path "$MODEL_DIR" --random-weights \
    --engine transformers --device cuda --dtype bfloat16 --levels "$LEVELS" --batch-sizes 4,16,32 \
    --context-lengths 64,256,512 --warmup 2 --repeats 8 --lora-rank 16 --trainer-micro-batch 2 \
    --trainer-seq-len 512 --out "$PROFILE"
  step bench-predictor 60 10 -- "$PYTHON" scripts/bench_predictor.py --profile "$PROFILE" --json
  # Without a profile the harvest mode cannot run; the baselines still can.
  modes=(--modes "decode-alone,harvest,static,trainer-alone" --profile "$PROFILE")
  [[ -f $PROFILE ]] || modes=(--modes "decode-alone,static,trainer-alone")
  step colocate 330 90 -- "$PYTHON" scripts/colocate_gpu.py --model-path "$MODEL_DIR" --random-weights \
    --device cuda "${modes[@]}" --levels "$LEVELS" --target-tpot-ms 40 --trace-seconds 30 \
    --max-context 512 --max-generated 128 --trainer-alone-s 20 --lora-rank 16 --trainer-seq-len 512 \
    --trainer-batch 4 --trainer-micro-batch 2 --steps-out "$OUT_DIR/colocate-steps.json"
fi

# The summary: every step's status and the figures docs/gpu-validation.md asks for.
"$PYTHON" - "$OUT_DIR" <<'PY' >"$OUT_DIR/summary.stdout.txt" 2>&1
import csv, json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
def load(name):
    path = out / name
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None
steps = list(csv.DictReader((out / "steps.tsv").open(), delimiter="\t"))
summary = {"steps": steps, "doctor": load("doctor.json"), "bench_vmm": load("bench-vmm.json"),
           "bench_trainer": load("bench-trainer.json"), "bench_predictor": load("bench-predictor.json"),
           "colocate": load("colocate.json")}
tests = out / "gpu-tests.xml"
if tests.is_file():
    cases = ET.parse(tests).getroot().iter("testcase")
    outcome = {}
    for case in cases:
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        outcome[f"{case.get('classname')}::{case.get('name')}"] = kind
    summary["gpu_tests"] = {"counts": {k: list(outcome.values()).count(k) for k in set(outcome.values())},
                            "not_passed": {k: v for k, v in outcome.items() if v != "passed"}}
log = out / "gpu-tests.stdout.txt"
if log.is_file():  # the numbers tests/compute/test_greenctx_gpu.py prints (ladder, scaling, isolation, graph)
    summary["gpu_validation"] = [{"name": line.split(" ", 2)[1], "values": json.loads(line.split(" ", 2)[2])}
                                 for line in log.read_text().splitlines() if line.startswith("GPU-VALIDATION ")]
profile = load("cuda-llama3-8b-transformers.json")
if profile:
    levels = profile["ladder"]["levels"]
    biggest = max((s["batch_size"], s["context_length"]) for s in profile["samples"])
    summary["profile"] = {
        "stage1_quality": [lv["quality"] for lv in profile["stage1"]],
        "stage2_quality": profile["stage2"]["combined"]["quality"],
        # Issue 4: a decode step of the model, time vs decode SMs (solo, largest grid point).
        "decode_step_ms_vs_decode_sms": [
            [levels[s["level"]]["decode_sms"], round(s["latency_s"] * 1e3, 3)] for s in profile["samples"]
            if s["stage"] == "solo" and (s["batch_size"], s["context_length"]) == biggest],
        "largest_point": biggest}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
for s in steps:
    print(f"{s['step']:16} {s['status']:28} {s['seconds']:>5}s")
PY
cat "$OUT_DIR/summary.stdout.txt"
archive
echo "gpu_validate: done in $(($(date +%s) - STARTED))s; summary: $OUT_DIR/summary.json"
awk -F'\t' 'NR > 1 && $2 != "ok" { bad = 1 } END { exit bad }' "$STEPS_TSV"
