"""Analysis of a run: the bound, rates, gaps, reconciliation, isolation, overhead, fairness.

Every function here takes plain numpy arrays or dataclasses and does no I/O
(except ``load_run``), so tests can call them directly on any trace.
"""

from ratebench.analysis.bound import (
    BURST_NS,
    NS_PER_S,
    BoundResult,
    WorstWindow,
    check_bound,
    check_bound_grouped,
)

__all__ = [
    "BURST_NS",
    "NS_PER_S",
    "BoundResult",
    "WorstWindow",
    "check_bound",
    "check_bound_grouped",
]
