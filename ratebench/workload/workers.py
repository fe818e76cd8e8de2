"""A phase's streams spread over worker processes: one event loop each, past one core's worth of streams.

``Driver(workers=K)`` hands a phase here. The driver makes every record (client id, time)
first; the requests are dealt to K worker processes (started for the phase, ``spawn``):
requests outside closed loops round-robin, each closed loop's places split between the
workers (its requests dealt to those places in order), the phase's concurrency cap split
the same way. Once every worker is ready (imported, its keep-alive pool open) the phase's
time starts; each worker streams its share on its own event loop, stamping with
``time.monotonic_ns()`` (one clock for every process of a host), and sends back its
records, its loop-lag samples and its live counts (4 times a second) over a pipe. Background
streams close when every worker's foreground streams are done; an interrupted phase
stops every worker, whose records come back marked as usual.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import threading
import time
from array import array
from typing import Any

from rich.live import Live

from ratebench.runrecords import ERROR_INTERRUPTED, ClientRecord
from ratebench.workload.live import LiveRates, LoopLagProbe
from ratebench.workload.requests import PhaseContext, StreamRequest
from ratebench.workload.sender import StreamSender

WORKER_READY_TIMEOUT_S = 60.0
WORKER_STOP_TIMEOUT_S = 15.0
LIVE_EVERY_S = 0.25


def deal(requests: list[StreamRequest], workers: int, concurrency: int | None
         ) -> tuple[list[list[int]], list[list[StreamRequest]], list[int | None]]:
    """Which requests each worker sends (indices), those requests as that worker runs them (a closed
    loop with that worker's share of its places), and each worker's share of the concurrency cap."""
    def split(n: int) -> list[int]:
        return [n // workers + (1 if w < n % workers else 0) for w in range(workers)]

    index: list[list[int]] = [[] for _ in range(workers)]
    loop_places: dict[str, list[int]] = {}  # group -> worker of each place
    loop_next: dict[str, int] = {}
    free_next = 0
    for i, req in enumerate(requests):
        if req.loop_group is None:
            index[free_next % workers].append(i)
            free_next += 1
            continue
        if req.loop_group not in loop_places:
            per = split(req.loop_streams)
            loop_places[req.loop_group] = [w for w in range(workers) for _ in range(per[w])]
            loop_next[req.loop_group] = 0
        places = loop_places[req.loop_group]
        index[places[loop_next[req.loop_group] % len(places)]].append(i)
        loop_next[req.loop_group] += 1
    shard_reqs = []
    for w in range(workers):
        reqs = []
        for i in index[w]:
            req = requests[i]
            if req.loop_group is not None:
                req = dataclasses.replace(req, loop_streams=loop_places[req.loop_group].count(w))
            reqs.append(req)
        shard_reqs.append(reqs)
    caps: list[int | None] = split(concurrency) if concurrency else [None] * workers
    return index, shard_reqs, [c if c is None else max(1, c) for c in caps]


async def _recv(conn) -> Any:
    return await asyncio.to_thread(conn.recv)


def _read_pipe(w: int, conn, first: tuple, lock: threading.Lock, loop: asyncio.AbstractEventLoop,
               queue: asyncio.Queue, exitcode) -> None:
    """Send a worker its share, then its messages into the phase's queue (a thread: a pipe is not a
    socket the loop can watch, and a large share would block the loop until the worker reads it)."""
    try:
        with lock:
            conn.send(first)
    except OSError:
        pass
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = ("died", f"driver worker {w} exited before sending its records (code {exitcode()})")
        loop.call_soon_threadsafe(queue.put_nowait, (w, msg))
        if msg[0] in ("done", "died", "failed"):
            return


async def _next(queue: asyncio.Queue, timeout_s: float) -> Any:
    """The queue's next item within ``timeout_s`` (else TimeoutError). Not ``asyncio.wait_for``: on
    Python 3.11 it returns the item and swallows the cancel when both come at once, and a phase
    interrupted then ran on to its end. A cancel here always propagates; an item that arrived with it
    goes back into the queue for the interrupted phase's own reading."""
    getter = asyncio.ensure_future(queue.get())
    try:
        done, _ = await asyncio.wait({getter}, timeout=timeout_s)
    except asyncio.CancelledError:
        if getter.done() and not getter.cancelled():
            queue.put_nowait(getter.result())
        else:
            getter.cancel()
        raise
    if not done:
        getter.cancel()
        raise asyncio.TimeoutError
    return getter.result()


