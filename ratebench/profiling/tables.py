"""The console tables of profile-scheduler (rich): one per part and per breakdown."""

from __future__ import annotations

from ratebench.profiling.breakdown import Breakdown, LineBreakdown
from ratebench.profiling.engine import EngineReport
from ratebench.profiling.microbench import VARIANT_LETTERS, VARIANT_OFF, VARIANTS
from ratebench.profiling.samples import ENGINE_CATEGORIES
from ratebench.profiling.statistics import LARGE_SPREAD, MicrobenchReport


def microbench_table(report: MicrobenchReport):
    from rich.table import Table

    s = report.settings
    table = Table(title=(f"schedule() microbenchmark: us per call, median over {s['rounds']} rounds of "
                         f"{s['calls_per_round']} calls [IQR]; ratio to (a) per round; "
                         f"--max-num-active-seqs {s['active_seqs']}, {s['streams_per_user']} streams per user, "
                         f"{s.get('policy', 'fcfs').upper()} policy"))
    for col in ("R", "users", "variant", "us/call", "IQR", "mean us/call", "x (a)", "ratio IQR", "running",
                "scheduled/step", "re-added/step"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r, row in report.rows.items():
        for variant in VARIANTS:
            v = row.get(variant)
            if v is None:
                continue
            ratio = v.ratio_to_off
            ratio_cell = "1" if variant == VARIANT_OFF else (f"{ratio.median:.2f}" if ratio else "-")
            iqr_cell = "" if variant == VARIANT_OFF or ratio is None else f"{ratio.q1:.2f}-{ratio.q3:.2f}"
            if ratio is not None and variant != VARIANT_OFF and ratio.relative_iqr > LARGE_SPREAD:
                ratio_cell = f"[yellow]{ratio_cell}[/]"
            table.add_row(str(r), str(v.state.get("users", "")), f"({v.letter}) {variant}",
                          f"{v.us_per_call.median:.1f}", f"{v.us_per_call.q1:.1f}-{v.us_per_call.q3:.1f}",
                          f"{v.mean_us_per_call.median:.1f}", ratio_cell, iqr_cell,
                          f"{v.state.get('mean_running', 0):.0f}", f"{v.state.get('mean_scheduled_requests', 0):.1f}",
                          f"{v.state.get('mean_readded_requests', 0):.1f}")
        table.add_section()
    return table


def engine_table(report: EngineReport):
    from rich.table import Table

    table = Table(title="EngineCore busy-loop thread under py-spy: share of its samples (wall time)")
    for col in ("R", "running", "waiting", "samples", "schedule", "limiter", "rotation", "update_from_output",
                "model wait", "idle", "flame graph"):
        table.add_column(col, justify="right")
    for row in report.rows:
        if row.error:
            table.add_row(str(row.r), "", "", "", f"[red]{row.error[:60]}[/]", "", "", "", "", "", "")
            continue
        table.add_row(str(row.r), f"{row.resident.get('running', 0):.0f}", f"{row.resident.get('waiting', 0):.0f}",
                      str(row.samples), *(f"{100 * row.shares[c]:.1f} %" for c in ENGINE_CATEGORIES),
                      f"engine/{row.svg}" if row.svg else "-")
    return table


def breakdown_table(b: Breakdown):
    from rich.table import Table

    table = Table(title=(f"cProfile of schedule() only: ({VARIANT_LETTERS[b.variant]}) {b.variant}, R={b.r}, "
                         f"{b.steps} steps, {b.schedule_us_per_step:.0f} us/step under the profiler; "
                         f"running {b.state.get('running')}, waiting {b.state.get('waiting')}"))
    for col in ("function", "calls/step", "self us/step", "total us/step", "total share of schedule()"):
        table.add_column(col, justify="left" if col == "function" else "right")
    total = b.schedule_us_per_step or 1.0
    for c in sorted(b.patch.values(), key=lambda c: c.cumtime_us_per_step, reverse=True):
        table.add_row(f"[bold]patch[/] {c.function}", f"{c.calls / b.steps:.1f}", f"{c.tottime_us_per_step:.1f}",
                      f"{c.cumtime_us_per_step:.1f}", f"{100 * c.cumtime_us_per_step / total:.1f} %")
    table.add_section()
    for c in b.top:
        table.add_row(c.function, f"{c.calls / b.steps:.1f}", f"{c.tottime_us_per_step:.1f}",
                      f"{c.cumtime_us_per_step:.1f}", f"{100 * c.cumtime_us_per_step / total:.1f} %")
    return table


def line_breakdown_table(b: LineBreakdown):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=(f"py-spy, lines of schedule(): ({VARIANT_LETTERS[b.variant]}) {b.variant}, R={b.r}, "
                         f"{b.samples_in_schedule} samples in schedule(); at lines the patch added (with their "
                         f"callees): {100 * b.patch_share:.1f} %"))
    for col in ("line", "share", "from", "source"):
        table.add_column(col, justify="left" if col == "source" else "right")
    for c in b.top:
        table.add_row(str(c.line), f"{100 * c.share:.1f} %", "[bold]patch[/]" if c.from_patch else "upstream",
                      escape(c.source[:90]))
    return table
