"""verify-bound on synthetic run folders: exit codes, outputs, and broken limiters caught by the right check."""

from __future__ import annotations

import json

import numpy as np

import pytest
from typer.testing import CliRunner

from ratebench.cli import app
from synth import SimEngine, SimPhase, SimRequest, standard_run, write_run_folder
from ratebench.verify import analyse_run, verify_run
from synthetic_runs import edit_client_records, edit_manifest, one_phase_run

runner = CliRunner()


def verify_cli(run_dir, *args):
    return runner.invoke(app, ["verify-bound", str(run_dir), "--no-plots", *args])


def failed_check_names(run_dir) -> set[str]:
    return {c.name for c in analyse_run(run_dir).verdict.failures}


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    return standard_run(tmp_path_factory.mktemp("good") / "run")


def test_correct_gcra_run_passes_every_check_and_exits_0(good_run):
    result = verify_cli(good_run)
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output
    verdict = json.loads((good_run / "verdict.json").read_text())
    assert verdict["passed"] is True
    names = {c["name"] for c in verdict["checks"]}
    assert {"bound-dispatch", "bound-emit", "bound-dispatch-run", "delivery", "reconciliation", "cancellation",
            "isolation-rate", "overhead", "stream-fairness", "rate-seed"} <= names
    for c in verdict["checks"]:
        assert {"name", "scenario", "phase", "engine", "user", "figure", "threshold", "passed", "explanation"} <= set(c)
    assert (good_run / "report.md").read_text().startswith("# ratebench verdict: PASS")


def test_plots_are_written_and_embedded_in_the_report(tmp_path):
    run = one_phase_run(tmp_path / "run", streams=3)
    verify_run(run)
    pngs = sorted(p.name for p in (run / "plots").glob("*.png"))
    assert pngs == ["seed-experiment-main-patched-sync.png"]  # one plot per phase
    report = (run / "report.md").read_text()
    assert "](plots/seed-experiment-main-patched-sync.png)" in report
    assert "data:image/png;base64," in (run / "report.html").read_text()


@pytest.mark.parametrize("limiter", ["burst-1s", "per-request", "rolling-1s", "never"])
def test_broken_limiter_breaks_the_bound(tmp_path, limiter):
    run = standard_run(tmp_path / "run", limiter=limiter, overhead=False)
    failed = failed_check_names(run)
    assert {"bound-dispatch", "bound-dispatch-run"} <= failed
    assert verify_cli(run).exit_code == 1


def test_one_budget_per_request_is_caught_only_with_several_streams(tmp_path):
    assert not failed_check_names(one_phase_run(tmp_path / "one", limiter="per-request", streams=1))
    assert "bound-dispatch" in failed_check_names(one_phase_run(tmp_path / "four", limiter="per-request", streams=4))


def test_limiter_at_half_the_rate_fails_delivery_not_the_bound(tmp_path):
    run = standard_run(tmp_path / "run", limiter="half-rate", overhead=False)
    failed = failed_check_names(run)
    assert "delivery" in failed
    assert not {n for n in failed if n.startswith("bound")}


def test_limiter_that_forgets_users_between_phases_is_caught_over_the_whole_file(tmp_path):
    eng = SimEngine("patched-sync", default_tps=20)
    user = {"u": {"limit_tps": 20, "streams": 1, "backlogged": True}}
    phases = [SimPhase("s", "seed-experiment", f"p{k}", "patched-sync", "measure", user,
                       [SimRequest(f"rb-1-{k}", "u", 0, 40)], reset_limiter=k > 0) for k in range(2)]
    failed = failed_check_names(write_run_folder(tmp_path / "run", [eng], phases))
    assert "bound-dispatch-run" in failed
    assert "bound-dispatch" not in failed  # each phase alone looks fine


def test_emit_events_carrying_several_tokens_are_weighted(tmp_path):
    run = one_phase_run(tmp_path / "run", engine_kw={"emit_coalesce": 3}, streams=2, max_tokens=50)
    assert not failed_check_names(run)