async def run_phase_in_workers(driver: StreamSender, ctx: PhaseContext, requests: list[StreamRequest], *,
                               concurrency: int | None, limits: dict[str, int | None] | None) -> list[ClientRecord]:
    workers = min(driver.workers, len(requests))
    index, shard_reqs, caps = deal(requests, workers, concurrency)
    mp = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    pipes, procs = [], []
    locks = [threading.Lock() for _ in range(workers)]  # one writer at a time on each pipe

    def stop(w: int) -> None:
        try:
            with locks[w]:
                pipes[w].send(("stop",))
        except OSError:
            pass

    for w in range(workers):
        parent_end, child_end = mp.Pipe()
        proc = mp.Process(target=worker_main, args=(child_end, driver.run_id), daemon=True,
                          name=f"ratebench-driver-{w}")
        proc.start()
        child_end.close()
        pipes.append(parent_end)
        procs.append(proc)
        threading.Thread(target=_read_pipe, args=(w, parent_end, ("phase", ctx, shard_reqs[w], caps[w]), locks[w], loop, queue,
                                                  lambda p=proc: p.exitcode), daemon=True).start()
    records: list[ClientRecord] = []
    live = LiveRates(limits or {})
    probe = LoopLagProbe()
    driver.last_loop_lag = None
    results: dict[int, tuple] = {}
    try:
        ready: set[int] = set()
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        while len(ready) < workers:
            w, msg = await _next(queue, max(0.0, deadline - time.monotonic()))
            if msg[0] != "ready":
                raise RuntimeError(f"driver worker {w} did not start: {msg[1] if len(msg) > 1 else msg[0]}")
            ready.add(w)
        t0 = time.monotonic_ns()  # the schedule starts once every worker is ready
        records = driver.new_records(ctx, requests, t0)
        has_foreground = any(not r.background for r in requests)
        for w, conn in enumerate(pipes):
            conn.send(("start", t0, [records[i] for i in index[w]], has_foreground))
        fg_done: set[int] = set()
        closed_bg = False
        title = f"{ctx.scenario} / {ctx.phase} on {ctx.engine} ({workers} driver processes)"
        with Live(live.table(title), console=driver.console, transient=True, auto_refresh=False) as display:
            next_display = time.monotonic()
            while len(results) < workers:
                try:
                    w, msg = await _next(queue, LIVE_EVERY_S)
                except asyncio.TimeoutError:
                    w, msg = -1, ("tick",)
                if msg[0] == "live":
                    live.remote[w] = msg[1]
                elif msg[0] == "fg-done":
                    fg_done.add(w)
                elif msg[0] in ("done", "died", "failed"):
                    results[w] = msg
                    fg_done.add(w)
                if has_foreground and not closed_bg and len(fg_done) == workers:
                    closed_bg = True
                    for v, conn in enumerate(pipes):
                        if v not in results:
                            conn.send(("close-bg",))
                if driver.live and time.monotonic() >= next_display:
                    next_display = time.monotonic() + LIVE_EVERY_S
                    display.update(live.table(title), refresh=True)
    except asyncio.CancelledError:
        for w in range(workers):
            if w not in results:
                stop(w)
        deadline = time.monotonic() + WORKER_STOP_TIMEOUT_S
        while records and len(results) < workers and time.monotonic() < deadline:
            try:
                w, msg = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
            if msg[0] in ("done", "died", "failed"):
                results[w] = msg
        _merge(driver, records, index, results, probe)
        raise
    finally:
        for w in range(workers):
            if w not in results:  # e.g. a worker that never got its start
                stop(w)
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        for conn in pipes:
            conn.close()
    _merge(driver, records, index, results, probe)
    return records


