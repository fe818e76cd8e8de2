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
    if g.size == 0:
        return None
    p50, p90, p99 = np.percentile(g, QUANTILES)
    return GapStats(int(g.size), int(g.min()), float(p50), float(p90), float(p99), int(g.max()))


def gaps_per_request(t_ns: np.ndarray, request: np.ndarray) -> np.ndarray:
    """Gaps between consecutive events of the same request (input time-sorted)."""
    groups = group_by(np.asarray(request))
    t = np.asarray(t_ns, dtype=np.int64)[groups.order]
    d, _ = diffs_within(t, groups.codes[groups.order])
    return d


def gaps_merged(t_ns: np.ndarray) -> np.ndarray:
    """Gaps between consecutive events of a merged, time-sorted stream."""
    t = np.asarray(t_ns, dtype=np.int64)
    return np.diff(np.sort(t)) if t.size > 1 else np.empty(0, dtype=np.int64)
