"""A phase of many users read by tier: the terminal shows a line per tier with the worst user of each
check, then only the failing users' rows; verdict.json and report.md keep every user; the plot has
one chart per tier with every user's slack."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from ratebench.outputs.console import print_verdict, verdict_tables
from ratebench.outputs.tiers import MAX_USER_ROWS, tier_lines, tier_of
from ratebench.profiles import ANONYMOUS_USER
from ratebench.synth import SimEngine, SimPhase, SimRequest, write_run_folder
from ratebench.verify import analyse_run, verify_run
from synthetic_runs import edit_client_records

_TIERS = (("low", 25, 20), ("high", 20, 200), ("burst", 10, 50))  # name, users, limit


def _mix_run(run_dir: Path, *, kind: str = "mix", tiers: tuple = _TIERS) -> Path:
    """One mix phase: 55 tier users (two 8-token requests each) and anonymous requests."""
    users = {f"{name}-{i:02d}": limit for name, n, limit in tiers for i in range(n)}
    eng = SimEngine("patched-sync", default_tps=100, user_tps=dict(users))
    reqs, info = [], {}
    for u, limit in users.items():
        for k in range(2):
            reqs.append(SimRequest(f"rb-5e1f0001-{len(reqs)}", u, len(reqs), 8,
                                   arrive_offset_ns=k * 50_000_000 + len(reqs) * 1_000_000))
        info[u] = {"limit_tps": limit, "streams": 2, "backlogged": False}
        if kind == "mix":
            info[u]["tier"] = u.rsplit("-", 1)[0]
    for k in range(3):
        reqs.append(SimRequest(f"rb-5e1f0001-{len(reqs)}", None, len(reqs), 8, arrive_offset_ns=k * 30_000_000))
    info[ANONYMOUS_USER] = {"limit_tps": 100, "streams": 3, "backlogged": False}
    phase = SimPhase(kind, kind, kind, "patched-sync", "measure", info, reqs, params={"lateness_ms": 20})
    return write_run_folder(run_dir, [eng], [phase])


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


def test_verdict_json_and_report_md_keep_every_user_and_their_tier(broken) -> None:
    verify_run(broken)
    rows = json.loads((broken / "verdict.json").read_text())["rows"]
    assert len(rows) == 56 and {r["user"]: r["tier"] for r in rows}["high-19"] == "high"
    report = (broken / "report.md").read_text()
    assert all(f"| {u} |" in report for u in ("low-00", "low-24", "high-19", "burst-09", ANONYMOUS_USER))


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


def test_report_md_reads_the_mix_by_tier_before_every_users_row(broken) -> None:
    verify_run(broken)
    report = (broken / "report.md").read_text()
    tiers, users = report.index("## Users by tier"), report.index("## Users by scenario phase")
    assert tiers < users
    section = report[tiers:users]
    assert "| mix/mix | patched-sync | low | 25 | 20 | 400 | FAIL (low-07) |" in section
    assert "1 (low-07, **1 of 25 FAIL**)" in section and "| burst |" in section


def test_the_line_after_a_phase_of_many_users_sums_up_each_tier(broken) -> None:
    from ratebench.events import read_client_records
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
