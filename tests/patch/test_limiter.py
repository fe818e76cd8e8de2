"""The GCRA limiter of the patch keeps its promise (docs/promise.md section 2).

``vllm.v1.core.sched.output_rate.OutputRateLimiter`` driven by hand: every time
is an integer number of nanoseconds passed to ``try_take`` / ``cleanup_idle_users`` /
``cleanup_idle_users`` (the limiter's own clock raises if read), so nothing
depends on the wall clock. Expected values
are derived from the rule in the code: a take at ``now`` is refused iff
``tat_scaled - now * rate > burst_ns * rate`` (``tat_scaled`` is the user's TAT
times its rate), i.e. iff TAT - now > 100 ms in exact arithmetic.
"""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.core.sched.output_rate import OutputRateLimiter

pytestmark = pytest.mark.usefixtures("patched_vllm")

NS_PER_S = 1_000_000_000
BURST_NS = 100_000_000
RATES_TPS = [1, 7, 20, 100, 1000, 10**6]

PROPERTY_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def make_limiter(default_tps: int, user_tps: dict[str, int] | None = None):
    """A limiter with the patch's default burst and a clock nobody may read:
    every call in these tests passes its time explicitly."""

    def no_clock() -> int:
        raise AssertionError("the limiter read its clock; tests pass time explicitly")

    return OutputRateLimiter(default_tps, user_tps, clock_ns=no_clock)


def take_until_refused(limiter, user: str, now_ns: int) -> int:
    """Charge ``user`` at ``now_ns`` until refused; the number of tokens granted."""
    granted = 0
    while limiter.try_take(user, now_ns):
        granted += 1
    return granted


# --------------------------------------------------------------------------
# Table-driven edge cases
# --------------------------------------------------------------------------


def test_two_tokens_at_t0_from_the_burst_when_rate_is_10_then_refused():
    limiter = make_limiter(10)
    assert limiter.try_take("u", 0)
    assert limiter.try_take("u", 0)
    assert not limiter.try_take("u", 0)
    assert not limiter.try_take("u", 0)  # a refusal charges nothing


@pytest.mark.parametrize(
    "rate_tps", [1, 3, 7, 9, 10, 11, 19, 20, 25, 99, 100, 101, 1000, 12_345, 10**6]
)
@pytest.mark.parametrize("start_ns", [0, 5 * NS_PER_S + 123])
def test_a_fresh_user_gets_floor_tenth_of_rate_plus_one_tokens_at_once(rate_tps, start_ns):
    """The k-th token at one instant (k from 0) needs k/N <= 0.1 s: floor(0.1*N) + 1 tokens."""
    limiter = make_limiter(rate_tps)
    assert take_until_refused(limiter, "u", start_ns) == rate_tps // 10 + 1


# (rate, tokens granted at t=0, first time in ns at which the next take succeeds),
# by hand: after k tokens at 0, TAT = k/N s, and a take succeeds iff TAT - now <= 0.1 s.
BURST_BOUNDARY_CASES = [
    (1, 1, 900_000_000),  # TAT = 1 s            -> 0.9 s
    (3, 1, 233_333_334),  # TAT = 333_333_333.3 ns -> ceil(233_333_333.3)
    (7, 1, 42_857_143),  # TAT = 142_857_142.86 ns -> ceil(42_857_142.86)
    (10, 2, 100_000_000),  # TAT = 0.2 s           -> 0.1 s
    (20, 3, 50_000_000),  # TAT = 0.15 s          -> 0.05 s
    (1000, 101, 1_000_000),  # TAT = 0.101 s       -> 1 ms
    (10**6, 100_001, 1_000),  # TAT = 0.100001 s   -> 1 us
]


@pytest.mark.parametrize(("rate_tps", "burst_tokens", "first_ok_ns"), BURST_BOUNDARY_CASES)
def test_a_take_succeeds_exactly_at_the_burst_boundary_and_not_1ns_earlier(
    rate_tps, burst_tokens, first_ok_ns
):
    limiter = make_limiter(rate_tps)
    assert take_until_refused(limiter, "u", 0) == burst_tokens
    assert limiter.ready_at_ns("u") == first_ok_ns
    early = copy.deepcopy(limiter)
    assert not early.try_take("u", first_ok_ns - 1)
    assert limiter.try_take("u", first_ok_ns)
    assert not limiter.try_take("u", first_ok_ns)  # exactly one token became due


