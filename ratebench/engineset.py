"""The engines of one run: launched, made ready, arranged around the phases, stopped.

Before a phase, its engine runs, with as many of the engines of the following
phases as ``profile.max_engines`` allows (started together on a CPU; one after
another on a GPU, where vLLM sizes its KV cache from the memory free while it
starts); an engine stops as soon as no later phase needs it. Each engine's entry in
the manifest (flags, times, warm-up, what it says it ran with) is kept here.
With ``--endpoint`` the one external server stands in for the feature-on engine.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from ratebench.engine import (
    EngineSpec,
    RunningEngine,
    WarmUpPlan,
    launch_engine,
    records_events,
    uses_cpu_async_overlay,
    wait_ready,
    warm_up,
)
from ratebench.events import EventFileError, read_engine_events
from ratebench.runrecords import BalancerEntry, EngineEntry
from ratebench.manifest import Manifest
from ratebench.plan import engine_spec, engines_wanted
from ratebench.procstats import groups_cpu_s, machine_busy_cpu_s
from ratebench.profiles import Profile
from ratebench.scenarios import ROLE_FEATURE_ON, EngineRef, engine_name, fleet_members

EXTERNAL_ENGINE = "external"
EVENTS_SETTLE_S = 0.5
FAILOVER_GRACE_S = 2.0  # a fleet member stopped for failover: SIGINT, then at most this long before SIGKILL


class AttachError(RuntimeError):
    """The --endpoint server cannot stand in for the feature-on engine: the message says why."""


class EngineSet:
    """The running engines of a run (:attr:`running`) and the references phases use (:attr:`refs`)."""

    def __init__(self, profile: Profile, run_dir: Path, manifest: Manifest, console: Console, *,
                 use_patch: bool = True) -> None:
        self.profile = profile
        self.run_dir = run_dir
        self.manifest = manifest
        self.console = console
        self.use_patch = use_patch
        self.model_path: str | None = None
        self.running: dict[str, RunningEngine] = {}
        self.refs: dict[str, EngineRef] = {}
        self.balancers: dict[str, Any] = {}  # fleet name -> its RunningBalancer (ratebench/balancer.py)
        self._stale: set[str] = set()
        self._stopped_cpu_s = 0.0  # CPU-seconds the engines stopped so far had used (cpu_probe)  # fleets one of whose members was stopped (failover)
        self._pristine_files: dict[str, bytes | None] | None = None
        # wall seconds spent starting engines (until they serve), warming them up, stopping them
        self.stage_s: dict[str, float] = {"engines start": 0.0, "engines warm-up": 0.0, "engines stop": 0.0}

    # ---- specs ------------------------------------------------------------------------

    def pristine_files(self) -> dict[str, bytes | None]:
        """The pristine content of the files the patch touches (read once, for stock engines)."""
        if self._pristine_files is None:
            from ratebench import patching

            self._pristine_files = patching.read_pristine_files()
        return self._pristine_files

    def engine_spec(self, name: str) -> EngineSpec:
        return engine_spec(self.profile, name, self.model_path or "", use_patch=self.use_patch,
                           pristine_files=self.pristine_files)

    def warm_up_plan(self) -> WarmUpPlan:
        """The warm-up wave: as many streams at once as the engine has resident slots (the
        profile's max_num_seqs), one of them a prompt of 2.5 x max_num_batched_tokens (chunked
        prefill), within max_model_len. None waits for a slot: a wave one request larger queued
        its last request, which a broken limiter that never frees a slot held for the whole
        warm-up timeout."""
        e, m = self.profile.engine, self.profile.model
        plan = WarmUpPlan(streams=e.max_num_seqs, long_prompt_tokens=None)
        if e.enable_chunked_prefill is not False:
            chunk = e.max_num_batched_tokens or 2048
            room = (m.max_model_len or 4096) - plan.max_tokens - 1
            plan.long_prompt_tokens = max(1, min(chunk * 5 // 2, room))
            plan.streams = max(0, e.max_num_seqs - 1)
        return plan

    # ---- start ------------------------------------------------------------------------

    def _launch(self, name: str) -> RunningEngine:
        spec = self.engine_spec(name)
        self.manifest.engines[name] = EngineEntry(
            kind=spec.kind, feature=spec.feature, async_scheduling=spec.async_scheduling,
            default_tps=spec.default_tps, user_tps=spec.user_tps if spec.feature else None,
            flags=spec.all_flags(), scheduling_policy=spec.scheduling_policy, log_file=f"engines/{name}/engine.log",
            started_monotonic_ns=time.monotonic_ns(),
            stock_overlay=spec.pristine_files is not None, cpu_async_overlay=uses_cpu_async_overlay(spec),
            record_events=records_events(spec),
        )
        self.manifest.write()
        self.console.print(f"[bold]engine[/] {name}: starting ({spec.kind} vLLM, "
                           f"{'limiter on' if spec.feature else 'limiter off'}, "
                           f"{'' if spec.record_events or spec.kind != 'patched' else 'no engine events, '}"
                           f"{'async' if spec.async_scheduling else 'sync'} scheduling"
                           f"{', priority policy' if spec.scheduling_policy == 'priority' else ''})")
        engine = launch_engine(spec, self.run_dir / "engines" / name)
        self.running[name] = engine
        entry = self.manifest.engines[name]
        entry.endpoint, entry.pid = engine.endpoint, engine.process.pid
        return engine

    def _ready(self, engines: list[RunningEngine], t0: float) -> None:
        wait_ready(engines, self.profile.startup_timeout_s, self.console)
        self.stage_s["engines start"] += time.monotonic() - t0
        plan = self.warm_up_plan()
        for engine in engines:
            t_warm = time.monotonic()
            result = warm_up(engine, plan)
            self.stage_s["engines warm-up"] += time.monotonic() - t_warm
            name = engine.spec.name
            entry = self.manifest.engines[name]
            entry.warm_up = asdict(result)
            entry.ready_monotonic_ns = time.monotonic_ns()
            if engine.events_path is not None:
                entry.events_file = f"engines/{name}/events.rbev"
            self.refs[name] = EngineRef(name=name, endpoint=engine.endpoint, model=engine.spec.served_name,
                                        feature=engine.spec.feature, kind=engine.spec.kind, pgid=engine.pgid)
            self.console.print(f"[bold]engine[/] {name}: ready at {engine.endpoint} "
                               f"({time.monotonic() - t0:.0f} s; warm-up {result.requests} requests, "
                               f"{result.seconds:.1f} s{', timed out' if result.timed_out else ''})")
        self.manifest.write()

    @staticmethod
    def processes_of(names: list[str]) -> list[str]:
        """The engines that run for these phase engines: a fleet's members in its place."""
        return list(dict.fromkeys(m for n in names for m in (fleet_members(n) or [n])))

    def ensure_engines(self, names: list[str]) -> None:
        """Start the engines not running yet and wait until they serve: all at once, or one after
        another on a GPU (vLLM sizes its KV cache from the GPU memory free while it starts; an engine
        starting beside it skews that). A fleet's members start as engines; then its balancer."""
        missing = [n for n in self.processes_of(names) if n not in self.running]
        for wave in ([n] for n in missing) if self.profile.device == "cuda" else ([missing] if missing else []):
            t0 = time.monotonic()
            self._ready([self._launch(n) for n in wave], t0)
        for name in dict.fromkeys(names):
            if fleet_members(name) is not None and name in self._stale:  # a member restarted: new ports
                self._stop_balancer(name)
            if fleet_members(name) is not None and name not in self.balancers:
                self._start_balancer(name)

    def arrange_engines(self, upcoming: list[str]) -> None:
        """Have the next phase's engine running, and as many of the following ones as
        profile.max_engines allows (started together); stop the others."""
        wanted = engines_wanted(upcoming, self.profile.max_engines)
        self.stop_unneeded(wanted)
        self.ensure_engines([n for n in wanted if any(m not in self.running for m in self.processes_of([n]))
                             or (fleet_members(n) is not None and (n not in self.balancers or n in self._stale))])

    def stop_unneeded(self, needed: list[str] | set[str]) -> None:
        """Stop every engine and balancer that none of these phase engines needs."""
        needed = list(needed)
        for fleet in list(self.balancers):
            if fleet not in needed:
                self._stop_balancer(fleet)
        processes = self.processes_of(needed)
        for name in list(self.running):
            if name not in processes:
                self.stop(name)

    # ---- a fleet's balancer -----------------------------------------------------------

    def _fleet_header(self) -> str:
        from ratebench.balancer import USER_HEADER

        return next((s.params["user_header"] for s in self.profile.scenarios if s.kind == "fleet"), USER_HEADER)

    def _start_balancer(self, fleet: str) -> None:
        from ratebench.balancer import POLICIES, SERVED_BY_HEADER, start_balancer

        members = fleet_members(fleet) or []
        servers = {m: self.running[m].port for m in members}
        header = self._fleet_header()
        t0 = time.monotonic()
        folder = self.run_dir / "balancers" / fleet
        entry = BalancerEntry(kind="haproxy", members=members, config=f"balancers/{fleet}/haproxy.cfg",
                              log_file=f"balancers/{fleet}/balancer.log", user_header=header,
                              served_by_header=SERVED_BY_HEADER, started_monotonic_ns=time.monotonic_ns())
        self.manifest.balancers[fleet] = entry
        balancer = start_balancer(servers, folder, list(POLICIES), user_header=header)
        self.balancers[fleet] = balancer
        entry.endpoints, entry.pid = dict(balancer.endpoints), balancer.process.pid
        self.manifest.write()
        first = self.running[members[0]]
        self.refs[fleet] = EngineRef(name=fleet, endpoint=first.endpoint, model=first.spec.served_name,
                                     feature=first.spec.feature, kind="fleet", routes=dict(balancer.endpoints),
                                     members=members, served_by_header=SERVED_BY_HEADER,
                                     member_endpoints={m: self.running[m].endpoint for m in members})
        self.stage_s["engines start"] += time.monotonic() - t0
        self.console.print(f"[bold]fleet[/] {fleet}: HAProxy in front of {', '.join(members)} "
                           f"({', '.join(f'{p} at {u}' for p, u in balancer.endpoints.items())}; "
                           f"user header {header})")

    def fail_member(self, fleet: str, member: str) -> None:
        """A fleet's failover: stop one member as if it died (no settling; the balancer stays up and finds
        it gone by its health checks). The fleet's balancer is restarted before the fleet runs again."""
        if member not in (fleet_members(fleet) or []):
            raise ValueError(f"{member} is not a member of {fleet}")
        self._stale.add(fleet)
        entry = self.manifest.engines.get(member)
        if entry is not None:
            entry.failover_stopped_monotonic_ns = time.monotonic_ns()
        # SIGINT, and SIGKILL 2 s later: its API server would wait for the balancer's open connections
        self.stop(member, settle=False, grace_s=FAILOVER_GRACE_S)

    def _stop_balancer(self, fleet: str) -> None:
        self._stale.discard(fleet)
        balancer = self.balancers.pop(fleet, None)
        self.refs.pop(fleet, None)
        if balancer is None:
            return
        killed = balancer.stop()
        entry = self.manifest.balancers.get(fleet)
        if entry is not None:
            entry.stopped_monotonic_ns, entry.killed_pids = time.monotonic_ns(), list(killed)
            entry.exit_code = balancer.process.returncode
        self.manifest.write()

    # ---- stop -------------------------------------------------------------------------

    def stop(self, name: str, *, settle: bool = True, grace_s: float | None = None) -> None:
        engine = self.running.pop(name, None)
        self.refs.pop(name, None)
        if engine is None:
            return
        t0 = time.monotonic()
        # what it used so far stays in the run's CPU time (a failover stops a member mid-phase: without this
        # its CPU-seconds would leave the sum and read as other processes' negative use)
        self._stopped_cpu_s += groups_cpu_s({engine.pgid})
        try:
            self._stop(name, engine, settle, grace_s)
        finally:
            self.stage_s["engines stop"] += time.monotonic() - t0

    def _stop(self, name: str, engine: RunningEngine, settle: bool, grace_s: float | None = None) -> None:
        if settle:
            # The engine flushes its events at least every 100 ms: let the last ones land.
            time.sleep(EVENTS_SETTLE_S)
        killed = engine.stop(self.profile.shutdown_grace_s if grace_s is None else grace_s)
        entry = self.manifest.engines.get(name)
        if entry is not None:
            entry.stopped_monotonic_ns = time.monotonic_ns()
            entry.killed_pids = killed
            entry.exit_code = engine.process.returncode
            self._record_effective_settings(name, engine, entry)
        self.manifest.write()

    def _record_effective_settings(self, name: str, engine: RunningEngine, entry: EngineEntry) -> None:
        """What the engine says it ran with (its event file header), beside what was asked."""
        if uses_cpu_async_overlay(engine.spec):  # what the CPU async overlay saw inside the engine
            from ratebench.cpu_async import read_stats, stats_problems

            entry.cpu_async = read_stats(engine.folder / "cpu-async" / "stats")
            for problem in stats_problems(entry.cpu_async):
                msg = f"engine {name}: CPU async overlay: {problem}"
                entry.warnings.append(msg)
                self.manifest.warn(msg)
                self.console.print(f"[yellow]warning:[/] {msg}")
        if engine.events_path is None or not engine.events_path.is_file():
            return
        try:
            meta = read_engine_events(engine.events_path).meta
        except EventFileError as exc:
            entry.events_error = str(exc)
            return
        entry.engine_meta = meta
        effective = meta.get("async_scheduling")
        if effective is not None and bool(effective) != engine.spec.async_scheduling:
            # vLLM's CPU platform turns --async-scheduling off without a word.
            msg = (f"engine {name}: asked for {'async' if engine.spec.async_scheduling else 'sync'} scheduling, "
                   f"the engine ran {'async' if effective else 'sync'} scheduling")
            entry.warning = msg
            self.manifest.warn(msg)
            self.console.print(f"[yellow]warning:[/] {msg}")

    def stop_all(self, *, settle: bool = True) -> None:
        for fleet in list(self.balancers):
            try:
                self._stop_balancer(fleet)
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                self.console.print(f"[red]balancer {fleet}: stop failed: {exc}[/]")
        for name in list(self.running):
            try:
                self.stop(name, settle=settle)
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                self.console.print(f"[red]engine {name}: stop failed: {exc}[/]")

    # ---- an engine someone else runs ------------------------------------------------------

    def attach(self, endpoint: str, events_file: Path | None) -> None:
        """--endpoint: the one external server stands in for the feature-on engine."""
        endpoint = endpoint.rstrip("/")
        try:
            r = httpx.get(f"{endpoint}/v1/models", timeout=10.0)
            r.raise_for_status()
            models = [m["id"] for m in r.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise AttachError(f"--endpoint {endpoint}: /v1/models did not answer ({exc}); is the server up?") from exc
        served = self.profile.model.served_name
        model = served if served in models else (models[0] if models else None)
        if model is None:
            raise AttachError(f"--endpoint {endpoint}: the server lists no model")
        lim = self.profile.limits
        self.manifest.engines[EXTERNAL_ENGINE] = EngineEntry(
            kind="external", feature=True, async_scheduling=None, default_tps=lim.default_tps,
            user_tps=dict(lim.user_tps), flags=None,
            events_file=f"engines/{EXTERNAL_ENGINE}/events.rbev" if events_file else None,
            endpoint=endpoint, served_model=model, record_events=bool(events_file),
        )
        self.manifest.write()
        ref = EngineRef(name=EXTERNAL_ENGINE, endpoint=endpoint, model=model, feature=True, kind="external")
        for mode in self.profile.scheduling:
            self.refs[engine_name(ROLE_FEATURE_ON, mode)] = ref

    # ---- while a phase runs -----------------------------------------------------------

    def cpu_probe(self) -> tuple[float, float]:
        """(CPU-seconds the machine has been busy, CPU-seconds this run's processes have used): the
        driver and every engine it runs. Their difference over a phase is what other processes took."""
        own = os.times()
        engines = groups_cpu_s({e.pgid for e in self.running.values()}) if self.running else 0.0
        return machine_busy_cpu_s(), own.user + own.system + engines + self._stopped_cpu_s
