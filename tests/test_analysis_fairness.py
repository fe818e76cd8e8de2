"""Streams of one user take turns; equal limits get equal rates."""

from __future__ import annotations

import numpy as np

from ratebench.analysis import jain_index, stream_spread


def test_streams_taking_turns_have_a_spread_of_one():
    t = np.arange(40)
    assert stream_spread(t, t % 4) == 1


def test_a_starved_stream_shows_in_the_spread():
    t = np.arange(40)
    stream = np.where(t % 4 == 3, 3, t % 3)  # stream 3 gets a quarter, others a quarter each...
    stream[4:30] = np.arange(4, 30) % 2  # ...then streams 0 and 1 take everything for a while
    assert stream_spread(t, stream) >= 10


def test_counts_start_when_the_last_stream_starts():
    # stream 0 runs alone for 10 tokens, then both alternate: spread counted from then is 1
    t = np.arange(30)
    stream = np.concatenate([np.zeros(10, int), np.arange(20) % 2])
    assert stream_spread(t, stream) == 1


def test_single_stream_has_no_spread():
    assert stream_spread(np.arange(5), np.zeros(5)) is None


def test_jain_index():
    assert jain_index([20, 20, 20]) == 1.0
    assert abs(jain_index([10, 30]) - 0.8) < 1e-12
    assert jain_index([5]) is None


def brute_force_spread(t, stream):
    streams = sorted(set(stream))
    first = {s: min(ti for ti, si in zip(t, stream) if si == s) for s in streams}
    last = {s: max(ti for ti, si in zip(t, stream) if si == s) for s in streams}
    start, end = max(first.values()), min(last.values())
    if start > end:
        return None
    best = 0
    for now in sorted(set(ti for ti in t if start < ti <= end)):
        counts = [sum(1 for ti, si in zip(t, stream) if si == s and start < ti <= now) for s in streams]
        best = max(best, max(counts) - min(counts))
    return best


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 3)), min_size=1, max_size=60))
def test_stream_spread_equals_brute_force(events):
    events.sort(key=lambda e: e[0])
    t = np.array([e[0] for e in events])
    s = np.array([e[1] for e in events])
    expected = brute_force_spread(t.tolist(), s.tolist()) if len(set(s.tolist())) > 1 else None
    assert stream_spread(t, s) == expected


# ---- in service: users whose limit never bound (each two streams while both had a request in service)


def test_a_stream_queued_between_its_requests_is_out_of_the_in_service_count():
    # stream 0 answers 5 tokens, its next request waits 10 steps for a slot while stream 1 runs alone,
    # then both alternate: counted from the last first token the spread is 10, in service 1
    stream = np.array([0, 1] * 5 + [1] * 10 + [0, 1] * 5)
    req = np.where(stream == 0, 0, 1)
    req[20:][stream[20:] == 0] = 2
    t = np.arange(stream.size)
    assert stream_spread(t, stream) >= 10
    assert stream_spread(t, stream, req) == 1


def test_streams_that_never_take_turns_show_in_the_in_service_count():
    # both streams in service throughout (one request each and a second): stream 0 takes 12 tokens to 1
    stream = np.array([0, 1] + [0] * 12 + [1])
    req = stream.copy()
    t = np.arange(stream.size)
    assert stream_spread(t, stream, req) >= 11


def brute_force_in_service(t, stream, req):
    first, last = {}, {}
    for ti, ri in zip(t, req):
        first[ri] = min(first.get(ri, ti), ti)
        last[ri] = max(last.get(ri, ti), ti)
    stream_of = dict(zip(req, stream))

    def serving(s, x):
        return any(stream_of[r] == s and first[r] < x <= last[r] for r in first)

    worst = None
    streams = sorted(set(stream))
    for i, a in enumerate(streams):
        for b in streams[i + 1:]:
            times = sorted({ti for ti, si in zip(t, stream) if si in (a, b)})
            start = None
            for x in times:
                if not (serving(a, x) and serving(b, x)):
                    start = None
                    continue
                start = x if start is None else start
                d = sum((si == a) - (si == b) for ti, si in zip(t, stream) if start <= ti <= x)
                worst = abs(d) if worst is None else max(worst, abs(d))
    return worst


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2), st.integers(0, 2)), min_size=1, max_size=50))
def test_the_in_service_spread_equals_brute_force(events):
    events.sort(key=lambda e: e[0])
    t = np.array([e[0] for e in events])
    s = np.array([e[1] for e in events])
    r = np.array([10 * e[1] + e[2] for e in events])
    expected = brute_force_in_service(t.tolist(), s.tolist(), r.tolist()) if len(set(s.tolist())) > 1 else None
    assert stream_spread(t, s, r) == expected
