"""CPU time and process groups read from /proc: an engine's processes, the CPU seconds they and the
machine spent (Linux only, as vLLM's CPU build)."""

from __future__ import annotations

import os


def _read_proc(path: str) -> bytes | None:
    """A /proc file's bytes; None when the process is gone."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _proc_stats():
    """(pid, fields after the command) of every process in /proc/<pid>/stat: state (0),
    ppid (1), pgrp (2), ... utime (11), stime (12). The command may hold spaces."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        stat = _read_proc(f"/proc/{entry.name}/stat")
        if stat is not None:
            yield int(entry.name), stat[stat.rfind(b")") + 2 :].split()


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    return [pid for pid, rest in _proc_stats() if len(rest) >= 3 and int(rest[2]) == pgid and rest[0] != b"Z"]


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def groups_cpu_s(pgids: set[int]) -> float:
    """CPU seconds (user + system) the live processes of these process groups have used, from /proc."""
    ticks = sum(int(rest[11]) + int(rest[12]) for _pid, rest in _proc_stats()
                if len(rest) > 12 and int(rest[2]) in pgids)
    return ticks / _CLK_TCK


def engine_core_cpu_s(pgid: int) -> float | None:
    """CPU seconds (user + system, all threads) the EngineCore processes of one engine's process group
    have used, from /proc; None when none is found (vLLM titles them ``VLLM::EngineCore``)."""
    ticks, found = 0, False
    for pid, rest in _proc_stats():
        if len(rest) <= 12 or int(rest[2]) != pgid:
            continue
        cmdline = _read_proc(f"/proc/{pid}/cmdline")
        if cmdline is not None and b"EngineCore" in cmdline:
            ticks += int(rest[11]) + int(rest[12])
            found = True
    return ticks / _CLK_TCK if found else None


def machine_busy_cpu_s() -> float:
    """CPU seconds every CPU of the machine has spent busy (not idle, not waiting for I/O) since boot."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = sum(fields[3:5])  # idle, iowait
    return (sum(fields[:8]) - idle) / _CLK_TCK  # user nice system idle iowait irq softirq steal
