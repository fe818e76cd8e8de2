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


def test_steady_rate_counts_from_where_the_budget_was_spent_not_from_a_slow_start():
    """cpu-tiny's long-prompt on a slow machine: the user's one decoding stream got one token every 60 ms
    while its second stream's prompt was prefilled in the same steps (the engine, not the budget, held it
    back), then a token every 10 ms at its 100 tok/s. From the first token that read 0.87 of the limit (0.90
    here), under the 0.97 delivery asks; from where the budget was spent, N."""
    slow = 10**12 + np.arange(5) * 60_000_000
    lim = GcraLimiter({}, 100)
    for x in slow:
        assert lim.try_take("u", "r0", int(x))
    rest, now = [], int(slow[-1]) + 6_000_000
    while len(rest) < 195:
        for s in range(2):
            if len(rest) < 195 and lim.try_take("u", f"r{s}", now):
                rest.append(now)
        now += 6_000_000
    t = np.concatenate([slow, np.array(rest, dtype=np.int64)])
    # the engine's steps: 60 ms while the prompt was prefilled, 6 ms after
    starts = np.concatenate([slow, np.arange(int(slow[-1]) + 6_000_000, int(t[-1]) + 1, 6_000_000)])
    steps = (starts, np.diff(np.append(starts, starts[-1] + 6_000_000)))
    r = rate_figures(t, limit_tps=100, steps=steps)
    assert (200 - 11) / ((t[-1] - t[0]) / 1e9) / 100 < 0.95  # the old measure, the slow start counted: FAIL
    assert 0.97 <= r.steady_rate_tps / 100 <= 1.005 and r.steady_start_ns > t[4]
    # without the engine's steps (the client's rate) nothing says the engine held the user back
    assert rate_figures(t, limit_tps=100).steady_start_ns == t[0]


def test_a_pause_of_the_users_own_before_its_budget_binds_keeps_the_whole_span_judged():
    """A limiter that holds a user back 500 ms after its first tokens (the engine stepping every 6 ms
    meanwhile), then lets its whole burst through: from where the budget was spent it reads N, but the
    user was not held back by the engine's steps, so the whole span is judged, and it under-delivers."""
    lim = GcraLimiter({}, 100)
    t, now = [], 10**12
    for k in range(400):
        if k == 3:
            now += 500_000_000  # the limiter's pause (the engine steps on without the user)
            lim = GcraLimiter({}, 100)  # ... and it comes back with a full burst
        while not lim.try_take("u", "r0", now):
            now += 6_000_000
        t.append(now)
        now += 6_000_000
    t = np.array(t, dtype=np.int64)
    starts = np.arange(t[0], t[-1] + 1, 6_000_000)
    r = rate_figures(t, limit_tps=100, steps=(starts, np.full(len(starts), 6_000_000)))
    assert r.steady_start_ns == t[0] and r.steady_rate_tps / 100 < 0.97


def test_a_limiter_at_half_the_rate_fails_delivery_however_the_engine_starts():
    # its budget is never spent to the bound of the rate it should give: the whole span is judged
    t = gcra_trace(100, 300, step_ns=6_000_000, rate_divisor=2, streams=2)
    assert delivery_ratio(t, 100) < 0.6
    # a user at 5 tok/s (a burst of one token): exactly N, no token taken twice
    assert abs(delivery_ratio(gcra_trace(5, 40, step_ns=3_000_000), 5) - 1.0) < 0.01
