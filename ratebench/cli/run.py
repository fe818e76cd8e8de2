"""`ratebench run`, `profiles` and `tiny-model`: what a run serves and runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ratebench import profiles, runner, tinymodel
from ratebench.cli._console import fail, stderr, stdout
from ratebench.outputs.console import print_verdict

EXIT_TINY_MODEL_FAILED = 2


def tiny_model(
    dest: Annotated[
        Path | None,
        typer.Option(
            "--dest",
            help="Model folder (default: <repo>/models/tiny-qwen3 in a source checkout, else "
            f"~/.cache/ratebench/models/tiny-qwen3; ${tinymodel.MODELS_DIR_ENV} sets the parent).",
            file_okay=False,
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Regenerate even if a matching model exists.")] = False,
) -> None:
    """Generate (or reuse) the tiny Qwen3 model of the cpu-tiny profile; print its path and a summary."""
    try:
        path = tinymodel.ensure_tiny_model(dest, force=force)
        info = tinymodel.read_tiny_model_info(path)
    except tinymodel.TinyModelError as exc:
        raise fail(str(exc), EXIT_TINY_MODEL_FAILED) from None
    out = stdout()
    out.print(escape(str(path)))
    out.print(escape(info.summary()))


def list_profiles() -> None:
    """List the built-in profiles, one line each."""
    out = stdout()
    for info in profiles.list_profiles():
        out.print(f"[bold]{info.name:<20}[/] {escape(info.description)}")


def run(
    profile: Annotated[str, typer.Option("--profile", "-p", help="built-in profile name or path to a .toml")] = (
        profiles.DEFAULT_PROFILE),
    results: Annotated[Path, typer.Option("--results", help="folder that holds results/<profile>/<run>/")] = (
        Path("results")),
    endpoint: Annotated[str | None, typer.Option(
        "--endpoint", help="attach to a server someone else started (URL); no engine is launched")] = None,
    events_file: Annotated[Path | None, typer.Option(
        "--events-file", help="with --endpoint: that server's engine event file")] = None,
    model: Annotated[str | None, typer.Option("--model", help="model folder or id instead of the profile's")] = None,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="skip the verdict at the end")] = False,
    unpatched: Annotated[bool, typer.Option(
        "--unpatched", hidden=True, help="development: stock vLLM, limiter flags left out")] = False,
) -> None:
    """Launch the engines of a profile, run every scenario, and print the verdict.

    Exit 0: the run passed (or --no-verify); 1: a check failed; 2: the profile is
    invalid (nothing launched); 3: the run failed (engine, patch, model); 130: interrupted.
    """
    try:
        prof = profiles.load_profile(profile)
    except profiles.ProfileError as exc:
        raise fail(str(exc), runner.EXIT_USAGE) from None
    if events_file is not None and endpoint is None:
        raise fail("--events-file goes with --endpoint (launched engines record their own)", runner.EXIT_USAGE)
    err = stderr()
    options = runner.RunOptions(results_dir=results, endpoint=endpoint, events_file=events_file, model=model,
                                use_patch=not unpatched, verify=not no_verify, live=err.is_terminal)
    outcome = runner.run_profile(prof, options, console=err)
    if outcome.engine_error is not None:
        err.print(f"[bold red]error:[/] {escape(str(outcome.engine_error))}")
        if outcome.engine_error.log_tail:
            err.print(f"[dim]last lines of {outcome.engine_error.log_path}:[/]")
            err.print(escape(outcome.engine_error.log_tail.rstrip()), markup=True, highlight=False)
    elif outcome.state != "complete":
        err.print(f"[bold red]run {outcome.state}:[/] {escape(outcome.reason or '')}")
    stdout().print(f"run folder: {outcome.run_dir}  state: {outcome.state}")
    if outcome.verdict is not None:
        print_verdict(outcome.verdict)
    raise typer.Exit(outcome.exit_code)
