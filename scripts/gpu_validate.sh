#!/usr/bin/env bash
# GPU validation of harvest (issues 9, 18 and 39; docs/gpu-validation.md): the steps of
# scripts/gpu_validate_plan.tsv for one part, each with its timeout, in the plan's order.
# Every result goes into OUT_DIR the moment it exists: a step's files as it writes them,
# steps.tsv and summary.json after every step, the archive (--archive) after every step;
# a failed or timed-out step is recorded (exit code + log) and the next step still runs.
#
#   scripts/gpu_validate.sh OUT_DIR [--part 1|2|3|4|5|all] [--device auto|cuda|cpu] [--budget-s N] [--archive FILE]
#
#   --part 1       build, doctor, green contexts, per-level CUDA graphs, VMM bench, GPU tests
#   --part 2       build, doctor, harvest profile, bench_predictor, co-location
#   --part 3       doctor, tensor-parallel trainer on 2 GPUs (parity with tp = 1, a fault
#                  on one rank); on a machine with fewer GPUs its steps say so and skip
#   --part 4       round two (issue 39): build, doctor, bench_trainer on the 8B shape,
#                  co-location with the compiled trainer, lend/reclaim costs
#   --part 5       round two: build, doctor, paged profile over the Azure sample's grid,
#                  its held-out MAPE, harvest replay with it (one instance, --servers auto)
#                  (each part fits one device call: see the plan's limits)
#   --part all     all of them, one after the other
#   --device       auto (default): cuda when torch sees one, else cpu: the CPU rehearsal
#                  (tiny model, host VMM backend; GPU tests skip themselves, the JSON of
#                  each step says what it could not measure)
#   --budget-s N   start no step that would not end within N seconds of the start
#                  (default: the plan's part_budget_s per part); skipped steps are recorded
#   --archive FILE after every step, write OUT_DIR as a .tar.gz to FILE
#   HARVEST_GV_COLOCATE_PROFILE=FILE  part 4's co-location uses this profile instead of
#                  the committed one of the card (e.g. one co-run beside 8 x 512 units)
#
# Needs: python3 with torch, transformers, peft, scikit-learn, numpy, matplotlib, pytest;
# cmake and a C++ compiler; the CUDA headers. Not sglang, not LlamaFactory, no network.
# Re-runnable: steps overwrite their own files; the native build is incremental.
set -u -o pipefail

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

[[ $# -ge 1 && $1 != -* ]] || usage
OUT_DIR=$1
shift
PART=all
DEVICE=auto
BUDGET_S=
ARCHIVE=
while [[ $# -gt 0 ]]; do
  case $1 in
    --part) PART=${2:-}; shift 2 ;;
    --device) DEVICE=${2:-}; shift 2 ;;
    --budget-s) BUDGET_S=${2:-}; shift 2 ;;
    --archive) ARCHIVE=${2:-}; shift 2 ;;
    *) usage ;;
  esac
done
case $DEVICE in auto | cuda | cpu) ;; *) echo "gpu_validate: --device $DEVICE: one of auto, cuda, cpu" >&2; exit 2 ;; esac

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLAN=$ROOT/scripts/gpu_validate_plan.tsv
PARTS=$(awk -F'\t' '$1 ~ /^[0-9]+$/ { print $1 }' "$PLAN" | sort -un | tr '\n' ' ')
case " $PARTS all " in *" $PART "*) ;; *) echo "gpu_validate: --part $PART: one of ${PARTS}all" >&2; exit 2 ;; esac
limit() { sed -n "s/^# limits:.* $1=\([0-9][0-9]*\).*/\1/p" "$PLAN"; }
PART_BUDGET_S=$(limit part_budget_s)
KILL_AFTER_S=$(limit kill_after_s)
SUMMARY_RESERVE_S=$(limit summary_reserve_s) # kept back for the summary and the archive
NUM_PARTS=$(wc -w <<<"$PARTS")
[[ -n $BUDGET_S ]] || { [[ $PART == all ]] && BUDGET_S=$((NUM_PARTS * PART_BUDGET_S)) || BUDGET_S=$PART_BUDGET_S; }
[[ $BUDGET_S =~ ^[0-9]+$ ]] || { echo "gpu_validate: --budget-s $BUDGET_S: a whole number of seconds" >&2; exit 2; }

