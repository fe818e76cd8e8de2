"""py-spy itself: can it attach here, which process is the EngineCore, the ``record`` command.

py-spy 0.4 writes one format per ``record`` (``--format raw|flamegraph|speedscope``)
and cannot convert a recording into another format afterwards. profile-scheduler
wants three files per R: the raw collapsed stacks, which ratebench reads for the
shares of the engine table, and py-spy's flame graph and speedscope file, for
people. It records two windows one after the other under the same load
(:data:`RECORDING_WINDOWS`): the raw stacks alone, then the flame graph and the
speedscope file side by side. Why not the alternatives:

- All three recorders over one window: py-spy stops the process for every sample,
  so three recorders stop it three times as often, and the stops bias the shares
  (the worker computes on while the EngineCore is stopped, so ``model wait``
  shrinks). ``benchmarks/py_spy_formats.py`` on this 2-core machine, 100 Hz per
  recorder, a busy Python loop: 1.8 % of the window lost with no recorder, 4.0 %
  with the raw one, 7.6 % with all three (medians of 7 rounds, others' jobs
  running). The table's window keeps one recorder.
- One raw recording and files of our own made from it: two writers to keep up
  with formats py-spy writes better (its flame graph is interactive: search,
  zoom); what they saved is one window per R (``--duration-s``, 4 s by default).

So the pictures are of the window just after the table's, with the same streams
resident: they agree with the table within sampling noise, not sample for sample.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

# vLLM names its engine process so (setproctitle).
ENGINE_CORE_TITLES = ("VLLM::EngineCore", "EngineCore")

# The files of one R: py-spy format -> file suffix (R<r><suffix>).
RECORDING_FORMATS = {"raw": ".raw.txt", "flamegraph": ".svg", "speedscope": ".speedscope.json"}
# The formats recorded together, window after window: the stacks the table counts alone, then
# the two pictures.
RECORDING_WINDOWS = (("raw",), ("flamegraph", "speedscope"))


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


def py_spy_command(pid: int, output: Path, duration_s: float, rate_hz: int, *, fmt: str = "raw",
                   by_function: bool = True, idle: bool = True) -> list[str]:
    """``py-spy record`` of one process into ``output`` in format ``fmt`` (raw: collapsed
    stacks), no subprocesses; by function (``--function``) or by line; idle samples kept
    (``--idle``)."""
    cmd = [py_spy_binary(), "record", "--pid", str(pid), "--duration", str(max(1, round(duration_s))),
           "--rate", str(rate_hz), "--format", fmt, "--output", str(output)]
    if by_function:
        cmd.append("--function")
    if idle:
        cmd.append("--idle")
    return cmd