def test_wrong_completion_tokens_fails_reconciliation(tmp_path):
    run = one_phase_run(tmp_path / "run")

    def bump(recs):
        recs[0].completion_tokens += 1

    edit_client_records(run, bump)
    verdict = analyse_run(run).verdict
    bad = [c for c in verdict.failures if c.name == "reconciliation"]
    assert bad and "usage.completion_tokens 61 != 60" in bad[0].explanation
    result = verify_cli(run)
    assert result.exit_code == 1
    assert "reconciliation" in result.output


def test_engine_that_keeps_generating_after_a_cancel_fails(tmp_path):
    reqs = [SimRequest("rb-1-1", "user-a", 0, 80, cancel_after_ns=200_000_000)]
    run = one_phase_run(tmp_path / "run", requests=reqs, backlogged=False, limit_tps=500,
                        engine_kw={"abort_delay_ns": 30_000_000})
    assert "cancellation" in failed_check_names(run)


def test_partial_run_is_unusable_exit_2(tmp_path):
    run = one_phase_run(tmp_path / "run")
    edit_manifest(run, lambda m: m.update(state="partial", partial_reason="interrupted by SIGINT"))
    result = verify_cli(run)
    assert result.exit_code == 2
    assert "'partial'" in result.output and "interrupted by SIGINT" in result.output


def test_missing_events_file_is_unusable_and_named(tmp_path):
    run = one_phase_run(tmp_path / "run")
    (run / "engines" / "patched-sync" / "events.rbev").unlink()
    result = verify_cli(run)
    assert result.exit_code == 2
    assert "events.rbev" in result.output and "missing" in result.output


@pytest.mark.parametrize("name", ["manifest.json", "scenarios.json", "requests.jsonl"])
def test_missing_run_file_is_unusable_and_named(tmp_path, name):
    run = one_phase_run(tmp_path / "run")
    (run / name).unlink()
    result = verify_cli(run)
    assert result.exit_code == 2 and name in result.output


def test_corrupt_events_file_is_unusable(tmp_path):
    run = one_phase_run(tmp_path / "run")
    (run / "engines" / "patched-sync" / "events.rbev").write_bytes(b"not an event file")
    result = verify_cli(run)
    assert result.exit_code == 2 and "bad magic" in result.output


def test_thresholds_are_options_and_reach_the_verdict(tmp_path):
    run = one_phase_run(tmp_path / "run")
    assert verify_cli(run, "--delivery-min", "1.5").exit_code == 1
    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["thresholds"]["delivery_min"] == 1.5
    assert [c for c in verdict["checks"] if c["name"] == "delivery"][0]["passed"] is False


def test_overhead_fails_only_with_max_overhead(good_run):
    assert verify_cli(good_run).exit_code == 0
    assert verify_cli(good_run, "--max-overhead", "-0.5").exit_code == 1


def test_rows_follow_the_user_the_engine_charged_and_identity_fails_on_the_one_sent(tmp_path):
    run = one_phase_run(tmp_path / "run")

    def spoof(recs):
        for r in recs:
            r.user = "spoofed-name"

    edit_client_records(run, spoof)
    verdict = analyse_run(run).verdict
    assert {r.user for r in verdict.rows} == {"user-a"}
    # every request was sent as spoofed-name and charged to user-a: identity names them, nothing else fails
    assert {(c.name, c.user) for c in verdict.failures} == {("identity", "spoofed-name")}
    (identity,) = verdict.failures
    assert "sent as spoofed-name, charged to user-a" in identity.explanation


def test_engine_requests_without_a_client_record_count_in_the_whole_file_bound(tmp_path):
    run = one_phase_run(tmp_path / "run", limiter="never", streams=1)

    def drop_all(recs):
        recs.clear()

    edit_client_records(run, drop_all)
    verdict = analyse_run(run).verdict
    assert {c.name for c in verdict.failures} == {"bound-dispatch-run", "bound-emit-run"}
    assert any("match no client record" in w for w in verdict.warnings)


def test_emit_tolerance_can_be_set_instead_of_measured(tmp_path):
    run = one_phase_run(tmp_path / "run")
    assert verify_cli(run, "--emit-tolerance-ms", "0").exit_code in (0, 1)
    verdict = json.loads((run / "verdict.json").read_text())
    emit = [c for c in verdict["checks"] if c["name"] == "bound-emit"][0]
    assert "step" not in emit["explanation"]  # no tolerance added
    assert verdict["thresholds"]["emit_tolerance_ns"] == 0


