"""A phase of many users read by tier: the terminal and report.md show a line per tier with the worst
user of each check, then only the failing users' rows, and each tier's latency beside the phase's
baseline (as `vllm bench serve` prints a run); verdict.json keeps every user; the plot has one chart
per tier with every user's slack."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from ratebench.outputs.console import print_verdict, verdict_tables
from ratebench.outputs.markdown import render_report
from ratebench.outputs.tiers import MAX_USER_ROWS, tier_lines, tier_of
from ratebench.profiles import ANONYMOUS_USER
from ratebench.verify import analyse_run, verify_run
from synthetic_runs import edit_client_records, mix_run_folder

_mix_run = mix_run_folder


def _break_totals(run_dir: Path, users: set[str]) -> None:
    """The final usage of each of these users' first request says one token more than was streamed."""
    def edit(recs):
        seen = set()
        for r in recs:
            if r.user in users and r.user not in seen:
                r.completion_tokens += 1
                seen.add(r.user)
    edit_client_records(run_dir, edit)


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    run = _mix_run(tmp_path_factory.mktemp("mix") / "run")
    _break_totals(run, {"low-07", "high-03"})
    return run


def _text(verdict, width: int = 180) -> str:
    console = Console(width=width, record=True, color_system=None)
    print_verdict(verdict, console)
    return console.export_text()


def test_a_mix_phase_shows_a_line_per_tier_then_only_its_failing_users(broken) -> None:
    verdict = analyse_run(broken).verdict
    assert len(verdict.rows) == 56 and {r.tier for r in verdict.rows} == {"low", "high", "burst", None}
    text = _text(verdict)
    assert "56 users by tier, the worst user of each check" in text
    by_tier, failing = text.split("failing users")
    tiers = {words[1]: words for words in map(str.split, by_tier.splitlines()) if words[:1] == ["mix"]
             and words[1] != "on"}
    assert list(tiers) == ["burst", "high", "low", ANONYMOUS_USER]  # anonymous requests last
    assert tiers["low"][2:7] == ["25", "20", "400", "FAIL", "1/25"] and tiers["burst"][5] == "pass"
    user_rows = {words[1] for words in map(str.split, failing.splitlines()) if words[:1] == ["mix"]}
    assert user_rows == {"low-07", "high-03"}  # of 56 users, only the failing ones have a row
    assert "low-12" not in text


def test_each_tier_names_its_worst_user_of_each_check(broken) -> None:
    verdict = analyse_run(broken).verdict
    rows = [r for r in verdict.rows if r.phase == "mix"]
    lines = {line.tier: line for line in tier_lines(verdict, rows)}
    low = lines["low"]
    assert len(low.users) == 25 and low.limits_tps == [20] and low.failed_users == ["low-07"]
    rec = low.worst["reconciliation"]
    assert (rec.user, rec.failed, rec.checked) == ("low-07", 1, 25)
    bound = low.worst["bound-dispatch"]
    mine = [c for c in verdict.checks if c.name == "bound-dispatch" and c.user in low.users]
    assert bound.figure == min(c.figure for c in mine) and bound.checked == 25 and not bound.failed
    assert lines["burst"].passed and not lines["burst"].worst["reconciliation"].failed


def _section(report: str, heading: str) -> str:
    start = report.index(heading)
    nxt = report.find("\n## ", start + len(heading))
    return report[start:] if nxt < 0 else report[start:nxt]


def test_verdict_json_keeps_every_user_and_report_md_its_tiers_and_failing_users(broken) -> None:
    verify_run(broken)
    rows = json.loads((broken / "verdict.json").read_text())["rows"]
    assert len(rows) == 56 and {r["user"]: r["tier"] for r in rows}["high-19"] == "high"
    report = (broken / "report.md").read_text()
    for heading in ("## Users by scenario phase", "## Inter-token gaps"):
        section = _section(report, heading)
        assert "| mix/mix | patched-sync | low-07 |" in section and "| mix/mix | patched-sync | high-03 |" in section
        assert not any(f"| {u} |" in section for u in ("low-00", "low-24", "high-19", "burst-09", ANONYMOUS_USER))
    assert "The 54 passing users of the 1 phases of many users (`mix/mix@patched-sync`)" in report
    # the whole-file bound: each tier's tightest user on each side (every user in verdict.json)
    bound = _section(report, "## The bound over each engine's whole event file")
    rows_md = [line for line in bound.splitlines() if line.startswith("| patched-sync |")]
    assert len(rows_md) <= 2 * 4 + 2 and "(tightest of tier low, 25 users)" in bound
    assert len(json.loads((broken / "verdict.json").read_text())["engine_bounds"]) == 56


