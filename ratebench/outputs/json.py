"""verdict.json: the verdict as plain JSON, with the settings that produced it."""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path

import orjson

from ratebench import __version__
from ratebench._io import atomic_write_bytes
from ratebench.analysis.verdict import Verdict
from ratebench.outputs.promises import headline, promise_coverage

SCHEMA = "ratebench.verdict/1"
_OPTIONS = orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE


def _header(verdict: Verdict) -> dict:
    coverage = promise_coverage(verdict)
    return {
        "schema": SCHEMA,
        "ratebench_version": __version__,
        "passed": verdict.passed,  # false for a partial verdict (see "partial" and "missing_phases")
        "outcome": verdict.outcome,  # PASS, FAIL, PARTIAL or FAIL (PARTIAL)
        # the first line of every output: the outcome, the broken promises, the promises exercised and not
        "headline": headline(verdict, coverage),
        # every promise of docs/promise.md sections 1 and 5: {key, name, words, exercised, checks_judged,
        # checks_failed, how}
        "promises": [p.__dict__ for p in coverage],
        "counts": {
            "checks": len(verdict.checks),
            "failed": len(verdict.failures),
            "informational": sum(c.passed is None for c in verdict.checks),
        },
    }


def verdict_to_dict(verdict: Verdict) -> dict:
    """The verdict as plain dicts and lists (what verdict.json holds)."""
    d = asdict(verdict)
    for c, obj in zip(d["checks"], verdict.checks):
        c["status"] = obj.status
    return {**_header(verdict), **d}


def verdict_json(verdict: Verdict) -> bytes:
    """verdict.json's bytes: ``verdict_to_dict`` serialized by orjson, which walks the dataclasses
    itself (no intermediate copy of every row)."""
    body = {f.name: getattr(verdict, f.name) for f in fields(verdict)}
    body["checks"] = [{**c.__dict__, "status": c.status} for c in verdict.checks]
    return orjson.dumps({**_header(verdict), **body}, default=str, option=_OPTIONS)


def write_verdict(verdict: Verdict, path: str | Path) -> Path:
    path = Path(path)
    atomic_write_bytes(path, verdict_json(verdict))
    return path
