"""Inter-token gaps per request and per user, with their stated definitions."""

from __future__ import annotations

import numpy as np

from ratebench.analysis import gap_stats, gaps_merged, gaps_per_request
from ratebench.analysis.steps import estimate_engine_step


def test_gaps_per_request_never_span_two_requests():
    t = np.array([0, 5, 10, 20, 30, 100])
    req = np.array([1, 2, 1, 2, 1, 2])
    assert sorted(gaps_per_request(t, req).tolist()) == [10, 15, 20, 80]


def test_gaps_merged_is_the_user_stream_in_time_order():
    assert gaps_merged(np.array([0, 5, 10, 20])).tolist() == [5, 5, 10]


def test_gap_stats_percentiles_interpolate_linearly():
    g = gap_stats(np.arange(1, 102))  # 1..101
    assert (g.count, g.min_ns, g.max_ns) == (101, 1, 101)
    assert g.p50_ns == 51 and g.p90_ns == 91 and g.p99_ns == 100


def test_no_gaps_gives_none():
    assert gap_stats(np.array([])) is None


def test_engine_step_is_the_longest_dispatch_to_emit_latency():
    # request 0: dispatched at 0, 10, 20; emitted at 7, (two tokens at) 31
    d_t = np.array([0, 10, 20, 40])
    d_req = np.array([0, 0, 0, 1])
    e_t = np.array([7, 31, 45])
    e_req = np.array([0, 0, 1])
    e_c = np.array([1, 2, 1])
    step = estimate_engine_step(d_t, d_req, e_t, e_req, e_c)
    assert step.longest_ns == 21  # the two-token emit at 31 carries the token dispatched at 10
    assert step.samples == 3


def test_extra_charges_after_the_last_emit_match_nothing():
    step = estimate_engine_step(np.array([0, 10, 20]), np.array([0, 0, 0]), np.array([5]), np.array([0]),
                                np.array([1]))
    assert step.longest_ns == 5 and step.samples == 1


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ratebench.analysis.reconcile import events_after_grouped  # noqa: E402
from ratebench.analysis.segments import group_by  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**9), min_size=1, max_size=300))
def test_gap_stats_match_numpy_percentiles(values):
    g = np.array(values)
    s = gap_stats(g)
    assert np.allclose([s.p50_ns, s.p90_ns, s.p99_ns], np.percentile(g, [50, 90, 99]))
    assert (s.min_ns, s.max_ns, s.count) == (g.min(), g.max(), g.size)


def test_events_after_a_cutoff_are_counted_per_request():
    t = np.array([1, 2, 3, 4, 5, 6])
    req = np.array([0, 1, 0, 1, 0, 1])
    groups = group_by(req)
    cutoff = np.array([3, 100])
    n, tok = events_after_grouped(t[groups.order], groups, cutoff, np.array([1, 1, 2, 1, 3, 1])[groups.order])
    assert n.tolist() == [1, 0] and tok.tolist() == [3, 0]
