"""compare: two runs' figures side by side with ratios B/A."""

from __future__ import annotations

from typer.testing import CliRunner

from ratebench.analysis import compare_verdicts
from ratebench.cli import app
from ratebench.verify import analyse_run
from synthetic_runs import one_phase_run


def test_compare_matches_rows_and_gives_ratios(tmp_path):
    a = one_phase_run(tmp_path / "a", limiter="gcra")
    b = one_phase_run(tmp_path / "b", limiter="never")
    c = compare_verdicts(analyse_run(a).verdict, analyse_run(b).verdict)
    line = next(x for x in c.lines if x.figure == "dispatch seed tok/s" and x.user == "user-a")
    assert line.ratio > 2  # the broken limiter sends far more
    slack = next(x for x in c.lines if x.figure == "worst slack dispatch")
    assert slack.ratio is None and slack.b < 0
    assert c.passed_a and not c.passed_b


def test_compare_command_writes_compare_md(tmp_path):
    a = one_phase_run(tmp_path / "a")
    b = one_phase_run(tmp_path / "b", limiter="half-rate")
    result = CliRunner().invoke(app, ["compare", str(a), str(b), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "compare.md").read_text()
    assert "dispatch steady tok/s" in text and "B/A" in text


def test_compare_of_an_unusable_run_exits_2(tmp_path):
    a = one_phase_run(tmp_path / "a")
    result = CliRunner().invoke(app, ["compare", str(a), str(tmp_path / "nothing")])
    assert result.exit_code == 2


def test_compare_puts_overhead_ratios_and_engine_steps_side_by_side(tmp_path):
    from synth import standard_run

    a = analyse_run(standard_run(tmp_path / "a")).verdict
    b = analyse_run(standard_run(tmp_path / "b", seed=1)).verdict
    c = compare_verdicts(a, b)
    ratios = {x.where: x for x in c.lines if x.figure == "median round ratio"}
    assert set(ratios) == {f"overhead/{p}" for p in a.overheads[0].paired}
    assert "overhead/feature-on/feature-on-no-events" in ratios
    line = ratios["overhead/feature-on/feature-off"]
    assert line.a == a.overheads[0].paired["feature-on/feature-off"].median
    assert line.b == b.overheads[0].paired["feature-on/feature-off"].median
    steps = {x.where for x in c.lines if x.figure == "engine step p50 ms"}
    assert steps == {"overhead/feature-on", "overhead/feature-off"}
