"""The run folder's record of a run: ``manifest.json`` and ``scenarios.json`` (``docs/run-folder.md``).

:class:`Manifest` holds the manifest as the run goes (started, engines and their
states, phases, finished) and rewrites it atomically after each change, so that an
interrupted run leaves a readable folder. The engines' entries are written by
:mod:`ratebench.engineset`; the phases come from the scenarios as they end.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ratebench import __version__
from ratebench._io import atomic_write_json
from ratebench.runrecords import BalancerEntry, ClientRecord, EngineEntry, PhaseRecord, write_client_records
from ratebench.profiles import Profile


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            gpu = [line.strip() for line in out.stdout.splitlines() if line.strip()] or None
        except (OSError, subprocess.SubprocessError):
            gpu = None
    return {"hostname": socket.gethostname(), "cpu": cpu, "cpus": os.cpu_count(), "gpu": gpu,
            "platform": platform.platform()}


def git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def vllm_and_patch() -> tuple[str | None, str | None]:
    """(the installed vLLM's version, the patch series' sha256), None for what cannot be read
    (reported as unknown; whoever needs it decides)."""
    from ratebench import patching

    try:
        vllm_version = patching.installed_vllm_version()
    except Exception:  # noqa: BLE001
        vllm_version = None
    try:
        patch_hash = patching.patch_sha256()
    except Exception:  # noqa: BLE001
        patch_hash = None
    return vllm_version, patch_hash


class Manifest:
    """``manifest.json`` and the phases of ``scenarios.json`` of one run folder: the run's own fields
    (:attr:`data`) and its engines (:attr:`engines`)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.data: dict[str, Any] = {}
        self.engines: dict[str, EngineEntry] = {}
        self.balancers: dict[str, BalancerEntry] = {}
        self.phases: list[PhaseRecord] = []

    def to_json(self) -> dict[str, Any]:
        out = dict(self.data)
        out["engines"] = {name: e.to_json() for name, e in self.engines.items()}
        if self.balancers:
            out["balancers"] = {name: b.to_json() for name, b in self.balancers.items()}
        return out

    def write(self) -> None:
        atomic_write_json(self.run_dir / "manifest.json", self.to_json())

    def start(self, profile: Profile, run_id: str, *, endpoint: str | None, use_patch: bool) -> None:
        """The manifest of a run that has just started (state ``running``), written."""
        vllm_version, patch_hash = vllm_and_patch()
        self.data = {
            "ratebench_version": __version__,
            "run_id": run_id,
            "profile_name": profile.name,
            "profile": profile.to_json(),
            "state": "running",
            "partial_reason": None,
            "started_unix_s": time.time(),
            "ended_unix_s": None,
            "started_monotonic_ns": time.monotonic_ns(),
            "ended_monotonic_ns": None,
            "git_commit": git_commit(),
            "python": platform.python_version(),
            "vllm_version": vllm_version,
            "patch_sha256": patch_hash if use_patch else None,
            "machine": machine_info(),
            "endpoint": endpoint,
            "model_path": None,
            "skipped_scenarios": [],
            "command": sys.argv,
        }
        self.write()

    @classmethod
    def synthetic(cls, run_dir: Path, *, run_id: str, profile_name: str, engines: dict[str, EngineEntry],
                  started_monotonic_ns: int, ended_monotonic_ns: int, state: str = "complete",
                  partial_reason: str | None = None, machine: dict[str, Any] | None = None,
                  git_commit: str | None = None, ended_unix_s: float = 0.0) -> Manifest:
        """The manifest of a run folder made without a run (the tests' synthetic and harness folders), with
        the fields a run's has; written."""
        m = cls(run_dir)
        m.data = {
            "ratebench_version": __version__, "run_id": run_id, "profile_name": profile_name,
            "profile": {"name": profile_name}, "state": state, "partial_reason": partial_reason,
            "started_unix_s": 0.0, "ended_unix_s": ended_unix_s, "started_monotonic_ns": started_monotonic_ns,
            "ended_monotonic_ns": ended_monotonic_ns, "git_commit": git_commit, "python": "3",
            "vllm_version": "0.32.0", "patch_sha256": None, "machine": machine or {},
        }
        m.engines = dict(engines)
        m.write()
        return m

    def record_model(self, path: str | None, stop_token_ids: list[int] | None = None,
                     max_model_len: int | None = None) -> None:
        """The model the engines serve; for a model ratebench launches, where its answers end (its stop
        token ids, its context length: reconciliation's answer-ends rule)."""
        self.data["model_path"] = path
        if stop_token_ids is not None or max_model_len is not None:
            self.data["model_stop_token_ids"] = stop_token_ids
            self.data["max_model_len"] = max_model_len

    def record_skipped(self, skipped: list[dict[str, str]]) -> None:
        """Scenarios (or phases) the run leaves out, each with why."""
        self.data["skipped_scenarios"].extend(skipped)

    def record_plan(self, planned: list[dict[str, str]]) -> None:
        """Every phase the run will run, in order (``verify-bound --partial`` names those never started)."""
        self.data["planned_phases"] = planned

    def record_stages(self, stage_s: dict[str, float]) -> None:
        """Where the run's time went, by stage (seconds)."""
        self.data["stage_s"] = {k: round(v, 2) for k, v in stage_s.items()}

    def warn(self, message: str) -> None:
        """A warning of the whole run (the manifest's ``warnings``); written with the next write."""
        self.data.setdefault("warnings", []).append(message)

    def add_phase(self, record: PhaseRecord, client_records: list[ClientRecord]) -> None:
        """A phase that ended: scenarios.json and requests.jsonl rewritten with it."""
        self.phases.append(record)
        self._write_phases()
        write_client_records(self.run_dir / "requests.jsonl", client_records)

    def finish(self, state: str, reason: str | None, client_records: list[ClientRecord]) -> None:
        """The run's last word: requests.jsonl, scenarios.json, and the manifest's state and end."""
        write_client_records(self.run_dir / "requests.jsonl", client_records)
        self._write_phases()
        self.data.update(state=state, partial_reason=reason, ended_unix_s=time.time(),
                         ended_monotonic_ns=time.monotonic_ns())
        self.write()

    def _write_phases(self) -> None:
        atomic_write_json(self.run_dir / "scenarios.json", [p.to_json() for p in self.phases])
