"""What the check modules share. A check module (one per promise, or per scenario whose checks guard
several) registers what each of its checks stands for (:func:`meanings`: the promise its failure is
shown under, what the failure means, where to look) and the functions that make its checks: once per
(phase, user) row of the summary (:func:`per_row`) or once per run (:func:`per_run`). The order
numbers fix where each function's checks stand in the verdict: runs' below 0 first, then every row's
in order, then runs' from 0 up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ratebench.analysis.bound import BoundResult
from ratebench.analysis.isolation import Binding, phase_binding
from ratebench.analysis.load import RunData
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds, UserPhaseSummary
from ratebench.analysis.witness import WitnessResult

WHOLE = "*"

# where-to-look texts: {plot} is the phase's plot, {events} the engine's event file
UPPER = "{plot}, the user's panel: red, slack under the bound over time, its tightest window shaded"
LOWER = "{plot}, the user's panel: blue, the margin above even spacing over time, its emptiest window shaded"
REPORT_ROW = "report.md, the row of {where}"
ISOLATION_LOOK = ("verdict.json, checks: the isolation-* checks of {where} (every quantile, both phases' figures); "
                   "{plot}, the gaps panel, against the baseline phase's plot")


@dataclass(frozen=True)
class CheckMeaning:
    promise: str  # a key of PROMISES: the one its failure is shown under
    broke: str  # what a failure of this check means, in words
    look: str  # where to look, a template (see above)
    also: tuple[str, ...] = ()  # other promises (keys of PROMISES) the check guards


_MEANINGS: dict[str, CheckMeaning] = {}
RowCheck = Callable[["RowContext"], list[Check]]
RunCheck = Callable[[RunData, RunSummary, Thresholds], list[Check]]
_ROW: dict[int, RowCheck] = {}
_RUN: dict[int, RunCheck] = {}


def meanings(table: dict[str, CheckMeaning]) -> dict[str, CheckMeaning]:
    """Register what each check of a module stands for (a check name is registered once)."""
    for name in table:
        if name in _MEANINGS:
            raise ValueError(f"check {name!r} is registered twice")
    _MEANINGS.update(table)
    return table


def registered_meanings() -> dict[str, CheckMeaning]:
    return dict(_MEANINGS)


def _register(table: dict, order: int, fn: Callable) -> Callable:
    if order in table:
        raise ValueError(f"check order {order} is taken by {table[order].__module__}.{table[order].__name__}")
    table[order] = fn
    return fn


def per_row(order: int) -> Callable[[RowCheck], RowCheck]:
    """Register a function that makes checks of one (phase, user) row."""
    return lambda fn: _register(_ROW, order, fn)


def per_run(order: int) -> Callable[[RunCheck], RunCheck]:
    """Register a function that makes checks of the whole run."""
    return lambda fn: _register(_RUN, order, fn)


def row_checks() -> list[RowCheck]:
    return [_ROW[k] for k in sorted(_ROW)]


def run_checks(before_rows: bool) -> list[RunCheck]:
    return [_RUN[k] for k in sorted(_RUN) if (k < 0) == before_rows]


@dataclass
class RowContext:
    """One (phase, user) row of the summary, with what the row checks share."""

    run: RunData
    s: RunSummary
    th: Thresholds
    p_index: int
    user: str
    row: UserPhaseSummary
    witness: WitnessResult | None
    failover_cut: set = field(default_factory=set)  # client ids a fleet's failover cut short on purpose
    bindings: dict = field(default_factory=dict)  # phase index -> whose limit bound in it, made once a phase

    @property
    def ids(self) -> tuple:
        return (self.row.scenario, self.row.phase, self.row.engine, self.user)

    def binding(self) -> Binding:
        """Whose limit bound in the row's phase (isolation.phase_binding), made once per phase."""
        if self.p_index not in self.bindings:
            self.bindings[self.p_index] = phase_binding(self.run, self.run.phases[self.p_index])
        return self.bindings[self.p_index]


def bound_check(name: str, scen: str, phase: str, engine: str, user: str, b: BoundResult, what: str,
                 informational: bool = False, tolerance_text: str | None = None) -> Check:
    w = b.worst
    tol = f" + step {b.tolerance_ns / 1e6:.1f} ms" if b.tolerance_ns else ""
    if tolerance_text is not None:
        tol = tolerance_text
    if w is None:
        return Check(name, scen, phase, engine, user, None, 0, ">=", "tokens", None if informational else True,
                     f"no {what}")
    text = (
        f"worst window {w.window_s:.3f} s on {what}: {w.tokens} tokens, allowed "
        f"(W + {b.burst_ns / 1e9:g}{tol}) * {b.limit_tps} + 1 = {w.allowed_tokens:.2f}, slack {w.slack_tokens:+.3f}"
    )
    return Check(name, scen, phase, engine, user, round(w.slack_tokens, 9), 0, ">=", "tokens",
                 None if informational else b.passed, text)
