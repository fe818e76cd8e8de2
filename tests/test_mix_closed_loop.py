"""Closed loops: a mix tier whose users each keep k requests open, sending the next when one ends.
The driver (a scripted server, no engine), the requests a tier makes, the phase's users, and every
malformed closed-loop tier refused at profile load."""

from __future__ import annotations

import asyncio

import pytest

from ratebench.mix import mix_requests
from ratebench.profiles import parse_profile
from ratebench.scenarios import EngineRef, ScenarioContext
from ratebench.scenarios.mix import mix_phase_users
from ratebench.scenarios.trace import trace_streams
from ratebench.workload import Driver, StreamRequest
from test_mix import _data, _refused
from test_trace import _FakeDriver
from test_workload import CTX, chunk, final, run, server, sse

_CLOSED = {"name": "loop", "users": 2, "limit_tps": 30, "arrival": "closed", "streams": 2, "requests": 5}


async def _three_chunks(_req):
    for n in range(1, 4):
        yield chunk(n)
        await asyncio.sleep(0.02)
    yield final(3)
    yield sse("[DONE]")


def _loop(user: str, n: int, k: int, **kw) -> list[StreamRequest]:
    return [StreamRequest(user=user, prompt=[1], max_tokens=3, stream_index=i, loop_group=user, loop_streams=k, **kw)
            for i in range(n)]


def _most_at_once(recs) -> int:
    return max(sum(1 for o in recs if o.sent_ns <= r.sent_ns < o.done_ns) for r in recs)


def test_a_closed_loop_keeps_k_requests_open_and_sends_the_next_when_one_ends() -> None:
    driver = Driver("ab12", live=False, transport=server(_three_chunks))
    recs = run(driver, _loop("a", 6, 2) + _loop("b", 3, 1))
    a, b = recs[:6], recs[6:]
    assert all(r.completion_tokens == 3 and r.error is None for r in recs)
    assert _most_at_once(a) == 2 and _most_at_once(b) == 1  # each loop on its own
    ends = sorted(r.done_ns for r in a)
    for r in sorted(a, key=lambda r: r.sent_ns)[2:]:
        # its time is when the request whose place it took ended; sent right after
        assert r.scheduled_ns in ends and r.scheduled_ns <= r.sent_ns < r.scheduled_ns + 20_000_000
    assert [r.stream_index for r in sorted(b, key=lambda r: r.sent_ns)] == [0, 1, 2]  # in list order
    assert all(x.done_ns <= y.sent_ns for x, y in zip(b, b[1:]))


def test_a_closed_loops_think_time_counts_from_the_end_of_the_request_before() -> None:
    driver = Driver("ab12", live=False, transport=server(_three_chunks))
    recs = run(driver, _loop("a", 3, 1, delay_s=0.05))
    for before, after in zip(recs, recs[1:]):
        assert after.scheduled_ns == before.done_ns + 50_000_000 and after.sent_ns >= after.scheduled_ns


