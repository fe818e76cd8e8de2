"""A run: run folder, manifest, engines, scenarios, and the verdict at the end.

The run folder follows ``docs/run-folder.md``. Each scenario is a list of phases,
each on one engine. Before a phase, its engine runs, with as many of the engines
of the following phases as ``profile.max_engines`` allows (started together on a
CPU; one after another on a GPU, where vLLM sizes its KV cache from the memory
free while it starts); an engine stops as soon as no later phase needs it. The
engines' specs and the phases come from ``ratebench.plan``, which
``ratebench run --dry-run`` prints. The stock engine (overhead scenario) runs the
real pristine vLLM through an import overlay (see ``ratebench.engine``): the
installed tree stays patched throughout. An interrupted run (Ctrl-C, SIGTERM) is
marked ``partial`` and never reported as a pass; no engine process outlives the run.
"""

from __future__ import annotations

import asyncio
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from ratebench import __version__
from ratebench._io import atomic_write_json
from ratebench.engine import (
    EngineError,
    EngineSpec,
    RunningEngine,
    WarmUpPlan,
    groups_cpu_s,
    launch_engine,
    machine_busy_cpu_s,
    records_events,
    uses_cpu_async_overlay,
    wait_ready,
    warm_up,
)
from ratebench.events import EventFileError, read_engine_events, write_client_records
from ratebench.models import SOURCE_TINY, model_choice
from ratebench.plan import engine_spec, engines_wanted, plan_phases, scenarios_for
from ratebench.profiles import Profile
from ratebench.scenarios import (
    ROLE_FEATURE_ON,
    EngineRef,
    PhaseRecord,
    ScenarioContext,
    engine_name,
)
from ratebench.workload import Driver, WorkloadError

EXIT_OK = 0
EXIT_VERDICT_FAILED = 1
EXIT_RUN_FAILED = 3
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXTERNAL_ENGINE = "external"
EVENTS_SETTLE_S = 0.5


class RunError(RuntimeError):
    """A run that cannot start (patch, model, endpoint): the message says what to do."""


@dataclass
class RunOptions:
    results_dir: Path = Path("results")
    endpoint: str | None = None  # attach to a running server instead of launching engines
    events_file: Path | None = None  # that server's engine event file
    model: str | None = None  # overrides the profile's model (folder or id)
    use_patch: bool = True  # False: development on stock vLLM (limiter flags left out)
    verify: bool = True
    live: bool = True


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


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            gpu = [line.strip() for line in out.stdout.splitlines() if line.strip()] or None
        except (OSError, subprocess.SubprocessError):
            gpu = None
    return {"hostname": socket.gethostname(), "cpu": cpu, "cpus": os.cpu_count(), "gpu": gpu,
            "platform": platform.platform()}


def git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


