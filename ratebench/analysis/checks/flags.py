"""The flags: malformed limiter flags are refused at start-up with a message that names the flag
(check flags-refused, from flags.json)."""

from __future__ import annotations

from ratebench.analysis.checks.base import CheckMeaning, meanings, per_run
from ratebench.analysis.load import RunData
from ratebench.analysis.prestart import flag_checks
from ratebench.analysis.summary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds

MEANINGS = meanings({
    "flags-refused": CheckMeaning("flags", "a malformed limiter flag was accepted, or refused without naming the "
                                  "flag, or valid flags did not reach the scheduler's config as given",
                                  "flags.json: each case, how it was refused (arguments or engine config) and the "
                                  "message"),
})


@per_run(30)
def flags_refused(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return flag_checks(run)
