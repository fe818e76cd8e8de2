"""The workload driver: concurrent streaming OpenAI clients (httpx + asyncio).

Every request streams with ``stream_options: {include_usage, continuous_usage_stats}``
so each chunk carries the cumulative ``completion_tokens``; the tokens of a chunk
are the delta of that count. Each chunk's time is ``time.monotonic_ns()`` taken
when its bytes came off the socket (the clock of the engine events). Every
request carries ``X-Request-Id: rb-<run id>-<n>``, which the engine keeps inside
its request id (``ratebench.events.client_id_of``). What the client saw goes into
one :class:`ratebench.events.ClientRecord` per request.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import socket
import ssl
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Mapping

import httpx
import orjson
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ratebench.events import ERROR_INTERRUPTED, ClientRecord
from ratebench.http1 import HTTPStreamError, StreamPool
from ratebench.profiles import ANONYMOUS_USER


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """One verifying SSL context for every HTTP client of the process: httpx loads the
    certificate bundle anew for each client otherwise (about 27 ms each, a tokenize
    call per stream before every phase)."""
    return httpx.create_ssl_context()

READ_TIMEOUT_S = 300.0
LIVE_RATE_WINDOW_S = 2.0
LOOP_LAG_PROBE_S = 0.01  # how often the event-loop lag probe sends itself a byte
# Natural text the prompts are made of (tokenized once by the server's /tokenize).
_BASE_TEXT = (
    "The scheduler hands out output tokens one step at a time, and every user shares "
    "a single budget across all of their streams. A request that runs out of budget "
    "waits in place and resumes later; it is never cut short. Meanwhile other users "
    "carry on at their own pace, as if nothing had happened. "
)


class WorkloadError(RuntimeError):
    """The server refused what the driver needs (tokenizer, model): says what and where."""


@dataclass
class StreamRequest:
    """One streamed request a scenario wants sent."""

    user: str | None  # vllm_xargs.output_rate_user; None: the field is left out
    prompt: list[int] | str  # token ids (completions) or text (chat, or completions)
    max_tokens: int
    api: str = "completions"  # "completions" | "chat"
    ignore_eos: bool = True
    delay_s: float = 0.0  # after the phase starts
    cancel_after_tokens: int | None = None
    cancel_after_s: float | None = None
    background: bool = False  # closed by the driver once every foreground stream is done
    openai_user: str | None = None  # the OpenAI "user" field
    extra_body: dict[str, Any] = field(default_factory=dict)  # min_tokens, logit_bias, ...
    extra_xargs: dict[str, Any] = field(default_factory=dict)  # more vllm_xargs keys (spoofing attempts)
    headers: dict[str, str] = field(default_factory=dict)  # more HTTP headers (spoofing attempts)
    spoof: str | None = None  # the channels through which the request names another user, in words
    stream_index: int = 0
    prompt_tokens: int | None = None  # known length of the prompt, when exact
    # a closed loop: at most loop_streams requests of loop_group open at once, each sent delay_s after
    # one of them ends (the first ones, after the phase starts), in list order
    loop_group: str | None = None
    loop_streams: int = 1


@dataclass
class PhaseContext:
    """Where a phase's records belong."""

    scenario: str
    phase: str
    engine: str
    endpoint: str
    model: str
    # a fleet's phase: the fleet's engine name (each record's ``fleet``), and the response header in which
    # the balancer names the engine that served the request (each record's ``engine``)
    fleet: str | None = None
    served_by_header: str | None = None


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


