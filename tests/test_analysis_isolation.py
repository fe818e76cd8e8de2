"""Isolation: every user whose limit did not bind (ratebench/analysis/isolation.py), beside throttled
users, against the phase's baseline: the isolation scenario's user against its solo phase, a mix's
tiers against the same requests on the limiter-off engine."""

from __future__ import annotations

import numpy as np

from ratebench.analysis.verdict import Thresholds
from ratebench.events import STEP_DTYPE, EventFileWriter, read_engine_events
from synth import SimEngine, SimPhase, SimRequest, write_run_folder
from ratebench.verify import analyse_run
from synthetic_runs import edit_client_records


def isolation_run(tmp_path, shared_step_ns=None, tokens=80):
    eng = SimEngine("patched-sync", default_tps=20, user_tps={"fast": 5000})
    fast = {"limit_tps": 5000, "streams": 2, "backlogged": False}
    phases = [
        SimPhase("isolation", "isolation", "baseline", "patched-sync", "baseline", {"fast": fast},
                 [SimRequest(f"rb-1-{i}", "fast", i, tokens) for i in range(2)]),
        SimPhase("isolation", "isolation", "shared", "patched-sync", "shared",
                 {"fast": fast, "slow": {"limit_tps": 20, "streams": 2, "backlogged": True}},
                 [SimRequest(f"rb-1-{i + 2}", "fast", i, tokens) for i in range(2)]
                 + [SimRequest(f"rb-1-{i + 4}", "slow", i, 10) for i in range(2)], step_ns=shared_step_ns),
    ]
    return write_run_folder(tmp_path, [eng], phases)


def isolation_checks(run_dir):
    return {c.name: c for c in analyse_run(run_dir).verdict.checks if c.name.startswith("isolation")}


def test_unthrottled_user_unaffected_by_throttled_neighbour(tmp_path):
    checks = isolation_checks(isolation_run(tmp_path))
    assert checks["isolation-rate"].passed and checks["isolation-rate"].figure > 0.9
    # every latency judged against the solo phase (gaps, end to end, first token), the quantiles
    # with too few samples for information
    for name in ("isolation-gap-p50", "isolation-gap-p90", "isolation-gap-p99", "isolation-e2e-p50", "isolation-ttft"):
        assert checks[name].passed, checks[name].explanation
    assert checks["isolation-ttft-p90"].passed is None and "too few samples" in checks["isolation-ttft-p90"].explanation


def test_neighbour_that_slows_everyone_fails_isolation(tmp_path):
    checks = isolation_checks(isolation_run(tmp_path, shared_step_ns=10_000_000))
    assert checks["isolation-rate"].passed is False
    assert checks["isolation-rate"].figure < 0.6


def test_the_rates_span_gets_the_end_to_end_slack(tmp_path):
    # steps of 7 ms where the baseline had 5: 8-token answers end 16 ms later (a rate of 0.71 x the
    # baseline's, each answer's end-to-end latency well within 1.5 x + 50 ms): within the span allowed
    short = isolation_checks(isolation_run(tmp_path / "short", shared_step_ns=7_000_000, tokens=8))["isolation-rate"]
    assert short.passed and short.figure < 0.75 and short.threshold < short.figure, short.explanation
    assert "+ 50 ms" in short.explanation
    # the same slowdown over 80-token answers (400 ms) is 160 ms late: still a failure, the threshold near 0.9
    long = isolation_checks(isolation_run(tmp_path / "long", shared_step_ns=7_000_000))["isolation-rate"]
    assert long.passed is False and long.figure < 0.75 and long.threshold > 0.8, long.explanation


def test_unthrottled_users_first_token_is_checked_against_its_baseline(tmp_path):
    checks = isolation_checks(isolation_run(tmp_path))
    ttft = checks["isolation-ttft"]
    assert ttft.passed and ttft.unit == "ms"
    assert "engine side" in ttft.explanation


def test_a_neighbour_that_delays_the_first_token_fails_isolation_ttft(tmp_path):
    run = isolation_run(tmp_path)

    def sent_earlier(recs):  # as if the shared phase's requests waited 0.5 s before their first token
        for r in recs:
            if r.phase == "shared" and r.user == "fast":
                r.sent_ns -= 500_000_000

    edit_client_records(run, sent_earlier)
    checks = isolation_checks(run)
    assert checks["isolation-ttft"].passed is False
    assert checks["isolation-ttft"].figure > 500
    # the rate, from the first request sent, sees it too (from the first token on it did not)
    assert checks["isolation-rate"].passed is False


