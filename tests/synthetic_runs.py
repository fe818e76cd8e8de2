"""Helpers of the verifier's tests: small synthetic run folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ratebench.events import EventFileWriter, read_engine_events
from ratebench.runrecords import read_client_records, write_client_records
from ratebench.profiles import ANONYMOUS_USER
from ratebench.roles import PHASE_IDLE
from synth import SimEngine, SimPhase, SimRequest, write_run_folder


def one_phase_run(run_dir: Path, *, limiter: str = "gcra", limit_tps: int = 50, streams: int = 2,
                  max_tokens: int = 60, backlogged: bool = True, engine_kw: dict | None = None,
                  requests: list[SimRequest] | None = None) -> Path:
    """One engine, one phase, one user."""
    eng = SimEngine("patched-sync", default_tps=limit_tps, limiter=limiter, **(engine_kw or {}))
    reqs = requests or [SimRequest(f"rb-5e1f0001-{i}", "user-a", i, max_tokens) for i in range(streams)]
    phase = SimPhase("seed-experiment", "seed-experiment", "main", "patched-sync", "measure",
                     {"user-a": {"limit_tps": limit_tps, "streams": streams, "backlogged": backlogged}}, reqs)
    return write_run_folder(run_dir, [eng], [phase])


def edit_client_records(run_dir: Path, edit) -> None:
    """Apply ``edit(records)`` to requests.jsonl in place."""
    path = Path(run_dir) / "requests.jsonl"
    recs = read_client_records(path)
    edit(recs)
    write_client_records(path, recs)


def edit_manifest(run_dir: Path, edit) -> None:
    path = Path(run_dir) / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def edit_scenarios(run_dir: Path, edit) -> None:
    """Apply ``edit(phases)`` to scenarios.json (a list of dicts) in place."""
    path = Path(run_dir) / "scenarios.json"
    phases = json.loads(path.read_text())
    edit(phases)
    path.write_text(json.dumps(phases))


def rewrite_events(path: Path, edit) -> None:
    """Rewrite an engine event file as a lying recorder would have written it: ``edit(records, strings)``
    returns the records (RECORD_DTYPE) to keep, in any order; the header, strings and step records stay."""
    ev = read_engine_events(path)
    recs = edit(ev.records.copy(), ev.strings)
    recs = recs[np.argsort(recs["t_ns"], kind="stable")]
    with EventFileWriter(path, ev.meta, version=ev.version) as w:
        for s in ev.strings:
            w.intern(s)
        if len(ev.steps):
            w.write_steps(ev.steps)
        w.write_block(recs)


def cut_event_file(path: Path, keep_before_ns: int) -> None:
    """Rewrite an engine event file as a hard stop leaves it: the events (and step records) before
    ``keep_before_ns`` in complete blocks, the rest of the events in a last block cut short (the
    reader drops it)."""
    ev = read_engine_events(path)
    recs = ev.records
    with EventFileWriter(path, ev.meta, version=ev.version) as w:
        for s in ev.strings:
            w.intern(s)
        if len(ev.steps):
            w.write_steps(ev.steps[ev.steps["t_ns"] < keep_before_ns])
        w.write_block(recs[recs["t_ns"] < keep_before_ns])
        w.write_block(recs[recs["t_ns"] >= keep_before_ns])
    with open(path, "r+b") as f:
        f.truncate(Path(path).stat().st_size - 7)


MIX_TIERS = (("low", 25, 20), ("high", 20, 200), ("burst", 10, 50))  # name, users, limit


def mix_run_folder(run_dir: Path, *, kind: str = "mix", tiers: tuple = MIX_TIERS, baseline: bool = False) -> Path:
    """One mix phase: 55 tier users (two 8-token requests each) and anonymous requests; ``baseline``: the
    same requests again on the limiter-off engine (mix-baseline)."""
    users = {f"{name}-{i:02d}": limit for name, n, limit in tiers for i in range(n)}
    eng = SimEngine("patched-sync", default_tps=100, user_tps=dict(users))

    def requests(first: int) -> list[SimRequest]:
        reqs = []
        for u in users:
            for k in range(2):
                reqs.append(SimRequest(f"rb-5e1f0001-{first + len(reqs)}", u, len(reqs), 8,
                                       arrive_offset_ns=k * 50_000_000 + len(reqs) * 1_000_000))
        for k in range(3):
            reqs.append(SimRequest(f"rb-5e1f0001-{first + len(reqs)}", None, len(reqs), 8,
                                   arrive_offset_ns=k * 30_000_000))
        return reqs

    info = {}
    for u, limit in users.items():
        info[u] = {"limit_tps": limit, "streams": 2, "backlogged": False}
        if kind == "mix":
            info[u]["tier"] = u.rsplit("-", 1)[0]
    info[ANONYMOUS_USER] = {"limit_tps": 100, "streams": 3, "backlogged": False}
    phases = [SimPhase(kind, kind, kind, "patched-sync", "measure", info, requests(0), params={"lateness_ms": 20})]
    engines = [eng]
    if baseline:
        engines.append(SimEngine("feature-off-sync", feature=False, default_tps=None))
        phases.append(SimPhase(kind, kind, f"{kind}-baseline", "feature-off-sync", "baseline",
                               {u: {**v, "limit_tps": None} for u, v in info.items()}, requests(1000),
                               params={"lateness_ms": 20}))
    return write_run_folder(run_dir, engines, phases)


def set_async_scheduling(run_dir: Path, engine: str) -> None:
    """Mark one engine as having run with async scheduling, in manifest.json and its event file's header
    alike (the simulation itself is the same)."""
    edit_manifest(run_dir, lambda m: m["engines"][engine].update(async_scheduling=True))
    path = Path(run_dir) / "engines" / engine / "events.rbev"
    ev = read_engine_events(path)
    with EventFileWriter(path, {**ev.meta, "async_scheduling": True}, version=ev.version) as w:
        for s in ev.strings:
            w.intern(s)
        if len(ev.steps):
            w.write_steps(ev.steps)
        w.write_block(ev.records)


def write_flags_as_promised(run_dir: Path) -> None:
    """The flags.json of a run whose malformed limiter flags were all refused naming their flag, the valid
    ones kept (what ratebench.flagcheck writes for the patch as shipped, without running it)."""
    from ratebench.flagcheck import CASES, FILE

    cases = [dict(name=name, flags=flags, must_name=names, ok=True, refused=names is not None,
                  stage="arguments" if names else None, why="as promised") for name, flags, names in CASES]
    (Path(run_dir) / FILE).write_text(json.dumps({"version": 1, "cases": cases, "error": None}))


def all_promises_run(run_dir: Path, *, waiting: bool = True, max_tokens: int = 60) -> Path:
    """A run whose phases exercise every promise the verdict counts: the seed experiment on a sync and an
    async limiter-on engine, isolation, cancellation, the waiting scenario (``waiting``: its idle, busy and
    waiting phases, the EngineCore's CPU time measured) and the overhead rounds (judged only with a
    ``max_overhead`` threshold)."""
    from synth import overhead_engines, overhead_phases, request_maker

    reqs, cid = request_maker(max_tokens)

    limits = {"user-a": 20, "user-c": 1000, "slow": 10, "probe": 100000, "bulk": 100000}
    sync = SimEngine("patched-sync", default_tps=100, user_tps=dict(limits))
    asyn = SimEngine("patched-async", default_tps=100, user_tps=dict(limits))
    ua = {"limit_tps": 20, "streams": 2, "backlogged": True}
    phases = [SimPhase("seed-experiment", "seed-experiment", "2-streams", e.name, "measure", {"user-a": ua},
                       reqs("user-a", 2)) for e in (sync, asyn)]
    uc = {"limit_tps": 1000, "streams": 2, "backlogged": False}
    phases += [
        SimPhase("isolation", "isolation", "baseline", sync.name, "baseline", {"user-c": uc}, reqs("user-c", 2)),
        SimPhase("isolation", "isolation", "shared", sync.name, "shared",
                 {"user-c": uc, "user-a": {**ua, "backlogged": False}},
                 reqs("user-c", 2) + reqs("user-a", 2, tokens=10)),
        SimPhase("cancellation", "cancellation", "cancel", sync.name, "measure",
                 {"user-b": {"limit_tps": 100, "streams": 2, "backlogged": False}},
                 reqs("user-b", 1) + reqs("user-b", 1, cancel_after_ns=300_000_000)),
    ]
    if waiting:
        probe = {"limit_tps": 100000, "streams": 2, "backlogged": False}
        phases += [
            SimPhase("waiting", "waiting", "idle", sync.name, PHASE_IDLE, {"probe": probe},
                     reqs("probe", 2, tokens=4)),
            SimPhase("waiting", "waiting", "busy", sync.name, "steps", {"probe": probe}, reqs("probe", 2)),
            SimPhase("waiting", "waiting", "waiting", sync.name, "waiting",
                     {"slow": {"limit_tps": 10, "streams": 3, "backlogged": True}, "probe": probe},
                     reqs("slow", 2, tokens=10) + reqs("slow", 1, tokens=10, cancel_after_ns=400_000_000)
                     + reqs("probe", 2, tokens=4, arrive_offset_ns=300_000_000)),
        ]
    roles = overhead_engines(sync)
    phases += overhead_phases(roles, cid, max_tokens=max_tokens)
    engines = [sync, asyn, *(e for e in roles.values() if e is not sync)]
    run = write_run_folder(run_dir, engines, phases)
    set_async_scheduling(run, asyn.name)
    write_flags_as_promised(run)
    if waiting:
        # the EngineCore's CPU time: an idle engine keeps 0.01 CPUs busy, a step costs 2 ms, waiting adds nothing
        def cpu(entries):
            for p in entries:
                if p["scenario"] == "waiting":
                    wall = (p["end_ns"] - p["start_ns"]) / 1e9
                    p["engine_core_cpu_s"] = round(0.01 * wall + 0.002 * _steps(run, p), 6)
        edit_scenarios(run, cpu)
    return run


def _steps(run: Path, phase: dict) -> int:
    """Engine steps of a phase: its distinct emit times on its engine."""
    from ratebench.events import KIND_EMIT

    rec = read_engine_events(Path(run) / "engines" / phase["engine"] / "events.rbev").records
    t = rec["t_ns"][(rec["kind"] == KIND_EMIT) & (rec["t_ns"] >= phase["start_ns"]) & (rec["t_ns"] <= phase["end_ns"])]
    return len(np.unique(t))