def test_an_interrupted_closed_loop_marks_the_requests_still_waiting_for_a_place() -> None:
    async def endless(_req):
        n = 0
        while True:
            n += 1
            yield chunk(n)
            await asyncio.sleep(0.01)

    driver = Driver("ab12", live=False, transport=server(endless))

    async def main():
        task = asyncio.create_task(driver.run_phase(CTX, _loop("a", 3, 1)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    first, *waiting = driver.records
    assert first.cancelled and first.error == "interrupted" and first.sent_ns is not None
    assert all(r.cancelled and r.error == "interrupted" and r.sent_ns is None for r in waiting)


def _mix(**tier) -> dict:
    return parse_profile(_data(tiers=[{**_CLOSED, **tier}, {"name": "t1", "users": 2, "limit_tps": 20, "rate": 0.5}]),
                         "my.toml").scenarios[0].params


def test_a_closed_tier_makes_its_requests_per_user_in_one_loop_each() -> None:
    p = _mix(think_s=0.25)
    reqs = mix_requests(p)
    loop = [r for r in reqs if r.user and r.user.startswith("loop-")]
    assert len(loop) == 2 * 5 and {r.user for r in loop} == {"loop-00", "loop-01"}
    assert {(r.loop_streams, r.at_s) for r in loop} == {(2, 0.25)}
    assert all(r.loop_streams is None for r in reqs if r not in loop)
    assert mix_requests(p) == reqs
    assert parse_profile(_data(tiers=[{**_CLOSED}]), "my.toml").limits.limit_of("loop-01") == 30


def test_a_closed_loop_reaches_the_driver_as_one_loop_per_user() -> None:
    reqs = mix_requests(_mix())
    ctx = ScenarioContext(profile=None, spec=None, driver=_FakeDriver(), on_phase=lambda p: None)  # type: ignore
    out = asyncio.run(trace_streams(ctx, EngineRef("e", "http://engine", "m", True, "patched"), reqs, "s"))
    for r, s in zip(reqs, out):
        if r.loop_streams:
            assert (s.loop_group, s.loop_streams) == (r.user, 2)
        else:
            assert s.loop_group is None


def test_the_mix_phase_records_each_users_tier_and_the_backlogged_closed_loops() -> None:
    p = _mix(backlogged=True)
    users = mix_phase_users(p, mix_requests(p))
    assert users["loop-00"]["tier"] == "loop" and users["t1-01"]["tier"] == "t1"
    assert users["loop-01"]["backlogged"] and not users["t1-00"]["backlogged"]
    assert "tier" not in users["__anonymous__"]
    assert not mix_phase_users(_mix(), mix_requests(_mix()))["loop-00"]["backlogged"]


_T0 = "scenarios[0].tiers[0]"


@pytest.mark.parametrize("change, key, expected", [
    ({"arrival": "bursty"}, f"{_T0}.arrival", 'one of ["poisson", "constant", "closed"]'),
    ({"requests": None}, f"{_T0}.requests", "it is required"),
    ({"requests": 0}, f"{_T0}.requests", "a positive integer"),
    ({"streams": 0}, f"{_T0}.streams", "a positive integer"),
    ({"streams": 6}, f"{_T0}.streams", "at most requests (5)"),
    ({"think_s": -1}, f"{_T0}.think_s", "a number >= 0"),
    ({"backlogged": "yes"}, f"{_T0}.backlogged", "true or false"),
    ({"rate": 1.0}, f"{_T0}.rate", 'no rate nor burst with arrival = "closed"'),
    ({"burst": True}, f"{_T0}.burst", 'no rate nor burst with arrival = "closed"'),
    ({"arrival": "poisson", "rate": 1.0}, f"{_T0}.streams", 'arrival = "closed" with it'),
])
def test_every_malformed_closed_loop_tier_is_refused(change: dict, key: str, expected: str) -> None:
    tier = {k: v for k, v in {**_CLOSED, **change}.items() if v is not None}
    _refused(_data(tiers=[tier]), key, expected)


def test_an_open_tier_may_take_its_own_arrivals() -> None:
    p = parse_profile(_data(tiers=[{"name": "t", "users": 1, "rate": 5.0, "arrival": "constant"}], anonymous_rate=0,
                            duration_s=20), "my.toml").scenarios[0].params
    reqs = mix_requests(p)
    gaps = {round(b.at_s - a.at_s, 3) for a, b in zip(reqs, reqs[1:])}
    assert gaps <= {0.2, 0.199, 0.201}


def test_a_tier_rate_is_the_whole_tiers_arrivals_spread_over_its_users() -> None:
    tiers = [{"name": "t", "users": 5, "tier_rate": 10.0}]
    p = parse_profile(_data(tiers=tiers, anonymous_rate=0, duration_s=100), "my.toml").scenarios[0].params
    reqs = mix_requests(p)
    assert 900 <= len(reqs) <= 1100 and [r.at_s for r in reqs] == sorted(r.at_s for r in reqs)
    per_user = [sum(1 for r in reqs if r.user == f"t-0{i}") for i in range(5)]
    assert all(abs(n - len(reqs) / 5) < 0.25 * len(reqs) / 5 for n in per_user)


@pytest.mark.parametrize("tier, key, expected", [
    ({"rate": 1.0, "tier_rate": 2.0}, "tier_rate", "neither rate (per user) nor burst"),
    ({"burst": True, "tier_rate": 2.0}, "tier_rate", "neither rate (per user) nor burst"),
    ({"tier_rate": -1}, "tier_rate", "a number >= 0"),
    ({"arrival": "closed", "requests": 2, "tier_rate": 1.0}, "tier_rate", 'no rate nor burst with arrival = "closed"'),
])
def test_a_malformed_tier_rate_is_refused(tier: dict, key: str, expected: str) -> None:
    _refused(_data(tiers=[{"name": "t", "users": 2, **tier}]), f"{_T0}.{key}", expected)