def test_a_long_step_in_one_phase_widens_no_other_phases_emit_bound(tmp_path):
    """The emit bound's tolerance is the longest step of the row's own phase. One phase of 1.5 s steps (as
    a structured-output backend compiling a grammar) before a phase in which a rolling-window limiter lets
    user-a take its second's tokens at once: with the engine's longest step as every phase's tolerance,
    that phase's emit bound allowed (W + 0.1 + 1.36 s) N + 1 and passed (its worst window: 20 tokens in
    19 ms against 30.6 allowed); with the phase's own steps it fails beside the dispatch bound."""
    eng = SimEngine("patched-sync", default_tps=100, user_tps={"user-a": 20}, limiter="rolling-1s")
    slow = SimPhase("request-options", "request-options", "slow", "patched-sync", "measure",
                    {"user-b": {"limit_tps": 100, "streams": 1, "backlogged": False}},
                    [SimRequest("rb-5e1f0001-1", "user-b", 0, 3)], step_ns=1_500_000_000)
    burst = SimPhase("seed-experiment", "seed-experiment", "burst", "patched-sync", "measure",
                     {"user-a": {"limit_tps": 20, "streams": 4, "backlogged": True}},
                     [SimRequest(f"rb-5e1f0001-{i + 2}", "user-a", i, 30) for i in range(4)])
    run = write_run_folder(tmp_path / "run", [eng], [slow, burst])
    verdict = analyse_run(run).verdict
    by = {(c.name, c.phase, c.user): c for c in verdict.checks}
    assert by[("bound-dispatch", "burst", "user-a")].passed is False
    emit = by[("bound-emit", "burst", "user-a")]
    assert emit.passed is False, emit.explanation
    step_ms = float(emit.explanation.split("+ step ")[1].split(" ms")[0])
    assert step_ms < 10, emit.explanation  # the burst phase's own 5 ms steps, not the slow phase's 1.5 s
    assert verdict.engine_steps["patched-sync"].longest_ns > 1_000_000_000  # the engine's longest: the slow one


def test_warm_up_requests_of_the_driver_raise_no_unmatched_request_warning(tmp_path):
    from ratebench.analysis.load import is_warmup_request

    assert is_warmup_request("cmpl-warmup-patched-sync-0-0-1a2b3c4d", "patched-sync")
    assert is_warmup_request("chatcmpl-warmup-patched-sync-1-1a2b3c4d", "patched-sync")
    assert not is_warmup_request("cmpl-warmup-patched-sync-0-0-1a2b3c4d", "patched")
    assert not is_warmup_request("cmpl-rb-5e1f0001-1-0-1a2b3c4d", "patched-sync")
    # a beam search probe's beams (served with the limiter off): each an engine request of its own
    assert is_warmup_request("cmpl-probe-feature-off-sync-3-b654603a921926bf-beam-1-b62fdd20", "feature-off-sync")
    assert not is_warmup_request("cmpl-probe-feature-off-sync-3-b654603a921926bf-beam-1-b62fdd20", "feature-off")
    warm = [SimRequest(f"warmup-patched-sync-{n}", None, 0, 8) for n in range(2)]
    run = one_phase_run(tmp_path / "run", requests=[SimRequest(f"rb-5e1f0001-{i}", "user-a", i, 60) for i in range(2)]
                        + warm)
    edit_client_records(run, lambda recs: recs.__setitem__(slice(None), [r for r in recs if r.client_id.startswith("rb-")]))
    verdict = analyse_run(run).verdict
    assert not any("match no client record" in w for w in verdict.warnings), verdict.warnings
    assert verdict.passed, verdict.summary()


