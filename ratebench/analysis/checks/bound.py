"""Promise 6, the bound: in any window of W seconds a user receives at most (W + 0.1) * N + 1
output tokens; on the engine's dispatch events exactly, on its emits and the client's chunks with
stated tolerances (checks bound-*)."""

from __future__ import annotations

from ratebench.analysis.bound import BoundResult
from ratebench.analysis.checks.base import (
    UPPER, WHOLE, CheckMeaning, RowContext, bound_check, meanings, per_row, per_run,
)
from ratebench.analysis.load import RunData
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds
from ratebench.analysis.witness import WitnessResult

MEANINGS = meanings({
    "bound-dispatch": CheckMeaning("6", "the engine charged more tokens in a window than the bound allows",
                                   UPPER),
    "bound-emit": CheckMeaning("6", "the engine emitted more tokens in a window than the bound allows "
                               "(with one engine step of tolerance)", UPPER + " (dashed: emit)"),
    "bound-client": CheckMeaning("6", "the client received more tokens in a window than the bound allows, even "
                                 "with the windows widened by the engine step and the spread of the measured "
                                 "delivery latency (client arrival - engine emit)",
                                 "requests.jsonl: the chunk times of the user's requests in the worst window, "
                                 "against their emit events in {events}"),
    "bound-dispatch-run": CheckMeaning("6", "over the engine's whole event file, a window holds more charges than "
                                       "the bound allows (the limiter's state must carry across phases)",
                                       "{events}; report.md, the bound over each engine's whole event file"),
    "bound-emit-run": CheckMeaning("6", "over the engine's whole event file, a window holds more emitted tokens "
                                   "than the bound allows", "{events}; report.md, the bound over each engine's "
                                   "whole event file"),
})


@per_run(-10)
def engine_bounds(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    """The bound over each engine's whole file."""
    checks = []
    for eb in s.engine_bounds:
        if eb.dispatch is not None:
            checks.append(bound_check("bound-dispatch-run", WHOLE, WHOLE, eb.engine, eb.user, eb.dispatch,
                                      "dispatch events, whole engine file"))
        if eb.emit is not None:
            checks.append(bound_check("bound-emit-run", WHOLE, WHOLE, eb.engine, eb.user, eb.emit,
                                      "emit events, whole engine file"))
    return checks


@per_row(10)
def phase_bounds(c: RowContext) -> list[Check]:
    """The bound in the phase, on dispatch and on emit events."""
    checks = []
    if c.row.bound_dispatch is not None:
        checks.append(bound_check("bound-dispatch", *c.ids, c.row.bound_dispatch, "dispatch events"))
    if c.row.bound_emit is not None:
        checks.append(bound_check("bound-emit", *c.ids, c.row.bound_emit, "emit events"))
    return checks


@per_row(20)
def client_bound(c: RowContext) -> list[Check]:
    """The bound on the client's chunks, windows widened by the measured delivery spread."""
    return [] if c.row.bound_client is None else [_bound_client(c.row.bound_client, c.witness, c.ids)]


def _bound_client(b: BoundResult, w: WitnessResult | None, ids) -> Check:
    """The bound on the client's chunk times, its windows widened by the emit tolerance T and the spread of
    the measured delivery latency (witness.py: every token of a client window was emitted in a window
    Lmax - Lmin longer). Information only where no latency was measured (no engine events)."""
    if w is None or w.client_tolerance_ns is None:
        return bound_check("bound-client", *ids, b, "client chunks (information only: no engine emit events "
                            "to measure the delivery latency against)", informational=True)
    tol = (f" + step {w.emit_tolerance_ns / 1e6:.1f} ms + delivery spread {w.spread_ns / 1e6:.1f} ms"
           if b.tolerance_ns else "")
    c = bound_check("bound-client", *ids, b, "client chunks", tolerance_text=tol)
    c.explanation += (f"; delivery latency (client arrival - engine emit) {w.latency_min_ns / 1e6:.2f}.."
                      f"{w.latency_max_ns / 1e6:.2f} ms, p50 {w.latency_p50_ns / 1e6:.2f} ms over {w.tokens} tokens")
    return c
