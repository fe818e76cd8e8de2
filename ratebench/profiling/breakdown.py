"""Where inside ``schedule()`` the time goes, in one microbenchmark variant.

:func:`breakdown`: cProfile of ``schedule()`` alone, naming the patch's functions
and the hottest others. :func:`line_breakdown`: py-spy on this process, each sample
inside ``schedule()`` given to the line of schedule() it was on, marked as added by
the patch or upstream vLLM's.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ratebench.profiling.microbench import (
    VARIANT_OFF,
    VARIANTS,
    MicrobenchSettings,
    SchedulerBench,
    quiet_vllm_logs,
    scheduler_source,
    warmup_calls_for,
)
from ratebench.profiling.pyspy import ptrace_problem, py_spy_command
from ratebench.profiling.samples import FRAME, read_collapsed

# The microbenchmark variants profile-scheduler --breakdown looks into (the feature on).
BREAKDOWN_VARIANTS = tuple(v for v in VARIANTS if v != VARIANT_OFF)


# The patch's code: every function of output_rate.py and every scheduler method with
# "output_rate" in its name (the patch names its code so; the names change as it does).
def is_patch_function(name: str, file: str) -> bool:
    return file.endswith("output_rate.py") or ("output_rate" in name and file.endswith("scheduler.py"))


@dataclass
class FunctionCost:
    function: str  # "file:line(name)"
    calls: int
    tottime_us_per_step: float  # in the function itself
    cumtime_us_per_step: float  # with what it calls


@dataclass
class Breakdown:
    variant: str
    r: int
    steps: int
    schedule_us_per_step: float  # under cProfile (inflated by it; compare shares, not absolutes)
    patch: dict[str, FunctionCost]  # the patch's functions (is_patch_function) by name
    top: list[FunctionCost]  # by tottime
    state: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def breakdown(variant: str, r: int, settings: MicrobenchSettings, steps: int = 300, top_n: int = 15,
              model_dir: Path | None = None) -> Breakdown:
    """cProfile of ``schedule()`` alone (the profiler runs only around it) over ``steps``
    steps of one microbenchmark variant at R, after its warm-up."""
    import cProfile
    import pstats

    scheduler_source()  # before the first scheduler is built: the text these figures belong to
    bench = _warmed_bench(variant, r, settings, model_dir)
    profiler = cProfile.Profile()
    scheduler = bench.scheduler
    original = scheduler.schedule

    def profiled_schedule(*args, **kwargs):
        profiler.enable()
        try:
            return original(*args, **kwargs)
        finally:
            profiler.disable()

    scheduler.schedule = profiled_schedule
    try:
        for _ in range(steps):
            bench.step()
    finally:
        del scheduler.schedule
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    total_us = 0.0
    patch: dict[str, FunctionCost] = {}
    rows: list[FunctionCost] = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in stats.items():
        short = f"{_short_path(file)}:{line}({name})"
        cost = FunctionCost(short, nc, tt * 1e6 / steps, ct * 1e6 / steps)
        rows.append(cost)
        if name == "schedule" and file.endswith(os.path.join("sched", "scheduler.py")):
            total_us = cost.cumtime_us_per_step
        if is_patch_function(name, file):
            patch[name] = cost
    rows.sort(key=lambda c: c.tottime_us_per_step, reverse=True)
    notes = ["cProfile slows calls, not loops: it inflates code that makes many small calls (request "
             "properties) and under-weights plain loops (the rotation); read call counts here, shares from "
             "the py-spy line breakdown, absolute times from the microbenchmark"]
    return Breakdown(variant, r, steps, total_us, patch, rows[:top_n], bench.state(), notes)


def _short_path(file: str) -> str:
    for marker in ("site-packages" + os.sep, "lib" + os.sep + "python"):
        if marker in file:
            return file.split(marker, 1)[1]
    return file


SCHEDULER_FILE = "vllm/v1/core/sched/scheduler.py"


def patch_added_lines(target: str = SCHEDULER_FILE, patch_dir: Path | None = None) -> dict[int, str]:
    """The lines the patch series adds to ``target``: line number in the patched file -> text."""
    from ratebench import patching

    patch_dir = Path(patch_dir) if patch_dir is not None else patching.DEFAULT_PATCH_DIR
    names = [ln.strip() for ln in (patch_dir / "series").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    added: dict[int, str] = {}
    for name in names:
        in_target, new_line = False, 0
        for line in (patch_dir / name).read_text().splitlines():
            if line.startswith("+++ "):
                in_target = line[4:].strip().removeprefix("b/") == target
                continue
            if line.startswith("--- ") and not in_target:
                continue
            if not in_target:
                continue
            m = re.match(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,\d+)? @@", line)
            if m:
                new_line = int(m.group(1))
            elif line.startswith("+"):
                added[new_line] = line[1:]
                new_line += 1
            elif line.startswith(" ") or line == "":
                new_line += 1
    return added


@dataclass
class LineCost:
    line: int
    share: float  # of the samples inside schedule()
    from_patch: bool
    source: str


@dataclass
class LineBreakdown:
    variant: str
    r: int
    samples_in_schedule: int
    patch_share: float  # samples at lines the patch added (their callees included)
    top: list[LineCost]
    state: dict[str, Any]
    error: str | None = None


def _warmed_bench(variant: str, r: int, settings: MicrobenchSettings, model_dir: Path | None) -> SchedulerBench:
    """One microbenchmark variant at R, stepped through its warm-up."""
    if model_dir is None:
        from ratebench.tinymodel import ensure_tiny_model

        model_dir = ensure_tiny_model()
    quiet_vllm_logs()
    bench = SchedulerBench(variant, r, settings, model_dir)
    for _ in range(warmup_calls_for(r, settings)):
        bench.step(timed=False)
    return bench


def line_breakdown(variant: str, r: int, settings: MicrobenchSettings, duration_s: float = 5.0,
                   rate_hz: int = 250, top_n: int = 12, model_dir: Path | None = None) -> LineBreakdown:
    """py-spy on this process while it steps one microbenchmark variant: each sample inside
    ``schedule()`` goes to the line of schedule() it was on (a call site holds its callee's
    time), marked as added by the patch or upstream vLLM's."""
    source = scheduler_source()
    bench = _warmed_bench(variant, r, settings, model_dir)
    problem = ptrace_problem()
    if problem is not None:
        return LineBreakdown(variant, r, 0, 0.0, [], bench.state(), problem)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ratebench-lines-") as tmp:
        raw = Path(tmp) / "raw.txt"
        proc = subprocess.Popen(py_spy_command(os.getpid(), raw, duration_s, rate_hz, by_function=False, idle=False),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        while proc.poll() is None:
            for _ in range(10):
                bench.step()
        _, err = proc.communicate()
        if proc.returncode != 0 or not raw.exists():
            return LineBreakdown(variant, r, 0, 0.0, [], bench.state(),
                                 f"py-spy exited with {proc.returncode}: {err.decode(errors='replace')[-300:]}")
        stacks = read_collapsed(raw)
    added = patch_added_lines()
    per_line: dict[int, int] = {}
    for frames, n in stacks:
        for frame in reversed(frames):  # innermost schedule() frame of this sample
            m = FRAME.match(frame)
            if m and m.group("func").rsplit(".", 1)[-1] == "schedule" \
                    and m.group("file").endswith("sched/scheduler.py") and m.group("line"):
                line = int(m.group("line"))
                per_line[line] = per_line.get(line, 0) + n
                break
    total = sum(per_line.values())
    top = [LineCost(line, n / total, line in added, source.line(line).strip())
           for line, n in sorted(per_line.items(), key=lambda kv: kv[1], reverse=True)[:top_n]] if total else []
    patch_share = sum(n for line, n in per_line.items() if line in added) / total if total else 0.0
    error = None
    if source.changed_on_disk():
        error = ("the patched scheduler.py changed on disk since this process imported it: the lines are those "
                 "of the imported text, the patch/upstream marks come from the patch files now; rerun")
    return LineBreakdown(variant, r, total, patch_share, top, bench.state(), error)
