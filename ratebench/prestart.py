"""What ``ratebench run`` checks before its engines start, with no engine, each in a child process with
the engines' environment (``[engine] env``: its ``PYTHONPATH`` included, so the child imports what the
engines import): promise 7, the installed scheduler with the limiter off against upstream's step by
step (:mod:`ratebench.upstream_replay`, ``feature-off.json``), and the limiter's flags through ``vllm
serve``'s parser and config (:mod:`ratebench.flagcheck`, ``flags.json``). The two children run side by
side; verify-bound judges their files (:mod:`ratebench.analysis.prestart`). A child that fails or runs
out of time is recorded as an error, which fails its check: never left out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

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


def check_before_engines(run_dir: Path, env: dict[str, str] | None, console: Console) -> dict[str, dict]:
    """Both children side by side; a line for each that found something; their results by file."""
    from ratebench import flagcheck, upstream_replay

    console.print("[bold]before the engines[/]: the installed scheduler with the limiter off against "
                  "upstream's, step by step; malformed limiter flags through vllm serve's parser and config")
    with ThreadPoolExecutor(max_workers=2) as pool:
        replay = pool.submit(upstream_replay.run_replay, run_dir, env)
        flags = pool.submit(flagcheck.run_flag_check, run_dir, env)
        results = {upstream_replay.FILE: replay.result(), flagcheck.FILE: flags.result()}
    for (file, result), (items, key, what) in zip(results.items(), (
            ("configs", "identical", "configurations parted from upstream"),
            ("cases", "ok", "flag cases not as promised"))):
        bad = [c for c in result.get(items, []) if not c.get(key)]
        if result.get("error"):
            console.print(f"[bold red]{file}[/]: could not be made ({result['error']})")
        elif bad:
            console.print(f"[bold red]{file}[/]: {len(bad)} of {len(result[items])} {what}")
    return results
