"""End to end on CPU: a real patched vLLM server whose limiter is broken on purpose must fail verify-bound.

The test writes a ``sitecustomize.py`` into a temporary folder and puts it first on
the engine's ``PYTHONPATH``: in every process of the server (the API server and the
EngineCore), as soon as ``vllm.v1.core.sched.output_rate`` is imported, it gives
``OutputRateLimiter`` a 1 s burst instead of 100 ms. Nothing installed changes.
Real HTTP streams through ratebench's driver; the engine's own event file; the run
folder written as ``ratebench run`` would; then ``ratebench verify-bound``.
"""

from __future__ import annotations

import asyncio
import os
import textwrap
import time
import uuid

import pytest
from typer.testing import CliRunner

from mutants.runfolder import write_run_files
from ratebench.cli import app
from ratebench.engine import EngineSpec, start_engine
from ratebench.events import read_engine_events
from ratebench.verify import verify_run
from ratebench.workload import Driver, PhaseContext, StreamRequest

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("patched_vllm", "engine_lock")]

ENGINE = "patched-burst-1s"
LIMITS = {"user-a": 20, "user-b": 100}
BURST_1S_NS = 1_000_000_000
MARKER = "ratebench test mutant: OutputRateLimiter burst 1 s"

SITECUSTOMIZE = textwrap.dedent(f'''
    """Test fixture of tests/test_mutants_e2e.py: a broken limiter (1 s burst). Never shipped."""
    import importlib.abc
    import importlib.util
    import sys

    _TARGET = "vllm.v1.core.sched.output_rate"


    def _break(module):
        cls = module.OutputRateLimiter
        shipped_init = cls.__init__

        def init_with_1s_burst(self, *args, **kwargs):
            shipped_init(self, *args, **kwargs)
            self.burst_ns = {BURST_1S_NS}

        cls.__init__ = init_with_1s_burst
        print("{MARKER}", file=sys.stderr, flush=True)


    class _BreakOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_then_break(module):
                exec_module(module)
                _break(module)

            spec.loader.exec_module = exec_then_break
            return spec


    sys.meta_path.insert(0, _BreakOnImport())
''')


def test_a_real_engine_with_a_one_second_burst_fails_verify_bound(tmp_path, tiny_model):
    hook_dir = tmp_path / "mutant-site"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    run_dir = tmp_path / "run"
    pythonpath = os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH")) if p)
    spec = EngineSpec(
        name=ENGINE, kind="patched", feature=True, async_scheduling=False, model=str(tiny_model),
        served_name="tiny-qwen3",
        flags=["--max-model-len", "1024", "--max-num-seqs", "8", "--enforce-eager"],
        default_tps=100, user_tps={"user-a": LIMITS["user-a"]},
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": pythonpath},
    )
    engine = start_engine(spec, run_dir / "engines" / ENGINE, timeout_s=600)
    driver = Driver(uuid.uuid4().hex[:8], live=False)
    ctx = PhaseContext("seed-experiment", "2-streams", ENGINE, engine.endpoint, "tiny-qwen3")
    # user-a: 2 streams x 30 tokens at 20 tok/s (with the broken burst, 21 of them at once);
    # user-b: 1 stream x 60 tokens at 100 tok/s
    requests = [StreamRequest("user-a", "Rate limits in a shared scheduler", 30, stream_index=i) for i in range(2)]
    requests.append(StreamRequest("user-b", "Tokens per second for everyone", 60))
    try:
        start_ns = time.monotonic_ns()
        records = asyncio.run(driver.run_phase(ctx, requests, limits=dict(LIMITS)))
        end_ns = time.monotonic_ns()
    finally:
        engine.stop()
    log = engine.log_path.read_text(errors="replace")
    assert MARKER in log, "the broken limiter was not injected"
    meta = read_engine_events(engine.events_path).meta
    assert meta["burst_ns"] == BURST_1S_NS  # the EngineCore's own limiter ran with the broken burst
    assert all(r.error is None and r.completion_tokens == r.max_tokens for r in records), records

    write_run_files(
        run_dir, ENGINE,
        {"kind": "patched", "feature": True, "async_scheduling": False, "default_tps": spec.default_tps,
         "user_tps": spec.user_tps, "flags": spec.all_flags(), "events_file": f"engines/{ENGINE}/events.rbev",
         "log_file": f"engines/{ENGINE}/engine.log", "endpoint": engine.endpoint, "engine_meta": meta},
        [{"scenario": ctx.scenario, "kind": "seed-experiment", "phase": ctx.phase, "engine": ENGINE,
          "start_ns": start_ns, "end_ns": end_ns, "role": "measure",
          "users": {"user-a": {"limit_tps": 20, "streams": 2, "backlogged": True},
                    "user-b": {"limit_tps": 100, "streams": 1, "backlogged": False}},
          "params": {"max_tokens": 30, "ignore_eos": True}}],
        records, profile_name="cpu-tiny-mutant",
    )
    verdict = verify_run(run_dir, plots=False)
    failed = {(c.name, c.user) for c in verdict.failures}
    assert {("bound-dispatch", "user-a"), ("bound-dispatch-run", "user-a")} <= failed, verdict.summary()
    assert {name for name, _ in failed} <= {"bound-dispatch", "bound-dispatch-run", "bound-emit", "bound-emit-run",
                                           "bound-client"}, verdict.summary()
    worst = next(c for c in verdict.failures if (c.name, c.user) == ("bound-dispatch", "user-a"))
    assert worst.figure <= -10  # about 21 tokens at once where 0.1 * 20 + 1 = 3 may go
    assert any("burst" in w for w in verdict.warnings)  # the header's 1 s burst is reported, not believed

    result = CliRunner().invoke(app, ["verify-bound", str(run_dir), "--no-plots"])
    assert result.exit_code == 1, result.output
    assert "bound-dispatch" in result.output
