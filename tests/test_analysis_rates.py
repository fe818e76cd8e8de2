"""Rates and delivery: a backlogged user gets its limit, an over-throttling limiter is caught."""

from __future__ import annotations

import numpy as np

from ratebench.analysis import burst_tokens, delivery_ratio, rate_figures
from synth import GcraLimiter


def gcra_trace(limit_tps: int, tokens: int, step_ns: int, rate_divisor: int = 1, streams: int = 1) -> np.ndarray:
    """Dispatch times of a backlogged user under GCRA, the engine asking once per stream per step."""
    lim = GcraLimiter({}, limit_tps, rate_divisor=rate_divisor)
    out, now = [], 10**12
    while len(out) < tokens:
        for s in range(streams):
            if len(out) < tokens and lim.try_take("u", f"r{s}", now):
                out.append(now)
        now += step_ns
    return np.array(out, dtype=np.int64)


def test_burst_is_a_tenth_of_a_second_of_tokens_plus_one():
    assert burst_tokens(20) == 3
    assert burst_tokens(100) == 11
    assert burst_tokens(5) == 1


def test_backlogged_user_under_correct_gcra_gets_its_limit():
    for limit, streams in ((20, 1), (20, 4), (100, 1), (500, 8)):
        t = gcra_trace(limit, 400, step_ns=3_000_000, streams=streams)
        assert delivery_ratio(t, limit) >= 0.97, (limit, streams)


def test_steady_rate_is_not_inflated_when_the_burst_is_spent_over_several_steps():
    # one stream, 5 ms steps: the 11-token burst of a 100 tok/s user takes ~20 steps to spend
    t = gcra_trace(100, 200, step_ns=5_000_000)
    r = rate_figures(t, limit_tps=100)
    assert r.seed_rate_tps > 100  # the seed's method counts the burst
    assert 0.97 <= r.steady_rate_tps / 100 <= 1.0


def test_limiter_at_half_the_rate_fails_delivery():
    t = gcra_trace(100, 300, step_ns=2_000_000, rate_divisor=2)
    assert delivery_ratio(t, 100) < 0.6


def test_weighted_emit_events_count_every_token():
    t = np.array([0, 10**9, 2 * 10**9])
    r = rate_figures(t, counts=np.array([1, 2, 3]))
    assert r.tokens == 6 and r.seed_rate_tps == 3.0


def test_too_few_tokens_past_the_burst_gives_no_steady_rate():
    assert delivery_ratio(np.array([0, 1, 2]), 100) is None
