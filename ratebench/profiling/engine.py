"""Part 1 of profile-scheduler: py-spy on the EngineCore of a real engine, for each R.

The profile's patched engine (or someone else's, ``--endpoint`` and ``--pid``) carries
the load of :mod:`ratebench.profiling.load` while py-spy records its EngineCore
(:mod:`ratebench.profiling.pyspy`); the samples are sorted by
:mod:`ratebench.profiling.samples` into the shares of the engine table.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ratebench._io import file_lock
from ratebench.profiling.load import BUSY_USER, engine_gauges, resident_load
from ratebench.profiling.microbench import scheduler_source
from ratebench.profiling.pyspy import (
    ENGINE_CORE_TITLES,
    RECORDING_FORMATS,
    RECORDING_WINDOWS,
    find_engine_core,
    process_title,
    ptrace_problem,
    py_spy_command,
)
from ratebench.profiling.samples import ENGINE_CATEGORIES, classify_samples, read_collapsed

ENGINE_LOCK = Path("/tmp/ratebench-engine.lock")
DEFAULT_R_VALUES = {"cpu-tiny": [16, 64, 256, 1024]}
FALLBACK_R_VALUES = [16, 64, 256, 1024]


class ProfilingError(RuntimeError):
    """What profile-scheduler could not do, said so the user can act on it."""


def r_values_for(profile_name: str) -> list[int]:
    return list(DEFAULT_R_VALUES.get(profile_name, FALLBACK_R_VALUES))


@dataclass
class EngineProfileSettings:
    r_values: list[int]
    duration_s: float = 4.0
    rate_hz: int = 100
    limit_tps: int = 1  # the throttled users' rate (the engine's default)
    streams_per_user: int = 4
    busy_streams: int | None = None  # unlimited streams that keep the engine stepping (default: active seqs)
    max_tokens: int = 1000
    settle_s: float = 1.5  # after every stream is in the engine, before recording

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PySpyRecording:
    r: int
    pid: int
    duration_s: float
    rate_hz: int
    raw_path: Path
    svg_path: Path
    speedscope_path: Path
    resident: dict[str, float]  # running / waiting from /metrics while recording the raw stacks
    error: str | None = None  # the raw stacks were not recorded
    picture_errors: list[str] = field(default_factory=list)  # the flame graph or speedscope file was not


async def _record_one_r(endpoint: str, model: str, r: int, settings: EngineProfileSettings, busy: int,
                        engine_pid: int, out_dir: Path, log: Callable[[str], None]) -> PySpyRecording:
    paths = {fmt: out_dir / f"R{r}{suffix}" for fmt, suffix in RECORDING_FORMATS.items()}
    rec = PySpyRecording(r, engine_pid, settings.duration_s, settings.rate_hz, paths["raw"], paths["flamegraph"],
                         paths["speedscope"], {})
    async with resident_load(endpoint, model, r, busy=busy, streams_per_user=settings.streams_per_user,
                             max_tokens=settings.max_tokens, settle_s=settings.settle_s) as load:
        log(f"R={r}: {load.streams} streams open ({load.throttled} throttled of {load.users} users at the engine's "
            f"default rate, {load.unlimited} unlimited); recording {settings.duration_s:.0f} s for the shares, "
            f"then {settings.duration_s:.0f} s for the flame graph and the speedscope file")
        shares_window, *picture_windows = RECORDING_WINDOWS
        before = await engine_gauges(load.client, endpoint)
        rec.error = "; ".join(await _record_window(engine_pid, {f: paths[f] for f in shares_window}, settings)) or None
        after = await engine_gauges(load.client, endpoint)
        rec.resident = {k: (before.get(k, 0) + after.get(k, 0)) / 2 for k in ("running", "waiting")}
        for formats in picture_windows:
            rec.picture_errors += await _record_window(engine_pid, {f: paths[f] for f in formats}, settings)
    return rec


async def _record_window(pid: int, paths: dict[str, Path], settings: EngineProfileSettings) -> list[str]:
    """py-spy recorders of the same window, one per format (:mod:`ratebench.profiling.pyspy` says
    why), started together; why any failed."""
    procs = {fmt: await asyncio.create_subprocess_exec(
                 *py_spy_command(pid, path, settings.duration_s, settings.rate_hz, fmt=fmt),
                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
             for fmt, path in paths.items()}
    outputs = await asyncio.gather(*(p.communicate() for p in procs.values()))
    return [f"py-spy --format {fmt} exited with {proc.returncode}: {err.decode(errors='replace').strip()[-300:]}"
            for (fmt, proc), (_, err) in zip(procs.items(), outputs)
            if proc.returncode != 0 or not paths[fmt].exists()]


@dataclass
class EngineRow:
    r: int
    resident: dict[str, float]
    samples: int
    shares: dict[str, float]  # category -> share of samples
    svg: str | None
    speedscope: str | None
    error: str | None = None
    picture_error: str | None = None  # why the flame graph or the speedscope file is missing


@dataclass
class EngineReport:
    settings: dict[str, Any]
    engine: dict[str, Any]
    rows: list[EngineRow]
    warnings: list[str]
    notes: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def not_recorded_reason(self) -> str | None:
        """Why part 1 recorded nothing when it did not fail (py-spy cannot attach, and the fix), else None."""
        if self.rows or self.engine or not self.warnings or self.warnings[0].startswith(ENGINE_PART_FAILED):
            return None
        return self.warnings[0]


ENGINE_PART_FAILED = "engine part failed"
ENGINE_NOTES = [
    "py-spy records the EngineCore process only (found by its title VLLM::EngineCore), without "
    "--subprocesses: it holds the scheduler; the model runs in a worker process (MultiprocExecutor), whose "
    "time shows here as model_wait, and the API server is not the scheduler's cost",
    "idle samples are kept (--idle) and only the EngineCore's busy-loop thread is counted: every share is "
    "of that thread's wall time (about rate x duration samples), so schedule + model_wait + idle + the rest "
    "add up to the step loop; its socket threads, which mostly wait, are left out",
    "samples are aggregated by function (--function); categories overlap (the limiter and the rotation run "
    "inside schedule)",
    "the flame graph and the speedscope file are py-spy's own, recorded together in a second window just "
    "after the raw stacks', same load (one recorder over the shares' window stops the process least): they "
    "agree with these shares within sampling noise, not sample for sample",
]


def failed_engine_report(settings: EngineProfileSettings, exc: BaseException) -> EngineReport:
    """Part 1's report when the engine could not be profiled: no rows, the reason (part 2 still runs)."""
    return EngineReport(settings.to_json(), {}, [], [f"{ENGINE_PART_FAILED}: {exc}"], ENGINE_NOTES)


