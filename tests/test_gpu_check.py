"""scripts/gpu-check.sh: valid bash, and its --print-plan picks the model and the engine count
as docs/gpu.md says, without a GPU (a fake nvidia-smi stands in for one)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ratebench.cli import app

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu-check.sh"

pytestmark = pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").is_file(),
                                reason="the script looks for the model with .venv/bin/python")


def _plan(tmp_path: Path, *, gpu_mib: int | None = None, **env: str) -> subprocess.CompletedProcess:
    """Run --print-plan with an empty Hugging Face cache, and nvidia-smi faked (or absent)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    if gpu_mib is not None:
        fake.write_text(f"#!/bin/sh\necho 'NVIDIA H200, {gpu_mib}'\n")
        fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RATEBENCH_", "HF_"))}
    base["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    base["HF_HUB_CACHE"] = str(tmp_path / "hub")
    return subprocess.run(["bash", str(SCRIPT), "--print-plan"], capture_output=True, text=True, cwd=tmp_path,
                          env={**base, **env}, timeout=120)


def _line(out: str, prefix: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(prefix))


def _model_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_the_script_is_valid_bash_and_strict() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    assert "set -euo pipefail" in text and "timeout " in text


def test_without_a_real_model_it_falls_back_to_the_tiny_model(tmp_path: Path) -> None:
    result = _plan(tmp_path, gpu_mib=143771)
    assert result.returncode == 0, result.stderr
    assert _line(result.stdout, "model:").startswith("model:   tiny: the generated tiny model (fallback")
    assert "ratebench tiny-model" in result.stdout
    assert _line(result.stdout, "GPU:") == "GPU:     NVIDIA H200, 143771 MiB"
    # the GPU holds the four engines of the overhead scenario at once
    assert "--max-engines 4 --engine-arg=--gpu-memory-utilization=0.22" in result.stdout


def test_four_engines_only_where_they_fit_else_the_profile_s_one(tmp_path: Path) -> None:
    assert "engines: 4 alive at once" in _plan(tmp_path, gpu_mib=24564).stdout  # tiny model
    small = _plan(tmp_path, gpu_mib=8192)
    assert "engines: 1 alive at once" in small.stdout and "--max-engines" not in small.stdout
    folder = _model_folder(tmp_path / "Qwen3-8B")
    h100 = _plan(tmp_path, gpu_mib=81559, RATEBENCH_GPU_MODEL=str(folder))  # four 8B engines need more
    assert "engines: 1 alive at once" in h100.stdout
    forced = _plan(tmp_path, gpu_mib=81559, RATEBENCH_GPU_MODEL=str(folder), RATEBENCH_GPU_CHECK_ENGINES="2")
    assert "--max-engines 2 --engine-arg=--gpu-memory-utilization=0.44" in forced.stdout
    absent = _plan(tmp_path / "none")
    assert absent.returncode == 0
    assert "GPU:     none found" in absent.stdout and "no NVIDIA GPU here" in absent.stdout


def test_a_complete_local_folder_is_used(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "Qwen3-8B")
    result = _plan(tmp_path, gpu_mib=143771, RATEBENCH_GPU_MODEL=str(folder))
    assert _line(result.stdout, "model:") == f"model:   folder: a local folder (RATEBENCH_GPU_MODEL): {folder}"
    assert f"--model {folder} " in result.stdout and "tiny-model" not in result.stdout


def test_an_incomplete_local_folder_is_refused_not_replaced(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "Qwen3-8B")
    (folder / "model.safetensors").unlink()
    result = _plan(tmp_path, gpu_mib=143771, RATEBENCH_GPU_MODEL=str(folder))
    assert result.returncode == 2
    assert "RATEBENCH_GPU_MODEL" in result.stderr and "no weights" in result.stderr


def test_the_profile_s_model_in_the_hugging_face_cache_is_used(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-8B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snapshot = _model_folder(repo / "snapshots" / "abc123")
    result = _plan(tmp_path, gpu_mib=143771)
    assert _line(result.stdout, "model:") == (
        f"model:   hf-cache: Qwen/Qwen3-8B from the local Hugging Face cache: {snapshot}")


def test_the_planned_run_is_a_valid_ratebench_run(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "Qwen3-8B")
    result = _plan(tmp_path, gpu_mib=143771, RATEBENCH_GPU_MODEL=str(folder))
    argv = shlex.split(_line(result.stdout, "  4. ").removeprefix("  4. "))
    assert argv[:2] == [".venv/bin/ratebench", "run"]
    dry = CliRunner().invoke(app, [*argv[1:], "--results", str(tmp_path / "results"), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "seed-experiment/4-streams on patched-async" in dry.output
    assert "overhead/feature-on-sync-3 on patched-sync" in dry.output and "-sync-4 " not in dry.output
    assert "5 start(s) in 2 wave(s)" in dry.output
    assert not (tmp_path / "results").exists()
