"""Where profile-scheduler writes: the output folder and ``profile-scheduler.json``."""

from __future__ import annotations

import secrets
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from ratebench import __version__
from ratebench._io import atomic_write_json
from ratebench.profiling.breakdown import Breakdown, LineBreakdown
from ratebench.profiling.engine import EngineReport
from ratebench.profiling.microbench import scheduler_source
from ratebench.profiling.statistics import MicrobenchReport, target_verdicts


def new_out_dir(results_dir: Path = Path("results")) -> Path:
    """results/profile-scheduler/<UTC>-<id>/"""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = results_dir / "profile-scheduler" / f"{stamp}-{secrets.token_hex(4)}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def write_results(out_dir: Path, *, command: list[str], microbench: MicrobenchReport | None,
                  engine: EngineReport | None, breakdowns: list[Breakdown],
                  line_breakdowns: list[LineBreakdown] = ()) -> Path:
    """profile-scheduler.json, atomically: every figure with the settings that produced it."""
    from ratebench.manifest import git_commit, machine_info, vllm_and_patch

    vllm_version, patch_hash = vllm_and_patch()
    doc = {
        "ratebench_version": __version__,
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "git_commit": git_commit(),
        "machine": machine_info(),
        "vllm_version": vllm_version,
        "patch_sha256": patch_hash,
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