# ---- a mix: every tier whose limits did not bind, pooled, against mix-baseline ----------------------

MIX_LIMITS = {"pro-00": 100, "pro-01": 100, "free-00": 20, "free-01": 20, "team-00": 2000}


def mix_run(tmp_path, *, refusals=True, pro_01_limit=100, team_isolated=True, pro_01_burst=False):
    """A mix phase on the limiter-on engine and the same requests on the limiter-off engine
    (mix-baseline): free-00/01 at 20 tok/s, two streams of 40 tokens each (their limit binds);
    pro-00/01 at 100 tok/s, 12 answers of 6 tokens each, one every 100 ms (never out of budget);
    team-00 at 2000 tok/s, a tier marked isolated. ``refusals``: the engine records refuse events.
    ``pro_01_burst``: pro-01 also sends a 40-token answer first, which runs it out of budget for about
    0.4 s (refuse events), its later answers sent clear of its limit."""
    on = SimEngine("patched-sync", default_tps=100, user_tps={**MIX_LIMITS, "pro-01": pro_01_limit},
                   record_refusals=refusals)
    off = SimEngine("feature-off-sync", feature=False, default_tps=None)

    def reqs(prefix):
        out = [SimRequest(f"rb-5e1f0001-{prefix + 100 * k + i}", f"pro-0{k}", i, 6, arrive_offset_ns=100_000_000 * i)
               for k in range(2) for i in range(12)]
        out += [SimRequest(f"rb-5e1f0001-{prefix + 300 + 10 * k + i}", f"free-0{k}", i, 40)
                for k in range(2) for i in range(2)]
        if pro_01_burst:
            out.append(SimRequest(f"rb-5e1f0001-{prefix + 500}", "pro-01", 12, 40))
        return out + [SimRequest(f"rb-5e1f0001-{prefix + 400 + i}", "team-00", i, 10,
                                 arrive_offset_ns=150_000_000 * i) for i in range(6)]

    users = {f"pro-0{k}": {"limit_tps": 100, "streams": 12, "backlogged": False, "tier": "pro"} for k in range(2)}
    users["pro-01"]["limit_tps"] = pro_01_limit
    users |= {f"free-0{k}": {"limit_tps": 20, "streams": 2, "backlogged": False, "tier": "free"} for k in range(2)}
    users["team-00"] = {"limit_tps": 2000, "streams": 6, "backlogged": False, "tier": "team"}
    if team_isolated:
        users["team-00"]["isolated"] = True
    base_users = {u: {**v, "limit_tps": None} for u, v in users.items()}
    phases = [SimPhase("mix", "mix", "mix", "patched-sync", "measure", users, reqs(1000)),
              SimPhase("mix", "mix", "mix-baseline", "feature-off-sync", "baseline", base_users, reqs(2000))]
    return write_run_folder(tmp_path / "run", [on, off], phases)


def mix_checks(run_dir, th=None):
    return [c for c in analyse_run(run_dir, th).verdict.checks if c.name.startswith("isolation")]


def late_first_tokens(run_dir, users, late_ns=3_000_000_000):
    """As if these users' requests in the mix phase waited ``late_ns`` more for their first token (and
    so for every token): their send times moved that much earlier."""
    def edit(recs):
        for r in recs:
            if r.phase == "mix" and r.user in users:
                r.sent_ns -= late_ns
                r.scheduled_ns -= late_ns

    edit_client_records(run_dir, edit)


def test_a_correct_mix_passes_isolation_for_every_unbound_tier(tmp_path):
    checks = mix_checks(mix_run(tmp_path))
    judged = {c.user for c in checks if c.passed is not None}
    # pro never ran out of budget: judged, pooled over its users; free was refused charges: not judged
    assert judged == {"pro tier", "team tier"}, judged
    assert not [c for c in checks if c.user == "free tier"]
    assert all(c.passed is not False for c in checks), [c.explanation for c in checks if c.passed is False]
    pro = {c.name: c for c in checks if c.user == "pro tier"}
    assert {"isolation-ttft", "isolation-ttft-p90", "isolation-e2e-p50", "isolation-gap-p50", "isolation-gap-p99",
            "isolation-rate"} <= set(pro)
    assert pro["isolation-ttft-p90"].passed  # 24 answers: enough for a p90
    p99 = pro["isolation-ttft-p99"]
    assert p99.passed is None and "too few samples for a p99" in p99.explanation
    assert "2 unbound of 2 users" in pro["isolation-ttft"].explanation
    [binding] = [c for c in checks if c.name == "isolation-binding"]
    assert binding.passed is None and "free-00, free-01" in binding.explanation, binding.explanation