def test_a_take_when_tat_is_exactly_burst_ahead_succeeds():
    """TAT - now == burst (scaled: tat - now*rate == burst*rate) is allowed, one ns later TAT - now > burst is not."""
    limiter = make_limiter(10)
    assert take_until_refused(limiter, "u", 0) == 2  # TAT = 0.2 s
    tat_ns = 200_000_000
    assert not copy.deepcopy(limiter).try_take("u", tat_ns - BURST_NS - 1)
    assert limiter.try_take("u", tat_ns - BURST_NS)


def test_refund_gives_exactly_one_token_back():
    limiter = make_limiter(10)
    assert take_until_refused(limiter, "u", 0) == 2
    limiter.refund("u")
    assert limiter.try_take("u", 0)
    assert not limiter.try_take("u", 0)


@pytest.mark.parametrize("rate_tps", RATES_TPS)
def test_r_refunds_give_back_exactly_r_tokens(rate_tps):
    limiter = make_limiter(rate_tps)
    granted = take_until_refused(limiter, "u", 0)
    refunds = min(granted, 3)
    for _ in range(refunds):
        limiter.refund("u")
    assert take_until_refused(limiter, "u", 0) == refunds


def test_refund_of_an_untracked_user_changes_nothing():
    limiter = make_limiter(10)
    limiter.refund("nobody")
    assert limiter.num_tracked_users == 0
    assert take_until_refused(limiter, "nobody", 0) == 2


def test_refund_never_lifts_an_idle_user_above_a_full_burst():
    """An idle user already holds the whole burst; a refund cannot add to it."""
    limiter = make_limiter(10)
    assert limiter.try_take("u", 0)
    limiter.refund("u")
    limiter.refund("u")  # more refunds than charges: TAT moves into the past
    assert take_until_refused(limiter, "u", 10 * NS_PER_S) == 2


def test_ready_at_of_an_untracked_user_is_not_in_the_future():
    limiter = make_limiter(10)
    assert limiter.ready_at_ns("nobody") <= 0
    assert limiter.try_take("nobody", 0)


@st.composite
def limiter_states(draw):
    """A limiter after a random history of takes and refunds at non-decreasing times."""
    rate_tps = draw(st.sampled_from(RATES_TPS) | st.integers(1, 5000))
    limiter = make_limiter(rate_tps)
    now_ns = draw(st.integers(0, 10 * NS_PER_S))
    for _ in range(draw(st.integers(1, 12))):
        now_ns += draw(st.sampled_from([0, 1, 999, BURST_NS]) | st.integers(0, 2 * NS_PER_S))
        for _ in range(draw(st.integers(1, 6))):
            limiter.try_take("u", now_ns)
        for _ in range(draw(st.integers(0, 2))):
            limiter.refund("u")
    return limiter, now_ns


@PROPERTY_SETTINGS
@given(state=limiter_states())
def test_ready_at_is_never_early_and_never_late(state):
    """At ready_at_ns the next take succeeds; at ready_at_ns - 1 it is refused."""
    limiter, _ = state
    ready_at_ns = limiter.ready_at_ns("u")
    assert copy.deepcopy(limiter).try_take("u", ready_at_ns)
    assert not copy.deepcopy(limiter).try_take("u", ready_at_ns - 1)


@PROPERTY_SETTINGS
@given(state=limiter_states())
def test_ready_at_after_a_refusal_is_later_than_now(state):
    limiter, now_ns = state
    take_until_refused(limiter, "u", now_ns)
    assert limiter.ready_at_ns("u") > now_ns


@pytest.mark.parametrize("rate_tps", [1, 10**6])
def test_extreme_rates_keep_their_rate_over_time(rate_tps):
    """A user asking every 1 ms until refused: the burst at t=0, then exactly N per second.

    Rate 1: tokens at 0, 0.9 s, 1.9 s, ... (TAT 1 s, 2 s, ... may be 0.1 s ahead).
    Rate 10**6: 100_001 at t=0, then 1000 per ms (TAT 0.100001 s may be 0.1 s ahead at 1 ms).
    """
    limiter = make_limiter(rate_tps)
    step_ns = 1_000_000
    duration_ns = 3 * NS_PER_S if rate_tps == 1 else 20 * step_ns
    grants = {
        t: take_until_refused(limiter, "u", t) for t in range(0, duration_ns + 1, step_ns)
    }
    granted_at = {t: n for t, n in grants.items() if n}
    if rate_tps == 1:
        assert granted_at == {0: 1, 900_000_000: 1, 1_900_000_000: 1, 2_900_000_000: 1}
    else:
        assert granted_at[0] == 100_001
        assert all(granted_at[t] == 1000 for t in range(step_ns, duration_ns + 1, step_ns))


