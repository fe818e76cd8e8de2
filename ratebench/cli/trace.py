"""`ratebench trace from-run|check`: request traces for the trace scenario (docs/trace.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ratebench import trace as traces
from ratebench.cli._console import fail, stderr, stdout
from ratebench.events import EventFileError
from ratebench.runrecords import read_client_records

EXIT_USAGE = 2

app = typer.Typer(
    help="Request traces for the trace scenario (format: docs/trace.md). Exit code 2: refused, with the reason.",
    no_args_is_help=True,
)


@app.command("from-run")
def from_run(
    run_dir: Annotated[Path, typer.Argument(help="a run folder of `ratebench run` (its requests.jsonl)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="the trace file to write (.jsonl)")],
    scenario: Annotated[str | None, typer.Option("--scenario", help="only this scenario's requests")] = None,
    phase: Annotated[str | None, typer.Option("--phase", help="only this phase's requests")] = None,
    engine: Annotated[str | None, typer.Option("--engine", help="only the requests sent to this engine")] = None,
) -> None:
    """The requests an earlier run sent, as a trace: arrivals at the times the driver meant to send them
    (from the first), users, prompt lengths, max_tokens, APIs, EOS, cancels (by the time each ran)."""
    path = run_dir / "requests.jsonl" if run_dir.is_dir() else run_dir
    try:
        records = read_client_records(path)
    except EventFileError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    made = traces.trace_from_records(records, scenario=scenario, phase=phase, engine=engine)
    if not made.requests:
        chosen = ", ".join(f"--{k} {v}" for k, v in (("scenario", scenario), ("phase", phase), ("engine", engine))
                           if v is not None)
        raise fail(f"{path}: no request to write" + (f" with {chosen}" if chosen else ""), EXIT_USAGE)
    traces.write_trace(out, made.requests)
    for why, n in made.skipped.items():
        stderr().print(f"left out {n} record(s): {why}")
    stdout().print(f"{out}: {traces.describe(made.requests)}")


@app.command("check")
def check(trace_file: Annotated[Path, typer.Argument(help="a trace file (.jsonl)")]) -> None:
    """Read a trace as a profile would (exit 2 naming the line and field of the first mistake)."""
    try:
        requests = traces.read_trace(trace_file)
    except traces.TraceError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    stdout().print(f"{trace_file}: {traces.describe(requests)}")
