"""Promise 7: with --default-user-output-tokens-per-second unset the feature is off and the scheduler
behaves as upstream, step by step (check feature-off-upstream, from feature-off.json)."""

from __future__ import annotations

from ratebench.analysis.checks.base import CheckMeaning, meanings, per_run
from ratebench.analysis.load import RunData
from ratebench.analysis.prestart import feature_off_checks
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds

MEANINGS = meanings({
    "feature-off-upstream": CheckMeaning("7", "with the limiter off, the installed scheduler did not schedule as "
                                         "upstream's on the same requests (another order, another request, "
                                         "another preemption), or could not be compared",
                                         "feature-off.json: each configuration's first differing step, both "
                                         "values"),
})


@per_run(20)
def feature_off_upstream(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return feature_off_checks(run)