class Run:
    """One run of a profile. Use :func:`run_profile`."""

    def __init__(self, profile: Profile, options: RunOptions, console: Console) -> None:
        self.profile = profile
        self.options = options
        self.console = console
        self.run_id = secrets.token_hex(4)
        self.run_dir = new_run_dir(options.results_dir, profile.name, self.run_id)
        self.driver = Driver(self.run_id, console=console, live=options.live)
        self.phases: list[PhaseRecord] = []
        self.engines: dict[str, RunningEngine] = {}
        self.refs: dict[str, EngineRef] = {}
        self.model_path: str | None = None
        self.model_dir: Path | None = None
        self.manifest: dict[str, Any] = {}
        self._pristine_files: dict[str, bytes | None] | None = None

    # ---- files ----------------------------------------------------------------------

    def write_manifest(self) -> None:
        atomic_write_json(self.run_dir / "manifest.json", self.manifest)

    def on_phase(self, record: PhaseRecord) -> None:
        self.phases.append(record)
        atomic_write_json(self.run_dir / "scenarios.json", [asdict(p) for p in self.phases])
        write_client_records(self.run_dir / "requests.jsonl", self.driver.records)

    def start_manifest(self) -> None:
        from ratebench import patching

        try:
            vllm_version = patching.installed_vllm_version()
        except Exception:  # noqa: BLE001 - reported as unknown, the run decides later
            vllm_version = None
        try:
            patch_hash = patching.patch_sha256() if self.options.use_patch else None
        except Exception:  # noqa: BLE001
            patch_hash = None
        self.manifest = {
            "ratebench_version": __version__,
            "run_id": self.run_id,
            "profile_name": self.profile.name,
            "profile": self.profile.to_json(),
            "state": "running",
            "partial_reason": None,
            "started_unix_s": time.time(),
            "ended_unix_s": None,
            "started_monotonic_ns": time.monotonic_ns(),
            "ended_monotonic_ns": None,
            "git_commit": git_commit(),
            "python": platform.python_version(),
            "vllm_version": vllm_version,
            "patch_sha256": patch_hash,
            "machine": machine_info(),
            "endpoint": self.options.endpoint,
            "model_path": None,
            "engines": {},
            "skipped_scenarios": [],
            "command": sys.argv,
        }
        self.write_manifest()

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
        self.model_path, self.model_dir = choice.path, choice.local_dir
        self.manifest["model_path"] = self.model_path

    def pristine_files(self) -> dict[str, bytes | None]:
        """The pristine content of the files the patch touches (read once, for stock engines)."""
        if self._pristine_files is None:
            from ratebench import patching

            self._pristine_files = patching.read_pristine_files()
        return self._pristine_files

    def engine_spec(self, name: str) -> EngineSpec:
        return engine_spec(self.profile, name, self.model_path or "", use_patch=self.options.use_patch,
                           pristine_files=self.pristine_files)

    def warm_up_plan(self) -> WarmUpPlan:
        """The warm-up wave: the profile's max_num_seqs short streams at once, and one prompt of
        2.5 x max_num_batched_tokens (chunked prefill), within max_model_len."""
        e, m = self.profile.engine, self.profile.model
        plan = WarmUpPlan(streams=e.max_num_seqs, long_prompt_tokens=None)
        if e.enable_chunked_prefill is not False:
            chunk = e.max_num_batched_tokens or 2048
            room = (m.max_model_len or 4096) - plan.max_tokens - 1
            plan.long_prompt_tokens = max(1, min(chunk * 5 // 2, room))
        return plan

    def _launch(self, name: str) -> RunningEngine:
        spec = self.engine_spec(name)
        self.manifest["engines"][name] = {
            "kind": spec.kind, "feature": spec.feature, "async_scheduling": spec.async_scheduling,
            "default_tps": spec.default_tps, "user_tps": spec.user_tps if spec.feature else None,
            "flags": spec.all_flags(), "events_file": None, "log_file": f"engines/{name}/engine.log",
            "endpoint": None, "started_monotonic_ns": time.monotonic_ns(), "ready_monotonic_ns": None,
            "stopped_monotonic_ns": None, "killed_pids": [],
            "stock_overlay": spec.pristine_files is not None, "cpu_async_overlay": uses_cpu_async_overlay(spec),
            "record_events": records_events(spec), "warm_up": None,
        }
        self.write_manifest()
        self.console.print(f"[bold]engine[/] {name}: starting ({spec.kind} vLLM, "
                           f"{'limiter on' if spec.feature else 'limiter off'}, "
                           f"{'' if spec.record_events or spec.kind != 'patched' else 'no engine events, '}"
                           f"{'async' if spec.async_scheduling else 'sync'} scheduling)")
        engine = launch_engine(spec, self.run_dir / "engines" / name)
        self.engines[name] = engine
        self.manifest["engines"][name].update(endpoint=engine.endpoint, pid=engine.process.pid)
        return engine

    def _ready(self, engines: list[RunningEngine], t0: float) -> None:
        wait_ready(engines, self.profile.startup_timeout_s, self.console)
        plan = self.warm_up_plan()
        for engine in engines:
            result = warm_up(engine, plan)
            name = engine.spec.name
            entry = self.manifest["engines"][name]
            entry["warm_up"] = asdict(result)
            entry["ready_monotonic_ns"] = time.monotonic_ns()
            if engine.events_path is not None:
                entry["events_file"] = f"engines/{name}/events.rbev"
            self.refs[name] = EngineRef(name=name, endpoint=engine.endpoint, model=engine.spec.served_name,
                                        feature=engine.spec.feature, kind=engine.spec.kind, pgid=engine.pgid)
            self.console.print(f"[bold]engine[/] {name}: ready at {engine.endpoint} "
                               f"({time.monotonic() - t0:.0f} s; warm-up {result.requests} requests, "
                               f"{result.seconds:.1f} s{', timed out' if result.timed_out else ''})")
        self.write_manifest()

    def cpu_probe(self) -> tuple[float, float]:
        """(CPU-seconds the machine has been busy, CPU-seconds this run's processes have used): the
        driver and every engine it runs. Their difference over a phase is what other processes took."""
        own = os.times()
        engines = groups_cpu_s({e.pgid for e in self.engines.values()}) if self.engines else 0.0
        return machine_busy_cpu_s(), own.user + own.system + engines

    def ensure_engines(self, names: list[str]) -> None:
        """Start the engines not running yet and wait until they serve: all at once, or one after
        another on a GPU (vLLM sizes its KV cache from the GPU memory free while it starts; an engine
        starting beside it skews that)."""
        missing = [n for n in dict.fromkeys(names) if n not in self.engines]
        if not missing:
            return
        for wave in ([n] for n in missing) if self.profile.device == "cuda" else [missing]:
            t0 = time.monotonic()
            self._ready([self._launch(n) for n in wave], t0)

    def stop(self, name: str, *, settle: bool = True) -> None:
        engine = self.engines.pop(name, None)
        self.refs.pop(name, None)
        if engine is None:
            return
        if settle:
            # The engine flushes its events at least every 100 ms: let the last ones land.
            time.sleep(EVENTS_SETTLE_S)
        killed = engine.stop(self.profile.shutdown_grace_s)
        entry = self.manifest["engines"].get(name, {})
        entry["stopped_monotonic_ns"] = time.monotonic_ns()
        entry["killed_pids"] = killed
        entry["exit_code"] = engine.process.returncode
        self._record_effective_settings(name, engine, entry)
        self.write_manifest()

    def _record_effective_settings(self, name: str, engine: RunningEngine, entry: dict[str, Any]) -> None:
        """What the engine says it ran with (its event file header), beside what was asked."""
        if uses_cpu_async_overlay(engine.spec):  # what the CPU async overlay saw inside the engine
            from ratebench.cpu_async import read_stats, stats_problems

            entry["cpu_async"] = read_stats(engine.folder / "cpu-async" / "stats")
            for problem in stats_problems(entry["cpu_async"]):
                msg = f"engine {name}: CPU async overlay: {problem}"
                entry.setdefault("warnings", []).append(msg)
                self.manifest.setdefault("warnings", []).append(msg)
                self.console.print(f"[yellow]warning:[/] {msg}")
        if engine.events_path is None or not engine.events_path.is_file():
            return
        try:
            meta = read_engine_events(engine.events_path).meta
        except EventFileError as exc:
            entry["events_error"] = str(exc)
            return
        entry["engine_meta"] = meta
        effective = meta.get("async_scheduling")
        if effective is not None and bool(effective) != engine.spec.async_scheduling:
            # vLLM's CPU platform turns --async-scheduling off without a word.
            msg = (f"engine {name}: asked for {'async' if engine.spec.async_scheduling else 'sync'} scheduling, "
                   f"the engine ran {'async' if effective else 'sync'} scheduling")
            entry["warning"] = msg
            self.manifest.setdefault("warnings", []).append(msg)
            self.console.print(f"[yellow]warning:[/] {msg}")

    def stop_all(self, *, settle: bool = True) -> None:
        for name in list(self.engines):
            try:
                self.stop(name, settle=settle)
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                self.console.print(f"[red]engine {name}: stop failed: {exc}[/]")

    def attach(self) -> None:
        """--endpoint: the one external server stands in for the feature-on engine."""
        endpoint = self.options.endpoint.rstrip("/")
        try:
            r = httpx.get(f"{endpoint}/v1/models", timeout=10.0)
            r.raise_for_status()
            models = [m["id"] for m in r.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise RunError(f"--endpoint {endpoint}: /v1/models did not answer ({exc}); is the server up?") from exc
        served = self.profile.model.served_name
        model = served if served in models else (models[0] if models else None)
        if model is None:
            raise RunError(f"--endpoint {endpoint}: the server lists no model")
        lim = self.profile.limits
        self.manifest["engines"][EXTERNAL_ENGINE] = {
            "kind": "external", "feature": True, "async_scheduling": None, "default_tps": lim.default_tps,
            "user_tps": dict(lim.user_tps), "flags": None,
            "events_file": f"engines/{EXTERNAL_ENGINE}/events.rbev" if self.options.events_file else None,
            "log_file": None, "endpoint": endpoint, "served_model": model,
        }
        self.write_manifest()
        ref = EngineRef(name=EXTERNAL_ENGINE, endpoint=endpoint, model=model, feature=True, kind="external")
        for mode in self.profile.scheduling:
            self.refs[engine_name(ROLE_FEATURE_ON, mode)] = ref

    # ---- the run ----------------------------------------------------------------------

    def scenarios_to_run(self):
        specs, skipped = scenarios_for(self.profile, self.options.endpoint)
        self.manifest["skipped_scenarios"].extend(skipped)
        return specs

    def arrange_engines(self, upcoming: list[str]) -> None:
        """Have the next phase's engine running, and as many of the following ones as
        profile.max_engines allows (started together); stop the others."""
        wanted = engines_wanted(upcoming, self.profile.max_engines)
        for name in list(self.engines):
            if name not in wanted:
                self.stop(name)
        self.ensure_engines([n for n in wanted if n not in self.engines])

    def execute(self) -> None:
        specs = self.scenarios_to_run()
        plans = plan_phases(specs)
        # the plan, so that verify-bound --partial can name the phases an interrupted run never started
        self.manifest["planned_phases"] = [
            {"scenario": plan.scenario, "phase": plan.phase,
             "engine": EXTERNAL_ENGINE if self.options.endpoint is not None else plan.engine}
            for _, plan in plans]
        self.write_manifest()
        if self.options.endpoint is not None:
            self.attach()
        current = None
        for k, (spec, plan) in enumerate(plans):
            if self.options.endpoint is None:
                self.arrange_engines([p.engine for _, p in plans[k:]])
            if spec.name != current:
                current = spec.name
                self.console.print(f"[bold cyan]scenario[/] {spec.name} ({spec.kind})")
            ctx = ScenarioContext(profile=self.profile, spec=spec, driver=self.driver, on_phase=self.on_phase,
                                  model_dir=self.model_dir, cpu_probe=self.cpu_probe)
            asyncio.run(plan.run(ctx, self.refs[plan.engine]))
            later = {p.engine for _, p in plans[k + 1:]}
            for name in list(self.engines):
                if name not in later:
                    self.stop(name)

    def finish(self, state: str, reason: str | None) -> None:
        if self.options.endpoint is not None and self.options.events_file is not None:
            dest = self.run_dir / "engines" / EXTERNAL_ENGINE / "events.rbev"
            dest.parent.mkdir(parents=True, exist_ok=True)
            time.sleep(0.3)  # the engine flushes its events at least every 100 ms
            try:
                shutil.copyfile(self.options.events_file, dest)
            except OSError as exc:
                self.manifest["engines"][EXTERNAL_ENGINE]["events_file"] = None
                reason = (reason + "; " if reason else "") + f"events file not copied: {exc}"
        write_client_records(self.run_dir / "requests.jsonl", self.driver.records)
        atomic_write_json(self.run_dir / "scenarios.json", [asdict(p) for p in self.phases])
        self.manifest.update(state=state, partial_reason=reason, ended_unix_s=time.time(),
                             ended_monotonic_ns=time.monotonic_ns())
        self.write_manifest()


def _sigterm_as_sigint(signum: int, frame: Any) -> None:
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
    try:
        run.prepare()
        run.execute()
    except KeyboardInterrupt:
        state, reason, code = "partial", "interrupted (SIGINT or SIGTERM)", EXIT_INTERRUPTED
    except EngineError as exc:
        engine_error = exc
        state, reason, code = "partial", f"engine failed: {exc}", EXIT_RUN_FAILED
    except (RunError, WorkloadError) as exc:
        state, reason, code = "partial", str(exc), EXIT_RUN_FAILED
    except Exception as exc:  # noqa: BLE001 - recorded, then re-raised below for the traceback
        state, reason, code = "partial", f"{type(exc).__name__}: {exc}", EXIT_RUN_FAILED
        raise
    finally:
        # A second Ctrl-C must not cut the shutdown short: it is bounded by the grace period.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            run.stop_all(settle=state == "complete")
            if state != "complete" and not run.phases:
                state = "failed"
            run.finish(state, reason)
        finally:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
    outcome = RunOutcome(run_dir=run.run_dir, state=state, exit_code=code, reason=reason, phases=run.phases,
                         engine_error=engine_error)
    if state == "complete" and options.verify:
        outcome.verdict, outcome.exit_code = verify_at_end(run.run_dir, console)
    elif state == "partial" and options.verify:
        console.print(f"[bold]verify[/]: the run did not complete; `ratebench verify-bound --partial {run.run_dir}` "
                      "checks the phases that did")
    return outcome


def verify_at_end(run_dir: Path, console: Console) -> tuple[Any, int]:
    """The verifier's verdict on a complete run, written into the run folder."""
    from ratebench import verify

    console.print("[bold]verify[/]: checking the run (verdict.json, report.md, report.html, plots/)")
    try:
        verdict = verify.verify_run(run_dir)
    except verify.RunFolderError as exc:
        console.print(f"[bold red]the verifier cannot use this run:[/] {exc}")
        return None, EXIT_RUN_FAILED
    return verdict, (EXIT_OK if verdict.passed else EXIT_VERDICT_FAILED)
