"""A replayed trace reached the engine as the trace says: each request sent on time (check
trace-lateness; the run's instrument, not a promise of the limiter)."""

from __future__ import annotations

from ratebench.analysis.checks.base import CheckMeaning, meanings, per_run
from ratebench.analysis.lateness import lateness_checks
from ratebench.analysis.load import RunData
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds

MEANINGS = meanings({
    "trace-lateness": CheckMeaning("replay", "the driver sent the trace's requests later than the stated lateness: "
                                   "the run did not replay the trace faithfully (a busy machine, too many requests "
                                   "at once)", "requests.jsonl: sent_ns - scheduled_ns of the phase's requests; "
                                   "scenarios.json machine_cpu"),
})


@per_run(110)
def trace_lateness(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return lateness_checks(run, th)
