"""`ratebench profile-scheduler`: where the scheduler's time goes with many throttled requests resident."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ratebench import profiles, profiling
from ratebench.cli._console import fail, stderr
from ratebench.profiling.microbench import MicrobenchSettings

EXIT_USAGE = 2


def _parse_r_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise typer.BadParameter(f"expected positive integers separated by commas (e.g. 16,64,256), got {text!r}")
    return values


def _parse_reference_steps(text: str | None) -> dict[int, float] | None:
    """``--reference-step-ms``: BATCH=MS pairs separated by commas."""
    if text is None:
        return None
    steps: dict[int, float] = {}
    for item in (x for x in text.replace(" ", "").split(",") if x):
        batch, sep, ms = item.partition("=")
        try:
            b, m = int(batch), float(ms)
        except ValueError:
            b, m = 0, 0.0
        if not sep or b <= 0 or not m > 0:
            raise typer.BadParameter(f"--reference-step-ms: expected BATCH=MS pairs with a positive batch size and "
                                     f"milliseconds, separated by commas (e.g. 1=5.5,64=7.2,256=13.0), got {item!r}")
        steps[b] = m
    if not steps:
        raise typer.BadParameter(f"--reference-step-ms: no BATCH=MS pair in {text!r} (e.g. 1=5.5,64=7.2,256=13.0)")
    return steps


def _table_console() -> Console:
    """Tables at full width when piped."""
    return Console() if Console().is_terminal else Console(width=200)


def profile_scheduler(
    profile: Annotated[str, typer.Option("--profile", "-p", help="built-in profile name or path to a .toml")] = (
        profiles.DEFAULT_PROFILE),
    r_list: Annotated[str | None, typer.Option(
        "--r", help="resident requests R, comma separated (default for cpu-tiny: 16,64,256,1024)")] = None,
    duration_s: Annotated[float, typer.Option("--duration-s", help="py-spy sampling per R, seconds")] = 4.0,
    rate_hz: Annotated[int, typer.Option("--rate-hz", help="py-spy samples per second")] = 100,
    limit_tps: Annotated[int, typer.Option(
        "--limit-tps", help="the throttled users' rate on the launched engine (its default rate)")] = 1,
    endpoint: Annotated[str | None, typer.Option(
        "--endpoint", help="profile a server someone else started (URL; with --pid; engine part only)")] = None,
    pid: Annotated[int | None, typer.Option(
        "--pid", help="with --endpoint: that server's pid, or its EngineCore's")] = None,
    engine_part: Annotated[bool, typer.Option("--engine/--no-engine", help="part 1: py-spy under a real engine")] = (
        True),
    microbench_part: Annotated[bool, typer.Option(
        "--microbench/--no-microbench", help="part 2: the in-process schedule() microbenchmark")] = True,
    rounds: Annotated[int, typer.Option("--rounds", help="microbenchmark rounds (a, b, c, d each)")] = 20,
    calls_per_round: Annotated[int, typer.Option("--calls-per-round", help="schedule() calls per variant "
                                                                            "per round")] = 50,
    active_seqs: Annotated[int | None, typer.Option(
        "--active-seqs", help="microbenchmark --max-num-active-seqs (default: the profile's)")] = None,
    streams_per_user: Annotated[int, typer.Option("--streams-per-user", help="R / users")] = 4,
    policy: Annotated[str, typer.Option(
        "--policy", help="microbenchmark: vLLM's scheduling policy, fcfs (the limiter's bench orders the "
                         "places) or priority (its sort by priority and turn)")] = "fcfs",
    reference_step_ms: Annotated[str | None, typer.Option(
        "--reference-step-ms", help="the decode step by batch size for the cost target, BATCH=MS comma "
                                    "separated (e.g. 1=5.5,64=7.2,256=13.0; default: the profile's "
                                    "engine.reference_step_ms)")] = None,
    breakdown_r: Annotated[int | None, typer.Option(
        "--breakdown", help="also profile schedule() in (b), (c), (d) at this R (cProfile by function, "
                                    "py-spy by line, patch vs upstream) and print where the time goes")] = (
        None),
    out: Annotated[Path | None, typer.Option(
        "--out", help="output folder (default: results/profile-scheduler/<UTC>-<id>/)")] = None,
) -> None:
    """Where the scheduler's time goes with many throttled requests resident.

    Part 1: py-spy on the EngineCore of the profile's patched engine, per R (flame graph and
    speedscope files, shares of schedule(), the limiter, the rotation, update_from_output).
    Part 2: microseconds per schedule() call, feature off (a), limits never reached (b), every
    request throttled (c), half throttled (d), as ratios to (a). Exit 0 when done, 2 on usage errors.
    """
    try:
        prof = profiles.load_profile(profile)
        r_values = _parse_r_list(r_list) or profiling.r_values_for(prof.name)
        steps = _parse_reference_steps(reference_step_ms)
    except (profiles.ProfileError, typer.BadParameter) as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    if policy not in ("fcfs", "priority"):
        raise fail(f"--policy {policy!r}: use fcfs or priority (vLLM's scheduling policies)", EXIT_USAGE)
    if (endpoint is None) != (pid is None):
        raise fail("--endpoint and --pid go together (the server to load, the process to record)", EXIT_USAGE)
    err = stderr()
    table_out = _table_console()
    out_dir = out if out is not None else profiling.new_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    err.print(f"output folder: {out_dir}")
    active_seqs = active_seqs or prof.engine.max_num_active_seqs

    engine_report = None
    if engine_part:
        settings = profiling.EngineProfileSettings(r_values=r_values, duration_s=duration_s, rate_hz=rate_hz,
                                                   limit_tps=limit_tps, streams_per_user=streams_per_user)
        try:
            engine_report = profiling.record_engine(prof, settings, out_dir, endpoint=endpoint, pid=pid,
                                                    log=lambda m: err.print(escape(m)), console=err)
        except Exception as exc:  # noqa: BLE001 - part 2 still runs; the reason is printed and saved
            err.print(f"[bold red]{profiling.ENGINE_PART_FAILED}:[/] {escape(str(exc))}")
            log_tail = getattr(exc, "log_tail", "")
            if log_tail:
                err.print(escape(log_tail.rstrip()))
            engine_report = profiling.failed_engine_report(settings, exc)
        if engine_report.rows:
            table_out.print(profiling.engine_table(engine_report))
            for w in engine_report.warnings:
                err.print(f"[yellow]warning:[/] {escape(w)}")
        elif (reason := engine_report.not_recorded_reason()) is not None:
            err.print(f"[yellow]{escape(reason)}[/]")  # py-spy cannot attach, and the fix

    micro_report = None
    if microbench_part and endpoint is None:
        ms = MicrobenchSettings(r_values=r_values, rounds=rounds, calls_per_round=calls_per_round,
                                active_seqs=active_seqs, streams_per_user=streams_per_user, policy=policy)
        err.print(f"microbenchmark: R = {', '.join(map(str, r_values))}; {rounds} rounds of {calls_per_round} calls "
                  f"per variant")
        results = profiling.run_microbench(ms, on_round=lambda r, k: err.print(
            f"  R={r}: round {k + 1}/{rounds}", end="\r") if err.is_terminal else None)
        micro_report = profiling.summarize_microbench(results, ms)
        if steps:
            micro_report.reference_step_ms = profiles.step_ms_at(steps, active_seqs)
            micro_report.reference_source = "--reference-step-ms"
        elif prof.engine.reference_step_ms:
            micro_report.reference_step_ms = prof.engine.step_ms_at(active_seqs)
            micro_report.reference_source = f"profile {prof.name}'s engine.reference_step_ms"
        table_out.print(profiling.microbench_table(micro_report))
        for line in profiling.target_verdicts(micro_report):
            table_out.print(f"target: {escape(line)}")
        for w in micro_report.warnings:
            err.print(f"[yellow]warning:[/] {escape(w)}")

    breakdowns, line_breakdowns = [], []
    if breakdown_r is not None and endpoint is None:
        ms = MicrobenchSettings(r_values=[breakdown_r], active_seqs=active_seqs, streams_per_user=streams_per_user,
                                policy=policy)
        for variant in profiling.BREAKDOWN_VARIANTS:
            b = profiling.breakdown(variant, breakdown_r, ms)
            breakdowns.append(b)
            table_out.print(profiling.breakdown_table(b))
            lb = profiling.line_breakdown(variant, breakdown_r, ms)
            line_breakdowns.append(lb)
            if lb.top:
                table_out.print(profiling.line_breakdown_table(lb))
            if lb.error:
                err.print(f"[yellow]warning:[/] line breakdown of {variant}: {escape(lb.error)}")
    path = profiling.write_results(out_dir, command=list(sys.argv), microbench=micro_report, engine=engine_report,
                                   breakdowns=breakdowns, line_breakdowns=line_breakdowns)
    err.print(f"wrote {path}")
