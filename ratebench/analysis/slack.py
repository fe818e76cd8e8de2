"""Slack over time, for plots: at each of a user's events, the tokens it has to spare against the
bound (the upper side, ``bound.py``) and against even spacing (the lower side, ``spacing.py``).

Upper side. With ``bound.py``'s ``u_j = C_j - 1 - N t_j`` and ``v_i = P_i - N t_i``, the tightest
window ending at event j leaves ``(B + T) N - (u_j - min over i <= j of v_i)`` tokens under the
bound: the running slack (for one token per event, ``B N - (a_j - min a_i)``). Its minimum over j is
``BoundResult.worst.slack_tokens``.

Lower side. Inside one run of steps where the budget, not the engine, limited the user
(``spacing.budget_limited_intervals``), with ``spacing.py``'s ``u_j = N t_j - C_{j-1}`` and
``v_i = N t_i - C_i`` over distinct event times, the emptiest open window ending at j falls short
of ``N W`` by ``u_j - min over i < j of v_i``; the margin is the allowance A less that. Its minimum
over the runs is ``A - SpacingResult.worst.deficit_tokens``. Outside the runs nothing is judged
(NaN).

Plain arrays out; the figures they are drawn beside come from the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ratebench.analysis.bound import NS_PER_S
from ratebench.analysis.load import RunData
from ratebench.analysis.segments import group_by
from ratebench.analysis.series import UserSeries, phase_series
from ratebench.analysis.spacing import _collapse, budget_limited_intervals
from ratebench.analysis.steps import step_latencies
from ratebench.analysis.rowgroups import phase_steps
from ratebench.analysis.verdict import UserPhaseSummary
from ratebench.events import KIND_DISPATCH, KIND_EMIT

_INT64_SAFE = 2**62


@dataclass
class SlackSeries:
    """Tokens to spare at each time (negative: broken); NaN where nothing is judged."""

    t_ns: np.ndarray
    tokens: np.ndarray  # float64


@dataclass
class UserSlack:
    """Both sides of one user's promise in one phase, on dispatch and on emit events (None: not checked)."""

    user: str
    upper_dispatch: SlackSeries | None = None
    upper_emit: SlackSeries | None = None
    lower_dispatch: SlackSeries | None = None
    lower_emit: SlackSeries | None = None


def _exact_or_float(tokens: int, n_span: int):
    """int64 while every term stays far from overflow, else float64 (a plot needs no more)."""
    return np.int64 if tokens * NS_PER_S + n_span < _INT64_SAFE else np.float64


def bound_slack(t_ns: np.ndarray, counts: np.ndarray | None, limit_tps: int, burst_ns: int,
                tolerance_ns: int = 0) -> SlackSeries:
    """The running slack under the bound at each of one user's time-sorted events (``counts``:
    positive tokens per event; None: one each)."""
    t = np.asarray(t_ns, dtype=np.int64)
    if len(t) == 0:
        return SlackSeries(t, np.empty(0))
    c = np.ones(len(t), dtype=np.int64) if counts is None else np.asarray(counts, dtype=np.int64)
    incl = np.cumsum(c)
    dt = _exact_or_float(int(incl[-1]), int(limit_tps) * int(t[-1] - t[0]))
    nt = (t - t[0]).astype(dt) * dt(limit_tps)
    u = (incl - 1).astype(dt) * dt(NS_PER_S) - nt
    v = (incl - c).astype(dt) * dt(NS_PER_S) - nt
    d = u - np.minimum.accumulate(v)
    budget = limit_tps * (burst_ns + tolerance_ns)
    return SlackSeries(t, (budget - d) / NS_PER_S)


