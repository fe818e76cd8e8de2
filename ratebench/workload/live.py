"""What the driver shows and measures about itself while a phase runs: each user's tokens a second
(the live table, :class:`LiveRates`) and the lag of the driver's own event loop (:class:`LoopLagProbe`)."""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from array import array
from typing import Any

from rich.table import Table

from ratebench.workload.sse import ChunkReader

LIVE_RATE_WINDOW_S = 2.0
LOOP_LAG_PROBE_S = 0.01  # how often the event-loop lag probe sends itself a byte


class LiveRates:
    """Per-user live figures for the display: streams running, tokens, recent rate.

    Nothing here runs per chunk: when the display refreshes (4 times a second) it reads each
    open stream's token count off its :class:`ChunkReader`, and the recent rate is the change
    of a user's total over the totals it read in the last ``LIVE_RATE_WINDOW_S``.
    """

    def __init__(self, limits: dict[str, int | None]) -> None:
        self.limits = limits
        self.running: dict[str, int] = collections.Counter()
        self.ended_tokens: dict[str, int] = collections.Counter()
        self.open: dict[str, set[ChunkReader]] = collections.defaultdict(set)
        self.totals_seen: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.remote: dict[int, dict[str, tuple[int, int]]] = {}  # driver worker -> user -> (streams, tokens)

    def started(self, user: str, reader: "ChunkReader") -> None:
        self.running[user] += 1
        self.open[user].add(reader)

    def ended(self, user: str, reader: "ChunkReader") -> None:
        self.running[user] -= 1
        self.open[user].discard(reader)
        self.ended_tokens[user] += reader.seen

    def tokens(self, user: str) -> int:
        return (self.ended_tokens[user] + sum(r.seen for r in self.open[user])
                + sum(counts.get(user, (0, 0))[1] for counts in self.remote.values()))

    def streams(self, user: str) -> int:
        return self.running[user] + sum(counts.get(user, (0, 0))[0] for counts in self.remote.values())

    def rate_tps(self, user: str, now_ns: int) -> float:
        total = self.tokens(user)
        q = self.totals_seen[user]
        q.append((now_ns, total))
        cutoff = now_ns - int(LIVE_RATE_WINDOW_S * 1e9)
        while len(q) > 1 and q[1][0] <= cutoff:
            q.popleft()
        then_ns, then_total = q[0]
        return (total - then_total) / ((now_ns - then_ns) / 1e9) if now_ns > then_ns else 0.0

    def table(self, title: str) -> Table:
        now = time.monotonic_ns()
        t = Table(title=title, title_justify="left", expand=False)
        for col in ("user", "streams", "tokens", "live tok/s", "limit tok/s"):
            t.add_column(col, justify="left" if col == "user" else "right")
        users = set(self.running) | set(self.ended_tokens)
        for counts in self.remote.values():
            users |= set(counts)
        for user in sorted(users):
            limit = self.limits.get(user)
            rate = self.rate_tps(user, now)
            style = "red" if limit and rate > 1.2 * limit else ""
            t.add_row(user, str(self.streams(user)), str(self.tokens(user)), f"{rate:.1f}",
                      "off" if limit is None else str(limit), style=style)
        return t


class LoopLagProbe:
    """How late the event loop handles bytes that arrive: the delay a chunk's timestamp carries.

    Every ``LOOP_LAG_PROBE_S`` the probe sends itself one byte over a socket pair and stamps
    the send; the loop's reader callback for the other end stamps the receipt. The difference is
    how long a byte that reached the kernel waits for the loop: the rest of the loop's current
    pass plus the I/O callbacks ahead of it, the same wait as a stream's bytes (their stamps are
    taken in ``data_received``).
    """

    def __init__(self) -> None:
        self.lags_ns = array("q")
        self._sent_ns = 0

    async def run(self, every_s: float = LOOP_LAG_PROBE_S, tick=None) -> None:
        loop = asyncio.get_running_loop()
        rsock, wsock = socket.socketpair()
        rsock.setblocking(False)
        wsock.setblocking(False)

        def on_byte() -> None:
            now = time.monotonic_ns()
            try:
                rsock.recv(64)
            except BlockingIOError:
                return
            self.lags_ns.append(now - self._sent_ns)

        loop.add_reader(rsock.fileno(), on_byte)
        try:
            while True:
                await asyncio.sleep(every_s)
                self._sent_ns = time.monotonic_ns()
                wsock.send(b"x")
                if tick is not None:
                    tick(self._sent_ns)
        finally:
            loop.remove_reader(rsock.fileno())
            rsock.close()
            wsock.close()

    def summary(self) -> dict[str, Any] | None:
        """p50, p90, p99 and max of the lag in ms, and the samples; None without samples."""
        if not self.lags_ns:
            return None
        lags = sorted(self.lags_ns)
        n = len(lags)

        def ms(q: float) -> float:
            return round(lags[min(n - 1, int(q * n))] / 1e6, 3)

        return {"samples": n, "every_ms": LOOP_LAG_PROBE_S * 1e3, "p50_ms": ms(0.5), "p90_ms": ms(0.9),
                "p99_ms": ms(0.99), "max_ms": round(lags[-1] / 1e6, 3)}