def summarize_recording(rec: PySpyRecording) -> EngineRow:
    """Shares of samples per category, from the raw stacks (py-spy wrote the pictures beside them)."""
    if rec.error is not None:
        return EngineRow(rec.r, rec.resident, 0, {}, None, None, rec.error)
    counts = classify_samples(read_collapsed(rec.raw_path))
    total = counts.pop("total")
    shares = {c: (counts[c] / total if total else 0.0) for c in ENGINE_CATEGORIES}
    return EngineRow(rec.r, rec.resident, total, shares,
                     rec.svg_path.name if rec.svg_path.exists() else None,
                     rec.speedscope_path.name if rec.speedscope_path.exists() else None,
                     picture_error="; ".join(rec.picture_errors) or None)


def _engine_spec_for(profile, r_max: int, settings: EngineProfileSettings, model_path: str):
    from ratebench.engine import EngineSpec
    from ratebench.plan import profile_engine_flags

    flags = profile_engine_flags(profile)
    max_num_seqs = max(r_max, profile.engine.max_num_seqs)
    flags[flags.index("--max-num-seqs") + 1] = str(max_num_seqs)
    # vLLM refuses --max-num-batched-tokens below --max-num-seqs.
    if "--max-num-batched-tokens" in flags:
        i = flags.index("--max-num-batched-tokens")
        flags[i + 1] = str(max(int(flags[i + 1]), max_num_seqs))
    return EngineSpec(
        name="profile-scheduler", kind="patched", feature=True,
        async_scheduling=profile.scheduling[0] == "async", model=model_path,
        served_name=profile.model.served_name, flags=flags, default_tps=settings.limit_tps,
        user_tps={BUSY_USER: 1_000_000}, env=dict(profile.engine.env), record_events=False,
    )


