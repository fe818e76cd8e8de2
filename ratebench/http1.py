"""The driver's HTTP/1.1 client: streamed POSTs over a keep-alive pool, the body handed on as it arrives.

Plain asyncio (a :class:`asyncio.Protocol` per connection): each socket read is
stamped with ``time.monotonic_ns()`` in ``data_received``, de-chunked there and handed
at once to the stream's reader (``feed(bytes, t_ns) -> bool``), so a token costs no
task switch, no per-chunk object of an HTTP library and no wait for the waiting
coroutine to run: the coroutine wakes once, at the end of its stream. Connections are
kept alive and reused, as many as there are streams at once (a phase's pool), so a
request costs neither a TCP nor a TLS set-up once the pool is warm.

Only what the driver needs: ``POST`` with a JSON body; chunked, ``Content-Length`` or
read-until-close bodies; no redirects, no compression, no proxies.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Protocol
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 30.0


class HTTPStreamError(Exception):
    """A request that got no complete answer: says what went wrong (connect, read, protocol)."""


class ConnectError(HTTPStreamError):
    pass


class ReadTimeout(HTTPStreamError):
    pass


# a client record's error for a stream the server left without a byte for the read timeout (the
# profile's stall_timeout_s): ``ReadTimeout: stalled: ...``
STALLED = "stalled: no data from the server"
STALL_ERROR = f"ReadTimeout: {STALLED}"


class RemoteProtocolError(HTTPStreamError):
    pass


class BodyReader(Protocol):
    def feed(self, data: bytes, t_ns: int) -> bool:
        """Take body bytes that arrived at ``t_ns``; True: the driver needs no more (done or closing);
        the rest of the body (after a done) is read and dropped."""

    @property
    def closing(self) -> bool:
        """After ``feed`` said True: whether the driver closes the stream (False: it ended, drain it)."""

    def head(self, status: int, headers: dict[str, str]) -> None:
        """The response's status and headers (names and values lower-cased), before its body."""


