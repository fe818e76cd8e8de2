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
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ratebench.events import ERROR_INTERRUPTED, ClientRecord
from ratebench.profiles import ANONYMOUS_USER


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """One verifying SSL context for every HTTP client of the process: httpx loads the
    certificate bundle anew for each client otherwise (about 27 ms each, a tokenize
    call per stream before every phase)."""
    return httpx.create_ssl_context()

READ_TIMEOUT_S = 300.0
LIVE_RATE_WINDOW_S = 2.0
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


class LiveRates:
    """Per-user live figures for the display: streams running, tokens, recent rate."""

    def __init__(self, limits: dict[str, int | None]) -> None:
        self.limits = limits
        self.running: dict[str, int] = collections.Counter()
        self.tokens: dict[str, int] = collections.Counter()
        self.recent: dict[str, collections.deque] = collections.defaultdict(collections.deque)

    def started(self, user: str) -> None:
        self.running[user] += 1

    def ended(self, user: str) -> None:
        self.running[user] -= 1

    def got(self, user: str, t_ns: int, n: int) -> None:
        self.tokens[user] += n
        self.recent[user].append((t_ns, n))

    def rate_tps(self, user: str, now_ns: int) -> float:
        q = self.recent[user]
        cutoff = now_ns - int(LIVE_RATE_WINDOW_S * 1e9)
        while q and q[0][0] < cutoff:
            q.popleft()
        return sum(n for _, n in q) / LIVE_RATE_WINDOW_S

    def table(self, title: str) -> Table:
        now = time.monotonic_ns()
        t = Table(title=title, title_justify="left", expand=False)
        for col in ("user", "streams", "tokens", "live tok/s", "limit tok/s"):
            t.add_column(col, justify="left" if col == "user" else "right")
        for user in sorted(set(self.running) | set(self.tokens)):
            limit = self.limits.get(user)
            rate = self.rate_tps(user, now)
            style = "red" if limit and rate > 1.2 * limit else ""
            t.add_row(user, str(self.running[user]), str(self.tokens[user]), f"{rate:.1f}",
                      "off" if limit is None else str(limit), style=style)
        return t


