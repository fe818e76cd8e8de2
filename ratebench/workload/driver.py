"""The driver of a run's phases (:class:`Driver`): a :class:`ratebench.workload.sender.StreamSender`
that spreads a phase's streams over worker processes when it has more than one
(:mod:`ratebench.workload.workers`)."""

from __future__ import annotations

from ratebench.runrecords import ClientRecord
from ratebench.workload.requests import PhaseContext, StreamRequest
from ratebench.workload.sender import StreamSender
from ratebench.workload.workers import run_phase_in_workers


class Driver(StreamSender):
    """Sends streamed requests for the phases of a run and keeps their client records.

    The requests go over ratebench's own HTTP/1.1 client (``ratebench.http1``: a keep-alive pool
    per phase, sized to its streams); ``transport`` (tests: a scripted server) sends them through
    ``httpx`` instead. Either way every body byte goes through the same
    :class:`ratebench.workload.sse.ChunkReader`.
    """

    async def run_phase(self, ctx: PhaseContext, requests: list[StreamRequest], *, concurrency: int | None = None,
                        limits: dict[str, int | None] | None = None) -> list[ClientRecord]:
        """Send every request (at its delay, at most ``concurrency`` at once); wait for the end.

        Foreground requests run to their end; background ones are closed when every
        foreground request is done (or run to their end if there are no foreground ones).
        With ``workers`` > 1 the streams are spread over that many worker processes
        (:mod:`ratebench.workload.workers`); the records come back here all the same.
        """
        if self.workers > 1 and self.transport is None and len(requests) > 1:
            return await run_phase_in_workers(self, ctx, requests, concurrency=concurrency, limits=limits)
        return await self.run_phase_here(ctx, requests, concurrency=concurrency, limits=limits)