def test_per_user_overrides_replace_the_default():
    limiter = make_limiter(10, {"fast": 100, "slow": 1})
    assert limiter.rate_of("fast") == 100
    assert limiter.rate_of("slow") == 1
    assert limiter.rate_of("anyone") == 10
    assert take_until_refused(limiter, "fast", 0) == 11
    assert take_until_refused(limiter, "slow", 0) == 1
    assert take_until_refused(limiter, "anyone", 0) == 2
    assert limiter.ready_at_ns("fast") == 10_000_000  # TAT 0.11 s
    assert limiter.ready_at_ns("slow") == 900_000_000  # TAT 1 s
    assert limiter.ready_at_ns("anyone") == 100_000_000  # TAT 0.2 s


@pytest.mark.parametrize("bad_rate", [0, -1])
def test_a_non_positive_rate_is_refused_by_the_limiter(bad_rate):
    with pytest.raises(ValueError):
        make_limiter(bad_rate)
    with pytest.raises(ValueError, match="'u'"):
        make_limiter(10, {"u": bad_rate})


# Operations of one step: (time advance in ns, user, number of takes, number of refunds).
steps_strategy = st.lists(
    st.tuples(
        st.sampled_from([0, 1, 10_000_000, BURST_NS]) | st.integers(0, 3 * NS_PER_S),
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 4),
        st.integers(0, 2),
    ),
    min_size=1,
    max_size=60,
)


def run_steps(limiter, steps, *, only_user: str | None = None, cleanup=None):
    """Apply steps at non-decreasing times; the answers of every take, and of
    ready_at after each refusal (the only time the scheduler asks for it)."""
    answers = []
    now_ns = 0
    for index, (dt_ns, user, takes, refunds) in enumerate(steps):
        now_ns += dt_ns
        if cleanup is not None:
            cleanup(limiter, index, now_ns)
        if only_user is not None and user != only_user:
            continue
        for _ in range(takes):
            ok = limiter.try_take(user, now_ns)
            answers.append((user, ok, None if ok else limiter.ready_at_ns(user)))
        for _ in range(refunds):
            limiter.refund(user)
    return answers


@PROPERTY_SETTINGS
@given(steps=steps_strategy, rate_a=st.sampled_from(RATES_TPS), rate_b=st.sampled_from(RATES_TPS))
def test_users_are_independent(steps, rate_a, rate_b):
    """User a gets the same answers whether or not b and c are charged in between."""
    overrides = {"a": rate_a, "b": rate_b}
    together = run_steps(make_limiter(20, overrides), steps)
    alone = run_steps(make_limiter(20, overrides), steps, only_user="a")
    assert [x for x in together if x[0] == "a"] == alone


@PROPERTY_SETTINGS
@given(
    steps=steps_strategy,
    rate_a=st.sampled_from(RATES_TPS),
    cleanup_at=st.sets(st.integers(0, 59)),
)
def test_idle_clean_up_is_invisible(steps, rate_a, cleanup_at):
    """The same takes and refunds with and without clean-ups give identical answers.

    One limiter is cleaned at random steps and whenever its clean-up is due
    (as the scheduler does); the other is never cleaned.
    """

    def clean(limiter, index, now_ns):
        if index in cleanup_at or now_ns >= limiter.next_cleanup_ns:
            limiter.cleanup_idle_users(now_ns)

    overrides = {"a": rate_a, "b": 1}
    never_cleaned = run_steps(make_limiter(20, overrides), steps)
    cleaned = run_steps(make_limiter(20, overrides), steps, cleanup=clean)
    assert cleaned == never_cleaned


