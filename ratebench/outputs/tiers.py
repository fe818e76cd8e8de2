"""Many users in one phase, read by tier: for a ``mix`` phase (or any phase of more users than a
table stays readable with), each tier's users in one line with the worst user of each check.

A user's tier is the one its mix recorded (``scenarios.json`` ``users[u].tier``); a user without
one (a trace's users, a mix's anonymous requests) is grouped with the users at its limit. The
terminal and report.md show these lines, then the failing users' own rows; verdict.json keeps every
row. Beside them, the latency of each tier (``analysis/tierlatency.py``) on the phase and on its
baseline, as ``vllm bench serve`` reports a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ratebench.analysis.tierlatency import ServeFigures, TierLatency
from ratebench.analysis.verdict import Check, UserPhaseSummary, Verdict
from ratebench.outputs.format import num, quantiles_ms
from ratebench.profiles import ANONYMOUS_USER

MAX_USER_ROWS = 12  # a phase of more users than this is shown by tier in the terminal
BY_TIER_KINDS = ("mix",)  # kinds whose phases are always shown by tier


@dataclass
class WorstUser:
    """The user of a tier furthest from (or past) a check's threshold."""

    check: str
    user: str
    figure: float | int
    threshold: float | int | None
    op: str
    unit: str
    failed: int  # users of the tier that failed this check
    checked: int  # users of the tier this check judged


@dataclass
class TierLine:
    """One tier of one phase: its users, their totals, the worst user of each check."""

    scenario: str
    phase: str
    engine: str
    tier: str
    users: list[str]
    limits_tps: list[int | None]  # the distinct limits of its users
    requests: int
    streamed_tokens: int
    failed_users: list[str]
    worst: dict[str, WorstUser] = field(default_factory=dict)  # check name -> worst user, in check order

    @property
    def passed(self) -> bool:
        return not self.failed_users

    @property
    def limits_text(self) -> str:
        """Its users' limits, ``20`` or ``20/50`` (``off``: the limiter off)."""
        return "/".join("off" if n is None else str(n) for n in self.limits_tps)


def tier_of(row: UserPhaseSummary) -> str:
    """The tier a row is read under: its mix tier, else its limit (``at N tok/s``, ``limiter off``)."""
    if row.tier is not None:
        return row.tier
    if row.user == ANONYMOUS_USER:
        return ANONYMOUS_USER
    return f"at {row.limit_tps} tok/s" if row.limit_tps else "limiter off"


def by_tier(rows: list[UserPhaseSummary]) -> bool:
    """Whether one phase's rows are shown by tier in the terminal."""
    return any(r.kind in BY_TIER_KINDS for r in rows) or len({r.user for r in rows}) > MAX_USER_ROWS


def phases_by_tier(rows: list[UserPhaseSummary]) -> dict[tuple[str, str, str], list[UserPhaseSummary]]:
    """The rows of each phase shown by tier, by (scenario, phase, engine), in run order."""
    phases: dict[tuple[str, str, str], list[UserPhaseSummary]] = {}
    for r in rows:
        phases.setdefault((r.scenario, r.phase, r.engine), []).append(r)
    return {key: members for key, members in phases.items() if by_tier(members)}


def figure_text(x: float | int) -> str:
    """A check's figure, short: an integer as it is, two decimals below 100."""
    if isinstance(x, int):
        return str(x)
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.2f}"


def _margin(c: Check) -> float:
    """How far a figure is on the good side of its threshold (negative: past it)."""
    return c.figure - c.threshold if c.op == ">=" else c.threshold - c.figure


