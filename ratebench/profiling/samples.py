"""py-spy's collapsed stacks: reading them, and sorting samples into the engine table's categories.

A sample belongs to each category one of its frames belongs to (not exclusive: the
limiter runs inside ``schedule()``). Only the EngineCore's busy-loop thread counts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

# A py-spy frame: ``name (file:line)``; the line is absent with --nolineno.
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


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
    m = FRAME.match(frame)
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
