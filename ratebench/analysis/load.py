"""Loading a run folder (docs/run-folder.md) into plain dataclasses.

The only module of ``ratebench.analysis`` that reads files. Everything it
refuses raises :class:`RunFolderError` with the file and the reason, which
``verify-bound`` turns into exit code 2.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ratebench.events import KIND_DISPATCH, KIND_EMIT, EngineEvents, EventFileError, read_engine_events
from ratebench.runrecords import ClientRecord, EngineEntry, PhaseRecord, client_id_of, read_client_records
from ratebench.analysis.segments import Groups, group_by, time_order


def is_warmup_request(engine_request_id: str, engine: str) -> bool:
    """A warm-up request the driver sends each engine once it is ready (``ratebench.engine.warm_up``:
    ``X-Request-Id: warmup-<engine>-<n>``, inside the engine's request id), or a probe a scenario sends
    before its phase (a beam search probe, ``X-Request-Id: probe-<engine>-<n>``: its beams are engine
    requests of their own). It belongs to no phase and has no client record; its events still count in
    the whole-file bound."""
    return re.search(rf"(?<![0-9A-Za-z])(warmup|probe)-{re.escape(engine)}-[0-9]+(?![0-9])",
                     engine_request_id) is not None


class RunFolderError(Exception):
    """A run folder that cannot be verified: the message names the file and why."""


@dataclass
class EngineInfo:
    """One entry of manifest.json's engines."""

    name: str
    kind: str
    feature: bool
    async_scheduling: bool
    default_tps: int | None
    user_tps: dict[str, int]
    events_file: Path | None
    scheduling_policy: str | None = None  # "fcfs" or "priority" as asked; None: not recorded

    def limit_of(self, user: str) -> int | None:
        if not self.feature:
            return None
        return self.user_tps.get(user, self.default_tps)


@dataclass
class EngineTrace:
    """One engine's events, time-sorted, with each request code tied to the client side."""

    engine: str
    events: EngineEvents
    records: np.ndarray  # RECORD_DTYPE, sorted by time (stable)
    req_record: np.ndarray  # per string code: index into RunData.records, or -1
    req_phase: np.ndarray  # per string code: index into RunData.phases, or -1
    _columns: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def runs_priority_policy(self) -> bool:
        """Whether the engine ran vLLM's PRIORITY scheduling policy (its event file's header): a user's
        streams take turns within a priority, higher priorities first."""
        policy = self.events.meta.get("policy")
        return isinstance(policy, str) and policy.upper() == "PRIORITY"

    def of_kind(self, kind: int, names: tuple[str, ...] = ("t_ns", "req", "user", "count")) -> dict[str, np.ndarray]:
        """Columns of the events of one kind, time-sorted, each a contiguous array; each made once per
        engine, kind and column (the analyses share them)."""
        sel = self._columns.get(("select", kind))
        if sel is None:
            sel = self._columns[("select", kind)] = np.flatnonzero(self.records["kind"] == kind)
        out = {}
        for name in names:
            col = self._columns.get((kind, name))
            if col is None:
                col = self._columns[(kind, name)] = np.ascontiguousarray(self.records[name][sel])
            out[name] = col
        return out

    def first_event_ns(self) -> np.ndarray:
        """Per request code: the time of its first event of any kind (-1: none); made once."""
        got = self._columns.get("first-event")
        if got is None:
            n_codes = max(len(self.req_record), int(self.records["req"].max()) + 1 if len(self.records) else 0, 1)
            big = np.iinfo(np.int64).max
            got = np.full(n_codes, big, dtype=np.int64)
            kinds = np.flatnonzero(np.bincount(self.records["kind"])) if len(self.records) else []
            for kind in kinds.tolist() if len(kinds) else []:
                if kind in (KIND_DISPATCH, KIND_EMIT):  # from their groupings by request
                    groups, t = self.by_request(KIND_DISPATCH if kind == KIND_DISPATCH else "emits")
                    if len(groups):
                        got[groups.keys] = np.minimum(got[groups.keys], t[groups.starts])
                    if kind == KIND_DISPATCH:
                        continue
                    cols = self.of_kind(KIND_EMIT, ("t_ns", "req", "count"))
                    zero = cols["count"] == 0  # emits of no tokens are events too
                    req, t = cols["req"][zero], cols["t_ns"][zero]
                else:
                    cols = self.of_kind(kind, ("t_ns", "req"))
                    req, t = cols["req"], cols["t_ns"]
                if len(req):
                    first = np.full(n_codes, big, dtype=np.int64)
                    first[req[::-1]] = t[::-1]  # assigned in reverse time order: the earliest wins
                    np.minimum(got, first, out=got)
            got[got == big] = -1
            self._columns["first-event"] = got
        return got

    def emits(self) -> dict[str, np.ndarray]:
        """The emit events that carry tokens (an emit of no tokens adds nothing), as :meth:`of_kind`."""
        cols = self._columns.get("emits")
        if cols is None:
            cols = self.of_kind(KIND_EMIT)
            if len(cols["count"]) and cols["count"].min() == 0:
                keep = cols["count"] > 0
                cols = {name: col[keep] for name, col in cols.items()}
            self._columns["emits"] = cols
        return cols

    def by_request(self, kind: int | str) -> tuple[Groups, np.ndarray]:
        """The events of one kind (or ``"emits"``: :meth:`emits`) grouped by request (time order kept
        inside each), and their times in that order; made once per engine and kind."""
        key = ("by-request", kind)
        got = self._columns.get(key)
        if got is None:
            cols = self.emits() if kind == "emits" else self.of_kind(kind)
            groups = group_by(cols["req"])
            got = self._columns[key] = (groups, cols["t_ns"][groups.order])
        return got

    def request_gaps(self, kind: int) -> dict[str, np.ndarray]:
        """Per request code with events of one kind (``codes``, ascending): ``count``, ``first`` and
        ``last`` time, and the longest time between two of its consecutive events (``gap``, -1 for
        fewer than two) with the time that gap began (``gap_at``: the first such gap's); made once."""
        key = ("gaps", kind)
        got = self._columns.get(key)
        if got is None:
            groups, t = self.by_request(kind)
            n = groups.ends - groups.starts
            gap = np.full(len(n), -1, dtype=np.int64)
            gap_at = np.zeros(len(n), dtype=np.int64)
            two = np.flatnonzero(n >= 2)
            if len(two):
                group_of = np.repeat(np.arange(len(n)), n)
                within = group_of[1:] == group_of[:-1]
                d = np.where(within, np.diff(t), -1)  # d[k] = t[k + 1] - t[k] inside one request
                segs = groups.starts[two]  # a request's first gap up to the next such request's
                gap[two] = np.maximum.reduceat(d, segs)
                big = np.iinfo(np.int64).max
                hit = np.where(within & (d == gap[group_of[:-1]]), np.arange(len(d)), big)
                gap_at[two] = t[np.minimum.reduceat(hit, segs)]
            got = self._columns[key] = dict(codes=groups.keys, count=n, first=t[groups.starts] if len(n) else n,
                                            last=t[groups.ends - 1] if len(n) else n, gap=gap, gap_at=gap_at)
        return got


@dataclass
class RunData:
    run_dir: Path
    manifest: dict
    phases: list[PhaseRecord]
    records: list[ClientRecord]
    engines: dict[str, EngineInfo]
    traces: dict[str, EngineTrace]
    warnings: list[str] = field(default_factory=list)
    stage_s: dict[str, float] = field(default_factory=dict)  # wall time of each part, for benchmarks


def _read_json(path: Path, what: str):
    if not path.is_file():
        raise RunFolderError(f"{path}: missing ({what})")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise RunFolderError(f"{path}: not valid JSON ({exc})") from exc


def _phase(i: int, entry: dict, path: Path) -> PhaseRecord:
    try:
        return PhaseRecord.from_json(i, entry)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RunFolderError(f"{path}: entry {i} is not a scenario phase ({type(exc).__name__}: {exc})") from exc


def _engine(name: str, entry: dict, run_dir: Path) -> EngineInfo:
    e = EngineEntry.from_json(entry)
    return EngineInfo(
        name=name, kind=str(e.kind), feature=bool(e.feature), async_scheduling=bool(e.async_scheduling),
        default_tps=None if e.default_tps is None else int(e.default_tps),
        user_tps={str(k): int(v) for k, v in (e.user_tps or {}).items()},
        events_file=(run_dir / e.events_file) if e.events_file else None,
        scheduling_policy=None if e.scheduling_policy is None else str(e.scheduling_policy).lower(),
    )


def load_run(run_dir: str | Path, *, require_complete: bool = True) -> RunData:
    """Read manifest.json, scenarios.json, requests.jsonl and every engine event file."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunFolderError(f"{run_dir}: not a directory (expected a run folder from `ratebench run`)")
    manifest_path = run_dir / "manifest.json"
    manifest = _read_json(manifest_path, "the run's manifest, written by `ratebench run`")
    if not isinstance(manifest, dict):
        raise RunFolderError(f"{manifest_path}: not a JSON object")
    state = manifest.get("state")
    if require_complete and state != "complete":
        why = manifest.get("partial_reason")
        raise RunFolderError(
            f"{manifest_path}: run state is {state!r}"
            + (f" ({why})" if why else "")
            + "; verify-bound checks only complete runs: rerun `ratebench run`, or check the phases that "
            "completed with `ratebench verify-bound --partial`"
        )
    try:
        engines = {n: _engine(n, e, run_dir) for n, e in (manifest.get("engines") or {}).items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise RunFolderError(f"{manifest_path}: engines entry unreadable ({exc})") from exc

    scen_path = run_dir / "scenarios.json"
    scen = _read_json(scen_path, "the scenario phases, written by `ratebench run`")
    if not isinstance(scen, list):
        raise RunFolderError(f"{scen_path}: expected a JSON list of scenario phases")
    phases = [_phase(i, e, scen_path) for i, e in enumerate(scen)]
    for p in phases:
        if p.engine not in engines:
            raise RunFolderError(f"{scen_path}: phase {p.label} names engine {p.engine!r}, not in manifest.json")

    req_path = run_dir / "requests.jsonl"
    if not req_path.is_file():
        raise RunFolderError(f"{req_path}: missing (client records, written by `ratebench run`)")
    t0 = time.perf_counter()
    try:
        records = read_client_records(req_path)
    except EventFileError as exc:
        raise RunFolderError(str(exc)) from exc
    if any(r.choices is not None for r in records):
        # a request of n > 1 answers is n engine requests: one record per answer, each joined to its own
        records = [a for r in records for a in r.answers()]

    run = RunData(run_dir, manifest, phases, records, engines, {})
    run_warnings = [w for w in manifest.get("warnings") or [] if isinstance(w, str)]
    run_warnings += [e["warning"] for e in (manifest.get("engines") or {}).values()
                     if isinstance(e, dict) and isinstance(e.get("warning"), str) and e["warning"] not in run_warnings]
    run.warnings.extend(f"run: {w}" for w in run_warnings)
    run.stage_s["requests.jsonl"] = time.perf_counter() - t0
    phase_of_key = {p.key: p.index for p in phases}
    for name, eng in engines.items():
        if eng.events_file is None:
            continue
        t0 = time.perf_counter()
        if not eng.events_file.is_file():
            raise RunFolderError(f"{eng.events_file}: missing (engine events of {name!r}, named in manifest.json)")
        try:
            events = read_engine_events(eng.events_file)
        except EventFileError as exc:
            raise RunFolderError(str(exc)) from exc
        if events.truncated:
            run.warnings.append(f"{eng.events_file}: last block truncated; verified the complete blocks")
        recs = events.records
        order = time_order(recs["t_ns"])
        if order is not None:
            recs = recs[order]
        used = np.flatnonzero(np.bincount(recs["req"], minlength=len(events.strings))) if len(recs) else \
            np.empty(0, dtype=np.int64)
        run.traces[name] = _trace(name, events, recs, records, phase_of_key, used)
        run.stage_s[f"events {name}"] = time.perf_counter() - t0
        unmatched_codes = used[run.traces[name].req_record[used] < 0]
        # the driver's warm-up requests have no client record by design (docs/run-folder.md)
        unmatched = sum(1 for c in unmatched_codes.tolist() if not is_warmup_request(events.strings[c], name))
        if unmatched:
            run.warnings.append(f"engine {name}: {unmatched} engine requests match no client record")
    return run


def _trace(name: str, events: EngineEvents, recs: np.ndarray, records: list[ClientRecord], phase_of_key,
           used: np.ndarray) -> EngineTrace:
    """``used``: the string codes that are request ids of some event."""
    n_codes = len(events.strings)
    req_record = np.full(n_codes, -1, dtype=np.int64)
    req_phase = np.full(n_codes, -1, dtype=np.int64)
    index = {r.client_id: i for i, r in enumerate(records) if r.engine == name}
    strings = events.strings
    codes, found, phases = [], [], []
    for code in used.tolist():
        cid = client_id_of(strings[code])
        i = index.get(cid) if cid else None
        if i is not None:
            r = records[i]
            codes.append(code)
            found.append(i)
            phases.append(phase_of_key.get((r.scenario, r.phase, r.engine), -1))
    req_record[codes] = found
    req_phase[codes] = phases
    return EngineTrace(name, events, recs, req_record, req_phase)
