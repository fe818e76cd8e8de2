"""Fairness: streams of one user take turns; equal limits get equal rates.

* stream spread: while all of a user's streams are active (from the moment the
  last of them got its first token to the moment the first of them got its
  last), count each stream's tokens since that start; the spread is the largest
  difference between two streams' counts at any event time. Strict turns give 1.
* Jain's index of the steady rates x of backlogged users with the same limit:
  (sum x)^2 / (n * sum x^2); 1 is perfectly even.
"""

from __future__ import annotations

import numpy as np

from ratebench.analysis.segments import dense_codes


def stream_spread(t_ns: np.ndarray, stream: np.ndarray) -> int | None:
    """Largest spread of per-stream token counts while all streams are active.

    ``t_ns`` time-sorted events of one user (one token each), ``stream`` their stream
    numbers. None for a single stream or when the streams never overlap.
    """
    t = np.asarray(t_ns, dtype=np.int64)
    s, s_vals = dense_codes(np.asarray(stream))
    k = len(s_vals)
    if k < 2 or t.size == 0:
        return None
    first = np.full(k, np.iinfo(np.int64).max)
    last = np.full(k, np.iinfo(np.int64).min)
    np.minimum.at(first, s, t)
    np.maximum.at(last, s, t)
    start, end = first.max(), last.min()
    if start > end:
        return None
    w = (t > start) & (t <= end)
    if not w.any():
        return 0
    tw, sw = t[w], s[w]
    # each stream's count after every event: k running maxima, no n-by-k reductions
    hi = lo = None
    for j in range(k):
        pos = np.flatnonzero(sw == j)
        count = np.zeros(tw.size, dtype=np.int64)
        count[pos] = np.arange(1, pos.size + 1)
        np.maximum.accumulate(count, out=count)
        hi = count if hi is None else np.maximum(hi, count)
        lo = count if lo is None else np.minimum(lo, count)
    spread = hi - lo
    # several events at one instant happen together: look only after the last of them
    last_of_instant = np.append(tw[1:] != tw[:-1], True)
    return int(spread[last_of_instant].max())


def jain_index(rates: np.ndarray) -> float | None:
    """Jain's fairness index; None for fewer than two values."""
    x = np.asarray(rates, dtype=float)
    if x.size < 2 or not np.any(x):
        return None
    return float(x.sum() ** 2 / (x.size * np.square(x).sum()))
