"""The terminal: first the verdict's headline (the outcome, the broken promises, the promises the
run exercised and not), then one table per scenario and engine (a row per phase and user), then each failure
with the promise it broke and where to look, then the rest. A phase of many users (a ``mix``, see
``outputs/tiers.py``) is shown by tier: a line per tier with the worst user of each check, then
only its failing users' rows; after a scenario's tables, each such phase's latency by tier beside
its baseline phase, as ``vllm bench serve`` prints a run.

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
from ratebench.outputs.format import FIGURE_COLUMNS, check_where, figure_cells, threshold_items
from ratebench.outputs.promises import (
    PromiseCoverage,
    failures_by_promise,
    headline,
    promise_clause,
    promise_coverage,
)
from ratebench.outputs.tiers import (
    LATENCY_SHORT,
    LatencyRow,
    TierLine,
    WorstUser,
    figure_text,
    latency_tables,
    phases_by_tier,
    tier_lines,
)

MAX_FAILURES_SHOWN = 20  # the rest are in report.md


def default_console() -> Console:
    """A console that does not squeeze the table to 80 columns when output is piped."""
    c = Console()
    return c if c.is_terminal else Console(width=180)


def verdict_tables(verdict: Verdict, width: int | None = None) -> list[Table]:
    """One table per scenario and engine, in run order; its phases of many users by tier first
    (a table of tiers, split to fit ``width`` columns), then the rows of the other phases and of
    those phases' failing users; after a scenario's last engine, the latency by tier of its phases
    of many users beside their baselines."""
    groups: dict[tuple[str, str], list[UserPhaseSummary]] = {}
    for row in verdict.rows:
        groups.setdefault((row.scenario, row.engine), []).append(row)
    latency = latency_tables(verdict)
    last_group = {key[0]: key for key in groups}  # each scenario's last engine
    tables = []
    for (scenario, engine), rows in groups.items():
        by_tier = phases_by_tier(rows)
        tiered = {phase for _, phase, _ in by_tier}
        if by_tier:
            lines = [line for members in by_tier.values() for line in tier_lines(verdict, members)]
            tables.extend(_tier_tables(scenario, engine, lines, width))
        shown = [r for r in rows if r.phase not in tiered or not r.passed]
        if shown:
            failing_only = all(r.phase in tiered for r in shown)
            tables.append(_table(scenario, engine, shown, "failing users" if failing_only else None))
        if last_group[scenario] == (scenario, engine):
            tables.extend(_latency_table(rows_, width) for key, rows_ in latency.items() if key[0] == scenario)
    return tables


def _latency_table(rows: list[LatencyRow], width: int | None) -> Table:
    """A many-user phase's tiers, each on the phase then on its baseline (ms at p50/p90/p99, in a line
    where the table fits ``width`` columns, else one over the other)."""
    line = rows[0].line
    base = f" beside {escape(line.baseline_phase)}@{escape(line.baseline_engine)}" if line.baseline_phase else ""
    names = [[r.line.tier, r.phase, r.limits_text] for r in rows]

    def widths(headers, sep: str) -> list[int]:
        cells = [n + r.cells(sep) for n, r in zip(names, rows)]
        return [max(len(h), *(len(x) for c in col for x in c.split("\n"))) for h, *col in zip(headers, *cells)]

    headers = ("tier", "phase", "N", *LATENCY_SHORT)
    sep = "/"
    if width is not None and sum(w + 2 for w in widths(headers, sep)) > width:
        sep, headers = "\n", ("tier", "phase", "N", "reqs", *LATENCY_SHORT[1:])  # p50 over p90 over p99
    how = "p50/p90/p99" if sep == "/" else "p50 over p90 over p99"
    title = (f"[bold]{escape(line.scenario)}[/]: latency per tier, {escape(line.phase)}@{escape(line.engine)}{base} "
             f"(ms at {how}, as vllm bench serve)")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  collapse_padding=True)
    for k, (name, w) in enumerate(zip(headers, widths(headers, sep))):
        table.add_column(name, justify="left" if k < 3 else "right", no_wrap=True, min_width=w)
    for n, r in zip(names, rows):
        table.add_row(*map(escape, n), *r.cells(sep), end_section=r.baseline)
    return table


def _title(scenario: str, engine: str, what: str | None = None) -> str:
    title = f"[bold]{escape(scenario)}[/] on [bold]{escape(engine)}[/]"
    return f"{title}: {escape(what)}" if what else title


def _table(scenario: str, engine: str, rows: list[UserPhaseSummary], what: str | None = None) -> Table:
    table = Table(title=_title(scenario, engine, what), title_justify="left",
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


def _worst_cell(w: WorstUser | None, one_user: bool) -> str:
    """The worst user's figure over its name (a tier of one user: the figure alone); red with the
    count of users that failed the check."""
    if w is None:
        return "-"
    cell = figure_text(w.figure) if one_user else f"{figure_text(w.figure)}\n{escape(w.user)}"
    return f"[bold red]{cell}\n{w.failed}/{w.checked} FAIL[/]" if w.failed else cell


def _check_width(name: str, lines: list[TierLine]) -> int:
    """A check column's width: its name wraps between words, never inside a word nor a user's name."""
    worst = [(line, w) for line in lines if (w := line.worst.get(name)) is not None]
    texts = [figure_text(w.figure) for _, w in worst] + [w.user for line, w in worst if len(line.users) > 1]
    texts += [f"{w.failed}/{w.checked} FAIL" for _, w in worst if w.failed]
    return max(len(x) for x in [*name.split("-"), *texts])


def _tier_tables(scenario: str, engine: str, lines: list[TierLine], width: int | None) -> list[Table]:
    """A line per tier: its users, limit, tokens and result, then the worst user of each check (figure
    over name). Checks that do not fit in ``width`` columns go on in a table below (the tier repeated)."""
    users = sum(len(line.users) for line in lines)
    name_widths = [max(len("phase"), *(len(x.phase) for x in lines)), max(len("tier"), *(len(x.tier) for x in lines))]
    checks = list(dict.fromkeys(name for line in lines for name in line.worst))
    results = {id(x): "[green]pass[/]" if x.passed else f"[bold red]FAIL[/] {len(x.failed_users)}/{len(x.users)}"
               for x in lines}
    head = [("users", 5), ("N", max(1, *(len(x.limits_text) for x in lines))), ("tokens", 6), ("result", 10)]
    chunks: list[list[str]] = [[]]
    gap = 2  # a column's padding and the separator
    used = sum(w + gap for w in name_widths) + sum(w + gap for _, w in head)
    for name in checks:
        w = _check_width(name, lines) + gap
        if width is not None and chunks[-1] and used + w > width:
            chunks.append([])
            used = sum(w0 + gap for w0 in name_widths)
        chunks[-1].append(name)
        used += w
    tables = []
    for i, chunk in enumerate(chunks):
        what = (f"{users} users by tier, the worst user of each check (every user: verdict.json)" if i == 0
                else "(continued)")
        table = Table(title=_title(scenario, engine, what), title_justify="left", box=box.SIMPLE_HEAD,
                      show_edge=False, pad_edge=False, collapse_padding=True)
        for name, w in zip(("phase", "tier"), name_widths):
            table.add_column(name, no_wrap=True, min_width=w)
        if i == 0:
            for name, w in head:
                table.add_column(name, justify="right" if name != "result" else "left", no_wrap=True, min_width=w)
        for name in chunk:
            table.add_column(name.replace("-", " "), justify="right", width=_check_width(name, lines))
        for line in lines:
            cells = ([str(len(line.users)), line.limits_text, str(line.streamed_tokens), results[id(line)]]
                     if i == 0 else [])
            table.add_row(escape(line.phase), escape(line.tier), *cells,
                          *(_worst_cell(line.worst.get(name), len(line.users) == 1) for name in chunk))
        tables.append(table)
    return tables


def legend() -> str:
    """The short column headers, explained (rates in tok/s; seed: the seed article's method)."""
    return "rates in tok/s, seed = tokens / (last - first token); " + "; ".join(
        f"{c.short}: {c.legend}" for c in FIGURE_COLUMNS)


def print_verdict(verdict: Verdict, console: Console | None = None) -> None:
    console = console or default_console()
    coverage = promise_coverage(verdict)
    console.print(_headline(verdict, coverage))
    head = f"[bold]ratebench verify-bound[/] {escape(verdict.run_dir)}"
    if verdict.partial:
        n = len({(r.scenario, r.phase, r.engine) for r in verdict.rows})
        head += (f"  [bold yellow]PARTIAL[/]: the run did not complete; {n} completed phases checked, "
                 f"{len(verdict.missing_phases)} missing (listed below)")
    console.print(head)
    for table in verdict_tables(verdict, console.width):
        console.print()
        console.print(table)
    _print_failures(verdict, console)
    _print_unexercised(coverage, console)
    if verdict.missing_phases:
        console.print(f"[bold yellow]PARTIAL[/]: {len(verdict.missing_phases)} phases not checked:")
        for m in verdict.missing_phases:
            console.print(f"  {escape(m.label)}: {escape(m.why)}")
    console.print(f"[dim]{escape(legend())}[/]")
    thresholds = ", ".join(f"{k} {x}" for k, x in threshold_items(verdict.thresholds))
    console.print(f"[dim]thresholds: {escape(thresholds)}[/]")
    for name, step in verdict.engine_steps.items():
        longest = f"{step.longest_ns / 1e6:.2f} ms" if step.samples else "n/a"
        console.print(f"engine {name}: longest step (dispatch-to-emit) {longest} ({step.method})")
    for o in verdict.overheads:
        for pair, p in o.paired.items():
            console.print(f"{o.scenario} {pair}: throughput ratio, median per round {p.median:.3f} "
                          f"(spread {p.min:.3f}..{p.max:.3f} over {p.rounds} rounds), pooled {o.ratios[pair]:.3f}")
    for w in verdict.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    console.print(f"{_outcome_line(verdict)}; {escape(promise_clause(verdict, coverage))}")


_OUTCOME_STYLE = {"PASS": "bold green", "PARTIAL": "bold yellow"}


def _headline(verdict: Verdict, coverage: list[PromiseCoverage]) -> str:
    """The first line: the outcome in its colour, then the broken and the unexercised promises."""
    text = headline(verdict, coverage)
    word = verdict.outcome
    style = _OUTCOME_STYLE.get(word, "bold red")
    return f"[{style}]{escape(word)}[/]{escape(text[len(word):])}"


def _print_unexercised(coverage: list[PromiseCoverage], console: Console) -> None:
    """Each promise the run's phases did not exercise, and why (not a failure)."""
    for p in coverage:
        if not p.exercised:
            console.print(f"[yellow]not exercised[/] {escape(p.name)}: {escape(p.how)}")


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