def spacing_margin(t_ns: np.ndarray, req: np.ndarray, counts: np.ndarray | None, limit_tps: int,
                   allowance_tokens: float, steps: tuple, shift_ns: int = 0) -> SlackSeries:
    """The margin against even spacing at each distinct event time inside the user's budget-limited
    runs of steps, NaN between runs (one NaN ends each run, so a line breaks there).

    ``steps``: the phase's (step starts, periods, went straight on) as ``check_spacing`` takes them;
    ``shift_ns``: the longest dispatch-to-emit latency for emit events, else 0.
    """
    t = np.asarray(t_ns, dtype=np.int64)
    req = np.asarray(req)
    if len(t) == 0:
        return SlackSeries(t, np.empty(0))
    c = np.ones(len(t), dtype=np.int64) if counts is None else np.asarray(counts, dtype=np.int64)
    by_req = group_by(req)
    t_r = t[by_req.order]
    firsts, lasts = t_r[by_req.starts], t_r[by_req.ends - 1]
    intervals = budget_limited_intervals(firsts, lasts, *steps[:3], limit_tps,
                                         index=steps[4] if len(steps) > 4 else None)
    if shift_ns:
        intervals = intervals + np.array([0, int(shift_ns)], dtype=np.int64)
    lo = np.searchsorted(t, intervals[:, 0], side="left")
    hi = np.searchsorted(t, intervals[:, 1], side="right")
    out_t, out_y = [], []
    # one step per run of steps (tens per phase), numpy inside
    for a, b in zip(lo.tolist(), hi.tolist()):
        tt, cc = _collapse(t[a:b], c[a:b])
        if len(tt) < 2:
            continue
        incl = np.cumsum(cc)
        dt = _exact_or_float(int(incl[-1]), int(limit_tps) * int(tt[-1] - tt[0]))
        nt = (tt - tt[0]).astype(dt) * dt(limit_tps)
        v = nt - incl.astype(dt) * dt(NS_PER_S)
        u = nt - (incl - cc).astype(dt) * dt(NS_PER_S)
        deficit = (u[1:] - np.minimum.accumulate(v[:-1])) / NS_PER_S
        out_t += [tt[1:], tt[-1:]]
        out_y += [allowance_tokens - deficit, np.array([np.nan])]
    if not out_t:
        return SlackSeries(np.empty(0, dtype=np.int64), np.empty(0))
    return SlackSeries(np.concatenate(out_t), np.concatenate(out_y))


def engine_phase_steps(run: RunData, engine: str) -> dict[int, tuple]:
    """Per phase of one engine: (step starts, periods, went straight on, longest dispatch-to-emit
    latency), as the verifier measured them for even spacing (``rowgroups.phase_steps``)."""
    trace = run.traces.get(engine)
    if trace is None or not len(trace.records):
        return {}
    recs = trace.records
    dm, em = recs["kind"] == KIND_DISPATCH, recs["kind"] == KIND_EMIT
    e_c = recs["count"][em].astype(np.int64)
    keep = e_c > 0
    e_t, e_req = recs["t_ns"][em][keep], recs["req"][em][keep]
    latencies = step_latencies(recs["t_ns"][dm], recs["req"][dm], e_t, e_req, e_c[keep])
    return phase_steps(run, engine, latencies)


def user_slack(row: UserPhaseSummary, s: UserSeries, steps: tuple | None, spacing_slack_ns: int) -> UserSlack:
    """Both sides for one verdict row, from its events in the phase, with the parameters its checks used."""
    out = UserSlack(row.user)
    e_keep = s.emit_count > 0
    e_t, e_c, e_r = s.emit_t_ns[e_keep], s.emit_count[e_keep], s.emit_request[e_keep]
    for b, attr, t, c in ((row.bound_dispatch, "upper_dispatch", s.dispatch_t_ns, None),
                          (row.bound_emit, "upper_emit", e_t, e_c)):
        if b is not None and len(t):
            setattr(out, attr, bound_slack(t, c, b.limit_tps, b.burst_ns, b.tolerance_ns))
    if steps is not None:
        for sp, attr, t, r, c, shift in ((row.spacing_dispatch, "lower_dispatch", s.dispatch_t_ns,
                                          s.dispatch_request, None, 0),
                                         (row.spacing_emit, "lower_emit", e_t, e_r, e_c, steps[3])):
            if sp is not None and len(t):
                setattr(out, attr, spacing_margin(t, r, c, sp.limit_tps, sp.allowance_tokens(spacing_slack_ns),
                                                  steps, shift))
    return out


def phase_slack(run: RunData, phase_index: int, rows: list[UserPhaseSummary], spacing_slack_ns: int,
                steps: dict[int, tuple] | None = None) -> dict[str, UserSlack]:
    """Both sides for the limited users among ``rows`` (one phase's verdict rows); ``steps``:
    ``engine_phase_steps`` of the phase's engine, when already computed."""
    limited = [r for r in rows if r.limit_tps]
    if not limited:
        return {}
    p = run.phases[phase_index]
    if steps is None:
        steps = engine_phase_steps(run, p.engine)
    series = phase_series(run, phase_index, [r.user for r in limited])
    return {r.user: user_slack(r, series[r.user], steps.get(phase_index), spacing_slack_ns) for r in limited}