def test_an_unbound_tier_whose_first_tokens_come_3_s_late_fails_naming_the_tier(tmp_path):
    """cpu-tiny's mix: the pro tier (never out of budget) got its first token at p50 3.5 s against 12 ms on
    the limiter-off engine, and verify-bound said PASS (only the team tier, marked isolated, was judged)."""
    run_dir = mix_run(tmp_path)
    late_first_tokens(run_dir, {"pro-00", "pro-01"})
    failed = {c.name: c for c in mix_checks(run_dir) if c.passed is False}
    assert {"isolation-ttft", "isolation-ttft-p90", "isolation-e2e-p50", "isolation-e2e-p90"} <= set(failed), failed
    ttft = failed["isolation-ttft"]
    assert ttft.user == "pro tier" and ttft.figure > 3000 and ttft.threshold < 100, ttft.explanation
    assert ttft.explanation.startswith("pro tier, 2 users (pro-00, pro-01)")
    assert "p50 time to first token 30" in ttft.explanation
    assert {c.user for c in failed.values()} == {"pro tier"}
    verdict = analyse_run(run_dir).verdict
    assert not verdict.passed and "FAIL isolation-ttft mix/mix@patched-sync pro tier" in verdict.summary()


def test_a_user_that_was_refused_charges_is_not_judged_by_isolation(tmp_path):
    # pro-01 at 5 tok/s runs out of budget (refuse events): late as it is, isolation leaves it out
    run_dir = mix_run(tmp_path, pro_01_limit=5)
    late_first_tokens(run_dir, {"pro-01"})
    checks = mix_checks(run_dir)
    pro = [c for c in checks if c.user == "pro tier"]
    assert pro and all(c.passed is not False for c in pro), [c.explanation for c in pro if c.passed is False]
    assert "1 unbound of 2 users" in pro[0].explanation and "bound, not judged: pro-01" in pro[0].explanation
    # the same delay on pro-00, the unbound user, fails
    late_first_tokens(run_dir, {"pro-00"})
    assert [c for c in mix_checks(run_dir) if c.name == "isolation-ttft" and c.user == "pro tier"][0].passed is False


def late_tokens(run_dir, user, late_ns, first_index):
    """As if this user's requests of stream index ``first_index`` on in the mix phase got every token
    ``late_ns`` later (sent on time)."""
    def edit(recs):
        for r in recs:
            if r.phase == "mix" and r.user == user and r.stream_index >= first_index and r.chunk_ns:
                r.chunk_ns = [t + late_ns for t in r.chunk_ns]
                r.first_token_ns += late_ns
                r.done_ns += late_ns

    edit_client_records(run_dir, edit)


def test_requests_of_a_bound_user_sent_clear_of_its_limit_are_judged_by_their_first_token(tmp_path):
    """A user refused once is bound and skipped by the unit checks, but its requests sent while it had
    budget are judged by their first token against the same requests on the limiter-off engine: a
    limiter that kept a once-refused user's later requests waiting (2 s each) passed every check."""
    run_dir = mix_run(tmp_path, pro_01_burst=True)
    checks = mix_checks(run_dir)
    clear = {c.name: c for c in checks if c.name.startswith("isolation-ttft-clear")}
    assert set(clear) == {"isolation-ttft-clear", "isolation-ttft-clear-p90"}, clear
    c50 = clear["isolation-ttft-clear"]
    assert c50.user == "pro tier" and c50.passed, c50.explanation
    assert "pro-01" in c50.explanation and " of their 13 requests sent clear" in c50.explanation
    assert all(c.passed is not False for c in checks), [c.explanation for c in checks if c.passed is False]
    late_tokens(run_dir, "pro-01", 2_000_000_000, 6)
    checks = mix_checks(run_dir)
    failed = [c for c in checks if c.passed is False]
    assert [c.name for c in failed] == ["isolation-ttft-clear"], [c.explanation for c in failed]
    assert failed[0].figure > 2000 and failed[0].user == "pro tier"
    verdict = analyse_run(run_dir).verdict
    assert "FAIL isolation-ttft-clear mix/mix@patched-sync pro tier" in verdict.summary()


