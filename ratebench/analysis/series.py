"""One user's time series in one phase, for plots: plain arrays, no figures computed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ratebench.analysis.load import RunData
from ratebench.events import KIND_DISPATCH, KIND_EMIT

ANONYMOUS = "__anonymous__"


@dataclass
class UserSeries:
    dispatch_t_ns: np.ndarray
    dispatch_stream: np.ndarray  # stream index of each dispatch (-1: unknown)
    emit_t_ns: np.ndarray
    emit_count: np.ndarray
    emit_stream: np.ndarray
    client_t_ns: np.ndarray  # time-sorted chunks of all the user's requests
    client_tokens: np.ndarray


def request_streams(run: RunData, trace) -> np.ndarray:
    """Stream index of every request code of an engine trace (-1: no client record)."""
    out = np.full(len(trace.req_record), -1, dtype=np.int64)
    has = np.flatnonzero(trace.req_record >= 0)
    if len(has):
        out[has] = [run.records[i].stream_index for i in trace.req_record[has]]
    return out


def user_series(run: RunData, phase_index: int, user: str) -> UserSeries:
    p = run.phases[phase_index]
    empty = np.empty(0, dtype=np.int64)
    d_t = d_s = e_t = e_c = e_s = empty
    trace = run.traces.get(p.engine)
    if trace is not None:
        code = trace.events.string_index(user)
        recs = trace.records
        if code is not None and len(recs):
            sel = (recs["user"] == code) & (trace.req_phase[recs["req"]] == phase_index)
            mine = recs[sel]
            stream = request_streams(run, trace)[mine["req"]]
            dm, em = mine["kind"] == KIND_DISPATCH, mine["kind"] == KIND_EMIT
            d_t, d_s = mine["t_ns"][dm].astype(np.int64), stream[dm]
            e_t, e_c, e_s = mine["t_ns"][em].astype(np.int64), mine["count"][em].astype(np.int64), stream[em]
    chunks_t, chunks_c = [], []
    for r in run.records:
        if (r.scenario, r.phase, r.engine) == p.key and (r.user if r.user is not None else ANONYMOUS) == user:
            chunks_t.append(np.asarray(r.chunk_ns, dtype=np.int64))
            chunks_c.append(np.asarray(r.chunk_tokens, dtype=np.int64))
    c_t = np.concatenate(chunks_t) if chunks_t else empty
    c_c = np.concatenate(chunks_c) if chunks_c else empty
    order = np.argsort(c_t, kind="stable")
    return UserSeries(d_t, d_s, e_t, e_c, e_s, c_t[order], c_c[order])