def test_a_trace_of_few_users_keeps_its_rows_and_of_many_goes_by_limit(tmp_path) -> None:
    few = analyse_run(_mix_run(tmp_path / "few", kind="trace", tiers=(("a", 3, 20), ("b", 2, 200)))).verdict
    text = _text(few)
    assert "by tier" not in text and all(r.user in text for r in few.rows)
    many = analyse_run(_mix_run(tmp_path / "many", kind="trace", tiers=(("a", MAX_USER_ROWS, 20), ("b", 2, 200))))
    text = _text(many.verdict)
    assert f"{MAX_USER_ROWS + 3} users by tier" in text and "a-03" not in text
    assert {tier_of(r) for r in many.verdict.rows} == {"at 20 tok/s", "at 200 tok/s", ANONYMOUS_USER}


def test_a_mix_plot_has_one_chart_per_tier_with_every_users_slack(broken, tmp_path, monkeypatch) -> None:
    import matplotlib.pyplot as plt

    charts = []
    original = plt.Figure.savefig

    def spy(fig, *a, **kw):
        charts.append([(ax.get_title(), len(ax.get_lines())) for ax in fig.axes])
        return original(fig, *a, **kw)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    verify_run(broken)
    assert len(list((broken / "plots").glob("*.png"))) == 1
    (panels,) = charts
    titles = [t for t, _ in panels]
    assert set(titles[:4]) == {"tier low: 25 users at 20 tok/s, 1 FAIL", "tier high: 20 users at 200 tok/s, 1 FAIL",
                               "tier burst: 10 users at 50 tok/s", f"tier {ANONYMOUS_USER}: 1 user at 100 tok/s"}
    assert titles[4] == "inter-token gaps"
    lines = dict(panels)  # every user's slack on the bound's side at least, and the zero line
    assert lines["tier low: 25 users at 20 tok/s, 1 FAIL"] >= 25 + 1
    assert lines["tier burst: 10 users at 50 tok/s"] >= 10 + 1


@pytest.mark.parametrize("width", [80, 100, 180])
def test_the_tier_lines_fit_the_terminal_and_go_on_below_when_checks_do_not(broken, width) -> None:
    verdict = analyse_run(broken).verdict
    text = _text(verdict, width)
    assert "…" not in text
    # laid out without a limit, each tier table is as wide as on the terminal: nothing was cut there
    wide = Console(width=1000, record=True, color_system=None)
    for table in verdict_tables(verdict, width):
        if "by tier" in table.title or "(continued)" in table.title:  # the users' rows fold their figures
            wide.print(table)
    assert max(len(line.rstrip()) for line in wide.export_text().splitlines()) <= width
    head = " ".join(text.split())
    for name in tier_lines(verdict, [r for r in verdict.rows if r.phase == "mix"])[0].worst:
        assert name.replace("-", " ") in head or all(w in head for w in name.split("-")), name
    assert ("(continued)" in text) == (width < 180)


def test_a_tier_chart_leaves_a_users_idle_stretch_blank() -> None:
    import numpy as np

    from ratebench.outputs.plots import IDLE_BREAK_S, _break_idle

    x, y = _break_idle(np.array([0.0, 0.1, 0.2, 2.0, 2.1]), np.array([1.0, 0.5, 0.2, 2.0, 1.0]))
    assert np.isnan(y[3]) and 0.2 < x[3] < 2.0 and list(x[[0, 1, 2, 4, 5]]) == [0.0, 0.1, 0.2, 2.0, 2.1]
    assert np.nanmin(y) == 0.2 and len(_break_idle(np.arange(5) * IDLE_BREAK_S / 2, np.ones(5))[0]) == 5


def test_report_md_reads_the_mix_by_tier_before_its_failing_users_rows(broken) -> None:
    verify_run(broken)
    report = (broken / "report.md").read_text()
    tiers, users = report.index("## Users by tier"), report.index("## Users by scenario phase")
    assert tiers < users
    section = report[tiers:users]
    assert "| mix/mix | patched-sync | low | 25 | 20 | 400 | FAIL (low-07) |" in section
    assert "1 (low-07, **1 of 25 FAIL**)" in section and "| burst |" in section


