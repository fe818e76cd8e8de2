"""Shared fixtures: the patched vLLM, the tiny model, the machine-wide engine lock."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pytest

ENGINE_LOCK = Path("/tmp/ratebench-engine.lock")


def pytest_configure(config: pytest.Config) -> None:
    """Apply the limiter patch before collection: test modules import vLLM's scheduler
    at import time, and must get the patched one."""
    from ratebench import patching

    if patching.patch_status().overall != "patched":
        patching.apply_patch()


@pytest.fixture(scope="session")
def patched_vllm() -> str:
    """The installed vLLM with the limiter patch applied (applied here when it is not)."""
    from ratebench import patching

    state = patching.patch_status().overall
    if state != "patched":
        patching.apply_patch()  # refuses, with the reason, a tree that is neither pristine nor patched
        state = patching.patch_status().overall
    assert state == "patched", f"vLLM is {state} after apply_patch()"
    return patching.patch_sha256()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The generated tiny Qwen3 (made once, reused)."""
    from ratebench.tinymodel import ensure_tiny_model

    return ensure_tiny_model()


@contextlib.contextmanager
def hold_engine_lock() -> Iterator[None]:
    """One engine run at a time on this machine (other sessions share the CPUs)."""
    from ratebench._io import file_lock

    with file_lock(ENGINE_LOCK):
        yield


@pytest.fixture
def engine_lock() -> Iterator[None]:
    with hold_engine_lock():
        yield


def patched_tiny_spec(tiny_model: Path, flags: list[str], default_tps: int, user_tps: dict[str, int]):
    """A limiter-on, synchronous patched engine serving the tiny model as "tiny-qwen3" (1 GiB of CPU KV
    space), for the end-to-end tests that start their own engine."""
    from ratebench.engine import EngineSpec

    return EngineSpec(name="patched", kind="patched", feature=True, async_scheduling=False,
                      model=str(tiny_model), served_name="tiny-qwen3", flags=flags, default_tps=default_tps,
                      user_tps=user_tps, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
