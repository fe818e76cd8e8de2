"""The patch's per-user counters for /metrics (--output-rate-metrics-users): what the limiter granted
and refused per user, in the scheduler's stats, and the Prometheus counters with their capped labels.
Summed across the engines of a fleet, the granted counter is a user's rate across the fleet."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from sched_harness import Engine, FakeClock, create_scheduler, make_request
from vllm.v1.core.sched.output_rate import CountingOutputRateLimiter, OutputRateLimiter
from vllm.v1.metrics.loggers import PrometheusStatLogger


def test_the_counting_limiter_counts_grants_net_of_refunds_and_refusals() -> None:
    lim = CountingOutputRateLimiter(10, {"user-b": 20}, burst_ns=100_000_000)
    now = 5_000_000_000
    taken = [lim.try_take("user-a", now) for _ in range(5)]
    assert taken == [True, True, False, False, False]  # 0.1 s x 10 tok/s + 1 = 2 tokens at once
    lim.refund("user-a")
    assert lim.drain_user_counts() == {"user-a": [1, 3]}
    assert lim.drain_user_counts() == {}  # drained
    lim.refund("user-a")  # a refund of a token granted before the last drain: kept back, never reported < 0
    lim.try_take("user-a", now + 10**9)
    assert lim.drain_user_counts() == {}
    lim.try_take("user-a", now + 2 * 10**9)
    assert lim.drain_user_counts() == {"user-a": [1, 0]}


@pytest.mark.parametrize("users", [0, 4])
def test_the_scheduler_sends_its_users_counts_with_its_stats_only_when_asked(users: int) -> None:
    clock = FakeClock()
    sched = create_scheduler(default_tps=100, user_tps={"slow": 10}, max_num_seqs=8, clock=clock,
                             log_stats=True, output_rate_metrics_users=users)
    assert type(sched.output_rate_limiter) is (CountingOutputRateLimiter if users else OutputRateLimiter)
    # the stats update_from_output sends the API server with each step's outputs
    sent = []
    shipped_make_stats = sched.make_stats

    def make_stats(*args, **kwargs):
        stats = shipped_make_stats(*args, **kwargs)
        sent.append(stats.output_rate_user_counts)
        return stats

    sched.make_stats = make_stats
    engine = Engine(sched, clock, step_s=0.01)
    engine.add(make_request("a", user="slow", max_tokens=40), make_request("b", user="fast", max_tokens=40),
               make_request("c", max_tokens=5))
    engine.run_for_s(1.0)
    engine.drain()
    assert len(sent) >= 99
    granted: dict[str, int] = {}
    refused: dict[str, int] = {}
    for counts in sent:
        if not users:
            assert counts is None
            continue
        for user, (g, r) in (counts or {}).items():
            granted[user] = granted.get(user, 0) + g
            refused[user] = refused.get(user, 0) + r
    if users:
        assert granted.get("fast") == 40 and granted.get("__anonymous__") == 5, (granted, refused)
        # 10 tok/s for a second, its burst of 2 at the start: 11 or 12 tokens, the rest refused
        assert 10 <= granted["slow"] <= 12 and refused["slow"] > 0, (granted, refused)
        assert refused.get("fast", 0) == 0


def _logger(cap: int) -> tuple[PrometheusStatLogger, CollectorRegistry]:
    logger = object.__new__(PrometheusStatLogger)  # only what _record_output_rate_users uses
    reg = CollectorRegistry()
    logger.output_rate_metrics_users = cap
    logger.output_rate_named_users = set()
    logger.per_engine_labelvalues = {0: ["tiny", "0"]}
    logger.counter_output_rate_granted = Counter("vllm:output_rate_tokens_granted", "", ["model_name", "engine", "user"],
                                                 registry=reg)
    logger.counter_output_rate_refused = Counter("vllm:output_rate_charges_refused", "",
                                                 ["model_name", "engine", "user"], registry=reg)
    return logger, reg


def test_the_prometheus_counters_name_the_first_users_and_count_the_rest_as_other() -> None:
    logger, reg = _logger(cap=2)
    logger._record_output_rate_users({"user-a": [5, 1], "user-b": [3, 0]}, 0)
    logger._record_output_rate_users({"user-c": [7, 2], "user-a": [1, 0], "user-d": [2, 0]}, 0)
    text = generate_latest(reg).decode()
    assert 'vllm:output_rate_tokens_granted_total{engine="0",model_name="tiny",user="user-a"} 6.0' in text
    assert 'vllm:output_rate_tokens_granted_total{engine="0",model_name="tiny",user="user-b"} 3.0' in text
    assert 'vllm:output_rate_tokens_granted_total{engine="0",model_name="tiny",user="__other__"} 9.0' in text
    assert 'vllm:output_rate_charges_refused_total{engine="0",model_name="tiny",user="__other__"} 2.0' in text
    assert 'user="user-c"' not in text
