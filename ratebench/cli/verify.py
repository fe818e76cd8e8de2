"""`ratebench verify-bound` and `compare`: the verdict on run folders, from their files alone."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ratebench import verify
from ratebench.analysis import Thresholds
from ratebench.analysis.compare import compare_verdicts
from ratebench.cli._console import fail, stderr
from ratebench.outputs.console import print_comparison, print_verdict
from ratebench.outputs.markdown import write_comparison


# The thresholds of verify-bound: one option each, turned into Thresholds by thresholds() alone.
_OPT_DELIVERY = typer.Option("--delivery-min", help="backlogged user's steady rate, at least this x its limit")
_OPT_ISOLATION = typer.Option("--isolation-min", help="a user whose limit did not bind: its rate beside throttled "
                                                        "users, at least this x on the phase's baseline")
_OPT_ISO_TTFT = typer.Option("--isolation-ttft-factor", help="its p50/p90/p99 time to first token, at most this x the "
                                                                "baseline's + --isolation-ttft-slack-ms")
_OPT_ISO_TTFT_SLACK = typer.Option("--isolation-ttft-slack-ms", help="added to the allowed time to first token")
_OPT_ISO_E2E = typer.Option("--isolation-e2e-factor", help="its p50/p90/p99 end-to-end latency, at most this x the "
                                                             "baseline's + --isolation-e2e-slack-ms")
_OPT_ISO_E2E_SLACK = typer.Option("--isolation-e2e-slack-ms", help="added to the allowed end-to-end latency")
_OPT_ISO_GAP = typer.Option("--isolation-gap-factor", help="its p50/p90/p99 inter-token gap, at most this x the "
                                                             "baseline's + --isolation-gap-slack-ms")
_OPT_ISO_GAP_SLACK = typer.Option("--isolation-gap-slack-ms", help="added to the allowed inter-token gap")
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
_OPT_SPACING = typer.Option("--spacing-slack-ms", help="even spacing: a backlogged user may fall short of N x W by "
                                                        "1 + N x (longest step period + this) tokens in a window")
_OPT_WAIT_CPU = typer.Option("--wait-cpu-max", help="EngineCore CPUs spent while users wait, beyond what an idle "
                                                     "engine and its steps cost")
_OPT_WAIT_STEPS = typer.Option("--wait-steps-max", help="empty engine steps right after an empty step (re-wakes) "
                                                         "per second of waiting for budget (a blocked engine wakes "
                                                         "every 50 ms at most: 20)")
_OPT_WAKE = typer.Option("--wake-max-ms", help="a waiting engine's added p50 time to first token of a new request, "
                                                "and p50 abort latency")
_OPT_STREAM_WAIT = typer.Option("--stream-wait-factor", help="a throttled user's stream waits at most this x "
                                                                "streams / limit + --stream-wait-slack-ms for a token")
_OPT_STREAM_WAIT_SLACK = typer.Option("--stream-wait-slack-ms", help="added to the allowed longest stream wait")
_OPT_PLACE_SHARE = typer.Option("--place-share-min", help="with more streams than active places, every user's rate "
                                                           "at least this x its max-min fair share")
_OPT_PLACE_JAIN = typer.Option("--place-jain-min", help="Jain's index of the users' rates / fair shares of the "
                                                         "active places")
_OPT_REFUSAL_TOL = typer.Option("--refusal-tolerance-tokens",
                                help="refusal-witness: tokens a refused user's charges may fall short of the burst "
                                     "in the window ending at the refusal (refunds of the refusing step)")
_OPT_WORK_RUN = typer.Option("--work-conservation-max-run-steps",
                             help="work conservation: the longest run of consecutive engine steps that may leave a "
                                  "place or a slot idle, or held by a throttled request, while a request of a user "
                                  "with budget waits (1: the step in which a budget flips)")
_OPT_PLACES_RUN = typer.Option("--work-conservation-places-max-run-steps",
                               help="work conservation: the longest run of consecutive engine steps (synchronous "
                                    "scheduling) that may leave a place idle while a resident request of a user "
                                    "with budget gets no tokens (2: a budget flip, and a stream sitting out one step "
                                    "for its sibling's turn)")
_OPT_WITNESS_CLOCK = typer.Option("--witness-clock-us",
                                  help="two witnesses: how far (microseconds) the client's time may precede the "
                                       "engine's event for the same token, end of stream or send (the clock's "
                                       "resolution; one host clock)")
_OPT_DELIVERY_SPREAD = typer.Option("--delivery-spread-max-ms",
                                    help="two witnesses: how much (ms) the delay from a token's emit event to its "
                                         "arrival at the client may vary for one user in a phase (the client "
                                         "bound's windows widen by it; 250: two and a half bursts)")
_OPT_ANSWERS_TOL = typer.Option("--answers-logprob-tol",
                                help="answers-intact: how far (nats) below the limiter-off engine's likeliest "
                                     "token a token of a limiter-on answer that parted may score there and still "
                                     "count as its greedy choice (a tie the batch's rounding broke the other way)")
_OPT_EMIT_TOL = typer.Option("--emit-tolerance-ms", help="widen windows on emit events by this much "
                                                         "(default: the longest engine step measured)")


def thresholds(*, delivery_min: float, isolation_min: float,
               isolation_ttft_factor: float, isolation_ttft_slack_ms: float, max_overhead: float | None,
               max_event_overhead: float | None, cancel_max_steps: int, stream_spread_max: int, jain_min: float,
               emit_tolerance_ms: float | None, spacing_slack_ms: float, wait_cpu_max: float,
               wake_max_ms: float, stream_wait_factor: float = 2.0, stream_wait_slack_ms: float = 300.0,
               place_share_min: float = 0.5, place_jain_min: float = 0.9,
               work_conservation_max_run_steps: int = 1, isolation_e2e_factor: float = 1.5,
               isolation_e2e_slack_ms: float = 50.0, isolation_gap_factor: float = 1.5,
               isolation_gap_slack_ms: float = 20.0, witness_clock_us: float = 5.0,
               wait_steps_max: float = 40.0, refusal_tolerance_tokens: float = 2.0,
               work_conservation_places_max_run_steps: int = 2, answers_logprob_tol: float = 0.05,
               delivery_spread_max_ms: float = 250.0) -> Thresholds:
    """The verify-bound threshold options as Thresholds (milliseconds on the command line, ns inside)."""
    return Thresholds(delivery_min=delivery_min, isolation_min=isolation_min,
                      isolation_ttft_factor=isolation_ttft_factor,
                      isolation_ttft_slack_ns=round(isolation_ttft_slack_ms * 1e6),
                      isolation_e2e_factor=isolation_e2e_factor,
                      isolation_e2e_slack_ns=round(isolation_e2e_slack_ms * 1e6),
                      isolation_gap_factor=isolation_gap_factor,
                      isolation_gap_slack_ns=round(isolation_gap_slack_ms * 1e6),
                      max_overhead=max_overhead, max_event_overhead=max_event_overhead,
                      cancel_max_steps=cancel_max_steps, stream_spread_max=stream_spread_max, jain_min=jain_min,
                      emit_tolerance_ns=None if emit_tolerance_ms is None else round(emit_tolerance_ms * 1e6),
                      spacing_slack_ns=round(spacing_slack_ms * 1e6), wait_cpu_max=wait_cpu_max,
                      wait_steps_max=wait_steps_max, wake_max_ms=wake_max_ms, stream_wait_factor=stream_wait_factor,
                      stream_wait_slack_ns=round(stream_wait_slack_ms * 1e6), place_share_min=place_share_min,
                      place_jain_min=place_jain_min, work_conservation_max_run_steps=work_conservation_max_run_steps,
                      witness_clock_ns=round(witness_clock_us * 1e3),
                      refusal_tolerance_tokens=refusal_tolerance_tokens,
                      work_conservation_places_max_run_steps=work_conservation_places_max_run_steps,
                      answers_logprob_tol=answers_logprob_tol,
                      delivery_spread_max_ns=round(delivery_spread_max_ms * 1e6))


def verify_bound(
    run_dir: Annotated[Path, typer.Argument(help="a run folder written by `ratebench run`")],
    delivery_min: Annotated[float, _OPT_DELIVERY] = 0.97,
    isolation_min: Annotated[float, _OPT_ISOLATION] = 0.9,
    isolation_ttft_factor: Annotated[float, _OPT_ISO_TTFT] = 1.5,
    isolation_ttft_slack_ms: Annotated[float, _OPT_ISO_TTFT_SLACK] = 20.0,
    isolation_e2e_factor: Annotated[float, _OPT_ISO_E2E] = 1.5,
    isolation_e2e_slack_ms: Annotated[float, _OPT_ISO_E2E_SLACK] = 50.0,
    isolation_gap_factor: Annotated[float, _OPT_ISO_GAP] = 1.5,
    isolation_gap_slack_ms: Annotated[float, _OPT_ISO_GAP_SLACK] = 20.0,
    max_overhead: Annotated[float | None, _OPT_OVERHEAD] = None,
    max_event_overhead: Annotated[float | None, _OPT_EVENT_OVERHEAD] = None,
    cancel_max_steps: Annotated[int, _OPT_CANCEL] = 1,
    stream_spread_max: Annotated[int, _OPT_SPREAD] = 2,
    jain_min: Annotated[float, _OPT_JAIN] = 0.95,
    emit_tolerance_ms: Annotated[float | None, _OPT_EMIT_TOL] = None,
    spacing_slack_ms: Annotated[float, _OPT_SPACING] = 5.0,
    wait_cpu_max: Annotated[float, _OPT_WAIT_CPU] = 0.2,
    wait_steps_max: Annotated[float, _OPT_WAIT_STEPS] = 40.0,
    wake_max_ms: Annotated[float, _OPT_WAKE] = 10.0,
    stream_wait_factor: Annotated[float, _OPT_STREAM_WAIT] = 2.0,
    stream_wait_slack_ms: Annotated[float, _OPT_STREAM_WAIT_SLACK] = 300.0,
    place_share_min: Annotated[float, _OPT_PLACE_SHARE] = 0.5,
    place_jain_min: Annotated[float, _OPT_PLACE_JAIN] = 0.9,
    work_conservation_max_run_steps: Annotated[int, _OPT_WORK_RUN] = 1,
    work_conservation_places_max_run_steps: Annotated[int, _OPT_PLACES_RUN] = 2,
    witness_clock_us: Annotated[float, _OPT_WITNESS_CLOCK] = 5.0,
    refusal_tolerance_tokens: Annotated[float, _OPT_REFUSAL_TOL] = 2.0,
    answers_logprob_tol: Annotated[float, _OPT_ANSWERS_TOL] = 0.05,
    delivery_spread_max_ms: Annotated[float, _OPT_DELIVERY_SPREAD] = 250.0,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="write plots/*.png")] = True,
    max_plot_users: Annotated[int, typer.Option("--max-plot-users", help="users per phase in the plots")] = 8,
    partial: Annotated[bool, typer.Option(
        "--partial", help="a run that did not complete (interrupted, failed part way): check the phases that "
        "completed, name the others; the verdict is marked PARTIAL and never passes")] = False,
) -> None:
    """Re-check a run folder from its files alone; write verdict.json, report.md, report.html, plots/.

    Exit 0: every check passed; 1: a check failed; 2: the run folder is unusable (without
    --partial: the run did not complete); 4: --partial on a run that did not complete, and
    every check of its completed phases passed.
    """
    th = thresholds(delivery_min=delivery_min, isolation_min=isolation_min,
                    isolation_ttft_factor=isolation_ttft_factor, isolation_ttft_slack_ms=isolation_ttft_slack_ms,
                    isolation_e2e_factor=isolation_e2e_factor, isolation_e2e_slack_ms=isolation_e2e_slack_ms,
                    isolation_gap_factor=isolation_gap_factor, isolation_gap_slack_ms=isolation_gap_slack_ms,
                    max_overhead=max_overhead, max_event_overhead=max_event_overhead,
                    cancel_max_steps=cancel_max_steps, stream_spread_max=stream_spread_max, jain_min=jain_min,
                    emit_tolerance_ms=emit_tolerance_ms, spacing_slack_ms=spacing_slack_ms,
                    wait_cpu_max=wait_cpu_max, wait_steps_max=wait_steps_max, wake_max_ms=wake_max_ms,
                    stream_wait_factor=stream_wait_factor,
                    stream_wait_slack_ms=stream_wait_slack_ms, place_share_min=place_share_min,
                    place_jain_min=place_jain_min, work_conservation_max_run_steps=work_conservation_max_run_steps,
                    witness_clock_us=witness_clock_us, refusal_tolerance_tokens=refusal_tolerance_tokens,
                    work_conservation_places_max_run_steps=work_conservation_places_max_run_steps,
                    answers_logprob_tol=answers_logprob_tol, delivery_spread_max_ms=delivery_spread_max_ms)
    try:
        result = verify.analyse_run(run_dir, th, partial=partial)
    except verify.RunFolderError as exc:
        raise fail(str(exc), verify.EXIT_UNUSABLE, label="unusable run folder") from None
    written = verify.write_result(result, plots=plots, max_plot_users=max_plot_users)
    print_verdict(result.verdict)
    stderr().print(f"wrote {len(written)} files into {run_dir} (verdict.json, report.md, report.html, plots/)")
    raise typer.Exit(verify.exit_code(result.verdict))


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
