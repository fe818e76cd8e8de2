"""A tiny stand-in for vLLM's streaming completions endpoint, to measure clients without an engine.

    .venv/bin/python benchmarks/fake_sse_server.py --port 8123 [--step-ms 10]

HTTP/1.1 with keep-alive on plain asyncio. ``POST /v1/completions`` (or ``/v1/chat/completions``)
with ``"stream": true`` answers like vLLM 0.32.0 with ``stream_options: {include_usage,
continuous_usage_stats}``: one server-sent event per token, each in its own HTTP chunk,
carrying the cumulative ``usage``; the last token's chunk has ``finish_reason: "length"``,
then a usage-only chunk and ``data: [DONE]``. Like an engine step, one timer every
``--step-ms`` sends the next token of every open stream (``max_tokens`` tokens each, EOS
ignored), so the token rate is streams / step. ``GET /health`` answers 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

_COMPLETION = ('{{"id":"cmpl-{rid}","object":"text_completion","created":{created},"model":"{model}",'
               '"choices":[{{"index":0,"text":" token","logprobs":null,"finish_reason":{finish},'
               '"stop_reason":null}}],"usage":{{"prompt_tokens":{prompt},"total_tokens":{total},'
               '"completion_tokens":{n}}}}}')
_CHAT = ('{{"id":"chatcmpl-{rid}","object":"chat.completion.chunk","created":{created},"model":"{model}",'
         '"choices":[{{"index":0,"delta":{{"content":" token"}},"logprobs":null,"finish_reason":{finish},'
         '"stop_reason":null}}],"usage":{{"prompt_tokens":{prompt},"total_tokens":{total},'
         '"completion_tokens":{n}}}}}')
_FINAL = ('{{"id":"cmpl-{rid}","object":"text_completion","created":{created},"model":"{model}","choices":[],'
          '"usage":{{"prompt_tokens":{prompt},"total_tokens":{total},"completion_tokens":{n}}}}}')


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Stream:
    def __init__(self, proto: "Connection", body: dict, rid: str, chat: bool) -> None:
        self.proto = proto
        self.max_tokens = int(body.get("max_tokens") or 16)
        prompt = body.get("prompt")
        self.prompt_tokens = len(prompt) if isinstance(prompt, list) else 16
        self.model = body.get("model", "tiny-qwen3")
        self.rid = rid
        self.template = _CHAT if chat else _COMPLETION
        self.created = int(time.time())
        self.n = 0

    def next_event(self) -> bytes:
        """The next token's chunk; after the last token, the usage chunk, [DONE] and the end of the body."""
        self.n += 1
        n = self.n
        fields = dict(rid=self.rid, created=self.created, model=self.model, prompt=self.prompt_tokens,
                      total=self.prompt_tokens + n, n=n)
        if n < self.max_tokens:
            return http_chunk(b"data: " + self.template.format(finish="null", **fields).encode() + b"\n\n")
        return (http_chunk(b"data: " + self.template.format(finish='"length"', **fields).encode() + b"\n\n")
                + http_chunk(b"data: " + _FINAL.format(**fields).encode() + b"\n\n")
                + http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


class Connection(asyncio.Protocol):
    def __init__(self, server: "Server") -> None:
        self.server = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.stream: Stream | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            self.server.streams.discard(self.stream)
            self.stream = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].decode("latin-1").split("\r\n")
            length = 0
            headers = {}
            for line in head[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            length = int(headers.get("content-length", "0"))
            if len(self.buf) < head_end + 4 + length:
                return
            body = self.buf[head_end + 4: head_end + 4 + length]
            self.buf = self.buf[head_end + 4 + length:]
            self.handle(head[0], headers, body)

    def handle(self, request_line: str, headers: dict[str, str], body: bytes) -> None:
        method, path, _ = request_line.split(" ", 2)
        assert self.transport is not None
        if method == "GET":
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}")
            return
        req = json.loads(body)
        rid = headers.get("x-request-id", "fake")
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
        self.stream = Stream(self, req, rid, chat=path.endswith("/chat/completions"))
        self.server.streams.add(self.stream)


class Server:
    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.streams: set[Stream] = set()

    async def steps(self) -> None:
        next_s = time.monotonic()
        while True:
            next_s += self.step_s
            for s in list(self.streams):
                out = s.next_event()
                if s.proto.transport is not None and not s.proto.transport.is_closing():
                    s.proto.transport.write(out)
                if s.n >= s.max_tokens:
                    self.streams.discard(s)
                    s.proto.stream = None
            await asyncio.sleep(max(0.0, next_s - time.monotonic()))


async def serve(port: int, step_s: float) -> None:
    server = Server(step_s)
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(lambda: Connection(server), "127.0.0.1", port, backlog=4096)
    async with srv:
        await server.steps()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--step-ms", type=float, default=10.0)
    args = ap.parse_args()
    try:
        asyncio.run(serve(args.port, args.step_ms / 1000))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
