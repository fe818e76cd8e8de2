"""The terminal: one table per scenario and engine (a row per phase and user), then each failure
with the promise it broke and where to look, then the rest.

The names that identify a row (phase, user; scenario and engine in the table's title) are never
cut: their columns keep their full width, and the figures, under short headers explained in a
legend, give way first.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ratebench.analysis.verdict import UserPhaseSummary, Verdict
from ratebench.outputs.format import FIGURE_COLUMNS, check_where, figure_cells
from ratebench.outputs.promises import failures_by_promise

MAX_FAILURES_SHOWN = 20  # the rest are in report.md


def default_console() -> Console:
    """A console that does not squeeze the table to 80 columns when output is piped."""
    c = Console()
    return c if c.is_terminal else Console(width=180)


def verdict_tables(verdict: Verdict) -> list[Table]:
    """One table per scenario and engine, in run order."""
    groups: dict[tuple[str, str], list[UserPhaseSummary]] = {}
    for row in verdict.rows:
        groups.setdefault((row.scenario, row.engine), []).append(row)
    return [_table(scenario, engine, rows) for (scenario, engine), rows in groups.items()]


def _table(scenario: str, engine: str, rows: list[UserPhaseSummary]) -> Table:
    table = Table(title=f"[bold]{escape(scenario)}[/] on [bold]{escape(engine)}[/]", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for name, values in (("phase", [r.phase for r in rows]), ("user", [r.user for r in rows])):
        # never cut nor wrapped: the name identifies the row
        table.add_column(name, no_wrap=True, min_width=max(len(name), *map(len, values)))
    for col in FIGURE_COLUMNS:
        table.add_column(col.short, justify="right", overflow="fold")
    table.add_column("result", no_wrap=True)
    for row in rows:
        table.add_row(escape(row.phase), escape(row.user), *figure_cells(row),
                      "[green]pass[/]" if row.passed else "[bold red]FAIL[/]")
    return table


def legend() -> str:
    """The short column headers, explained (rates in tok/s; seed: the seed article's method)."""
    return "rates in tok/s, seed = tokens / (last - first token); " + "; ".join(
        f"{c.short}: {c.legend}" for c in FIGURE_COLUMNS)


def print_verdict(verdict: Verdict, console: Console | None = None) -> None:
    console = console or default_console()
    head = f"[bold]ratebench verify-bound[/] {escape(verdict.run_dir)}"
    if verdict.partial:
        n = len({(r.scenario, r.phase, r.engine) for r in verdict.rows})
        head += (f"  [bold yellow]PARTIAL[/]: the run did not complete; {n} completed phases checked, "
                 f"{len(verdict.missing_phases)} missing (listed below)")
    console.print(head)
    for table in verdict_tables(verdict):
        console.print()
        console.print(table)
    _print_failures(verdict, console)
    if verdict.missing_phases:
        console.print(f"[bold yellow]PARTIAL[/]: {len(verdict.missing_phases)} phases not checked:")
        for m in verdict.missing_phases:
            console.print(f"  {escape(m.label)}: {escape(m.why)}")
    console.print(f"[dim]{escape(legend())}[/]")
    for name, step in verdict.engine_steps.items():
        longest = f"{step.longest_ns / 1e6:.2f} ms" if step.samples else "n/a"
        console.print(f"engine {name}: longest step (dispatch-to-emit) {longest} ({step.method})")
    for o in verdict.overheads:
        for pair, p in o.paired.items():
            console.print(f"{o.scenario} {pair}: throughput ratio, median per round {p.median:.3f} "
                          f"(spread {p.min:.3f}..{p.max:.3f} over {p.rounds} rounds), pooled {o.ratios[pair]:.3f}")
    for w in verdict.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    console.print(_outcome_line(verdict))


def _print_failures(verdict: Verdict, console: Console) -> None:
    """Each failed check under the promise it tests: what broke, the check's figures, where to look."""
    shown = 0
    for promise, hints in failures_by_promise(verdict):
        console.print(f"[bold red]broken[/] {escape(promise)}")
        for h in hints:
            if shown == MAX_FAILURES_SHOWN:
                break
            shown += 1
            c = h.check
            console.print(f"  [bold red]FAIL[/] [bold]{c.name}[/] {escape(check_where(c))}: {escape(h.broke)}")
            console.print(f"    {escape(c.explanation)}", style="dim")
            console.print(f"    look: {escape(h.look)}")
    if len(verdict.failures) > shown:
        console.print(f"[bold red]... and {len(verdict.failures) - shown} more failures[/] in "
                      f"{escape(verdict.run_dir)}/report.md")


def _outcome_line(verdict: Verdict) -> str:
    n_info = sum(c.passed is None for c in verdict.checks)
    n_fail = len(verdict.failures)
    n_pass = len(verdict.checks) - n_fail - n_info
    if n_fail:
        word = "[bold red]FAIL (PARTIAL)[/]" if verdict.partial else "[bold red]FAIL[/]"
        return f"{word}: {n_fail} of {n_pass + n_fail} checks failed ({n_info} informational)"
    if verdict.partial:
        return (f"[bold yellow]PARTIAL[/]: every check of the completed phases passed ({n_pass} checks, "
                f"{n_info} informational); {len(verdict.missing_phases)} phases not checked: not a pass")
    return f"[bold green]PASS[/]: {n_pass} checks passed ({n_info} informational)"


def print_comparison(comparison, console: Console | None = None) -> None:
    console = console or default_console()
    table = Table(title=f"ratebench compare: A={comparison.run_a}  B={comparison.run_b}")
    for col in ("scenario/phase", "engine", "user", "figure", "A", "B", "B/A"):
        table.add_column(col, justify="left" if col in ("scenario/phase", "engine", "user", "figure") else "right")
    for line in comparison.lines:
        table.add_row(*line.cells())
    console.print(table)
    for note in comparison.notes:
        console.print(f"[yellow]note:[/] {note}")