def record_engine(profile, settings: EngineProfileSettings, out_dir: Path, *, endpoint: str | None = None,
                  pid: int | None = None, log: Callable[[str], None] = print, console=None) -> EngineReport:
    """Part 1: py-spy on the EngineCore for each R (launching the profile's engine unless
    ``endpoint`` and ``pid`` name one someone else started)."""
    problem = ptrace_problem()
    engine_dir = out_dir / "engine"
    engine_dir.mkdir(parents=True, exist_ok=True)
    warnings: list[str] = []
    if problem is not None:
        return EngineReport(settings.to_json(), {}, [], [problem], ENGINE_NOTES)
    busy = settings.busy_streams if settings.busy_streams is not None else profile.engine.max_num_active_seqs
    if endpoint is not None:
        if pid is None:
            raise ProfilingError("--endpoint needs --pid (the server's or its EngineCore's process id)")
        core = find_engine_core(pid)
        if core is None:
            warnings.append(f"no process titled EngineCore under pid {pid}: recording pid {pid} itself")
            core = pid
        model = _served_model(endpoint)
        warnings.append("external engine: its own limits apply; the throttled users are profile-u*, at its "
                        "default rate, and profile-busy at its default rate too unless it has an override")
        rows = _record_all(endpoint, model, settings, busy, core, engine_dir, log)
        info = {"endpoint": endpoint, "pid": pid, "engine_core_pid": core, "external": True}
        return EngineReport(settings.to_json(), info, rows, warnings, ENGINE_NOTES)

    from ratebench.engine import start_engine

    scheduler_source()  # the text the engine is about to import (recorded in the JSON)
    model_path = _model_path(profile)
    spec = _engine_spec_for(profile, max(settings.r_values), settings, model_path)
    with file_lock(ENGINE_LOCK):  # the machine-wide lock every real engine run takes
        log(f"engine: starting the patched engine of {profile.name} ({' '.join(spec.flags[:4])}, "
            f"default {settings.limit_tps} tok/s)")
        engine = start_engine(spec, engine_dir, timeout_s=profile.startup_timeout_s, console=console,
                              grace_s=profile.shutdown_grace_s)
        try:
            core = _wait_engine_core(engine.pgid)
            if core is None:
                raise ProfilingError(f"no EngineCore process in the engine's process group {engine.pgid}")
            rows = _record_all(engine.endpoint, spec.served_name, settings, busy, core, engine_dir, log)
        finally:
            engine.stop(profile.shutdown_grace_s)
    info = {"flags": spec.all_flags(), "engine_core_pid": core, "log_file": "engine/engine.log", "external": False}
    for row in rows:
        if row.error:
            warnings.append(f"R={row.r}: {row.error}")
        if row.picture_error:
            warnings.append(f"R={row.r}: {row.picture_error}")
        elif row.resident and row.resident.get("running", 0) + row.resident.get("waiting", 0) < 0.9 * row.r:
            warnings.append(f"R={row.r}: only {row.resident.get('running', 0) + row.resident.get('waiting', 0):.0f} "
                            f"requests were in the engine while recording")
    return EngineReport(settings.to_json(), info, rows, warnings, ENGINE_NOTES)


def _record_all(endpoint: str, model: str, settings: EngineProfileSettings, busy: int, core: int,
                engine_dir: Path, log: Callable[[str], None]) -> list[EngineRow]:
    rows = []
    for r in settings.r_values:
        rec = asyncio.run(_record_one_r(endpoint, model, r, settings, busy, core, engine_dir, log))
        rows.append(summarize_recording(rec))
    return rows


def _wait_engine_core(pgid: int, timeout_s: float = 10.0) -> int | None:
    from ratebench.procstats import group_members

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in group_members(pgid):
            if any(t in process_title(p) for t in ENGINE_CORE_TITLES):
                return p
        time.sleep(0.2)
    return None


def _served_model(endpoint: str) -> str:
    import httpx

    try:
        data = httpx.get(f"{endpoint}/v1/models", timeout=10).json()["data"]
        return data[0]["id"]
    except Exception as exc:  # noqa: BLE001
        raise ProfilingError(f"{endpoint}/v1/models did not name a model: {exc}") from None


def _model_path(profile) -> str:
    if profile.model.source == "tiny":
        from ratebench.tinymodel import ensure_tiny_model

        return str(ensure_tiny_model())
    return profile.model.name