def test_the_line_after_a_phase_of_many_users_sums_up_each_tier(broken) -> None:
    from ratebench.runrecords import read_client_records
    from ratebench.scenarios import SUMMARY_MAX_USERS, PhaseRecord, phase_summary

    (entry,) = json.loads((broken / "scenarios.json").read_text())
    records = read_client_records(broken / "requests.jsonl")
    phase = PhaseRecord(entry["scenario"], "mix", "mix", "patched-sync", 0, 1, entry["users"])
    line = phase_summary(phase, records)
    head, tiers = line.split(": ", 1)[0], line.split("56 users by tier: ")[1].split("; ")
    assert head == "mix on patched-sync" and len(tiers) == 4
    low = next(t for t in tiers if t.startswith("low (limit 20): 25 users 400 tok, "))
    assert re.fullmatch(r".*, [0-9.]+ \(low-\d\d\) to [0-9.]+ tok/s \(low-\d\d\)", low)
    assert any(t.startswith(f"{ANONYMOUS_USER} (limit 100): 1 user 24 tok, ") for t in tiers)
    few = PhaseRecord("s", "mix", "mix", "e", 0, 1, {u: entry["users"][u] for u in list(entry["users"])[:3]})
    assert len(few.users) <= SUMMARY_MAX_USERS and phase_summary(few, records).count(" tok/s (limit ") == 3


# ---- latency by tier, beside the baseline (as `vllm bench serve` prints a run) ---------------------------


@pytest.fixture(scope="module")
def with_baseline(tmp_path_factory):
    run = _mix_run(tmp_path_factory.mktemp("mixb") / "run", baseline=True)
    return run, verify_run(run)


def _served(records, phase: str, users: list[str]) -> dict:
    """What `vllm bench serve` would print for these users' requests, from requests.jsonl alone."""
    import numpy as np

    rs = [r for r in records if r.phase == phase and (r.user or ANONYMOUS_USER) in users and r.sent_ns is not None]
    tokens = [sum(r.chunk_tokens) for r in rs]
    pct = lambda xs: list(np.percentile(np.array(xs, dtype=float), [50, 90, 99]))  # noqa: E731
    return {
        "requests": len(rs), "tokens": sum(tokens),
        "tps": sum(tokens) / ((max(r.chunk_ns[-1] for r in rs) - min(r.sent_ns for r in rs)) / 1e9),
        "ttft": pct([r.chunk_ns[0] - r.sent_ns for r in rs]),
        "tpot": pct([(r.chunk_ns[-1] - r.chunk_ns[0]) / (n - 1) for r, n in zip(rs, tokens) if n > 1]),
        "itl": pct([b - a for r in rs for a, b in zip(r.chunk_ns, r.chunk_ns[1:])]),
        "e2el": pct([r.chunk_ns[-1] - r.sent_ns for r in rs if r.finish_reason in ("stop", "length")]),
    }


def test_each_tier_gets_vllm_bench_serve_figures_on_the_phase_and_on_its_baseline(with_baseline) -> None:
    from ratebench.runrecords import read_client_records

    run, verdict = with_baseline
    records = read_client_records(run / "requests.jsonl")
    lines = verdict.tier_latency
    assert [x.tier for x in lines] == ["burst", "high", "low", ANONYMOUS_USER]
    for x in lines:
        assert (x.phase, x.engine, x.baseline_phase, x.baseline_engine) == \
            ("mix", "patched-sync", "mix-baseline", "feature-off-sync")
        for figures, phase in ((x.on, "mix"), (x.baseline, "mix-baseline")):
            want = _served(records, phase, x.users)
            assert figures.side == "client"
            assert (figures.requests, figures.output_tokens) == (want["requests"], want["tokens"])
            assert figures.throughput_tps == pytest.approx(want["tps"])
            for name in ("ttft", "tpot", "itl", "e2el"):
                g = getattr(figures, name)
                assert [g.p50_ns, g.p90_ns, g.p99_ns] == pytest.approx(want[name], abs=1), (x.tier, phase, name)
    low = next(x for x in lines if x.tier == "low")
    assert len(low.users) == 25 and low.limits_tps == [20] and low.on.requests == 50
    # 20 tok/s spaces the low tier's tokens on the limiter-on phase; nothing does on the baseline
    assert low.on.tpot.p50_ns > 5 * low.baseline.tpot.p50_ns and low.on.throughput_tps < low.baseline.throughput_tps


