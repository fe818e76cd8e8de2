"""The pressure checks (ratebench/analysis/pressure.py): stream-wait, place-share, kv-pressure-applied.

Synthetic run folders from the simulated engine, then the engine event file edited the way a
broken limiter would have written it: a user's stream that got no token for seconds, users the
active places left out until the others were done."""

from __future__ import annotations

import numpy as np
import pytest

from ratebench.analysis.checks import build_checks
from ratebench.analysis.load import load_run
from ratebench.analysis.pressure import fair_shares, fair_shares_by_priority, place_shares, stream_waits
from ratebench.analysis.summary import summarize_run
from ratebench.analysis.verdict import Thresholds
from ratebench.events import KIND_DISPATCH, KIND_EMIT, EventFileWriter, read_engine_events
from synth import SimEngine, SimPhase, SimRequest, write_run_folder
from synthetic_runs import edit_client_records, edit_scenarios


def _checks(run_dir, name):
    run = load_run(run_dir)
    th = Thresholds()
    return [c for c in build_checks(run, summarize_run(run), th) if c.name == name]


def _rewrite_events(run_dir, keep):
    """Keep only the engine events for which ``keep(records, strings)`` is True."""
    path = run_dir / "engines" / "patched-sync" / "events.rbev"
    ev = read_engine_events(path)
    mask = keep(ev.records, ev.strings)
    with EventFileWriter(path, ev.meta) as w:
        for s in ev.strings:
            w.intern(s)
        w.write_block(ev.records[mask])


def _throttled_run(tmp_path):
    """user-a at 20 tok/s with 4 streams beside user-c at 200 tok/s: a kv-shared phase."""
    eng = SimEngine("patched-sync", default_tps=100, user_tps={"user-a": 20, "user-c": 200})
    reqs = [SimRequest(f"rb-5e1f0001-{i}", "user-a", i, 40) for i in range(4)]
    reqs += [SimRequest(f"rb-5e1f0001-{4 + i}", "user-c", 4 + i, 60, arrive_offset_ns=500_000_000 * (i + 1))
             for i in range(3)]
    phase = SimPhase("kv-pressure", "kv-pressure", "kv-shared", "patched-sync", "shared",
                     {"user-a": {"limit_tps": 20, "streams": 4, "backlogged": True},
                      "user-c": {"limit_tps": 200, "streams": 3, "backlogged": False}}, reqs,
                     params={"stream_wait": ["user-a"], "kv_usage_max": 0.97, "preemptions": 4})
    return write_run_folder(tmp_path / "run", [eng], [phase])


def test_streams_taking_turns_pass_stream_wait(tmp_path):
    run_dir = _throttled_run(tmp_path)
    [check] = _checks(run_dir, "stream-wait")
    assert check.passed, check.explanation
    # 4 streams at 20 tok/s: a token every 200 ms per stream
    assert 150 <= check.figure <= 260, check.explanation
    assert check.threshold == pytest.approx(2 * 200 + 300)
    [applied] = _checks(run_dir, "kv-pressure-applied")
    assert applied.passed and applied.figure == 4


def test_a_stream_left_without_tokens_fails_stream_wait(tmp_path):
    # stream 0 of user-a gets nothing from 0.5 s to 2.5 s (its siblings keep the budget)
    check = _starve_stream_0(_throttled_run(tmp_path))
    assert not check.passed
    assert check.figure >= 1900
    assert "stream 0" in check.explanation


def test_a_phase_without_pressure_fails_kv_pressure_applied(tmp_path):
    run_dir = _throttled_run(tmp_path)

    def no_pressure(phases):
        phases[0]["params"].update(kv_usage_max=0.41, preemptions=0)

    edit_scenarios(run_dir, no_pressure)
    [check] = _checks(run_dir, "kv-pressure-applied")
    assert not check.passed
    assert "never ran short of KV" in check.explanation


