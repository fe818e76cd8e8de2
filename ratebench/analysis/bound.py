"""The bound on every window, checked exactly in one pass.

The promise: in any window of W seconds a user receives at most
``(W + B) * N + 1`` output tokens, with N the user's limit (tok/s) and B the
burst tolerance (0.1 s).

Derivation (why one pass over a running minimum is exact)
-----------------------------------------------------------
Let the user's events be sorted by time, ``t_0 <= t_1 <= ... <= t_{n-1}``
(integer ns), event k carrying ``c_k >= 1`` tokens (1 for dispatch events).
Let ``C_k = c_0 + ... + c_k`` (inclusive) and ``P_k = C_k - c_k`` (exclusive).

A window is the closed interval ``[s, s + W]``. Shrinking it to start at its
first event ``t_i`` and end at its last event ``t_j`` keeps its tokens and does
not lengthen it, so the bound holds for every window iff it holds for every
closed window ``[t_i, t_j]``, ``i <= j``, taking ``i`` as the first event at
time ``t_i`` and ``j`` as the last event at time ``t_j`` (pairs inside a run of
equal times count fewer tokens and the same length, so including them in the
maximum changes nothing). That window holds ``C_j - P_i`` tokens and is
``t_j - t_i`` long, so the bound reads::

    C_j - P_i <= (t_j - t_i + B) * N + 1
    (C_j - 1 - N t_j) - (P_i - N t_i) <= B * N

The "+1" is what makes the window closed: with one token per event
(``C_j - 1 = j``, ``P_i = i``) this is ``a_j - a_i <= B N`` with
``a_k = k - N t_k``; the "+1" pays for counting both end points. So the bound
holds for all W iff::

    max over j of ( u_j - min over i <= j of v_i ) <= B * N
    u_j = C_j - 1 - N t_j,   v_i = P_i - N t_i

one pass with a running minimum of ``v``. (``i = j`` gives ``c_j - 1 <= B N``:
one event may carry at most ``B N + 1`` tokens.) A tolerance T (the longest
engine step, for emit events which lag their dispatch) widens every window:
the limit becomes ``(B + T) * N``.

Exact integers: multiplying by 1e9, with t in ns relative to the user's first
event, the test is ``(C_j - 1) 1e9 - N t_j - (P_i 1e9 - N t_i) <= N (B_ns + T_ns)``.
Each term is below ``tokens * 1e9 + N * span_ns``; when that could pass 2**62
the group is computed in Python integers (numpy object arrays) instead of int64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ratebench.analysis.segments import group_by, time_order

NS_PER_S = 1_000_000_000
BURST_NS = 100_000_000  # the promise's burst tolerance: 0.1 s
_INT64_SAFE = 2**62


@dataclass
class WorstWindow:
    """The window closest to (or furthest past) the bound."""

    start_ns: int
    end_ns: int
    tokens: int
    allowed_tokens: float  # (W + burst + tolerance) * N + 1
    slack_tokens: float  # allowed - tokens; negative when the bound is broken

    @property
    def window_s(self) -> float:
        return (self.end_ns - self.start_ns) / NS_PER_S


@dataclass
class BoundResult:
    """The bound checked on one user's events."""

    limit_tps: int
    burst_ns: int
    tolerance_ns: int
    events: int
    tokens: int
    passed: bool
    worst: WorstWindow | None  # None when there are no events


def _worst_pair(t_rel: np.ndarray, c_incl: np.ndarray | None, c: np.ndarray | None, limit_tps: int):
    """(i, j, max of u_j - v_i) on one group; t_rel int64 ns from the group's first event.

    ``c`` None: one token per event, where u = v = k * 1e9 - N t_k.
    """
    n = len(t_rel)
    n_tokens = n if c_incl is None else int(c_incl[-1])
    span_ns = int(t_rel[-1])
    if n_tokens * NS_PER_S + limit_tps * span_ns < _INT64_SAFE:
        nt = t_rel * np.int64(limit_tps)
        if c is None:
            u = np.arange(0, n * NS_PER_S, NS_PER_S, dtype=np.int64)
            u -= nt
            v = u
        else:
            u = (c_incl - 1) * np.int64(NS_PER_S) - nt
            v = u - (c - 1) * np.int64(NS_PER_S)
    else:  # exact, slower: Python integers
        nt = t_rel.astype(object) * int(limit_tps)
        ci = np.arange(1, n + 1, dtype=np.int64) if c_incl is None else c_incl
        cc = np.ones(n, dtype=np.int64) if c is None else c
        u = (ci.astype(object) - 1) * NS_PER_S - nt
        v = u - (cc.astype(object) - 1) * NS_PER_S
    d = u - np.minimum.accumulate(v)
    j = int(np.argmax(d))
    i = int(np.argmin(v[: j + 1]))
    return i, j, int(d[j])


