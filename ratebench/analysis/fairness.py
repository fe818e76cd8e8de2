"""Fairness: streams of one user take turns; equal limits get equal rates.

* stream spread: while all of a user's streams are active (from the moment the
  last of them got its first token to the moment the first of them got its
  last), count each stream's tokens since that start; the spread is the largest
  difference between two streams' counts at any event time. Strict turns give 1.
  **In service** (``requests`` given): for every two streams and every stretch
  of time in which both had a request in service (from a request's first token
  to its last), their counts since that stretch began: a stream between two of
  its requests, its next one queued for a slot, is out of the count while its
  siblings run (:func:`stream_spread`).
* Jain's index of the steady rates x of backlogged users with the same limit:
  (sum x)^2 / (n * sum x^2); 1 is perfectly even.
"""

from __future__ import annotations

import numpy as np

from ratebench.analysis.segments import dense_codes


def stream_spread(t_ns: np.ndarray, stream: np.ndarray, requests: np.ndarray | None = None) -> int | None:
    """Largest spread of per-stream token counts while all streams are active.

    ``t_ns`` time-sorted events of one user (one token each), ``stream`` their stream
    numbers. None for a single stream or when the streams never overlap. ``requests``
    (the events' request codes): the in-service spread instead, over every two streams and
    every stretch in which both had a request in service (from its first token to its last:
    a stream whose next request is queued is out of the count meanwhile) the largest
    difference of their counts since the stretch began; None when no two streams were ever
    in service together.
    """
    t = np.asarray(t_ns, dtype=np.int64)
    s, s_vals = dense_codes(np.asarray(stream))
    k = len(s_vals)
    if k < 2 or t.size == 0:
        return None
    if requests is not None:
        return _pairwise_in_service(t, s, k, np.asarray(requests))
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


def _service_spans(t: np.ndarray, s: np.ndarray, k: int, requests: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per stream: (starts, ends) of its requests in service, by start (from a request's first event
    to its last; overlapping requests of one stream merge)."""
    r, _ = dense_codes(requests)
    n_req = int(r.max()) + 1
    r_first = np.full(n_req, np.iinfo(np.int64).max)
    r_last = np.full(n_req, np.iinfo(np.int64).min)
    np.minimum.at(r_first, r, t)
    np.maximum.at(r_last, r, t)
    r_stream = np.zeros(n_req, dtype=np.int64)
    r_stream[r] = s
    out = []
    for j in range(k):
        mine = np.flatnonzero(r_stream == j)
        order = np.argsort(r_first[mine], kind="stable")
        out.append((r_first[mine][order], np.maximum.accumulate(r_last[mine][order])))
    return out


def _serving(spans: tuple[np.ndarray, np.ndarray], t: np.ndarray) -> np.ndarray:
    """Whether a stream had a request in service at each time of ``t``: after the request's first
    event, up to its last (as while all streams are active, the first token of the request that opens
    a stretch is not counted)."""
    starts, ends = spans
    i = np.searchsorted(starts, t, side="left") - 1  # the last request begun strictly before t
    return (i >= 0) & (t <= ends[np.maximum(i, 0)])


def _pairwise_in_service(t: np.ndarray, s: np.ndarray, k: int, requests: np.ndarray) -> int | None:
    """The in-service spread: over every two streams and every stretch of time in which both had a
    request in service, the largest difference of their token counts since that stretch began; None
    when no two streams were ever in service together. Each pair looks at its own two streams' events
    only: O(streams x events) in all."""
    spans = _service_spans(t, s, k, requests)
    events = [np.flatnonzero(s == j) for j in range(k)]
    worst = None
    for a in range(k):
        for b in range(a + 1, k):
            pair = np.sort(np.concatenate((events[a], events[b])))  # time order: t is sorted
            sp, tp = s[pair], t[pair]
            both = _serving(spans[a], tp) & _serving(spans[b], tp)
            if not both.any():
                continue
            step = np.where(both, np.where(sp == a, 1, -1), 0)
            total = np.cumsum(step)
            opens = both & ~np.concatenate(([False], both[:-1]))  # each stretch's first event
            stretch = np.cumsum(opens) - 1
            before = (total - step)[opens]  # the count difference just before each stretch
            diff = total - before[np.maximum(stretch, 0)]
            ends = np.append(tp[1:] != tp[:-1], True) & both  # after the last event of each instant
            if ends.any():
                d = int(np.abs(diff[ends]).max())
                worst = d if worst is None else max(worst, d)
    return worst


def jain_index(rates: np.ndarray) -> float | None:
    """Jain's fairness index; None for fewer than two values."""
    x = np.asarray(rates, dtype=float)
    if x.size < 2 or not np.any(x):
        return None
    return float(x.sum() ** 2 / (x.size * np.square(x).sum()))
