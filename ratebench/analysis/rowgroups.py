"""One engine's events in (phase, user) rows without a sort over every event: the groupings the
run summary (:mod:`ratebench.analysis.summary`) builds its rows from, the steps of each phase, and the
charges a client's cancel left without an emit."""

from __future__ import annotations

import numpy as np

from ratebench.analysis.load import RunData
from ratebench.analysis.segments import group_by
from ratebench.analysis.spacing import StepIndex
from ratebench.analysis.steps import step_periods
from ratebench.events import FINISH_REASONS, KIND_FINISH

FINISH_ABORT = next(code for code, reason in FINISH_REASONS.items() if reason == "abort")


def lost_charges(recs: np.ndarray, req_col: np.ndarray, d_req: np.ndarray, e_req: np.ndarray, e_c: np.ndarray,
                 d_by_req, d_t_r: np.ndarray, n_codes: int) -> tuple[np.ndarray, np.ndarray]:
    """Charges that a client's cancel left without an emit (an accepted over-charge, docs/promise.md
    section 3: a step already dispatched when the client cancels), as (dispatch times, request codes), by
    code then time: each aborted request's last dispatches beyond the tokens it emitted. Even spacing on
    emit events counts them as emitted at their dispatch, as the budget was spent then (a stream the
    scenario closes between a charge and its emit made a window 2 tokens short of a user whose dispatch
    side was even)."""
    fin = recs["kind"] == KIND_FINISH
    aborted = np.zeros(n_codes, dtype=bool)
    aborted[req_col[fin][recs["reason"][fin] == FINISH_ABORT]] = True
    lost = np.where(aborted, np.bincount(d_req, minlength=n_codes)
                    - np.bincount(e_req, weights=e_c, minlength=n_codes).astype(np.int64), 0)
    g = d_by_req
    n_lost = np.clip(lost[g.keys], 0, g.ends - g.starts)
    sel = n_lost > 0
    counts, ends = n_lost[sel], g.ends[sel]
    # each group's last ``count`` positions in the grouped-by-request layout (times in order in a group)
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    pos = np.repeat(ends - counts, counts) + within
    return d_t_r[pos], np.repeat(g.keys[sel], counts).astype(d_req.dtype)


def phase_steps(run: RunData, name: str, latencies) -> dict[int, tuple]:
    """Per phase of the engine: (step starts, periods, whether the engine went straight on, the
    longest dispatch-to-emit latency, their ``spacing.StepIndex`` with the engine's places from its
    event file's header), for the steps that started in the phase (``steps.step_periods``)."""
    if isinstance(latencies, str):
        return {}
    emit_t, lat = latencies
    starts, periods, worked = step_periods(emit_t, lat)
    trace = run.traces.get(name)
    meta = trace.events.meta if trace is not None else {}
    places = meta.get("max_num_active_seqs") or meta.get("max_num_seqs")  # None: no cap on a step's requests
    out = {}
    for p in run.phases:
        if p.engine != name:
            continue
        a, b = np.searchsorted(starts, [p.start_ns, p.end_ns], side="left")
        if b <= a:
            continue
        at = (emit_t - lat >= p.start_ns) & (emit_t - lat < p.end_ns)
        s, per, w = starts[a:b], periods[a:b], worked[a:b]
        out[p.index] = (s, per, w, int(lat[at].max()) if at.any() else 0, StepIndex(s, per, w, places=places))
    return out


def rows_from_requests(by_req, t_r: np.ndarray, req_all: np.ndarray, user_all: np.ndarray, first_user: np.ndarray,
                       req_phase: np.ndarray, n_codes: int):
    """Events grouped by (phase, user), time order kept inside each group, built from their grouping by
    request: requests put in row order, then each row's few time-sorted runs (one per request) sorted
    by time. No sort over all events, and reads that stay near each other.

    Returns (positions into the grouped-by-request layout, [(phase index, user code, slice)], whether every
    event is in a phase); None when a request's events name more than one user (then rows follow events).
    """
    if len(by_req) == 0 or not np.array_equal(user_all, first_user[req_all]):
        return None
    codes = by_req.keys.astype(np.int64)
    phase = req_phase[codes]
    in_phase = np.flatnonzero(phase >= 0)
    key = phase * n_codes + first_user[codes]
    perm = in_phase[np.argsort(key[in_phase], kind="stable")]  # requests in row order
    sizes = by_req.sizes[perm]
    ends = np.cumsum(sizes)
    pos = np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
    pos += np.repeat(by_req.starts[perm] - (ends - sizes), sizes)
    row_keys = key[perm]
    first_req = np.flatnonzero(np.concatenate(([True], row_keys[1:] != row_keys[:-1]))) if len(perm) else perm
    row_start = (ends - sizes)[first_req]
    row_end = np.append(row_start[1:], ends[-1] if len(ends) else 0)
    n_reqs = np.diff(np.append(first_req, len(perm)))
    groups = []
    for k, a, b, n in zip(row_keys[first_req].tolist(), row_start.tolist(), row_end.tolist(), n_reqs.tolist()):
        if n > 1:  # several requests: merge their runs by time (stable)
            p = pos[a:b]
            pos[a:b] = p[np.argsort(t_r[p], kind="stable")]
        p_index, u_code = divmod(k, n_codes)
        groups.append((p_index, u_code, slice(a, b)))
    return pos, groups, len(in_phase) == len(codes)


def phase_user_groups(req_all: np.ndarray, user_all: np.ndarray, req_phase: np.ndarray, user_codes: np.ndarray,
                      n_phases: int, n_codes: int):
    """Events grouped by (phase of their request, their user), time order kept inside each group.

    Returns (order into the events, [(phase index, user code, slice into order)], whether every
    event is in a phase). One stable sort of a uint16 key (a radix sort) when phases x users fit.
    """
    n_users = len(user_codes)
    if len(req_all) == 0:
        return np.empty(0, dtype=np.int64), [], True
    if (n_phases + 1) * n_users < 2**16:
        phase_key = ((req_phase + 1) * n_users).astype(np.uint16)  # per request code; 0: in no phase
        user_rank = np.zeros(n_codes, dtype=np.uint16)
        user_rank[user_codes] = np.arange(n_users, dtype=np.uint16)
        key = phase_key[req_all]
        key += user_rank[user_all]
        sizes = np.bincount(key, minlength=(n_phases + 1) * n_users)
        order = np.argsort(key, kind="stable")
        ends = np.cumsum(sizes)
        present = np.flatnonzero(sizes[n_users:]) + n_users
        groups = [(int(k // n_users) - 1, int(user_codes[k % n_users]), slice(int(ends[k] - sizes[k]), int(ends[k])))
                  for k in present.tolist()]
        return order, groups, not sizes[:n_users].any()
    ph = req_phase[req_all]
    sel = np.flatnonzero(ph >= 0)
    groups = group_by(ph[sel] * n_codes + user_all[sel])
    out = []
    for _, key, sl in groups.slices():
        p_index, u_code = divmod(int(key), n_codes)
        out.append((p_index, u_code, sl))
    return sel[groups.order], out, len(sel) == len(req_all)


def row_groups(trace, codes: np.ndarray, first_user: np.ndarray, n_codes: int):
    """(phase index, user code, positions into ``codes``) for each row the request codes belong to."""
    keys = trace.req_phase[codes] * n_codes + first_user[codes]
    if len(keys) == 0:
        return
    groups = group_by(keys)
    for _, key, sl in groups.slices():
        p_index, u_code = divmod(int(key), n_codes)
        yield p_index, u_code, groups.order[sl]