class ChunkReader:
    """A streamed response's body -> its client record: server-sent events split, each chunk's usage read.

    ``feed`` runs for every socket read (from ``ratebench.http1`` straight off ``data_received``,
    or per ``aiter_raw`` piece of an httpx transport) with the time the bytes came off the
    socket. The per-chunk work is one ``orjson.loads`` and two appends to ``array('q')``s;
    :meth:`finish` turns those into the record's lists once, at the end of the stream.
    """

    __slots__ = ("rec", "cancel_after_tokens", "seen", "times", "counts", "ids", "buf", "closing", "served_by_header")

    def __init__(self, rec: ClientRecord, cancel_after_tokens: int | None, served_by_header: str | None = None) -> None:
        self.rec = rec
        self.cancel_after_tokens = cancel_after_tokens
        self.served_by_header = served_by_header.lower() if served_by_header else None
        self.seen = 0  # usage.completion_tokens of the last chunk
        self.times = array("q")  # chunks that carried tokens: arrival time
        self.counts = array("q")  # tokens in each of those chunks
        self.ids: array | None = None  # the answer's token ids (choices[].token_ids), when the server sends them
        self.buf = b""  # an event not complete yet
        self.closing = False  # feed said True because the driver closes the stream (cancel_after_tokens)

    def head(self, status: int, headers: Mapping[str, str]) -> None:
        """A fleet's answer names the engine that served it (the balancer's header): the record's engine."""
        if self.served_by_header is not None:
            served = headers.get(self.served_by_header)
            if served:
                self.rec.engine = served

    def feed(self, data: bytes, t_ns: int) -> bool:
        """Take body bytes that came off the socket at ``t_ns``; True: the driver needs no more
        ([DONE] seen, or ``cancel_after_tokens`` reached: then ``closing``)."""
        buf = self.buf + data if self.buf else data
        if b"\r" in buf:  # a CR at the end stays, and meets its LF in the next read
            buf = buf.replace(b"\r\n", b"\n")
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            event = buf[start:end]
            start = end + 2
            if event.startswith(b"data: ") and b"\n" not in event:  # vLLM's one-line events
                done = self._chunk(event[6:], t_ns)
            else:
                done = False
                for line in event.split(b"\n"):
                    if line.startswith(b"data:") and self._chunk(line[5:].strip(), t_ns):
                        done = True
                        break
            if done:
                self.buf = b""
                return True
        self.buf = buf[start:] if start < len(buf) else b""
        return False

    def _chunk(self, payload: bytes, t_ns: int) -> bool:
        rec = self.rec
        if payload == b"[DONE]":
            rec.done_ns = t_ns
            return True
        try:
            chunk = orjson.loads(payload)
        except ValueError:
            rec.error = f"unreadable chunk: {payload[:200]!r}"
            return False
        if type(chunk) is not dict:
            rec.error = f"unreadable chunk: {payload[:200]!r}"
            return False
        if "error" in chunk and "choices" not in chunk:
            err = chunk["error"]
            rec.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return False
        choices = chunk.get("choices") or []
        usage = chunk.get("usage")
        if usage is not None:
            total = int(usage.get("completion_tokens") or 0)
            if rec.prompt_tokens is None and usage.get("prompt_tokens") is not None:
                rec.prompt_tokens = int(usage["prompt_tokens"])
            if total > self.seen:
                if rec.first_token_ns is None:
                    rec.first_token_ns = t_ns
                self.times.append(t_ns)
                self.counts.append(total - self.seen)
                self.seen = total
            if not choices:  # the final usage chunk (include_usage)
                rec.completion_tokens = total
                if usage.get("prompt_tokens") is not None:
                    rec.prompt_tokens = int(usage["prompt_tokens"])
        for choice in choices:
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
            ids = choice.get("token_ids")
            if ids:
                if self.ids is None:
                    self.ids = array("q")
                self.ids.extend(ids)
        if self.cancel_after_tokens is not None and self.seen >= self.cancel_after_tokens:
            rec.cancelled = True
            rec.cancel_ns = time.monotonic_ns()
            self.closing = True
            return True  # the driver closes the connection: vLLM aborts
        return False

    def finish(self) -> None:
        """The record's chunk lists, once the stream is over."""
        self.rec.chunk_ns = self.times.tolist()
        self.rec.chunk_tokens = self.counts.tolist()
        if self.ids is not None:
            self.rec.token_ids = self.ids.tolist()


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


