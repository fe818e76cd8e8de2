"""Benchmark: what ratebench's streaming client costs, against a plain aiohttp client.

    flock /tmp/ratebench-engine.lock .venv/bin/python benchmarks/client_cost.py [--streams 16,64,256] [--rounds 3]
    .venv/bin/python benchmarks/client_cost.py --server fake [--step-ms 10]    # no engine
    .venv/bin/python benchmarks/client_cost.py --endpoint http://127.0.0.1:8000 --model NAME

The same closed-loop workload twice per round, interleaved (the order alternates from
round to round): N streams kept open, each request 16 prompt tokens and 128 output tokens
with ``ignore_eos``, streamed with ``include_usage`` and ``continuous_usage_stats``, as user
``bulk`` (cpu-tiny's user whose limit is far above what the engine produces: the limiter
is on and never binds), ``--per-stream`` requests per stream in all. Once by ratebench's
own client (``Driver.run_phase`` with its live display rendering to a terminal that is
thrown away), once by a plain aiohttp client written like vLLM's benchmark client
(``benchmarks/backend_request_func.py``: one session, ``async for`` over the response
content, strip ``data: ``, ``json.loads`` every chunk, a timestamp per token). Each client
runs in its own subprocess, whose CPU time (``time.process_time()``: user + system of
every thread of that process) over the workload is the client's cost.

Prints, per stream count, the median and the range over rounds of: each client's CPU
milliseconds per 1,000 tokens, the server's throughput while that client drove it
(tokens / (last token - first request)), and the ratios ratebench / peer of both; and,
for ratebench, its event-loop lag (``Driver.last_loop_lag``: how late a 10 ms sleep
wakes, p50 / p99 / max over the phase, the delay every chunk's timestamp can carry) and
whether every record's chunk timestamps are intact (one per token, in order, between
sent and done). ``--json PATH`` writes every round.

The server: by default the patched engine of cpu-tiny (``patched-sync``, events off,
``--max-num-seqs`` = the largest stream count so every stream runs, a KV cache that holds
them all), started once; run it under ``flock /tmp/ratebench-engine.lock``. ``--server
fake``: ``benchmarks/fake_sse_server.py`` in its own process, vLLM-shaped chunks, one token
per stream every ``--step-ms``. ``--endpoint``: a server someone else started.
Figures: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a child measuring another checkout's client (--before) imports ratebench from there
sys.path.insert(0, os.environ.get("CLIENT_COST_RATEBENCH_ROOT") or str(ROOT))

MAX_TOKENS = 128
PROMPT_TOKENS = 16
USER = "bulk"
CLIENTS = ("ratebench", "peer")
BEFORE = "before"  # ratebench's client from another checkout (--before), run like "ratebench"


def prompt_ids(i: int) -> list[int]:
    """16 token ids, unique per request (no prefix-cache hits between requests)."""
    return [100 + (i * 7 + k * 13) % 1400 for k in range(PROMPT_TOKENS)]  # the tiny model has 1,560 ids


# --- the clients (each runs in a child process: `client_cost.py --client NAME ...`) -------------------------

async def run_ratebench(endpoint: str, model: str, streams: int, requests: int, workers: int = 1) -> dict:
    import resource

    from rich.console import Console

    from ratebench.workload import Driver, PhaseContext, StreamRequest

    # the live display renders as in a terminal, into a buffer nobody reads
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    driver = Driver("c0ffee", console=console, live=True, **({"workers": workers} if workers > 1 else {}))
    ctx = PhaseContext(scenario="client-cost", phase=f"{streams}-streams", engine="bench", endpoint=endpoint,
                       model=model)
    reqs = [StreamRequest(user=USER, prompt=prompt_ids(i), max_tokens=MAX_TOKENS, prompt_tokens=PROMPT_TOKENS,
                          loop_group="bench", loop_streams=streams) for i in range(requests)]
    def cpu_s() -> float:  # this process, and its driver workers once they have ended
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + kids.ru_utime + kids.ru_stime

    cpu0, t0 = cpu_s(), time.monotonic_ns()
    records = await driver.run_phase(ctx, reqs, limits={USER: None})
    cpu1 = cpu_s()
    tokens = sum(r.streamed_tokens for r in records)
    first = min(r.sent_ns for r in records if r.sent_ns is not None)
    last = max(r.chunk_ns[-1] for r in records if len(r.chunk_ns))
    bad = [r.client_id for r in records if not timestamps_intact(r)]
    return {"cpu_s": cpu1 - cpu0, "tokens": tokens, "span_s": (last - first) / 1e9,
            "wall_s": (time.monotonic_ns() - t0) / 1e9, "errors": sum(r.error is not None for r in records),
            "timestamps_bad": len(bad), "loop_lag": getattr(driver, "last_loop_lag", None)}


def timestamps_intact(r) -> bool:
    """One timestamp per chunk, the tokens adding up to the final usage, in order, between sent and done."""
    t = list(r.chunk_ns)
    return (r.error is None and len(t) == len(r.chunk_tokens) and sum(r.chunk_tokens) == r.completion_tokens
            == MAX_TOKENS and all(a <= b for a, b in zip(t, t[1:])) and r.sent_ns <= t[0] and t[-1] <= r.done_ns)


async def run_peer(endpoint: str, model: str, streams: int, requests: int) -> dict:
    """A plain aiohttp client written like vLLM's benchmark client, closed loop."""
    import aiohttp

    url = endpoint + "/v1/completions"
    counter = iter(range(requests))
    outputs: list[dict] = []

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        payload = {"model": model, "prompt": prompt_ids(i), "max_tokens": MAX_TOKENS, "stream": True,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                   "ignore_eos": True, "temperature": 1.0, "vllm_xargs": {"output_rate_user": USER}}
        out = {"itl": [], "ttft": 0.0, "output_tokens": 0, "generated_text": "", "error": None}
        st = time.perf_counter()
        most_recent = st
        async with session.post(url=url, json=payload, headers={"X-Request-Id": f"peer-{i}"}) as response:
            if response.status != 200:
                out["error"] = response.reason
            else:
                first = False
                async for chunk_bytes in response.content:
                    chunk_bytes = chunk_bytes.strip()
                    if not chunk_bytes:
                        continue
                    chunk = chunk_bytes.decode("utf-8").removeprefix("data: ")
                    if chunk != "[DONE]":
                        data = json.loads(chunk)
                        if choices := data.get("choices"):
                            text = choices[0].get("text")
                            timestamp = time.perf_counter()
                            if not first:
                                first = True
                                out["ttft"] = timestamp - st
                            else:
                                out["itl"].append(timestamp - most_recent)
                            most_recent = timestamp
                            out["generated_text"] += text or ""
                        if usage := data.get("usage"):
                            out["output_tokens"] = usage.get("completion_tokens")
        out["done"] = time.perf_counter()
        out["start"] = st
        outputs.append(out)

    async def loop(session: aiohttp.ClientSession) -> None:
        for i in counter:
            await one(session, i)

    cpu0, t0 = time.process_time(), time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=6 * 60 * 60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=streams)) as session:
        await asyncio.gather(*(loop(session) for _ in range(streams)))
    cpu1 = time.process_time()
    tokens = sum(o["output_tokens"] or 0 for o in outputs)
    first = min(o["start"] for o in outputs)
    last = max(o["done"] for o in outputs)
    return {"cpu_s": cpu1 - cpu0, "tokens": tokens, "span_s": last - first, "wall_s": time.perf_counter() - t0,
            "errors": sum(o["error"] is not None or o["output_tokens"] != MAX_TOKENS for o in outputs)}


