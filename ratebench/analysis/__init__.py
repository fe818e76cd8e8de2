"""Analysis of a run: the bound, rates, gaps, reconciliation, isolation, overhead, fairness.

Every function here takes plain numpy arrays or dataclasses and does no I/O
(except ``load_run``), so tests can call them directly on any trace, e.g. the
dispatch times of one user from a real scheduler::

    from ratebench.analysis import check_bound
    result = check_bound(t_ns, limit_tps=20)          # exact, O(n)
    assert result.passed, result.worst
"""

from ratebench.analysis.bound import (
    BURST_NS,
    NS_PER_S,
    BoundResult,
    WorstWindow,
    check_bound,
    check_bound_grouped,
)
from ratebench.analysis.compare import Comparison, compare_verdicts
from ratebench.analysis.fairness import jain_index, stream_spread
from ratebench.analysis.gaps import GapStats, gap_stats, gaps_merged, gaps_per_request
from ratebench.analysis.load import RunData, RunFolderError, load_run
from ratebench.analysis.overhead import paired_ratio
from ratebench.analysis.rates import RateFigures, burst_tokens, rate_figures
from ratebench.analysis.reconcile import (
    EngineRequestView,
    RequestCheck,
    engine_request_totals,
    reconcile_request,
)
from ratebench.analysis.steps import EngineStep, estimate_engine_step
from ratebench.analysis.verdict import (
    Check,
    EngineUserBound,
    OverheadSummary,
    PairedRatio,
    Thresholds,
    UserPhaseSummary,
    Verdict,
)


def delivery_ratio(t_ns, limit_tps: int, counts=None, burst_ns: int = BURST_NS) -> float | None:
    """A backlogged user's steady rate over its limit (see ``rate_figures``); None if not measurable."""
    r = rate_figures(t_ns, counts, limit_tps, burst_ns)
    return None if r.steady_rate_tps is None else r.steady_rate_tps / limit_tps


__all__ = [
    "BURST_NS", "NS_PER_S", "BoundResult", "WorstWindow", "check_bound", "check_bound_grouped",
    "Comparison", "compare_verdicts", "jain_index", "stream_spread", "GapStats", "gap_stats", "gaps_merged",
    "gaps_per_request", "RunData", "RunFolderError", "load_run", "RateFigures", "burst_tokens", "rate_figures",
    "delivery_ratio", "EngineRequestView", "RequestCheck", "engine_request_totals", "reconcile_request",
    "EngineStep", "estimate_engine_step", "Check", "EngineUserBound", "OverheadSummary", "PairedRatio",
    "paired_ratio", "Thresholds",
    "UserPhaseSummary", "Verdict",
]
