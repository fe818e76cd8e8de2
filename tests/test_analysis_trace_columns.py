"""The per-engine columns and groupings the analyses share (``EngineTrace``), against naive loops."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ratebench.analysis.load import EngineTrace
from ratebench.events import KIND_DISPATCH, KIND_EMIT, RECORD_DTYPE

EVENTS = st.lists(st.tuples(st.integers(0, 50), st.integers(1, 5), st.integers(0, 6), st.integers(0, 2)),
                  max_size=60)


def _trace(events) -> EngineTrace:
    events = sorted(events, key=lambda e: e[0])  # time-sorted, as load_run keeps them
    arr = np.zeros(len(events), dtype=RECORD_DTYPE)
    for name, k in (("t_ns", 0), ("kind", 1), ("req", 2), ("count", 3)):
        arr[name] = [e[k] for e in events]
    return EngineTrace("e", None, arr, np.full(7, -1), np.full(7, -1))


@settings(max_examples=200, deadline=None)
@given(EVENTS)
def test_first_event_of_any_kind(events):
    trace = _trace(events)
    first = trace.first_event_ns()
    for code in range(7):
        times = [t for t, _, r, _ in events if r == code]
        assert first[code] == (min(times) if times else -1)


@settings(max_examples=200, deadline=None)
@given(EVENTS)
def test_groupings_and_gaps_by_request(events):
    trace = _trace(events)
    emits = trace.emits()
    assert list(emits["t_ns"]) == sorted(t for t, k, _, c in events if k == KIND_EMIT and c > 0)
    groups, t_r = trace.by_request(KIND_DISPATCH)
    gaps = trace.request_gaps(KIND_DISPATCH)
    for g, code in enumerate(groups.keys.tolist()):
        times = sorted(t for t, k, r, _ in events if k == KIND_DISPATCH and r == code)
        assert list(t_r[groups.starts[g]:groups.ends[g]]) == times
        assert (gaps["count"][g], gaps["first"][g], gaps["last"][g]) == (len(times), times[0], times[-1])
        diffs = np.diff(times)
        assert gaps["gap"][g] == (int(diffs.max()) if len(diffs) else -1)
        if len(diffs):
            assert gaps["gap_at"][g] == times[int(np.argmax(diffs))]
