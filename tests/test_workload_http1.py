"""The driver over its own HTTP/1.1 client (ratebench.http1) against a scripted server on a real socket.

tests/test_workload.py covers the records through an httpx transport; here the bytes come
off a socket: chunked framing, events split anywhere, keep-alive reuse, closing, errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Awaitable, Callable

from ratebench.workload import Driver, PhaseContext, StreamRequest

Script = Callable[[asyncio.StreamWriter, dict, int], Awaitable[None]]


def sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"


def chunk(total: int, finish: str | None = None) -> bytes:
    return sse({"choices": [{"index": 0, "text": "x", "finish_reason": finish}],
                "usage": {"prompt_tokens": 7, "completion_tokens": total, "total_tokens": 7 + total}})


def final(total: int) -> bytes:
    return sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": total, "total_tokens": 7 + total}})


def whole_stream(n: int) -> list[bytes]:
    return [chunk(k, finish="length" if k == n else None) for k in range(1, n + 1)] + [final(n), sse("[DONE]")]


async def send_chunked(writer: asyncio.StreamWriter, events: list[bytes], pause_s: float = 0.0) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    for e in events:
        writer.write(b"%x\r\n%s\r\n" % (len(e), e))
        await writer.drain()
        if pause_s:
            await asyncio.sleep(pause_s)
    writer.write(b"0\r\n\r\n")
    await writer.drain()


class Server:
    """Counts connections and requests; each request answered by ``script(writer, body, n)``."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[tuple[dict, dict]] = []  # (headers, body)
        self.disconnects = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = json.loads(await reader.readexactly(int(headers["content-length"])))
                self.requests.append((headers, body))
                await self.script(writer, body, len(self.requests))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnects += 1
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(script: Script):
    server = Server(script)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        srv.close()


def phase(endpoint: str, stall_timeout_s: float = 60.0) -> PhaseContext:
    return PhaseContext(scenario="sc", phase="ph", engine="patched-sync", endpoint=endpoint, model="tiny-qwen3",
                        stall_timeout_s=stall_timeout_s)


def run_against(script: Script, requests: list[StreamRequest], stall_timeout_s: float = 60.0, **kw):
    async def main():
        async with serving(script) as (server, endpoint):
            driver = Driver("ab12", live=False)
            recs = await driver.run_phase(phase(endpoint, stall_timeout_s), requests, **kw)
            await asyncio.sleep(0.1)  # the server's next write finds a closed connection
            return server, driver, recs

    return asyncio.run(main())


def test_every_token_is_stamped_off_the_socket_and_connections_are_kept_alive() -> None:
    async def script(writer, body, n):
        await send_chunked(writer, whole_stream(body["max_tokens"]), pause_s=0.002)

    reqs = [StreamRequest(user="u", prompt=[1, 2], max_tokens=5, loop_group="g", loop_streams=2) for _ in range(6)]
    server, driver, recs = run_against(script, reqs)
    for rec in recs:
        assert rec.chunk_tokens == [1] * 5 and rec.completion_tokens == 5 and rec.finish_reason == "length"
        assert rec.error is None and rec.http_status == 200 and rec.prompt_tokens == 7
        assert rec.sent_ns < rec.first_token_ns == rec.chunk_ns[0] < rec.chunk_ns[-1] <= rec.done_ns
        assert type(rec.chunk_ns) is list and type(rec.chunk_tokens) is list  # the JSON format as before
    assert len(server.requests) == 6 and server.connections == driver.last_connections == 2
    headers, body = server.requests[0]
    assert headers["x-request-id"] == recs[0].client_id and body["vllm_xargs"] == {"output_rate_user": "u"}
    assert driver.last_loop_lag is not None and driver.last_loop_lag["samples"] > 0


def test_events_and_chunk_framing_split_anywhere_are_put_together() -> None:
    async def script(writer, body, n):
        raw = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        events = [chunk(1), chunk(3), chunk(4, finish="length").replace(b"\n", b"\r\n"), final(4), sse("[DONE]")]
        raw += b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
        for i in range(len(raw)):
            writer.write(raw[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0)

    server, driver, (rec,) = run_against(script, [StreamRequest(user="u", prompt=[1], max_tokens=4)])
    assert rec.chunk_tokens == [1, 2, 1] and rec.completion_tokens == 4 and rec.error is None


def test_a_refused_request_keeps_the_status_and_the_body() -> None:
    async def script(writer, body, n):
        text = b'{"error": {"message": "bad request"}}'
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text))
        await writer.drain()

    server, driver, (rec,) = run_against(script, [StreamRequest(user="u", prompt=[1], max_tokens=4)])
    assert rec.http_status == 400 and rec.error.startswith("HTTP 400") and "bad request" in rec.error
    assert rec.chunk_tokens == [] and rec.done_ns is not None


