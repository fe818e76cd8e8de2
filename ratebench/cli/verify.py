"""`ratebench verify-bound` and `compare`: the verdict on run folders, from their files alone."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer

from ratebench import verify
from ratebench.analysis.thresholds import TABLE, from_options
from ratebench.analysis.compare import compare_verdicts
from ratebench.cli._console import fail, stderr
from ratebench.outputs.console import print_comparison, print_verdict
from ratebench.outputs.exporters import described
from ratebench.outputs.markdown import write_comparison


def verify_bound(run_dir: Path, *, plots: bool = True, max_plot_users: int = 8, partial: bool = False,
                 **threshold_options) -> None:
    """Re-check a run folder from its files alone; write verdict.json, report.md, report.html, plots/.

    Exit 0: every check passed; 1: a check failed; 2: the run folder is unusable (without
    --partial: the run did not complete); 4: --partial on a run that did not complete, and
    every check of its completed phases passed.
    """
    th = from_options(threshold_options)
    try:
        result = verify.analyse_run(run_dir, th, partial=partial)
    except verify.RunFolderError as exc:
        raise fail(str(exc), verify.EXIT_UNUSABLE, label="unusable run folder") from None
    written = verify.write_result(result, plots=plots, max_plot_users=max_plot_users)
    print_verdict(result.verdict)
    stderr().print(f"wrote {len(written)} files into {run_dir} ({described()})")
    raise typer.Exit(verify.exit_code(result.verdict))


def _threshold_parameter(t) -> inspect.Parameter:
    kind = t.type | None if t.optional else t.type
    return inspect.Parameter(t.param, inspect.Parameter.KEYWORD_ONLY, default=t.default,
                             annotation=Annotated[kind, typer.Option(t.option, help=t.help)])


# verify-bound's options: the run folder, one option per row of the thresholds table
# (ratebench/analysis/thresholds.py), then what to write.
_PARAMETERS = [
    inspect.Parameter("run_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[
        Path, typer.Argument(help="a run folder written by `ratebench run`")]),
    *(_threshold_parameter(t) for t in TABLE),
    inspect.Parameter("plots", inspect.Parameter.KEYWORD_ONLY, default=True, annotation=Annotated[
        bool, typer.Option("--plots/--no-plots", help="write plots/*.png")]),
    inspect.Parameter("max_plot_users", inspect.Parameter.KEYWORD_ONLY, default=8, annotation=Annotated[
        int, typer.Option("--max-plot-users", help="users per phase in the plots")]),
    inspect.Parameter("partial", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
        bool, typer.Option("--partial", help="a run that did not complete (interrupted, failed part way): check "
                           "the phases that completed, name the others; the verdict is marked PARTIAL and never "
                           "passes")]),
]
verify_bound.__signature__ = inspect.Signature(_PARAMETERS)
verify_bound.__annotations__ = {p.name: p.annotation for p in _PARAMETERS}


def compare(
    run_a: Annotated[Path, typer.Argument(help="run folder A (the reference)")],
    run_b: Annotated[Path, typer.Argument(help="run folder B (ratios are B/A)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="folder for compare.md")] = Path("."),
) -> None:
    """Put two runs' figures side by side with ratios B/A; writes OUT/compare.md.

    Exit 0 when both runs could be read (whatever their verdicts), 2 when one is unusable.
    """
    try:
        a = verify.analyse_run(run_a).verdict
        b = verify.analyse_run(run_b).verdict
    except verify.RunFolderError as exc:
        raise fail(str(exc), verify.EXIT_UNUSABLE, label="unusable run folder") from None
    comparison = compare_verdicts(a, b)
    print_comparison(comparison)
    path = write_comparison(comparison, out / "compare.md")
    stderr().print(f"wrote {path}")
