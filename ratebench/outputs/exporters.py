"""Every file a verdict is written to, through one interface: an :class:`Exporter` names what it writes
and writes it into the run folder. verify-bound and ``ratebench run`` write them all in this order
(the plots first: the reports link them) and name them from this table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ratebench.analysis.load import RunData
from ratebench.analysis.verdict import Verdict


@dataclass(frozen=True)
class Output:
    """What the exporters are given: the verdict, the run it judged, where to write, and the plots
    written so far (the reports link them)."""

    verdict: Verdict
    run: RunData
    run_dir: Path
    plot_paths: list[Path]
    max_plot_users: int = 8


@dataclass(frozen=True)
class Exporter:
    name: str  # what it writes, as a person reads it
    write: Callable[[Output], list[Path]]
    plots: bool = False  # left out when plots are not wanted


def _plots(out: Output) -> list[Path]:
    from ratebench.analysis.plotdata import phase_figures
    from ratebench.outputs import plots

    # the plots choose what each phase shows; the analysis computes it; the plots draw it
    chosen = plots.choose(out.run, out.verdict, out.max_plot_users)
    figures = phase_figures(out.run, chosen, out.verdict.thresholds.spacing_slack_ns)
    return plots.write_plots(out.run, figures, out.verdict.overheads, out.run_dir / "plots",
                             max_users=out.max_plot_users)


def _json(out: Output) -> list[Path]:
    from ratebench.outputs import json

    return [json.write_verdict(out.verdict, out.run_dir / "verdict.json")]


def _markdown(out: Output) -> list[Path]:
    from ratebench.outputs import markdown

    return [markdown.write_report(out.verdict, out.run_dir / "report.md", out.plot_paths)]


def _html(out: Output) -> list[Path]:
    from ratebench.outputs import html

    return [html.write_report(out.verdict, out.run_dir / "report.html", out.plot_paths)]


EXPORTERS: tuple[Exporter, ...] = (
    Exporter("plots/", _plots, plots=True),
    Exporter("verdict.json", _json),
    Exporter("report.md", _markdown),
    Exporter("report.html", _html),
)


def described() -> str:
    """The files a verdict is written to, for a person: ``verdict.json, report.md, report.html, plots/``."""
    return ", ".join([e.name for e in EXPORTERS if not e.plots] + [e.name for e in EXPORTERS if e.plots])


def write_all(verdict: Verdict, run: RunData, run_dir: Path, *, plots: bool = True, max_plot_users: int = 8,
              stage_s: dict[str, float] | None = None) -> list[Path]:
    """Every exporter's files (the plots only with ``plots``); ``stage_s`` gets the seconds the plots
    and the other files took (``plots``, ``write``)."""
    import time

    written: list[Path] = []
    plot_paths: list[Path] = []
    seconds = {"plots": 0.0, "write": 0.0}
    for e in EXPORTERS:
        if e.plots and not plots:
            continue
        t0 = time.perf_counter()
        paths = e.write(Output(verdict, run, run_dir, plot_paths, max_plot_users))
        seconds["plots" if e.plots else "write"] += time.perf_counter() - t0
        if e.plots:
            plot_paths = paths
        written += paths
    if stage_s is not None:
        stage_s.update(seconds)
    return written
