"""What ``ratebench run`` checks before its engines start, with no engine, each in a child process with
the engines' environment (``[engine] env``: its ``PYTHONPATH`` included, so the child imports what the
engines import): promise 7, the installed scheduler with the limiter off against upstream's step by
step (:mod:`ratebench.upstream_replay`, ``feature-off.json``), and the limiter's flags through ``vllm
serve``'s parser and config (:mod:`ratebench.flagcheck`, ``flags.json``). The two children run side by
side; verify-bound judges their files (:mod:`ratebench.analysis.prestart`). A child that fails or runs
out of time is recorded as an error, which fails its check: never left out."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console


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