def _places_run(tmp_path, users=4, streams=2, high=False, high_delay_ns=300_000_000, high_streams=None):
    limits = {f"cap-{i:02d}": 1000 for i in range(users)}
    if high:
        limits["cap-high"] = 5000
    eng = SimEngine("patched-sync", default_tps=100, user_tps=limits)
    reqs, n = [], 0
    for u in limits:
        for k in range(high_streams if u == "cap-high" and high_streams else streams):
            delay = high_delay_ns if u == "cap-high" else 0
            reqs.append(SimRequest(f"rb-5e1f0001-{n}", u, n, 200, arrive_offset_ns=delay))
            n += 1
    phase = SimPhase("active-cap-fairness", "active-cap-fairness", "cap-high" if high else "cap-equal",
                     "patched-sync", "measure",
                     {u: {"limit_tps": lim, "streams": streams, "backlogged": False} for u, lim in limits.items()},
                     reqs, params={"place_share": True})
    return write_run_folder(tmp_path / "run", [eng], [phase])


def test_users_served_alike_pass_place_share(tmp_path):
    run_dir = _places_run(tmp_path)
    share, jain = _checks(run_dir, "place-share")[0], _checks(run_dir, "place-share-jain")[0]
    assert share.passed and share.figure >= 0.95, share.explanation
    assert jain.passed and jain.figure >= 0.99
    (most,) = _checks(run_dir, "place-share-max")
    assert most.passed and most.figure <= 1.05, most.explanation


@pytest.mark.parametrize("high", [False, True])
def test_users_left_out_of_the_places_fail_place_share(tmp_path, high):
    # The first users in the running list take the places until their answers are done; the last
    # ones (or cap-high, arriving last) get their tokens only after that.
    run_dir = _places_run(tmp_path, high=high)
    run = load_run(run_dir)
    phase = run.phases[0]
    late = {"cap-high"} if high else {"cap-02", "cap-03"}
    trace = run.traces["patched-sync"]
    shift = 3_000_000_000

    path = run_dir / "engines" / "patched-sync" / "events.rbev"
    ev = read_engine_events(path)
    recs = ev.records.copy()
    is_late = np.array([u in late for u in ev.strings])[recs["user"]]
    recs["t_ns"][is_late] += shift
    recs = recs[np.argsort(recs["t_ns"], kind="stable")]
    with EventFileWriter(path, ev.meta) as w:
        for s in ev.strings:
            w.intern(s)
        w.write_block(recs)
    del trace, phase
    share = _checks(run_dir, "place-share")[0]
    jain = _checks(run_dir, "place-share-jain")[0]
    assert not share.passed and share.user in late and share.figure < 0.1, share.explanation
    assert not jain.passed


def test_a_user_served_ahead_of_the_others_fails_place_share_max(tmp_path):
    # cap-00..05 at one stream each and cap-high at two: the simulated engine serves every stream alike
    # (a token a step), so cap-high's two streams take twice a user's share. The six others lose a
    # seventh each: place-share (0.86 x) and Jain's index (0.92) pass; place-share-max names cap-high
    run_dir = _places_run(tmp_path, users=6, streams=1, high=True, high_streams=2)
    (share,) = _checks(run_dir, "place-share")
    (jain,) = _checks(run_dir, "place-share-jain")
    assert share.passed and jain.passed, (share.explanation, jain.explanation)
    (most,) = _checks(run_dir, "place-share-max")
    assert not most.passed and most.user == "cap-high" and 1.6 < most.figure < 1.9, most.explanation
    # served by user, not by stream: passed
    (most,) = _checks(_places_run(tmp_path / "even", users=6, streams=1, high=True), "place-share-max")
    assert most.passed and most.figure < 1.05, most.explanation


def test_a_phase_whose_users_never_all_want_tokens_at_once_fails_place_share(tmp_path):
    # cap-high arrives after every other user is done: nothing was measured. Judged as the users'
    # shares from the last arrival to the phase's end, the users done early would count 0 and the
    # check would blame the limiter; it fails instead for the phase's size, saying what to change.
    run_dir = _places_run(tmp_path, high=True, high_delay_ns=10_000_000_000)
    (share,) = _checks(run_dir, "place-share")
    assert not share.passed and share.figure == 0.0 and share.unit == "s measured", share.explanation
    assert "never all wanted tokens at once" in share.explanation and "max_tokens" in share.explanation
    assert "cap-00" in share.user and "cap-high" not in share.user
    assert not _checks(run_dir, "place-share-jain")


