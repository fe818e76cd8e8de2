"""The microbenchmark's statistics: spreads over rounds, per-round ratios to "off", targets.

:mod:`ratebench.profiling.microbench` measures; this module summarises; the tables
(:mod:`ratebench.profiling.tables`) present.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from ratebench.profiling.microbench import (
    VARIANT_LETTERS,
    VARIANT_OFF,
    MicrobenchSettings,
    VariantRounds,
    scheduler_source,
)

# A spread (IQR / median) above this makes a figure a warning, not a result.
LARGE_SPREAD = 0.10


@dataclass
class Spread:
    """Median, quartiles and range of a few repeated figures."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        if not values:
            raise ValueError("no values")
        xs = sorted(values)
        if len(xs) >= 2:
            q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        else:
            q1 = q3 = xs[0]
        return cls(statistics.median(xs), q1, q3, xs[0], xs[-1], len(xs))

    @property
    def relative_iqr(self) -> float:
        return (self.q3 - self.q1) / self.median if self.median else float("inf")


@dataclass
class VariantSummary:
    variant: str
    letter: str
    us_per_call: Spread  # over rounds, of each round's median call
    mean_us_per_call: Spread  # over rounds, of each round's mean call
    ratio_to_off: Spread | None  # per-round ratio to the same round's "off"
    state: dict[str, Any]


@dataclass
class MicrobenchReport:
    settings: dict[str, Any]
    rows: dict[int, dict[str, VariantSummary]]  # R -> variant -> summary
    warnings: list[str]
    targets: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "targets": self.targets,
            "warnings": self.warnings,
            "results": {str(r): {v: asdict(s) for v, s in row.items()} for r, row in self.rows.items()},
        }


# The targets for the patch (see docs/profile-scheduler.md): (b) at every R, (c) and (d) at R = 1024.
TARGETS = {
    "never-reached_max_ratio_every_r": 1.10,
    "throttled_max_ratio_at_r": {"r": 1024, "max_ratio": {"all-throttled": 1.10, "half-throttled": 1.20}},
}


def summarize_microbench(results: dict[int, dict[str, VariantRounds]],
                         settings: MicrobenchSettings) -> MicrobenchReport:
    """Spreads over rounds, per-round ratios to "off", and warnings on large spreads."""
    rows: dict[int, dict[str, VariantSummary]] = {}
    warnings: list[str] = []
    for r, by_variant in results.items():
        off = by_variant.get(VARIANT_OFF)
        row: dict[str, VariantSummary] = {}
        for variant, rounds in by_variant.items():
            ratio = None
            if off is not None:
                ratio = Spread.of([x / o for x, o in zip(rounds.round_median_us, off.round_median_us) if o > 0])
            summary = VariantSummary(variant, VARIANT_LETTERS[variant], Spread.of(rounds.round_median_us),
                                     Spread.of(rounds.round_mean_us), ratio, rounds.state)
            row[variant] = summary
            spread = ratio if ratio is not None and variant != VARIANT_OFF else summary.us_per_call
            what = "ratio to off" if spread is ratio else "us per call"
            if spread.relative_iqr > LARGE_SPREAD:
                warnings.append(
                    f"R={r} ({summary.letter}) {variant}: the {what} varies by {spread.relative_iqr:.0%} "
                    f"(IQR/median) between rounds; the machine was busy, take it as rough "
                    f"(more --rounds, a quieter machine)")
        rows[r] = row
    source = scheduler_source()
    if source.changed_on_disk():
        warnings.append(f"{source.path} changed on disk during the measurement (patch re-applied?): the figures "
                        f"are those of the text imported at the start (sha256 {source.sha256[:16]}); rerun")
    if settings.rounds < 5:
        warnings.append(f"only {settings.rounds} rounds: the spread is not meaningful below 5")
    return MicrobenchReport(settings=settings.to_json(), rows=rows, warnings=warnings, targets=TARGETS)


def target_verdicts(report: MicrobenchReport) -> list[str]:
    """One line per target: met or not, with the figure (informational, never an exit code)."""
    lines = []
    limit_b = TARGETS["never-reached_max_ratio_every_r"]
    for r, row in report.rows.items():
        b = row.get("never-reached")
        if b is not None and b.ratio_to_off is not None:
            ok = b.ratio_to_off.median <= limit_b
            lines.append(f"(b) at R={r}: {b.ratio_to_off.median:.2f}x off (spread {b.ratio_to_off.q1:.2f}.."
                         f"{b.ratio_to_off.q3:.2f}), target <= {limit_b:.2f}x: {'met' if ok else 'NOT met'}")
    t = TARGETS["throttled_max_ratio_at_r"]
    row = report.rows.get(t["r"])
    if row is not None:
        for variant, limit in t["max_ratio"].items():
            s = row.get(variant)
            if s is not None and s.ratio_to_off is not None:
                ok = s.ratio_to_off.median <= limit
                lines.append(f"({s.letter}) at R={t['r']}: {s.ratio_to_off.median:.2f}x off (spread "
                             f"{s.ratio_to_off.q1:.2f}..{s.ratio_to_off.q3:.2f}), target <= {limit:.2f}x: "
                             f"{'met' if ok else 'NOT met'}")
    return lines
