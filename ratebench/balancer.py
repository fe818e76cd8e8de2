"""The load balancer in front of a fleet of engines: HAProxy, configured, started, checked, stopped.

Why HAProxy (Debian's ``haproxy`` package): in HTTP mode it forwards a response's body as the
bytes arrive, never holding a whole response (nginx buffers a proxied response unless
``proxy_buffering off``); it hashes a request
header onto a consistent ring (``balance hdr(...)`` with ``hash-type consistent``: a user's
requests go to one engine, and when an engine leaves only its users move, to the next engine on
the ring); it health-checks each engine's ``/health`` and takes a dead one out of rotation; it
refuses a request without the user header before any engine sees it; and it names the engine
that served each answer in a response header, which the driver records.

One setting it must be given: ``option http-no-delay``. By default HAProxy sends with
``MSG_MORE`` while it expects more of a message, and the kernel then holds a small segment for up
to 200 ms waiting for more: a token stream reaches the client in clumps (measured here through
HAProxy 2.6: a 30 tok/s user's tokens four at a time every 260 ms, and an 8-token answer the engine
emitted over 22 ms as one read 36 ms after it was sent), and the client's clock lies by as much.
With the option each chunk leaves as it arrives (``tests/test_balancer.py`` holds it to that).

One HAProxy process serves every routing policy of a fleet, each on a frontend of its own
(port), over the same engines:

- ``round-robin``: each request to the next engine, whoever sends it.
- ``user-hash``: consistent hashing on the user header (``X-Ratebench-User`` by default), as a
  gateway that authenticates users would set it. ``hash-balance-factor`` is left unset (it would
  move a busy user's requests off its engine) and ``option redispatch`` is not set (it breaks
  affinity after one failed connection).

Both refuse a request without the user header with HTTP 400: a request that names no user
cannot be kept to a per-user rate by any engine.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ratebench.profiles import FLEET_POLICIES as POLICIES
USER_HEADER = "X-Ratebench-User"
SERVED_BY_HEADER = "X-Ratebench-Engine"  # the engine that served the answer (HAProxy's server name)
HEALTH_INTERVAL_MS = 500


class BalancerError(RuntimeError):
    """The balancer cannot run or did not come up: the message says why and what to do."""


def haproxy_binary() -> str:
    path = shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy")
                                             if os.access(p, os.X_OK)), None)
    if path is None:
        raise BalancerError("HAProxy is not installed, and a fleet scenario runs its engines behind it: install "
                            "Debian's package (`apt-get install haproxy`, as root), or run ./scripts/setup.sh "
                            "--fleet, which does that where apt-get exists")
    return path


def _backend(policy: str) -> str:
    return "be_" + policy.replace("-", "_")


def haproxy_config(servers: dict[str, int], frontends: dict[str, int], *, user_header: str = USER_HEADER) -> str:
    """The configuration: one frontend per policy (``frontends``: policy -> port on 127.0.0.1), each to a
    backend of every engine (``servers``: engine name -> port on 127.0.0.1)."""
    for policy in frontends:
        if policy not in POLICIES:
            raise BalancerError(f"unknown routing policy {policy!r}: one of {list(POLICIES)}")
    lines = [
        "# written by ratebench (ratebench/balancer.py) for one run; started as `haproxy -db -f haproxy.cfg`",
        "global",
        "    maxconn 4096",
        "    log stderr format raw local0 info",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        # each chunk of a token stream sent on as it arrives, not held by the kernel for more (MSG_MORE): without
        # it a stream reaches the client in clumps up to 200 ms late
        "    option http-no-delay",
        "    timeout connect 5s",
        # a throttled answer may stream for minutes: the client and server sides wait as long
        "    timeout client 1h",
        "    timeout server 1h",
        "    timeout http-request 30s",
        "    timeout http-keep-alive 60s",
        # health checks every 500 ms; and a connection an engine refuses marks it down at once (its users
        # move on their next request, not after two missed checks)
        f"    default-server check inter {HEALTH_INTERVAL_MS}ms fall 2 rise 1 observe layer4 error-limit 1 "
        "on-error mark-down",
    ]
    for policy, port in frontends.items():
        lines += [
            f"frontend fe_{policy.replace('-', '_')}",
            f"    bind 127.0.0.1:{port}",
            f"    http-request deny deny_status 400 if !{{ req.hdr({user_header}) -m found }}",
            f"    default_backend {_backend(policy)}",
            f"backend {_backend(policy)}",
        ]
        if policy == "round-robin":
            lines.append("    balance roundrobin")
        else:
            lines += [f"    balance hdr({user_header})", "    hash-type consistent"]
        lines += [
            "    option httpchk GET /health",
            "    http-check expect status 200",
            f"    http-response set-header {SERVED_BY_HEADER} %[srv_name]",
        ]
        lines += [f"    server {name} 127.0.0.1:{port_}" for name, port_ in servers.items()]
    return "\n".join(lines) + "\n"


@dataclass
class RunningBalancer:
    """A started HAProxy; :meth:`stop` is idempotent and leaves no process behind."""

    process: subprocess.Popen
    folder: Path
    endpoints: dict[str, str]  # policy -> http://127.0.0.1:<port>
    servers: dict[str, int]
    user_header: str = USER_HEADER
    _log_file: object = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.folder / "balancer.log"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace_s: float = 5.0) -> list[int]:
        """SIGTERM (HAProxy's hard stop), then SIGKILL after ``grace_s``; returns the pids killed."""
        killed: list[int] = []
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
                killed.append(self.process.pid)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return killed


def start_balancer(servers: dict[str, int], folder: Path, policies: list[str], *, timeout_s: float = 30.0,
                   user_header: str = USER_HEADER) -> RunningBalancer:
    """Write the configuration, have HAProxy check it, start it, and wait until every frontend routes
    (a request with the user header answered by an engine, one without it refused with 400)."""
    from ratebench.engine import free_port

    binary = haproxy_binary()
    folder = folder.resolve()  # HAProxy runs in it: a relative run folder (results/...) would be read twice over
    folder.mkdir(parents=True, exist_ok=True)
    frontends = {policy: free_port() for policy in policies}
    cfg = folder / "haproxy.cfg"
    cfg.write_text(haproxy_config(servers, frontends, user_header=user_header))
    check = subprocess.run([binary, "-c", "-q", "-f", str(cfg)], capture_output=True, text=True)
    if check.returncode != 0:
        raise BalancerError(f"HAProxy refused its configuration {cfg}: {(check.stderr or check.stdout).strip()}")
    log_file = open(folder / "balancer.log", "ab")
    try:
        process = subprocess.Popen([binary, "-db", "-f", str(cfg)], stdin=subprocess.DEVNULL, stdout=log_file,
                                   stderr=subprocess.STDOUT, process_group=0, cwd=folder)
    except OSError:
        log_file.close()
        raise
    balancer = RunningBalancer(process, folder, {p: f"http://127.0.0.1:{port}" for p, port in frontends.items()},
                               dict(servers), user_header, log_file)
    atexit.register(balancer.stop)  # never outlives ratebench, whatever ends it (stop() is idempotent)
    try:
        _wait_routing(balancer, timeout_s)
    except BaseException:
        balancer.stop()
        raise
    return balancer


def _wait_routing(balancer: RunningBalancer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = dict(balancer.endpoints)
    last = ""
    with httpx.Client(timeout=5.0) as client:
        while pending:
            if not balancer.alive():
                tail = balancer.log_path.read_text(errors="replace")[-2000:] if balancer.log_path.is_file() else ""
                raise BalancerError(f"HAProxy exited (code {balancer.process.returncode}) while starting; its log "
                                    f"{balancer.log_path}:\n{tail}")
            for policy, url in list(pending.items()):
                try:
                    named = client.get(f"{url}/v1/models", headers={balancer.user_header: "ratebench-check"})
                    anonymous = client.get(f"{url}/v1/models")
                except httpx.HTTPError as exc:
                    last = f"{policy}: {exc}"
                    continue
                if named.status_code == 200 and anonymous.status_code == 400:
                    del pending[policy]
                else:
                    last = (f"{policy}: with the user header HTTP {named.status_code}, without it HTTP "
                            f"{anonymous.status_code} (want 200 and 400)")
            if pending:
                if time.monotonic() > deadline:
                    raise BalancerError(f"HAProxy did not route within {timeout_s:g} s ({last}); its log: "
                                        f"{balancer.log_path}")
                time.sleep(0.1)
