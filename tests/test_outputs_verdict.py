"""Reading a verdict: the terminal tables keep every row's names whole at 100 columns, each failure
says which promise broke and where to look, in the console and in report.md alike, and the first line
of every output says which promises the run exercised."""

from __future__ import annotations

import html as html_lib
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from ratebench.analysis.verdict import Thresholds
from ratebench.outputs.console import print_verdict
from ratebench.outputs.markdown import render_report
from ratebench.outputs.promises import CHECKS, PROMISE_NAMES, PROMISES, VERDICT_PROMISES, headline, promise_coverage
from synth import standard_run
from ratebench.verify import EXIT_PASSED, analyse_run, exit_code, verify_run
from synthetic_runs import all_promises_run, one_phase_run

# every check the verifier makes, the lead's new ones included
CHECK_NAMES = (
    "bound-dispatch", "bound-emit", "bound-client", "bound-dispatch-run", "bound-emit-run", "delivery", "rate-seed",
    "reconciliation", "cancellation", "charge-parity", "stream-fairness", "isolation-rate", "isolation-ttft",
    "isolation-gap-p99", "isolation-ttft-p90", "isolation-ttft-p99", "isolation-e2e-p50", "isolation-e2e-p90",
    "isolation-e2e-p99", "isolation-gap-p50", "isolation-gap-p90", "isolation-binding", "overhead", "event-recording", "jain-fairness", "even-spacing-dispatch",
    "even-spacing-emit", "identity", "wait-cpu", "wait-steps", "wake-first-token", "wake-abort", "witness-order", "witness-emits",
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


# which promises a run exercised (docs/promise.md section 5: "A PASS names the promises its phases
# did not exercise"), in all four outputs

@pytest.fixture(scope="module")
def without_waiting(tmp_path_factory):
    """Every promise but waiting costs nothing exercised; verdict.json, report.md and report.html written."""
    run = all_promises_run(tmp_path_factory.mktemp("nowait") / "run", waiting=False)
    return run, verify_run(run, Thresholds(max_overhead=0.5), plots=False)


def _first_lines(run: Path, verdict) -> dict[str, str]:
    page = (run / "report.html").read_text()
    banner = re.search(r'<h1 class="outcome"[^>]*>(.*?)</h1>', page).group(1)
    return {
        "console": rendered(verdict, width=400).splitlines()[0],
        "report.md": (run / "report.md").read_text().splitlines()[0].removeprefix("# ratebench verdict: "),
        "report.html": html_lib.unescape(re.sub(r"<[^>]+>", "", banner)).removeprefix("ratebench verdict: "),
        "verdict.json": json.loads((run / "verdict.json").read_text())["headline"],
    }


def test_a_run_without_waiting_checks_says_so_on_the_first_line_of_every_output(without_waiting):
    run, verdict = without_waiting
    assert verdict.passed and exit_code(verdict) == EXIT_PASSED  # an unexercised promise is no failure
    want = "PASS, 12 of 13 promises exercised; not exercised: waiting costs nothing"
    assert _first_lines(run, verdict) == dict.fromkeys(("console", "report.md", "report.html", "verdict.json"), want)
    lines = rendered(verdict, width=400).splitlines()
    assert "not exercised waiting costs nothing: none of its checks was made (wait-cpu, wait-steps, " \
           "wake-first-token, wake-abort)" in lines
    assert lines[-1].startswith("PASS: ") and lines[-1].endswith("; " + want.removeprefix("PASS, "))
    report = (run / "report.md").read_text()
    assert "| waiting costs nothing | **no** | 0 | 0 | none of its checks was made" in report


def test_verdict_json_lists_every_promise(without_waiting):
    run, _ = without_waiting
    promises = json.loads((run / "verdict.json").read_text())["promises"]
    assert [p["key"] for p in promises] == list(VERDICT_PROMISES)
    assert set(promises[0]) == {"key", "name", "words", "exercised", "checks_judged", "checks_failed", "how"}
    by_name = {p["name"]: p for p in promises}
    assert [n for n, p in by_name.items() if not p["exercised"]] == ["waiting costs nothing"]
    assert by_name["the bound"]["checks_judged"] > 0 and by_name["the bound"]["checks_failed"] == 0
    assert by_name["the bound"]["words"] == PROMISES["6"]
    assert "async: patched-async" in by_name["sync and async scheduling"]["how"]
    assert "engine-as-asked on feature-off-sync" in by_name["feature off = upstream"]["how"]


def test_a_run_that_exercises_everything_says_so(tmp_path):
    run = all_promises_run(tmp_path / "run")
    verdict = verify_run(run, Thresholds(max_overhead=0.5), plots=False)
    assert verdict.passed
    want = "PASS, 13 of 13 promises exercised"
    assert _first_lines(run, verdict) == dict.fromkeys(("console", "report.md", "report.html", "verdict.json"), want)
    assert all(p["exercised"] for p in json.loads((run / "verdict.json").read_text())["promises"])


def test_sync_and_async_need_judged_checks_on_both_modes_limiter_on_engines(tmp_path):
    verdict = analyse_run(all_promises_run(tmp_path / "run", waiting=False), Thresholds(max_overhead=0.5)).verdict
    assert verdict.engine_async_scheduling["patched-async"] is True  # its event file's header

    def five():
        return next(p for p in promise_coverage(verdict) if p.key == "5")

    assert five().exercised
    verdict.engine_async_scheduling["patched-async"] = False  # the header wins over the name
    assert not five().exercised and "no judged check on an async limiter-on engine" in five().how
    del verdict.engine_async_scheduling["patched-async"]  # no header: the name tells
    assert five().exercised
    # engine-as-asked alone (it says how an engine ran) does not exercise a mode
    verdict.checks = [c for c in verdict.checks if c.engine != "patched-async" or c.name == "engine-as-asked"]
    assert not five().exercised


def test_information_only_checks_exercise_nothing(good_verdict):
    # the standard run: sync engines only, no waiting scenario, the overhead reported without a threshold
    coverage = {p.name: p for p in promise_coverage(good_verdict)}
    assert coverage["overhead"].how == "its checks were information only (feature-off-cost, overhead)"
    assert headline(good_verdict) == ("PASS, 9 of 13 promises exercised; not exercised: sync and async "
                                      "scheduling, flags and beam search refused, waiting costs nothing, overhead")


def test_a_fail_names_the_broken_promises_first(broken_verdict):
    line = rendered(broken_verdict, width=400).splitlines()[0]
    assert line == headline(broken_verdict)
    assert line.startswith("FAIL, broken: the bound; ") and "promises exercised" in line
    assert render_report(broken_verdict).startswith(f"# ratebench verdict: {line}\n")


def test_promises_have_short_names_the_headline_can_list():
    assert set(VERDICT_PROMISES) <= set(PROMISES) and set(PROMISE_NAMES) == set(PROMISES)
    assert not any("," in n or ";" in n for n in PROMISE_NAMES.values())
    # every promise the verdict counts has a check that guards it
    guarded = {k for m in CHECKS.values() for k in (m.promise, *m.also)}
    assert set(VERDICT_PROMISES) <= guarded
