"""Reading one streamed answer: the server-sent events of a request, chunk by chunk, into its
:class:`ratebench.runrecords.ClientRecord` (:class:`ChunkReader`); the TLS context of https endpoints."""

from __future__ import annotations

import functools
import ssl
import time
from array import array
from typing import Mapping

import httpx
import orjson

from ratebench.runrecords import ClientRecord


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """One verifying SSL context for every HTTP client of the process: httpx loads the
    certificate bundle anew for each client otherwise (about 27 ms each, a tokenize
    call per stream before every phase)."""
    return httpx.create_ssl_context()


class ChunkReader:
    """A streamed response's body -> its client record: server-sent events split, each chunk's usage read.

    ``feed`` runs for every socket read (from ``ratebench.http1`` straight off ``data_received``,
    or per ``aiter_raw`` piece of an httpx transport) with the time the bytes came off the
    socket. The per-chunk work is one ``orjson.loads`` and two appends to ``array('q')``s;
    :meth:`finish` turns those into the record's lists once, at the end of the stream.
    """

    __slots__ = ("rec", "cancel_after_tokens", "seen", "times", "counts", "ids", "buf", "closing", "served_by_header",
                 "parts")

    def __init__(self, rec: ClientRecord, cancel_after_tokens: int | None, served_by_header: str | None = None) -> None:
        self.rec = rec
        self.cancel_after_tokens = cancel_after_tokens
        self.served_by_header = served_by_header.lower() if served_by_header else None
        self.seen = 0  # usage.completion_tokens of the last chunk
        self.times = array("q")  # chunks that carried tokens: arrival time
        self.counts = array("q")  # tokens in each of those chunks
        self.ids: array | None = None  # the answer's token ids (choices[].token_ids), when the server sends them
        self.buf = b""  # an event not complete yet
        self.closing = False  # feed said True because the driver closes the stream (cancel_after_tokens)
        # a request of n > 1 answers (parallel sampling): each chunk carries one choice, whose
        # usage.completion_tokens counts that choice's tokens only; per choice index, its
        # [tokens seen, chunk times, chunk counts, finish reason, token ids]. None until a choice
        # other than 0 shows up (then choice 0's part is rebuilt from what was read so far)
        self.parts: dict[int, list] | None = None

    def head(self, status: int, headers: Mapping[str, str]) -> None:
        """A fleet's answer names the engine that served it (the balancer's header): the record's engine."""
        if self.served_by_header is not None:
            served = headers.get(self.served_by_header)
            if served:
                self.rec.engine = served

    def feed(self, data: bytes, t_ns: int) -> bool:
        """Take body bytes that came off the socket at ``t_ns``; True: the driver needs no more
        ([DONE] seen, or ``cancel_after_tokens`` reached: then ``closing``)."""
        buf = self.buf + data if self.buf else data
        if b"\r" in buf:  # a CR at the end stays, and meets its LF in the next read
            buf = buf.replace(b"\r\n", b"\n")
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            event = buf[start:end]
            start = end + 2
            if event.startswith(b"data: ") and b"\n" not in event:  # vLLM's one-line events
                done = self._chunk(event[6:], t_ns)
            else:
                done = False
                for line in event.split(b"\n"):
                    if line.startswith(b"data:") and self._chunk(line[5:].strip(), t_ns):
                        done = True
                        break
            if done:
                self.buf = b""
                return True
        self.buf = buf[start:] if start < len(buf) else b""
        return False

    def _chunk(self, payload: bytes, t_ns: int) -> bool:
        rec = self.rec
        if payload == b"[DONE]":
            rec.done_ns = t_ns
            return True
        try:
            chunk = orjson.loads(payload)
        except ValueError:
            rec.error = f"unreadable chunk: {payload[:200]!r}"
            return False
        if type(chunk) is not dict:
            rec.error = f"unreadable chunk: {payload[:200]!r}"
            return False
        if "error" in chunk and "choices" not in chunk:
            err = chunk["error"]
            rec.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return False
        choices = chunk.get("choices") or []
        usage = chunk.get("usage")
        if choices and (self.parts is not None or choices[0].get("index", 0)):
            self._count_choices(choices, usage, t_ns)  # a request of several answers
        else:
            if usage is not None:
                total = int(usage.get("completion_tokens") or 0)
                if rec.prompt_tokens is None and usage.get("prompt_tokens") is not None:
                    rec.prompt_tokens = int(usage["prompt_tokens"])
                if total > self.seen:
                    if rec.first_token_ns is None:
                        rec.first_token_ns = t_ns
                    self.times.append(t_ns)
                    self.counts.append(total - self.seen)
                    self.seen = total
                if not choices:  # the final usage chunk (include_usage)
                    rec.completion_tokens = total
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_tokens = int(usage["prompt_tokens"])
            for choice in choices:
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
                ids = choice.get("token_ids")
                if ids:
                    if self.ids is None:
                        self.ids = array("q")
                    self.ids.extend(ids)
        if self.cancel_after_tokens is not None and self.seen >= self.cancel_after_tokens:
            rec.cancelled = True
            rec.cancel_ns = time.monotonic_ns()
            self.closing = True
            return True  # the driver closes the connection: vLLM aborts
        return False

    def _count_choices(self, choices: list, usage: dict | None, t_ns: int) -> None:
        """A chunk of a request with several answers: tokens counted per choice (each choice's usage counts
        its own), the request's chunk lists summed over choices."""
        rec = self.rec
        parts = self.parts
        if parts is None:  # the first chunk of a choice other than 0: what was read so far was choice 0's
            zero = [self.seen, array("q", self.times), array("q", self.counts), rec.finish_reason,
                    array("q", self.ids) if self.ids is not None else None]
            parts = self.parts = {0: zero} if self.seen or rec.finish_reason else {}
        if rec.prompt_tokens is None and usage is not None and usage.get("prompt_tokens") is not None:
            rec.prompt_tokens = int(usage["prompt_tokens"])
        for choice in choices:
            index = int(choice.get("index", 0))
            part = parts.get(index)
            if part is None:
                part = parts[index] = [0, array("q"), array("q"), None, None]
            if usage is not None and len(choices) == 1:
                total = int(usage.get("completion_tokens") or 0)
                if total > part[0]:
                    if rec.first_token_ns is None:
                        rec.first_token_ns = t_ns
                    part[1].append(t_ns)
                    part[2].append(total - part[0])
                    self.times.append(t_ns)
                    self.counts.append(total - part[0])
                    self.seen += total - part[0]
                    part[0] = total
            if choice.get("finish_reason"):
                part[3] = rec.finish_reason = choice["finish_reason"]
            ids = choice.get("token_ids")
            if ids:
                if part[4] is None:
                    part[4] = array("q")
                part[4].extend(ids)

    def finish(self) -> None:
        """The record's chunk lists, once the stream is over."""
        self.rec.chunk_ns = self.times.tolist()
        self.rec.chunk_tokens = self.counts.tolist()
        if self.parts is not None:
            self.rec.choices = [
                {"index": i, "chunk_ns": p[1].tolist(), "chunk_tokens": p[2].tolist(), "completion_tokens": p[0],
                 "finish_reason": p[3], "token_ids": p[4].tolist() if p[4] is not None else None}
                for i, p in sorted(self.parts.items())]
            return  # the request's token ids are its choices' (no one sequence of them)
        if self.ids is not None:
            self.rec.token_ids = self.ids.tolist()