def test_fair_shares_fill_up_to_each_limit():
    assert fair_shares(300, {"a": 1000, "b": 1000, "c": 1000}) == pytest.approx({"a": 100, "b": 100, "c": 100})
    # a low limit takes what it may; the rest split the remainder
    assert fair_shares(300, {"a": 20, "b": 1000, "c": 1000}) == pytest.approx({"a": 20, "b": 140, "c": 140})


def test_fair_shares_by_priority_go_to_higher_priorities_first():
    limits = {"hi": 5000, "a": 1000, "b": 1000}
    # hi's 2 streams can take 2 of the 4 places a step: half the rate; a and b split the rest
    assert fair_shares_by_priority(1200, limits, {"hi": -1, "a": 0, "b": 0}, {"hi": 2, "a": 1, "b": 1},
                                   4) == pytest.approx({"hi": 600, "a": 300, "b": 300})
    # with streams for every place hi takes it all: the lower priority's fair share is 0
    assert fair_shares_by_priority(1200, limits, {"hi": -1, "a": 0, "b": 0}, {"hi": 4, "a": 1, "b": 1},
                                   4) == pytest.approx({"hi": 1200, "a": 0, "b": 0})
    # a limit caps a level as it caps a user: what the higher priority cannot take goes down a level
    assert fair_shares_by_priority(1200, {"hi": 100, "a": 1000, "b": 1000}, {"hi": -1, "a": 0, "b": 0},
                                   {"hi": 4, "a": 1, "b": 1}, 4) == pytest.approx({"hi": 100, "a": 300, "b": 300})


def _priority_places_run(tmp_path, policy="PRIORITY", places=2, users=4):
    """cap-high (2 streams, arriving last) at priority -1 beside cap-00.. (2 streams each) at 0; the
    simulated engine serves every stream alike (a token a step): what a limiter that ignores priorities
    gives them."""
    run_dir = _places_run(tmp_path, users=users, high=True)
    path = run_dir / "engines" / "patched-sync" / "events.rbev"
    ev = read_engine_events(path)
    with EventFileWriter(path, {**ev.meta, "policy": policy, "max_num_active_seqs": places}) as w:
        for s in ev.strings:
            w.intern(s)
        w.write_block(ev.records)

    def high_first(recs):
        for r in recs:
            if r.user == "cap-high":
                r.priority = -1

    edit_client_records(run_dir, high_first)
    return run_dir


def test_a_priority_engine_that_serves_priorities_alike_fails_place_share(tmp_path):
    # cap-high's two streams at priority -1 could take both places (2) every step: its fair share is the
    # whole rate; served like the priority-0 users it got a third of it
    (share,) = _checks(_priority_places_run(tmp_path), "place-share")
    assert not share.passed and share.user == "cap-high" and share.figure < 0.4, share.explanation
    assert "PRIORITY policy" in share.explanation and "cap-high -1" in share.explanation
    # the same run from an FCFS engine (priorities not acted on): every user's max-min share, passed
    (share,) = _checks(_priority_places_run(tmp_path / "fcfs", policy="FCFS"), "place-share")
    assert share.passed and "PRIORITY" not in share.explanation, share.explanation


def test_a_higher_priority_served_alike_fails_place_share_priority_where_place_share_passes(tmp_path):
    # cap-high's two streams beside two users' four at priority 0 on 4 places: its fair share is half the
    # rate (its 2 streams of the 4 places), served alike it got 2 of 6 streams' tokens, 0.67 of that. The
    # lower users got 1.33 of theirs: place-share's floor (0.5) and Jain's index (0.92) pass; a user of a
    # higher priority is owed its whole share
    run_dir = _priority_places_run(tmp_path, places=4, users=2)
    (share,) = _checks(run_dir, "place-share")
    (jain,) = _checks(run_dir, "place-share-jain")
    assert share.passed and jain.passed, (share.explanation, jain.explanation)
    (high,) = _checks(run_dir, "place-share-priority")
    assert not high.passed and high.user == "cap-high" and 0.6 < high.figure < 0.75, high.explanation
    assert "above the lowest priority" in high.explanation
    # an FCFS engine (priorities not acted on): no such check
    assert not _checks(_priority_places_run(tmp_path / "fcfs", policy="FCFS", places=4, users=2),
                       "place-share-priority")


