"""Trace lateness: how late the driver sent each request of a replayed trace.

A request's lateness is ``sent_ns - scheduled_ns`` of its client record: when the driver
began sending it against the time the trace gave it (numpy's default percentiles). A
phase whose p99 lateness exceeds the allowed lateness (``--trace-lateness-ms``, else its scenario's
``lateness_ms``, else 20 ms: the thresholds table) did not replay its trace faithfully: what the
engine saw was not the trace's arrivals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ratebench.analysis.load import RunData
from ratebench.analysis.thresholds import DEFAULT_TRACE_LATENESS_NS, for_phase
from ratebench.analysis.verdict import Check, Thresholds

# Scenario kinds that send requests at the times of a trace.
TRACE_KINDS = ("trace", "mix")


@dataclass
class TraceLateness:
    """The lateness of one trace phase's requests."""

    phase_index: int
    sent: int  # requests the driver sent
    unsent: int  # requests never sent (closed while waiting for their start)
    p50_ns: int | None  # None: nothing sent
    p99_ns: int | None
    max_ns: int | None
    latest: str | None  # the client id of the latest request
    threshold_ns: int  # the allowed p99 lateness


def trace_lateness(run: RunData, th: Thresholds = Thresholds()) -> list[TraceLateness]:
    """One figure per phase of a trace-replaying scenario, in phase order."""
    by_phase: dict[tuple[str, str, str], list] = {}
    for r in run.records:
        by_phase.setdefault((r.scenario, r.phase, r.engine), []).append(r)
    out = []
    for p in run.phases:
        if p.kind not in TRACE_KINDS:
            continue
        recs = by_phase.get(p.key, [])
        sent = [r for r in recs if r.sent_ns is not None]
        threshold_ns = for_phase(th, "trace_lateness_ns", p.params) or DEFAULT_TRACE_LATENESS_NS
        if not sent:
            out.append(TraceLateness(p.index, 0, len(recs), None, None, None, None, threshold_ns))
            continue
        late = np.array([r.sent_ns - r.scheduled_ns for r in sent], dtype=np.int64)
        p50, p99 = np.percentile(late, [50, 99])
        worst = int(np.argmax(late))
        out.append(TraceLateness(p.index, len(sent), len(recs) - len(sent), int(round(p50)), int(round(p99)),
                                 int(late[worst]), sent[worst].client_id, threshold_ns))
    return out


def lateness_checks(run: RunData, th: Thresholds = Thresholds()) -> list[Check]:
    """trace-lateness: each trace phase's p99 lateness against the allowed lateness."""
    out = []
    for f in trace_lateness(run, th):
        p = run.phases[f.phase_index]
        limit_ms = f.threshold_ns / 1e6
        if f.p99_ns is None:
            out.append(Check("trace-lateness", p.scenario, p.phase, p.engine, None, None, limit_ms, "<=", "ms", None,
                             f"no request sent ({f.unsent} never started)"))
            continue
        ok = f.p99_ns <= f.threshold_ns
        text = (f"{f.sent} requests sent, late against their trace time by p50 {f.p50_ns / 1e6:.2f} ms, "
                f"p99 {f.p99_ns / 1e6:.2f} ms, max {f.max_ns / 1e6:.2f} ms ({f.latest})"
                + (f"; {f.unsent} never sent" if f.unsent else ""))
        if not ok:
            text += f": the run did not replay the trace faithfully (allowed p99 {limit_ms:g} ms)"
        out.append(Check("trace-lateness", p.scenario, p.phase, p.engine, None, round(f.p99_ns / 1e6, 3), limit_ms,
                         "<=", "ms", ok, text))
    return out
