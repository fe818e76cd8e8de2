#!/usr/bin/env python3
"""Maintainer tool: run scenarios on the limiter patch of another commit, without touching the
installed vLLM.

    .venv/bin/python scripts/run_with_patch_series.py REV -- run --profile cpu-tiny --scenario kv-pressure

REV is a git revision of this repository (its ``patches/vllm-0.32.0``), or a patch folder.
The files that either series touches are computed from the pristine vLLM 0.32.0 files
(which the installed, patched tree gives back through the reverse patch) with REV's
series applied, and served to every Python process of the command through the same
import overlay the stock engines use (``ratebench.engine.write_stock_overlay``, a
``sitecustomize`` on ``PYTHONPATH``). So the engines of the run serve REV's patch while
the installed vLLM keeps the current one. Meant for the patched engines (limiter on and
off): a stock engine in the same run would be served REV's patch too, since this
overlay's finder goes in front of the stock one.

Used to show that a scenario fails on an older patch (the run folder's manifest still
names the installed series; the note printed at the start says which one ran).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def series_folder(rev: str, dest: Path) -> Path:
    if Path(rev).is_dir():
        return Path(rev)
    from ratebench.patching import PATCH_DIR_NAME

    out = dest / "series"
    out.mkdir(parents=True)
    tree = f"{rev}:patches/{PATCH_DIR_NAME}"
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", tree], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        data = subprocess.run(["git", "-C", str(ROOT), "show", f"{tree}/{name}"], check=True,
                              capture_output=True).stdout
        (out / name).write_bytes(data)
    return out


def overlay_files(series_dir: Path) -> dict[str, bytes | None]:
    """Every file either series touches, as REV's series makes it from pristine vLLM."""
    from ratebench import patching

    site = patching.site_packages_of_vllm()
    current = patching.read_pristine_files()  # pristine content of the files the installed series touches
    other = patching.load_series(series_dir)
    files: dict[str, bytes | None] = dict(current)
    for path in other.targets:
        base = current[path] if path in current else patching._read_target(site, path)
        files[path] = patching.apply_chain(base, patching._chain_for(other, path, pristine_absent=base is None))
    return files


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    rev, command = argv[0], argv[2:]
    from ratebench.engine import stock_overlay_env, write_stock_overlay
    from ratebench.patching import patch_sha256, site_packages_of_vllm

    with tempfile.TemporaryDirectory(prefix="ratebench-series-") as tmp:
        series_dir = series_folder(rev, Path(tmp))
        files = overlay_files(series_dir)
        overlay = Path(tmp) / "overlay"
        write_stock_overlay(files, site_packages_of_vllm(), overlay)
        env = {**os.environ, **stock_overlay_env(overlay)}
        print(f"run_with_patch_series: engines serve the series of {rev} (sha256 {patch_sha256(series_dir)[:16]}), "
              f"{len(files)} files through {overlay}", file=sys.stderr, flush=True)
        exe = Path(sys.executable).parent / "ratebench"
        return subprocess.run([str(exe), *command], env=env).returncode


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1:]))