def test_a_priority_engine_that_serves_the_higher_priority_first_passes_place_share(tmp_path):
    # the priority-0 users get their tokens only after cap-high's answers are done
    run_dir = _priority_places_run(tmp_path)
    path = run_dir / "engines" / "patched-sync" / "events.rbev"
    ev = read_engine_events(path)
    recs = ev.records.copy()
    low = np.array([u.startswith("cap-0") for u in ev.strings])[recs["user"]]
    high_t = recs["t_ns"][~low & (recs["kind"] == KIND_DISPATCH)]
    late = low & (recs["t_ns"] > high_t.min())
    recs["t_ns"][late] += int(high_t.max() - high_t.min()) + 1
    recs = recs[np.argsort(recs["t_ns"], kind="stable")]
    with EventFileWriter(path, ev.meta) as w:
        for s in ev.strings:
            w.intern(s)
        w.write_block(recs)
    (share,) = _checks(run_dir, "place-share")
    assert share.passed and share.figure >= 0.95, share.explanation
    assert "cap-high -1" in share.explanation
    (high,) = _checks(run_dir, "place-share-priority")
    assert high.passed and high.user == "cap-high" and high.figure >= 0.95, high.explanation


def test_phases_without_the_params_have_no_pressure_figures(tmp_path):
    run_dir = _places_run(tmp_path)
    edit_scenarios(run_dir, lambda phases: phases[0]["params"].clear())
    run = load_run(run_dir)
    assert place_shares(run, run.phases[0]) is None
    assert stream_waits(run, run.phases[0]) == []


