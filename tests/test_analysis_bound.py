"""The one-pass bound check agrees with checking every window by brute force."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ratebench.analysis import check_bound, check_bound_grouped
from ratebench.analysis.bound import BURST_NS, NS_PER_S


def brute_force_min_slack(t_ns, counts, limit_tps, burst_ns, tolerance_ns=0):
    """min over closed windows [t_i, t_j] of allowed - tokens, in exact fractions."""
    t = list(t_ns)
    c = list(counts)
    best = None
    for a in t:
        for b in t:
            if b < a:
                continue
            tokens = sum(ci for ti, ci in zip(t, c) if a <= ti <= b)
            allowed = Fraction((b - a + burst_ns + tolerance_ns) * limit_tps, NS_PER_S) + 1
            slack = allowed - tokens
            if best is None or slack < best:
                best = slack
    return best


times = st.lists(st.integers(min_value=0, max_value=2 * NS_PER_S), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(t=times, limit=st.integers(min_value=1, max_value=200), data=st.data())
def test_one_pass_bound_equals_brute_force_on_every_window(t, limit, data):
    counts = data.draw(st.lists(st.integers(1, 4), min_size=len(t), max_size=len(t)))
    tolerance_ns = data.draw(st.sampled_from([0, 7_000_000]))
    result = check_bound(np.array(t), limit, counts=np.array(counts), tolerance_ns=tolerance_ns)
    expected = brute_force_min_slack(t, counts, limit, BURST_NS, tolerance_ns)
    assert result.passed == (expected >= 0)
    assert abs(result.worst.slack_tokens - float(expected)) < 1e-9
    # The reported worst window is a real window with the reported tokens.
    w = result.worst
    assert w.tokens == sum(ci for ti, ci in zip(t, counts) if w.start_ns <= ti <= w.end_ns)


@settings(max_examples=200, deadline=None)
@given(t=times, limit=st.integers(min_value=1, max_value=100), s=st.integers(-NS_PER_S, 3 * NS_PER_S),
       w=st.integers(0, 3 * NS_PER_S))
def test_a_passing_trace_keeps_the_bound_on_any_window_not_only_event_aligned(t, limit, s, w):
    result = check_bound(np.array(t), limit)
    if result.passed:
        tokens = sum(1 for ti in t if s <= ti <= s + w)
        assert tokens <= Fraction((w + BURST_NS) * limit, NS_PER_S) + 1


def test_exactly_at_the_bound_passes_and_one_more_token_fails():
    limit = 20  # burst 0.1 s * 20 = 2 tokens, plus one: 3 tokens at the same instant
    assert check_bound(np.zeros(3, dtype=np.int64), limit).passed
    assert not check_bound(np.zeros(4, dtype=np.int64), limit).passed
    # then one token every 50 ms keeps exactly to it
    t = np.concatenate([np.zeros(3, dtype=np.int64), np.arange(1, 50) * 50_000_000])
    r = check_bound(t, limit)
    assert r.passed and r.worst.slack_tokens == 0
    t[-1] -= 1  # one ns early
    assert not check_bound(t, limit).passed


def test_huge_limits_and_spans_fall_back_to_exact_integers():
    limit = 10**9  # N * span overflows int64 for a span of hours
    t = np.array([0, 3600 * NS_PER_S, 7200 * NS_PER_S], dtype=np.int64)
    r = check_bound(t, limit)
    assert r.passed and r.tokens == 3


def test_grouped_check_is_the_same_as_one_user_at_a_time():
    rng = np.random.default_rng(1)
    t = np.sort(rng.integers(0, 5 * NS_PER_S, 3000))
    users = rng.integers(0, 7, 3000)
    limits = {u: 50 + 10 * u for u in range(7)}
    grouped = check_bound_grouped(t, users, limits)
    for u in range(7):
        alone = check_bound(t[users == u], limits[u])
        assert grouped[u] == alone


def test_users_without_a_limit_are_skipped():
    r = check_bound_grouped(np.arange(5), np.array([0, 0, 1, 1, 1]), {0: 10, 1: None})
    assert set(r) == {0}


def test_users_can_be_named_by_strings():
    t = np.array([0, 0, 0, 0, 10**9])
    users = np.array(["a", "b", "a", "a", "b"])
    r = check_bound_grouped(t, users, {"a": 20, "b": 20})
    assert r["a"].passed and r["a"].tokens == 3
    assert r["b"].tokens == 2
