"""End to end on CPU: a real patched vLLM server on the tiny model, real HTTP streams.

One user limited to 20 tok/s streams with four streams beside a user at 100 tok/s.
The engine's dispatch events must hold the bound exactly, the user must get close
to 20 tok/s, every stream must complete, and the engine's event file must agree
with what the client counted. Beam search is refused with HTTP 400.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import numpy as np
import pytest

from ratebench.analysis import check_bound, rate_figures
from conftest import patched_tiny_spec
from ratebench.engine import start_engine
from ratebench.events import KIND_DISPATCH, KIND_EMIT, KIND_FINISH, read_engine_events
from ratebench.runrecords import client_id_of

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("patched_vllm", "engine_lock")]

LIMITS = {"user-a": 20, "user-b": 100}
MAX_TOKENS = {"user-a": 50, "user-b": 200}
STREAMS = {"user-a": 4, "user-b": 1}


async def _stream(client: httpx.AsyncClient, base: str, user: str, client_id: str, chat: bool) -> dict:
    body = {
        "model": "tiny-qwen3",
        "max_tokens": MAX_TOKENS[user],
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "vllm_xargs": {"output_rate_user": user},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": "Tell me about rate limits."}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = "Rate limits in a shared scheduler"
        path = "/v1/completions"
    streamed, last_cumulative, usage, finish = 0, 0, None, None
    async with client.stream("POST", base + path, json=body, headers={"X-Request-Id": client_id}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cumulative = chunk["usage"]["completion_tokens"]
                streamed += cumulative - last_cumulative
                last_cumulative = cumulative
                usage = cumulative
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
    return {"user": user, "client_id": client_id, "streamed": streamed, "usage": usage, "finish": finish}


def test_patched_server_limits_one_user_with_four_streams(tmp_path, tiny_model):
    spec = patched_tiny_spec(tiny_model, ["--max-model-len", "2048", "--max-num-seqs", "16", "--enforce-eager"],
                             100, {"user-a": LIMITS["user-a"], "user-b": LIMITS["user-b"]})
    engine = start_engine(spec, tmp_path / "engine", timeout_s=600)
    run = uuid.uuid4().hex[:8]
    try:

        async def drive():
            async with httpx.AsyncClient(timeout=120) as client:
                jobs, n = [], 0
                for user, count in STREAMS.items():
                    for i in range(count):
                        n += 1
                        jobs.append(_stream(client, engine.endpoint, user, f"rb-{run}-{n}", chat=i % 2 == 1))
                results = await asyncio.gather(*jobs)
                beam = await client.post(
                    engine.endpoint + "/v1/completions",
                    json={"model": "tiny-qwen3", "prompt": "x", "max_tokens": 4,
                          "use_beam_search": True, "n": 2},
                )
                return results, beam

        results, beam = asyncio.run(drive())
    finally:
        engine.stop()

    assert beam.status_code == 400 and "Beam search" in beam.text
    for r in results:
        assert r["finish"] == "length", r
        assert r["usage"] == r["streamed"] == MAX_TOKENS[r["user"]], r

    events = read_engine_events(engine.events_path)
    rec = events.records
    by_client = {}
    for i, req in enumerate(rec["req"]):
        by_client.setdefault(client_id_of(events.strings[req]), []).append(i)
    for r in results:
        mine = rec[by_client[r["client_id"]]]
        assert (mine["kind"] == KIND_DISPATCH).sum() == r["usage"]
        assert mine["count"][mine["kind"] == KIND_EMIT].sum() == r["usage"]
        finish = mine[mine["kind"] == KIND_FINISH]
        assert len(finish) == 1 and finish["count"][0] == r["usage"]

    for user, limit in LIMITS.items():
        u = events.string_index(user)
        t_ns = np.sort(rec["t_ns"][(rec["user"] == u) & (rec["kind"] == KIND_DISPATCH)])
        bound = check_bound(t_ns, limit_tps=limit)
        assert bound.passed, (user, bound)
        rates = rate_figures(t_ns, None, limit)
        print(f"{user}: limit {limit} tok/s, seed-method rate {rates.seed_rate_tps:.2f}, "
              f"steady {rates.steady_rate_tps}, worst-window slack {bound.worst}")
        # The seed's method (tokens over first-to-last span T) may exceed N by at most
        # the burst spread over T; the steady rate (after the burst) is N, since the
        # engine can serve far more than 100 tok/s here.
        span_s = (int(t_ns[-1]) - int(t_ns[0])) / 1e9
        assert rates.seed_rate_tps <= limit + (0.1 * limit + 1) / span_s + 1e-6 * limit
        # Below N only by what an engine stall explains: a 2-core machine now and then holds the
        # engine ~70 ms (96.8 tok/s once at 100, in CI). A limiter that under-delivers evenly
        # (every gap a little long) has no such stall and still fails.
        stall_s = max(0.0, float(np.diff(t_ns).max()) / 1e9 - 1 / limit)
        assert (0.97 - stall_s / span_s) * limit <= rates.steady_rate_tps <= 1.01 * limit, \
            (user, rates, stall_s)
