"""`ratebench run`, `profiles` and `tiny-model`: what a run serves and runs."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ratebench import plan, profiles, runner, tinymodel
from ratebench.balancer import POLICIES, USER_HEADER, BalancerError, haproxy_binary
from ratebench.cli._console import fail, stderr, stdout
from ratebench.events import ENV_VAR as EVENTS_ENV_VAR
from ratebench.outputs.console import print_verdict
from ratebench.scenarios import fleet_members

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
    scenario: Annotated[list[str] | None, typer.Option(
        "--scenario", metavar="NAME", help="run only this scenario of the profile (by name; repeatable)")] = None,
    overhead_rounds: Annotated[int | None, typer.Option(
        "--overhead-rounds", help="rounds of the overhead scenario instead of the profile's")] = None,
    max_engines: Annotated[int | None, typer.Option(
        "--max-engines", help="engines alive at once instead of the profile's max_engines")] = None,
    engine_arg: Annotated[list[str] | None, typer.Option(
        "--engine-arg", metavar="ARG", help="one more `vllm serve` argument for every engine, after the profile's "
                             "(repeatable; e.g. --engine-arg=--gpu-memory-utilization=0.2)")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="print the model, each engine's command line and environment, and the phases with "
                          "their expected durations; launch, generate and write nothing")] = False,
    unpatched: Annotated[bool, typer.Option(
        "--unpatched", hidden=True, help="development: stock vLLM, limiter flags left out")] = False,
) -> None:
    """Launch the engines of a profile, run every scenario, and print the verdict.

    Exit 0: the run passed (or --no-verify; or the --dry-run plan); 1: a check failed; 2: the
    profile or an option is invalid (nothing launched); 3: the run failed (engine, patch, model);
    130: interrupted.
    """
    try:
        prof = profiles.with_run_options(profiles.load_profile(profile), scenarios=scenario,
                                         overhead_rounds=overhead_rounds, max_engines=max_engines,
                                         engine_args=engine_arg)
    except profiles.ProfileError as exc:
        raise fail(str(exc), runner.EXIT_USAGE) from None
    if events_file is not None and endpoint is None:
        raise fail("--events-file goes with --endpoint (launched engines record their own)", runner.EXIT_USAGE)
    if dry_run:
        _print_plan(plan.plan_run(prof, model=model, endpoint=endpoint, use_patch=not unpatched), stdout())
        return
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


def _starts(p: plan.RunPlan) -> int:
    """Engine processes the run starts (a fleet's start is one per member)."""
    return sum(len(fleet_members(n) or [n]) for wave in p.engine_starts for n in wave)


def _print_plan(p: plan.RunPlan, out: Console) -> None:
    """The dry run: what `ratebench run` would launch and send, in the order it would."""
    prof = p.profile
    out.print(f"[bold]dry run[/] of profile {escape(prof.name)} ({escape(prof.path)}): nothing is launched, "
              f"generated or written")
    if p.model is not None:
        state = "[green]present[/]" if p.model.present else "[yellow]not present[/]"
        out.print(f"[bold]model[/] ({p.model.source}): {escape(p.model.path)}: {state}: {escape(p.model.detail)}")
    if p.endpoint is not None:
        out.print(f"[bold]endpoint[/]: attach to {escape(p.endpoint)}; no engine is launched")
    elif p.use_patch:
        out.print("[bold]patch[/]: the run applies the limiter patch to vLLM first if it is pristine")
    for s in p.skipped:
        out.print(f"[bold]skipped[/]: {escape(s['scenario'])} ({escape(s['why'])})")
    if p.engines:
        starts = _starts(p)
        together = "one after another (GPU)" if prof.device == "cuda" else "a wave together"
        out.print(f"[bold]engines[/] ({len(p.engines)}, in order of first use; at most {prof.max_engines} alive at "
                  f"once: {starts} start(s) in {len(p.engine_starts)} wave(s), {together}, each allowed "
                  f"{prof.startup_timeout_s:g} s to start; each inherits ratebench's environment without "
                  f"{escape(EVENTS_ENV_VAR)}, plus the env lines):")
    for e in p.engines:
        spec = e.spec
        what = (f"{spec.kind} vLLM, limiter {'on' if spec.feature else 'off'}, "
                f"{'async' if spec.async_scheduling else 'sync'} scheduling, {spec.scheduling_policy} policy, "
                f"{e.phases} phase(s)")
        out.print(f"  [bold]{escape(spec.name)}[/] ({what})")
        out.print(f"    argv: {escape(shlex.join(e.argv))}")
        for key, value in e.env.items():
            out.print(f"    env:  {escape(key)}={escape(shlex.quote(value))}")
    for fleet in dict.fromkeys(ph.engine for ph in p.phases):
        members = fleet_members(fleet)
        if members is None or p.endpoint is not None:
            continue
        try:
            found = f"[green]{escape(haproxy_binary())}[/]"
        except BalancerError as exc:
            found = f"[red]not installed[/]: {escape(str(exc))}"
        header = next((s.params["user_header"] for s in prof.scenarios if s.kind == "fleet"), USER_HEADER)
        out.print(f"[bold]fleet[/] {escape(fleet)}: HAProxy ({found}) in front of {escape(', '.join(members))}; "
                  f"a frontend per routing policy ({', '.join(POLICIES)}), requests without the "
                  f"{escape(header)} header refused with 400; started after its engines, stopped with them")
    out.print(f"[bold]phases[/] ({len(p.phases)}, in order; expected durations are lower bounds at the users' "
              f"limits, tokens / limit without the 100 ms burst; the engine's speed may make a phase longer):")
    for k, ph in enumerate(p.phases, 1):
        expected = "set by the engine's speed" if ph.estimate.at_least_s is None else \
            f">= {ph.estimate.at_least_s:.1f} s"
        out.print(f"  {k:>3}. {escape(ph.scenario)}/{escape(ph.phase)} on {escape(ph.engine)}: {expected} "
                  f"({escape(ph.estimate.basis)})")
    reach = plan.reachability(p)
    if reach:
        out.print("[bold]reachable limits[/] at the reference decode step (engine.reference_step_ms; a stream "
                  "gets at most one token a step, 1000 / step ms tok/s):")
        for r in reach:
            verdict = ("[green]reachable[/]" if r.reachable else
                       "[dim]far above what its streams get: never binds[/]" if r.limit_tps > 5 * r.max_tps else
                       "[bold red]NOT reachable[/]")
            out.print(f"  {escape(r.phase.scenario)}/{escape(r.phase.phase)} on {escape(r.phase.engine)}: "
                      f"{escape(r.user)} {r.limit_tps} tok/s with {r.streams} stream(s): at most "
                      f"{r.max_tps:.0f} tok/s at a batch of {r.batch} ({r.step_ms:.1f} ms a step): {verdict}")
        bad = sum(not r.reachable and r.limit_tps <= 5 * r.max_tps for r in reach)
        if bad:
            out.print(f"  [bold red]{bad} limit(s) the engine, not the budget, would set[/]: give those users more "
                      f"streams, or lower their limits")
    by_engine = sum(ph.estimate.at_least_s is None for ph in p.phases)
    out.print(f"[bold]expected[/]: at least {p.at_least_s():.0f} s of phases"
              + (f", plus {by_engine} phase(s) the engine's speed sets" if by_engine else "")
              + (f", plus {_starts(p)} engine start(s) and warm-up(s)" if p.engines else ""))
