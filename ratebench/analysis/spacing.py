"""Even spacing: the lower side of the bound on every window, checked exactly in one pass.

The promise (docs/promise.md section 1, promise 2): a user's budget is spent evenly over
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
requests waiting, counted up to the engine's places (``max_num_active_seqs``: a
step gives a token to no more requests than that, so a user with more streams
than places is held to ``places`` tokens a step by the engine), at a step after
which the engine went straight on, at least
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
    """Even spacing measured on one user's events in one phase (``analysis/checks/even.py`` judges it)."""

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


_LOW = np.iinfo(np.int64).min
_NOT_WORKED = -(2**62)  # the key of a step after which the engine waited: at or under every threshold


def _max_tree(values: np.ndarray) -> tuple[np.ndarray, int]:
    """A bottom-up segment tree of maxima over ``values`` (leaves at ``size + i``, padding ``_LOW``)."""
    n = len(values)
    size = 1 << max(n - 1, 0).bit_length()
    tree = np.full(2 * size, _LOW, dtype=np.int64)
    tree[size:size + n] = values
    k = size
    while k > 1:
        np.maximum(tree[k:2 * k:2], tree[k + 1:2 * k:2], out=tree[k // 2:k])
        k //= 2
    return tree, size


def _first_above(tree: np.ndarray, size: int, n: int, pos: np.ndarray, bar: np.ndarray) -> np.ndarray:
    """For each query: the first leaf index ``>= pos`` whose value is ``> bar``, else ``n``.
    Vectorized over the queries; O(log n) numpy passes, each over the queries still open."""
    pos = np.asarray(pos, dtype=np.int64)
    bar = np.asarray(bar, dtype=np.int64)
    out = np.full(len(pos), n, dtype=np.int64)
    q = np.flatnonzero(pos < n)
    if not len(q):
        return out
    node = pos[q] + size
    hit = tree[node] > bar[q]
    out[q[hit]] = pos[q[hit]]
    q, node = q[~hit], node[~hit]
    found_q, found_node = [], []
    while len(q):  # climb: a left child's right sibling covers what follows it
        left = (node & 1) == 0
        sib = np.where(left, node + 1, node)
        ok = left & (tree[sib] > bar[q])
        found_q.append(q[ok])
        found_node.append(sib[ok])
        node = node[~ok] >> 1
        q = q[~ok]
        more = node > 1
        q, node = q[more], node[more]
    if found_q:
        q = np.concatenate(found_q)
        node = np.concatenate(found_node)
        b = bar[q]
        while len(node) and node.min() < size:  # descend to the leftmost leaf above the bar
            inner = node < size
            child = 2 * node[inner]
            node[inner] = np.where(tree[child] > b[inner], child, child + 1)
        out[q] = node - size
    return out


def _range_max(tree: np.ndarray, size: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max(values[lo:hi]) per query (``_LOW`` when empty), vectorized."""
    l = np.asarray(lo, dtype=np.int64) + size
    r = np.asarray(hi, dtype=np.int64) + size
    res = np.full(len(l), _LOW, dtype=np.int64)
    while True:
        m = l < r
        if not m.any():
            return res
        a = m & ((l & 1) == 1)
        res[a] = np.maximum(res[a], tree[l[a]])
        l[a] += 1
        b = m & ((r & 1) == 1)
        r[b] -= 1
        res[b] = np.maximum(res[b], tree[r[b]])
        l >>= 1
        r >>= 1


class StepIndex:
    """The engine's steps of one phase, indexed once so that each user's figures cost O(its own
    requests and runs x log steps), never a pass over every step (``budget_limited_intervals``).

    A step is *too long* for a user with ``w`` requests waiting (counted up to the engine's places)
    at limit ``N`` when the engine went
    straight on after it and its period ``p`` exceeds ``min(burst, floor(w * 1e9 / N))`` (exactly
    ``ceil(N p / 1e9) > w`` or ``p > burst``); a step after which the engine waited never is. So one
    key per step (``p``, or a low constant when the engine waited) against one threshold per run of
    steps with the same requests waiting decides it: segment trees of the keys (max, and max of the
    negated keys for the first step *not* too long) and of the periods (P over the runs judged).
    """

    def __init__(self, step_start_ns, step_period_ns, step_worked, burst_ns: int = BURST_NS,
                 places: int | None = None) -> None:
        self.starts = np.asarray(step_start_ns, dtype=np.int64)
        # the engine's places (``max_num_active_seqs``): at most this many of a user's requests get a
        # token in one step, however many wait (None: no cap)
        self.places = None if not places else int(places)
        self.periods = np.asarray(step_period_ns, dtype=np.int64)
        self.worked = np.asarray(step_worked, dtype=bool)
        self.burst_ns = int(burst_ns)
        self.n = len(self.starts)
        self.sorted = bool(self.n < 2 or (self.starts[1:] >= self.starts[:-1]).all())
        key = np.where(self.worked, self.periods, _NOT_WORKED)
        self._key, self.size = _max_tree(key)
        self._neg_key, _ = _max_tree(-key)
        self._period, _ = _max_tree(self.periods)
        self.longest_period = int(self.periods.max()) if self.n else 0

    def first_too_long(self, pos: np.ndarray, bar: np.ndarray) -> np.ndarray:
        return _first_above(self._key, self.size, self.n, pos, bar)

    def first_not_too_long(self, pos: np.ndarray, bar: np.ndarray) -> np.ndarray:
        # key <= bar  <=>  -key > -bar - 1 (integers)
        return _first_above(self._neg_key, self.size, self.n, pos, -np.asarray(bar, dtype=np.int64) - 1)

    def longest_in(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return _range_max(self._period, self.size, lo, hi)


def budget_limited_intervals_scan(req_first_ns: np.ndarray, req_last_ns: np.ndarray, step_start_ns: np.ndarray,
                             step_period_ns: np.ndarray, step_worked: np.ndarray, limit_tps: int,
                             burst_ns: int = BURST_NS, places: int | None = None) -> np.ndarray:
    """Runs of consecutive engine steps at which the user could take every token its budget allowed:
    at least ``ceil(N * period)`` of its requests waiting when the engine went straight on to the
    next step (one token per waiting request per step), at least one when it then waited (it waited
    for a budget); a step that kept the engine longer than the burst ends a run (the waiting user
    loses what was due beyond the burst). Waiting requests count up to ``places`` (the engine's
    ``max_num_active_seqs``: no more of them get a token in one step; None: no cap). Each request
    waits from its first to its last event. An (m, 2) array of [first step, last step] starts.

    The reference: one pass over every step of the phase (O(steps) per user). ``budget_limited_intervals``
    gives the same runs from a :class:`StepIndex` in O(the user's requests and runs x log steps)."""
    s = np.asarray(step_start_ns, dtype=np.int64)
    if len(s) == 0 or len(req_first_ns) == 0:
        return np.empty((0, 2), dtype=np.int64)
    first, last = np.sort(req_first_ns), np.sort(req_last_ns)
    waiting = np.searchsorted(first, s, side="right") - np.searchsorted(last, s, side="left")
    if places:
        waiting = np.minimum(waiting, int(places))
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


def budget_limited_intervals(req_first_ns: np.ndarray, req_last_ns: np.ndarray, step_start_ns: np.ndarray,
                             step_period_ns: np.ndarray, step_worked: np.ndarray, limit_tps: int,
                             burst_ns: int = BURST_NS, *, index: StepIndex | None = None) -> np.ndarray:
    """Runs of consecutive engine steps at which the user could take every token its budget allowed
    (``budget_limited_intervals_scan`` says which), found from the phase's :class:`StepIndex` (built
    here when not given; pass one per phase when calling per user). An (m, 2) array of [first step,
    last step] starts."""
    if index is None:
        index = StepIndex(step_start_ns, step_period_ns, step_worked, burst_ns)
    if not index.sorted or int(burst_ns) != index.burst_ns:
        return budget_limited_intervals_scan(req_first_ns, req_last_ns, index.starts, index.periods, index.worked,
                                             limit_tps, burst_ns, index.places)
    first = np.asarray(req_first_ns, dtype=np.int64)
    _, intervals = grouped_intervals(index, np.zeros(len(first), dtype=np.int64), first,
                                     np.asarray(req_last_ns, dtype=np.int64), np.array([int(limit_tps)]))
    return intervals


def grouped_intervals(index: StepIndex, group: np.ndarray, req_first_ns: np.ndarray, req_last_ns: np.ndarray,
                      limit_tps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``budget_limited_intervals`` for several users at once (``group``: each request's user, an index
    into ``limit_tps``) on one phase's sorted steps: (each run's user, the runs), by user then time.

    A user's waiting and ending requests change only at its requests' first and last events, so its
    steps fall into O(requests) segments with one count of waiting requests each (one threshold
    each); inside a segment the runs are the stretches between steps too long for that threshold,
    found with the index, so the cost is O((requests + runs) x log steps)."""
    s, n = index.starts, index.n
    empty = (np.empty(0, dtype=np.int64), np.empty((0, 2), dtype=np.int64))
    if n == 0 or len(req_first_ns) == 0:
        return empty
    group = np.asarray(group, dtype=np.int64)
    r = len(group)
    # a request waits at step k when first <= s_k <= last; it still waits after it when s_k < last
    points = np.concatenate((np.searchsorted(s, req_first_ns, side="left"),
                             np.searchsorted(s, req_last_ns, side="right"),
                             np.searchsorted(s, req_last_ns, side="left")))
    d_wait = np.repeat(np.array([1, -1, 0], dtype=np.int64), r)
    d_still = np.repeat(np.array([1, 0, -1], dtype=np.int64), r)
    g3 = np.tile(group, 3)
    order = np.lexsort((points, g3))
    points, g3 = points[order], g3[order]
    wait, still = np.cumsum(d_wait[order]), np.cumsum(d_still[order])  # each user's deltas sum to 0
    last_of = np.r_[(points[1:] != points[:-1]) | (g3[1:] != g3[:-1]), True]
    lo, seg_g, wait, still = points[last_of], g3[last_of], wait[last_of], still[last_of] > 0
    hi = np.r_[lo[1:], n]
    hi[np.r_[seg_g[1:] != seg_g[:-1], True]] = n
    keep = (wait >= 1) & (lo < hi)
    lo, hi, seg_g, wait, still = lo[keep], hi[keep], seg_g[keep], wait[keep], still[keep]
    if not len(lo):
        return empty
    lim = np.asarray(limit_tps, dtype=np.int64)[seg_g]
    if index.places:  # no more than the engine's places get a token in one step
        wait = np.minimum(wait, index.places)
    bar = np.full(len(lo), index.burst_ns, dtype=np.int64)
    pos_lim = lim > 0
    # ceil(N p / 1e9) <= w  <=>  p <= floor(w 1e9 / N)
    bar[pos_lim] = np.minimum(bar[pos_lim], wait[pos_lim] * NS_PER_S // lim[pos_lim])
    run_seg, run_a, run_b = [], [], []
    seg = np.arange(len(lo), dtype=np.int64)
    pos = lo.copy()
    while len(seg):
        a = index.first_not_too_long(pos, bar[seg])
        inside = a < hi[seg]
        seg, a = seg[inside], a[inside]
        e = index.first_too_long(a, bar[seg])
        run_seg.append(seg)
        run_a.append(a)
        run_b.append(np.minimum(e, hi[seg]) - 1)
        more = e < hi[seg]
        seg, pos = seg[more], e[more]
    run_seg, run_a, run_b = np.concatenate(run_seg), np.concatenate(run_a), np.concatenate(run_b)
    if not len(run_seg):
        return empty
    o = np.lexsort((run_a, run_seg))
    run_seg, run_a, run_b = run_seg[o], run_a[o], run_b[o]
    alone = ~still[run_seg]
    if alone.any():  # no request waits past these steps: each step is a run of its own
        k = run_b - run_a + 1
        k[~alone] = 1
        run_seg = np.repeat(run_seg, k)
        base = np.repeat(run_a, k)
        within = np.arange(len(run_seg), dtype=np.int64) - np.repeat(np.cumsum(k) - k, k)
        run_b = np.repeat(run_b, k)
        single = np.repeat(alone, k)
        run_a = np.where(single, base + within, base)
        run_b = np.where(single, run_a, run_b)
    run_g = seg_g[run_seg]
    joined = (run_g[1:] == run_g[:-1]) & (run_b[:-1] + 1 == run_a[1:]) & still[run_seg[:-1]]
    begins = ~np.r_[False, joined]
    ends = ~np.r_[joined, False]
    return run_g[begins], np.stack([s[run_a[begins]], s[run_b[ends]]], axis=1)


def grouped_longest_periods(index: StepIndex, interval_group: np.ndarray, intervals: np.ndarray,
                            n_groups: int) -> np.ndarray:
    """``_longest_judged_period`` per user for ``grouped_intervals``' runs: O(runs x log steps)."""
    out = np.full(n_groups, _LOW, dtype=np.int64)
    if index.n and len(intervals):
        lo = np.searchsorted(index.starts, intervals[:, 0], side="left")
        hi = np.searchsorted(index.starts, intervals[:, 1], side="right")
        np.maximum.at(out, np.asarray(interval_group, dtype=np.int64), index.longest_in(lo, hi))
    out[out == _LOW] = 0
    return out


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
    index: StepIndex | None = None,
    places: int | None = None,
) -> SpacingResult:
    """Even spacing of one user's time-sorted events (``req``: each event's request) in one phase.

    ``step_start_ns``, ``step_period_ns``, ``step_worked``: the engine's steps in the phase
    (``steps.step_periods``);
    P is the longest period. ``shift_ns``: how far events may move against the step starts (the
    longest dispatch-to-emit latency, for emit events; 0 for dispatch events). Windows are taken
    inside runs of steps at which the user's waiting requests could take every token its budget
    allowed (``budget_limited_intervals``): elsewhere the engine, not the budget, limits it.
    ``index``: the phase's :class:`StepIndex` of these steps, built once per phase by a caller that
    checks many users (then each costs O(its own events and requests), not a pass over the steps).
    ``places``: the engine's ``max_num_active_seqs`` when no ``index`` is given (the index's own otherwise).
    """
    t = np.asarray(t_ns, dtype=np.int64)
    req = np.asarray(req)
    c = None if counts is None else np.asarray(counts, dtype=np.int64)
    if len(t) == 0:
        longest = index.longest_period if index is not None else (
            int(np.max(step_period_ns)) if len(step_period_ns) else 0)
        return SpacingResult(limit_tps, longest + int(shift_ns), 0, 0.0, 0, 0, None)
    if index is None:
        index = StepIndex(step_start_ns, step_period_ns, step_worked, places=places)
    firsts, lasts = _request_spans(t, req)
    intervals = budget_limited_intervals(firsts, lasts, index.starts, index.periods, index.worked, limit_tps,
                                         index.burst_ns, index=index)
    # P: the longest step period among the steps judged (inside the runs): a long step elsewhere (a
    # prefill before the user's first token, the engine idle between requests) bounds no window here
    if index.sorted:
        p_ns = int(grouped_longest_periods(index, np.zeros(len(intervals), dtype=np.int64), intervals, 1)[0])
    else:
        p_ns = _longest_judged_period(intervals, index.starts, index.periods)
    return _spacing_in_runs(t, c, limit_tps, intervals, p_ns, shift_ns)


def _request_spans(t: np.ndarray, req: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each request's first and last event time (requests in code order)."""
    order = np.argsort(req, kind="stable")
    r_sorted = req[order]
    bounds = np.flatnonzero(np.r_[True, r_sorted[1:] != r_sorted[:-1]])
    return np.minimum.reduceat(t[order], bounds), np.maximum.reduceat(t[order], bounds)


def _spacing_in_runs(t: np.ndarray, c: np.ndarray | None, limit_tps: int, intervals: np.ndarray, p_ns: int,
                     shift_ns: int) -> SpacingResult:
    """The emptiest window of the user's events inside its runs of steps (P: ``p_ns``)."""
    tokens = len(t) if c is None else int(c.sum())
    p_ns = int(p_ns) + int(shift_ns)
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


def check_spacing_many(users: list[tuple], index: StepIndex, shift_ns: int = 0) -> list[SpacingResult]:
    """``check_spacing`` of many users of one phase at once: ``users`` holds (time-sorted event times,
    each event's request, limit, counts or None) per user; ``index``: the phase's steps. The runs of
    steps of every user come from one pass over all their requests (``grouped_intervals``), so the
    phase costs O(events + (requests + runs) x log steps), whatever the number of users."""
    out: list[SpacingResult | None] = [None] * len(users)
    spans, groups, limits = [], [], []
    for k, (t, req, limit, counts) in enumerate(users):
        t = np.asarray(t, dtype=np.int64)
        if len(t) == 0:
            out[k] = SpacingResult(limit, index.longest_period + int(shift_ns), 0, 0.0, 0, 0, None)
            continue
        f, l_ = _request_spans(t, np.asarray(req))
        spans.append((f, l_))
        groups.append(np.full(len(f), k, dtype=np.int64))
        limits.append(limit)
    todo = [k for k in range(len(users)) if out[k] is None]
    if not todo:
        return out
    if not index.sorted:
        for k in todo:
            t, req, limit, counts = users[k]
            out[k] = check_spacing(t, req, limit, index.starts, index.periods, index.worked, counts=counts,
                                   shift_ns=shift_ns, index=index)
        return out
    lim = np.zeros(len(users), dtype=np.int64)
    lim[todo] = limits
    g, intervals = grouped_intervals(index, np.concatenate(groups), np.concatenate([f for f, _ in spans]),
                                     np.concatenate([l_ for _, l_ in spans]), lim)
    longest = grouped_longest_periods(index, g, intervals, len(users))
    cut = np.searchsorted(g, np.arange(len(users) + 1))
    for k in todo:
        t, req, limit, counts = users[k]
        c = None if counts is None else np.asarray(counts, dtype=np.int64)
        out[k] = _spacing_in_runs(np.asarray(t, dtype=np.int64), c, limit, intervals[cut[k]:cut[k + 1]],
                                  int(longest[k]), shift_ns)
    return out