def test_a_request_whose_events_name_two_users_is_split_between_their_rows(tmp_path):
    from ratebench.events import KIND_DISPATCH, EventFileWriter, read_engine_events

    run = one_phase_run(tmp_path / "run", streams=2)
    path = run / "engines" / "patched-sync" / "events.rbev"
    ev = read_engine_events(path)
    recs = ev.records.copy()
    with EventFileWriter(path, ev.meta) as w:
        for s in ev.strings:
            w.intern(s)
        other = w.intern("user-z")
        first_req = recs["req"][0]
        moved = (recs["req"] == first_req) & (recs["kind"] == KIND_DISPATCH)
        moved &= np.cumsum(moved) > 10  # the request's dispatches after its tenth charged to another user
        recs["user"][moved] = other
        w.write_block(recs)
    verdict = analyse_run(run).verdict
    users = {r.user for r in verdict.rows}
    assert {"user-a", "user-z"} <= users
    moved_row = next(r for r in verdict.rows if r.user == "user-z")
    assert moved_row.dispatch_rate.tokens == int(moved.sum())


def test_the_new_thresholds_are_options_and_reach_the_verdict(tmp_path):
    run = one_phase_run(tmp_path / "run")
    assert verify_cli(run, "--spacing-slack-ms", "7.5", "--wait-cpu-max", "0.3", "--wake-max-ms", "12").exit_code == 0
    th = json.loads((run / "verdict.json").read_text())["thresholds"]
    assert (th["spacing_slack_ns"], th["wait_cpu_max"], th["wake_max_ms"]) == (7_500_000, 0.3, 12.0)


def test_the_pressure_thresholds_are_options_and_reach_the_verdict(tmp_path):
    run = one_phase_run(tmp_path / "run")
    result = verify_cli(run, "--stream-wait-factor", "2.5", "--stream-wait-slack-ms", "250", "--place-share-min",
                        "0.6", "--place-jain-min", "0.85")
    assert result.exit_code == 0, result.output
    th = json.loads((run / "verdict.json").read_text())["thresholds"]
    assert (th["stream_wait_factor"], th["stream_wait_slack_ns"], th["place_share_min"], th["place_jain_min"]) == \
        (2.5, 250_000_000, 0.6, 0.85)


def test_an_engine_that_ran_another_scheduling_mode_than_asked_fails_engine_as_asked(tmp_path):
    """vLLM's CPU platform turns --async-scheduling off without a word: an "async" engine whose event
    file says it ran sync proves nothing about promise 5's async half, so the run fails (it was a
    warning only)."""
    run_dir = one_phase_run(tmp_path / "run")
    clean = verify_run(run_dir, plots=False)
    (ok,) = [c for c in clean.checks if c.name == "engine-as-asked"]
    assert ok.passed and ok.engine == "patched-sync"

    def ask_async(m):
        m["engines"]["patched-sync"]["async_scheduling"] = True

    edit_manifest(run_dir, ask_async)
    verdict = verify_run(run_dir, plots=False)
    (bad,) = [c for c in verdict.failures if c.name == "engine-as-asked"]
    assert "ran with async_scheduling=False" in bad.explanation and "asked for True" in bad.explanation
    assert not verdict.passed


def test_an_engine_meant_to_run_with_the_limiter_off_that_charges_fails_engine_as_asked(tmp_path):
    """Promise 7's engine (the limiter off) must not charge: its event file's header names no default
    rate and it has no dispatch events."""
    run_dir = one_phase_run(tmp_path / "run")

    def limiter_off(m):
        m["engines"]["patched-sync"]["feature"] = False

    edit_manifest(run_dir, limiter_off)
    verdict = verify_run(run_dir, plots=False)
    (bad,) = [c for c in verdict.failures if c.name == "engine-as-asked"]
    assert "meant to run with the limiter off" in bad.explanation
    assert "dispatch events (charges) with the limiter off" in bad.explanation


def test_every_threshold_is_an_option_of_verify_bound_with_its_default():
    """One table (ratebench/analysis/thresholds.py, read from the Thresholds fields) makes verify-bound's
    threshold options: every Thresholds field has its row (the burst excepted: each engine's header gives it), each option's
    default is the field's, and a command line of defaults gives the default Thresholds."""
    import dataclasses

    from ratebench.analysis.thresholds import NOT_OPTIONS, TABLE, from_options
    from ratebench.analysis.verdict import Thresholds

    fields = {f.name for f in dataclasses.fields(Thresholds)}
    assert {t.field for t in TABLE} | set(NOT_OPTIONS) == fields
    assert len({t.option for t in TABLE}) == len(TABLE)
    assert from_options({t.param: t.default for t in TABLE}) == Thresholds() == from_options({})
    slack = next(t for t in TABLE if t.option == "--spacing-slack-ms")
    assert from_options({slack.param: 7.5}).spacing_slack_ns == 7_500_000
    result = CliRunner().invoke(app, ["verify-bound", "--help"], env={"COLUMNS": "200"})
    for t in TABLE:
        assert t.option in result.output, t.option


