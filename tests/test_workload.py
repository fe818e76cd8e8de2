"""The workload driver against a scripted server (httpx.MockTransport): no engine needed.

The driver against a real engine is covered by tests/test_run_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

import httpx
import pytest

from ratebench.runrecords import client_id_of
from ratebench.workload import Driver, PhaseContext, StreamRequest, request_body

CTX = PhaseContext(scenario="sc", phase="ph", engine="patched-sync", endpoint="http://engine", model="tiny-qwen3")


def sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


def chunk(total: int, text: str = "x", finish: str | None = None) -> bytes:
    return sse({"choices": [{"index": 0, "text": text, "finish_reason": finish}],
                "usage": {"prompt_tokens": 7, "completion_tokens": total, "total_tokens": 7 + total}})


def final(total: int) -> bytes:
    return sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": total, "total_tokens": 7 + total}})


def server(stream_of: Callable[[httpx.Request], AsyncIterator[bytes]], seen: list | None = None,
           status: int = 200) -> httpx.MockTransport:
    async def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "bad request"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream_of(request))

    return httpx.MockTransport(handler)


def run(driver: Driver, requests: list[StreamRequest], **kw):
    return asyncio.run(driver.run_phase(CTX, requests, **kw))


def test_every_chunk_counts_the_tokens_of_its_usage_delta() -> None:
    async def stream(_req):
        yield chunk(1)
        yield chunk(3)  # two tokens coalesced into one chunk
        yield chunk(4, finish="length")
        yield final(4)
        yield sse("[DONE]")

    seen: list[httpx.Request] = []
    driver = Driver("ab12", live=False, transport=server(stream, seen))
    (rec,) = run(driver, [StreamRequest(user="user-a", prompt=[1, 2, 3], max_tokens=4)])
    assert rec.chunk_tokens == [1, 2, 1]
    assert rec.completion_tokens == 4 and rec.streamed_tokens == 4
    assert rec.finish_reason == "length" and rec.error is None and not rec.cancelled
    assert rec.prompt_tokens == 7 and rec.http_status == 200
    assert rec.sent_ns <= rec.first_token_ns == rec.chunk_ns[0] <= rec.chunk_ns[-1] <= rec.done_ns
    assert (rec.scenario, rec.phase, rec.engine, rec.user) == ("sc", "ph", "patched-sync", "user-a")
    assert seen[0].headers["X-Request-Id"] == rec.client_id == "rb-ab12-0"
    body = json.loads(seen[0].content)
    assert body["vllm_xargs"] == {"output_rate_user": "user-a"}
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 4 and body["prompt"] == [1, 2, 3]
    assert seen[0].url.path == "/v1/completions"


def choice_chunk(index: int, total: int, ids: list[int], finish: str | None = None) -> bytes:
    """A chunk of one answer of a request of n > 1, as vLLM streams it: its usage counts that answer's tokens."""
    return sse({"choices": [{"index": index, "text": "x", "finish_reason": finish, "token_ids": ids}],
                "usage": {"prompt_tokens": 4, "completion_tokens": total, "total_tokens": 4 + total}})


def test_a_request_of_several_answers_counts_each_answers_tokens() -> None:
    """n = 2 as vLLM 0.32.0 streams it (seen on the CPU engine): the answers' chunks alternate, each chunk's
    usage.completion_tokens counts its own answer (1, 1, 2, 2, ...) and the final usage their sum. Read as
    one answer, the second answer's chunks added nothing (its count never passed the first's) and the
    request streamed 3 tokens of 6."""
    async def stream(_req):
        yield choice_chunk(0, 1, [10])
        yield choice_chunk(1, 1, [20])
        yield choice_chunk(0, 2, [11])
        yield choice_chunk(1, 2, [21])
        yield choice_chunk(0, 3, [12], finish="length")
        yield choice_chunk(1, 3, [22], finish="length")
        yield final(6)
        yield sse("[DONE]")

    seen: list[httpx.Request] = []
    driver = Driver("ab12", live=False, transport=server(stream, seen))
    (rec,) = run(driver, [StreamRequest(user="u", prompt=[1], max_tokens=3, stream_index=2, extra_body={"n": 2})])
    assert json.loads(seen[0].content)["n"] == 2
    assert rec.chunk_tokens == [1] * 6 and rec.streamed_tokens == rec.completion_tokens == 6
    assert rec.token_ids is None
    assert [(c["index"], c["chunk_tokens"], c["completion_tokens"], c["token_ids"], c["finish_reason"])
            for c in rec.choices] == [(0, [1, 1, 1], 3, [10, 11, 12], "length"),
                                      (1, [1, 1, 1], 3, [20, 21, 22], "length")]
    a, b = rec.answers()
    assert (a.client_id, b.client_id) == ("rb-ab12-0/0", "rb-ab12-0/1")
    assert (a.stream_index, b.stream_index) == (2000, 2001)
    assert a.chunk_ns == rec.chunk_ns[0::2] and b.chunk_ns == rec.chunk_ns[1::2]
    assert a.first_token_ns == rec.first_token_ns < b.first_token_ns
    assert (a.completion_tokens, b.token_ids, a.error, a.choices) == (3, [20, 21, 22], None, None)
    for i, answer in enumerate((a, b)):  # each answer joins its engine request, vLLM's <index>_<id>
        assert client_id_of(f"{i}_cmpl-rb-ab12-0-0-1a2b3c4d") == answer.client_id
    # a final usage that is not the answers' sum is an error on every answer (reconciliation fails them)
    rec.completion_tokens = 7
    assert all("not the sum" in r.error for r in rec.answers())
    plain = run(Driver("ab12", live=False, transport=server(lambda _r: _one_answer())),
                [StreamRequest(user="u", prompt=[1], max_tokens=1)])[0]
    assert plain.choices is None and plain.answers() == [plain]