def test_an_engine_file_without_refusals_or_step_records_cannot_tell_and_never_passes(tmp_path):
    run_dir = mix_run(tmp_path, refusals=False, team_isolated=False)
    late_first_tokens(run_dir, {"pro-00", "pro-01"})
    checks = mix_checks(run_dir)
    tiers = [c for c in checks if c.name != "isolation-binding"]
    assert {c.user for c in tiers} == {"pro tier", "free tier", "team tier"}
    # neither pass nor fail: information, with the reason
    assert all(c.passed is None and "cannot tell whose limit bound" in c.explanation for c in tiers)
    [binding] = [c for c in checks if c.name == "isolation-binding"]
    assert "no refuse event and no step records" in binding.explanation and "(none)" in binding.explanation
    # the late tier's figures are still there to read
    [ttft] = [c for c in tiers if c.name == "isolation-ttft" and c.user == "pro tier"]
    assert ttft.figure > 3000


def test_an_isolated_tier_is_judged_even_when_binding_cannot_be_told(tmp_path):
    run_dir = mix_run(tmp_path, refusals=False)
    late_first_tokens(run_dir, {"team-00"})
    [ttft] = [c for c in mix_checks(run_dir) if c.name == "isolation-ttft" and c.user == "team tier"]
    assert ttft.passed is False and "marked isolated" in ttft.explanation


def with_step_records(run_dir):
    """The limiter-on engine's event file rewritten as version 2 with a step record: an engine that
    records refusals (and refused nobody here)."""
    path = run_dir / "engines" / "patched-sync" / "events.rbev"
    ev = read_engine_events(path)
    with EventFileWriter(path, ev.meta) as w:
        for s in ev.strings:
            w.intern(s)
        w.write_steps(np.zeros(1, dtype=STEP_DTYPE))
        w.write_block(ev.records)
    return run_dir


def test_step_records_without_refusals_say_no_limit_bound(tmp_path):
    """A version 2 file with step records and no refuse event: the engine records refusals and refused
    nobody, so every user is unbound and judged."""
    run_dir = with_step_records(mix_run(tmp_path, refusals=False))
    checks = mix_checks(run_dir)
    # free was throttled in fact: its requests came faster than its limit allows on the limiter-off
    # engine, so its limit binds on them whatever the limiter-on engine recorded; it is told from the
    # baseline alone and judged by the bound, not against the limiter-off engine's latencies; its
    # first tokens, every request sent clear of a refusal, are (isolation-ttft-clear)
    assert {c.user for c in checks if c.passed is not None and "-clear" not in c.name} == {"pro tier", "team tier"}
    assert {c.user for c in checks if c.passed is not None and "-clear" in c.name} == {"free tier"}
    [binding] = [c for c in analyse_run(run_dir).verdict.checks if c.name == "isolation-binding"]
    assert "0 of" in binding.explanation and "asked more than their limits allow on the baseline" in binding.explanation
    assert "free-00" in binding.explanation


def test_a_user_within_its_limit_on_the_baseline_is_judged_and_one_past_it_is_not(tmp_path):
    """Which mix users count as unbound besides the refuse events: only the limiter-off engine's record
    decides (their client chunks on the baseline against their bound), so a limiter cannot take a user out
    of the isolation checks; the pro tier, far under its limit, stays judged and fails when late."""
    run_dir = with_step_records(mix_run(tmp_path, refusals=False))
    late_first_tokens(run_dir, {"pro-00", "pro-01"})
    checks = [c for c in mix_checks(run_dir) if c.user == "pro tier"]
    assert any(c.name == "isolation-ttft" and c.passed is False for c in checks)


def test_isolation_thresholds_are_options(tmp_path):
    run_dir = mix_run(tmp_path)
    late_first_tokens(run_dir, {"pro-00", "pro-01"}, late_ns=100_000_000)
    assert any(c.passed is False for c in mix_checks(run_dir))
    lenient = Thresholds(isolation_ttft_factor=100, isolation_ttft_slack_ns=200_000_000, isolation_e2e_factor=100,
                         isolation_e2e_slack_ns=200_000_000)
    assert all(c.passed is not False for c in mix_checks(run_dir, lenient))


