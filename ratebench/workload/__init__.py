"""The workload driver: concurrent streaming OpenAI clients (asyncio, ratebench's HTTP/1.1 pool).

Every request streams with ``stream_options: {include_usage, continuous_usage_stats}``
so each chunk carries the cumulative ``completion_tokens``; the tokens of a chunk
are the delta of that count. Each chunk's time is ``time.monotonic_ns()`` taken
when its bytes came off the socket (the clock of the engine events). Every
request carries ``X-Request-Id: rb-<run id>-<n>``, which the engine keeps inside
its request id (``ratebench.runrecords.client_id_of``). What the client saw goes into
one :class:`ratebench.runrecords.ClientRecord` per request.

The package, from the bottom: :mod:`~ratebench.workload.requests` (what a scenario asks to send),
:mod:`~ratebench.workload.sse` (one answer read into its record), :mod:`~ratebench.workload.live`
(the live table, the loop-lag probe), :mod:`~ratebench.workload.prompts`,
:mod:`~ratebench.workload.sender` (a phase sent from this process), :mod:`~ratebench.workload.workers`
(a phase spread over worker processes) and :mod:`~ratebench.workload.driver` (either, by the number
of workers). The names other stages use are handed on here.
"""

from ratebench.workload.driver import Driver
from ratebench.workload.live import LiveRates, LoopLagProbe
from ratebench.workload.prompts import PromptMaker
from ratebench.workload.requests import PhaseContext, StreamRequest, WorkloadError, request_body
from ratebench.workload.sender import users_of
from ratebench.workload.sse import ssl_context

__all__ = ["Driver", "LiveRates", "LoopLagProbe", "PhaseContext", "PromptMaker", "StreamRequest", "WorkloadError",
           "request_body", "ssl_context", "users_of"]