def child(args: argparse.Namespace) -> None:
    if args.client == "peer":
        result = asyncio.run(run_peer(args.endpoint, args.model, args.streams_one, args.requests))
    else:
        result = asyncio.run(run_ratebench(args.endpoint, args.model, args.streams_one, args.requests, args.workers))
    print(json.dumps(result))


# --- the servers ---------------------------------------------------------------------------------------------

def wait_health(endpoint: str, timeout_s: float = 30.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(endpoint + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{endpoint}: no answer to /health within {timeout_s:.0f} s")
        time.sleep(0.2)


def start_fake(step_ms: float) -> tuple[subprocess.Popen, str]:
    from ratebench.engine import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "fake_sse_server.py"), "--port", str(port),
                             "--step-ms", str(step_ms)])
    endpoint = f"http://127.0.0.1:{port}"
    wait_health(endpoint)
    return proc, endpoint


def start_patched_engine(max_num_seqs: int, folder: Path):
    from ratebench.engine import start_engine
    from ratebench.plan import engine_spec
    from ratebench.profiles import load_profile
    from ratebench.tinymodel import ensure_tiny_model

    profile = load_profile("cpu-tiny")
    spec = engine_spec(profile, "patched-sync", str(ensure_tiny_model()), use_patch=True, pristine_files=dict)
    spec.record_events = False
    flags = spec.flags
    for flag, value in (("--max-num-seqs", max_num_seqs), ("--max-num-active-seqs", max_num_seqs),
                        ("--max-num-batched-tokens", max(max_num_seqs, 256)),
                        # every stream's KV at once: N x (16 + 128) tokens, in blocks of 32
                        ("--num-gpu-blocks-override", max(256, max_num_seqs * 5 + 64))):
        flags[flags.index(flag) + 1] = str(value)
    engine = start_engine(spec, folder, timeout_s=profile.startup_timeout_s, grace_s=profile.shutdown_grace_s)
    return engine, spec


