"""report.md people read: the verdict and failures first, the overhead rounds as one table of paired
ratios (each round only in verdict.json), one plot per scenario phase and one for the overhead rounds."""

from __future__ import annotations

import json
import re

import pytest

from ratebench.outputs.format import in_rounds
from ratebench.outputs.markdown import render_report
from ratebench.outputs.exporters import EXPORTERS, Output
from synth import standard_run
from ratebench.verify import analyse_run, verify_run


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    run = standard_run(tmp_path_factory.mktemp("good") / "run")
    verdict = verify_run(run)
    return run, verdict


def _section(report: str, heading: str) -> str:
    start = report.index(heading)
    nxt = report.find("\n## ", start + len(heading))
    return report[start:] if nxt < 0 else report[start:nxt]


def test_overhead_rounds_are_one_table_of_paired_ratios_with_their_spread(good):
    run, verdict = good
    report = (run / "report.md").read_text()
    (o,) = verdict.overheads
    table = _section(report, "## Overhead")
    assert "| pair a/b | median | spread | rounds | pooled |" in table
    for pair, p in o.paired.items():
        assert f"| {pair} | {p.median:.3f} | {p.min:.3f}..{p.max:.3f} | {p.rounds} | {p.pooled:.3f} |" in table
    assert "engine step p50" in table
    # each round only in verdict.json (the checks table's closest call may name one: it names where it was)
    rounds = list(o.round_throughput_tps)
    assert len(rounds) == 2
    without_checks = report.replace(_section(report, "## Checks"), "")
    assert not any(rnd in without_checks for rnd in rounds)
    in_json = json.loads((run / "verdict.json").read_text())
    assert set(in_json["overheads"][0]["round_throughput_tps"]) == set(rounds)
    assert {r["phase"] for r in in_json["rows"] if r["scenario"] == "overhead"} == \
        {r.phase for r in verdict.rows if in_rounds(r.role)}


def test_the_users_and_gap_tables_leave_the_passing_overhead_rounds_out(good):
    run, verdict = good
    report = (run / "report.md").read_text()
    round_rows = [r for r in verdict.rows if in_rounds(r.role)]
    assert len(round_rows) == 8  # 2 rounds x 4 roles
    for section in ("## Users by scenario phase", "## Inter-token gaps"):
        text = _section(report, section)
        assert "| overhead/" not in text
        for r in verdict.rows:
            if not in_rounds(r.role):
                assert f"| {r.scenario}/{r.phase} | {r.engine} | {r.user} |" in text
    assert "The 8 passing phases of the overhead rounds" in report


def test_a_failing_overhead_round_keeps_its_row_and_gets_its_own_plot(tmp_path):
    result = analyse_run(standard_run(tmp_path / "run"))
    verdict = result.verdict
    broken = next(r for r in verdict.rows if r.role == "feature-on")
    broken.passed = False
    report = render_report(verdict)
    assert f"| {broken.scenario}/{broken.phase} | {broken.engine} | {broken.user} |" in report
    assert "The 7 passing phases of the overhead rounds" in report
    (plots,) = [e for e in EXPORTERS if e.plots]
    names = {p.name for p in plots.write(Output(verdict, result.run, tmp_path / "run", []))}
    assert f"{broken.scenario}-{broken.phase}-{broken.engine}.png" in names
    assert "overhead-rounds.png" in names


def test_one_plot_per_scenario_phase_and_one_for_the_overhead_rounds(good):
    run, verdict = good
    names = sorted(p.name for p in (run / "plots").glob("*.png"))
    phases = {(r.scenario, r.phase, r.engine) for r in verdict.rows if not in_rounds(r.role)}
    assert names == sorted([f"{s}-{p}-{e}.png" for s, p, e in phases] + ["overhead-rounds.png"])
    report = (run / "report.md").read_text()
    assert re.findall(r"\]\((plots/[^)]+)\)", report) and all(
        (run / p).is_file() for p in re.findall(r"\]\((plots/[^)]+)\)", report))
    assert "](plots/overhead-rounds.png)" in report


def test_plots_of_an_earlier_layout_are_removed_on_a_second_verify(tmp_path):
    run = standard_run(tmp_path / "run", overhead=False)
    (run / "plots").mkdir()
    (run / "plots" / "cumulative-eos-eos-patched-sync.png").write_bytes(b"old")
    verify_run(run)
    assert not (run / "plots" / "cumulative-eos-eos-patched-sync.png").exists()


def test_verdict_and_failures_come_first_and_checks_are_one_row_per_kind(tmp_path):
    verdict = analyse_run(standard_run(tmp_path / "run", limiter="burst-1s")).verdict
    report = render_report(verdict)
    assert report.startswith("# ratebench verdict: FAIL, broken: the bound; ")
    heads = re.findall(r"^## (.+)$", report, flags=re.M)
    assert heads[0] == "Failures"
    checks = _section(report, "## Checks")
    rows = [line for line in checks.splitlines() if line.startswith("| ") and not line.startswith("| check ")]
    kinds = {c.name for c in verdict.checks}
    assert len(rows) == len(kinds)
    bound = next(line for line in rows if line.startswith("| bound-dispatch |"))
    n_fail = sum(c.name == "bound-dispatch" and c.passed is False for c in verdict.checks)
    assert bound.split(" | ")[3] == str(n_fail) and n_fail > 0
    assert rows[0].split(" | ")[3] != "0"  # failing kinds first


def test_thresholds_read_in_milliseconds_in_the_report_and_the_terminal(good):
    from rich.console import Console

    from ratebench.outputs.console import print_verdict

    run, verdict = good
    report = (run / "report.md").read_text()
    line = next(x for x in report.splitlines() if x.startswith("Thresholds: "))
    assert "`spacing_slack` = 5 ms" in line and "`isolation_e2e_slack` = 50 ms" in line
    assert "`stream_wait_slack` = 300 ms" in line and "`burst` = 100 ms" in line and "`wake_max` = 10 ms" in line
    assert "`emit_tolerance` = the phase's longest engine step" in line and "`max_overhead` = the profile's max_overhead, else report only" in line
    assert "_ns`" not in line and "000000" not in line and "`delivery_min` = 0.97" in line
    console = Console(width=180, record=True, color_system=None)
    print_verdict(verdict, console)
    text = " ".join(console.export_text().split())
    assert "thresholds: delivery_min 0.97," in text and "spacing_slack 5 ms" in text and "_ns" not in text


def test_threshold_items_give_each_duration_its_unit():
    from ratebench.analysis.verdict import Thresholds
    from ratebench.outputs.format import threshold_items

    items = dict(threshold_items(Thresholds(spacing_slack_ns=2_500_000, emit_tolerance_ns=750_000,
                                            stream_wait_slack_ns=12_000_000_000, max_overhead=0.05)))
    assert items["spacing_slack"] == "2.5 ms" and items["emit_tolerance"] == "750 us"
    assert items["stream_wait_slack"] == "12 s" and items["max_overhead"] == "0.05"
    assert items["cancel_max_steps"] == "1" and not any(k.endswith(("_ns", "_ms")) for k in items)
