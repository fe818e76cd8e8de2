"""A refusal must be earned: the engine's refuse events against its own dispatch events.

A ``refuse`` event says a user was out of budget at that step. Isolation judges only the users
who were never refused in a phase, so an engine that wrote refuse events for users far from their
limits would take them out of the isolation checks and pass. GCRA refuses a user at time ``r``
only when its theoretical arrival time is more than the burst ahead: some dispatch at ``t_i``
starts a run of ``c`` charges up to ``r`` with ``c > N * (r - t_i + burst)`` (each charge moves
the TAT ``1/N`` on, and a TAT in the past restarts from the charge's time). So at every refusal
the user's charges within some window ending at ``r`` must reach the bound's full burst:

    head(r) = max over dispatches i at or before r of  (c_i - N * (r - t_i))  >=  N * burst

with ``c_i`` the dispatches from ``i`` to ``r`` inclusive. Charged tokens refunded at the end of
the refusing step (a KV allocation that failed, a token kept for a preempted stream's turn that it
did not spend) are no dispatch events, so the test allows ``tolerance`` tokens short of it. One
pass per user: ``head(r) = j - N r + max_{i < j}(N t_i - i)`` with ``j`` the dispatches up to
``r``, a prefix maximum and a binary search per refusal.

Figures only; :mod:`ratebench.analysis.checks` judges them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ratebench.analysis.load import RunData
from ratebench.analysis.rates import window_heads
from ratebench.events import KIND_DISPATCH

try:
    from ratebench.events import KIND_REFUSE
except ImportError:  # pragma: no cover - the reader always has it
    KIND_REFUSE = 4


@dataclass
class RefusalWitness:
    """One user's refusals in one phase on one engine, held against its own dispatches."""

    scenario: str
    phase: str
    engine: str
    user: str
    limit_tps: int
    refusals: int
    worst_short_tokens: float  # N * burst - head(r) at the refusal furthest from the bound
    worst_t_ns: int  # that refusal's time, from the phase's start
    worst_head_tokens: float


def refusal_heads(dispatch_ns: np.ndarray, refuse_ns: np.ndarray, limit_tps: int) -> np.ndarray:
    """head(r) for each refusal time: the most a window ending at r holds above N x its length."""
    t = np.sort(dispatch_ns.astype(np.int64))
    r = refuse_ns.astype(np.int64)
    j = np.searchsorted(t, r, side="right")  # dispatches at or before each refusal
    heads = np.full(len(r), -np.inf)
    if not len(t):
        return heads
    # N t_i - i in tokens, t relative to the first dispatch to keep the floats small
    base = t[0]
    prefix = np.maximum.accumulate(limit_tps * (t - base) / 1e9 - np.arange(len(t)))
    has = j > 0
    heads[has] = j[has] - limit_tps * (r[has] - base) / 1e9 + prefix[j[has] - 1]
    return heads


def peak_head(dispatch_ns: np.ndarray, limit_tps: int) -> float:
    """The most any window ending at one of a user's dispatches holds above N x its length: the
    highest head(t_j) (module docstring) over the time-sorted ``dispatch_ns``; N x burst means the
    user's budget was spent to the bound there (its next token would be refused)."""
    t = np.asarray(dispatch_ns, dtype=np.int64)
    if not len(t):
        return 0.0
    return float(window_heads(t, None, limit_tps).max())


def refusal_witnesses(run: RunData, burst_ns: int) -> list[RefusalWitness]:
    """Per limiter-on phase and refused user: its worst refusal against the bound's burst."""
    out: list[RefusalWitness] = []
    for name, trace in run.traces.items():
        eng = run.engines.get(name)
        if eng is None or not eng.feature:
            continue
        recs = trace.records
        refuse = recs["kind"] == KIND_REFUSE
        if not refuse.any():
            continue
        dispatch = recs["kind"] == KIND_DISPATCH
        strings = trace.events.strings
        d_user, d_t = recs["user"][dispatch], recs["t_ns"][dispatch]
        r_user, r_t = recs["user"][refuse], recs["t_ns"][refuse]
        by_user = {int(u): d_t[d_user == u] for u in np.unique(r_user)}
        for p in run.phases:
            if p.engine != name:
                continue
            in_phase = (r_t >= p.start_ns) & (r_t <= p.end_ns)
            for u in np.unique(r_user[in_phase]):
                user = strings[int(u)]
                limit = eng.limit_of(user)
                if not limit:
                    continue
                times = r_t[in_phase & (r_user == u)]
                heads = refusal_heads(by_user[int(u)], times, limit)
                short = limit * burst_ns / 1e9 - heads
                k = int(np.argmax(short))
                out.append(RefusalWitness(p.scenario, p.phase, name, user, limit, len(times), float(short[k]),
                                          int(times[k] - p.start_ns), float(heads[k])))
    return out
