"""The run around the phases: the run folder's record when a run cannot start (no engine needed)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from ratebench.profiles import load_profile
from ratebench.runner import EXIT_RUN_FAILED, RunOptions, run_profile


def test_an_endpoint_that_does_not_answer_leaves_a_failed_run_folder(tmp_path: Path) -> None:
    options = RunOptions(results_dir=tmp_path, endpoint="http://127.0.0.1:9/", verify=False, live=False)
    outcome = run_profile(load_profile("cpu-tiny"), options, Console(stderr=True, quiet=True))
    assert (outcome.state, outcome.exit_code) == ("failed", EXIT_RUN_FAILED)
    assert "/v1/models did not answer" in outcome.reason
    manifest = json.loads((outcome.run_dir / "manifest.json").read_text())
    assert manifest["state"] == "failed" and manifest["partial_reason"] == outcome.reason
    assert manifest["endpoint"] == "http://127.0.0.1:9/"
    assert manifest["planned_phases"] and manifest["ended_monotonic_ns"] >= manifest["started_monotonic_ns"]
    assert json.loads((outcome.run_dir / "scenarios.json").read_text()) == []
    assert (outcome.run_dir / "requests.jsonl").read_text() == ""


def test_sigterm_stops_a_run_as_ctrl_c_does_whatever_sigint_the_process_inherited() -> None:
    """SIGTERM becomes the KeyboardInterrupt run_profile turns into a partial run with every engine
    stopped: with SIGINT at its default (a terminal) and with SIGINT ignored (a background job, which
    a raised SIGINT would not reach)."""
    import subprocess
    import sys

    probe = (
        "import os, signal, sys\n"
        "from ratebench.runner import _sigterm_as_sigint\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN if sys.argv[1] == 'ignored' else signal.default_int_handler)\n"
        "signal.signal(signal.SIGTERM, _sigterm_as_sigint)\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    signal.pause()\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
    )
    for inherited in ("default", "ignored"):
        proc = subprocess.run([sys.executable, "-c", probe, inherited], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0 and proc.stdout.strip() == "interrupted", (inherited, proc.stdout, proc.stderr)
