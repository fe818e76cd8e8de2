"""Two verdicts side by side: the same figures, matched by scenario phase and user, with ratios."""

from __future__ import annotations

from dataclasses import dataclass, field

from ratebench.analysis.verdict import UserPhaseSummary, Verdict


@dataclass
class CompareLine:
    where: str  # scenario/phase
    engine: str
    user: str
    figure: str
    a: float | None
    b: float | None

    @property
    def ratio(self) -> float | None:
        """B/A; None where a ratio means nothing (slack can be negative: compare the numbers)."""
        if self.a is None or self.b is None or self.a == 0 or "slack" in self.figure:
            return None
        return self.b / self.a

    def cells(self) -> list[str]:
        def f(x):
            if x is None:
                return "-"
            if isinstance(x, int):
                return str(x)
            return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"

        return [self.where, self.engine, self.user, self.figure, f(self.a), f(self.b),
                "-" if self.ratio is None else f"{self.ratio:.3f}"]


@dataclass
class Comparison:
    run_a: str
    run_b: str
    passed_a: bool
    passed_b: bool
    lines: list[CompareLine] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _row_figures(r: UserPhaseSummary) -> list[tuple[str, float | None]]:
    def rate(x, attr):
        return getattr(x, attr) if x is not None else None

    def p99_ms(g):
        return g.p99_ns / 1e6 if g is not None else None

    def slack(b):
        return b.worst.slack_tokens if b is not None and b.worst is not None else None

    return [
        ("limit tok/s", r.limit_tps),
        ("dispatch seed tok/s", rate(r.dispatch_rate, "seed_rate_tps")),
        ("dispatch steady tok/s", rate(r.dispatch_rate, "steady_rate_tps")),
        ("emit seed tok/s", rate(r.emit_rate, "seed_rate_tps")),
        ("client seed tok/s", rate(r.client_rate, "seed_rate_tps")),
        ("worst slack dispatch", slack(r.bound_dispatch)),
        ("worst slack emit", slack(r.bound_emit)),
        ("p99 gap emit ms", p99_ms(r.gaps_emit_request)),
        ("p99 gap client ms", p99_ms(r.gaps_client_request)),
        ("p50 first token client ms", r.ttft_client.p50_ns / 1e6 if r.ttft_client is not None else None),
        ("charges beyond allowance", r.charge_over_allowance if r.charge_requests else None),
        ("tokens streamed", r.streamed_tokens),
    ]


def _ms(ns: float | None) -> float | None:
    return None if ns is None else ns / 1e6


def compare_verdicts(a: Verdict, b: Verdict) -> Comparison:
    """Match rows by (scenario, phase, engine, user), else by (scenario, phase, user) when unique."""
    out = Comparison(a.run_dir, b.run_dir, a.passed, b.passed)
    exact_b = {(r.scenario, r.phase, r.engine, r.user): r for r in b.rows}
    loose_b: dict[tuple, list[UserPhaseSummary]] = {}
    for r in b.rows:
        loose_b.setdefault((r.scenario, r.phase, r.user), []).append(r)
    used = set()
    for ra in a.rows:
        rb = exact_b.get((ra.scenario, ra.phase, ra.engine, ra.user))
        if rb is None:
            cands = loose_b.get((ra.scenario, ra.phase, ra.user), [])
            rb = cands[0] if len(cands) == 1 else None
        if rb is None:
            out.notes.append(f"only in A: {ra.scenario}/{ra.phase}@{ra.engine} {ra.user}")
            continue
        used.add(id(rb))
        engine = ra.engine if ra.engine == rb.engine else f"{ra.engine} | {rb.engine}"
        for (name, va), (_, vb) in zip(_row_figures(ra), _row_figures(rb)):
            if va is None and vb is None:
                continue
            out.lines.append(CompareLine(f"{ra.scenario}/{ra.phase}", engine, ra.user, name, va, vb))
    for rb in b.rows:
        if id(rb) not in used:
            out.notes.append(f"only in B: {rb.scenario}/{rb.phase}@{rb.engine} {rb.user}")
    over_b = {o.scenario: o for o in b.overheads}
    for oa in a.overheads:
        ob = over_b.get(oa.scenario)
        for role, tput in oa.throughput_tps.items():
            out.lines.append(CompareLine(f"{oa.scenario}/{role}", "*", "*", "throughput tok/s", tput,
                                         ob.throughput_tps.get(role) if ob else None))
            if role in oa.step_p50_ns or (ob and role in ob.step_p50_ns):
                out.lines.append(CompareLine(f"{oa.scenario}/{role}", "*", "*", "engine step p50 ms",
                                             _ms(oa.step_p50_ns.get(role)), _ms(ob.step_p50_ns.get(role)) if ob else None))
        for pair, pa in oa.paired.items():
            pb = ob.paired.get(pair) if ob else None
            out.lines.append(CompareLine(f"{oa.scenario}/{pair}", "*", "*", "median round ratio", pa.median,
                                         pb.median if pb else None))
    for name, step in a.engine_steps.items():
        sb = b.engine_steps.get(name)
        if step.samples or (sb and sb.samples):
            out.lines.append(CompareLine("*", name, "*", "longest step ms", step.longest_ns / 1e6 if step.samples else None,
                                         sb.longest_ns / 1e6 if sb and sb.samples else None))
    out.lines.append(CompareLine("*", "*", "*", "failed checks", len(a.failures), len(b.failures)))
    return out
