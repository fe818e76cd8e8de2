#!/usr/bin/env bash
# Set up (or reuse) .venv, apply the limiter patch to its vLLM, run the whole test suite
# (end-to-end tests included). Exit code 5 from pytest (no tests collected) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ratebench patch apply
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: treating as a failure" >&2
    exit 1
fi
exit "$rc"