def test_closing_after_k_tokens_drops_the_connection() -> None:
    async def script(writer, body, n):
        await send_chunked(writer, [chunk(k) for k in range(1, 1000)], pause_s=0.005)

    server, driver, (rec,) = run_against(script, [StreamRequest(user="u", prompt=[1], max_tokens=999,
                                                                cancel_after_tokens=5)])
    assert rec.cancelled and rec.streamed_tokens == 5 and rec.error is None and rec.cancel_ns >= rec.chunk_ns[-1]
    assert server.disconnects == 1


def test_closing_after_t_seconds_is_marked_cancelled() -> None:
    async def script(writer, body, n):
        await send_chunked(writer, [chunk(k) for k in range(1, 1000)], pause_s=0.01)

    server, driver, (rec,) = run_against(script, [StreamRequest(user="u", prompt=[1], max_tokens=999,
                                                                cancel_after_s=0.2)])
    assert rec.cancelled and rec.cancel_ns >= rec.sent_ns + 150_000_000 and rec.streamed_tokens > 0
    assert rec.error is None


def test_a_body_that_ends_without_done_is_an_error() -> None:
    async def script(writer, body, n):
        await send_chunked(writer, [chunk(1), chunk(2)])

    server, driver, (rec,) = run_against(script, [StreamRequest(user="u", prompt=[1], max_tokens=4)])
    assert rec.error == "stream ended without [DONE]" and rec.chunk_tokens == [1, 1]


def test_a_server_gone_mid_stream_is_an_error_not_a_crash() -> None:
    async def script(writer, body, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        e = chunk(1)
        writer.write(b"%x\r\n%s\r\n" % (len(e), e))
        await writer.drain()
        writer.transport.abort()
        raise ConnectionError

    server, driver, (rec,) = run_against(script, [StreamRequest(user="u", prompt=[1], max_tokens=4)])
    assert rec.error.startswith("RemoteProtocolError") and rec.chunk_tokens == [1]


def test_a_kept_alive_connection_the_server_closed_is_replaced() -> None:
    async def script(writer, body, n):
        await send_chunked(writer, whole_stream(2))
        writer.transport.close()  # closes after each answer (as an idle timeout would)
        raise ConnectionError

    async def main():
        async with serving(script) as (server, endpoint):
            driver = Driver("ab12", live=False)
            reqs = [StreamRequest(user="u", prompt=[1], max_tokens=2, loop_group="g", loop_streams=1)
                    for _ in range(3)]
            return server, await driver.run_phase(phase(endpoint), reqs)

    server, recs = asyncio.run(main())
    assert all(r.error is None and r.completion_tokens == 2 for r in recs) and server.connections == 3


def test_no_server_is_a_connect_error_on_the_record() -> None:
    async def main():
        srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        srv.close()
        await srv.wait_closed()
        driver = Driver("ab12", live=False)
        return await driver.run_phase(phase(f"http://127.0.0.1:{port}"),
                                      [StreamRequest(user="u", prompt=[1], max_tokens=2)])

    (rec,) = asyncio.run(main())
    assert rec.error.startswith("ConnectError") and rec.sent_ns is not None and rec.done_ns is not None


def test_a_silent_server_times_out_after_the_profiles_stall_timeout() -> None:
    async def script(writer, body, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    t0 = time.monotonic()
    server, driver, (rec,) = run_against(script, [StreamRequest(user="u", prompt=[1], max_tokens=2)],
                                         stall_timeout_s=0.3)
    assert rec.error.startswith("ReadTimeout") and not rec.cancelled
    assert "stalled: no data from the server for 0.3 s (profile.stall_timeout_s)" in rec.error
    assert time.monotonic() - t0 < 4.5  # closed by the stall timeout, not by the server's end


def test_the_keep_alive_pool_is_sized_to_the_streams_at_once() -> None:
    loop = [StreamRequest(user="u", prompt=[1], max_tokens=2, loop_group="g", loop_streams=3) for _ in range(10)]
    free = [StreamRequest(user="v", prompt=[1], max_tokens=2) for _ in range(4)]
    assert Driver.streams_at_once(loop + free, None) == 7
    assert Driver.streams_at_once(loop + free, 5) == 5


def test_an_answer_with_an_empty_body_leaves_the_connection_usable() -> None:
    async def script(writer, body, n):
        if n == 1:
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
        else:
            await send_chunked(writer, whole_stream(2))

    reqs = [StreamRequest(user="u", prompt=[1], max_tokens=2, loop_group="g", loop_streams=1) for _ in range(2)]
    server, driver, (refused, ok) = run_against(script, reqs)
    assert refused.error == "HTTP 503: " and ok.error is None and ok.completion_tokens == 2
    assert server.connections == 1