def test_a_profile_sets_a_phases_thresholds_only_through_the_table():
    """The thresholds a scenario's profile may set for its phases are rows of the thresholds table, each
    with its rule: cancel_max_steps the wider of the two, max_overhead and the trace lateness the phase's
    unless the command line gives one (the lateness in the option's unit, ms)."""
    from ratebench.analysis.thresholds import DEFAULT_TRACE_LATENESS_NS, TABLE, for_phase, phase_params
    from ratebench.analysis.verdict import Thresholds
    from ratebench.profiles import kinds

    assert phase_params("cancel_max_steps", "trace_lateness_ns") == {"cancel_max_steps": ("pos_int", None),
                                                                     "lateness_ms": ("pos_num", None)}
    th, given = Thresholds(), Thresholds(cancel_max_steps=3, max_overhead=0.1, trace_lateness_ns=5_000_000)
    assert for_phase(th, "cancel_max_steps", {"cancel_max_steps": 5}) == 5
    assert for_phase(given, "cancel_max_steps", {"cancel_max_steps": 2}) == 3  # wider: the command line's
    assert for_phase(th, "cancel_max_steps", {}) == 1
    assert for_phase(th, "max_overhead", {"max_overhead": 0.35}) == 0.35
    assert for_phase(given, "max_overhead", {"max_overhead": 0.35}) == 0.1
    assert for_phase(th, "max_overhead", {}) is None  # report only
    assert for_phase(th, "trace_lateness_ns", {"lateness_ms": 100}) == 100_000_000
    assert for_phase(given, "trace_lateness_ns", {"lateness_ms": 100}) == 5_000_000
    assert for_phase(th, "trace_lateness_ns", {"lateness_ms": None}) is None and DEFAULT_TRACE_LATENESS_NS == 20_000_000
    # every scenario parameter named after a threshold comes from the table
    overridable = {t.phase_param for t in TABLE if t.phase_param}
    for name, kind in kinds().items():
        for param in overridable & set(kind.params):
            row = next(t for t in TABLE if t.phase_param == param)
            assert kind.params[param] == (row.phase_type, None), (name, param)


def _beam_checks(run_dir, status: int, message: str, *, limiter_on: bool):
    from synthetic_runs import edit_scenarios

    probe = {"api": "completions", "sent": "use_beam_search, n 2", "status": status, "message": message}
    edit_scenarios(run_dir, lambda phases: phases[0]["params"].update(beam_search=[probe]))
    if not limiter_on:
        edit_manifest(run_dir, lambda m: m["engines"]["patched-sync"].update(feature=False))
    return [c for c in analyse_run(run_dir).verdict.checks if c.name.startswith("beam-search")]


def test_beam_search_probes_are_judged_by_the_engines_limiter(tmp_path):
    refused = '{"error":{"message":"Beam search is not supported while per-user output rate limiting is enabled."}}'
    served = '{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" blue"}]}'
    # limiter on: refused with HTTP 400 naming beam search, nothing else
    (c,) = _beam_checks(one_phase_run(tmp_path / "on-400"), 400, refused, limiter_on=True)
    assert (c.name, c.passed) == ("beam-search-refused", True), c.explanation
    (c,) = _beam_checks(one_phase_run(tmp_path / "on-200"), 200, served, limiter_on=True)
    assert (c.name, c.passed) == ("beam-search-refused", False), c.explanation
    # limiter off (promise 7): served as upstream serves it, with its choices
    (c,) = _beam_checks(one_phase_run(tmp_path / "off-200"), 200, served, limiter_on=False)
    assert (c.name, c.passed) == ("beam-search-off-served", True), c.explanation
    (c,) = _beam_checks(one_phase_run(tmp_path / "off-400"), 400, refused, limiter_on=False)
    assert (c.name, c.passed, c.figure) == ("beam-search-off-served", False, 400), c.explanation
    assert "limiter off" in c.explanation
