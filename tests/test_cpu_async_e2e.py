"""End to end on CPU: cpu-tiny's "async" engine really runs asynchronous scheduling.

Two real patched servers, one after the other, as ``ratebench run`` builds them from
the cpu-tiny profile: ``patched-sync`` (vLLM as installed) and ``patched-async``
(through ratebench's CPU async overlay, ratebench/cpu_async.py). The same seeded
greedy requests go to both. The test fails if the async engine silently runs the
synchronous scheduler: the overlay's counts from inside the engine core (AsyncScheduler,
``step_with_batch_queue`` with two batches in flight), the worker's CPU async outputs,
and the event file's header (``async_scheduling`` as the scheduler ran, and
``cpu_async_overlay``) must all say so. Then: the tokens are the same, token for token,
and the engine events show the look-ahead step after a stop (one extra dispatch for a
request ended by EOS under async scheduling, none under sync, none for a length finish).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf

import httpx
import pytest

from ratebench import cpu_async
from ratebench.engine import start_engine, uses_cpu_async_overlay
from ratebench.events import FINISH_REASONS, KIND_DISPATCH, KIND_EMIT, KIND_FINISH, read_engine_events
from ratebench.plan import engine_spec
from ratebench.profiles import load_profile

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("patched_vllm", "engine_lock")]

USER = "bulk"  # cpu-tiny: 1,000,000 tok/s, never throttled


def _requests() -> list[tuple[str, str, dict]]:
    """(key, path, body): length finishes (ignore_eos) and EOS stops (chat, after min_tokens)."""
    out = []
    for i in range(4):
        out.append((f"length-{i}", "/v1/completions", {
            "prompt": f"hello {i} world " * (i + 1), "max_tokens": 30 + 7 * i, "ignore_eos": True,
            "temperature": 0, "seed": 1234 + i}))
        out.append((f"stop-{i}", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 200,
            "min_tokens": 5 + 6 * i, "temperature": 0, "seed": 99 + i}))
    return out


def _serve(spec, folder, places: int) -> dict[str, dict]:
    engine = start_engine(spec, folder, timeout_s=300, grace_s=15)
    try:
        def send(item):
            key, path, body = item
            r = httpx.post(engine.endpoint + path, timeout=120, json={
                **body, "model": spec.served_name, "return_token_ids": True,
                "vllm_xargs": {"output_rate_user": USER}})
            r.raise_for_status()
            choice = r.json()["choices"][0]
            return key, {"ids": choice["token_ids"], "finish": choice["finish_reason"]}

        # At most max_num_active_seqs requests at once: every live request is
        # in every step, so the step after the one that sampled a stop already
        # holds the request (with more, the user's streams take the places in
        # turn and a stream that just sampled waits a step: no look-ahead).
        with cf.ThreadPoolExecutor(places) as pool:
            results = dict(pool.map(send, _requests()))
    finally:
        import time

        time.sleep(0.5)  # the engine flushes its events at least every 100 ms
        engine.stop(15)
    return results


def _parity(events) -> list[tuple[str, int]]:
    """(finish reason, dispatch events - emitted tokens) of every finished request."""
    dispatched, emitted, reason = collections.Counter(), collections.Counter(), {}
    for r in events.records:
        req = events.strings[r["req"]]
        if r["kind"] == KIND_DISPATCH:
            dispatched[req] += 1
        elif r["kind"] == KIND_EMIT:
            emitted[req] += int(r["count"])
        elif r["kind"] == KIND_FINISH:
            reason[req] = FINISH_REASONS[int(r["reason"])]
    return [(reason[q], dispatched[q] - emitted[q]) for q in reason]


def test_cpu_tiny_async_engine_runs_async_and_matches_sync(tmp_path, tiny_model):
    profile = load_profile("cpu-tiny")
    specs = {name: engine_spec(profile, name, str(tiny_model), use_patch=True, pristine_files=dict)
             for name in ("patched-sync", "patched-async")}
    assert not uses_cpu_async_overlay(specs["patched-sync"])
    assert uses_cpu_async_overlay(specs["patched-async"])

    places = profile.engine.max_num_active_seqs
    assert places >= 2
    results = {name: _serve(spec, tmp_path / name, places) for name, spec in specs.items()}

    # The async engine ran asynchronously: from inside the engine core and the worker.
    stats = cpu_async.read_stats(tmp_path / "patched-async" / "cpu-async" / "stats")
    assert cpu_async.stats_problems(stats) == [], stats
    core = stats["core"][0]
    assert core["scheduler_cls"] == "AsyncScheduler" and core["batch_queue_size"] == 2
    assert stats["max_in_flight"] == 2 and stats["full_queue"] >= 10
    assert stats["cpu_async_outputs"] >= 10
    log = (tmp_path / "patched-async" / "engine.log").read_text(errors="replace")
    assert f"{cpu_async.LOG_PREFIX} step_with_batch_queue has 2 batches in flight" in log
    # ... and says so in its event file; the sync engine neither.
    meta = {n: read_engine_events(tmp_path / n / "events.rbev").meta for n in specs}
    assert meta["patched-async"]["async_scheduling"] is True
    assert meta["patched-async"]["cpu_async_overlay"] == cpu_async.OVERLAY_NAME
    assert meta["patched-sync"]["async_scheduling"] is False
    assert "cpu_async_overlay" not in meta["patched-sync"]
    assert not (tmp_path / "patched-sync" / "cpu-async").exists()

    # Token for token the same, and the finishes asked for.
    assert results["patched-async"] == results["patched-sync"]
    for key, got in results["patched-sync"].items():
        assert got["finish"] == key.split("-")[0], (key, got)

    # Charge parity: the look-ahead step after a stop (async only), nothing extra for a length finish.
    parity = {n: _parity(read_engine_events(tmp_path / n / "events.rbev")) for n in specs}
    assert sorted(r for r, _ in parity["patched-sync"]) == ["length"] * 4 + ["stop"] * 4
    assert all(excess == 0 for _, excess in parity["patched-sync"])
    assert all(excess == 0 for r, excess in parity["patched-async"] if r == "length")
    stop_excess = [excess for r, excess in parity["patched-async"] if r == "stop"]
    # Every live request is in every step (no more requests than places): each stop
    # had its look-ahead step dispatched.
    assert stop_excess == [1, 1, 1, 1], parity["patched-async"]
