"""Synthetic run folders: a simulated engine with correct and broken limiters.

The verifier's tests use these instead of a real vLLM (a test fixture, not shipped). The
simulated engine runs fixed-length steps; at the start of a step it asks the
limiter for one token per active request (a user's streams take turns), records
a dispatch event at that instant, and at the end of the step an emit event for
each token. The files follow docs/run-folder.md, ratebench/events.py and
ratebench/runrecords.py exactly.

Limiters (``LIMITERS``):

* ``gcra``: the promise: GCRA per user, burst 100 ms, integer ns arithmetic;
* ``burst-1s``: GCRA with a 1 s burst;
* ``per-request``: GCRA with one budget per request instead of per user;
* ``rolling-1s``: N tokens per trailing 1 s window;
* ``never``: never throttles;
* ``half-rate``: GCRA at N/2.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ratebench._io import atomic_write_json
from ratebench.manifest import Manifest
from ratebench.analysis.overhead import ROLE_NO_EVENTS, ROLE_OFF, ROLE_ON, ROLE_STOCK
from ratebench.events import (
    ANONYMOUS_USER,
    KIND_DISPATCH,
    KIND_EMIT,
    KIND_FINISH,
    KIND_REFUSE,
    RECORD_DTYPE,
    EventFileWriter,
)
from ratebench.runrecords import ClientRecord, EngineEntry, write_client_records

NS = 1_000_000_000
BURST_NS = 100_000_000
FINISH_CODE = {"stop": 1, "length": 2, "abort": 3}


class GcraLimiter:
    """GCRA: TAT per key stored times the rate, so each token adds exactly 1e9."""

    def __init__(self, limits: dict[str, int], default_tps: int, burst_ns: int = BURST_NS,
                 per_request: bool = False, rate_divisor: int = 1) -> None:
        self.limits, self.default_tps = limits, default_tps
        self.burst_ns, self.per_request, self.rate_divisor = burst_ns, per_request, rate_divisor
        self.tat: dict[str, int] = {}

    def rate(self, user: str) -> int:
        return self.limits.get(user, self.default_tps) // self.rate_divisor

    def try_take(self, user: str, req: str, now_ns: int) -> bool:
        n = self.rate(user)
        key = req if self.per_request else user
        now_scaled = now_ns * n
        tat = max(self.tat.get(key, now_scaled), now_scaled)
        if tat - now_scaled > self.burst_ns * n:
            return False
        self.tat[key] = tat + NS
        return True


class RollingWindowLimiter:
    """At most N tokens in any trailing 1 s window (a common, wrong, limiter)."""

    def __init__(self, limits: dict[str, int], default_tps: int, window_ns: int = NS) -> None:
        self.limits, self.default_tps, self.window_ns = limits, default_tps, window_ns
        self.sent: dict[str, deque] = {}

    def try_take(self, user: str, req: str, now_ns: int) -> bool:
        q = self.sent.setdefault(user, deque())
        while q and q[0] <= now_ns - self.window_ns:
            q.popleft()
        if len(q) >= self.limits.get(user, self.default_tps):
            return False
        q.append(now_ns)
        return True


class NeverThrottle:
    def try_take(self, user: str, req: str, now_ns: int) -> bool:
        return True


LIMITERS = ("gcra", "burst-1s", "per-request", "rolling-1s", "never", "half-rate")


def make_limiter(kind: str, limits: dict[str, int], default_tps: int):
    if kind == "gcra":
        return GcraLimiter(limits, default_tps)
    if kind == "burst-1s":
        return GcraLimiter(limits, default_tps, burst_ns=NS)
    if kind == "per-request":
        return GcraLimiter(limits, default_tps, per_request=True)
    if kind == "rolling-1s":
        return RollingWindowLimiter(limits, default_tps)
    if kind == "never":
        return NeverThrottle()
    if kind == "half-rate":
        return GcraLimiter(limits, default_tps, rate_divisor=2)
    raise ValueError(f"unknown limiter {kind!r}; choose one of {', '.join(LIMITERS)}")


@dataclass
class SimRequest:
    client_id: str
    user: str | None  # output_rate_user sent; None: anonymous
    stream_index: int
    max_tokens: int
    arrive_offset_ns: int = 0  # after the phase starts
    ignore_eos: bool = True
    eos_after: int | None = None  # without ignore_eos: the model stops after this many tokens
    cancel_after_ns: int | None = None  # client cancels this long after sending


@dataclass
class SimPhase:
    scenario: str
    kind: str
    phase: str
    engine: str
    role: str
    users: dict[str, dict]  # user -> {"limit_tps", "streams", "backlogged"}
    requests: list[SimRequest]
    params: dict = field(default_factory=dict)
    step_ns: int | None = None  # this phase's engine step, when not the engine's (a slowed-down engine)
    reset_limiter: bool = False  # a broken engine that forgets every user's state when this phase starts
    machine_cpu: dict | None = None  # scenarios.json's CPUs in use during the phase (busy, run, other)


@dataclass
class SimEngine:
    name: str
    kind: str = "patched"  # "patched" | "stock"
    feature: bool = True
    record_events: bool = True  # a patched engine's event file (stock vLLM never has one)
    default_tps: int | None = 100
    user_tps: dict[str, int] = field(default_factory=dict)
    limiter: str = "gcra"
    step_ns: int = 5_000_000
    abort_delay_ns: int = 2_000_000
    emit_coalesce: int = 1  # >1: some emit events carry several tokens (tests of weights)
    # a refuse event (events.KIND_REFUSE) for each charge the limiter refuses, as the patched engine
    # records them since format version 2 (off: a file from an engine that did not record them)
    record_refusals: bool = False
    # >0: a broken engine that charges each request this many steps before its first token without
    # sampling anything (as if it charged its middle prefill chunks)
    prefill_charges: int = 0
    records: list = field(default_factory=list)  # event tuples
    strings: dict[str, int] = field(default_factory=dict)
    clock_ns: int = 10**12
    _limiter: object = None

    def intern(self, s: str) -> int:
        return self.strings.setdefault(s, len(self.strings))

    @property
    def records_events(self) -> bool:
        return self.kind == "patched" and self.record_events


def simulate_phase(engine: SimEngine, phase: SimPhase, rng: np.random.Generator,
                   client_delay_ns: int = 1_000_000) -> tuple[list[ClientRecord], int, int]:
    """Run one phase on the simulated engine; returns client records and the phase span."""
    if engine._limiter is None or phase.reset_limiter:
        engine._limiter = (make_limiter(engine.limiter, engine.user_tps, engine.default_tps or 1)
                           if engine.feature else NeverThrottle())
    limiter = engine._limiter
    start = engine.clock_ns + 50_000_000
    reqs = []
    for r in phase.requests:
        user = r.user if r.user is not None else ANONYMOUS_USER
        rid = f"cmpl-{r.client_id}-0-{rng.integers(0, 2**32):08x}"
        reqs.append({
            "sim": r, "user": user, "rid": rid, "arrive": start + r.arrive_offset_ns, "done": 0,
            "finished": False, "chunks": [], "cancel": None if r.cancel_after_ns is None
            else start + r.arrive_offset_ns + r.cancel_after_ns, "finish_reason": None, "dispatched": 0,
            "pending": 0, "free_charges": engine.prefill_charges,
        })
    last_served: dict[str, int] = {}
    now = start
    ev = engine.records
    while not all(q["finished"] for q in reqs):
        # aborts that reached the engine
        for q in reqs:
            if not q["finished"] and q["cancel"] is not None and q["cancel"] + engine.abort_delay_ns <= now:
                q["finished"], q["finish_reason"] = True, "abort"
                ev.append((now, KIND_FINISH, FINISH_CODE["abort"], q["rid"], q["user"], q["done"]))
        active = [q for q in reqs if not q["finished"] and q["arrive"] <= now]
        # each user's streams take turns: start after the one served last
        by_user: dict[str, list] = {}
        for i, q in enumerate(active):
            by_user.setdefault(q["user"], []).append(q)
        order = []
        for user, qs in by_user.items():
            k = last_served.get(user, -1)
            idx = [reqs.index(q) for q in qs]
            pivot = next((j for j, ix in enumerate(idx) if ix > k), 0)
            order.extend(qs[pivot:] + qs[:pivot])
        scheduled = []
        for i, q in enumerate(order):
            t_disp = now + i * 1000
            if not limiter.try_take(q["user"], q["rid"], t_disp):
                if engine.feature and engine.record_refusals:
                    ev.append((t_disp, KIND_REFUSE, 0, q["rid"], q["user"], 1))
            else:
                if engine.feature:
                    ev.append((t_disp, KIND_DISPATCH, 0, q["rid"], q["user"], 1))
                q["dispatched"] += 1
                last_served[q["user"]] = reqs.index(q)
                if q["free_charges"]:
                    q["free_charges"] -= 1  # charged, samples nothing
                else:
                    scheduled.append(q)
        step = int((phase.step_ns or engine.step_ns) * rng.uniform(0.8, 1.2))
        t_emit = now + step - 1000
        for q in scheduled:
            q["pending"] += 1
            sim: SimRequest = q["sim"]
            target = sim.max_tokens if sim.ignore_eos or sim.eos_after is None else min(sim.max_tokens, sim.eos_after)
            flush = (q["pending"] >= engine.emit_coalesce or q["done"] + q["pending"] >= target)
            if not flush:
                continue
            n = q["pending"]
            q["pending"] = 0
            q["done"] += n
            ev.append((t_emit, KIND_EMIT, 0, q["rid"], q["user"], n))
            if q["cancel"] is None or t_emit + client_delay_ns <= q["cancel"]:
                q["chunks"].append((t_emit + client_delay_ns, n))
            if q["done"] >= target:
                q["finished"] = True
                q["finish_reason"] = "length" if q["done"] >= sim.max_tokens else "stop"
                ev.append((t_emit, KIND_FINISH, FINISH_CODE[q["finish_reason"]], q["rid"], q["user"], q["done"]))
        now += step
    engine.clock_ns = now
    out = []
    for q in reqs:
        sim = q["sim"]
        cancelled = q["cancel"] is not None and q["finish_reason"] == "abort"
        chunks = q["chunks"]
        out.append(ClientRecord(
            client_id=sim.client_id, scenario=phase.scenario, phase=phase.phase, engine=engine.name,
            user=sim.user, api="completions", stream_index=sim.stream_index, max_tokens=sim.max_tokens,
            ignore_eos=sim.ignore_eos, prompt_tokens=16, scheduled_ns=q["arrive"] - 200_000,
            sent_ns=q["arrive"] - 100_000, first_token_ns=chunks[0][0] if chunks else None,
            done_ns=q["cancel"] if cancelled else (chunks[-1][0] if chunks else None),
            chunk_ns=[c[0] for c in chunks], chunk_tokens=[c[1] for c in chunks],
            completion_tokens=None if cancelled else q["done"],
            finish_reason=None if cancelled else q["finish_reason"], http_status=200,
            cancelled=cancelled, cancel_ns=q["cancel"] if cancelled else None,
        ))
    return out, start, now


def _records_array(engine: SimEngine) -> np.ndarray:
    arr = np.zeros(len(engine.records), dtype=RECORD_DTYPE)
    if engine.records:
        t, k, reason, rid, user, count = zip(*engine.records)
        arr["t_ns"], arr["kind"], arr["reason"], arr["count"] = t, k, reason, count
        arr["req"] = [engine.intern(x) for x in rid]
        arr["user"] = [engine.intern(x) for x in user]
    order = np.argsort(arr["t_ns"], kind="stable")
    return arr[order]


def write_run_folder(run_dir: str | Path, engines: list[SimEngine], phases: list[SimPhase], *,
                     run_id: str = "5e1f0001", state: str = "complete", seed: int = 0,
                     block_records: int = 4096) -> Path:
    """Simulate the phases in order and write a complete run folder."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    by_name = {e.name: e for e in engines}
    client: list[ClientRecord] = []
    scen = []
    for p in phases:
        recs, start, end = simulate_phase(by_name[p.engine], p, rng)
        client.extend(recs)
        scen.append({"scenario": p.scenario, "kind": p.kind, "phase": p.phase, "engine": p.engine,
                     "start_ns": start, "end_ns": end, "users": p.users, "role": p.role, "params": p.params,
                     "machine_cpu": p.machine_cpu})
    manifest_engines = {}
    for e in engines:
        rel = f"engines/{e.name}/events.rbev" if e.records_events else None
        (run_dir / "engines" / e.name).mkdir(parents=True, exist_ok=True)
        (run_dir / "engines" / e.name / "engine.log").write_text("synthetic engine\n")
        if rel:
            arr = _records_array(e)
            meta = {"pid": 0, "vllm_version": "0.32.0", "started_monotonic_ns": 10**12,
                    "started_unix_s": 0.0, "default_tps": e.default_tps if e.feature else None,
                    "user_tps": e.user_tps if e.feature else {}, "burst_ns": BURST_NS, "async_scheduling": False}
            with EventFileWriter(run_dir / rel, meta) as w:
                strings = sorted(e.strings, key=e.strings.get)
                for s in strings:
                    w.intern(s)
                for i in range(0, max(len(arr), 1), block_records):
                    w.write_block(arr[i:i + block_records])
        manifest_engines[e.name] = EngineEntry(
            kind=e.kind, feature=e.feature, async_scheduling=False,
            default_tps=e.default_tps if e.feature else None, user_tps=e.user_tps if e.feature else {},
            flags=["--max-num-seqs", "16"], events_file=rel, log_file=f"engines/{e.name}/engine.log",
            endpoint="http://127.0.0.1:0",
        )
    Manifest.synthetic(
        run_dir, run_id=run_id, profile_name="synthetic", engines=manifest_engines, state=state,
        partial_reason=None if state == "complete" else "interrupted (synthetic)", ended_unix_s=1.0,
        started_monotonic_ns=10**12, ended_monotonic_ns=max(e.clock_ns for e in engines), git_commit="synthetic",
        machine={"hostname": "synthetic", "cpu": "simulated", "cpus": 1, "gpu": None, "platform": "synthetic"})
    atomic_write_json(run_dir / "scenarios.json", scen)
    write_client_records(run_dir / "requests.jsonl", client)
    return run_dir