async def _one_answer():
    yield chunk(1, finish="length")
    yield final(1)
    yield sse("[DONE]")


def test_an_event_split_across_socket_reads_is_put_together() -> None:
    async def stream(_req):
        whole = chunk(1) + chunk(2, finish="stop") + final(2) + sse("[DONE]")
        for i in range(0, len(whole), 7):
            yield whole[i:i + 7]

    driver = Driver("ab12", live=False, transport=server(stream))
    (rec,) = run(driver, [StreamRequest(user="u", prompt="hi", max_tokens=8, ignore_eos=False)])
    assert rec.chunk_tokens == [1, 1] and rec.completion_tokens == 2 and rec.finish_reason == "stop"


def test_request_without_user_leaves_the_field_out_and_sends_the_openai_user() -> None:
    body = request_body("m", StreamRequest(user=None, prompt="hello", max_tokens=3, api="chat",
                                           openai_user="user-b"))
    assert "vllm_xargs" not in body
    assert body["user"] == "user-b"
    assert body["messages"] == [{"role": "user", "content": "hello"}]


def test_chat_requests_go_to_chat_completions() -> None:
    async def stream(_req):
        yield sse({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})
        yield final(1)
        yield sse("[DONE]")

    seen: list[httpx.Request] = []
    driver = Driver("ab12", live=False, transport=server(stream, seen))
    (rec,) = run(driver, [StreamRequest(user="u", prompt="hi", max_tokens=8, api="chat", ignore_eos=False)])
    assert seen[0].url.path == "/v1/chat/completions"
    assert rec.api == "chat" and rec.completion_tokens == 1 and rec.finish_reason == "stop"


async def endless(_req):
    n = 0
    while True:
        n += 1
        yield chunk(n)
        await asyncio.sleep(0.01)


def test_stream_closed_after_k_tokens_is_marked_cancelled() -> None:
    driver = Driver("ab12", live=False, transport=server(endless))
    (rec,) = run(driver, [StreamRequest(user="u", prompt=[1], max_tokens=1000, cancel_after_tokens=5)])
    assert rec.cancelled and rec.cancel_ns is not None
    assert rec.streamed_tokens == 5 and rec.completion_tokens is None and rec.finish_reason is None
    assert rec.error is None


def test_stream_closed_after_t_seconds_is_marked_cancelled() -> None:
    driver = Driver("ab12", live=False, transport=server(endless))
    (rec,) = run(driver, [StreamRequest(user="u", prompt=[1], max_tokens=1000, cancel_after_s=0.2)])
    assert rec.cancelled and rec.cancel_ns >= rec.sent_ns + 150_000_000
    assert rec.streamed_tokens > 0 and rec.error is None