def test_cleanup_drops_users_whose_tat_is_past_and_keeps_the_others():
    limiter = make_limiter(10, {"slow": 1})
    assert limiter.try_take("quick", 0)  # TAT 0.1 s
    assert limiter.try_take("slow", 0)  # TAT 1 s
    limiter.cleanup_idle_users(50_000_000)
    assert limiter.num_tracked_users == 2
    limiter.cleanup_idle_users(100_000_000)  # TAT == now counts as idle
    assert limiter.num_tracked_users == 1
    limiter.cleanup_idle_users(999_999_999)
    assert limiter.num_tracked_users == 1
    limiter.cleanup_idle_users(NS_PER_S)
    assert limiter.num_tracked_users == 0


def test_cleanup_is_due_once_a_second_after_the_last():
    limiter = make_limiter(10)
    assert limiter.next_cleanup_ns == 0  # due at the first step
    assert limiter.try_take("u", 0)
    limiter.cleanup_idle_users(50_000_000)  # TAT 0.1 s is still ahead
    assert limiter.num_tracked_users == 1
    assert limiter.next_cleanup_ns == NS_PER_S + 50_000_000
    limiter.cleanup_idle_users(limiter.next_cleanup_ns)
    assert limiter.num_tracked_users == 0
    assert limiter.next_cleanup_ns == 2 * NS_PER_S + 50_000_000


def test_many_idle_users_do_not_accumulate():
    limiter = make_limiter(1000)
    for i in range(1000):
        assert limiter.try_take(f"user-{i}", i * 1_000_000)
    assert limiter.num_tracked_users == 1000
    limiter.cleanup_idle_users(2 * NS_PER_S)
    assert limiter.num_tracked_users == 0


# --------------------------------------------------------------------------
# Properties: the bound, and the rate a user that always asks receives
# --------------------------------------------------------------------------


def assert_bound_holds(grants: list[tuple[int, int]], rate_tps: int) -> None:
    """Every window [s, s+W] holds at most (W + 0.1) * N + 1 granted tokens.

    ``grants`` lists (time ns, tokens granted at that time) in time order.
    Brute force over all pairs i <= j of granted tokens, exact: for the tokens
    at given times, the pair with the most tokens between them is the first
    token of the earlier time and the last of the later one, so checking those
    pairs checks every pair.
    """
    for first in range(len(grants)):
        tokens = 0
        for last in range(first, len(grants)):
            tokens += grants[last][1]
            window_ns = grants[last][0] - grants[first][0]
            # tokens <= window_ns / 1e9 * N + N / 10 + 1, times 10 * 1e9
            if 10 * NS_PER_S * tokens > 10 * window_ns * rate_tps + NS_PER_S * rate_tps + 10 * NS_PER_S:
                allowed = Fraction(window_ns, NS_PER_S) * rate_tps + Fraction(rate_tps, 10) + 1
                pytest.fail(
                    f"{tokens} tokens in [{grants[first][0]}, {grants[last][0]}] ns "
                    f"at {rate_tps} tok/s, allowed {allowed}"
                )


def assert_bound_holds_token_by_token(token_times_ns: list[int], rate_tps: int) -> None:
    """The same bound by literal brute force over every pair i <= j of tokens."""
    for i, t_i in enumerate(token_times_ns):
        for j in range(i, len(token_times_ns)):
            window_s = Fraction(token_times_ns[j] - t_i, NS_PER_S)
            assert j - i + 1 <= window_s * rate_tps + Fraction(rate_tps, 10) + 1


@st.composite
def take_patterns(draw):
    """Random attempts by two users at random times: several streams asking per
    step, sometimes a user that takes until refused, and refunds of tokens
    granted in the same step (as the scheduler's one refund point does)."""
    rates = {"a": draw(st.sampled_from(RATES_TPS)), "b": draw(st.sampled_from(RATES_TPS))}
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from([0, 1, 1_000_000, BURST_NS, NS_PER_S // rates["a"]])
                | st.integers(0, 400_000_000),
                st.sampled_from(["a", "b", "both"]),
                st.integers(1, 6) | st.just(-1),  # -1: take until refused
                st.integers(0, 2),
            ),
            min_size=1,
            max_size=50,
        )
    )
    return rates, steps


