"""A run: run folder, manifest, engines, scenarios, and the verdict at the end.

The run folder follows ``docs/run-folder.md``. Each scenario is a list of phases,
each on one engine; :class:`Run` composes the manifest (:mod:`ratebench.manifest`),
the engines (:mod:`ratebench.engineset`: which run before each phase, started and
stopped) and the workload driver. The engines' specs and the phases come from
``ratebench.plan``, which ``ratebench run --dry-run`` prints. The stock engine
(overhead scenario) runs the real pristine vLLM through an import overlay (see
``ratebench.engine``): the installed tree stays patched throughout. An interrupted
run (Ctrl-C, SIGTERM) is marked ``partial`` and never reported as a pass; no engine
process outlives the run.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console

from ratebench.balancer import BalancerError
from ratebench.engine import EngineError
from ratebench.engineset import EXTERNAL_ENGINE, AttachError, EngineSet
from ratebench.runrecords import PhaseRecord
from ratebench.http1 import STALL_ERROR
from ratebench.manifest import Manifest
from ratebench.models import SOURCE_TINY, model_choice, model_max_len, stop_token_ids
from ratebench.plan import plan_phases, scenarios_for
from ratebench.profiles import Profile
from ratebench.scenarios import ScenarioContext, fleet_members
from ratebench.workload import Driver, WorkloadError

EXIT_OK = 0
EXIT_VERDICT_FAILED = 1
EXIT_RUN_FAILED = 3
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class RunError(RuntimeError):
    """A run that cannot start (patch, model, endpoint): the message says what to do."""


class StalledRun(RuntimeError):
    """A phase ended with streams the engine left without a byte for the profile's stall_timeout_s: the
    run stops there (every later phase would wait as long), and the phases run so far are verified."""


@dataclass
class RunOptions:
    results_dir: Path = Path("results")
    endpoint: str | None = None  # attach to a running server instead of launching engines
    events_file: Path | None = None  # that server's engine event file
    model: str | None = None  # overrides the profile's model (folder or id)
    use_patch: bool = True  # False: development on stock vLLM (limiter flags left out)
    verify: bool = True
    live: bool = True
    # promise 7 and the flags, checked with no engine before the engines start (ratebench.prestart)
    check_before_engines: bool = True


@dataclass
class RunOutcome:
    run_dir: Path
    state: str  # complete | partial | failed
    exit_code: int
    reason: str | None = None
    verdict: Any = None
    engine_error: EngineError | None = None
    phases: list[PhaseRecord] = field(default_factory=list)


def new_run_dir(results_dir: Path, profile_name: str, run_id: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = results_dir / profile_name / f"{stamp}-{run_id}"
    path.mkdir(parents=True, exist_ok=False)
    return path


class Run:
    """One run of a profile: its folder, manifest, engines and phases. Use :func:`run_profile`."""

    def __init__(self, profile: Profile, options: RunOptions, console: Console) -> None:
        self.profile = profile
        self.options = options
        self.console = console
        self.run_id = secrets.token_hex(4)
        self.run_dir = new_run_dir(options.results_dir, profile.name, self.run_id)
        self.driver = Driver(self.run_id, console=console, live=options.live)
        self.manifest = Manifest(self.run_dir)
        self.engine_set = EngineSet(profile, self.run_dir, self.manifest, console, use_patch=options.use_patch)
        self.model_dir: Path | None = None
        # wall seconds per stage (printed at the end of the run and kept in manifest.json's stage_s)
        self.stage_s: dict[str, float] = {}

    def add_stage(self, name: str, seconds: float) -> None:
        self.stage_s[name] = self.stage_s.get(name, 0.0) + seconds

    @property
    def phases(self) -> list[PhaseRecord]:
        return self.manifest.phases

    def start_manifest(self) -> None:
        self.manifest.start(self.profile, self.run_id, endpoint=self.options.endpoint,
                            use_patch=self.options.use_patch)

    def on_phase(self, record: PhaseRecord) -> None:
        self.manifest.add_phase(record, self.driver.records)

    # ---- preparation ----------------------------------------------------------------

    def prepare(self) -> None:
        from ratebench import patching

        if self.options.endpoint is None and self.options.use_patch:
            try:
                state = patching.patch_status().overall
                if state == "pristine":
                    self.console.print("[bold]patch[/]: applying the limiter patch to vLLM")
                    patching.apply_patch()
                elif state != "patched":
                    patching.apply_patch()  # refuses with a message naming the modified files
            except patching.PatchError as exc:
                raise RunError(str(exc)) from exc
        if self.options.endpoint is not None:
            return
        choice = model_choice(self.profile, self.options.model)
        if choice.source == SOURCE_TINY:
            from ratebench.tinymodel import ensure_tiny_model

            self.console.print("[bold]model[/]: generating (or reusing) the tiny Qwen3")
            ensure_tiny_model()
            choice = model_choice(self.profile, self.options.model)
        self.engine_set.model_path, self.model_dir = choice.path, choice.local_dir
        # where the model's answers end by themselves, and how long they may grow: what reconciliation holds
        # an answer's finish against (an answer cut short says "stop" or "length" all the same)
        folder = choice.files_dir
        if folder is not None:
            self.manifest.record_model(choice.path, stop_token_ids(folder), model_max_len(folder, self.profile))
        else:
            self.manifest.record_model(choice.path)

    def check_before_engines(self) -> None:
        """Promise 7 and the limiter's flags, with no engine (``ratebench.prestart``)."""
        from ratebench.prestart import check_before_engines

        t0 = time.monotonic()
        check_before_engines(self.run_dir, self.profile.engine.env, self.console)
        self.add_stage("before the engines (feature off, flags)", time.monotonic() - t0)

    def scenarios_to_run(self):
        specs, skipped = scenarios_for(self.profile, self.options.endpoint)
        self.manifest.record_skipped(skipped)
        return specs

    def execute(self) -> None:
        specs = self.scenarios_to_run()
        plans = plan_phases(specs)
        # the plan, so that verify-bound --partial can name the phases an interrupted run never started
        # (a fleet's phase is recorded once per member engine)
        self.manifest.record_plan([
            {"scenario": plan.scenario, "phase": plan.phase, "engine": engine}
            for _, plan in plans
            for engine in ([EXTERNAL_ENGINE] if self.options.endpoint is not None else
                           fleet_members(plan.engine) or [plan.engine])])
        self.manifest.write()
        engines = self.engine_set
        if self.options.endpoint is not None:
            engines.attach(self.options.endpoint, self.options.events_file)
        current = None
        for k, (spec, plan) in enumerate(plans):
            if self.options.endpoint is None:
                engines.arrange_engines([p.engine for _, p in plans[k:]])
            if spec.name != current:
                current = spec.name
                self.console.print(f"[bold cyan]scenario[/] {spec.name} ({spec.kind})")
            ctx = ScenarioContext(profile=self.profile, spec=spec, driver=self.driver, on_phase=self.on_phase,
                                  model_dir=self.model_dir, cpu_probe=engines.cpu_probe,
                                  stop_member=engines.fail_member)
            t0 = time.monotonic()
            seen = len(self.driver.records)
            try:
                asyncio.run(plan.run(ctx, engines.refs[plan.engine]))
            finally:
                self.add_stage(f"scenario {spec.name}", time.monotonic() - t0)
            stalled = [r for r in self.driver.records[seen:] if (r.error or "").startswith(STALL_ERROR)]
            if stalled:
                users = ", ".join(sorted({r.user or "?" for r in stalled}))
                raise StalledRun(
                    f"{len(stalled)} stream{'s' * (len(stalled) > 1)} of {spec.name}/{plan.phase} on {plan.engine} "
                    f"stalled: no byte from the server for {self.profile.stall_timeout_s:g} s (users {users}); a "
                    "limiter that never wakes a user fails promise 3, so the run stops here and the phases run so "
                    "far are verified")
            engines.stop_unneeded({p.engine for _, p in plans[k + 1:]})

    def finish(self, state: str, reason: str | None) -> None:
        if self.options.endpoint is not None and self.options.events_file is not None:
            dest = self.run_dir / "engines" / EXTERNAL_ENGINE / "events.rbev"
            dest.parent.mkdir(parents=True, exist_ok=True)
            time.sleep(0.3)  # the engine flushes its events at least every 100 ms
            try:
                shutil.copyfile(self.options.events_file, dest)
            except OSError as exc:
                self.manifest.engines[EXTERNAL_ENGINE].events_file = None
                reason = (reason + "; " if reason else "") + f"events file not copied: {exc}"
        self.manifest.finish(state, reason, self.driver.records)


