"""The terminal: one rich table row per user and scenario phase, failures in one line each."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ratebench.analysis.verdict import Verdict
from ratebench.outputs.format import ROW_COLUMNS, check_where, row_cells


def default_console() -> Console:
    """A console that does not squeeze the table to 80 columns when output is piped."""
    c = Console()
    return c if c.is_terminal else Console(width=180)


def print_verdict(verdict: Verdict, console: Console | None = None) -> None:
    console = console or default_console()
    table = Table(title=f"ratebench verify-bound: {verdict.run_dir}", show_lines=False)
    for col in ROW_COLUMNS:
        table.add_column(col, justify="left" if col in ("scenario/phase", "engine", "user") else "right")
    for row in verdict.rows:
        cells = row_cells(row)
        cells[-1] = "[green]pass[/]" if row.passed else "[bold red]FAIL[/]"
        table.add_row(*cells)
    console.print(table)
    for name, step in verdict.engine_steps.items():
        longest = f"{step.longest_ns / 1e6:.2f} ms" if step.samples else "n/a"
        console.print(f"engine {name}: longest step (dispatch-to-emit) {longest} ({step.method})")
    for o in verdict.overheads:
        for pair, p in o.paired.items():
            console.print(f"{o.scenario} {pair}: throughput ratio, median per round {p.median:.3f} "
                          f"(spread {p.min:.3f}..{p.max:.3f} over {p.rounds} rounds), pooled {o.ratios[pair]:.3f}")
    for w in verdict.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    for c in verdict.failures:
        console.print(f"[bold red]FAIL[/] {c.name} {check_where(c)}: {c.explanation}")
    n_info = sum(c.passed is None for c in verdict.checks)
    n_fail = len(verdict.failures)
    n_pass = len(verdict.checks) - n_fail - n_info
    if verdict.passed:
        console.print(f"[bold green]PASS[/]: {n_pass} checks passed ({n_info} informational)")
    else:
        console.print(f"[bold red]FAIL[/]: {n_fail} of {n_pass + n_fail} checks failed ({n_info} informational)")


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