def _merge(driver: StreamSender, records: list[ClientRecord], index: list[list[int]], results: dict[int, tuple],
           probe: LoopLagProbe) -> None:
    """The workers' records into the driver's (the same objects), their lag samples into one summary."""
    connections = 0
    for w, shard in enumerate(index):
        msg = results.get(w)
        if msg is None or msg[0] != "done":
            why = msg[1] if msg is not None else "driver worker gave no records"
            for i in shard:
                rec = records[i] if i < len(records) else None
                if rec is not None and rec.done_ns is None:
                    rec.error = rec.error or (ERROR_INTERRUPTED if msg is None else why)
                    rec.cancelled = True
                    rec.cancel_ns = rec.done_ns = time.monotonic_ns()
            continue
        _, fields, lags, conns = msg
        for i, values in zip(shard, fields):
            records[i].__dict__.update(values)
        probe.lags_ns.extend(array("q", lags))
        connections += conns
    driver.last_loop_lag = probe.summary()
    if driver.last_loop_lag is not None:
        driver.last_loop_lag["workers"] = len(index)
    driver.last_connections = connections


def worker_main(conn, run_id: str) -> None:
    """A driver worker process: one phase's share of the streams on its own event loop."""
    import signal
    import traceback

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the process group: the parent says stop
    try:
        asyncio.run(_worker(conn, run_id))
    except Exception:  # noqa: BLE001
        try:
            conn.send(("failed", traceback.format_exc(limit=5)))
        except OSError:
            pass
    finally:
        conn.close()


async def _worker(conn, run_id: str) -> None:
    from rich.console import Console

    _, ctx, requests, cap = await _recv(conn)
    driver = StreamSender(run_id, console=Console(quiet=True), live=False)
    client = driver.open_client(ctx, driver.streams_at_once(requests, cap))
    conn.send(("ready",))
    msg = await _recv(conn)
    if msg[0] != "start":
        return
    _, t0, records, has_foreground = msg
    loop = asyncio.get_running_loop()
    close_bg = asyncio.Event()
    stop = asyncio.Event()
    send_lock = threading.Lock()

    def send(m: tuple) -> None:
        with send_lock:
            conn.send(m)

    def listen() -> None:  # the parent's orders, on a thread (a pipe is not a socket the loop can watch)
        while True:
            try:
                m = conn.recv()
            except (EOFError, OSError):
                loop.call_soon_threadsafe(stop.set)
                return
            loop.call_soon_threadsafe((close_bg if m[0] == "close-bg" else stop).set)
            if m[0] == "stop":
                return

    threading.Thread(target=listen, daemon=True).start()

    async def close_when(foreground: list[asyncio.Task]) -> None:
        await asyncio.gather(*foreground)
        send(("fg-done",))
        await close_bg.wait()

    live = LiveRates({})

    async def report_live() -> None:
        while True:
            await asyncio.sleep(LIVE_EVERY_S)
            send(("live", {u: (live.running[u], live.tokens(u)) for u in set(live.running) | set(live.ended_tokens)}))

    run = asyncio.create_task(driver.run_records(ctx, requests, records, t0, client, live=live, concurrency=cap,
                                                 display=False, close_when=close_when if has_foreground else None))
    reporter = asyncio.create_task(report_live())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([run, stopper], return_when=asyncio.FIRST_COMPLETED)
    if not run.done():
        run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    reporter.cancel()
    stopper.cancel()
    lags = driver.last_probe.lags_ns.tolist() if driver.last_probe is not None else []
    send(("done", [dataclasses.asdict(r) for r in records], lags, driver.last_connections))
