"""The self-hosted GPU workflow: valid for GitHub, and its steps do what docs/gpu.md says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from ratebench.profiles import load_profile

REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / ".github" / "workflows" / "gpu-bench.yml"


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _steps() -> list[dict]:
    return _workflow()["jobs"]["bench"]["steps"]


def _step_index(fragment: str) -> int:
    for i, step in enumerate(_steps()):
        if fragment in (step.get("run") or "") or fragment in (step.get("uses") or ""):
            return i
    raise AssertionError(f"no step runs or uses {fragment!r}")


def test_workflow_passes_the_github_workflow_schema() -> None:
    exe = Path(sys.executable).parent / "check-jsonschema"
    out = subprocess.run([str(exe), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_workflow_runs_on_self_hosted_gpu_runners() -> None:
    assert _workflow()["jobs"]["bench"]["runs-on"] == ["self-hosted", "linux", "gpu"]


def test_steps_install_patch_run_verify_and_upload_in_that_order() -> None:
    install = _step_index('pip install -e ".[cuda,dev]"')
    patch = _step_index("ratebench patch apply")
    run = _step_index("ratebench run --profile")
    verify = _step_index("ratebench verify-bound")
    upload = _step_index("actions/upload-artifact")
    assert install < patch < run < verify < upload
    upload_step = _steps()[upload]
    assert "steps.run.outputs.dir" in upload_step["with"]["path"]
    assert "always()" in upload_step["if"]  # the run folder is kept even when the bound fails


def test_default_profile_is_the_seed_set_up_and_exists() -> None:
    wf = _workflow()
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` as true
    default = on["workflow_dispatch"]["inputs"]["profile"]["default"]
    assert default == "rtx4090-qwen3-8b"
    assert "rtx4090-qwen3-8b" in wf["jobs"]["bench"]["env"]["PROFILE"]
    assert load_profile(default).device == "cuda"
