"""The fleet's load balancer: real HAProxy in front of small HTTP servers standing in for engines
(the engines themselves are in tests/test_fleet_e2e.py)."""

from __future__ import annotations

import http.server
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from ratebench.balancer import SERVED_BY_HEADER, USER_HEADER, BalancerError, haproxy_config, start_balancer
from ratebench.engine import free_port


STREAM_EVENTS, STREAM_EVERY_S = 10, 0.04


class _Engine(http.server.ThreadingHTTPServer):
    """Answers /health and everything else with 200 and its own name, as long as it runs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.port = free_port()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler) -> None:  # noqa: N805
                body = name.encode()
                handler.send_response(200)
                handler.send_header("Content-Length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)

            def do_POST(handler) -> None:  # noqa: N805
                if handler.path != "/stream":
                    return handler.do_GET()
                # a token stream: one small server-sent event every 40 ms, chunked, as vLLM's API server sends
                handler.send_response(200)
                handler.send_header("Content-Type", "text/event-stream")
                handler.send_header("Transfer-Encoding", "chunked")
                handler.end_headers()
                for k in range(STREAM_EVENTS):
                    event = f"data: {{\"token\": {k}}}\n\n".encode()
                    handler.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    handler.wfile.flush()
                    time.sleep(STREAM_EVERY_S)
                handler.wfile.write(b"0\r\n\r\n")
                handler.wfile.flush()

            def log_message(handler, *args) -> None:  # noqa: N805
                pass

        Handler.protocol_version = "HTTP/1.1"
        super().__init__(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch):
    engines = {name: _Engine(name) for name in ("patched-sync.e0", "patched-sync.e1", "patched-sync.e2")}
    monkeypatch.chdir(tmp_path)  # a relative folder, as `ratebench run`'s default results/ gives
    balancer = start_balancer({n: e.port for n, e in engines.items()}, Path("results") / "balancer",
                              ["round-robin", "user-hash"])
    assert (tmp_path / "results" / "balancer" / "haproxy.cfg").is_file()
    try:
        yield balancer, engines
    finally:
        assert balancer.stop() == [], "HAProxy stopped on SIGTERM"
        assert not balancer.alive()
        for e in engines.values():
            e.stop()


def _served(url: str, user: str | None) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={USER_HEADER: user} if user else {}, timeout=5)


def test_each_policy_names_the_engine_that_served_and_refuses_requests_without_a_user(fleet) -> None:
    balancer, engines = fleet
    for policy, url in balancer.endpoints.items():
        r = _served(url, "user-a")
        assert r.status_code == 200 and r.headers[SERVED_BY_HEADER] == r.text and r.text in engines, policy
        refused = _served(url, None)
        assert refused.status_code == 400 and SERVED_BY_HEADER not in refused.headers, policy


def test_round_robin_spreads_one_users_requests_and_user_hash_keeps_each_user_on_one_engine(fleet) -> None:
    balancer, engines = fleet
    rr = Counter(_served(balancer.endpoints["round-robin"], "user-a").text for _ in range(9))
    assert rr == Counter({name: 3 for name in engines})
    users = [f"user-{k}" for k in range(12)]
    home = {u: _served(balancer.endpoints["user-hash"], u).text for u in users}
    for _ in range(3):
        assert {u: _served(balancer.endpoints["user-hash"], u).text for u in users} == home
    assert len(set(home.values())) >= 2, "twelve users on one of three engines: the header was not hashed"


def test_user_hash_moves_only_the_users_of_an_engine_that_stops(fleet) -> None:
    balancer, engines = fleet
    url = balancer.endpoints["user-hash"]
    users = [f"user-{k}" for k in range(24)]
    home = {u: _served(url, u).text for u in users}
    gone = Counter(home.values()).most_common(1)[0][0]
    engines[gone].stop()
    deadline = time.monotonic() + 10
    while True:  # the health checks (every 500 ms, two failures) take the engine out of rotation
        now = {}
        for u in users:
            r = _served(url, u)
            now[u] = r.text if r.status_code == 200 else None
        if all(v is not None and v != gone for v in now.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert all(v is not None and v != gone for v in now.values()), now
    assert {u: v for u, v in now.items() if home[u] != gone} == {u: v for u, v in home.items() if v != gone}


def test_the_configuration_routes_by_the_header_it_is_given() -> None:
    cfg = haproxy_config({"patched-sync.e0": 8001, "patched-sync.e1": 8002}, {"user-hash": 9000},
                         user_header="X-Tenant")
    assert "balance hdr(X-Tenant)" in cfg and "hash-type consistent" in cfg
    assert "deny deny_status 400 if !{ req.hdr(X-Tenant) -m found }" in cfg
    assert "redispatch" not in cfg and "hash-balance-factor" not in cfg
    assert "observe layer4 error-limit 1 on-error mark-down" in cfg  # a refused connection marks it down
    with pytest.raises(BalancerError, match="unknown routing policy 'random'"):
        haproxy_config({"a": 1}, {"random": 2})


def _arrivals(url: str) -> list[tuple[float, int]]:
    """(seconds since sent, events in the read) of each read of a streamed answer."""
    out = []
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}/stream", headers={USER_HEADER: "user-a"}, timeout=5) as r:
        assert r.status_code == 200
        for data in r.iter_raw():
            out.append((time.monotonic() - t0, data.count(b"data: ")))
    assert sum(n for _, n in out) == STREAM_EVENTS
    return out


def test_a_token_stream_reaches_the_client_event_by_event_through_the_balancer(fleet) -> None:
    """Each chunk is sent on as it arrives: without `option http-no-delay` HAProxy sends with MSG_MORE and
    the kernel holds small segments up to 200 ms (events every 40 ms arrived five at a time), so the
    client's clock would lie about every token it times."""
    balancer, _ = fleet
    for policy, url in balancer.endpoints.items():
        reads = _arrivals(url)
        clumped = [f"{t * 1e3:.0f} ms: {n} events" for t, n in reads if n > 1]
        assert not clumped, (policy, clumped)
        gaps = [b[0] - a[0] for a, b in zip(reads, reads[1:])]
        assert max(gaps) < 3 * STREAM_EVERY_S, (policy, gaps)  # about 40 ms each; a held segment: 200 ms
