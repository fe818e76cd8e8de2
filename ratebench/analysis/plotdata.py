"""What a phase's plot draws, computed here so that ``outputs/plots.py`` only draws: each chosen
user's time series (``series.py``) and, for each limited user, its slack on both sides of its promise
(``slack.py``), with the parameters its checks used. The plots choose which users a phase shows (a
presentation matter); the figures come from here."""

from __future__ import annotations

from dataclasses import dataclass, field

from ratebench.analysis.load import RunData
from ratebench.analysis.series import UserSeries, phase_series
from ratebench.analysis.slack import UserSlack, engine_phase_steps, user_slack
from ratebench.analysis.verdict import UserPhaseSummary


@dataclass
class PhaseFigures:
    """One phase's plot: the users it shows and their series and slack."""

    phase_index: int
    label: str
    limited: list[UserPhaseSummary]  # users with a limit, whose slack is drawn
    others: list[UserPhaseSummary]  # users without one: their gaps only
    tiered: bool  # drawn one chart per tier
    series: dict[str, UserSeries] = field(default_factory=dict)
    slack: dict[str, UserSlack] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """No event and no chunk of any chosen user in the phase: nothing to draw."""
        return not any(len(s.dispatch_t_ns) or len(s.emit_t_ns) or len(s.client_t_ns) for s in self.series.values())


def phase_figures(run: RunData, chosen: list[PhaseFigures], spacing_slack_ns: int) -> list[PhaseFigures]:
    """Fill each chosen phase's series and slack (one pass over a phase's events for its users, one
    pass over an engine's steps for all its phases); the phases with nothing to draw are left out."""
    steps: dict[str, dict[int, tuple]] = {}
    out: list[PhaseFigures] = []
    for f in chosen:
        p = run.phases[f.phase_index]
        f.series = phase_series(run, f.phase_index, [r.user for r in f.limited + f.others])
        if f.empty:
            continue
        if f.limited and p.engine not in steps:
            steps[p.engine] = engine_phase_steps(run, p.engine)
        f.slack = {r.user: user_slack(r, f.series[r.user], steps[p.engine].get(f.phase_index), spacing_slack_ns)
                   for r in f.limited}
        out.append(f)
    return out
