"""The ratebench command line: parse, call, print. No logic lives here."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="ratebench",
    help="Prove that a per-user output-token rate limit in vLLM 0.32.0 keeps its promise.",
    no_args_is_help=True,
    add_completion=False,
)

# ---- patch: ratebench patch apply|check|revert|status ------------------------------
# (section owned by ratebench/patching.py)

from pathlib import Path as _Path  # noqa: E402
from typing import Annotated as _Annotated  # noqa: E402

from rich.console import Console as _Console  # noqa: E402
from rich.markup import escape as _escape  # noqa: E402

from ratebench import patching as _patching  # noqa: E402

patch_app = typer.Typer(
    help=(
        f"Apply, check, revert or inspect ratebench's limiter patch on vLLM {_patching.SUPPORTED_VLLM_VERSION} "
        "(by default the vLLM of this Python). Every change is all or nothing. "
        "Exit code 2 means refused or failed, with the reason."
    ),
    no_args_is_help=True,
)
app.add_typer(patch_app, name="patch")

_patch_out = _Console(soft_wrap=True, highlight=False)
_patch_err = _Console(stderr=True, soft_wrap=True, highlight=False)

_SitePackagesOption = _Annotated[
    _Path | None,
    typer.Option(
        "--site-packages",
        help="Work on the vLLM under this folder (it holds vllm/) instead of the installed one; "
        "the version then comes from vllm/_version.py.",
        file_okay=False,
    ),
]
_PatchDirOption = _Annotated[
    _Path | None,
    typer.Option("--patch-dir", help="The patch folder (series, *.patch, pristine.sha256).", file_okay=False),
]


def _patch_fail(exc: _patching.PatchError) -> typer.Exit:
    _patch_err.print(f"[bold red]error:[/] {_escape(str(exc))}")
    return typer.Exit(2)


def _patch_result_line(result: _patching.ApplyResult) -> str:
    verb = {"apply": "patched", "revert": "reverted"}[result.action]
    counts = f"{len(result.written)} file(s) to write, {len(result.deleted)} to delete"
    if result.dry_run:
        return f"{counts} in {result.root / 'vllm'}"
    return f"{verb} {result.root / 'vllm'}: " + counts.replace(" to write", " written").replace(" to delete", " deleted")


@patch_app.command("apply")
def patch_apply(site_packages: _SitePackagesOption = None, patch_dir: _PatchDirOption = None) -> None:
    """Patch vLLM (exit 0; already patched: nothing to do).

    Refused, exit 2, with the files listed, when a target file is neither pristine nor patched.
    """
    try:
        result = _patching.apply_patch(site_packages, patch_dir)
    except _patching.PatchError as exc:
        raise _patch_fail(exc) from None
    if not result.changed:
        _patch_out.print(f"already patched: nothing to do ({_escape(str(result.root / 'vllm'))})")
        return
    _print_patch_changes(result, wrote="wrote  ")


def _print_patch_changes(result, *, wrote: str) -> None:
    """The files apply or revert changed, and the reminder about running servers."""
    _patch_out.print(_escape(_patch_result_line(result)))
    for path in result.written:
        _patch_out.print(f"  {wrote} {_escape(path)}")
    for path in result.deleted:
        _patch_out.print(f"  deleted  {_escape(path)}")
    _patch_out.print("vLLM servers already running keep the old code until restarted")


@patch_app.command("check")
def patch_check(site_packages: _SitePackagesOption = None, patch_dir: _PatchDirOption = None) -> None:
    """Dry run of apply: exit 0 if apply would succeed or has nothing to do, 2 if not."""
    try:
        result = _patching.apply_patch(site_packages, patch_dir, dry_run=True)
    except _patching.PatchError as exc:
        raise _patch_fail(exc) from None
    if not result.changed:
        _patch_out.print(f"already patched: apply would change nothing ({_escape(str(result.root / 'vllm'))})")
    else:
        _patch_out.print(f"apply would succeed: {_escape(_patch_result_line(result))}")


@patch_app.command("revert")
def patch_revert(site_packages: _SitePackagesOption = None, patch_dir: _PatchDirOption = None) -> None:
    """Restore the pristine vLLM files (exit 0; already pristine: nothing to do).

    The result is checked against pristine.sha256; refused, exit 2, when a file is neither
    pristine nor patched.
    """
    try:
        result = _patching.revert_patch(site_packages, patch_dir)
    except _patching.PatchError as exc:
        raise _patch_fail(exc) from None
    if not result.changed:
        _patch_out.print(f"already pristine: nothing to do ({_escape(str(result.root / 'vllm'))})")
        return
    _print_patch_changes(result, wrote="restored")


_PATCH_STATE_STYLE = {"pristine": "yellow", "patched": "green", "modified": "bold red"}


@patch_app.command("status")
def patch_status(site_packages: _SitePackagesOption = None, patch_dir: _PatchDirOption = None) -> None:
    """Show each target file as pristine, patched or modified; exit 0 patched, 1 pristine, 2 modified.

    Exit codes: 0 when fully patched, 1 when pristine, 2 when any file is modified, the tree
    is half patched, or the check itself failed.
    """
    try:
        state = _patching.patch_status(site_packages, patch_dir)
    except _patching.PatchError as exc:
        raise _patch_fail(exc) from None
    for f in state.files:
        style = _PATCH_STATE_STYLE[f.state]
        detail = f"  ({_escape(f.problem)})" if f.problem else ""
        _patch_out.print(f"  [{style}]{f.state:<9}[/] {_escape(f.path)}{detail}")
    style = _PATCH_STATE_STYLE[state.overall]
    _patch_out.print(
        f"overall: [{style}]{state.overall}[/] (vLLM {_escape(state.vllm_version)} at "
        f"{_escape(str(state.root / 'vllm'))}; patch sha256 {state.patch_sha256[:16]})"
    )
    raise typer.Exit({"patched": 0, "pristine": 1}.get(state.overall, 2))


@patch_app.command("refresh-hashes")
def patch_refresh_hashes(
    pristine: _Annotated[
        _Path,
        typer.Option("--from", help="A pristine vLLM 0.32.0 site-packages folder (it holds vllm/).", file_okay=False),
    ],
    patch_dir: _PatchDirOption = None,
) -> None:
    """Maintainers: regenerate pristine.sha256 from a pristine vLLM tree after changing the series.

    The target files are those the series touches; the series must apply to the tree.
    """
    try:
        out = _patching.refresh_pristine_hashes(pristine, patch_dir)
    except _patching.PatchError as exc:
        raise _patch_fail(exc) from None
    _patch_out.print(f"wrote {_escape(str(out))}")

# ---- tiny model: ratebench tiny-model ----------------------------------------------
# (section owned by ratebench/tinymodel.py)

from ratebench import tinymodel as _tinymodel  # noqa: E402


@app.command("tiny-model")
def tiny_model(
    dest: _Annotated[
        _Path | None,
        typer.Option(
            "--dest",
            help="Model folder (default: <repo>/models/tiny-qwen3 in a source checkout, else "
            f"~/.cache/ratebench/models/tiny-qwen3; ${_tinymodel.MODELS_DIR_ENV} sets the parent).",
            file_okay=False,
        ),
    ] = None,
    force: _Annotated[bool, typer.Option("--force", help="Regenerate even if a matching model exists.")] = False,
) -> None:
    """Generate (or reuse) the tiny Qwen3 model of the cpu-tiny profile; print its path and a summary."""
    out = _Console(soft_wrap=True, highlight=False)
    try:
        path = _tinymodel.ensure_tiny_model(dest, force=force)
        info = _tinymodel.read_tiny_model_info(path)
    except _tinymodel.TinyModelError as exc:
        _Console(stderr=True, soft_wrap=True, highlight=False).print(f"[bold red]error:[/] {_escape(str(exc))}")
        raise typer.Exit(2) from None
    out.print(_escape(str(path)))
    out.print(_escape(info.summary()))

# ---- run / profiles ------------------------------------------------------------------
# (section owned by ratebench/profiles.py, engine.py, workload.py, runner.py)

from ratebench import profiles as _profiles  # noqa: E402


@app.command("profiles")
def profiles_cmd() -> None:
    """List the built-in profiles, one line each."""
    out = _Console(soft_wrap=True, highlight=False)
    for info in _profiles.list_profiles():
        out.print(f"[bold]{info.name:<20}[/] {_escape(info.description)}")


@app.command("run")
def run_cmd(
    profile: _Annotated[str, typer.Option("--profile", "-p", help="built-in profile name or path to a .toml")] = (
        _profiles.DEFAULT_PROFILE),
    results: _Annotated[_Path, typer.Option("--results", help="folder that holds results/<profile>/<run>/")] = (
        _Path("results")),
    endpoint: _Annotated[str | None, typer.Option(
        "--endpoint", help="attach to a server someone else started (URL); no engine is launched")] = None,
    events_file: _Annotated[_Path | None, typer.Option(
        "--events-file", help="with --endpoint: that server's engine event file")] = None,
    model: _Annotated[str | None, typer.Option("--model", help="model folder or id instead of the profile's")] = None,
    no_verify: _Annotated[bool, typer.Option("--no-verify", help="skip the verdict at the end")] = False,
    unpatched: _Annotated[bool, typer.Option(
        "--unpatched", hidden=True, help="development: stock vLLM, limiter flags left out")] = False,
) -> None:
    """Launch the engines of a profile, run every scenario, and print the verdict.

    Exit 0: the run passed (or --no-verify); 1: a check failed; 2: the profile is
    invalid (nothing launched); 3: the run failed (engine, patch, model); 130: interrupted.
    """
    from ratebench import runner as _runner

    err = _Console(stderr=True, soft_wrap=True, highlight=False)
    try:
        prof = _profiles.load_profile(profile)
    except _profiles.ProfileError as exc:
        err.print(f"[bold red]error:[/] {_escape(str(exc))}")
        raise typer.Exit(_runner.EXIT_USAGE) from None
    if events_file is not None and endpoint is None:
        err.print("[bold red]error:[/] --events-file goes with --endpoint (launched engines record their own)")
        raise typer.Exit(_runner.EXIT_USAGE)
    options = _runner.RunOptions(results_dir=results, endpoint=endpoint, events_file=events_file, model=model,
                                 use_patch=not unpatched, verify=not no_verify, live=err.is_terminal)
    outcome = _runner.run_profile(prof, options, console=err)
    if outcome.engine_error is not None:
        err.print(f"[bold red]error:[/] {_escape(str(outcome.engine_error))}")
        if outcome.engine_error.log_tail:
            err.print(f"[dim]last lines of {outcome.engine_error.log_path}:[/]")
            err.print(_escape(outcome.engine_error.log_tail.rstrip()), markup=True, highlight=False)
    elif outcome.state != "complete":
        err.print(f"[bold red]run {outcome.state}:[/] {_escape(outcome.reason or '')}")
    out = _Console(soft_wrap=True, highlight=False)
    out.print(f"run folder: {outcome.run_dir}  state: {outcome.state}")
    if outcome.verdict is not None:
        from ratebench.outputs.console import print_verdict

        print_verdict(outcome.verdict)
    raise typer.Exit(outcome.exit_code)

# ---- verify-bound / compare ----------------------------------------------------------
# (section owned by ratebench/analysis/, ratebench/outputs/)

from pathlib import Path as _VPath  # noqa: E402
from typing import Annotated as _VAnnotated  # noqa: E402

_EXIT_VERIFY_FAILED = 1
_EXIT_VERIFY_UNUSABLE = 2


def _thresholds(delivery_min, isolation_min, isolation_gap_max, max_overhead, cancel_max_steps,
                stream_spread_max, jain_min, emit_tolerance_ms, isolation_ttft_factor=2.0,
                isolation_ttft_slack_ms=50.0, max_event_overhead=None):
    from ratebench.analysis import Thresholds

    return Thresholds(delivery_min=delivery_min, isolation_min=isolation_min, isolation_gap_max=isolation_gap_max,
                      max_overhead=max_overhead, max_event_overhead=max_event_overhead,
                      cancel_max_steps=cancel_max_steps,
                      stream_spread_max=stream_spread_max, jain_min=jain_min,
                      emit_tolerance_ns=None if emit_tolerance_ms is None else round(emit_tolerance_ms * 1e6),
                      isolation_ttft_factor=isolation_ttft_factor,
                      isolation_ttft_slack_ns=round(isolation_ttft_slack_ms * 1e6))


_OPT_DELIVERY = typer.Option("--delivery-min", help="backlogged user's steady rate, at least this x its limit")
_OPT_ISOLATION = typer.Option("--isolation-min", help="unthrottled user's rate beside a throttled one, x alone")
_OPT_ISO_GAP = typer.Option("--isolation-gap-max", help="its p99 gap beside a throttled one, at most x alone "
                                                         "(default: report only)")
_OPT_ISO_TTFT = typer.Option("--isolation-ttft-factor", help="its p50 time to first token beside a throttled one, "
                                                                "at most this x alone + --isolation-ttft-slack-ms")
_OPT_ISO_TTFT_SLACK = typer.Option("--isolation-ttft-slack-ms", help="added to the allowed p50 time to first token")
_OPT_OVERHEAD = typer.Option("--max-overhead", help="fail when 1 - throughput(feature-on)/throughput(off or stock) "
                                                     "(the median of the per-round ratios) exceeds this "
                                                     "(default: report only)")
_OPT_EVENT_OVERHEAD = typer.Option("--max-event-overhead", help="fail when 1 - throughput(feature-on)/throughput("
                                                                 "feature-on without engine events) (the median of "
                                                                 "the per-round ratios) exceeds this "
                                                                 "(default: report only)")
_OPT_CANCEL = typer.Option("--cancel-max-steps", help="emit events of a cancelled request after the cancel")
_OPT_SPREAD = typer.Option("--stream-spread-max", help="tokens between one user's streams while all are active")
_OPT_JAIN = typer.Option("--jain-min", help="Jain's index across backlogged users with equal limits")
_OPT_EMIT_TOL = typer.Option("--emit-tolerance-ms", help="widen windows on emit events by this much "
                                                         "(default: the longest engine step measured)")


@app.command("verify-bound")
def verify_bound_cmd(
    run_dir: _VAnnotated[_VPath, typer.Argument(help="a run folder written by `ratebench run`")],
    delivery_min: _VAnnotated[float, _OPT_DELIVERY] = 0.97,
    isolation_min: _VAnnotated[float, _OPT_ISOLATION] = 0.9,
    isolation_gap_max: _VAnnotated[float | None, _OPT_ISO_GAP] = None,
    isolation_ttft_factor: _VAnnotated[float, _OPT_ISO_TTFT] = 2.0,
    isolation_ttft_slack_ms: _VAnnotated[float, _OPT_ISO_TTFT_SLACK] = 50.0,
    max_overhead: _VAnnotated[float | None, _OPT_OVERHEAD] = None,
    max_event_overhead: _VAnnotated[float | None, _OPT_EVENT_OVERHEAD] = None,
    cancel_max_steps: _VAnnotated[int, _OPT_CANCEL] = 1,
    stream_spread_max: _VAnnotated[int, _OPT_SPREAD] = 2,
    jain_min: _VAnnotated[float, _OPT_JAIN] = 0.95,
    emit_tolerance_ms: _VAnnotated[float | None, _OPT_EMIT_TOL] = None,
    plots: _VAnnotated[bool, typer.Option("--plots/--no-plots", help="write plots/*.png")] = True,
    max_plot_users: _VAnnotated[int, typer.Option("--max-plot-users", help="users per phase in the plots")] = 8,
) -> None:
    """Re-check a run folder from its files alone; write verdict.json, report.md, plots/.

    Exit 0: every check passed; 1: a check failed; 2: the run folder is unusable.
    """
    from rich.console import Console
    from rich.markup import escape

    from ratebench.outputs.console import print_verdict
    from ratebench.verify import RunFolderError, analyse_run, write_result

    err = Console(stderr=True, soft_wrap=True, highlight=False)
    th = _thresholds(delivery_min, isolation_min, isolation_gap_max, max_overhead, cancel_max_steps,
                     stream_spread_max, jain_min, emit_tolerance_ms, isolation_ttft_factor, isolation_ttft_slack_ms,
                     max_event_overhead)
    try:
        result = analyse_run(run_dir, th)
    except RunFolderError as exc:
        err.print(f"[bold red]unusable run folder:[/] {escape(str(exc))}")
        raise typer.Exit(_EXIT_VERIFY_UNUSABLE) from None
    written = write_result(result, plots=plots, max_plot_users=max_plot_users)
    print_verdict(result.verdict)
    err.print(f"wrote {len(written)} files into {run_dir} (verdict.json, report.md, plots/)")
    raise typer.Exit(0 if result.verdict.passed else _EXIT_VERIFY_FAILED)


@app.command("compare")
def compare_cmd(
    run_a: _VAnnotated[_VPath, typer.Argument(help="run folder A (the reference)")],
    run_b: _VAnnotated[_VPath, typer.Argument(help="run folder B (ratios are B/A)")],
    out: _VAnnotated[_VPath, typer.Option("--out", "-o", help="folder for compare.md")] = _VPath("."),
) -> None:
    """Put two runs' figures side by side with ratios B/A; writes OUT/compare.md.

    Exit 0 when both runs could be read (whatever their verdicts), 2 when one is unusable.
    """
    from rich.console import Console
    from rich.markup import escape

    from ratebench.analysis.compare import compare_verdicts
    from ratebench.outputs.console import print_comparison
    from ratebench.outputs.markdown import write_comparison
    from ratebench.verify import RunFolderError, analyse_run

    err = Console(stderr=True, soft_wrap=True, highlight=False)
    try:
        a = analyse_run(run_a).verdict
        b = analyse_run(run_b).verdict
    except RunFolderError as exc:
        err.print(f"[bold red]unusable run folder:[/] {escape(str(exc))}")
        raise typer.Exit(_EXIT_VERIFY_UNUSABLE) from None
    comparison = compare_verdicts(a, b)
    print_comparison(comparison)
    path = write_comparison(comparison, out / "compare.md")
    err.print(f"wrote {path}")

# ---- profile-scheduler -----------------------------------------------------------------
# (section owned by ratebench/profiling.py)

from pathlib import Path as _PPath  # noqa: E402
from typing import Annotated as _PAnnotated  # noqa: E402


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


@app.command("profile-scheduler")
def profile_scheduler_cmd(
    profile: _PAnnotated[str, typer.Option("--profile", "-p", help="built-in profile name or path to a .toml")] = (
        _profiles.DEFAULT_PROFILE),
    r_list: _PAnnotated[str | None, typer.Option(
        "--r", help="resident requests R, comma separated (default for cpu-tiny: 16,64,256,1024)")] = None,
    duration_s: _PAnnotated[float, typer.Option("--duration-s", help="py-spy sampling per R, seconds")] = 4.0,
    rate_hz: _PAnnotated[int, typer.Option("--rate-hz", help="py-spy samples per second")] = 100,
    limit_tps: _PAnnotated[int, typer.Option(
        "--limit-tps", help="the throttled users' rate on the launched engine (its default rate)")] = 1,
    endpoint: _PAnnotated[str | None, typer.Option(
        "--endpoint", help="profile a server someone else started (URL; with --pid; engine part only)")] = None,
    pid: _PAnnotated[int | None, typer.Option(
        "--pid", help="with --endpoint: that server's pid, or its EngineCore's")] = None,
    engine_part: _PAnnotated[bool, typer.Option("--engine/--no-engine", help="part 1: py-spy under a real engine")] = (
        True),
    microbench_part: _PAnnotated[bool, typer.Option(
        "--microbench/--no-microbench", help="part 2: the in-process schedule() microbenchmark")] = True,
    rounds: _PAnnotated[int, typer.Option("--rounds", help="microbenchmark rounds (a, b, c, d each)")] = 20,
    calls_per_round: _PAnnotated[int, typer.Option("--calls-per-round", help="schedule() calls per variant "
                                                                              "per round")] = 50,
    active_seqs: _PAnnotated[int | None, typer.Option(
        "--active-seqs", help="microbenchmark --max-num-active-seqs (default: the profile's)")] = None,
    streams_per_user: _PAnnotated[int, typer.Option("--streams-per-user", help="R / users")] = 4,
    breakdown_r: _PAnnotated[int | None, typer.Option(
        "--breakdown", help="also profile schedule() in (b), (c), (d) at this R (cProfile by function, "
                                    "py-spy by line, patch vs upstream) and print where the time goes")] = (
        None),
    out: _PAnnotated[_PPath | None, typer.Option(
        "--out", help="output folder (default: results/profile-scheduler/<UTC>-<id>/)")] = None,
) -> None:
    """Where the scheduler's time goes with many throttled requests resident.

    Part 1: py-spy on the EngineCore of the profile's patched engine, per R (flame graph and
    speedscope files, shares of schedule(), the limiter, the rotation, update_from_output).
    Part 2: microseconds per schedule() call, feature off (a), limits never reached (b), every
    request throttled (c), half throttled (d), as ratios to (a). Exit 0 when done, 2 on usage errors.
    """
    import sys as _sys

    from ratebench import profiling as _prof
    from ratebench.microbench import MicrobenchSettings

    err = _Console(stderr=True, soft_wrap=True, highlight=False)
    table_out = _Console() if _Console().is_terminal else _Console(width=200)
    try:
        prof = _profiles.load_profile(profile)
        r_values = _parse_r_list(r_list) or _prof.r_values_for(prof.name)
    except (_profiles.ProfileError, typer.BadParameter) as exc:
        err.print(f"[bold red]error:[/] {_escape(str(exc))}")
        raise typer.Exit(2) from None
    if (endpoint is None) != (pid is None):
        err.print("[bold red]error:[/] --endpoint and --pid go together (the server to load, the process to record)")
        raise typer.Exit(2)
    out_dir = out if out is not None else _prof.new_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    err.print(f"output folder: {out_dir}")

    engine_report = None
    if engine_part:
        settings = _prof.EngineProfileSettings(r_values=r_values, duration_s=duration_s, rate_hz=rate_hz,
                                               limit_tps=limit_tps, streams_per_user=streams_per_user)
        try:
            engine_report = _prof.record_engine(prof, settings, out_dir, endpoint=endpoint, pid=pid,
                                                log=lambda m: err.print(_escape(m)), console=err)
        except Exception as exc:  # noqa: BLE001 - part 2 still runs; the reason is printed and saved
            err.print(f"[bold red]engine part failed:[/] {_escape(str(exc))}")
            log_tail = getattr(exc, "log_tail", "")
            if log_tail:
                err.print(_escape(log_tail.rstrip()))
            engine_report = _prof.EngineReport(settings.to_json(), {}, [], [f"engine part failed: {exc}"],
                                               _prof.ENGINE_NOTES)
        if engine_report is not None and engine_report.rows:
            table_out.print(_prof.engine_table(engine_report))
            for w in engine_report.warnings:
                err.print(f"[yellow]warning:[/] {_escape(w)}")
        elif engine_report is not None and engine_report.warnings and not engine_report.engine \
                and not engine_report.warnings[0].startswith("engine part failed"):
            err.print(f"[yellow]{_escape(engine_report.warnings[0])}[/]")  # py-spy cannot attach, and the fix

    micro_report = None
    breakdowns = []
    if microbench_part and endpoint is None:
        ms = MicrobenchSettings(r_values=r_values, rounds=rounds, calls_per_round=calls_per_round,
                                active_seqs=active_seqs or prof.engine.max_num_active_seqs,
                                streams_per_user=streams_per_user)
        err.print(f"microbenchmark: R = {', '.join(map(str, r_values))}; {rounds} rounds of {calls_per_round} calls "
                  f"per variant")
        results = _prof.run_microbench(ms, on_round=lambda r, k: err.print(
            f"  R={r}: round {k + 1}/{rounds}", end="\r") if err.is_terminal else None)
        micro_report = _prof.summarize_microbench(results, ms)
        table_out.print(_prof.microbench_table(micro_report))
        for line in _prof.target_verdicts(micro_report):
            table_out.print(f"target: {_escape(line)}")
        for w in micro_report.warnings:
            err.print(f"[yellow]warning:[/] {_escape(w)}")
    line_breakdowns = []
    if breakdown_r is not None and endpoint is None:
        ms = MicrobenchSettings(r_values=[breakdown_r], active_seqs=active_seqs or prof.engine.max_num_active_seqs,
                                streams_per_user=streams_per_user)
        for variant in ("never-reached", "all-throttled", "half-throttled"):
            b = _prof.breakdown(variant, breakdown_r, ms)
            breakdowns.append(b)
            table_out.print(_prof.breakdown_table(b))
            lb = _prof.line_breakdown(variant, breakdown_r, ms)
            line_breakdowns.append(lb)
            if lb.top:
                table_out.print(_prof.line_breakdown_table(lb))
            if lb.error:
                err.print(f"[yellow]warning:[/] line breakdown of {variant}: {_escape(lb.error)}")
    path = _prof.write_results(out_dir, command=list(_sys.argv), microbench=micro_report, engine=engine_report,
                               breakdowns=breakdowns, line_breakdowns=line_breakdowns)
    err.print(f"wrote {path}")


def main() -> None:  # pragma: no cover
    app()
