"""Even spacing: the lower side of the bound on every window, checked exactly in one pass.

The promise (DESIGN section 1, promise 2): a user's budget is spent evenly over
time, never a whole second's worth at once and then nothing. The bound
(``bound.py``) is the upper side: at most ``(W + B) * N + 1`` tokens in any
window of W seconds. This is its dual: a user that is *backlogged* (always has
a request waiting for its next token) and whose budget, not the engine, limits
it gets at least ``N * W - A`` tokens in every window of W seconds inside its
backlog, with an allowance ``A`` stated below.

The allowance
-------------
Tokens are handed out only when the engine starts a step. A correct GCRA
limiter serving a backlogged user takes, at each step start, every token its
budget allows (one per waiting request at most), so each token leaves at the
first step start after it is due, and the emptiest window is the open one
between two step starts: at most ``1 + N * P`` tokens short, P the longest time
from one step start to the next. So::

    A = 1 + N * (P + slack)

P is measured on the phase itself (``steps.step_periods``), over the steps of the
runs judged (below; a long step elsewhere bounds no judged window): from one step start
to the next when the engine went straight on (the next step started within
2 ms of the previous one's end, or before it with async scheduling), else the
step's own length plus those 2 ms: time the engine spends *idle* is not in P,
because a waiting engine must wake when a user's next token is due. A late
wake-up, or a limiter that releases tokens in clumps, therefore shows as a
deficit. ``slack`` (a threshold, 5 ms by default) covers the wake-up of a
blocked process on a busy host. On emit events the windows are also shifted by
the longest dispatch-to-emit latency of the phase, which is added to P.

Which windows
-------------
Engine side, per user and phase, for users marked backlogged in
``scenarios.json`` with a limit (the users ``delivery`` judges). A request of
the user waits for tokens from its first to its last event. Windows are taken
inside runs of consecutive engine steps at which the user's waiting requests
could take every token the budget allowed: at least ``ceil(N * period)``
requests waiting at a step after which the engine went straight on, at least
one at a step after which it waited, and no step longer than the burst (a
waiting user loses for good what came due more than the burst ago); a run
also ends where no request of the user waits. Outside those runs (before a
phase's first token, after its last, between two requests of a closed-loop
stream, while long steps let fewer streams take fewer tokens than N a second)
the engine, not the budget, limits the user, and nothing is judged.

Exact, one pass
---------------
For the user's events in one backlog interval, grouped by time
``t_0 < t_1 < ...`` with ``c_k`` tokens at ``t_k`` and ``C_k`` the inclusive
sum, the open window ``(t_i, t_j)`` (``i < j``) holds ``C_{j-1} - C_i`` tokens
and is ``t_j - t_i`` long; every window inside the interval holds at least as
many tokens as the open window between the events around it, so these are the
worst. Its deficit ``N (t_j - t_i) - (C_{j-1} - C_i)`` is
``u_j - v_i`` with ``u_j = N t_j - C_{j-1}`` and ``v_i = N t_i - C_i``: the
maximum over ``i < j`` is one pass with a running minimum of ``v``, in integer
nanoseconds (times 1e9), O(n).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ratebench.analysis.bound import BURST_NS, NS_PER_S

_INT64_SAFE = 2**62


@dataclass
class SpacingWindow:
    """The emptiest window inside the user's budget-limited backlog."""

    start_ns: int  # the event before the window (the window is open: it holds no token at its ends)
    end_ns: int  # the event after it
    tokens: int  # tokens strictly inside
    expected_tokens: float  # N * W

    @property
    def window_s(self) -> float:
        return (self.end_ns - self.start_ns) / NS_PER_S

    @property
    def deficit_tokens(self) -> float:
        return self.expected_tokens - self.tokens