class Driver:
    """Sends streamed requests for the phases of a run and keeps their client records."""

    def __init__(self, run_id: str, *, console: Console | None = None, live: bool = True,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.run_id = run_id
        self.transport = transport  # tests: a mock server
        self.records: list[ClientRecord] = []
        self.console = console or Console(stderr=True)
        self.live = live
        self._counter = itertools.count()
        self._prompts: dict[tuple[str, str], "PromptMaker"] = {}
        # (endpoint, user) -> when that user's last phase there ended (monotonic ns)
        self.user_last_phase_end_ns: dict[tuple[str, str], int] = {}

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

    async def run_phase(self, ctx: PhaseContext, requests: list[StreamRequest], *, concurrency: int | None = None,
                        limits: dict[str, int | None] | None = None) -> list[ClientRecord]:
        """Send every request (at its delay, at most ``concurrency`` at once); wait for the end.

        Foreground requests run to their end; background ones are closed when every
        foreground request is done (or run to their end if there are no foreground ones).
        """
        live = LiveRates(limits or {})
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        phase_records: list[ClientRecord] = []
        stop_flags: dict[int, bool] = {}
        timeout = httpx.Timeout(connect=30.0, read=READ_TIMEOUT_S, write=30.0, pool=None)
        async with httpx.AsyncClient(timeout=timeout, transport=self.transport, verify=ssl_context(),
                                     limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64)) as client:
            # the schedule starts once the client is ready (a process's first client loads the
            # certificate bundle: tens of ms that would make the first requests late)
            t0 = time.monotonic_ns()
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

            for req in requests:
                rec = ClientRecord(
                    client_id=self.next_client_id(), scenario=ctx.scenario, phase=ctx.phase, engine=ctx.engine,
                    user=req.user, api=req.api, stream_index=req.stream_index, max_tokens=req.max_tokens,
                    ignore_eos=req.ignore_eos, prompt_tokens=req.prompt_tokens,
                    scheduled_ns=t0 + int(req.delay_s * 1e9), openai_user=req.openai_user, spoof=req.spoof,
                )
                self.records.append(rec)
                phase_records.append(rec)
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
            with Live(live.table(title), console=self.console, refresh_per_second=4, transient=True,
                      auto_refresh=self.live) as display:
                ticker = asyncio.create_task(self._refresh(display, live, title))
                try:
                    foreground = [t for r, t in tasks if not r.background]
                    if foreground:
                        await asyncio.gather(*foreground)
                        for r, t in tasks:
                            if r.background and not t.done():
                                stop_flags[id(t)] = True
                                t.cancel()
                    await asyncio.gather(*(t for _, t in tasks))
                finally:
                    ticker.cancel()
                    for _, t in tasks:
                        if not t.done():
                            t.cancel()
                    await asyncio.gather(*(t for _, t in tasks), ticker, return_exceptions=True)
        return phase_records

    @staticmethod
    async def _refresh(display: Live, live: LiveRates, title: str) -> None:
        while True:
            display.update(live.table(title))
            await asyncio.sleep(0.25)

    async def _stream(self, client: httpx.AsyncClient, ctx: PhaseContext, req: StreamRequest, rec: ClientRecord,
                      sem: asyncio.Semaphore | None, live: LiveRates, stop_flags: dict[int, bool]) -> None:
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

    async def _send(self, client: httpx.AsyncClient, ctx: PhaseContext, req: StreamRequest, rec: ClientRecord,
                    live: LiveRates, user_key: str) -> None:
        body = request_body(ctx.model, req)
        path = "/v1/chat/completions" if req.api == "chat" else "/v1/completions"
        headers = {**req.headers, "X-Request-Id": rec.client_id}
        live.started(user_key)
        try:
            if req.cancel_after_s is not None:
                try:
                    async with asyncio.timeout(req.cancel_after_s):
                        await self._read_stream(client, ctx.endpoint + path, body, headers, req, rec, live, user_key)
                except TimeoutError:
                    rec.cancelled = True
                    rec.cancel_ns = time.monotonic_ns()
            else:
                await self._read_stream(client, ctx.endpoint + path, body, headers, req, rec, live, user_key)
        except httpx.HTTPError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            if rec.done_ns is None:  # closed mid-stream (by the driver, or the run was interrupted)
                rec.cancelled = True
                rec.cancel_ns = time.monotonic_ns()
            raise
        finally:
            live.ended(user_key)
            if rec.done_ns is None:
                rec.done_ns = time.monotonic_ns()

    async def _read_stream(self, client: httpx.AsyncClient, url: str, body: dict, headers: dict, req: StreamRequest,
                           rec: ClientRecord, live: LiveRates, user_key: str) -> None:
        rec.sent_ns = time.monotonic_ns()
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            rec.http_status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:500]}"
                rec.done_ns = time.monotonic_ns()
                return
            seen = 0
            buf = b""
            async for raw in resp.aiter_raw():
                t_ns = time.monotonic_ns()
                buf += raw.replace(b"\r\n", b"\n")
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            rec.done_ns = t_ns
                            return
                        seen = self._on_chunk(payload, t_ns, seen, rec, live, user_key)
                        if req.cancel_after_tokens is not None and seen >= req.cancel_after_tokens:
                            rec.cancelled = True
                            rec.cancel_ns = time.monotonic_ns()
                            return  # leaving the context closes the connection: vLLM aborts
            rec.done_ns = time.monotonic_ns()
            if rec.finish_reason is None and rec.error is None:
                rec.error = "stream ended without [DONE]"

    @staticmethod
    def _on_chunk(payload: bytes, t_ns: int, seen: int, rec: ClientRecord, live: LiveRates, user_key: str) -> int:
        try:
            chunk = json.loads(payload)
        except ValueError:
            rec.error = f"unreadable chunk: {payload[:200]!r}"
            return seen
        if "error" in chunk and "choices" not in chunk:
            err = chunk["error"]
            rec.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return seen
        choices = chunk.get("choices") or []
        usage = chunk.get("usage")
        if usage is not None:
            total = int(usage.get("completion_tokens") or 0)
            if rec.prompt_tokens is None and usage.get("prompt_tokens") is not None:
                rec.prompt_tokens = int(usage["prompt_tokens"])
            if total > seen:
                n = total - seen
                if rec.first_token_ns is None:
                    rec.first_token_ns = t_ns
                rec.chunk_ns.append(t_ns)
                rec.chunk_tokens.append(n)
                live.got(user_key, t_ns, n)
                seen = total
            if not choices:  # the final usage chunk (include_usage)
                rec.completion_tokens = total
                if usage.get("prompt_tokens") is not None:
                    rec.prompt_tokens = int(usage["prompt_tokens"])
        for choice in choices:
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
        return seen


def request_body(model: str, req: StreamRequest) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": req.ignore_eos,
        "temperature": 1.0,
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
