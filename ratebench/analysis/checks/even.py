"""Promise 2: a user's concurrent requests share one budget of N tokens per second, spent evenly over
time: delivery, even spacing on every window, the measured rate and the streams' turns."""

from __future__ import annotations

from ratebench.analysis.checks.base import LOWER, REPORT_ROW, CheckMeaning, RowContext, meanings, per_row
from ratebench.analysis.isolation import Binding
from ratebench.analysis.spacing import SpacingResult
from ratebench.analysis.verdict import Check, Thresholds, UserPhaseSummary

MEANINGS = meanings({
    "delivery": CheckMeaning("2", "a user that always waits for tokens got less than its N tokens per second "
                             "in steady state (over-throttled, or charged without emitting)",
                             LOWER + " (fewer than N tokens a second: the blue line sinks)"),
    "rate-seed": CheckMeaning("2", "the measured rate beside the limit (information)", REPORT_ROW),
    "even-spacing-dispatch": CheckMeaning("2", "the user's charges came in clumps: some window inside its backlog "
                                          "got fewer than N * W tokens less the allowance (the lower side of the "
                                          "bound)", LOWER),
    "even-spacing-emit": CheckMeaning("2", "the user's emitted tokens came in clumps: some window inside its backlog "
                                      "got fewer than N * W tokens less the allowance (the lower side of the "
                                      "bound)", LOWER + " (dashed: emit)"),
    "stream-fairness": CheckMeaning("2", "one user's streams did not take turns on the shared budget",
                                    "{plot}, the streams panel (one line per stream)"),
})


@per_row(40)
def delivery_and_spacing(c: RowContext) -> list[Check]:
    """A backlogged user gets its N tokens a second, and evenly: the lower side of the bound on every window."""
    row = c.row
    if not (row.backlogged and row.limit_tps):
        return []
    checks = [_delivery(row, c.th, c.ids)]
    for name, result, what in (("even-spacing-dispatch", row.spacing_dispatch, "dispatch events"),
                               ("even-spacing-emit", row.spacing_emit, "emit events")):
        if result is not None:
            checks.append(_spacing(name, result, what, c.th, c.ids))
    return checks


@per_row(60)
def seed_rate(c: RowContext) -> list[Check]:
    """The seed's rate (tokens over first to last), for information."""
    row = c.row
    rate = row.emit_rate or row.client_rate
    if rate is None or rate.seed_rate_tps is None:
        return []
    return [Check("rate-seed", *c.ids, round(rate.seed_rate_tps, 3), row.limit_tps, "vs", "tok/s", None,
                  f"{rate.tokens} tokens over {(rate.last_ns - rate.first_ns) / 1e9:.3f} s "
                  f"({'engine emit' if row.emit_rate else 'client'}), limit {row.limit_tps}")]


@per_row(90)
def stream_fairness(c: RowContext) -> list[Check]:
    """The user's streams take turns."""
    if c.row.stream_spread is None:
        return []
    return [_stream_fairness(c.row, c.binding(), c.th, c.ids)]


def _delivery(row: UserPhaseSummary, th: Thresholds, ids) -> Check:
    """The steady rate on dispatch events (charges) and on emitted tokens; both must reach the threshold,
    so a limiter that charges without emitting cannot pass on its charges alone."""
    measured = [(src, r) for src, r in (("dispatch", row.dispatch_rate), ("emit", row.emit_rate))
                if r is not None and r.steady_rate_tps is not None]
    if not measured:
        rate = row.dispatch_rate or row.emit_rate
        tokens = rate.tokens if rate else 0
        return Check("delivery", *ids, None, th.delivery_min, ">=", "x limit", None,
                     f"{tokens} tokens: too few past the initial burst to measure a steady rate")
    ratios = [(src, r, r.steady_rate_tps / row.limit_tps) for src, r in measured]
    worst = min(x for _, _, x in ratios)
    text = "; ".join(
        f"steady {src} rate {r.steady_rate_tps:.2f} tok/s = {x:.3f} x limit {row.limit_tps} "
        f"({r.steady_tokens} tokens beyond the {r.tokens - r.steady_tokens}-token burst over "
        f"{(r.last_ns - r.first_ns) / 1e9:.2f} s)" for src, r, x in ratios)
    return Check("delivery", *ids, round(worst, 4), th.delivery_min, ">=", "x limit", worst >= th.delivery_min, text)


def _spacing(name: str, r: SpacingResult, what: str, th: Thresholds, ids) -> Check:
    """Fewest tokens in a window of the backlog against N * W less 1 + N * (P + slack)."""
    allowance = r.allowance_tokens(th.spacing_slack_ns)
    w = r.worst
    if w is None:
        return Check(name, *ids, None, round(allowance, 3), "<=", "tokens short", None,
                     f"no window to judge on {what}: the engine, not the budget, limited the user "
                     f"(fewer waiting requests than tokens due per step)")
    ok = w.deficit_tokens <= allowance
    text = (f"emptiest window {w.window_s * 1e3:.1f} ms on {what} ({r.backlog_s:.2f} s judged in {r.intervals} "
            f"run(s) of steps): {w.tokens} tokens where {r.limit_tps} tok/s x W = {w.expected_tokens:.2f}, "
            f"{w.deficit_tokens:.2f} short; allowed 1 + N x (longest step period "
            f"{r.step_ns / 1e6:.1f} ms + slack {th.spacing_slack_ns / 1e6:g} ms) = {allowance:.2f}")
    return Check(name, *ids, round(w.deficit_tokens, 3), round(allowance, 3), "<=", "tokens short", ok, text)


def _stream_fairness(row: UserPhaseSummary, binding: Binding, th: Thresholds, ids: tuple) -> Check:
    """A user's streams take turns on its budget. A user whose limit bound in the phase (a refuse
    event, or its own dispatches spent its budget to the bound: the verifier's replay), or one whose
    binding cannot be told, is judged on every token while all its streams were active. A user whose
    limit never bound shares no budget: while a stream of it waits between two requests for a resident
    slot its siblings run, as on an engine without the limiter, so every two of its streams are judged
    while both had a request in service (the places among resident streams are the limiter's)."""
    strict = (not binding.known or binding.bound(row.user) or row.spent_to_bound(th.burst_ns)
              or not row.streams_resent)
    text = f"largest difference between {row.streams} streams' token counts while all were active: {row.stream_spread}"
    if row.stream_priorities:
        text += (f" (PRIORITY policy, its streams at priorities {', '.join(map(str, row.stream_priorities))}: "
                 "the streams of one priority take turns, higher priorities first, as upstream; the largest "
                 "difference within one priority)")
    if strict:
        return Check("stream-fairness", *ids, row.stream_spread, th.stream_spread_max, "<=", "tokens",
                     row.stream_spread <= th.stream_spread_max, text)
    why = (f"its limit never bound: no refuse event, and its dispatches never spent its budget to the bound, so "
           f"a stream queued between its requests for a slot is out of the count, as on an engine without the "
           f"limiter; {row.stream_spread} counting those waits")
    figure = row.stream_spread_in_service
    if figure is None:
        return Check("stream-fairness", *ids, None, th.stream_spread_max, "<=", "tokens", None,
                     f"not judged: no two of its {row.streams} streams ever had a request in service together, so "
                     f"none waited on another for a place ({why})")
    return Check("stream-fairness", *ids, figure, th.stream_spread_max, "<=", "tokens", figure <= th.stream_spread_max,
                 f"largest difference between two of {row.streams} streams' token counts counted while both had a "
                 f"request in service: {figure} ({why})")
