"""Inter-token gaps.

Definitions (stated in every report):

* per request: time between consecutive emit events (engine) or consecutive
  token-carrying chunks (client) of the same request, pooled over the user's
  requests in the phase; tokens that arrive in one event or chunk have no gap
  between them.
* per user: the same over all the user's events or chunks merged in time
  order (the gap between a user's tokens whichever stream they went to).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ratebench.analysis.segments import diffs_within, group_by

QUANTILES = (50, 90, 99)


@dataclass
class GapStats:
    count: int
    min_ns: int
    p50_ns: float
    p90_ns: float
    p99_ns: float
    max_ns: int


def gap_stats(gaps_ns: np.ndarray) -> GapStats | None:
    """min, p50, p90, p99 (linear interpolation) and max of gaps; None when there are none."""
    g = np.asarray(gaps_ns)
    n = g.size
    if n == 0:
        return None
    # numpy's default ("linear") percentiles, from one partition around every index they need
    pos = [q / 100 * (n - 1) for q in QUANTILES]
    kth = sorted({0, n - 1} | {int(np.floor(p)) for p in pos} | {min(int(np.floor(p)) + 1, n - 1) for p in pos})
    part = np.partition(g, kth)

    def at(p: float) -> float:
        lo = int(np.floor(p))
        hi = min(lo + 1, n - 1)
        return float(part[lo] + (part[hi] - part[lo]) * (p - lo))

    p50, p90, p99 = (at(p) for p in pos)
    return GapStats(int(n), int(part[0]), p50, p90, p99, int(part[n - 1]))


def gaps_per_request(t_ns: np.ndarray, request: np.ndarray) -> np.ndarray:
    """Gaps between consecutive events of the same request (input time-sorted)."""
    groups = group_by(np.asarray(request))
    t = np.asarray(t_ns, dtype=np.int64)[groups.order]
    d, _ = diffs_within(t, groups.codes[groups.order])
    return d


def gaps_merged(t_ns: np.ndarray) -> np.ndarray:
    """Gaps between consecutive events of a merged, time-sorted stream."""
    t = np.asarray(t_ns, dtype=np.int64)
    if t.size < 2:
        return np.empty(0, dtype=np.int64)
    d = np.diff(t)
    return d if d.min() >= 0 else np.diff(np.sort(t))
