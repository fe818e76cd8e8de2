"""verify-bound --partial: an unfinished run is checked on its completed phases, marked PARTIAL, never a pass."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ratebench.cli import app
from ratebench.runrecords import ERROR_INTERRUPTED
from synth import standard_run
from ratebench.verify import EXIT_CHECK_FAILED, EXIT_PARTIAL, EXIT_PASSED, EXIT_UNUSABLE, analyse_run
from synthetic_runs import cut_event_file, edit_client_records, edit_manifest, edit_scenarios

runner = CliRunner()
ENGINE = "patched-sync"
NEVER_STARTED = {"scenario": "long-prompt", "phase": "long-prompt", "engine": ENGINE}


def verify_cli(run_dir, *args):
    return runner.invoke(app, ["verify-bound", str(run_dir), "--no-plots", *args])


def phase_span(run_dir, scenario: str) -> tuple[int, int]:
    p = next(p for p in json.loads((run_dir / "scenarios.json").read_text()) if p["scenario"] == scenario)
    return p["start_ns"], p["end_ns"]


def interrupted_run(run_dir, *, limiter: str = "gcra"):
    """A synthetic run as Ctrl-C during its cancellation phase leaves it: state partial, the four
    phases before complete, the cancellation streams cut short, the engine's last block truncated
    (nothing of eos ever ran), eos and long-prompt planned but never started."""
    run = standard_run(run_dir, limiter=limiter, overhead=False)
    plan = [{k: p[k] for k in ("scenario", "phase", "engine")}
            for p in json.loads((run / "scenarios.json").read_text())] + [NEVER_STARTED]
    edit_manifest(run, lambda m: m.update(state="partial", partial_reason="interrupted (SIGINT or SIGTERM)",
                                          planned_phases=plan))
    eos_start, _ = phase_span(run, "eos")
    cut_event_file(run / "engines" / ENGINE / "events.rbev", eos_start)
    edit_scenarios(run, lambda phases: phases.__setitem__(slice(None), [p for p in phases if p["scenario"] != "eos"]))

    def cut(recs):
        recs[:] = [r for r in recs if r.scenario != "eos"]
        next(r for r in recs if r.scenario == "cancellation").error = ERROR_INTERRUPTED

    edit_client_records(run, cut)
    return run


COMPLETED = {"seed-experiment/1-stream", "seed-experiment/4-streams", "isolation/baseline", "isolation/shared"}


def test_without_partial_an_interrupted_run_is_unusable_and_the_message_names_the_option(tmp_path):
    result = verify_cli(interrupted_run(tmp_path / "run"))
    assert result.exit_code == EXIT_UNUSABLE
    assert "'partial'" in result.output and "--partial" in result.output


def test_partial_checks_the_completed_phases_names_the_missing_ones_and_exits_4(tmp_path):
    run = interrupted_run(tmp_path / "run")
    result = verify_cli(run, "--partial")
    assert result.exit_code == EXIT_PARTIAL == 4, result.output
    out = result.output
    assert "PARTIAL" in out and "PASS" not in out
    for label in ("cancellation/cancel@patched-sync", "eos/eos@patched-sync", "long-prompt/long-prompt@patched-sync"):
        assert label in out
    assert "cut short" in out and "never started" in out

    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["partial"] is True and verdict["passed"] is False and verdict["outcome"] == "PARTIAL"
    assert {f"{r['scenario']}/{r['phase']}" for r in verdict["rows"]} == COMPLETED
    missing = {(m["scenario"], m["phase"]): m["why"] for m in verdict["missing_phases"]}
    assert set(missing) == {("cancellation", "cancel"), ("eos", "eos"), ("long-prompt", "long-prompt")}
    assert "1 of 2 streams cut short" in missing[("cancellation", "cancel")]
    assert missing[("eos", "eos")] == missing[("long-prompt", "long-prompt")] == "never started"
    assert {c["name"] for c in verdict["checks"]} >= {"bound-dispatch", "bound-dispatch-run", "delivery"}

    report = (run / "report.md").read_text()
    assert report.startswith("# ratebench verdict: PARTIAL")
    assert "## Missing phases" in report and "long-prompt" in report


def test_a_check_failing_in_a_partial_run_exits_1_and_stays_marked_partial(tmp_path):
    run = interrupted_run(tmp_path / "run", limiter="burst-1s")
    result = verify_cli(run, "--partial")
    assert result.exit_code == EXIT_CHECK_FAILED
    assert "FAIL (PARTIAL)" in result.output
    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["outcome"] == "FAIL (PARTIAL)" and verdict["partial"] is True
    assert (run / "report.md").read_text().startswith("# ratebench verdict: FAIL (PARTIAL)")


def _no_end_time(run):
    edit_scenarios(run, lambda phases: phases[-1].update(end_ns=None))


def _no_scenarios_entry(run):
    edit_scenarios(run, lambda phases: phases.pop())


def _engine_events_lost(run):
    start, end = phase_span(run, "eos")
    cut_event_file(run / "engines" / ENGINE / "events.rbev", (start + end) // 2)


@pytest.mark.parametrize("cut, why", [
    (_no_end_time, "no end time in scenarios.json"),
    (_no_scenarios_entry, "client records but no entry in scenarios.json"),
    (_engine_events_lost, "have no finish event in events.rbev"),
])
def test_the_last_phase_is_missing_with_the_reason_the_files_give(tmp_path, cut, why):
    run = standard_run(tmp_path / "run", overhead=False)
    edit_manifest(run, lambda m: m.update(state="running"))  # a driver killed outright
    cut(run)
    verdict = analyse_run(run, partial=True).verdict
    assert [(m.label, why in m.why) for m in verdict.missing_phases] == [("eos/eos@patched-sync", True)]
    assert "eos" not in {r.scenario for r in verdict.rows}
    assert verdict.partial and not verdict.passed and not verdict.failures


def test_without_a_plan_the_scenarios_never_started_are_named_whole(tmp_path):
    run = standard_run(tmp_path / "run", overhead=False)
    edit_manifest(run, lambda m: m.update(state="partial", profile={"name": "synthetic", "scenarios": [
        {"name": "seed-experiment"}, {"name": "eos"}, {"name": "long-prompt"}]}))
    missing = analyse_run(run, partial=True).verdict.missing_phases
    assert [m.label for m in missing] == ["long-prompt/*@*"]
    assert "phase names unknown" in missing[0].why


def test_a_run_with_no_completed_phase_is_unusable(tmp_path):
    run = standard_run(tmp_path / "run", overhead=False)
    edit_manifest(run, lambda m: m.update(state="partial"))
    edit_scenarios(run, lambda phases: [p.update(end_ns=None) for p in phases])
    result = verify_cli(run, "--partial")
    assert result.exit_code == EXIT_UNUSABLE
    assert "no scenario phase completed" in result.output


def test_a_complete_run_given_partial_verifies_as_without_it(tmp_path):
    run = standard_run(tmp_path / "run", overhead=False)
    result = verify_cli(run, "--partial")
    assert result.exit_code == EXIT_PASSED, result.output
    verdict = json.loads((run / "verdict.json").read_text())
    assert verdict["outcome"] == "PASS" and verdict["partial"] is False and verdict["missing_phases"] == []
