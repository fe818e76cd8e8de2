"""verify-bound: re-check a run folder from its files alone and write the verdict.

``verify_run`` is what both ``ratebench verify-bound`` and the end of
``ratebench run`` call. ``analyse_run(..., partial=True)`` checks the completed phases
of an unfinished run (``ratebench.analysis.partial``); ``exit_code`` turns a verdict
into verify-bound's exit status.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path

from ratebench.analysis.checks import build_checks
from ratebench.analysis.load import RunData, RunFolderError, load_run
from ratebench.analysis.partial import keep_completed_phases
from ratebench.analysis.summary import summarize_run
from ratebench.analysis.runsummary import Measure
from ratebench.analysis.tierlatency import tier_latencies
from ratebench.analysis.verdict import Thresholds, Verdict

__all__ = ["EXIT_CHECK_FAILED", "EXIT_PARTIAL", "EXIT_PASSED", "EXIT_UNUSABLE", "RunFolderError", "VerifyResult",
           "analyse_run", "exit_code", "verify_run", "write_result"]

# verify-bound's exit status
EXIT_PASSED = 0  # a complete run, every check passed
EXIT_CHECK_FAILED = 1  # a check failed (complete or partial run)
EXIT_UNUSABLE = 2  # the run folder cannot be verified (or, without --partial, the run is not complete)
EXIT_PARTIAL = 4  # a partial run (--partial): every check of its completed phases passed; never a pass


def exit_code(verdict: Verdict) -> int:
    """verify-bound's exit status for a verdict: a partial verdict never exits 0."""
    if verdict.failures:
        return EXIT_CHECK_FAILED
    return EXIT_PARTIAL if verdict.partial else EXIT_PASSED


@dataclass
class VerifyResult:
    verdict: Verdict
    run: RunData
    stage_s: dict[str, float] = field(default_factory=dict)  # wall time per stage
    written: list[Path] = field(default_factory=list)


def _manifest_summary(m: dict) -> dict:
    keys = ("run_id", "profile_name", "state", "ratebench_version", "vllm_version", "git_commit",
            "patch_sha256", "python", "started_unix_s", "ended_unix_s", "machine")
    out = {k: m.get(k) for k in keys if k in m}
    out["engines"] = {
        n: {k: e.get(k) for k in ("kind", "feature", "async_scheduling", "default_tps", "user_tps", "flags")}
        for n, e in (m.get("engines") or {}).items()
    }
    return out


@contextlib.contextmanager
def _no_cyclic_gc():
    """Pause the cyclic garbage collector: a run's millions of chunk times and thousands of rows
    and checks are allocated in bursts that would trigger full collections over and over, and
    verification makes no reference cycles worth collecting meanwhile (plain refcounting still frees)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def analyse_run(run_dir: str | Path, thresholds: Thresholds | None = None, *, partial: bool = False) -> VerifyResult:
    """Load and check a run folder; writes nothing. Raises RunFolderError for unusable input.

    ``partial``: a run whose state is not ``complete`` is checked on its completed phases and its
    verdict is marked partial (a complete run is checked as without it)."""
    with _no_cyclic_gc():
        return _analyse_run(run_dir, thresholds or Thresholds(), partial)


def _analyse_run(run_dir: str | Path, th: Thresholds, partial: bool) -> VerifyResult:
    stages: dict[str, float] = {}
    t0 = time.perf_counter()
    run = load_run(run_dir, require_complete=not partial)
    state = run.manifest.get("state")
    missing = []
    if state != "complete":
        run, missing = keep_completed_phases(run)
        if not run.phases:
            why = run.manifest.get("partial_reason")
            raise RunFolderError(f"{run.run_dir}: run state is {state!r}" + (f" ({why})" if why else "")
                                 + f" and no scenario phase completed; {len(missing)} phases missing"
                                 + "".join(f"\n  {m.label}: {m.why}" for m in missing))
        run.warnings.insert(0, f"partial run (state {state!r}"
                               + (f": {run.manifest['partial_reason']}" if run.manifest.get("partial_reason") else "")
                               + f"): checked {len(run.phases)} completed phases, {len(missing)} missing; the "
                               "missing phases' engine events still count in each engine's whole-file bound")
    stages["load"] = time.perf_counter() - t0
    stages.update({f"load: {k}": v for k, v in run.stage_s.items()})
    t1 = time.perf_counter()
    summary = summarize_run(run, Measure(burst_ns=th.burst_ns, emit_tolerance_ns=th.emit_tolerance_ns))
    stages["analyse"] = time.perf_counter() - t1
    stages.update({f"analyse: {k}": v for k, v in summary.stage_s.items()})
    t2 = time.perf_counter()
    checks = build_checks(run, summary, th)
    rows = [summary.rows[k] for k in sorted(summary.rows, key=lambda k: (k[0], k[1]))]
    failed = {(c.scenario, c.phase, c.engine, c.user) for c in checks if c.passed is False}
    for r in rows:
        r.passed = (r.scenario, r.phase, r.engine, r.user) not in failed
    verdict = Verdict(
        run_dir=str(run.run_dir), run_id=run.manifest.get("run_id"), profile_name=run.manifest.get("profile_name"),
        manifest_summary=_manifest_summary(run.manifest), thresholds=th, engine_steps=summary.engine_steps,
        rows=rows, engine_bounds=summary.engine_bounds, overheads=summary.overheads, checks=checks, waiting=summary.waiting,
        warnings=run.warnings + summary.warnings, partial=state != "complete", missing_phases=missing,
        engine_async_scheduling={name: bool(t.events.meta["async_scheduling"]) for name, t in run.traces.items()
                                 if t.events.meta.get("async_scheduling") is not None},
    )
    stages["checks"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    verdict.tier_latency = tier_latencies(run, summary)
    stages["tier latency"] = time.perf_counter() - t3
    return VerifyResult(verdict, run, stages)


def write_result(result: VerifyResult, *, plots: bool = True, max_plot_users: int = 8) -> list[Path]:
    """Write verdict.json, report.md, report.html and plots/*.png into the run folder."""
    with _no_cyclic_gc():
        return _write_result(result, plots=plots, max_plot_users=max_plot_users)


def _write_result(result: VerifyResult, *, plots: bool, max_plot_users: int) -> list[Path]:
    from ratebench.outputs.exporters import write_all

    written = write_all(result.verdict, result.run, result.run.run_dir, plots=plots, max_plot_users=max_plot_users,
                        stage_s=result.stage_s)
    result.written = written
    return written


def verify_run(
    run_dir: str | Path,
    thresholds: Thresholds | None = None,
    *,
    write: bool = True,
    plots: bool = True,
    max_plot_users: int = 8,
    partial: bool = False,
) -> Verdict:
    """Check a run folder and (by default) write its verdict, report and plots into it."""
    result = analyse_run(run_dir, thresholds, partial=partial)
    if write:
        write_result(result, plots=plots, max_plot_users=max_plot_users)
    return result.verdict
