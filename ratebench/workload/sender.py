"""Sending a phase's streams from this process: the records (client id, time), the keep-alive pool,
each stream read into its record, the live table (:class:`StreamSender`). :class:`ratebench.workload.
driver.Driver` adds spreading a phase over worker processes."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Awaitable, Callable, Iterable

import httpx
import orjson
from rich.console import Console
from rich.live import Live

from ratebench.events import ANONYMOUS_USER
from ratebench.runrecords import ERROR_INTERRUPTED, ClientRecord
from ratebench.http1 import HTTPStreamError, StreamPool
from ratebench.workload.live import LiveRates, LoopLagProbe
from ratebench.workload.prompts import PromptMaker
from ratebench.workload.requests import PhaseContext, StreamRequest, request_body
from ratebench.workload.sse import ChunkReader, ssl_context



class StreamSender:
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
        self.probes_sent = 0  # plain probes a scenario sent (X-Request-Id probe-<engine>-<n>)

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

    async def run_phase_here(self, ctx: PhaseContext, requests: list[StreamRequest], *,
                             concurrency: int | None = None, limits: dict[str, int | None] | None = None
                             ) -> list[ClientRecord]:
        """Send every request from this process (at its delay, at most ``concurrency`` at once); wait
        for the end. Foreground requests run to their end; background ones are closed when every
        foreground request is done (or run to their end if there are no foreground ones)."""
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
                priority=int(req.extra_body.get("priority") or 0), fleet=ctx.fleet,
            )
            self.records.append(rec)
            out.append(rec)
        return out

    async def post_json(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                        *, whole: bool = False) -> tuple[int, str]:
        """One plain (not streamed) POST: its HTTP status and the start of its body (a probe's answer;
        ``whole``: all of it)."""
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), transport=self.transport,
                                     verify=ssl_context()) as client:
            r = await client.post(url, json=body, headers=headers)
        return r.status_code, r.text if whole else r.text[:500]

    def open_client(self, ctx: PhaseContext, streams: int) -> "httpx.AsyncClient | StreamPool":
        """The phase's client: a keep-alive pool for ``streams`` at once (httpx over a test transport)."""
        if self.transport is not None:
            timeout = httpx.Timeout(connect=30.0, read=ctx.stall_timeout_s, write=30.0, pool=None)
            return httpx.AsyncClient(timeout=timeout, transport=self.transport, verify=ssl_context(),
                                     limits=httpx.Limits(max_connections=None, max_keepalive_connections=streams))
        return StreamPool(ctx.endpoint, max_idle=streams, read_timeout_s=ctx.stall_timeout_s,
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
        StreamSender._ended(rec, reader)

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
        StreamSender._ended(rec, reader)


def users_of(records: Iterable[ClientRecord]) -> set[str]:
    return {r.user or ANONYMOUS_USER for r in records}
