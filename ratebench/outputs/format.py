"""Number formatting shared by the console and markdown outputs."""

from __future__ import annotations

from ratebench.analysis.bound import BoundResult
from ratebench.analysis.gaps import GapStats
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
    if b is None or b.worst is None:
        return "-"
    return f"{b.worst.slack_tokens:+.2f}"


def ms(g: GapStats | None, field: str = "p99_ns") -> str:
    if g is None:
        return "-"
    return f"{getattr(g, field) / 1e6:.1f}"


def tokens(row: UserPhaseSummary) -> str:
    emitted = row.emit_rate.tokens if row.emit_rate else None
    if emitted is None:
        return str(row.streamed_tokens)
    return f"{emitted}/{row.streamed_tokens}"


ROW_COLUMNS = (
    "scenario/phase", "engine", "user", "limit", "dispatch seed/steady", "emit seed", "client seed",
    "slack dispatch/emit", "p99 gap emit/client ms", "tokens eng/client", "result",
)


def row_cells(row: UserPhaseSummary) -> list[str]:
    return [
        f"{row.scenario}/{row.phase}", row.engine, row.user, num(row.limit_tps),
        f"{seed_rate(row.dispatch_rate)}/{steady_rate(row.dispatch_rate) if row.backlogged else '-'}",
        seed_rate(row.emit_rate),
        seed_rate(row.client_rate), f"{slack(row.bound_dispatch)}/{slack(row.bound_emit)}",
        f"{ms(row.gaps_emit_request)}/{ms(row.gaps_client_request)}", tokens(row), "pass" if row.passed else "FAIL",
    ]


def check_where(c) -> str:
    where = f"{c.scenario}/{c.phase}@{c.engine}"
    return f"{where} {c.user}" if c.user else where