def bound_result(
    t: np.ndarray, c: np.ndarray | None, limit_tps: int, burst_ns: int = BURST_NS, tolerance_ns: int = 0
) -> BoundResult:
    """The bound on one user's time-sorted events (``c`` None: one token each; no zero counts)."""
    n = len(t)
    if n == 0:
        return BoundResult(limit_tps, burst_ns, tolerance_ns, 0, 0, True, None)
    c_incl = None if c is None else np.cumsum(c, dtype=np.int64)
    t_rel = t - t[0]
    if t_rel.dtype != np.int64:
        t_rel = t_rel.astype(np.int64)
    i, j, max_diff = _worst_pair(t_rel, c_incl, c, limit_tps)
    budget = limit_tps * (burst_ns + tolerance_ns)
    if c is None:
        tokens, total = j - i + 1, n
    else:
        tokens, total = int(c_incl[j] - (c_incl[i] - c[i])), int(c_incl[-1])
    width_ns = int(t[j] - t[i])
    allowed = (width_ns + burst_ns + tolerance_ns) * limit_tps / NS_PER_S + 1
    slack = (budget - max_diff) / NS_PER_S
    worst = WorstWindow(int(t[i]), int(t[j]), tokens, allowed, slack)
    return BoundResult(limit_tps, burst_ns, tolerance_ns, n, total, max_diff <= budget, worst)


def check_bound(
    t_ns: np.ndarray,
    limit_tps: int,
    *,
    counts: np.ndarray | None = None,
    burst_ns: int = BURST_NS,
    tolerance_ns: int = 0,
) -> BoundResult:
    """Check ``tokens in any window W <= (W + burst) * N + 1`` on one user's events.

    ``t_ns``: event times (int ns, any order); ``counts``: tokens per event (default 1);
    ``tolerance_ns`` widens every window (for emit events: the longest engine step of the phase).
    Exact integer arithmetic, O(n) after sorting.
    """
    return check_bound_grouped(
        t_ns, np.zeros(len(t_ns), dtype=np.int64), {0: limit_tps},
        counts=counts, burst_ns=burst_ns, tolerance_ns=tolerance_ns,
    ).get(0) or BoundResult(int(limit_tps), burst_ns, tolerance_ns, 0, 0, True, None)


def check_bound_grouped(
    t_ns: np.ndarray,
    keys: np.ndarray,
    limit_tps: Mapping[int | str, int | None],
    *,
    counts: np.ndarray | None = None,
    burst_ns: int = BURST_NS,
    tolerance_ns: int = 0,
) -> dict[int, BoundResult]:
    """``check_bound`` for every group of ``keys`` (user codes or user names) at once.

    ``limit_tps`` maps a key to its limit; keys without a limit (absent or None)
    are skipped. One stable sort by time (skipped when already sorted) and one by key.
    """
    t = np.asarray(t_ns, dtype=np.int64)
    keys = np.asarray(keys)
    c = None if counts is None else np.asarray(counts, dtype=np.int64)
    if c is not None:
        if np.any(c < 0):
            raise ValueError("token counts must be non-negative")
        keep = c > 0  # an event carrying no tokens adds nothing to any window
        if not keep.all():
            t, keys, c = t[keep], keys[keep], c[keep]
        if np.all(c == 1):
            c = None
    by_time = time_order(t)
    if by_time is not None:
        t, keys = t[by_time], keys[by_time]
        c = None if c is None else c[by_time]
    groups = group_by(keys)
    t = t[groups.order]
    c = None if c is None else c[groups.order]
    out: dict[int, BoundResult] = {}
    for _, key, sl in groups.slices():
        key = key.item() if hasattr(key, "item") else key  # numpy scalar -> int or str
        limit = limit_tps.get(key)
        if limit is None:
            continue
        out[key] = bound_result(t[sl], None if c is None else c[sl], int(limit), burst_ns, tolerance_ns)
    return out
