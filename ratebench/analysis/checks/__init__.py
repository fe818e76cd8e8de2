"""Turning the run's figures into checks, each with its figure, threshold and one-line reason.

One module per promise (or per scenario whose checks guard several: the fleet's, the pressure
scenarios'), each registering its checks' meanings and the functions that make them
(:mod:`~ratebench.analysis.checks.base`). The package imports every module it holds: adding a check is
a module here (its figures from a measure module of ratebench/analysis; a threshold it needs is a
field of ``verdict.Thresholds``, declared with its option and help by ``verdict.threshold``)."""

from __future__ import annotations

import importlib
import pkgutil

from ratebench.analysis.checks.base import RowContext, registered_meanings, row_checks, run_checks
from ratebench.analysis.fleet import cut_by_failover
from ratebench.analysis.load import RunData
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.verdict import Check, Thresholds

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
    importlib.import_module(f"{__name__}.{_module}")


def build_checks(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    """Every registered check of the run, in their registered order."""
    checks: list[Check] = []
    for fn in run_checks(before_rows=True):
        checks.extend(fn(run, s, th))
    failover_cut = cut_by_failover(run)
    bindings: dict = {}
    rows = row_checks()
    for (p_index, user), row in sorted(s.rows.items(), key=lambda kv: kv[0]):
        c = RowContext(run, s, th, p_index, user, row, s.witness.get((p_index, user)), failover_cut, bindings)
        for fn in rows:
            checks.extend(fn(c))
    for fn in run_checks(before_rows=False):
        checks.extend(fn(run, s, th))
    return checks


__all__ = ["build_checks", "registered_meanings"]