def tier_lines(verdict: Verdict, rows: list[UserPhaseSummary]) -> list[TierLine]:
    """The tiers of one phase's rows, in the order their first users come (anonymous requests and users
    without a limit last)."""
    if not rows:
        return []
    key = (rows[0].scenario, rows[0].phase, rows[0].engine)
    tiers: dict[str, list[UserPhaseSummary]] = {}
    for r in rows:
        tiers.setdefault(tier_of(r), []).append(r)
    checks: dict[str, list[Check]] = {}
    for c in verdict.checks:
        # checks with a figure beside a threshold; information-only ones (bound-client) stay in report.md
        if (c.scenario, c.phase, c.engine) == key and c.user is not None and c.op in (">=", "<=") \
                and c.figure is not None and c.threshold is not None and c.passed is not None:
            checks.setdefault(c.user, []).append(c)
    out = []
    last = [t for t in (ANONYMOUS_USER, "limiter off") if t in tiers]  # after the tiers of limited users
    for tier, members in [*((t, m) for t, m in tiers.items() if t not in last), *((t, tiers[t]) for t in last)]:
        line = TierLine(*key, tier=tier, users=[r.user for r in members],
                        limits_tps=sorted({r.limit_tps for r in members}, key=lambda x: (x is None, x or 0)),
                        requests=sum(r.requests for r in members),
                        streamed_tokens=sum(r.streamed_tokens for r in members),
                        failed_users=[r.user for r in members if not r.passed])
        judged: dict[str, list[Check]] = {}
        for r in members:
            for c in checks.get(r.user, []):
                judged.setdefault(c.name, []).append(c)
        for name, cs in judged.items():
            worst = min(cs, key=lambda c: (c.passed is not False, _margin(c)))
            line.worst[name] = WorstUser(name, worst.user, worst.figure, worst.threshold, worst.op, worst.unit,
                                         failed=sum(c.passed is False for c in cs), checked=len(cs))
        out.append(line)
    return out


# the latency table's figures, as `vllm bench serve` prints them (ms at p50/p90/p99)
LATENCY_HEADER = ("requests", "output tokens", "tok/s", "TTFT ms p50/p90/p99", "TPOT ms p50/p90/p99",
                  "ITL ms p50/p90/p99", "E2EL ms p50/p90/p99")
LATENCY_SHORT = ("requests", "tokens", "tok/s", "TTFT", "TPOT", "ITL", "E2EL")  # the terminal's headers
LATENCY_INTRO = (
    "Each phase of many users (a `mix`) by tier, beside its baseline (the same requests on the limiter-off "
    "engine), with the figures `vllm bench serve` prints: requests sent, output tokens, throughput (output "
    "tokens over the tier's first request sent to its last token, tok/s), and in ms at p50/p90/p99 (linear "
    "interpolation): **TTFT** (first token - sent, per request), **TPOT** ((last token - first token) / "
    "(tokens - 1), per request of 2 tokens or more), **ITL** (between consecutive chunks of one request, "
    "pooled) and **E2EL** (last token - sent, answers that ended by themselves). On the client's chunks (the "
    "engine's emit events where the client recorded none). Figures only: the isolation checks judge the "
    "tiers whose limits did not bind. verdict.json (`tier_latency`) has each tier's users and sample counts.")


def serve_cells(f: ServeFigures | None, sep: str = "/") -> list[str]:
    """One tier's figures in one phase (``LATENCY_HEADER``'s order); ``sep`` between p50, p90 and p99."""
    if f is None:
        return ["0", "0", "-", "-", "-", "-", "-"]
    return [str(f.requests), str(f.output_tokens), num(f.throughput_tps),
            *(quantiles_ms(getattr(f, k), sep) for k in ("ttft", "tpot", "itl", "e2el"))]


@dataclass
class LatencyRow:
    """One row of the latency table: a tier in the limiter-on phase or in its baseline."""

    line: TierLatency
    baseline: bool

    @property
    def phase(self) -> str:
        return (self.line.baseline_phase if self.baseline else self.line.phase) or "-"

    @property
    def engine(self) -> str:
        return (self.line.baseline_engine if self.baseline else self.line.engine) or "-"

    @property
    def limits_text(self) -> str:
        """``off`` on the baseline (the limiter-off engine), else the tier's limits (``20``, ``20/50``)."""
        if self.baseline:
            return "off"
        return "/".join("off" if n is None else str(n) for n in self.line.limits_tps) or "-"

    def cells(self, sep: str = "/") -> list[str]:
        return serve_cells(self.line.baseline if self.baseline else self.line.on, sep)


def latency_tables(verdict: Verdict) -> dict[tuple[str, str, str], list[LatencyRow]]:
    """The latency rows of each many-user phase, by (scenario, phase, engine) of its limiter-on phase:
    for each tier, the phase then its baseline (when it has one)."""
    out: dict[tuple[str, str, str], list[LatencyRow]] = {}
    for line in verdict.tier_latency:
        rows = out.setdefault((line.scenario, line.phase, line.engine), [])
        rows.append(LatencyRow(line, False))
        if line.baseline_phase is not None:
            rows.append(LatencyRow(line, True))
    return out
