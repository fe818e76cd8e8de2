"""What py-spy recorders running side by side cost the recorded process.

profile-scheduler wants three files per R (raw stacks for the shares, flamegraph
and speedscope for people; ``ratebench/profiling/pyspy.py``), and py-spy writes
one format per recording. py-spy stops the process for every sample (blocking
mode), so three recorders over one window stop it three times as often. This
measures what that costs, and so why profile-scheduler records the raw stacks
alone and the two pictures together in a second window.

The target is a Python loop that reads the clock as fast as it can; a stop shows
as a gap between two readings. Gaps of 10 us to 1 ms count as stops (the kernel's
preemption by other processes gives gaps of milliseconds; the loop's own readings
are well under a microsecond apart). Per condition (no recorder, raw only, the two
pictures, all three at once), interleaved over rounds: the share of the window
lost in such gaps, the stop per sample, and the CPU time the recorders used.

    .venv/bin/python benchmarks/py_spy_formats.py [--rounds 7] [--duration-s 5] [--rate-hz 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ratebench.profiling.pyspy import py_spy_binary

TARGET = r"""
import sys, time
clock = time.perf_counter_ns
print("ready", flush=True)
while True:
    line = sys.stdin.readline()
    if not line: break
    end = clock() + int(float(line) * 1e9)
    n = lost = 0
    last = clock()
    while last < end:
        now = clock()
        gap = now - last
        if 10_000 <= gap <= 1_000_000:
            n += 1; lost += gap
        last = now
    print(n, lost, flush=True)
"""


def window(target: subprocess.Popen, duration_s: float, formats: list[str], rate_hz: int,
           tmp: Path) -> tuple[int, float, float]:
    """(pauses, share of the window lost in them, recorders' CPU seconds)."""
    recorders = [subprocess.Popen([py_spy_binary(), "record", "--pid", str(target.pid), "--duration",
                                   str(round(duration_s)), "--rate", str(rate_hz), "--format", f, "--function",
                                   "--idle", "--output", str(tmp / f"out.{f}")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for f in formats]
    time.sleep(1.0)  # the recorders attached (and as long without them) before the window starts
    window_s = duration_s - 2.0
    target.stdin.write(f"{window_s}\n")
    target.stdin.flush()
    pauses, lost_ns = map(int, target.stdout.readline().split())
    cpu_s = 0.0
    for r in recorders:
        _, _, usage = os.wait4(r.pid, 0)
        cpu_s += usage.ru_utime + usage.ru_stime
    return pauses, lost_ns / (window_s * 1e9), cpu_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--duration-s", type=float, default=5.0)
    ap.add_argument("--rate-hz", type=int, default=100)
    args = ap.parse_args()
    conditions = {"none": [], "raw": ["raw"], "flamegraph+speedscope": ["flamegraph", "speedscope"],
                  "raw+flamegraph+speedscope": ["raw", "flamegraph", "speedscope"]}
    results: dict[str, list[tuple[int, float, float]]] = {c: [] for c in conditions}
    target = subprocess.Popen([sys.executable, "-c", TARGET], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    target.stdout.readline()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.rounds):
                for name, formats in conditions.items():
                    results[name].append(window(target, args.duration_s, formats, args.rate_hz, Path(tmp)))
    finally:
        target.stdin.close()
        target.wait()
    window_s = args.duration_s - 2.0
    base_lost = statistics.median(x[1] for x in results["none"])
    base_pauses = statistics.median(x[0] for x in results["none"])
    print(f"{args.rounds} rounds, {window_s:.0f} s windows, {args.rate_hz} Hz per recorder")
    for name, xs in results.items():
        lost = [x[1] for x in xs]
        pauses = statistics.median(x[0] for x in xs)
        samples = len(conditions[name]) * args.rate_hz * window_s
        per_sample = ((statistics.median(lost) - base_lost) * window_s * 1e6 / samples) if samples else 0.0
        print(f"{name:28s} pauses {pauses:6.0f} (none: {base_pauses:.0f})  window lost: median "
              f"{100 * statistics.median(lost):.2f} % [{100 * min(lost):.2f}-{100 * max(lost):.2f}]  "
              f"per sample {per_sample:5.1f} us  recorders' CPU {statistics.median(x[2] for x in xs):.2f} s "
              f"per {args.duration_s:.0f} s")


if __name__ == "__main__":
    main()