# response parse states
_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _LENGTH, _UNTIL_CLOSE, _IDLE = range(8)


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time; the response parsed as bytes arrive."""

    def __init__(self, pool: "StreamPool") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.state = _IDLE
        self.buf = b""
        self.reader: BodyReader | None = None
        self.future: asyncio.Future | None = None
        self.status = 0
        self.error_body: bytearray | None = None  # a non-200 answer's body, kept for the message
        self.left = 0  # bytes left of the current chunk or of a Content-Length body
        self.keep_alive = True
        self.reused = False
        self.got_bytes = False  # of the current response
        self.last_ns = 0  # the last read (the read timeout counts from it)

    # --- asyncio.Protocol ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool._forget(self)
        self.transport = None
        if self.state == _UNTIL_CLOSE:
            self._body_done()
        elif self.future is not None and not self.future.done():
            why = "server closed the connection before the response ended"
            self.future.set_exception(RemoteProtocolError(f"{why}: {exc}" if exc else why))
        self.state = _IDLE

    def data_received(self, data: bytes) -> None:
        t_ns = time.monotonic_ns()
        self.last_ns = t_ns
        self.got_bytes = True
        buf = self.buf + data if self.buf else data
        self.buf = b""
        pos = 0
        end = len(buf)
        body: list[bytes] = []  # this read's body bytes, handed on at once
        state = self.state
        while pos < end:
            if state == _CHUNK_DATA:
                take = min(self.left, end - pos)
                body.append(buf[pos:pos + take])
                pos += take
                self.left -= take
                if self.left == 0:
                    state = _CHUNK_CRLF
            elif state == _CHUNK_CRLF:
                if end - pos < 2:
                    break
                pos += 2
                state = _CHUNK_SIZE
            elif state == _CHUNK_SIZE:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                try:
                    self.left = int(buf[pos:eol].split(b";", 1)[0], 16)
                except ValueError:
                    return self._fail(RemoteProtocolError(f"bad chunk size line {buf[pos:eol][:40]!r}"))
                pos = eol + 2
                state = _CHUNK_DATA if self.left else _TRAILER
            elif state == _TRAILER:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                blank = eol == pos
                pos = eol + 2
                if blank:
                    state = _IDLE
                    break
            elif state == _LENGTH:
                take = min(self.left, end - pos)
                body.append(buf[pos:pos + take])
                pos += take
                self.left -= take
                if self.left == 0:
                    state = _IDLE
                    break
            elif state == _UNTIL_CLOSE:
                body.append(buf[pos:] if pos else buf)
                pos = end
            elif state == _HEAD:
                head_end = buf.find(b"\r\n\r\n", pos)
                if head_end < 0:
                    break
                state = self._head(buf[pos:head_end])
                pos = head_end + 4
                if state < 0:
                    return None
                if state == _IDLE:  # an empty body
                    break
            else:  # _IDLE: bytes nobody asked for
                return self._fail(RemoteProtocolError("bytes from the server outside a response"))
        self.state = state
        if pos < end:
            self.buf = buf[pos:]
        if body:
            self._body(body[0] if len(body) == 1 else b"".join(body), t_ns)
        if state == _IDLE:
            self._body_done()

    # --- the response ---
    def _head(self, head: bytes) -> int:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        try:
            self.status = int(parts[1])
        except (IndexError, ValueError):
            self._fail(RemoteProtocolError(f"bad status line {lines[0][:80]!r}"))
            return -1
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        self.keep_alive = parts[0] == "HTTP/1.1" and headers.get("connection") != "close"
        if self.reader is not None:
            self.reader.head(self.status, headers)
        if self.status != 200:
            self.error_body = bytearray()
        if "chunked" in headers.get("transfer-encoding", ""):
            return _CHUNK_SIZE
        if "content-length" in headers:
            self.left = int(headers["content-length"])
            return _LENGTH if self.left else _IDLE
        self.keep_alive = False
        return _UNTIL_CLOSE

    def _body(self, data: bytes, t_ns: int) -> None:
        if self.error_body is not None:
            self.error_body += data
            return
        reader = self.reader
        if reader is None:  # the driver took its answer already: draining to the end of the body
            return
        if reader.feed(data, t_ns):
            self.reader = None
            if reader.closing:
                self._close()
                self._resolve()
            # else ([DONE]) the answer is complete when the body ends, right after: then the
            # connection is free again before the caller sends its next request on the pool

    def _body_done(self) -> None:
        self._resolve()
        self.reader = None
        self.error_body = None
        if self.keep_alive and self.transport is not None and self.state == _IDLE:
            self.pool._release(self)
        else:
            self._close()

    def _resolve(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result((self.status, bytes(self.error_body or b"")))

    def _fail(self, exc: Exception) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_exception(exc)
        self._close()

    def _close(self) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()  # at once: vLLM aborts the request when its client goes away

    # --- the driver's side ---
    def send(self, request: bytes, reader: BodyReader) -> asyncio.Future:
        assert self.transport is not None and self.state == _IDLE
        self.reader, self.state, self.status, self.error_body = reader, _HEAD, 0, None
        self.got_bytes = False
        self.last_ns = time.monotonic_ns()
        self.future = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.future


class StreamPool:
    """Keep-alive connections to one server; at most ``max_idle`` idle ones kept (the stream count)."""

    def __init__(self, endpoint: str, *, max_idle: int, read_timeout_s: float, ssl_context=None) -> None:
        url = urlsplit(endpoint)
        self.https = url.scheme == "https"
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if self.https else 80)
        self.prefix = url.path.rstrip("/")
        self.host_header = url.netloc
        self.max_idle = max_idle
        self.read_timeout_s = read_timeout_s
        self.ssl_context = ssl_context
        self.idle: collections.deque[_Connection] = collections.deque()
        self.busy: set[_Connection] = set()
        self.opened = 0  # connections made (a figure for the benchmark: reuse = requests / opened)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port,
                    ssl=self.ssl_context if self.https else None, server_hostname=self.host if self.https else None)
        except TimeoutError:
            raise ConnectError(f"no connection to {self.host}:{self.port} within {CONNECT_TIMEOUT_S:.0f} s") from None
        except OSError as exc:
            raise ConnectError(f"{self.host}:{self.port}: {exc}") from None
        self.opened += 1
        return conn

    def _release(self, conn: _Connection) -> None:
        self.busy.discard(conn)
        if len(self.idle) < self.max_idle:
            conn.reused = True
            conn.future = None
            self.idle.append(conn)
        else:
            conn._close()

    def _forget(self, conn: _Connection) -> None:
        self.busy.discard(conn)
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    async def post(self, path: str, headers: dict[str, str], body: bytes, reader: BodyReader) -> tuple[int, bytes]:
        """POST ``body`` (JSON); the response body goes to ``reader`` as it arrives (200) or comes back
        whole (any other status). Returns (status, the body of a non-200 answer). Cancelling the caller
        closes the connection."""
        head = [f"POST {self.prefix}{path} HTTP/1.1", f"Host: {self.host_header}", "User-Agent: ratebench",
                "Accept: */*", "Content-Type: application/json", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        while True:
            conn = self.idle.pop() if self.idle else await self._connect()
            self.busy.add(conn)
            fut = conn.send(request, reader)
            try:
                return await fut
            except RemoteProtocolError:
                # a kept-alive connection the server had closed before it read the request: once more, anew
                if conn.reused and not conn.got_bytes:
                    continue
                raise
            except BaseException:
                conn.reader = None
                conn._close()
                raise

    def expire(self, now_ns: int) -> None:
        """Fail the requests that got no byte for the read timeout (called about once a second)."""
        limit_ns = int(self.read_timeout_s * 1e9)
        for conn in list(self.busy):
            if conn.future is not None and not conn.future.done() and now_ns - conn.last_ns > limit_ns:
                conn._fail(ReadTimeout(f"{STALLED} for {self.read_timeout_s:g} s "
                                       "(profile.stall_timeout_s)"))

    def close(self) -> None:
        for conn in list(self.idle) + list(self.busy):
            conn._close()
        self.idle.clear()
        self.busy.clear()
