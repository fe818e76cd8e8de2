"""What a run's figures are kept in (:class:`RunSummary`, filled by :mod:`ratebench.analysis.summary`)
and what they are measured against (:class:`Measure`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ratebench.analysis.bound import BURST_NS
from ratebench.analysis.load import RunData
from ratebench.analysis.reconcile import RequestCheck
from ratebench.analysis.steps import EngineStep
from ratebench.analysis.verdict import EngineUserBound, OverheadSummary, UserPhaseSummary
from ratebench.analysis.waiting import WaitingSummary
from ratebench.analysis.witness import WitnessResult
from ratebench.events import ANONYMOUS_USER


@dataclass
class IdentityTally:
    """One user's requests in one phase (the user the client sent), against the user the engine charged."""

    requests: int = 0
    mismatches: list[str] = field(default_factory=list)  # "<client id>: sent as X, charged to Y"


@dataclass
class RunSummary:
    engine_steps: dict[str, EngineStep]
    rows: dict[tuple[int, str], UserPhaseSummary]  # (phase index, user)
    engine_bounds: list[EngineUserBound]
    request_checks: dict[tuple[int, str], list[RequestCheck]]
    overheads: list[OverheadSummary]
    warnings: list[str] = field(default_factory=list)
    # client record index -> the rate-limit user the engine charged (when it differs from what was sent)
    engine_user_of_record: dict[int, str] = field(default_factory=dict)
    stage_s: dict[str, float] = field(default_factory=dict)  # wall time of each part, for benchmarks
    # (phase index, user the client sent) -> the requests the engine charged, and those charged to another
    identity: dict[tuple[int, str], IdentityTally] = field(default_factory=dict)
    steps_per_phase: dict[int, int] = field(default_factory=dict)  # engine steps that sampled, per phase
    waiting: list[WaitingSummary] = field(default_factory=list)
    # (phase index, user) -> the client's records held against the engine's events (analysis/witness.py)
    witness: dict[tuple[int, str], WitnessResult] = field(default_factory=dict)
    # engine -> its steps' emit times and dispatch-to-emit latencies (steps.step_latencies), where measured
    step_latencies: dict[str, tuple] = field(default_factory=dict)

    def user_of(self, record_index: int, sent_user: str | None) -> str:
        return self.engine_user_of_record.get(record_index, client_user(sent_user))


def client_user(user: str | None) -> str:
    return ANONYMOUS_USER if user is None else user


@dataclass(frozen=True)
class Measure:
    """What the figures are measured against: the promise's burst (the bound's 100 ms) and how far
    windows on emit events are widened (None: the longest engine step measured in the phase). No threshold:
    the checks (:mod:`ratebench.analysis.checks`) judge the figures."""

    burst_ns: int = BURST_NS
    emit_tolerance_ns: int | None = None


def new_row(run: RunData, phase_index: int, user: str) -> UserPhaseSummary:
    """An empty row of one user in one phase, with the limit the engine's flags give it."""
    p = run.phases[phase_index]
    spec = p.users.get(user)
    limit = run.engines[p.engine].limit_of(user)
    if spec is not None and spec.limit_tps is not None and spec.limit_tps != limit:
        limit = spec.limit_tps if limit is None else limit
    return UserPhaseSummary(
        scenario=p.scenario, phase=p.phase, engine=p.engine, user=user, role=p.role, kind=p.kind,
        limit_tps=limit, streams=spec.streams if spec else 0, backlogged=bool(spec and spec.backlogged),
        requests=0, tier=spec.tier if spec else None,
    )


def row_of(run: RunData, summary: RunSummary, phase_index: int, user: str) -> UserPhaseSummary:
    """The row of this user in this phase, made empty if the summary has none yet."""
    key = (phase_index, user)
    if key not in summary.rows:
        summary.rows[key] = new_row(run, phase_index, user)
    return summary.rows[key]


def add_request_check(summary: RunSummary, phase_of: dict, i: int, r, chk: RequestCheck | None) -> None:
    """File one request's reconciliation under its phase and the user the engine charged."""
    if chk is None:
        return
    p_index = phase_of.get((r.scenario, r.phase, r.engine))
    if p_index is not None:
        summary.request_checks.setdefault((p_index, summary.user_of(i, r.user)), []).append(chk)
