"""Benchmark: what engine-event recording costs the scheduler's thread, in-process.

    .venv/bin/python benchmarks/event_recording.py [--r 16,256] [--active 4,64] [--rounds 21] [--steps 100]

Two real patched schedulers side by side in one process (``ratebench.profiling.microbench``:
the tiny model's config, a controlled model output, the limiter on with limits never
reached), one built with ``VLLM_OUTPUT_RATE_EVENTS_FILE`` set (dispatch, emit and finish
events written to a temporary file by the recorder's thread) and one without. Rounds
interleave the two; each round times ``--steps`` whole steps (``schedule()``, the
controlled output and ``update_from_output()``, where the emit events are recorded)
and takes their mean, so the flusher thread's packing and writing, which holds the
GIL, is in the figure. Prints, per R and active cap A, the median over rounds of
both, the difference per step and per event (2 A events per step: a dispatch and an
emit per scheduled request) and the ratio.

The patch must be applied (``ratebench patch apply``). Measured on the 2-core
development VM with the recorder as shipped, three runs: R = 16, A = 4: +2.3 to
+4.5 us on a 74 to 77 us step (1.03x to 1.06x, 0.29 to 0.56 us per event); R = 256,
A = 64: +11 to +44 us on a 642 to 690 us step (1.02x to 1.07x, 0.09 to 0.34 us per
event). Before the recorder was changed to append tuples and hand them over once
per step (a lock, two string look-ups and a ``struct.pack`` per event on the
scheduler's thread): 0.85 us per event (1.09x and 1.16x). Against an engine step
these are small: on the cpu-tiny CPU engine (1.4 ms steps, 4 requests per step)
8 events cost about 2.5 us, 0.2 %; on a GPU, steps are milliseconds too.

Event file version 2 adds a step record per ``schedule()`` (and a refuse event per refusal,
none here: limits are never reached). ``Scheduler._record_output_rate_step`` timed alone at
R = 256, A = 64 (nothing waiting, 192 requests on the bench): 4.0 us a step, 0.3 % of the
step; with a waiting queue it adds one pass over the queue (about 0.2 us a request). Two runs
of this benchmark on the same VM at that stop, busier than before: R = 16, A = 4: +0.9 us on
a 144 us step (1.006x); R = 256, A = 64: +285 and +307 us on a 1,124 to 1,254 us step (1.23x
and 1.27x, 2.2 to 2.4 us per event), against 1.02x to 1.07x above; with the step record
switched off in the same process the figure moved by less than its round-to-round spread, so
the difference is the dispatch and emit events' packing on the flusher thread, not the steps.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ratebench.profiling.microbench import (  # noqa: E402
    VARIANT_NEVER_REACHED,
    MicrobenchSettings,
    SchedulerBench,
    warmup_calls_for,
)


def _bench(r: int, active: int, events_dir: str | None) -> SchedulerBench:
    from ratebench.tinymodel import ensure_tiny_model

    settings = MicrobenchSettings(r_values=[r], active_seqs=active)
    if events_dir is not None:
        os.environ["VLLM_OUTPUT_RATE_EVENTS_FILE"] = os.path.join(events_dir, "events-{pid}.rbev")
    try:
        bench = SchedulerBench(VARIANT_NEVER_REACHED, r, settings, ensure_tiny_model())
    finally:
        os.environ.pop("VLLM_OUTPUT_RATE_EVENTS_FILE", None)
    if (bench.scheduler.output_rate_events is not None) != (events_dir is not None):
        sys.exit("the installed vLLM is not patched by ratebench: run `ratebench patch apply` first")
    for _ in range(warmup_calls_for(r, settings)):
        bench.step(timed=False)
    return bench


def _mean_step_us(bench: SchedulerBench, steps: int) -> float:
    gc.collect()
    t0 = time.perf_counter_ns()
    for _ in range(steps):
        bench.step(timed=False)
    return (time.perf_counter_ns() - t0) / steps / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--r", default="16,256", help="resident requests, one per pair with --active")
    ap.add_argument("--active", default="4,64", help="--max-num-active-seqs, one per R")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--steps", type=int, default=100, help="steps per round and scheduler")
    args = ap.parse_args()
    r_values = [int(v) for v in args.r.split(",")]
    actives = [int(v) for v in args.active.split(",")]
    if len(r_values) != len(actives) or any(a > r for r, a in zip(r_values, actives)):
        sys.exit("--r and --active need the same number of values, each active cap at most its R")
    from ratebench.profiling.microbench import quiet_vllm_logs

    quiet_vllm_logs()
    for r, active in zip(r_values, actives):
        with tempfile.TemporaryDirectory(prefix="ratebench-events-") as tmp:
            off, on = _bench(r, active, None), _bench(r, active, tmp)
            times: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(args.rounds):
                times["off"].append(_mean_step_us(off, args.steps))
                times["on"].append(_mean_step_us(on, args.steps))
            on.scheduler.output_rate_events.close()
            size = sum(f.stat().st_size for f in Path(tmp).iterdir())
        m_off, m_on = statistics.median(times["off"]), statistics.median(times["on"])
        per_event = (m_on - m_off) / (2 * active)
        print(f"R={r} A={active}: step without events {m_off:.1f} us, with events {m_on:.1f} us: "
              f"{m_on - m_off:+.1f} us per step, {per_event:+.2f} us per event, {m_on / m_off:.3f}x "
              f"({args.rounds} rounds of {args.steps} steps; event file {size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
