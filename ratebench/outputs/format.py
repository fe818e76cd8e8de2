"""Number formatting, the row table's columns and plot file names, shared by the console and markdown outputs."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ratebench.analysis.bound import BoundResult
from ratebench.analysis.gaps import GapStats
from ratebench.analysis.overhead import OVERHEAD_ROLES
from ratebench.analysis.rates import RateFigures
from ratebench.analysis.verdict import UserPhaseSummary


def num(x: float | int | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


def seed_rate(r: RateFigures | None) -> str:
    return num(r.seed_rate_tps) if r else "-"


def steady_rate(r: RateFigures | None) -> str:
    return num(r.steady_rate_tps) if r else "-"


def slack(b: BoundResult | None) -> str:
    """Tokens under the bound in the worst window: two decimals near the bound, fewer far from it
    (a limit never approached leaves thousands, k)."""
    if b is None or b.worst is None:
        return "-"
    x = b.worst.slack_tokens
    if abs(x) >= 10_000:
        return f"{x / 1000:+.0f}k"
    return f"{x:+.0f}" if abs(x) >= 100 else f"{x:+.2f}"


def ms(g: GapStats | None, field: str = "p99_ns") -> str:
    if g is None:
        return "-"
    return f"{getattr(g, field) / 1e6:.1f}"


def tokens(row: UserPhaseSummary) -> str:
    emitted = row.emit_rate.tokens if row.emit_rate else None
    if emitted is None:
        return str(row.streamed_tokens)
    return f"{emitted}/{row.streamed_tokens}"


@dataclass(frozen=True)
class FigureColumn:
    """One figure of a user's row: its report.md header, its short console header and legend entry."""

    title: str
    short: str
    legend: str
    cell: Callable[[UserPhaseSummary], str]


FIGURE_COLUMNS = (
    FigureColumn("limit", "N", "limit, tok/s", lambda r: num(r.limit_tps)),
    FigureColumn("dispatch seed/steady", "dispatch", "rate of charges (dispatch events), seed/steady (backlogged)",
                 lambda r: f"{seed_rate(r.dispatch_rate)}/{steady_rate(r.dispatch_rate) if r.backlogged else '-'}"),
    FigureColumn("emit seed", "emit", "rate of emitted tokens, seed", lambda r: seed_rate(r.emit_rate)),
    FigureColumn("client seed", "client", "rate the client received, seed", lambda r: seed_rate(r.client_rate)),
    FigureColumn("slack dispatch/emit", "slack d/e", "allowed - tokens in the bound's worst window, dispatch/emit "
                 "(negative: broken; k: thousands)",
                 lambda r: f"{slack(r.bound_dispatch)}/{slack(r.bound_emit)}"),
    FigureColumn("p99 gap emit/client ms", "p99 e/c", "p99 inter-token gap per request, emit/client, ms",
                 lambda r: f"{ms(r.gaps_emit_request)}/{ms(r.gaps_client_request)}"),
    FigureColumn("tokens eng/client", "tokens", "tokens the engine emitted/the client received", tokens),
)

ROW_COLUMNS = ("scenario/phase", "engine", "user", *(c.title for c in FIGURE_COLUMNS), "result")


def figure_cells(row: UserPhaseSummary) -> list[str]:
    return [c.cell(row) for c in FIGURE_COLUMNS]


def row_cells(row: UserPhaseSummary) -> list[str]:
    """report.md's row: the names that identify it, its figures, pass or FAIL."""
    return [f"{row.scenario}/{row.phase}", row.engine, row.user, *figure_cells(row), "pass" if row.passed else "FAIL"]


def in_rounds(role: str) -> bool:
    """A phase of the overhead scenario's rounds: reports show its rows collapsed into the overhead
    table and its plots into one (verdict.json keeps every round)."""
    return role in OVERHEAD_ROLES


def ms_text(ms_value: float) -> str:
    """Milliseconds, short: whole from 100 ms, one decimal from 10 ms, two below."""
    if abs(ms_value) >= 100:
        return f"{ms_value:.0f}"
    return f"{ms_value:.1f}" if abs(ms_value) >= 10 else f"{ms_value:.2f}"


def quantiles_ms(g: GapStats | None, sep: str = "/") -> str:
    """p50/p90/p99 of a latency, in ms."""
    if g is None:
        return "-"
    return sep.join(ms_text(x / 1e6) for x in (g.p50_ns, g.p90_ns, g.p99_ns))


def overrides_text(user_tps: dict | None, names_up_to: int = 3) -> str:
    """An engine's per-user limits in a line: how many users, and each distinct limit with its count of
    users (``100 users: 5 (24), 15 (36), 100 (12)``); at most ``names_up_to`` users are named instead.
    The full map stays in verdict.json and manifest.json."""
    if not user_tps:
        return "-"
    n = len(user_tps)
    head = f"{n} user" + ("" if n == 1 else "s")
    if n <= names_up_to:
        return f"{head}: " + ", ".join(f"{u} {lim}" for u, lim in user_tps.items())
    counts: dict = {}
    for lim in user_tps.values():
        counts[lim] = counts.get(lim, 0) + 1
    limits = sorted(counts, key=lambda x: (not isinstance(x, (int, float)), x if isinstance(x, (int, float)) else 0))
    return f"{head}: " + ", ".join(f"{lim} ({counts[lim]})" for lim in limits)


# thresholds whose None means something in words
_THRESHOLD_NONE = {"max_overhead": "the profile's max_overhead, else report only", "max_event_overhead": "report only",
                   "emit_tolerance_ns": "the phase's longest engine step",
                   "trace_lateness_ns": "the scenario's lateness_ms, else 20 ms"}


def _duration(ns: float) -> str:
    if abs(ns) >= 10e9:
        return f"{ns / 1e9:g} s"
    if abs(ns) >= 1e6 or ns == 0:
        return f"{ns / 1e6:g} ms"
    return f"{ns / 1e3:g} us"


def threshold_items(th) -> list[tuple[str, str]]:
    """Each threshold as a person reads it: (name, value), durations with their unit (ms; s, us) and
    the ``_ns`` suffix dropped (``spacing_slack``, ``5 ms``)."""
    out = []
    for name in th.__dataclass_fields__:
        x = getattr(th, name)
        if x is None:
            text = _THRESHOLD_NONE.get(name, "-")
        elif name.endswith("_ns"):
            text = _duration(x)
        elif name.endswith("_ms"):
            text = f"{x:g} ms"
        elif isinstance(x, float):
            text = f"{x:g}"
        else:
            text = str(x)
        out.append((name.removesuffix("_ns").removesuffix("_ms"), text))
    return out


def plot_slug(scenario: str, phase: str, engine: str) -> str:
    """A phase's plot file name, without the folder and suffix."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{scenario}-{phase}-{engine}").strip("-")


def plot_file(scenario: str, phase: str, engine: str) -> str:
    """The run-folder path of a phase's plot (slack over time per limited user, gaps, streams).
    The overhead scenario's rounds share one plot (``group_plot_file``); one of its phases has
    its own only when a check of it failed."""
    return f"plots/{plot_slug(scenario, phase, engine)}.png"


def group_plot_file(scenario: str) -> str:
    """The run-folder path of the one plot of a scenario's rounds (the overhead scenario)."""
    return f"plots/{re.sub(r'[^A-Za-z0-9._-]+', '-', scenario).strip('-')}-rounds.png"


def check_where(c) -> str:
    where = f"{c.scenario}/{c.phase}@{c.engine}"
    return f"{where} {c.user}" if c.user else where