# --- the comparison ------------------------------------------------------------------------------------------

def run_client(name: str, endpoint: str, model: str, streams: int, requests: int, before: Path | None = None,
               workers: int = 1) -> dict:
    env = dict(os.environ)
    env.pop("CLIENT_COST_RATEBENCH_ROOT", None)
    if name == BEFORE:
        env["CLIENT_COST_RATEBENCH_ROOT"] = str(before)
    out = subprocess.run([sys.executable, __file__, "--client", name, "--endpoint", endpoint, "--model", model,
                          "--streams-one", str(streams), "--requests", str(requests),
                          "--workers", str(workers if name == "ratebench" else 1)],
                         capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{name} client failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def compare(endpoint: str, model: str, stream_counts: list[int], rounds: int, per_stream: int,
            before: Path | None = None, workers: int = 1) -> list[dict]:
    # warm-up: the server's first requests (and the machine's caches) belong to no round
    run_client("peer", endpoint, model, min(stream_counts), min(stream_counts))
    rows = []
    for n in stream_counts:
        requests = max(per_stream * n, 64)
        for k in range(rounds):
            clients = CLIENTS + ((BEFORE,) if before else ())
            order = clients[k % len(clients):] + clients[:k % len(clients)]  # rotating
            for name in order:
                r = run_client(name, endpoint, model, n, requests, before, workers)
                r.update(client=name, streams=n, round=k, requests=requests,
                         cpu_ms_per_1k=1e6 * r["cpu_s"] / max(r["tokens"], 1), tps=r["tokens"] / r["span_s"])
                rows.append(r)
                lag = r.get("loop_lag") or {}
                print(f"  {n:>4} streams round {k} {name:<9}: {r['cpu_ms_per_1k']:6.1f} ms CPU / 1k tokens, "
                      f"{r['tps']:7.0f} tok/s, {r['tokens']} tokens, errors {r['errors']}"
                      + (f", lag p99 {lag.get('p99_ms')} ms" if lag else ""), flush=True)
    return rows


def summarize(rows: list[dict], stream_counts: list[int], title: str = "ratebench") -> None:
    print()
    print(f"{title}:")
    print(f"streams | CPU ms / 1k tokens: {title:<9}   peer        ratio      | server tok/s: {title:<9}     peer"
          "          ratio      | ratebench loop lag p99 ms, max ms | timestamps")
    for n in stream_counts:
        rb = [r for r in rows if r["streams"] == n and r["client"] == title]
        pe = [r for r in rows if r["streams"] == n and r["client"] == "peer"]
        cpu_ratio = [a["cpu_ms_per_1k"] / b["cpu_ms_per_1k"] for a, b in zip(rb, pe)]
        tps_ratio = [a["tps"] / b["tps"] for a, b in zip(rb, pe)]
        lags = [r["loop_lag"] for r in rb if r.get("loop_lag")]
        lag = (spread([x["p99_ms"] for x in lags], "{:.1f}") + ", " + spread([x["max_ms"] for x in lags], "{:.1f}")
               if lags else "-")
        bad = sum(r["timestamps_bad"] for r in rb)
        print(f"{n:>7} | {spread([r['cpu_ms_per_1k'] for r in rb]):>16} {spread([r['cpu_ms_per_1k'] for r in pe]):>13}"
              f" {spread(cpu_ratio, '{:.2f}'):>16} | {spread([r['tps'] for r in rb]):>20}"
              f" {spread([r['tps'] for r in pe]):>17} {spread(tps_ratio, '{:.2f}'):>16} | {lag:>33} |"
              f" {'intact' if bad == 0 else f'{bad} records not intact'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="16,64,256", help="stream counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-stream", type=int, default=2, help="requests per stream in a round (64 at the least)")
    ap.add_argument("--server", choices=("engine", "fake"), default="engine")
    ap.add_argument("--step-ms", type=float, default=10.0, help="--server fake: one token per stream every step")
    ap.add_argument("--endpoint", help="a running server (not started here)")
    ap.add_argument("--model", default="tiny-qwen3", help="the served model name (with --endpoint)")
    ap.add_argument("--json", type=Path, help="write every round here")
    ap.add_argument("--workers", type=int, default=1, help="ratebench's client: driver worker processes "
                    "(Driver(workers=K)); its CPU then counts theirs too")
    ap.add_argument("--before", type=Path, help="a third client, interleaved: ratebench's client of another "
                    "checkout (its folder holding ratebench/, e.g. `git archive COMMIT ratebench | tar -x -C DIR`)")
    # a child: one client, one workload
    ap.add_argument("--client", choices=CLIENTS + (BEFORE,), help=argparse.SUPPRESS)
    ap.add_argument("--streams-one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        child(args)
        return
    stream_counts = [int(s) for s in args.streams.split(",")]
    stop = None
    setting: dict = {"workers": args.workers, "streams": stream_counts, "rounds": args.rounds, "per_stream": args.per_stream,
                     "max_tokens": MAX_TOKENS, "prompt_tokens": PROMPT_TOKENS, "cpus": os.cpu_count()}
    if args.endpoint:
        endpoint, model = args.endpoint.rstrip("/"), args.model
        setting["server"] = endpoint
    elif args.server == "fake":
        proc, endpoint = start_fake(args.step_ms)
        model = "tiny-qwen3"
        stop = proc.terminate
        setting["server"] = f"fake, one token per stream every {args.step_ms} ms"
    else:
        folder = Path(tempfile.mkdtemp(prefix="client-cost-"))
        engine, spec = start_patched_engine(max(stream_counts), folder)
        endpoint, model = engine.endpoint, spec.served_name
        stop = engine.stop
        setting["server"] = "cpu-tiny patched-sync " + " ".join(spec.all_flags()[4:])
    print(f"server: {setting['server']}", flush=True)
    try:
        rows = compare(endpoint, model, stream_counts, args.rounds, args.per_stream, args.before, args.workers)
    finally:
        if stop is not None:
            stop()
    summarize(rows, stream_counts)
    if args.before:
        summarize(rows, stream_counts, title=BEFORE)
    if args.json:
        args.json.write_text(json.dumps({"setting": setting, "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
