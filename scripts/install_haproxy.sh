#!/usr/bin/env bash
# Install HAProxy (Debian's package) when it is missing and apt-get exists (as root, or with
# passwordless sudo): a fleet scenario (profile cpu-fleet, tests/test_fleet_e2e.py and
# tests/test_balancer.py) runs its engines behind it. Exit 0 when haproxy is there afterwards.
set -uo pipefail
if command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "[haproxy] not installed and no apt-get here: install HAProxy (2.x) with the system's package manager" >&2
    exit 1
fi
as_root=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then as_root="sudo -n"; fi
echo "[haproxy] installing Debian's haproxy package (the fleet scenario's load balancer)"
if ! { $as_root apt-get install -y -qq haproxy || { $as_root apt-get update -qq && $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy; }; } >/dev/null 2>&1; then
    echo "[haproxy] could not install haproxy: the fleet tests will fail" >&2
    exit 1
fi
# the package may start its own service where an init system runs: ratebench starts its own, on free ports
{ $as_root service haproxy stop || true; } >/dev/null 2>&1
exit 0