@PROPERTY_SETTINGS
@given(pattern=take_patterns())
def test_granted_tokens_never_exceed_the_bound_in_any_window(pattern):
    rates, steps = pattern
    limiter = make_limiter(20, rates)
    grants: dict[str, list[tuple[int, int]]] = {"a": [], "b": []}
    now_ns = 0
    for dt_ns, who, takes, refunds in steps:
        now_ns += dt_ns
        for user in ("a", "b") if who == "both" else (who,):
            if takes == -1:
                granted = take_until_refused(limiter, user, now_ns)
            else:
                granted = sum(limiter.try_take(user, now_ns) for _ in range(takes))
            refunded = min(refunds, granted)
            for _ in range(refunded):
                limiter.refund(user)
            if granted - refunded:
                grants[user].append((now_ns, granted - refunded))
    for user, user_grants in grants.items():
        assert_bound_holds(user_grants, rates[user])


@settings(max_examples=40, deadline=None)
@given(
    rate_tps=st.sampled_from([1, 7, 20, 100]),
    steps=st.lists(
        st.tuples(st.integers(0, 200_000_000), st.integers(1, 4)), min_size=1, max_size=40
    ),
)
def test_the_bound_holds_token_by_token(rate_tps, steps):
    limiter = make_limiter(rate_tps)
    token_times_ns: list[int] = []
    now_ns = 0
    for dt_ns, takes in steps:
        now_ns += dt_ns
        token_times_ns += [now_ns for _ in range(takes) if limiter.try_take("u", now_ns)]
    assert_bound_holds_token_by_token(token_times_ns, rate_tps)


def test_the_bound_is_reached_by_a_greedy_user():
    """The bound is tight: at rate 10 a user asking every 1 ms gets 2 + 10*W tokens
    in some windows (2 at t=0, then one every 0.1 s from 0.1 s)."""
    limiter = make_limiter(10)
    grants = [(t, take_until_refused(limiter, "u", t)) for t in range(0, NS_PER_S + 1, 1_000_000)]
    grants = [(t, n) for t, n in grants if n]
    assert grants[:3] == [(0, 2), (100_000_000, 1), (200_000_000, 1)]
    assert_bound_holds(grants, 10)
    tokens_first_second = sum(n for _, n in grants)
    assert tokens_first_second == 12  # (1 + 0.1) * 10 + 1 in [0, 1 s]


# Work cap for an always-asking user: at most this many try_take calls' worth of
# tokens per example (rate 10**6 grants 1000 tokens per ms).
MAX_TOKENS_PER_EXAMPLE = 150_000


