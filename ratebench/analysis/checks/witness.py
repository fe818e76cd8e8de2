"""Two witnesses, one host clock: the engine's event file agrees with what the client received (no
token before the engine says it emitted it, none it never emitted) and refusals are earned (checks
witness-*, refusal-witness)."""

from __future__ import annotations

import numpy as np

from ratebench.analysis.checks.base import CheckMeaning, RowContext, meanings, per_row, per_run
from ratebench.analysis.load import RunData
from ratebench.analysis.refusals import refusal_witnesses
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds
from ratebench.analysis.witness import WitnessResult

MEANINGS = meanings({
    "witness-order": CheckMeaning("witness", "a token (or a stream's end) reached the client before the engine's "
                                  "event file says the engine emitted (finished) it, or the file has the engine "
                                  "handling a request before the client sent it: the file's times are not what "
                                  "happened, and every check made on them proves nothing",
                                  "requests.jsonl: the chunk_ns of the request the explanation names, against "
                                  "its emit events in {events}"),
    "witness-emits": CheckMeaning("witness", "the client received tokens for which the engine's event file has no "
                                  "emit event: the file leaves out what the engine did",
                                  "{events}: the emit events of the request the explanation names, against its "
                                  "chunk_tokens in requests.jsonl"),
    "witness-delivery": CheckMeaning("witness", "the delays between the engine's emits and the client's arrivals "
                                     "varied by more than allowed: the client got tokens in clumps the event "
                                     "file does not show (an output path that holds tokens back)",
                                     "requests.jsonl chunk times against {events}' emit events of the user; {plot}"),
    "witness-steps": CheckMeaning("witness", "the engine's event file records a step (dispatch to emit) longer than "
                                  "any the client could have seen: the engine's other requests kept reaching the "
                                  "client meanwhile. The longest step widens the bound's windows on emits and on "
                                  "client chunks, so a file that stretches one step hides a burst of that size",
                                  "{events}: the phase's dispatch and emit events (the longest dispatch-to-emit "
                                  "latency), against the chunk_ns of the phase's requests in requests.jsonl"),
    "refusal-witness": CheckMeaning("witness", "the engine's event file says a user was refused a charge while its "
                                    "own charges leave it well inside its budget: a refusal the limiter did not "
                                    "make (it would take the user out of the isolation checks)",
                                    "{events}: the user's dispatch and refuse events around the time the "
                                    "explanation names"),
})


@per_row(30)
def row_witness(c: RowContext) -> list[Check]:
    """The client's times against the engine's events (analysis/witness.py)."""
    return [] if c.witness is None else _witness(c.witness, c.th, c.ids)