def test_background_streams_close_when_the_foreground_ones_end() -> None:
    async def stream(req):
        body = json.loads(req.content)
        if body["max_tokens"] == 1000:
            async for part in endless(req):
                yield part
        else:
            for n in range(1, 4):
                yield chunk(n)
                await asyncio.sleep(0.02)
            yield final(3)
            yield sse("[DONE]")

    driver = Driver("ab12", live=False, transport=server(stream))
    recs = run(driver, [
        StreamRequest(user="slow", prompt=[1], max_tokens=1000, background=True),
        StreamRequest(user="slow", prompt=[1], max_tokens=1000, background=True, stream_index=1),
        StreamRequest(user="fast", prompt=[1], max_tokens=3, delay_s=0.05, stream_index=2),
    ])
    slow, fast = recs[:2], recs[2]
    assert fast.completion_tokens == 3 and not fast.cancelled
    assert all(r.cancelled and r.cancel_ns >= fast.done_ns and r.error is None for r in slow)
    assert [r.client_id for r in recs] == ["rb-ab12-0", "rb-ab12-1", "rb-ab12-2"]
    assert driver.records == recs


def test_concurrency_caps_the_streams_in_flight() -> None:
    async def stream(_req):
        for n in range(1, 3):
            yield chunk(n)
            await asyncio.sleep(0.02)
        yield final(2)
        yield sse("[DONE]")

    driver = Driver("ab12", live=False, transport=server(stream))
    recs = run(driver, [StreamRequest(user="u", prompt=[1], max_tokens=2, stream_index=i) for i in range(6)],
               concurrency=2)
    assert all(r.completion_tokens == 2 for r in recs)
    most = max(sum(1 for o in recs if o.sent_ns <= r.sent_ns < o.done_ns) for r in recs)
    assert most == 2


def test_http_error_is_recorded_not_raised() -> None:
    driver = Driver("ab12", live=False, transport=server(endless, status=400))
    (rec,) = run(driver, [StreamRequest(user="u", prompt=[1], max_tokens=5)])
    assert rec.http_status == 400 and "HTTP 400" in rec.error and "bad request" in rec.error
    assert rec.chunk_tokens == [] and rec.completion_tokens is None


def test_error_event_in_the_stream_is_recorded() -> None:
    async def stream(_req):
        yield chunk(1)
        yield sse({"error": {"message": "engine dead", "type": "InternalServerError"}})
        yield sse("[DONE]")

    driver = Driver("ab12", live=False, transport=server(stream))
    (rec,) = run(driver, [StreamRequest(user="u", prompt=[1], max_tokens=5)])
    assert rec.error == "engine dead" and rec.streamed_tokens == 1


def test_an_interrupted_phase_marks_its_streams_and_propagates() -> None:
    driver = Driver("ab12", live=False, transport=server(endless))

    async def main():
        task = asyncio.create_task(driver.run_phase(CTX, [StreamRequest(user="u", prompt=[1], max_tokens=1000)]))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    (rec,) = driver.records
    assert rec.cancelled and rec.error == "interrupted"


def test_client_ids_are_found_inside_engine_request_ids() -> None:
    driver = Driver("0a1b2c3d", live=False)
    cid = driver.next_client_id()
    assert cid == "rb-0a1b2c3d-0"
    for engine_id in (f"cmpl-{cid}-0-1a2b3c4d", f"chatcmpl-{cid}-1a2b3c4d"):
        assert client_id_of(engine_id) == cid


def test_a_users_next_phase_on_an_engine_waits_until_its_burst_is_full_again(monkeypatch) -> None:
    """GCRA's TAT runs at most burst + 1/N ahead of a user's last charge: a phase of the same user
    on the same engine starts only after that (plus a margin), so every phase starts with the whole
    burst the rate figures assume. Other engines and users without a limit do not wait."""
    import time

    from ratebench.profiles import load_profile
    from ratebench.scenarios import base
    from ratebench.scenarios import EngineRef, ScenarioContext

    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(base.asyncio, "sleep", fake_sleep)
    profile = load_profile("cpu-tiny")
    driver = Driver("t")
    ctx = ScenarioContext(profile=profile, spec=profile.scenarios[0], driver=driver, on_phase=lambda r: None)
    engine = EngineRef(name="patched-sync", endpoint="http://e1", model="m", feature=True, kind="patched")
    driver.user_last_phase_end_ns[("http://e1", "user-a")] = time.monotonic_ns()
    asyncio.run(ctx._until_bursts_are_full(engine, {"user-a": 20, "user-b": 100}))
    # user-a at 20 tok/s: 100 ms burst + 50 ms (one token) + 100 ms margin, minus the time spent here
    assert len(slept) == 1 and 0.2 < slept[0] <= 0.25
    slept.clear()
    other = EngineRef(name="stock-sync", endpoint="http://e2", model="m", feature=False, kind="stock")
    asyncio.run(ctx._until_bursts_are_full(other, {"user-a": None}))
    asyncio.run(ctx._until_bursts_are_full(engine, {"user-b": 100}))  # user-b had no phase there
    assert slept == []
