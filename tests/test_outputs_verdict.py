"""Reading a verdict: the terminal tables keep every row's names whole at 100 columns, and each failure
says which promise broke and where to look, in the console and in report.md alike."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console

from ratebench.outputs.console import print_verdict
from ratebench.outputs.markdown import render_report
from ratebench.outputs.promises import CHECKS, PROMISES
from ratebench.synth import standard_run
from ratebench.verify import analyse_run, verify_run
from synthetic_runs import one_phase_run

# every check the verifier makes, the lead's new ones included
CHECK_NAMES = (
    "bound-dispatch", "bound-emit", "bound-client", "bound-dispatch-run", "bound-emit-run", "delivery", "rate-seed",
    "reconciliation", "cancellation", "charge-parity", "stream-fairness", "isolation-rate", "isolation-ttft",
    "isolation-gap-p99", "isolation-ttft-p90", "isolation-ttft-p99", "isolation-e2e-p50", "isolation-e2e-p90",
    "isolation-e2e-p99", "isolation-gap-p50", "isolation-gap-p90", "isolation-binding", "overhead", "event-recording", "jain-fairness", "even-spacing-dispatch",
    "even-spacing-emit", "identity", "wait-cpu", "wake-first-token", "wake-abort", "witness-order", "witness-emits",
)


def rendered(verdict, width: int = 100) -> str:
    console = Console(width=width, record=True, color_system=None)
    print_verdict(verdict, console)
    return console.export_text()


@pytest.fixture(scope="module")
def good_verdict(tmp_path_factory):
    return analyse_run(standard_run(tmp_path_factory.mktemp("good") / "run")).verdict


@pytest.fixture(scope="module")
def broken_verdict(tmp_path_factory):
    return analyse_run(standard_run(tmp_path_factory.mktemp("broken") / "run", limiter="burst-1s",
                                    overhead=False)).verdict


def test_every_rows_phase_and_user_appear_whole_at_100_columns(good_verdict):
    # the longest names a run makes: overhead phases, the anonymous user, a limit never reached
    for row in good_verdict.rows:
        if row.phase.startswith("feature-on-no-events"):
            row.user, row.limit_tps = "__anonymous__", 1_000_000
    text = rendered(good_verdict)
    assert "…" not in text
    lines = [line.split() for line in text.splitlines()]
    for row in good_verdict.rows:
        assert any(words[:2] == [row.phase, row.user] for words in lines), (row.phase, row.user)


def test_one_table_per_scenario_and_engine_titled_with_them(good_verdict):
    text = rendered(good_verdict)
    for scenario, engine in {(r.scenario, r.engine) for r in good_verdict.rows}:
        assert f"{scenario} on {engine}" in text
    assert "seed-experiment/" not in text.split("PASS")[0]  # no scenario/phase column to cut


def test_the_legend_explains_every_short_header(good_verdict):
    from ratebench.outputs.format import FIGURE_COLUMNS

    text = " ".join(rendered(good_verdict).split())
    for col in FIGURE_COLUMNS:
        assert f"{col.short}: {col.legend}" in text


def test_every_check_has_a_promise_and_a_place_to_look(good_verdict, broken_verdict):
    made = {c.name for v in (good_verdict, broken_verdict) for c in v.checks}
    assert made <= set(CHECKS), made - set(CHECKS)
    assert set(CHECK_NAMES) <= set(CHECKS)
    assert {m.promise for m in CHECKS.values()} <= set(PROMISES)


def test_failures_come_first_after_the_tables_with_the_promise_and_where_to_look(broken_verdict):
    text = rendered(broken_verdict)
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("broken promise"))
    assert lines[first - 1].split()[:2] == ["eos", "user-b"]  # right after the last table's last row
    after_tables = " ".join(" ".join(lines[first:]).split())
    assert after_tables.startswith(f"broken promise 6: {PROMISES['6']} FAIL bound-dispatch-run ")
    assert "look: plots/seed-experiment-1-stream-patched-sync.png, the user's panel: red" in after_tables
    assert "worst window at 0.000.." in after_tables
    assert after_tables.index("broken promise") < after_tables.index("rates in tok/s")  # before the legend


def test_report_puts_the_verdict_and_failures_first(broken_verdict):
    report = render_report(broken_verdict)
    assert report.startswith("# ratebench verdict: FAIL")
    order = [report.index(h) for h in ("## Failures", "## Run", "## Users by scenario phase", "## Checks")]
    assert order == sorted(order)
    assert "**Broken promise 6: the bound" in report
    assert "Look: plots/seed-experiment-1-stream-patched-sync.png" in report


def test_the_plot_a_failure_points_to_exists(tmp_path):
    run = one_phase_run(tmp_path / "run", limiter="burst-1s", streams=2)
    verdict = verify_run(run)
    report = (run / "report.md").read_text()
    looks = re.findall(r"Look: (plots/[^;.]+\.png)", report)
    assert looks and all((Path(run) / p).is_file() for p in looks)
    assert verdict.failures
