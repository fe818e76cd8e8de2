"""One user's time series in one phase, for plots: plain arrays, no figures computed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ratebench.analysis.load import RunData
from ratebench.events import ANONYMOUS_USER
from ratebench.events import KIND_DISPATCH, KIND_EMIT



@dataclass
class UserSeries:
    dispatch_t_ns: np.ndarray
    dispatch_stream: np.ndarray  # stream index of each dispatch (-1: unknown)
    dispatch_request: np.ndarray  # engine request code of each dispatch
    emit_t_ns: np.ndarray
    emit_count: np.ndarray
    emit_stream: np.ndarray
    emit_request: np.ndarray  # engine request code of each emit
    client_t_ns: np.ndarray  # time-sorted chunks of all the user's requests
    client_tokens: np.ndarray
    client_request: np.ndarray  # index of each chunk's request among the user's records


def request_streams(run: RunData, trace) -> np.ndarray:
    """Stream index of every request code of an engine trace (-1: no client record)."""
    out = np.full(len(trace.req_record), -1, dtype=np.int64)
    has = np.flatnonzero(trace.req_record >= 0)
    if len(has):
        out[has] = [run.records[i].stream_index for i in trace.req_record[has]]
    return out


def phase_series(run: RunData, phase_index: int, users: list[str]) -> dict[str, UserSeries]:
    """The series of several users of one phase: one pass over the engine's events and the records."""
    p = run.phases[phase_index]
    empty = np.empty(0, dtype=np.int64)
    engine_part: dict[str, tuple] = {}
    trace = run.traces.get(p.engine)
    if trace is not None and len(trace.records):
        recs = trace.records
        codes = {u: trace.events.string_index(u) for u in users}
        wanted = np.array([c for c in codes.values() if c is not None], dtype=np.int64)
        sel = np.flatnonzero(np.isin(recs["user"], wanted))
        sel = sel[trace.req_phase[recs["req"][sel]] == phase_index]
        mine = recs[sel]
        stream = request_streams(run, trace)[mine["req"]]
        for u, code in codes.items():
            if code is None:
                continue
            m = mine["user"] == code
            dm, em = m & (mine["kind"] == KIND_DISPATCH), m & (mine["kind"] == KIND_EMIT)
            engine_part[u] = (mine["t_ns"][dm].astype(np.int64), stream[dm], mine["req"][dm].astype(np.int64),
                              mine["t_ns"][em].astype(np.int64), mine["count"][em].astype(np.int64), stream[em],
                              mine["req"][em].astype(np.int64))
    chunks: dict[str, tuple[list, list, list]] = {u: ([], [], []) for u in users}
    for r in run.records:
        if (r.scenario, r.phase, r.engine) == p.key:
            u = r.user if r.user is not None else ANONYMOUS_USER
            if u in chunks:
                chunks[u][0].append(np.asarray(r.chunk_ns, dtype=np.int64))
                chunks[u][1].append(np.asarray(r.chunk_tokens, dtype=np.int64))
                chunks[u][2].append(np.full(len(r.chunk_ns), len(chunks[u][2]), dtype=np.int64))
    out = {}
    for u in users:
        d_t, d_s, d_r, e_t, e_c, e_s, e_r = engine_part.get(u, (empty,) * 7)
        ct, cc, cr = chunks[u]
        c_t = np.concatenate(ct) if ct else empty
        c_c = np.concatenate(cc) if cc else empty
        c_r = np.concatenate(cr) if cr else empty
        order = np.argsort(c_t, kind="stable")
        out[u] = UserSeries(d_t, d_s, d_r, e_t, e_c, e_s, e_r, c_t[order], c_c[order], c_r[order])
    return out


def user_series(run: RunData, phase_index: int, user: str) -> UserSeries:
    """One user's series in one phase."""
    return phase_series(run, phase_index, [user])[user]