class Driver:
    """Sends streamed requests for the phases of a run and keeps their client records.

    The requests go over ratebench's own HTTP/1.1 client (``ratebench.http1``: a keep-alive pool
    per phase, sized to its streams); ``transport`` (tests: a scripted server) sends them through
    ``httpx`` instead. Either way every body byte goes through the same :class:`ChunkReader`.
    """

    def __init__(self, run_id: str, *, console: Console | None = None, live: bool = True,
                 transport: httpx.AsyncBaseTransport | None = None, workers: int = 1) -> None:
        self.run_id = run_id
        self.workers = workers  # processes the streams of a phase are spread over (1: this one)
        self.transport = transport  # tests: a mock server
        self.records: list[ClientRecord] = []
        self.console = console or Console(stderr=True)
        self.live = live
        self._counter = itertools.count()
        self._prompts: dict[tuple[str, str], "PromptMaker"] = {}
        # (endpoint, user) -> when that user's last phase there ended (monotonic ns)
        self.user_last_phase_end_ns: dict[tuple[str, str], int] = {}
        # the event-loop lag over the last phase (LoopLagProbe.summary), for its scenarios.json entry
        self.last_loop_lag: dict[str, Any] | None = None
        self.last_connections = 0  # connections the last phase opened (its pool; 0 through httpx)
        self.last_probe: LoopLagProbe | None = None

    def next_client_id(self) -> str:
        return f"rb-{self.run_id}-{next(self._counter)}"

    async def prompts(self, endpoint: str, model: str) -> "PromptMaker":
        """The prompt maker for a server, calibrated against its /tokenize once."""
        key = (endpoint, model)
        if key not in self._prompts:
            maker = PromptMaker(endpoint, model)
            await maker.calibrate()
            self._prompts[key] = maker
        return self._prompts[key]

    @staticmethod
    def streams_at_once(requests: list[StreamRequest], concurrency: int | None) -> int:
        """The most streams the phase can have open at once (the size of its keep-alive pool)."""
        loops: dict[str, int] = {}
        free = 0
        for req in requests:
            if req.loop_group is None:
                free += 1
            else:
                loops[req.loop_group] = req.loop_streams
        most = free + sum(loops.values())
        return max(1, min(most, concurrency) if concurrency else most)

    async def run_phase(self, ctx: PhaseContext, requests: list[StreamRequest], *, concurrency: int | None = None,
                        limits: dict[str, int | None] | None = None) -> list[ClientRecord]:
        """Send every request (at its delay, at most ``concurrency`` at once); wait for the end.

        Foreground requests run to their end; background ones are closed when every
        foreground request is done (or run to their end if there are no foreground ones).
        With ``workers`` > 1 the streams are spread over that many worker processes
        (``ratebench/driver_workers.py``); the records come back here all the same.
        """
        if self.workers > 1 and self.transport is None and len(requests) > 1:
            from ratebench.driver_workers import run_phase_in_workers

            return await run_phase_in_workers(self, ctx, requests, concurrency=concurrency, limits=limits)
        client = self.open_client(ctx, self.streams_at_once(requests, concurrency))
        t0 = time.monotonic_ns()  # the schedule starts once the client is ready
        records = self.new_records(ctx, requests, t0)
        has_foreground = any(not r.background for r in requests)
        await self.run_records(ctx, requests, records, t0, client, live=LiveRates(limits or {}), concurrency=concurrency,
                               display=True, close_when=(lambda fg: asyncio.gather(*fg)) if has_foreground else None)
        return records

    def new_records(self, ctx: PhaseContext, requests: list[StreamRequest], t0: int) -> list[ClientRecord]:
        """One record per request (its client id, and its time: ``delay_s`` after ``t0``), kept in ``records``."""
        out = []
        for req in requests:
            rec = ClientRecord(
                client_id=self.next_client_id(), scenario=ctx.scenario, phase=ctx.phase, engine=ctx.engine,
                user=req.user, api=req.api, stream_index=req.stream_index, max_tokens=req.max_tokens,
                ignore_eos=req.ignore_eos, prompt_tokens=req.prompt_tokens,
                scheduled_ns=t0 + int(req.delay_s * 1e9), openai_user=req.openai_user, spoof=req.spoof,
                fleet=ctx.fleet,
            )
            self.records.append(rec)
            out.append(rec)
        return out

    def open_client(self, ctx: PhaseContext, streams: int) -> "httpx.AsyncClient | StreamPool":
        """The phase's client: a keep-alive pool for ``streams`` at once (httpx over a test transport)."""
        if self.transport is not None:
            timeout = httpx.Timeout(connect=30.0, read=READ_TIMEOUT_S, write=30.0, pool=None)
            return httpx.AsyncClient(timeout=timeout, transport=self.transport, verify=ssl_context(),
                                     limits=httpx.Limits(max_connections=None, max_keepalive_connections=streams))
        return StreamPool(ctx.endpoint, max_idle=streams, read_timeout_s=READ_TIMEOUT_S,
                          ssl_context=ssl_context() if ctx.endpoint.startswith("https:") else None)

    async def run_records(self, ctx: PhaseContext, requests: list[StreamRequest], records: list[ClientRecord],
                          t0: int, client: "httpx.AsyncClient | StreamPool", *, live: LiveRates,
                          concurrency: int | None, display: bool,
                          close_when: Callable[[list[asyncio.Task]], Awaitable[Any]] | None) -> None:
        """Stream ``requests`` into their ``records`` over ``client`` (closed at the end; a closed loop's
        first places free at ``t0``).

        ``close_when(foreground tasks)``: once it returns, the background streams still open
        are closed (None: they run to their end). ``display``: the live table on the console.
        """
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        stop_flags: dict[int, bool] = {}
        probe = self.last_probe = LoopLagProbe()
        self.last_loop_lag = None
        expire_every_ns = 1_000_000_000
        next_expiry = [time.monotonic_ns() + expire_every_ns]

        def tick(now_ns: int) -> None:  # from the probe, every 10 ms: read timeouts once a second
            if isinstance(client, StreamPool) and now_ns >= next_expiry[0]:
                next_expiry[0] = now_ns + expire_every_ns
                client.expire(now_ns)

        try:
            tasks: list[tuple[StreamRequest, asyncio.Task]] = []
            loops: dict[str, asyncio.Queue] = {}  # a closed loop's free places: when each was freed (ns)

            async def in_loop(free: asyncio.Queue, req: StreamRequest, rec: ClientRecord) -> None:
                # its time is delay_s after the request whose place it takes ended (the lateness counts from there)
                try:
                    freed_ns = await free.get()
                except asyncio.CancelledError:  # the run was interrupted before a place was free
                    rec.cancelled, rec.error = True, ERROR_INTERRUPTED
                    rec.cancel_ns = rec.done_ns = time.monotonic_ns()
                    raise
                rec.scheduled_ns = freed_ns + int(req.delay_s * 1e9)
                try:
                    await self._stream(client, ctx, req, rec, sem, live, stop_flags)
                finally:
                    free.put_nowait(rec.done_ns or time.monotonic_ns())

            for req, rec in zip(requests, records):
                if req.loop_group is None:
                    task = asyncio.create_task(self._stream(client, ctx, req, rec, sem, live, stop_flags))
                else:
                    if req.loop_group not in loops:
                        loops[req.loop_group] = asyncio.Queue()
                        for _ in range(req.loop_streams):
                            loops[req.loop_group].put_nowait(t0)
                    task = asyncio.create_task(in_loop(loops[req.loop_group], req, rec))
                tasks.append((req, task))
            title = f"{ctx.scenario} / {ctx.phase} on {ctx.engine}"
            # the display is rendered by the event loop's own 4 Hz task, not by a second thread
            # (a refresh thread would take the GIL from the loop at times of its own)
            with Live(live.table(title), console=self.console, transient=True, auto_refresh=False) as display_:
                ticker = asyncio.create_task(self._refresh(display_, live, title)) if self.live and display else None
                prober = asyncio.create_task(probe.run(tick=tick))
                side = [t for t in (ticker, prober) if t is not None]
                open_bg = {t for r, t in tasks if r.background}
                if close_when is not None and open_bg:
                    side.append(asyncio.ensure_future(close_when([t for r, t in tasks if not r.background])))
                try:
                    if close_when is not None and open_bg:
                        waiter = side[-1]
                        while open_bg and not waiter.done():
                            done, _ = await asyncio.wait([waiter, *open_bg], return_when=asyncio.FIRST_COMPLETED)
                            open_bg -= done
                        if waiter.done():
                            waiter.result()  # a foreground stream's own failure
                            for r, t in tasks:
                                if r.background and not t.done():
                                    stop_flags[id(t)] = True
                                    t.cancel()
                    await asyncio.gather(*(t for _, t in tasks))
                finally:
                    for t in side:
                        t.cancel()
                    for _, t in tasks:
                        if not t.done():
                            t.cancel()
                    await asyncio.gather(*(t for _, t in tasks), *side, return_exceptions=True)
                    self.last_loop_lag = probe.summary()
        finally:
            if isinstance(client, StreamPool):
                self.last_connections = client.opened
                client.close()
            else:
                self.last_connections = 0
                await client.aclose()

    @staticmethod
    async def _refresh(display: Live, live: LiveRates, title: str) -> None:
        while True:
            display.update(live.table(title), refresh=True)
            await asyncio.sleep(0.25)

    async def _stream(self, client: "httpx.AsyncClient | StreamPool", ctx: PhaseContext, req: StreamRequest,
                      rec: ClientRecord, sem: asyncio.Semaphore | None, live: LiveRates,
                      stop_flags: dict[int, bool]) -> None:
        user_key = req.user or ANONYMOUS_USER
        try:
            delay_s = (rec.scheduled_ns - time.monotonic_ns()) / 1e9
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            if sem is not None:
                async with sem:
                    await self._send(client, ctx, req, rec, live, user_key)
            else:
                await self._send(client, ctx, req, rec, live, user_key)
        except asyncio.CancelledError:
            if rec.sent_ns is None:  # never sent: closed while waiting for its start
                rec.cancelled = True
                rec.cancel_ns = rec.done_ns = time.monotonic_ns()
            task = asyncio.current_task()
            if stop_flags.get(id(task)) and task is not None and task.uncancel() == 0:
                return  # the driver closed a background stream: that is the plan
            if rec.error is None and not stop_flags.get(id(task)):
                rec.error = ERROR_INTERRUPTED
            raise

    async def _send(self, client: "httpx.AsyncClient | StreamPool", ctx: PhaseContext, req: StreamRequest,
                    rec: ClientRecord, live: LiveRates, user_key: str) -> None:
        body = request_body(ctx.model, req)
        path = "/v1/chat/completions" if req.api == "chat" else "/v1/completions"
        headers = {**req.headers, "X-Request-Id": rec.client_id}
        reader = ChunkReader(rec, req.cancel_after_tokens, ctx.served_by_header)
        read = self._read_pooled if isinstance(client, StreamPool) else self._read_httpx
        live.started(user_key, reader)
        try:
            if req.cancel_after_s is not None:
                try:
                    async with asyncio.timeout(req.cancel_after_s):
                        await read(client, ctx.endpoint, path, body, headers, rec, reader)
                except TimeoutError:
                    rec.cancelled = True
                    rec.cancel_ns = time.monotonic_ns()
            else:
                await read(client, ctx.endpoint, path, body, headers, rec, reader)
        except (httpx.HTTPError, HTTPStreamError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            if rec.done_ns is None:  # closed mid-stream (by the driver, or the run was interrupted)
                rec.cancelled = True
                rec.cancel_ns = time.monotonic_ns()
            raise
        finally:
            reader.finish()
            live.ended(user_key, reader)
            if rec.done_ns is None:
                rec.done_ns = time.monotonic_ns()

    @staticmethod
    def _ended(rec: ClientRecord, reader: ChunkReader) -> None:
        """The body ended (or the driver stopped reading it): the record's end, and what a short stream lacked."""
        if rec.done_ns is None and not reader.closing:
            rec.done_ns = time.monotonic_ns()
            if rec.finish_reason is None and rec.error is None:
                rec.error = "stream ended without [DONE]"

    @staticmethod
    async def _read_pooled(pool: StreamPool, endpoint: str, path: str, body: dict, headers: dict,
                           rec: ClientRecord, reader: ChunkReader) -> None:
        rec.sent_ns = time.monotonic_ns()
        status, error_body = await pool.post(path, headers, orjson.dumps(body), reader)
        rec.http_status = status
        if status != 200:
            rec.error = f"HTTP {status}: {error_body.decode(errors='replace')[:500]}"
            rec.done_ns = time.monotonic_ns()
            return
        Driver._ended(rec, reader)

    @staticmethod
    async def _read_httpx(client: httpx.AsyncClient, endpoint: str, path: str, body: dict, headers: dict,
                          rec: ClientRecord, reader: ChunkReader) -> None:
        rec.sent_ns = time.monotonic_ns()
        async with client.stream("POST", endpoint + path, json=body, headers=headers) as resp:
            rec.http_status = resp.status_code
            reader.head(resp.status_code, {k.lower(): v.lower() for k, v in resp.headers.items()})
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:500]}"
                rec.done_ns = time.monotonic_ns()
                return
            async for raw in resp.aiter_raw():
                if reader.feed(raw, time.monotonic_ns()):
                    return  # [DONE], or closing: leaving the context closes the connection (vLLM aborts)
        Driver._ended(rec, reader)


