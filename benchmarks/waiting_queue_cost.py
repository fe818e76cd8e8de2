"""Benchmark: what a queue of throttled users' requests costs each scheduler step, in-process.

    .venv/bin/python benchmarks/waiting_queue_cost.py [--w 0,50,100,200,400] [--steps 200]

Real schedulers built from the installed (patched) vLLM with the tiny model's config and a
controlled model output (``tests/sched_harness.py``, the scheduler tests' harness): the limiter
on at 15 tok/s with 16 resident slots and 4 active places, 16 resident requests of 16 users, then
W more queued requests of the same users (every slot taken, every user at its limit most of the
time: cpu-tiny's ``mix`` in small); against the limiter off with the same requests on 4 slots
(the limiter-off engine of a mix baseline). Prints, per W, the mean microseconds of a whole step
(``schedule()``, the controlled output, ``update_from_output()``) over ``--steps`` steps after
the queue has formed, both engines side by side.

Why it matters: on a two-core machine the engine's scheduling shares the CPU with the model, so
a step that grows with the queue makes the queue grow (cpu-tiny's mix: 137 to 282 requests
waiting on average on the limiter-on engine). Measured on the 2-core development VM, the patch
before and after queued requests of throttled users were held out of the queue and claims were
indexed by user (one run each, us per step, limiter on / off): W = 0: 39 / 66 and 41 / 76;
W = 100: 401 / 63 and 186 / 94; W = 200: 646 / 63 and 208 / 107; W = 400: 1,204 / 106 and
256 / 66 (about 3 us per queued request a step before, 0.5 us after: what is left grows with
the throttled residents' turns and the held users' heap). With the waiting queue a heap in order
of the users' loads (rule 4; membership and removal no longer search a deque), one run:
W = 200: 141 / 60; W = 400: 175 / 61.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from sched_harness import Engine, FakeClock, create_scheduler, make_request, model_output  # noqa: E402


def step_us(w: int, feature: bool, steps: int) -> tuple[float, int, int]:
    clock = FakeClock()
    s = create_scheduler(default_tps=15 if feature else None, max_num_seqs=16 if feature else 4,
                         max_num_active_seqs=4 if feature else None, clock=clock)
    e = Engine(s, clock, step_s=0.004)
    e.add(*(make_request(f"r{i}", user=f"u{i:02d}", prompt_len=24, max_tokens=100_000) for i in range(16)))
    e.run_for_s(0.5)
    e.add(*(make_request(f"w{i}", user=f"u{i % 16:02d}", prompt_len=24, max_tokens=100_000) for i in range(w)))
    e.run_for_s(0.2)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = s.schedule()
        clock.advance_ns(4_000_000)
        s.update_from_output(out, model_output(s, out))
    running, waiting = s.get_request_counts()
    return (time.perf_counter() - t0) / steps * 1e6, running, waiting


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--w", default="0,50,100,200,400", help="queued requests W, comma separated")
    ap.add_argument("--steps", type=int, default=200, help="steps timed per W and engine")
    args = ap.parse_args()
    print(f"{'W':>5} {'limiter on us/step':>19} {'limiter off us/step':>20} {'on/off':>7}  waiting (on, off)")
    for w in (int(x) for x in args.w.split(",")):
        on, _, wait_on = step_us(w, True, args.steps)
        off, _, wait_off = step_us(w, False, args.steps)
        print(f"{w:5d} {on:19.1f} {off:20.1f} {on / off:7.2f}  {wait_on}, {wait_off}")


if __name__ == "__main__":
    main()