PYTHON=${PYTHON:-python3}
[[ -z $ARCHIVE || $ARCHIVE == /* ]] || ARCHIVE=$PWD/$ARCHIVE
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 DISABLE_VERSION_CHECK=1 TOKENIZERS_PARALLELISM=false
# Before anything starts CUDA: harvest's streams (two per green-context level, plus the
# trainer's copy stream and the engine's own) need more hardware queues than the driver's
# default 8, or kernels in disjoint green contexts can serialise; 32 is the maximum. An
# operator's value wins.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
STARTED=$(date +%s)
STEPS_TSV=$OUT_DIR/steps.tsv
printf 'step\tstatus\trc\tseconds\ttimeout_s\tpart\tdevice\tclaims\tstdout\tstderr\n' >"$STEPS_TSV"

DEVICE_REASON="asked for with --device $DEVICE"
if [[ $DEVICE == auto ]]; then
  if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    DEVICE=cuda DEVICE_REASON="torch.cuda.is_available()"
  else
    DEVICE=cpu DEVICE_REASON="no CUDA device for torch here"
  fi
fi

archive() {
  [[ -n $ARCHIVE ]] || return 0
  tar -czf "$ARCHIVE.tmp" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")" && mv -f "$ARCHIVE.tmp" "$ARCHIVE"
}

summarize() {
  "$PYTHON" scripts/gpu_validate_summary.py "$OUT_DIR" >"$OUT_DIR/summary.stdout.txt" 2>&1
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

LEVELS=5 # 24/56/80/104 decode SMs + whole GPU on a 132-SM H100/H200; 80 is the 60/40 StaticMode level
# The Azure sample (the first 300 requests of the conversation trace, in the checkout): the
# paged profile's grid comes from it and the replays serve it.
TRACE=harvest/data/azure_llm_2023_conv_sample.csv
if [[ $DEVICE == cuda ]]; then
  MODEL_DIR=$OUT_DIR/model/llama3-8b
  write_model_config "$MODEL_DIR"
  MODEL_ARGS=(--model-path "$MODEL_DIR" --random-weights)
  PROFILE=$OUT_DIR/cuda-llama3-8b-transformers.json
  PAGED_PROFILE=$OUT_DIR/cuda-llama3-8b-transformers-paged.json
  # Part 4's co-location measures no profile of its own (no time for one): the committed
  # profile of this card, the H200's co-run beside 8 x 512 PEFT units as colocate-compiled
  # trains (2026-11-27), the H100's beside 2 x 512 (round one's); another card gets the
  # H100's with the mismatch allowed and recorded.
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  case $GPU_NAME in
    *H200*) COLOCATE_PROFILE=(--profile profiles/h200-llama3-8b-transformers-mb8.json) ;;
    *H100*) COLOCATE_PROFILE=(--profile profiles/h100-llama3-8b-transformers.json) ;;
    *) COLOCATE_PROFILE=(--profile profiles/h100-llama3-8b-transformers.json --allow-profile-mismatch) ;;
  esac
  # A profile measured on this machine (e.g. its co-run stage beside the units the trainer
  # will run) replaces the committed one when given.
  [[ -z ${HARVEST_GV_COLOCATE_PROFILE:-} ]] || COLOCATE_PROFILE=(--profile "$HARVEST_GV_COLOCATE_PROFILE")
else # the CPU rehearsal: harvest's tiny Llama (built once into harvest's cache)
  MODEL_DIR=$("$PYTHON" -c 'from harvest.tiny_model import TINY_LLAMA, ensure_tiny_model; print(ensure_tiny_model(TINY_LLAMA))' 2>/dev/null | tail -n 1)
  MODEL_ARGS=(--model-path "${MODEL_DIR:-tiny-llama-unavailable}")
  PROFILE=$OUT_DIR/cpu-tiny-llama-transformers.json
  PAGED_PROFILE=$OUT_DIR/cpu-tiny-llama-transformers-paged.json
  # the committed CPU profile of the tiny model (SGLang's engine, another CPU: mismatch allowed)
  COLOCATE_PROFILE=(--profile profiles/cpu-tiny-llama-sglang.json --allow-profile-mismatch)
fi

# The command of step $1 on $DEVICE, into CMD. Every step of the plan has an arm here
# (tests/test_gpu_validate_plan.py checks both ways).
command_for() {
  local cuda=0
  [[ $DEVICE == cuda ]] && cuda=1
  case $1 in
    build) CMD=(bash -c build_native) ;;
    doctor) CMD=("$PYTHON" -m harvest.cli doctor --json) ;;
    greenctx) CMD=("$PYTHON" -m pytest -m gpu -s -rA -p no:cacheprovider --junitxml="$OUT_DIR/greenctx.xml"
      tests/compute/test_greenctx_gpu.py) ;;
    level-graphs)
      local sizes=(--graph-batch-sizes "8,32" --graph-context 512 --graph-repeats 20)
      ((cuda)) || sizes=(--graph-batch-sizes "2,4" --graph-context 32 --graph-repeats 5 --torch-threads 1)
      CMD=("$PYTHON" scripts/colocate_gpu.py "${MODEL_ARGS[@]}" --device "$DEVICE" --levels "$LEVELS"
        --modes level-graphs "${sizes[@]}" --out-dir "$OUT_DIR" --name level-graphs) ;;
    bench-vmm)
      local backend=cuda
      ((cuda)) || backend=host
      CMD=("$PYTHON" scripts/bench_vmm.py --backend "$backend" --num-layers 32 --fuzz-ops 20000 --json
        --out "$OUT_DIR/bench-vmm.json") ;;
    gpu-tests) CMD=("$PYTHON" -m pytest -m gpu -s -rA -p no:cacheprovider --continue-on-collection-errors
      --junitxml="$OUT_DIR/gpu-tests.xml" tests/memory tests/test_native.py tests/train tests/test_gpu_scripts.py
      tests/engines) ;;
    profile)
      rm -f "$PROFILE" # never co-locate with a stale profile (an interrupted run resumes from its .partial.jsonl)
      local grid=(--dtype bfloat16 --batch-sizes "4,16,32" --context-lengths "64,256,512" --warmup 2 --repeats 8
        --lora-rank 16 --trainer-micro-batch 2 --trainer-seq-len 512 --trainer-alone-s 2)
      ((cuda)) || grid=(--dtype float32 --batch-sizes "1,2,4" --context-lengths "32,64" --warmup 1 --repeats 3
        --lora-rank 4 --trainer-micro-batch 1 --trainer-seq-len 32 --trainer-alone-s 1 --torch-threads 1)
      CMD=("$PYTHON" -m harvest.cli profile "${MODEL_ARGS[@]}" --engine transformers --device "$DEVICE"
        --levels "$LEVELS" "${grid[@]}" --out "$PROFILE") ;;
    bench-predictor) CMD=("$PYTHON" scripts/bench_predictor.py --profile "$PROFILE" --json) ;;
    colocate)
      # Without a profile the harvest modes cannot run; the baselines still can.
      local modes=(--modes "decode-alone,harvest,static,trainer-alone,harvest-tight" --profile "$PROFILE")
      [[ -f $PROFILE ]] || modes=(--modes "decode-alone,static,trainer-alone")
      # Graphs on (claim e): the serving modes decode through the slot batch, each step the
      # captured graph of the chosen level and the batch's bucket (5 levels x 4 buckets
      # captured first; trainer-alone gives those seconds back). On CPU: the same path, eager.
      local run=(--trace-seconds 20 --max-context 512 --max-generated 128 --trainer-alone-s 10 --lora-rank 16
        --trainer-seq-len 512 --trainer-batch 4 --trainer-micro-batch 2)
      ((cuda)) || run=(--trace-seconds 10 --time-scale 0.2 --max-generated 24 --trainer-alone-s 1.5 --lora-rank 4
        --trainer-seq-len 32 --trainer-batch 2 --trainer-micro-batch 1 --torch-threads 1)
      CMD=("$PYTHON" scripts/colocate_gpu.py "${MODEL_ARGS[@]}" --device "$DEVICE" "${modes[@]}" --levels "$LEVELS"
        --graphs on --max-batch-size 48 --graph-buckets "8,16,32"
        --target-tpot-ms 40 --tight-target-factor 1.25 "${run[@]}" --steps-out "$OUT_DIR/colocate-steps.json"
        --out-dir "$OUT_DIR" --name colocate) ;;
    # Two ranks, one GPU each, NCCL (gloo for the CPU rehearsal); plain PEFT over the tiny
    # Llama (the GPU machine has no LlamaFactory). Fewer than 2 GPUs: a JSON line that
    # says so, exit 0.
    tp-trainer) CMD=("$PYTHON" -m tests.train.tp_parity --tp 2 --device "$DEVICE" --builder peft --json) ;;
    tp-fault) CMD=("$PYTHON" -m tests.train.tp_parity --tp 2 --device "$DEVICE" --builder peft --fault-rank 1 --json) ;;
    # Round two (issue 39). Item 1: the layer-split trainer on the 8B shape, W = all eager,
    # W = all compiled (torch.compile's runtime, then the explicit pairs: round three) and
    # W = 2, 8 x 512 tokens a step (the units the co-location below
    # trains), after plain PEFT on the device (compiled_vs_peft, since 2026-11-27). The
    # rehearsal: the small synthetic shape, 2 layers, one timed step.
    bench-trainer)
      local size=(--model llama3-8b --batch 8 --seq-len 512 --rounds 4 --warmup 1)
      # The rehearsal in bf16 as on the GPU, with the fp32 reference (one eager step more) the GPU
      # step leaves out for its time (round three runs it on four layers, docs/gpu-validation.md).
      ((cuda)) || size=(--model small-synthetic --layers 2 --batch 1 --seq-len 32 --rounds 1 --warmup 0 --threads 1
        --dtype bfloat16 --fp32-reference)
      CMD=("$PYTHON" scripts/bench_trainer.py --device "$DEVICE" "${size[@]}" --json) ;;
    # Claim (f) with the compiled trainer: the H200 run of 2026-11-26 ("Co-location with the
    # compiled trainer") as the plan's step. The rehearsal leaves the trainer eager (a cold
    # compile of its layers takes 30-50 s on two loaded cores; tests/train cover it on CPU).
    colocate-compiled)
      local run=(--trace-seconds 20 --max-context 512 --max-generated 128 --trainer-alone-s 10 --lora-rank 16
        --trainer-seq-len 512 --trainer-batch 8 --trainer-micro-batch 8 --trainer-compile on)
      ((cuda)) || run=(--trace-seconds 6 --time-scale 0.2 --max-generated 24 --trainer-alone-s 1.5 --lora-rank 4
        --trainer-seq-len 32 --trainer-batch 2 --trainer-micro-batch 1 --trainer-compile off --torch-threads 1)
      CMD=("$PYTHON" scripts/colocate_gpu.py "${MODEL_ARGS[@]}" --device "$DEVICE" "${COLOCATE_PROFILE[@]}"
        --modes "decode-alone,harvest,static,trainer-alone,harvest-tight" --levels "$LEVELS" --graphs on
        --max-batch-size 48 --graph-buckets "8,16,32" --target-tpot-ms 40 --tight-target-factor 1.25 "${run[@]}"
        --steps-out "$OUT_DIR/colocate-compiled-steps.json" --out-dir "$OUT_DIR" --name colocate-compiled) ;;
    # Item 2: bench-vmm's command (its JSON now has driver_calls_per_lend/_reclaim and, on
    # CUDA, a 96-chunk pool); the rehearsal fuzzes less.
    lend-costs)
      local backend=(--backend cuda --fuzz-ops 20000)
      ((cuda)) || backend=(--backend host --fuzz-ops 2000)
      CMD=("$PYTHON" scripts/bench_vmm.py "${backend[@]}" --num-layers 32 --json --out "$OUT_DIR/lend-costs.json") ;;
    # Item 3: the paged engine over the grid the Azure sample's decode steps call for (12
    # points, up to 112 requests x 1072 tokens); its co-run beside 4 x 512-token PEFT units.
    # The rehearsal keeps the trace's simulation but measures a tiny grid (the trace's grid
    # on the tiny model took 14 min on this 2-core machine).
    profile-paged)
      rm -f "$PAGED_PROFILE" # an interrupted run resumes from its .partial.jsonl
      local grid=(--dtype bfloat16 --grid-from-trace "$TRACE" --warmup 2 --repeats 6 --lora-rank 16
        --trainer-micro-batch 4 --trainer-seq-len 512 --trainer-alone-s 1)
      ((cuda)) || grid=(--dtype float32 --grid-from-trace "$TRACE" --batch-sizes "1,2,4" --context-lengths "32,64"
        --warmup 1 --repeats 3 --lora-rank 4 --trainer-micro-batch 1 --trainer-seq-len 32 --trainer-alone-s 1
        --torch-threads 1)
      CMD=("$PYTHON" -m harvest.cli profile "${MODEL_ARGS[@]}" --engine transformers --kv paged --device "$DEVICE"
        --levels "$LEVELS" "${grid[@]}" --out "$PAGED_PROFILE") ;;
    predictor-paged) CMD=("$PYTHON" scripts/bench_predictor.py --profile "$PAGED_PROFILE" --json) ;;
    # One decode instance with the paged profile (the instance the grid was chosen for:
    # at most 256 requests, 160000 KV tokens), then the smallest fleet that holds 40 ms. A
    # tiny CPU model's steps are far slower than 40 ms: the rehearsal's fleet gets a
    # target it can hold.
    replay) CMD=("$PYTHON" -m harvest.cli replay --trace "$TRACE" --profile "$PAGED_PROFILE" --json --no-plots) ;;
    replay-fleet)
      local target=()
      ((cuda)) || target=(--target-tpot-ms 100000 --max-queue-delay-s 100000)
      CMD=("$PYTHON" -m harvest.cli replay --trace "$TRACE" --profile "$PAGED_PROFILE" --servers auto "${target[@]}"
        --json --no-plots) ;;
    *) return 1 ;;
  esac
}

# step PART NAME TIMEOUT_S MIN_S CLAIMS: run the step's command with stdout/stderr in
# OUT_DIR/NAME.*; its last stdout line, when a JSON object, becomes OUT_DIR/NAME.json (a
# step that writes NAME.json itself keeps its own file when it printed none).
step() {
  local part=$1 name=$2 timeout_s=$3 min_s=$4 claims=$5
  local left=$((BUDGET_S - SUMMARY_RESERVE_S - KILL_AFTER_S - ($(date +%s) - STARTED)))
  ((timeout_s > left)) && timeout_s=$left
  local stdout=$OUT_DIR/$name.stdout.txt stderr=$OUT_DIR/$name.stderr.txt status rc began
  rm -f "$OUT_DIR/$name.json"
  if ((timeout_s < min_s)); then
    printf '%s\tskipped (budget: %ss left)\t\t0\t%s\t%s\t%s\t%s\t\t\n' "$name" "$left" "$3" "$part" "$DEVICE" "$claims" >>"$STEPS_TSV"
    echo "== $name: skipped, ${left}s of the budget left (needs ${min_s}s)"
    return
  fi
  if ! command_for "$name"; then
    printf '%s\tfailed (no command for this step)\t2\t0\t%s\t%s\t%s\t%s\t\t\n' "$name" "$3" "$part" "$DEVICE" "$claims" >>"$STEPS_TSV"
    return
  fi
  echo "== $name (part $part, timeout ${timeout_s}s, $DEVICE): ${CMD[*]}"
  began=$(date +%s)
  timeout --signal=INT --kill-after="$KILL_AFTER_S" "$timeout_s" "${CMD[@]}" </dev/null >"$stdout" 2>"$stderr"
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="timeout (${timeout_s}s)" ;;
    *) status=failed ;;
  esac
  "$PYTHON" - "$stdout" "$OUT_DIR/$name.json" 2>/dev/null <<'PY'
import json, os, sys
text = open(sys.argv[1]).read().strip()
try:
    result = json.loads(text)  # the whole output (harvest doctor --json) ...
except ValueError:
    result = json.loads(text.splitlines()[-1])  # ... or its last line (the benchmarks)
assert isinstance(result, dict)
with open(sys.argv[2] + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
PY
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$(($(date +%s) - began))" "$3" "$part" \
    "$DEVICE" "$claims" "$name.stdout.txt" "$name.stderr.txt" >>"$STEPS_TSV"
  echo "   $status (rc $rc, $(($(date +%s) - began))s)"
  [[ $status == ok ]] || tail -n 5 "$stderr" | sed 's/^/   | /'
  summarize
  archive
}

printf '{"part": "%s", "device": "%s", "device_reason": "%s", "budget_s": %s, "profile": "%s", "paged_profile": "%s", "model": "%s", "started": "%s"}\n' \
  "$PART" "$DEVICE" "$DEVICE_REASON" "$BUDGET_S" "$(basename "$PROFILE")" "$(basename "$PAGED_PROFILE")" \
  "$(basename "${MODEL_DIR:-none}")" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$OUT_DIR/run.json"
echo "gpu_validate: part $PART on $DEVICE ($DEVICE_REASON), budget ${BUDGET_S}s, results in $OUT_DIR"
export -f build_native
export PYTHON BUILD_DIR NATIVE_DIR
nvidia-smi >"$OUT_DIR/nvidia-smi.txt" 2>&1 || true
while IFS=$'\t' read -r -u 3 part name timeout_s min_s expect_s claims needs what; do
  [[ -z $part || $part == \#* ]] && continue
  [[ $PART == all || $PART == "$part" ]] || continue
  step "$part" "$name" "$timeout_s" "$min_s" "$claims"
  [[ $name == build && -d $NATIVE_DIR ]] && export HARVEST_NATIVE_DIR=$NATIVE_DIR
  : "$expect_s" "$needs" "$what" # documentation columns
done 3<"$PLAN"

summarize
cat "$OUT_DIR/summary.stdout.txt"
archive
echo "gpu_validate: done in $(($(date +%s) - STARTED))s; summary: $OUT_DIR/summary.json"
awk -F'\t' 'NR > 1 && $2 != "ok" { bad = 1 } END { exit bad }' "$STEPS_TSV"
