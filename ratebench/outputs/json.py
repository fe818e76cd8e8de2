"""verdict.json: the verdict as plain JSON, with the settings that produced it."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from ratebench import __version__
from ratebench._io import atomic_write_json
from ratebench.analysis.verdict import Verdict

SCHEMA = "ratebench.verdict/1"


def verdict_to_dict(verdict: Verdict) -> dict:
    d = asdict(verdict)
    for c, obj in zip(d["checks"], verdict.checks):
        c["status"] = obj.status
    return {
        "schema": SCHEMA,
        "ratebench_version": __version__,
        "passed": verdict.passed,
        "counts": {
            "checks": len(verdict.checks),
            "failed": len(verdict.failures),
            "informational": sum(c.passed is None for c in verdict.checks),
        },
        **d,
    }


def write_verdict(verdict: Verdict, path: str | Path) -> Path:
    path = Path(path)
    atomic_write_json(path, verdict_to_dict(verdict))
    return path