def test_the_isolation_thresholds_are_verify_bound_options_and_reach_the_verdict(tmp_path):
    import json

    from typer.testing import CliRunner

    from ratebench.cli import app

    run_dir = mix_run(tmp_path)
    late_first_tokens(run_dir, {"pro-00", "pro-01"}, late_ns=100_000_000)
    args = ["verify-bound", str(run_dir), "--no-plots"]
    assert CliRunner().invoke(app, args).exit_code == 1
    lenient = ["--isolation-ttft-factor", "100", "--isolation-ttft-slack-ms", "200", "--isolation-e2e-factor", "100",
               "--isolation-e2e-slack-ms", "200", "--isolation-gap-factor", "3", "--isolation-gap-slack-ms", "30"]
    result = CliRunner().invoke(app, args + lenient)
    assert result.exit_code == 0, result.output
    th = json.loads((run_dir / "verdict.json").read_text())["thresholds"]
    assert (th["isolation_ttft_factor"], th["isolation_ttft_slack_ns"], th["isolation_e2e_factor"],
            th["isolation_e2e_slack_ns"], th["isolation_gap_factor"], th["isolation_gap_slack_ns"]) == \
        (100, 200_000_000, 100, 200_000_000, 3, 30_000_000)


def test_a_baseline_whose_first_answers_came_late_does_not_raise_the_rate_to_match(tmp_path):
    """isolation-rate spans the unit's first request sent to its last token. From the first token on,
    a limiter-off engine that kept the tier's first requests queued read a higher rate, and a limiter-on
    engine that served them at once failed (cpu-tiny's crowd: 0.86 x with the same tokens ending at the
    same time)."""
    run_dir = mix_run(tmp_path)

    def late_first_answers(recs):  # the baseline's first answer of each pro user 0.3 s late
        for user in ("pro-00", "pro-01"):
            mine = [r for r in recs if r.phase == "mix-baseline" and r.user == user]
            first = min(mine, key=lambda r: r.sent_ns)
            first.chunk_ns = [t + 300_000_000 for t in first.chunk_ns]

    edit_client_records(run_dir, late_first_answers)
    [rate] = [c for c in mix_checks(run_dir) if c.name == "isolation-rate" and c.user == "pro tier"]
    assert rate.passed, rate.explanation
    assert rate.figure >= 0.97, rate.explanation


def _baseline_steps(run_dir, *, full: bool):
    """The limiter-off engine's event file rewritten with step records over the baseline phase: every
    4 ms, 4 requests given tokens (places: the header's max_num_active_seqs, set to 4) and 30 waiting
    (``full``), or 2 given tokens and none waiting."""
    import json
    path = run_dir / "engines" / "feature-off-sync" / "events.rbev"
    ev = read_engine_events(path)
    base = [p for p in json.loads((run_dir / "scenarios.json").read_text()) if p["phase"] == "mix-baseline"][0]
    t = np.arange(base["start_ns"], base["end_ns"], 4_000_000, dtype=np.int64)
    steps = np.zeros(len(t), dtype=STEP_DTYPE)
    steps["t_ns"] = t
    steps["reqs"] = 4 if full else 2
    steps["tokens"] = steps["reqs"]
    steps["waiting"] = 30 if full else 0
    with EventFileWriter(path, {**ev.meta, "max_num_active_seqs": 4, "max_num_seqs": 16}) as w:
        for s in ev.strings:
            w.intern(s)
        w.write_steps(steps)
        w.write_block(ev.records)
    return run_dir


def test_a_baseline_engine_full_most_of_its_phase_is_said_in_the_isolation_checks(tmp_path):
    """A limiter-off engine with every place taken and requests waiting in most of its steps queues every
    request: the isolation figures then compare two queues' order, not what the limiter costs. The checks
    say so, and are judged all the same (the same verdicts as without the note)."""
    plain = {c.name + str(c.user): c.passed for c in mix_checks(mix_run(tmp_path / "a"))}
    full = mix_checks(_baseline_steps(mix_run(tmp_path / "b"), full=True))
    ttft = [c for c in full if c.name == "isolation-ttft" and c.user == "pro tier"][0]
    assert "the baseline engine was full: every active place taken with requests waiting in 100% of its steps" \
        in ttft.explanation
    assert {c.name + str(c.user): c.passed for c in full} == plain
    calm = mix_checks(_baseline_steps(mix_run(tmp_path / "c"), full=False))
    assert not any("baseline engine was full" in c.explanation for c in calm)
