"""The longest engine step, estimated from the engine's own events.

Emit events lag the dispatch that charged them by the time the engine takes to
run the step (two steps with async scheduling). A window over emit times
therefore covers dispatches from a window up to that lag wider, which is the
tolerance the bound gets on emit events.

Definition: each emit event is paired with the latest dispatch event of the
same request at or before it, but never with a later one than the dispatch of
its first token counted from the start plus the request's extra charges
(``dispatch events - emitted tokens`` when positive). Without extra charges
that is the k-th dispatch for the k-th token (charges happen in order; with
async scheduling the look-ahead dispatch of token k+1 comes before the emit of
token k, so "latest at or before" alone would pair them and halve the step).
Extra charges, wherever they fall (a charged prefill chunk before the first
token, the look-ahead step after a stop, a step dispatched before a cancel),
cannot stretch a pairing back past the latest dispatch before the emit. The
dispatch-to-emit latency of an emit event is its time minus its paired
dispatch's time; ``longest_ns`` is the largest such latency in the engine's file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ratebench.analysis.segments import Groups, group_by


@dataclass
class EngineStep:
    """Dispatch-to-emit latency of one engine, the emit-bound tolerance."""

    longest_ns: int  # 0 when it cannot be measured (see method)
    p50_ns: int | None
    p99_ns: int | None
    samples: int
    method: str  # "dispatch-to-emit", or "unavailable: <why>"


def estimate_engine_step(*args, **kwargs) -> EngineStep:
    """Latency from each emit event's dispatch (see the module) to the emit, over the whole engine
    (``step_latencies``' arguments)."""
    return engine_step(step_latencies(*args, **kwargs))


def engine_step(latencies: tuple[np.ndarray, np.ndarray] | str) -> EngineStep:
    """The summary of ``step_latencies``' result."""
    if isinstance(latencies, str):
        return EngineStep(0, None, None, 0, latencies)
    return _step(latencies[1], "dispatch-to-emit")


def step_latencies(
    dispatch_t_ns: np.ndarray,
    dispatch_req: np.ndarray,
    emit_t_ns: np.ndarray,
    emit_req: np.ndarray,
    emit_count: np.ndarray,
    *,
    dispatch_groups: Groups | None = None,
    emit_groups: Groups | None = None,
    grouped_times: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray] | str:
    """(emit times, their dispatch-to-emit latencies), in no particular order; a reason (str) when
    there are none.

    Inputs time-sorted; ``*_groups``: ``group_by`` of the request arrays, when already computed;
    ``grouped_times``: (dispatch, emit) times already taken in those groups' order.
    O(n) when no request has extra charges, else one binary search per emit event (O(n log n)).
    """
    if len(dispatch_t_ns) == 0 or len(emit_t_ns) == 0:
        return "unavailable: no dispatch or no emit events"
    n_codes = int(max(dispatch_req.max(), emit_req.max())) + 1
    d_groups = dispatch_groups or group_by(np.asarray(dispatch_req))
    e_groups = emit_groups or group_by(np.asarray(emit_req))
    if grouped_times is not None:
        d_t, e_t = grouped_times
    else:
        d_t = np.asarray(dispatch_t_ns)[d_groups.order]
        e_t = np.asarray(emit_t_ns)[e_groups.order]
    # times are sorted within each request when the input was time-ordered
    unit = bool(np.all(emit_count == 1))
    if unit and np.array_equal(d_groups.keys, e_groups.keys) and np.array_equal(d_groups.sizes, e_groups.sizes):
        # the usual case: every request has one dispatch per emitted token, in the same order; each
        # emit put back at its dispatch's place, so the steps' starts come time-sorted (step_periods)
        e_at = np.empty_like(e_t)
        e_at[d_groups.order] = e_t
        return e_at, e_at - np.asarray(dispatch_t_ns)
    d_count = np.zeros(n_codes, dtype=np.int64)
    d_start = np.zeros(n_codes, dtype=np.int64)
    d_count[d_groups.keys] = d_groups.sizes
    d_start[d_groups.keys] = d_groups.starts
    e_req = np.asarray(emit_req)[e_groups.order].astype(np.int64, copy=False)
    e_c = np.asarray(emit_count, dtype=np.int64)[e_groups.order]
    excl = np.cumsum(e_c) - e_c
    first_of_group = np.repeat(excl[e_groups.starts], e_groups.sizes)
    ordinal = excl - first_of_group  # tokens of this request emitted before this event
    emitted = np.zeros(n_codes, dtype=np.int64)
    emitted[e_groups.keys] = np.add.reduceat(e_c, e_groups.starts) if len(e_c) else 0
    extra = np.maximum(d_count - emitted, 0)
    latest = _latest_at_or_before(d_t, d_groups, e_t, e_groups, n_codes) - d_start[e_req]
    pair = np.minimum(np.minimum(ordinal + extra[e_req], d_count[e_req] - 1), latest)
    valid = (pair >= 0) & (e_c > 0)
    if not valid.any():
        return "unavailable: no emit follows a dispatch of its request"
    return e_t[valid], e_t[valid] - d_t[d_start[e_req[valid]] + pair[valid]]


def _latest_at_or_before(d_t: np.ndarray, d_groups: Groups, e_t: np.ndarray, e_groups: Groups,
                         n_codes: int) -> np.ndarray:
    """For each grouped emit, the index into grouped dispatches of the latest dispatch of its
    request at or before it (below its request's first dispatch when there is none).

    One ``searchsorted`` over all requests: each request's times are moved into its own
    interval of one increasing axis (time since the request's first event, plus the spans
    of the requests before it), so the grouped, per-request sorted times are sorted as a whole.
    """
    big = np.iinfo(np.int64).max
    first = np.full(n_codes, big, dtype=np.int64)
    last = np.full(n_codes, -big, dtype=np.int64)
    for t, g in ((d_t, d_groups), (e_t, e_groups)):
        if len(g):
            first[g.keys] = np.minimum(first[g.keys], t[g.starts])
            last[g.keys] = np.maximum(last[g.keys], t[g.ends - 1])
    span = np.where(last >= first, last - first + 1, 0)
    if int(span.sum(dtype=np.float64)) >= 2**62:  # cannot happen with real clocks; stay exact anyway
        out = np.empty(len(e_t), dtype=np.int64)
        d_start = dict(zip(d_groups.keys.tolist(), d_groups.starts.tolist()))
        d_end = dict(zip(d_groups.keys.tolist(), d_groups.ends.tolist()))
        for key, lo, hi in zip(e_groups.keys.tolist(), e_groups.starts.tolist(), e_groups.ends.tolist()):
            ds, de = d_start.get(key, 0), d_end.get(key, 0)
            out[lo:hi] = ds + np.searchsorted(d_t[ds:de], e_t[lo:hi], side="right") - 1
        return out
    offset = np.cumsum(span) - span - first
    d_key = d_t + np.repeat(offset[d_groups.keys], d_groups.sizes)
    e_key = e_t + np.repeat(offset[e_groups.keys], e_groups.sizes)
    return np.searchsorted(d_key, e_key, side="right") - 1


def _step(lat: np.ndarray, method: str) -> EngineStep:
    # p50 and p99 by selection (O(n)); percentile's interpolation is not worth a second pass
    k50, k99 = (len(lat) - 1) // 2, (len(lat) - 1) * 99 // 100
    part = np.partition(lat, (k50, k99))
    return EngineStep(int(max(lat.max(), 0)), int(part[k50]), int(part[k99]), int(len(lat)), method)


HANDOFF_NS = 2_000_000  # the longest hand-off from one step's end to the next one's start that counts as work


def step_periods(emit_t_ns: np.ndarray, latency_ns: np.ndarray,
                 handoff_ns: int = HANDOFF_NS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step starts, the time each step kept the engine from starting the next, whether the engine
    went straight on to the next step), from ``step_latencies``.

    A step starts at a dispatch time and ends at its first emit. From one step start ``s`` to
    the next ``s'``, the engine worked the whole time when it started ``s'`` within
    ``handoff_ns`` of ``s``'s end (or before it, with async scheduling): the period is
    ``s' - s``. Otherwise it was idle in between (waiting for input or for a user's budget),
    and only ``end - s + handoff_ns`` counts. The last step's period is its own length.
    """
    if len(emit_t_ns) == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
    start = np.asarray(emit_t_ns, dtype=np.int64) - np.asarray(latency_ns, dtype=np.int64)
    end = np.asarray(emit_t_ns, dtype=np.int64)
    if np.all(start[1:] >= start[:-1]):  # starts already in order (step_latencies' usual case)
        new = np.r_[True, start[1:] != start[:-1]]
        s, e = start[new], np.minimum.reduceat(end, np.flatnonzero(new))  # each step's first emit: its end
    else:
        order = np.lexsort((end, start))
        start, end = start[order], end[order]
        new = np.r_[True, start[1:] != start[:-1]]
        s, e = start[new], end[new]  # each step's first emit: its end
    nxt = np.append(s[1:], e[-1])
    worked = nxt - e <= handoff_ns
    period = np.where(worked, nxt - s, e - s + handoff_ns)
    period[-1] = e[-1] - s[-1]
    worked[-1] = False
    return s, period, worked
