"""The load profile-scheduler puts on an engine: R streams kept resident, most of them throttled.

``busy`` streams of an unlimited user keep the engine stepping as a loaded engine
does; the rest come from ``profile-u*`` users (``streams_per_user`` each) at the
engine's default rate, so they are throttled nearly all the time. A stream that
ends is sent again, so R stay in the engine until the load is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

BUSY_USER = "profile-busy"


@dataclass
class ResidentLoad:
    client: Any  # the httpx.AsyncClient the streams use (for the gauges)
    streams: int
    throttled: int  # streams of the profile-u* users
    users: int  # profile-u* users
    unlimited: int  # streams of BUSY_USER


async def engine_gauges(client, endpoint: str) -> dict[str, float]:
    """running / waiting gauges of the server's /metrics (empty when unreadable)."""
    out: dict[str, float] = {}
    try:
        r = await client.get(f"{endpoint}/metrics", timeout=5.0)
    except Exception:  # noqa: BLE001 - metrics are informational
        return out
    for line in r.text.splitlines():
        for key in ("running", "waiting"):
            if line.startswith((f"vllm:num_requests_{key}{{", f"vllm:num_requests_{key} ")):
                with contextlib.suppress(ValueError):
                    out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def _stream(client, endpoint: str, body: dict[str, Any]) -> None:
    """One stream, sent again each time it ends, until cancelled (R stays resident)."""
    while True:
        try:
            async with client.stream("POST", f"{endpoint}/v1/completions", json=body) as resp:
                async for _ in resp.aiter_raw():
                    pass
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a failed stream lowers the load; the table says how many were resident
            await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def resident_load(endpoint: str, model: str, r: int, *, busy: int, streams_per_user: int, max_tokens: int,
                        settle_s: float) -> AsyncIterator[ResidentLoad]:
    """R streams open and in the engine (its gauges say so, or 60 s passed), then ``settle_s``;
    on leaving, closes them and waits until the engine has aborted them."""
    import httpx

    from ratebench.workload import StreamRequest, request_body

    throttled = max(0, r - busy)
    users = max(1, -(-throttled // streams_per_user))
    bodies = [request_body(model, StreamRequest(user=BUSY_USER, prompt=f"Busy stream {i}: count on.",
                                                max_tokens=max_tokens)) for i in range(min(busy, r))]
    bodies += [request_body(model, StreamRequest(user=f"profile-u{i % users:05d}", prompt=f"Stream {i}: count on.",
                                                 max_tokens=max_tokens)) for i in range(throttled)]
    limits = httpx.Limits(max_connections=r + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        tasks = [asyncio.create_task(_stream(client, endpoint, b)) for b in bodies]
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                m = await engine_gauges(client, endpoint)
                if m.get("running", 0) + m.get("waiting", 0) >= len(bodies) or not m:
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(settle_s)
            yield ResidentLoad(client, len(bodies), throttled, users, min(busy, r))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # Let the engine abort the closed streams before the next R.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = await engine_gauges(client, endpoint)
            if not m or m.get("running", 0) + m.get("waiting", 0) == 0:
                break
            await asyncio.sleep(0.3)