def test_engine_metrics_read_preemptions_kv_use_and_size():
    from ratebench.engine_metrics import parse_engine_metrics

    text = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny-qwen3"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-qwen3"} 0.9647
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="256"} 1.0
"""
    assert parse_engine_metrics(text) == {"num_preemptions": 5.0, "kv_cache_usage_perc": 0.9647,
                                          "kv_cache_tokens": 8192.0}
    assert parse_engine_metrics("") == {}


def _mix_run(tmp_path, measure_step_ns=None, abort_delay_ns=2_000_000):
    """A mix phase (team-00 isolated at 2000 tok/s, free-00 at 20) and the same requests on the
    limiter-off engine (mix-baseline)."""
    on = SimEngine("patched-sync", default_tps=100, user_tps={"team-00": 2000, "free-00": 20},
                   abort_delay_ns=abort_delay_ns)
    off = SimEngine("feature-off-sync", feature=False, default_tps=None)

    def reqs(prefix):
        out = [SimRequest(f"rb-5e1f0001-{prefix + i}", "team-00", i, 40, arrive_offset_ns=200_000_000 * i,
                          cancel_after_ns=50_000_000 if i == 3 else None)
               for i in range(4)]
        return out + [SimRequest(f"rb-5e1f0001-{prefix + 10 + i}", "free-00", 4 + i, 20) for i in range(2)]

    users = {"team-00": {"limit_tps": 2000, "streams": 4, "backlogged": False, "tier": "team", "isolated": True},
             "free-00": {"limit_tps": 20, "streams": 2, "backlogged": False, "tier": "free"}}
    base_users = {u: {**v, "limit_tps": None} for u, v in users.items()}
    phases = [SimPhase("mix", "mix", "mix", "patched-sync", "measure", users, reqs(1000), step_ns=measure_step_ns),
              SimPhase("mix", "mix", "mix-baseline", "feature-off-sync", "baseline", base_users, reqs(2000))]
    return write_run_folder(tmp_path / "run", [on, off], phases)


def test_a_mix_judges_its_isolated_tiers_against_the_baseline_phase(tmp_path):
    # the simulated engine records no refusals here: which limits bound cannot be told, so only the
    # tier marked isolated is judged; the free tier's figures are information, and say why
    run_dir = _mix_run(tmp_path)
    iso = [c for c in _checks(run_dir, "isolation-rate") + _checks(run_dir, "isolation-ttft")]
    assert {c.user for c in iso if c.passed is not None} == {"team tier"} and all(c.passed is not False for c in iso), \
        [c.explanation for c in iso]
    assert [c.passed for c in iso if c.name == "isolation-ttft" and c.user == "team tier"] == [True]
    free = [c for c in iso if c.user == "free tier"]
    assert free and all(c.passed is None and "cannot tell" in c.explanation for c in free)


def test_an_isolated_tier_slowed_down_in_the_mix_fails_isolation(tmp_path):
    run_dir = _mix_run(tmp_path, measure_step_ns=100_000_000)  # 20x the baseline engine's 5 ms steps
    [ttft] = [c for c in _checks(run_dir, "isolation-ttft") if c.user == "team tier"]
    assert not ttft.passed and "team tier" in ttft.explanation, ttft.explanation
    # the rate is judged in a mix too (it was information only)
    [rate] = [c for c in _checks(run_dir, "isolation-rate") if c.user == "team tier"]
    assert rate.passed is False and rate.figure < 0.2, rate.explanation


def test_a_mix_may_allow_more_steps_after_a_cancel(tmp_path):
    # the abort reaches the engine 12 ms after the cancel: about two 5 ms steps emit after it
    run_dir = _mix_run(tmp_path, abort_delay_ns=12_000_000)
    [failed] = [c for c in _checks(run_dir, "cancellation") if c.phase == "mix" and c.user == "team-00"]
    assert not failed.passed and failed.threshold == 1 and failed.figure >= 2, failed.explanation
    edit_scenarios(run_dir, lambda phases: phases[0]["params"].update(cancel_max_steps=5))
    [allowed] = [c for c in _checks(run_dir, "cancellation") if c.phase == "mix" and c.user == "team-00"]
    assert allowed.threshold == 5 and allowed.passed, allowed.explanation


# ---- every record's longest wait at once, against one record at a time ----------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ratebench.analysis.load import EngineTrace  # noqa: E402
from ratebench.analysis.pressure import longest_waits  # noqa: E402
from ratebench.events import RECORD_DTYPE  # noqa: E402


def _one_at_a_time(times, sent, cancel, max_tokens, owner):
    """The per-record scan stream_waits made before it computed every record at once."""
    firsts = {}
    for t, u in zip(times, owner):
        if t:
            firsts[u] = min(firsts.get(u, t[0]), t[0])
    out = []
    for t, s, c, mt, u in zip(times, sent, cancel, max_tokens, owner):
        uf = firsts.get(u)
        start = s if uf is None else max(s, min(uf, t[0] if t else uf))
        closed = c >= 0 and len(t) < mt
        marks = [start, *t, *([c] if closed else [])]
        if len(marks) < 2:
            out.append(None)
            continue
        gaps = np.diff(marks)
        k = int(np.argmax(gaps))
        where = 2 if closed and k == len(gaps) - 1 else (0 if k == 0 else 1)
        out.append((int(gaps[k]), int(marks[k]), where))
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 60), max_size=6), st.integers(0, 40), st.integers(-1, 80),
                          st.integers(1, 6), st.integers(0, 2)), min_size=1, max_size=8))
def test_every_records_longest_wait_at_once_equals_one_at_a_time(recs):
    recs.sort(key=lambda r: r[4])  # records in user order, as stream_waits lists them
    times = [sorted(r[0]) for r in recs]
    sent = np.array([r[1] for r in recs], dtype=np.int64)
    cancel = np.array([r[2] for r in recs], dtype=np.int64)
    max_tokens = np.array([r[3] for r in recs], dtype=np.int64)
    owner = np.array([r[4] for r in recs], dtype=np.int64)
    # the per-request figures from a trace of their dispatch events (request code = record number)
    ev = [(t, j) for j, ts in enumerate(times) for t in ts]
    ev.sort(key=lambda e: e[0])
    arr = np.zeros(len(ev), dtype=RECORD_DTYPE)
    arr["kind"] = KIND_DISPATCH
    arr["t_ns"] = [e[0] for e in ev]
    arr["req"] = [e[1] for e in ev]
    arr["count"] = 1
    trace = EngineTrace("e", None, arr, np.arange(len(recs)), np.zeros(len(recs), dtype=np.int64))
    fig = trace.request_gaps(KIND_DISPATCH)
    figs = [np.zeros(len(recs), dtype=np.int64) for _ in range(5)]
    figs[3][:] = -1
    for k, name in enumerate(("count", "first", "last", "gap", "gap_at")):
        figs[k][fig["codes"]] = fig[name]
    best, at, where, start, measured = longest_waits(*figs, sent, cancel, max_tokens, owner, 3)
    expected = _one_at_a_time(times, sent.tolist(), cancel.tolist(), max_tokens.tolist(), owner.tolist())
    for j, e in enumerate(expected):
        if e is None:
            assert not measured[j]
            continue
        assert measured[j]
        wait, began, kind = e
        got_kind = 0 if where[j] == 0 or (where[j] == 1 and at[j] == start[j]) else int(where[j])
        kind = 0 if kind == 1 and began == start[j] else kind
        assert (int(best[j]), int(at[j]), got_kind) == (wait, began, kind), (j, times[j])


def _starve_stream_0(run_dir, *, policy=None, priorities=None):
    """Stream 0 of user-a gets nothing from 0.5 s to 2.5 s; the engine's header says ``policy``, and
    the client records carry ``priorities`` (client id suffix -> priority)."""
    from ratebench.runrecords import read_client_records, write_client_records

    run = load_run(run_dir)
    t0 = run.phases[0].start_ns

    def keep(recs, strings):
        starved = np.array(["rb-5e1f0001-0-" in s for s in strings])[recs["req"]]
        window = (recs["t_ns"] > t0 + 500_000_000) & (recs["t_ns"] < t0 + 2_500_000_000)
        return ~(starved & window & np.isin(recs["kind"], [KIND_DISPATCH, KIND_EMIT]))

    _rewrite_events(run_dir, keep)
    path = run_dir / "engines" / "patched-sync" / "events.rbev"
    ev = read_engine_events(path)
    if policy is not None:
        with EventFileWriter(path, {**ev.meta, "policy": policy}) as w:
            for s in ev.strings:
                w.intern(s)
            w.write_block(ev.records)
    records = read_client_records(run_dir / "requests.jsonl")
    for r in records:
        r.priority = (priorities or {}).get(r.client_id.rsplit("-", 1)[1], 0)
    write_client_records(run_dir / "requests.jsonl", records)
    [check] = _checks(run_dir, "stream-wait")
    return check


@pytest.mark.parametrize("policy, priorities, excused", [
    ("PRIORITY", {"0": 1}, True),  # its siblings of a higher priority (0) were open: they go first
    ("FCFS", {"0": 1}, False),  # vLLM ignores priorities under FCFS: the wait counts
    ("PRIORITY", {}, False),  # one priority: the streams take turns
    ("PRIORITY", {"1": 1, "2": 1, "3": 1}, False),  # the starved stream is the highest priority
])
def test_under_the_priority_policy_a_stream_may_wait_for_its_users_higher_priorities(
        tmp_path, policy, priorities, excused):
    check = _starve_stream_0(_throttled_run(tmp_path), policy=policy, priorities=priorities)
    assert check.passed is excused, check.explanation
    if excused:
        assert check.figure < 500 and "PRIORITY policy, the user's streams at priorities 0, 1" in check.explanation
    else:
        assert check.figure >= 1900 and "stream 0" in check.explanation


def test_a_wait_is_excused_only_while_a_higher_priority_stream_is_open(tmp_path):
    """The higher-priority siblings end early (their answers cut to 0.6 s): stream 0's wait after they
    ended counts, and starving it from 0.5 s to 2.5 s fails."""
    run_dir = _throttled_run(tmp_path)
    from ratebench.runrecords import read_client_records, write_client_records

    records = read_client_records(run_dir / "requests.jsonl")
    t0 = load_run(run_dir).phases[0].start_ns
    keep_ids = set()
    for r in records:
        if r.user == "user-a" and not r.client_id.endswith("-0"):
            r.done_ns = t0 + 600_000_000
            keep_ids.add(r.client_id)
    write_client_records(run_dir / "requests.jsonl", records)

    def cut(recs, strings):  # the siblings' tokens after 0.6 s are gone too
        sibling = np.array([any(f"{k}-" in s for k in keep_ids) for s in strings])[recs["req"]]
        return ~(sibling & (recs["t_ns"] > t0 + 600_000_000))

    _rewrite_events(run_dir, cut)
    check = _starve_stream_0(run_dir, policy="PRIORITY", priorities={"0": 1})
    assert not check.passed, check.explanation
    assert 1500 <= check.figure <= 2100, check.explanation


@pytest.mark.parametrize("policy, priorities, judged_ok", [
    ("FCFS", {"0": 1}, False),  # priorities mean nothing under FCFS: stream 0 left behind its siblings
    ("PRIORITY", {"0": 1}, True),  # stream 0 of a lower priority waits for its user's priority 0 streams
    ("PRIORITY", {"0": 1, "1": 1}, False),  # within priority 1, stream 0 is left behind stream 1
])
def test_under_the_priority_policy_a_users_streams_take_turns_within_a_priority(tmp_path, policy, priorities,
                                                                                judged_ok):
    run_dir = _throttled_run(tmp_path)
    _starve_stream_0(run_dir, policy=policy, priorities=priorities)
    [check] = [c for c in _checks(run_dir, "stream-fairness") if c.user == "user-a"]
    assert check.passed is judged_ok, check.explanation
    if policy == "PRIORITY":
        assert "its streams at priorities 0, 1" in check.explanation, check.explanation
    if not judged_ok:
        assert check.figure >= 8, check.explanation  # 2 s without tokens at 20 tok/s over 4 streams


def _first_token_late(run_dir, steps_tokens: int | None, budget: int | None = 256, full_for_ns: int | None = None,
                      another_prompt: bool = True):
    """Stream 3 of user-a gets its first token 1.5 s into the phase (its siblings' start at once); the
    event file gets a step record every 20 ms over the phase, each of ``steps_tokens`` tokens (None: no
    step records; with ``full_for_ns``, only the phase's first steps over that time, 4 tokens after),
    and ``budget`` as its header's max_num_batched_tokens. The client saw stream 3's first token then
    too; with ``another_prompt``, user-c's first request was sent as the phase began and waited for
    its first token until 1.6 s (a long prompt the full steps could have been prefilling)."""
    from ratebench.events import STEP_DTYPE
    from ratebench.runrecords import read_client_records, write_client_records

    run = load_run(run_dir)
    t0 = run.phases[0].start_ns
    path = run_dir / "engines" / "patched-sync" / "events.rbev"

    def keep(recs, strings):
        late = np.array(["rb-5e1f0001-3-" in s for s in strings])[recs["req"]]
        return ~(late & (recs["t_ns"] < t0 + 1_500_000_000) & np.isin(recs["kind"], [KIND_DISPATCH, KIND_EMIT]))

    _rewrite_events(run_dir, keep)
    ev = read_engine_events(path)
    with EventFileWriter(path, {**ev.meta, "max_num_batched_tokens": budget}) as w:
        for s in ev.strings:
            w.intern(s)
        w.write_block(ev.records)
        if steps_tokens is not None:
            t = np.arange(t0, run.phases[0].end_ns, 20_000_000, dtype=np.int64)
            steps = np.zeros(len(t), dtype=STEP_DTYPE)
            steps["t_ns"], steps["reqs"], steps["tokens"] = t, 4, steps_tokens
            if full_for_ns is not None:
                steps["tokens"][t >= t0 + full_for_ns] = 4
            w.write_steps(steps)
    records = read_client_records(run_dir / "requests.jsonl")
    for r in records:
        if r.client_id == "rb-5e1f0001-3":
            r.first_token_ns = t0 + 1_500_000_000
        if r.client_id == "rb-5e1f0001-4" and another_prompt:
            r.sent_ns, r.first_token_ns = t0, t0 + 1_600_000_000
    write_client_records(run_dir / "requests.jsonl", records)
    [check] = _checks(run_dir, "stream-wait")
    return check


def test_a_first_token_late_behind_steps_that_are_not_full_fails_stream_wait(tmp_path):
    """The engine ran decode steps (4 tokens of a 256-token budget) while stream 3 waited 1.5 s for its
    first token: its siblings spent the budget, and the wait counts whole."""
    check = _first_token_late(_throttled_run(tmp_path), steps_tokens=4)
    assert not check.passed and check.figure >= 1400, check.explanation
    assert "stream 3" in check.explanation and "first token" in check.explanation
    assert "full engine steps" not in check.explanation


def test_a_first_token_late_behind_full_steps_leaves_them_out_of_its_wait(tmp_path):
    """The same wait while every step scheduled the whole token budget (prefilling other prompts, which
    a stream sent beside them queues for, the limiter on or off): the wait leaves those steps out and
    the explanation says how much; without a budget in the header nothing is left out."""
    run_dir = _throttled_run(tmp_path)
    check = _first_token_late(run_dir, steps_tokens=256)
    assert check.passed and check.figure < 300, check.explanation  # the worst is now a turn between tokens
    run = load_run(run_dir)
    [sw] = stream_waits(run, run.phases[0])
    [late] = [w for w in sw.waits if w.stream_index == 3]
    assert late.wait_ns < 300_000_000, late  # its first token's wait, less the full steps, is under a turn
    # full steps over the first 0.8 s only: the rest of the wait counts (and fails), the explanation says
    # what was left out
    part = _first_token_late(_throttled_run(tmp_path / "part"), steps_tokens=256, full_for_ns=800_000_000)
    assert "stream 3" in part.explanation and "first token (less 800 ms of full" in part.explanation, part.explanation
    assert not part.passed and 700 < part.figure < 1000, part.explanation
    full = _first_token_late(_throttled_run(tmp_path / "no-budget"), steps_tokens=256, budget=None)
    assert not full.passed and full.figure >= 1400, full.explanation


def test_full_steps_while_no_other_request_waited_for_a_first_token_are_not_believed(tmp_path):
    """The step records are the engine's account of itself: a recorder that called every step full while
    stream 3 alone waited for a first token (no other prompt to prefill, by the client's clock) has only
    the phase's first steps left out, while its siblings waited for theirs: the rest of the wait counts."""
    check = _first_token_late(_throttled_run(tmp_path), steps_tokens=256, another_prompt=False)
    assert not check.passed and check.figure >= 1400, check.explanation
    assert "stream 3" in check.explanation, check.explanation


def test_full_step_time_counts_each_full_step_until_the_next_starts():
    from types import SimpleNamespace

    from ratebench.analysis.pressure import full_step_time
    from ratebench.events import STEP_DTYPE

    steps = np.zeros(5, dtype=STEP_DTYPE)
    steps["t_ns"] = [100, 0, 10, 30, 60]  # file order need not be time order
    steps["tokens"] = [8, 256, 4, 300, 256]  # sorted: 0 full, 10 not, 30 full, 60 full, 100 (last: unknown end)
    trace = SimpleNamespace(events=SimpleNamespace(steps=steps, meta={"max_num_batched_tokens": 256}))
    f = full_step_time(trace)
    a = np.array([0, 5, 20, 35, -50, 100, 120])
    b = np.array([100, 12, 40, 65, 5, 200, 130])
    # full: [0, 10), [30, 60), [60, 100)
    assert f(a, b).tolist() == [80, 5, 10, 30, 5, 0, 0]
    # two requests waiting for a first token from 0 to 40 and one until 70: the step at 60 is not counted
    g = full_step_time(trace, np.array([0, 0, 0]), np.array([40, 40, 70]))
    assert g(a, b).tolist() == [40, 5, 10, 25, 5, 0, 0]
    assert full_step_time(SimpleNamespace(events=SimpleNamespace(steps=steps, meta={}))) is None