def always_asking_grants(rate_tps: int, gaps_ns: list[int]) -> list[tuple[int, int]]:
    """A user that asks at every attempt time until refused; (attempt time, tokens)."""
    limiter = make_limiter(rate_tps)
    grants = []
    now_ns = 0
    budget = MAX_TOKENS_PER_EXAMPLE - (rate_tps // 10 + 1)
    for gap_ns in [0, *gaps_ns]:
        now_ns += gap_ns
        budget -= gap_ns * rate_tps // NS_PER_S
        if budget < 0:
            break
        grants.append((now_ns, take_until_refused(limiter, "u", now_ns)))
    return grants


def assert_always_asking_user_gets_its_rate(grants: list[tuple[int, int]], rate_tps: int) -> None:
    """For attempt times a_p <= a_q, the tokens granted at attempts a_p..a_q are
    at least N * (a_q - a_p) - 1.

    Windows are aligned to attempt times because a user can only be granted
    at an attempt: a window that starts just after one attempt and ends just
    before another loses up to two gaps to step granularity, which is not the
    limiter's doing. Why -1: GCRA with every gap <= burst never lets the TAT
    fall behind now, so over a_p..a_q the TAT advances from at most
    a_{p-1} + burst + 1/N (the last token before the window may have been
    taken while TAT was burst ahead) to more than a_q + burst (the user was
    refused at a_q), i.e. by more than (a_q - a_p) - 1/N seconds, 1/N per token.
    """
    for first in range(len(grants)):
        tokens = 0
        for last in range(first, len(grants)):
            tokens += grants[last][1]
            window_ns = grants[last][0] - grants[first][0]
            # tokens >= window_ns / 1e9 * N - 1, times 1e9
            if NS_PER_S * tokens < window_ns * rate_tps - NS_PER_S:
                pytest.fail(
                    f"only {tokens} tokens in [{grants[first][0]}, {grants[last][0]}] ns "
                    f"at {rate_tps} tok/s"
                )


@PROPERTY_SETTINGS
@given(
    rate_tps=st.sampled_from(RATES_TPS) | st.integers(1, 5000),
    gaps_ns=st.lists(
        st.sampled_from([1, 1_000_000, BURST_NS]) | st.integers(1, BURST_NS),
        min_size=1,
        max_size=80,
    ),
)
def test_a_user_that_always_asks_gets_at_least_rate_times_window_minus_one(rate_tps, gaps_ns):
    grants = always_asking_grants(rate_tps, gaps_ns)
    assert_always_asking_user_gets_its_rate(grants, rate_tps)
    assert_bound_holds(grants, rate_tps)


@pytest.mark.parametrize("rate_tps", RATES_TPS)
def test_a_user_asking_every_millisecond_gets_its_rate(rate_tps):
    step_ns = 1_000_000
    burst_tokens = rate_tps // 10 + 1
    num_steps = min(600, (MAX_TOKENS_PER_EXAMPLE - burst_tokens) * NS_PER_S // (rate_tps * step_ns))
    grants = always_asking_grants(rate_tps, [step_ns] * num_steps)
    assert len(grants) == num_steps + 1
    assert_always_asking_user_gets_its_rate(grants, rate_tps)


def test_the_minus_one_is_needed():
    """Rate 1, asking every 1 ms: tokens at 0, 0.9 s, 1.9 s; the window
    [0.901 s, 1.899 s] is 0.998 s long and holds no token."""
    grants = always_asking_grants(1, [1_000_000] * 2000)
    window = [n for t, n in grants if 901_000_000 <= t <= 1_899_000_000]
    assert sum(window) == 0
    assert [t for t, n in grants if n] == [0, 900_000_000, 1_900_000_000]


# --------------------------------------------------------------------------
# try_take equals the textbook GCRA, whatever the order of calls
# --------------------------------------------------------------------------


class Textbook:
    """docs/promise.md section 2 written out plainly, as the synthetic runs use it
    (``tests/synth.py``'s ``GcraLimiter``): a take at ``now`` is refused iff
    ``tat - now * rate > burst * rate``, else TAT becomes ``max(tat, now * rate) + 10^9``."""

    def __init__(self, default_tps: int, user_tps: dict[str, int]) -> None:
        from synth import GcraLimiter

        self.gcra = GcraLimiter(dict(user_tps), default_tps)

    def try_take(self, user: str, now_ns: int) -> bool:
        return self.gcra.try_take(user, user, now_ns)

    def refund(self, user: str) -> None:
        if user in self.gcra.tat:
            self.gcra.tat[user] -= NS_PER_S


_ops = st.one_of(
    st.tuples(st.just("take"), st.sampled_from(["a", "b", "o"]), st.one_of(st.just(0), st.integers(1, 30_000_000))),
    st.tuples(st.just("refund"), st.sampled_from(["a", "b", "o"]), st.just(0)),
    st.tuples(st.just("default"), st.sampled_from(RATES_TPS), st.just(0)),
    st.tuples(st.just("burst"), st.sampled_from([1, BURST_NS // 2, BURST_NS, NS_PER_S]), st.just(0)),
)


@PROPERTY_SETTINGS
@given(ops=st.lists(_ops, max_size=120), default_tps=st.sampled_from(RATES_TPS),
       override_tps=st.sampled_from(RATES_TPS))
def test_try_take_answers_as_the_textbook_gcra_at_repeated_and_advancing_times(ops, default_tps, override_tps):
    """The limiter computes the scaled `now` of default-rate users once per clock reading; many
    takes at one `now` (a scheduler step), a change of the default rate or of the burst between
    two takes at the same `now` (the broken-limiter tests do that), refunds and overrides must
    still give the textbook answer, take by take."""
    limiter = make_limiter(default_tps, {"o": override_tps})
    textbook = Textbook(default_tps, {"o": override_tps})
    now_ns = 1_000 * NS_PER_S
    for op, arg, advance_ns in ops:
        if op == "take":
            now_ns += advance_ns  # often 0: several takes in one step
            assert limiter.try_take(arg, now_ns) == textbook.try_take(arg, now_ns)
        elif op == "refund":
            limiter.refund(arg)
            textbook.refund(arg)
        elif op == "default":
            limiter.default_tokens_per_second = textbook.gcra.default_tps = arg
        else:
            limiter.burst_ns = textbook.gcra.burst_ns = arg
    for user in ("a", "b", "o"):
        assert take_until_refused(limiter, user, now_ns) == take_until_refused(textbook, user, now_ns)
