"""What a changed batch costs an engine step, read from a run folder.

    .venv/bin/python benchmarks/batch_churn.py RUN_DIR [--scenario NAME ...] [--json PATH]

The limiter's places go round the users with budget, so consecutive steps of the
limiter-on engine often run different requests where the limiter-off engine, first
come first served, keeps running the same ones until they end. vLLM's model runner
keeps a persistent batch and re-adds a request left out of the step before (its
token ids, block table row, sampling state), so a changed batch costs a step more
than the scheduler's own work (``profile-scheduler`` measures that part alone).

For every phase of the run folder (or of the scenarios named) and every engine with
an event file, synchronous scheduling only (an asynchronous engine's emits trail its
steps), this prints the interval from one step's start to the next's (the engine's
step clock: schedule, model, update, and whatever the two cores did between) for
decode-only steps (tokens scheduled == requests scheduled) followed by a step that
ran, by the number of requests and by whether the requests that emitted a token in
the step are the same set as in the step before. The same requests of a scenario on
the limiter-on and the limiter-off engine (``overhead``, ``mix``) give the controlled
comparison; the table's ``changed`` column is the share of steps whose batch changed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from ratebench._io import atomic_write_json
from ratebench.events import read_engine_events

EMIT = 2


def phase_rows(run_dir: Path, scenarios: set[str] | None) -> list[dict]:
    phases = json.loads((run_dir / "scenarios.json").read_text())
    events: dict[str, object] = {}
    rows = []
    for phase in phases:
        if scenarios and phase["scenario"] not in scenarios:
            continue
        engine = phase["engine"]
        path = run_dir / "engines" / engine / "events.rbev"
        if not path.exists():
            continue
        if engine not in events:
            events[engine] = read_engine_events(path)
        ev = events[engine]
        if ev.meta.get("async_scheduling"):
            continue
        steps = ev.steps
        t = steps["t_ns"]
        inside = np.nonzero((t >= phase["start_ns"]) & (t <= phase["end_ns"]))[0]
        if len(inside) < 3:
            continue
        emits = ev.of_kind(EMIT)
        emits = emits[(emits["t_ns"] >= t[inside[0]]) & (emits["t_ns"] <= phase["end_ns"])]
        step_of = np.searchsorted(t, emits["t_ns"], side="right") - 1
        batch: dict[int, set[int]] = defaultdict(set)
        for step, req in zip(step_of.tolist(), emits["req"].tolist()):
            batch[step].add(req)
        by_key: dict[tuple[int, bool], list[float]] = defaultdict(list)
        for i in inside[1:-1].tolist():
            reqs = int(steps["reqs"][i])
            if reqs == 0 or int(steps["tokens"][i]) != reqs or int(steps["reqs"][i + 1]) == 0:
                continue
            changed = batch.get(i) != batch.get(i - 1)
            by_key[(reqs, changed)].append((int(t[i + 1]) - int(t[i])) / 1e6)
        for (reqs, changed), gaps in sorted(by_key.items()):
            values = np.array(gaps)
            rows.append(dict(scenario=phase["scenario"], phase=phase["phase"], engine=engine, role=phase.get("role"),
                             reqs=reqs, batch="changed" if changed else "same", steps=len(values),
                             p50_ms=round(float(np.median(values)), 3),
                             p90_ms=round(float(np.percentile(values, 90)), 3)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--scenario", action="append", help="only this scenario (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if not (args.run_dir / "scenarios.json").exists():
        print(f"{args.run_dir}: not a run folder (no scenarios.json); give the folder `ratebench run` wrote",
              file=sys.stderr)
        return 2
    rows = phase_rows(args.run_dir, set(args.scenario) if args.scenario else None)
    if not rows:
        print("no synchronous engine phase with step records and decode-only steps", file=sys.stderr)
        return 1
    by_phase: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        by_phase[(row["scenario"], row["phase"], row["engine"])].append(row)
    print(f"{'scenario':<10} {'phase':<20} {'engine':<18} {'reqs':>4} {'batch':<8} {'steps':>6} "
          f"{'p50 ms':>7} {'p90 ms':>7}")
    for (scenario, phase, engine), phase_rows_ in by_phase.items():
        total = sum(r["steps"] for r in phase_rows_)
        changed = sum(r["steps"] for r in phase_rows_ if r["batch"] == "changed")
        for r in phase_rows_:
            print(f"{scenario:<10} {phase:<20} {engine:<18} {r['reqs']:>4} {r['batch']:<8} {r['steps']:>6} "
                  f"{r['p50_ms']:>7.2f} {r['p90_ms']:>7.2f}")
        print(f"{'':<10} {'':<20} {'':<18} changed batch in {changed} of {total} decode-only steps "
              f"({100 * changed / total:.0f} %)")
    if args.json:
        atomic_write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