@per_run(140)
def refusal_witness(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return _refusal_witness(run, th)


def _witness(w: WitnessResult, th: Thresholds, ids) -> list[Check]:
    """witness-order: nothing reached the client before the engine says it made it (tokens against their
    emits, the stream's end against the finish, the send against the request's first event), within the
    clock's resolution; witness-emits: every token the client received has an emit event."""
    out = []
    worst = w.worst
    clock_ms = th.witness_clock_ns / 1e6

    def margin(e, text: str) -> str:
        ms = e.early_ns / 1e6
        return text.format(d=f"{ms:.3f} ms before" if ms > 0 else f"{-ms:.3f} ms after")

    if worst is not None:
        what, e = worst
        parts = []
        if w.worst_token is not None:
            t = w.worst_token
            parts.append(margin(t, f"tokens ({w.tokens} of {w.requests} requests): token {t.token} of {t.client_id} "
                                   "reached the client {d} its emit event"))
        if w.worst_end is not None:
            parts.append(margin(w.worst_end, f"stream ends ({w.ends}): {w.worst_end.client_id}'s came {{d}} the "
                                             "engine's finish event"))
        if w.worst_sent is not None:
            parts.append(margin(w.worst_sent, f"sends ({w.sent}): the engine's first event of "
                                              f"{w.worst_sent.client_id} came {{d}} the client sent it"))
        ms = e.early_ns / 1e6
        ok = e.early_ns <= th.witness_clock_ns
        head = (f"the client's times contradict the engine's event file by {ms:.3f} ms" if not ok else
                f"the client's times agree with the engine's event file (closest {ms:+.3f} ms)")
        out.append(Check("witness-order", *ids, round(ms, 6), clock_ms, "<=", "ms", ok,
                         f"{head}, allowed {clock_ms:g} ms (the clock's resolution); worst of each: "
                         + "; ".join(parts)))
    if w.latency_max_ns is not None and w.spread_ns is not None:
        # bound-client widens its windows by this spread: a wide one lets a client see several bursts at
        # once where the engine's emits were even (an output path that holds tokens back)
        spread_ms, allowed_ms = w.spread_ns / 1e6, th.delivery_spread_max_ns / 1e6
        out.append(Check("witness-delivery", *ids, round(spread_ms, 6), allowed_ms, "<=", "ms",
                         w.spread_ns <= th.delivery_spread_max_ns,
                         f"tokens reached the client {w.latency_min_ns / 1e6:.2f} to {w.latency_max_ns / 1e6:.2f} ms "
                         f"after their emit events (p50 {w.latency_p50_ns / 1e6:.2f} ms, {w.tokens} tokens): a spread "
                         f"of {spread_ms:.2f} ms, allowed {allowed_ms:g} ms (bound-client's windows widen by this "
                         "spread: a wider one would hide tokens held back and sent in clumps)"))
    if w.tolerance_from_file and w.step_ns is not None:
        # the step tolerance T is the file's own: the client bounds every step (analysis/witness.py)
        spread = w.phase_spread_ns or 0
        allowed = 2 * (w.step_silence_ns + spread) + th.step_witness_slack_ns
        out.append(Check("witness-steps", *ids, round(w.step_ns / 1e6, 3), round(allowed / 1e6, 3), "<=", "ms",
                         w.step_ns <= allowed,
                         f"the engine's file records a step of {w.step_ns / 1e6:.1f} ms (dispatch to emit, "
                         f"{w.step_at_ns / 1e9:.3f} s into the phase; the phase's longest sets the bound's step "
                         f"tolerance on emits and client chunks, {w.emit_tolerance_ns / 1e6:.1f} ms); the client's "
                         f"longest silence from the engine across it (no chunk of any of the phase's requests) was "
                         f"{w.step_silence_ns / 1e6:.1f} ms and the phase's delivery spread {spread / 1e6:.1f} ms: "
                         f"allowed 2 x ({w.step_silence_ns / 1e6:.1f} + {spread / 1e6:.1f}) + "
                         f"{th.step_witness_slack_ns / 1e6:g} ms = {allowed / 1e6:.1f} ms (a step's tokens leave at "
                         "its end; two steps in flight with --async-scheduling). The step shown is the one longest "
                         "against its silence"))
    if w.requests or w.unemitted_tokens:
        bad = w.unemitted_tokens
        text = (f"{bad} tokens in {w.unemitted_requests} request(s) reached the client with no emit event in the "
                f"engine's file; most: {w.unemitted_example}" if bad else
                f"every one of the {w.tokens} tokens the client received in {w.requests} request(s) has its emit "
                "event")
        out.append(Check("witness-emits", *ids, bad, 0, "<=", "tokens", not bad, text))
    return out


def _refusal_witness(run: RunData, th: Thresholds) -> list[Check]:
    """Each refused user's worst refusal against its own charges: GCRA refuses only a user whose
    charges in some window ending at the refusal reach N x (W + burst) (ratebench/analysis/refusals.py).
    A refusal the charges do not explain would take the user out of the isolation checks."""
    out = []
    tol = th.refusal_tolerance_tokens
    for w in refusal_witnesses(run, th.burst_ns):
        short = w.worst_short_tokens
        head = "no charge before it" if not np.isfinite(w.worst_head_tokens) else f"{w.worst_head_tokens:.2f}"
        text = (f"{w.refusals} refuse event(s); at the one furthest from its bound ({w.worst_t_ns / 1e9:.3f} s "
                f"into the phase) the user's charges in the fullest window ending there exceeded {w.limit_tps} "
                f"tok/s x its length by {head} tokens, where a refusal needs the burst, {w.limit_tps} x "
                f"{th.burst_ns / 1e9:g} s = {w.limit_tps * th.burst_ns / 1e9:.2f} ({short:+.2f} short, "
                f"{tol:g} allowed: charges refunded at the end of the refusing step)")
        out.append(Check("refusal-witness", w.scenario, w.phase, w.engine, w.user,
                         round(short, 3) if np.isfinite(short) else None, tol, "<=", "tokens",
                         bool(short <= tol), text))
    return out
