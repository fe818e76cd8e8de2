"""The layers of the house (pyproject.toml's [tool.importlinter]): each stage of a run imports only the
stages below it, and no package has an import circle. ``lint-imports`` reads the source, imports
nothing of it, and fails on the first import that breaks a contract."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports() -> list[str]:
    exe = Path(sys.executable).parent / "lint-imports"
    found = str(exe) if exe.is_file() else shutil.which("lint-imports")
    assert found, "lint-imports is missing: it comes with the dev extra (scripts/setup.sh installs it)"
    return [found, "--no-cache"]


def test_every_import_keeps_the_layers_and_no_package_has_a_circle():
    proc = subprocess.run(_lint_imports(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("module, line, refusal", [
    # the profile schema importing a scenario kind (the circle that was there)
    ("profiles.py", "from ratebench.scenarios import mix", "ratebench.profiles is not allowed to import ratebench.scenarios"),
    # the verdict's types importing the partial-run code, which imports them back (the circle that was there)
    ("analysis/verdict.py", "from ratebench.analysis.partial import keep_completed_phases",
     "No cycles are allowed in ratebench.analysis"),
])
def test_an_import_that_breaks_the_house_is_refused(tmp_path, module, line, refusal):
    """The contracts can fail: the same source with one such import (inside a function, as the
    circles were) is refused, naming it."""
    copy = tmp_path / "house"
    shutil.copytree(ROOT / "ratebench", copy / "ratebench", ignore=shutil.ignore_patterns("__pycache__", "*.toml",
                                                                                         "*.jsonl", "*.txt"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    path = copy / "ratebench" / module
    path.write_text(path.read_text() + f"\n\ndef _up():\n    {line}  # noqa: F401\n")
    proc = subprocess.run(_lint_imports(), cwd=copy, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert refusal in proc.stdout, proc.stdout[-3000:]


MAX_SOURCE_LINES = 600  # a module a newcomer can read whole (issue 22)


def test_no_source_file_is_longer_than_a_newcomer_reads_whole():
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "ratebench").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_SOURCE_LINES}
    assert not long, f"source files over {MAX_SOURCE_LINES} lines (split them by what they do): {long}"
