"""The longest engine step, estimated from the engine's own events.

Emit events lag the dispatch that charged them by the time the engine takes to
run the step (two steps with async scheduling). A window over emit times
therefore covers dispatches from a window up to that lag wider, which is the
tolerance the bound gets on emit events.

Definition: match the k-th token emitted for a request with the k-th dispatch
event of that request (charges happen in order; the few extra charges of a
request, after a stop or a cancel, come last and match nothing). The
dispatch-to-emit latency of an emit event is its time minus the dispatch time of
its first token. ``longest_ns`` is the largest such latency in the engine's file.
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


def estimate_engine_step(
    dispatch_t_ns: np.ndarray,
    dispatch_req: np.ndarray,
    emit_t_ns: np.ndarray,
    emit_req: np.ndarray,
    emit_count: np.ndarray,
    *,
    dispatch_groups: Groups | None = None,
    emit_groups: Groups | None = None,
) -> EngineStep:
    """Latency from each emitted token's dispatch to its emit event, over the whole engine.

    Inputs time-sorted; ``*_groups``: ``group_by`` of the request arrays, when already computed.
    """
    if len(dispatch_t_ns) == 0 or len(emit_t_ns) == 0:
        return EngineStep(0, None, None, 0, "unavailable: no dispatch or no emit events")
    n_codes = int(max(dispatch_req.max(), emit_req.max())) + 1
    d_groups = dispatch_groups or group_by(np.asarray(dispatch_req))
    d_t = np.asarray(dispatch_t_ns)[d_groups.order]
    d_count = np.zeros(n_codes, dtype=np.int64)
    d_start = np.zeros(n_codes, dtype=np.int64)
    d_count[d_groups.keys] = d_groups.sizes
    d_start[d_groups.keys] = d_groups.starts
    # dispatch times are sorted within each request when the input was time-ordered
    e_groups = emit_groups or group_by(np.asarray(emit_req))
    e_t = np.asarray(emit_t_ns)[e_groups.order]
    unit = bool(np.all(emit_count == 1))
    if unit and np.array_equal(d_groups.keys, e_groups.keys) and np.array_equal(d_groups.sizes, e_groups.sizes):
        # the usual case: every request has one dispatch per emitted token, in the same order
        lat = e_t - d_t
        return _step(lat, "dispatch-to-emit")
    e_req = np.asarray(emit_req)[e_groups.order]
    e_c = np.asarray(emit_count, dtype=np.int64)[e_groups.order]
    excl = np.cumsum(e_c) - e_c
    first_of_group = np.repeat(excl[e_groups.starts], e_groups.sizes)
    ordinal = excl - first_of_group  # tokens of this request emitted before this event
    valid = (ordinal < d_count[e_req]) & (e_c > 0)
    if not valid.any():
        return EngineStep(0, None, None, 0, "unavailable: no emit matches a dispatch")
    lat = e_t[valid] - d_t[d_start[e_req[valid]] + ordinal[valid]]
    return _step(lat, "dispatch-to-emit")


def _step(lat: np.ndarray, method: str) -> EngineStep:
    # p50 and p99 by selection (O(n)); percentile's interpolation is not worth a second pass
    k50, k99 = (len(lat) - 1) // 2, (len(lat) - 1) * 99 // 100
    part = np.partition(lat, (k50, k99))
    return EngineStep(int(max(lat.max(), 0)), int(part[k50]), int(part[k99]), int(len(lat)), method)