def request_body(model: str, req: StreamRequest) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": req.ignore_eos,
        "temperature": 1.0,
        # the answer's token ids in each chunk: what the client got, to hold against the same request
        # on the limiter-off engine (answers-intact)
        "return_token_ids": True,
    }
    if req.api == "chat":
        text = req.prompt if isinstance(req.prompt, str) else None
        if text is None:
            raise WorkloadError("chat requests need a text prompt")
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    xargs = dict(req.extra_xargs)
    if req.user is not None:
        xargs["output_rate_user"] = req.user
    if xargs:
        body["vllm_xargs"] = xargs
    if req.openai_user is not None:
        body["user"] = req.openai_user
    body.update(req.extra_body)
    return body


class PromptMaker:
    """Prompts of a controlled token length, from the server's own tokenizer."""

    def __init__(self, endpoint: str, model: str) -> None:
        self.endpoint = endpoint
        self.model = model
        self.base_ids: list[int] = []
        self.chars_per_token = 4.0
        self._salt_cache: dict[str, list[int]] = {}

    async def tokenize(self, text: str) -> list[int]:
        async with httpx.AsyncClient(timeout=30.0, verify=ssl_context()) as client:
            r = await client.post(f"{self.endpoint}/tokenize",
                                  json={"model": self.model, "prompt": text, "add_special_tokens": False})
        if r.status_code != 200:
            raise WorkloadError(f"{self.endpoint}/tokenize answered HTTP {r.status_code}: {r.text[:300]}")
        return list(r.json()["tokens"])

    async def calibrate(self) -> None:
        text = _BASE_TEXT * 8
        self.base_ids = await self.tokenize(text)
        if not self.base_ids:
            raise WorkloadError(f"{self.endpoint}/tokenize returned no tokens for plain English text")
        self.chars_per_token = len(text) / len(self.base_ids)

    async def header_ids(self, salt: str) -> list[int]:
        if salt not in self._salt_cache:
            self._salt_cache[salt] = await self.tokenize(f"[{salt}] ")
        return self._salt_cache[salt]

    def fill(self, n: int, offset: int = 0) -> list[int]:
        """``n`` token ids of natural text, starting ``offset`` tokens into it."""
        base = self.base_ids
        return [base[(offset + i) % len(base)] for i in range(n)]

    async def token_prompt(self, n: int, salt: str, prefix: list[int] | None = None) -> list[int]:
        """Exactly ``n`` token ids (plus ``prefix``): a unique header, then text.

        The unique header keeps prompts from sharing cached blocks by accident.
        """
        head = (await self.header_ids(salt))[:n]
        return (prefix or []) + head + self.fill(n - len(head), offset=len(salt))

    def text_prompt(self, approx_tokens: int, salt: str) -> str:
        """Text of about ``approx_tokens`` tokens, starting with a unique header."""
        body = (_BASE_TEXT * (1 + int(approx_tokens * self.chars_per_token) // len(_BASE_TEXT)))
        return f"[{salt}] " + body[: int(approx_tokens * self.chars_per_token)]


def users_of(records: Iterable[ClientRecord]) -> set[str]:
    return {r.user or ANONYMOUS_USER for r in records}
