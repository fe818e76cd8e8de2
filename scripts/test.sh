#!/usr/bin/env bash
# Set up (or reuse) .venv, apply the limiter patch to its vLLM, install Chromium when missing,
# run the whole test suite (end-to-end tests included). Exit code 5 from pytest (no tests
# collected) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ratebench patch apply
# tests/test_outputs_html.py opens report.html in headless Chromium: install Debian's package when
# it is missing and apt-get exists (as root, or with passwordless sudo). Without it that test fails.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    as_root=""
    if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then as_root="sudo -n"; fi
    echo "[test] installing chromium for the report.html browser test"
    { $as_root apt-get update -qq && $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
        >/dev/null 2>&1 || echo "[test] could not install chromium: tests/test_outputs_html.py will fail" >&2
fi
# tests/test_balancer.py and tests/test_fleet_e2e.py run engines behind HAProxy (Debian's package)
./scripts/install_haproxy.sh || true
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: treating as a failure" >&2
    exit 1
fi
exit "$rc"
