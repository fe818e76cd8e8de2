"""Helpers of the verifier's tests: small synthetic run folders."""

from __future__ import annotations

import json
from pathlib import Path

from ratebench.events import EventFileWriter, read_client_records, read_engine_events, write_client_records
from ratebench.synth import SimEngine, SimPhase, SimRequest, write_run_folder


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