def test_report_md_and_the_terminal_show_each_tier_beside_its_baseline(with_baseline) -> None:
    from ratebench.outputs.format import quantiles_ms

    run, verdict = with_baseline
    report = (run / "report.md").read_text()
    heads = [report.index(h) for h in ("## Users by tier", "## Latency by tier", "## Users by scenario phase")]
    assert heads == sorted(heads)
    section = _section(report, "## Latency by tier")
    assert "| scenario/phase | engine | tier | users | N | requests | output tokens | tok/s | TTFT ms p50/p90/p99 " \
           "| TPOT ms p50/p90/p99 | ITL ms p50/p90/p99 | E2EL ms p50/p90/p99 |" in section
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| mix/")]
    assert [(r[0], r[2]) for r in rows] == [(f"| mix/{p}", t) for t in ("burst", "high", "low", ANONYMOUS_USER)
                                            for p in ("mix", "mix-baseline")]
    low = next(x for x in verdict.tier_latency if x.tier == "low")
    on, base = (r for r in rows if r[2] == "low")
    assert on[1:9] == ["patched-sync", "low", "25", "20", "50", "400", f"{low.on.throughput_tps:.1f}",
                       quantiles_ms(low.on.ttft)]
    assert base[1:5] == ["feature-off-sync", "low", "25", "off"] and base[-1] == f"{quantiles_ms(low.baseline.e2el)} |"
    text = _text(verdict)
    assert "mix: latency per tier, mix@patched-sync beside mix-baseline@feature-off-sync" in text
    terminal = [w for w in map(str.split, text.splitlines()) if w[:1] == ["low"]]
    assert [w[1:4] for w in terminal] == [["mix", "20", "50"], ["mix-baseline", "off", "50"]]
    assert terminal[0][6] == quantiles_ms(low.on.ttft)


def test_without_client_chunks_both_phases_are_read_on_the_engines_emit_events(tmp_path) -> None:
    run = _mix_run(tmp_path / "run", baseline=True)

    def drop_baseline_chunks(recs):
        for r in recs:
            if r.phase == "mix-baseline":
                r.chunk_ns, r.chunk_tokens = [], []

    edit_client_records(run, drop_baseline_chunks)
    lines = analyse_run(run).verdict.tier_latency
    assert {(x.on.side, x.baseline.side) for x in lines} == {("engine", "engine")}
    low = next(x for x in lines if x.tier == "low")
    assert (low.on.requests, low.on.output_tokens, low.baseline.output_tokens) == (50, 400, 400)
    assert low.on.ttft.count == low.baseline.ttft.count == 50


def test_a_mix_without_baseline_shows_its_tiers_alone(broken) -> None:
    verdict = analyse_run(broken).verdict
    assert [x.baseline_phase for x in verdict.tier_latency] == [None] * 4
    section = _section(render_report(verdict), "## Latency by tier")
    assert section.count("| mix/mix | patched-sync |") == 4 and "mix-baseline" not in section
    assert "latency per tier, mix@patched-sync (ms" in _text(verdict)


def test_the_overrides_cell_counts_users_by_limit(with_baseline) -> None:
    from ratebench.outputs.format import overrides_text

    run, _ = with_baseline
    section = _section((run / "report.md").read_text(), "## Run")
    assert "| patched-sync | patched | True | False | 100 | 55 users: 20 (25), 50 (10), 200 (20) |" in section
    assert "low-00" not in section and "| feature-off-sync | patched | False | False | - | - |" in section
    assert overrides_text({"user-a": 20, "user-b": 100}) == "2 users: user-a 20, user-b 100"
    assert overrides_text({f"u{i}": 5 if i % 3 else 15 for i in range(9)}) == "9 users: 5 (6), 15 (3)"
    assert overrides_text(None) == overrides_text({}) == "-"


def test_a_many_user_report_stays_small(with_baseline) -> None:
    """report.md and report.html hold the tiers and the failing users, not a row per user: 55 users
    make neither grow with them (verdict.json has every user)."""
    run, _ = with_baseline
    report = (run / "report.md").read_text()
    assert sum(f"{u}-" in line for line in report.splitlines() for u in ("low", "high", "burst")) <= 30
    assert len(report) < 40_000
    html_tables = re.sub(r'src="data:image/png;base64,[^"]+"', "", (run / "report.html").read_text())
    assert len(html_tables) < 60_000


@pytest.mark.parametrize("width", [80, 180])
def test_the_latency_table_fits_the_terminal_stacking_its_quantiles_when_narrow(with_baseline, width) -> None:
    from ratebench.outputs.format import quantiles_ms

    _, verdict = with_baseline
    (table,) = [t for t in verdict_tables(verdict, width) if "latency per tier" in str(t.title)]
    wide = Console(width=1000, record=True, color_system=None)  # nothing cut on the terminal: as wide there
    wide.print(table)
    lines = wide.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= width and "…" not in "".join(lines)
    low = [w for w in map(str.split, lines) if w[:2] == ["low", "mix"]][0]
    stacked = width == 80  # p50 over p90 over p99
    assert ("p50 over p90 over p99" in str(table.title)) == stacked
    ttft = next(x for x in verdict.tier_latency if x.tier == "low").on.ttft
    assert low[6] == quantiles_ms(ttft, "\n").split()[0] if stacked else low[6] == quantiles_ms(ttft)
