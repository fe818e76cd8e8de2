"""A check that runs in a child process with the engines' environment (``[engine] env``: its
``PYTHONPATH`` included, so the child imports what the engines import): the parent's side
(:func:`run_child`) and the child's entry point (:func:`child_main`). Used by the checks made before the
engines start (:mod:`ratebench.upstream_replay`, :mod:`ratebench.flagcheck`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from ratebench._io import atomic_write_json


def run_child(module: str, run_dir: Path, file: str, env: dict[str, str] | None, timeout_s: int,
              items: str) -> dict[str, Any]:
    """``python -m MODULE OUT`` with ``env`` over this process's environment; its JSON, written
    atomically to ``run_dir/file`` and returned, or ``{items: [], "error": ...}`` when it failed."""
    out = Path(run_dir) / file
    tmp = Path(run_dir) / (file + ".child")
    child_env = dict(os.environ)
    child_env.update(env or {})
    try:
        proc = subprocess.run([sys.executable, "-m", module, str(tmp)], env=child_env, capture_output=True,
                              text=True, timeout=timeout_s)
        if proc.returncode == 0 and tmp.is_file():
            result = json.loads(tmp.read_text())
        else:
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-12:]
            result = {"version": 1, items: [],
                      "error": f"{module} exited with code {proc.returncode}: " + " | ".join(tail)}
    except subprocess.TimeoutExpired:
        result = {"version": 1, items: [], "error": f"{module} did not finish within {timeout_s} s"}
    finally:
        tmp.unlink(missing_ok=True)
    atomic_write_json(out, result)
    return result


def child_main(argv: list[str] | None, module: str, produce: Callable[[], dict[str, Any]]) -> int:
    """A child's entry point: ``python -m MODULE OUT.json`` writes ``produce()`` to OUT.json."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m {module} OUT.json", file=sys.stderr)
        return 2
    atomic_write_json(args[0], produce())
    return 0
