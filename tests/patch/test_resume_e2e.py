"""End to end on CPU: answers of throttled requests that gave their slot resume intact.

A throttled resident that gives its resident slot to a user with budget keeps its KV blocks
and computed tokens out of the model runner, and resumes where it was (no recompute): the
model runner gets it back as a request resumed from preemption, with the blocks it kept.
Greedy answers resumed that way must be token for token what the same prompts get alone.
The real patched engine on the tiny model, real HTTP.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import numpy as np
import pytest

from conftest import patched_tiny_spec
from ratebench.engine import start_engine
from ratebench.events import read_engine_events

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("patched_vllm", "engine_lock")]

PROMPTS = [
    "Rate limits in a shared scheduler keep one user from",
    "The engine parks a throttled request and resumes it when",
]
MAX_TOKENS = 24


async def _complete(client: httpx.AsyncClient, base: str, user: str, prompt: str, max_tokens: int) -> list[int]:
    body = {
        "model": "tiny-qwen3",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "vllm_xargs": {"output_rate_user": user},
    }
    r = await client.post(base + "/v1/completions", json=body,
                          headers={"X-Request-Id": f"rb-{uuid.uuid4().hex[:12]}"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length", choice
    return list(choice["token_ids"])


def test_answers_resumed_after_giving_a_slot_away_are_the_answers_alone(tmp_path, tiny_model):
    # two slots: the throttled user's two answers fill them, so each request of user b takes the slot
    # of one of them (the one whose turn is furthest)
    spec = patched_tiny_spec(tiny_model, ["--max-model-len", "2048", "--max-num-seqs", "2",
                                          "--max-num-active-seqs", "2", "--enforce-eager", "--block-size", "32",
                                          "--num-gpu-blocks-override", "256"], 1000, {"slow": 8})
    engine = start_engine(spec, tmp_path / "engine", timeout_s=600)
    try:

        async def drive():
            async with httpx.AsyncClient(timeout=120) as client:
                alone = [await _complete(client, engine.endpoint, "ref", p, MAX_TOKENS) for p in PROMPTS]
                throttled = [asyncio.create_task(_complete(client, engine.endpoint, "slow", p, MAX_TOKENS))
                             for p in PROMPTS]
                await asyncio.sleep(0.5)  # both resident and throttled (8 tok/s: 3 s for 24 tokens each)
                t0 = asyncio.get_running_loop().time()
                while not all(t.done() for t in throttled):
                    await _complete(client, engine.endpoint, "b", "A neighbour with budget", 3)
                    await asyncio.sleep(0.1)
                    assert asyncio.get_running_loop().time() - t0 < 60
                return alone, [t.result() for t in throttled]

        alone, resumed = asyncio.run(drive())
    finally:
        engine.stop()

    steps = read_engine_events(engine.events_path).steps
    yielded = int(np.asarray(steps["yielded"]).sum())
    assert yielded >= 4, f"the throttled answers gave their slots {yielded} times"
    for prompt, a, r in zip(PROMPTS, alone, resumed):
        assert len(r) == MAX_TOKENS
        assert r == a, f"{prompt!r}: resumed {r} against alone {a}"