@dataclass
class SpacingResult:
    """Even spacing measured on one user's events in one phase (``checks.py`` judges it)."""

    limit_tps: int
    step_ns: int  # P, the longest step period in the phase, plus the emit shift on emit events
    intervals: int  # runs of steps at which the budget, not the engine, limited the user
    backlog_s: float  # their summed length
    events: int
    tokens: int
    worst: SpacingWindow | None  # None: no window to judge (the engine, not the budget, limited the user)

    def allowance_tokens(self, slack_ns: int = 0) -> float:
        """1 + N * (P + slack): what a correct limiter may fall short in any window."""
        return 1 + self.limit_tps * (self.step_ns + slack_ns) / NS_PER_S


def _collapse(t: np.ndarray, c: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Events at equal times merged: (distinct times, tokens at each)."""
    if len(t) == 0:
        return t, np.empty(0, dtype=np.int64)
    new = np.empty(len(t), dtype=bool)
    new[0] = True
    np.not_equal(t[1:], t[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    if c is None:
        counts = np.diff(np.append(starts, len(t)))
    else:
        counts = np.add.reduceat(c, starts)
    return t[starts], counts.astype(np.int64)


def worst_deficit(t_ns: np.ndarray, counts: np.ndarray | None, limit_tps: int) -> tuple[int, int, int] | None:
    """(i, j, deficit * 1e9) of the emptiest open window between time-sorted distinct events
    (``counts`` tokens each); None with fewer than two distinct times."""
    n = len(t_ns)
    if n < 2:
        return None
    t_rel = (t_ns - t_ns[0]).astype(np.int64)
    tokens = int(counts.sum())
    incl = np.cumsum(counts, dtype=np.int64)
    if tokens * NS_PER_S + limit_tps * int(t_rel[-1]) < _INT64_SAFE:
        nt = t_rel * np.int64(limit_tps)
        v = nt - incl * np.int64(NS_PER_S)
        u = nt - (incl - counts) * np.int64(NS_PER_S)
    else:  # exact, slower: Python integers
        nt = t_rel.astype(object) * int(limit_tps)
        v = nt - incl.astype(object) * NS_PER_S
        u = nt - (incl - counts).astype(object) * NS_PER_S
    run_min = np.minimum.accumulate(v[:-1])  # min over i < j, for j = 1..n-1
    d = u[1:] - run_min
    j = int(np.argmax(d)) + 1
    i = int(np.argmin(v[:j]))
    return i, j, int(d[j - 1])


def budget_limited_intervals(req_first_ns: np.ndarray, req_last_ns: np.ndarray, step_start_ns: np.ndarray,
                             step_period_ns: np.ndarray, step_worked: np.ndarray, limit_tps: int,
                             burst_ns: int = BURST_NS) -> np.ndarray:
    """Runs of consecutive engine steps at which the user could take every token its budget allowed:
    at least ``ceil(N * period)`` of its requests waiting when the engine went straight on to the
    next step (one token per waiting request per step), at least one when it then waited (it waited
    for a budget); a step that kept the engine longer than the burst ends a run (the waiting user
    loses what was due beyond the burst). Each request waits from its first to its last event. An (m, 2)
    array of [first step, last step] starts."""
    s = np.asarray(step_start_ns, dtype=np.int64)
    if len(s) == 0 or len(req_first_ns) == 0:
        return np.empty((0, 2), dtype=np.int64)
    first, last = np.sort(req_first_ns), np.sort(req_last_ns)
    waiting = np.searchsorted(first, s, side="right") - np.searchsorted(last, s, side="left")
    periods = np.asarray(step_period_ns, dtype=np.int64)
    worked = np.asarray(step_worked, dtype=bool)
    need = np.maximum(1, -(-int(limit_tps) * periods // NS_PER_S))
    need[~worked] = 1
    # a step longer than the burst costs a waiting user budget for good (GCRA keeps no credit past it)
    ok = (waiting >= need) & ~(worked & (periods > burst_ns))
    # a run goes on to the next step only if some request still waits after this one (the user's last
    # request ending here, and the next one's prefill before its first token, break it)
    still = np.searchsorted(first, s, side="right") - np.searchsorted(last, s, side="right") > 0
    joined = ok[:-1] & ok[1:] & still[:-1]
    begins = ok & ~np.r_[False, joined]
    ends = ok & ~np.r_[joined, False]
    return np.stack([s[begins], s[ends]], axis=1)


def _longest_judged_period(intervals: np.ndarray, step_start_ns, step_period_ns) -> int:
    """The longest period of a step that starts inside one of the runs ([first, last] step start);
    0 when there is none."""
    starts = np.asarray(step_start_ns, dtype=np.int64)
    periods = np.asarray(step_period_ns, dtype=np.int64)
    if len(starts) == 0 or len(intervals) == 0:
        return 0
    lo = np.searchsorted(starts, intervals[:, 0], side="left")
    hi = np.searchsorted(starts, intervals[:, 1], side="right")
    longest = [int(periods[a:b].max()) for a, b in zip(lo.tolist(), hi.tolist()) if b > a]
    return max(longest, default=0)


def check_spacing(
    t_ns: np.ndarray,
    req: np.ndarray,
    limit_tps: int,
    step_start_ns: np.ndarray,
    step_period_ns: np.ndarray,
    step_worked: np.ndarray,
    *,
    counts: np.ndarray | None = None,
    shift_ns: int = 0,
) -> SpacingResult:
    """Even spacing of one user's time-sorted events (``req``: each event's request) in one phase.

    ``step_start_ns``, ``step_period_ns``, ``step_worked``: the engine's steps in the phase
    (``steps.step_periods``);
    P is the longest period. ``shift_ns``: how far events may move against the step starts (the
    longest dispatch-to-emit latency, for emit events; 0 for dispatch events). Windows are taken
    inside runs of steps at which the user's waiting requests could take every token its budget
    allowed (``budget_limited_intervals``): elsewhere the engine, not the budget, limits it.
    """
    t = np.asarray(t_ns, dtype=np.int64)
    req = np.asarray(req)
    c = None if counts is None else np.asarray(counts, dtype=np.int64)
    tokens = len(t) if c is None else int(c.sum())
    if len(t) == 0:
        p_ns = (int(np.max(step_period_ns)) if len(step_period_ns) else 0) + int(shift_ns)
        return SpacingResult(limit_tps, p_ns, 0, 0.0, 0, 0, None)
    order = np.argsort(req, kind="stable")
    r_sorted = req[order]
    bounds = np.flatnonzero(np.r_[True, r_sorted[1:] != r_sorted[:-1]])
    firsts = np.minimum.reduceat(t[order], bounds)
    lasts = np.maximum.reduceat(t[order], bounds)
    intervals = budget_limited_intervals(firsts, lasts, step_start_ns, step_period_ns, step_worked, limit_tps)
    # P: the longest step period among the steps judged (inside the runs): a long step elsewhere (a
    # prefill before the user's first token, the engine idle between requests) bounds no window here
    p_ns = _longest_judged_period(intervals, step_start_ns, step_period_ns) + int(shift_ns)
    if shift_ns:  # emit events come after their step's start
        intervals = intervals + np.array([0, int(shift_ns)], dtype=np.int64)
    best = None  # (deficit * 1e9, start, end, tokens inside, expected)
    lo = np.searchsorted(t, intervals[:, 0], side="left")
    hi = np.searchsorted(t, intervals[:, 1], side="right")
    for a, b in zip(lo.tolist(), hi.tolist()):
        tt, cc = _collapse(t[a:b], None if c is None else c[a:b])
        found = worst_deficit(tt, cc, limit_tps)
        if found is None:
            continue
        i, j, d = found
        if best is None or d > best[0]:
            best = (d, int(tt[i]), int(tt[j]), int(cc[i + 1:j].sum()), limit_tps * int(tt[j] - tt[i]) / NS_PER_S)
    backlog_s = float((intervals[:, 1] - intervals[:, 0]).sum()) / NS_PER_S
    worst = None if best is None else SpacingWindow(*best[1:])
    return SpacingResult(limit_tps, p_ns, len(intervals), backlog_s, len(t), tokens, worst)
