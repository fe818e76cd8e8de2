"""A fleet's failover, judged from what the client saw (analysis/fleet.py): no request may end looking
complete without being so, and the stopped engine's users must be served elsewhere afterwards."""

from __future__ import annotations

from ratebench.analysis.fleet import failover_outcomes
from ratebench.runrecords import ClientRecord
from ratebench.phasefacts import Failover

MEMBERS = ["patched-sync.e0", "patched-sync.e1"]
STOP = Failover.read({"engine": "patched-sync.e1", "stopped_ns": 1_000, "users_before": ["user-a", "user-b"]})


def _rec(n: int, user: str, engine: str, sent: int, **kw) -> ClientRecord:
    base = dict(client_id=f"rb-x-{n}", scenario="fleet", phase="failover", engine=engine, user=user,
                api="completions", stream_index=n, max_tokens=12, ignore_eos=True, sent_ns=sent,
                fleet="fleet2-sync", finish_reason="length", completion_tokens=12)
    return ClientRecord(**{**base, **kw})


def _healthy() -> list[ClientRecord]:
    return [
        _rec(0, "user-a", "patched-sync.e1", 10),
        _rec(1, "user-a", "patched-sync.e1", 20, finish_reason="abort", completion_tokens=5),  # cut by the stop
        _rec(2, "user-a", "fleet2-sync", 1_100, finish_reason=None, completion_tokens=None, http_status=503,
             error="HTTP 503: No server is available"),  # refused while the balancer found it gone
        _rec(3, "user-a", "patched-sync.e0", 1_200),  # moved
        _rec(4, "user-b", "patched-sync.e1", 30),
        _rec(5, "user-b", "patched-sync.e0", 1_300),
        _rec(6, "user-c", "patched-sync.e0", 40),
    ]


def test_a_failover_that_cuts_and_refuses_visibly_and_moves_its_users_passes() -> None:
    o = failover_outcomes(_healthy(), MEMBERS, STOP)
    assert o.completed == 5 and o.lost_silently == [] and o.not_moved == []
    assert o.moved == {"user-a": "patched-sync.e0", "user-b": "patched-sync.e0"}
    assert sum(len(v) for v in o.failed_visibly.values()) == 2
    assert any("refused by the balancer (HTTP 503)" in how for how in o.failed_visibly)


def test_an_answer_cut_short_that_looks_complete_is_lost_silently() -> None:
    records = _healthy()
    # the stopped engine's answer ends as if finished (length), 5 of 12 tokens, no error
    records[1] = _rec(1, "user-a", "patched-sync.e1", 20, finish_reason="length", completion_tokens=5)
    o = failover_outcomes(records, MEMBERS, STOP)
    assert len(o.lost_silently) == 1 and "rb-x-1" in o.lost_silently[0] and "5 of 12" in o.lost_silently[0]
    # no finish reason, no error: lost as well
    records[1] = _rec(1, "user-a", "patched-sync.e1", 20, finish_reason=None, completion_tokens=None)
    assert len(failover_outcomes(records, MEMBERS, STOP).lost_silently) == 1


def test_a_user_of_the_stopped_engine_never_served_again_is_not_moved() -> None:
    records = [r for r in _healthy() if r.client_id != "rb-x-5"]
    records.append(_rec(7, "user-b", "fleet2-sync", 1_300, finish_reason=None, completion_tokens=None,
                        http_status=503, error="HTTP 503: No server is available"))
    o = failover_outcomes(records, MEMBERS, STOP)
    assert o.not_moved == ["user-b"] and "user-a" in o.moved


def test_a_per_user_counter_that_differs_from_the_charges_by_one_token_fails_fleet_metrics() -> None:
    from ratebench.analysis.checks.fleet import _fleet_counters
    from ratebench.analysis.fleet import FleetPhase, FleetUser

    def phase(e0_counted: float) -> FleetPhase:
        return FleetPhase("fleet", "round-robin", "fleet2-sync", "round-robin", MEMBERS, 4,
                          users=[FleetUser("user-a", 30, 4, {"patched-sync.e0": 80, "patched-sync.e1": 80})],
                          counters={"patched-sync.e0": {"user-a": {"granted": e0_counted, "refused": 3.0}},
                                    "patched-sync.e1": {"user-a": {"granted": 80.0, "refused": 2.0}}})

    (ok,) = _fleet_counters(phase(80.0))
    assert ok.passed and ok.figure == 0 and "across the fleet 160 tokens" in ok.explanation
    (bad,) = _fleet_counters(phase(79.0))  # a counter one token short of what the limiter charged
    assert bad.passed is False and bad.figure == 1 and "79 counted, 80 dispatch events" in bad.explanation