def request_maker(max_tokens: int):
    """``(reqs, cid)``: ``cid()`` the next request id (rb-5e1f0001-1, -2, ...), and ``reqs(user, streams,
    tokens=max_tokens, **kw)`` that many SimRequests of one user, numbered from the same count."""
    n = [0]

    def cid() -> str:
        n[0] += 1
        return f"rb-5e1f0001-{n[0]}"

    def reqs(user, streams, tokens=max_tokens, **kw):
        return [SimRequest(cid(), user, i, tokens, **kw) for i in range(streams)]

    return reqs, cid


def standard_run(run_dir: str | Path, *, limiter: str = "gcra", max_tokens: int = 100, seed: int = 0,
                 state: str = "complete", overhead: bool = True) -> Path:
    """A small run with the seed experiment, isolation, cancellation, EOS and overhead scenarios."""
    reqs, cid = request_maker(max_tokens)

    patched = SimEngine("patched-sync", default_tps=100, user_tps={"user-a": 20, "user-c": 1000, "bulk": 100000},
                        limiter=limiter)
    engines = [patched]
    ua = {"limit_tps": 20, "streams": 1, "backlogged": True}
    ub = {"limit_tps": 100, "streams": 1, "backlogged": True}
    phases = [
        SimPhase("seed-experiment", "seed-experiment", "1-stream", "patched-sync", "measure",
                 {"user-a": ua, "user-b": ub}, reqs("user-a", 1) + reqs("user-b", 1),
                 {"max_tokens": max_tokens, "ignore_eos": True}),
        SimPhase("seed-experiment", "seed-experiment", "4-streams", "patched-sync", "measure",
                 {"user-a": {**ua, "streams": 4}, "user-b": ub}, reqs("user-a", 4) + reqs("user-b", 1),
                 {"max_tokens": max_tokens, "ignore_eos": True}),
        SimPhase("isolation", "isolation", "baseline", "patched-sync", "baseline",
                 {"user-c": {"limit_tps": 1000, "streams": 2, "backlogged": False}}, reqs("user-c", 2)),
        SimPhase("isolation", "isolation", "shared", "patched-sync", "shared",
                 {"user-c": {"limit_tps": 1000, "streams": 2, "backlogged": False},
                  "user-a": {**ua, "streams": 2, "backlogged": False}},
                 reqs("user-c", 2) + reqs("user-a", 2, tokens=max(4, max_tokens // 10))),
        SimPhase("cancellation", "cancellation", "cancel", "patched-sync", "measure",
                 {"user-b": {"limit_tps": 100, "streams": 2, "backlogged": False}},
                 reqs("user-b", 1) + reqs("user-b", 1, cancel_after_ns=300_000_000)),
        SimPhase("eos", "eos", "eos", "patched-sync", "measure",
                 {"user-b": {"limit_tps": 100, "streams": 1, "backlogged": False}},
                 reqs("user-b", 1, ignore_eos=False, eos_after=max_tokens // 3)),
    ]
    if overhead:
        roles = overhead_engines(patched)
        engines += [e for e in roles.values() if e is not patched]
        phases += overhead_phases(roles, cid, max_tokens=max_tokens)
    return write_run_folder(run_dir, engines, phases, state=state, seed=seed)


OVERHEAD_USER = "bulk"


def overhead_engines(feature_on: SimEngine) -> dict[str, SimEngine]:
    """The overhead scenario's roles: ``feature_on`` (its limits never reached by OVERHEAD_USER), the
    same without engine events, the limiter off, and stock vLLM."""
    off = dict(default_tps=None, user_tps={})
    return {
        ROLE_ON: feature_on,
        ROLE_NO_EVENTS: SimEngine("patched-noevents-sync", default_tps=feature_on.default_tps,
                                  user_tps=dict(feature_on.user_tps), record_events=False),
        ROLE_OFF: SimEngine("feature-off-sync", feature=False, **off),
        ROLE_STOCK: SimEngine("stock-sync", kind="stock", feature=False, **off),
    }


def overhead_phases(engines: dict[str, SimEngine], new_id, *, rounds: int = 2, streams: int = 4,
                    max_tokens: int = 100, step_ns: dict[tuple[str, int], int] | None = None) -> list[SimPhase]:
    """The overhead scenario's phases as ``ratebench run`` plans them: one per role and round, the
    order rotating each round. ``new_id()`` gives client ids; ``step_ns[(role, round)]`` slows (or
    speeds up) that one phase's engine steps."""
    roles = list(engines)
    phases = []
    for rnd in range(1, rounds + 1):
        k = (rnd - 1) % len(roles)
        for role in roles[k:] + roles[:k]:
            eng = engines[role]
            limit = eng.user_tps.get(OVERHEAD_USER, eng.default_tps) if eng.feature else None
            phases.append(SimPhase(
                "overhead", "overhead", f"{role}-sync-{rnd}", eng.name, role,
                {OVERHEAD_USER: {"limit_tps": limit, "streams": streams, "backlogged": False}},
                [SimRequest(new_id(), OVERHEAD_USER, i, max_tokens) for i in range(streams)],
                {"max_tokens": max_tokens, "round": rnd, "scheduling": "sync"},
                step_ns=(step_ns or {}).get((role, rnd))))
    return phases