def _sigterm_as_sigint(signum: int, frame: Any) -> None:
    """SIGTERM stops a run as Ctrl-C does: partial, engines stopped. A process started in the background
    (``cmd &``, nohup, a CI script) inherits SIGINT ignored, so raising SIGINT would do nothing there:
    the run then stops by the same KeyboardInterrupt directly."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        raise KeyboardInterrupt
    signal.raise_signal(signal.SIGINT)


def run_profile(profile: Profile, options: RunOptions | None = None, console: Console | None = None) -> RunOutcome:
    """Run every scenario of a profile; always writes the run folder and stops every engine."""
    options = options or RunOptions()
    console = console or Console(stderr=True)
    run = Run(profile, options, console)
    run.start_manifest()
    console.print(f"[bold]run[/] {run.run_dir}")
    old_term = signal.signal(signal.SIGTERM, _sigterm_as_sigint)
    state, reason, code = "complete", None, EXIT_OK
    engine_error: EngineError | None = None
    t_run = time.monotonic()
    try:
        t0 = time.monotonic()
        run.prepare()
        run.add_stage("prepare (patch, model)", time.monotonic() - t0)
        if options.endpoint is None and options.use_patch and options.check_before_engines:
            run.check_before_engines()
        run.execute()
    except KeyboardInterrupt:
        state, reason, code = "partial", "interrupted (SIGINT or SIGTERM)", EXIT_INTERRUPTED
    except EngineError as exc:
        engine_error = exc
        state, reason, code = "partial", f"engine failed: {exc}", EXIT_RUN_FAILED
    except StalledRun as exc:
        state, reason, code = "partial", str(exc), EXIT_VERDICT_FAILED
        console.print(f"[bold red]stopped:[/] {exc}")
    except (RunError, AttachError, WorkloadError, BalancerError) as exc:
        state, reason, code = "partial", str(exc), EXIT_RUN_FAILED
    except Exception as exc:  # noqa: BLE001 - recorded, then re-raised below for the traceback
        state, reason, code = "partial", f"{type(exc).__name__}: {exc}", EXIT_RUN_FAILED
        raise
    finally:
        # A second Ctrl-C must not cut the shutdown short: it is bounded by the grace period.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            run.engine_set.stop_all(settle=state == "complete")
            if state != "complete" and not run.phases:
                state = "failed"
            for name, seconds in run.engine_set.stage_s.items():
                run.add_stage(name, seconds)
            run.manifest.record_stages(run.stage_s)
            run.finish(state, reason)
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
    outcome = RunOutcome(run_dir=run.run_dir, state=state, exit_code=code, reason=reason, phases=run.phases,
                         engine_error=engine_error)
    if options.verify and (state == "complete" or (state == "partial" and code == EXIT_VERDICT_FAILED)):
        # a stalled run is verified too, as far as it went: its verdict fails the stalled streams
        t0 = time.monotonic()
        outcome.verdict, outcome.exit_code = verify_at_end(run.run_dir, console, partial=state == "partial")
        if state == "partial" and outcome.exit_code == EXIT_OK:
            outcome.exit_code = EXIT_VERDICT_FAILED  # never a pass: the run did not finish
        run.add_stage("verify (verdict, report, plots)", time.monotonic() - t0)
    elif state == "partial" and options.verify:
        console.print(f"[bold]verify[/]: the run did not complete; `ratebench verify-bound --partial {run.run_dir}` "
                      "checks the phases that did")
    print_stages(run.stage_s, time.monotonic() - t_run, console)
    return outcome


def print_stages(stage_s: dict[str, float], total_s: float, console: Console) -> None:
    """Where the run's time went: one line per stage, the scenarios in the order they ran (the
    phases, the waits for users' bursts to refill and the prompts they tokenized)."""
    if not stage_s:
        return
    parts = [f"{name} {seconds:.0f} s" for name, seconds in stage_s.items() if seconds >= 0.5]
    other = total_s - sum(stage_s.values())
    if other >= 0.5:
        parts.append(f"other {other:.0f} s")
    console.print(f"[bold]time[/] {total_s:.0f} s: " + "; ".join(parts), highlight=False)


def verify_at_end(run_dir: Path, console: Console, partial: bool = False) -> tuple[Any, int]:
    """The verifier's verdict on a complete run (or, ``partial``, on the phases a stopped run ran), written
    into the run folder."""
    from ratebench import verify
    from ratebench.outputs.exporters import described

    console.print(f"[bold]verify[/]: checking the run ({described()})")
    try:
        verdict = verify.verify_run(run_dir, partial=partial)
    except verify.RunFolderError as exc:
        console.print(f"[bold red]the verifier cannot use this run:[/] {exc}")
        return None, EXIT_RUN_FAILED
    return verdict, (EXIT_OK if verdict.passed else EXIT_VERDICT_FAILED)
