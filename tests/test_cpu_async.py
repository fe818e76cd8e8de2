"""The CPU async overlay (ratebench/cpu_async.py) without an engine.

The overlay changes vLLM modules as they are imported, so the tests that apply it to
real vLLM modules run a child Python with the overlay's ``sitecustomize`` first on its
``PYTHONPATH`` (this process's vLLM stays as it is). The rest builds the pieces here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ratebench import cpu_async
from ratebench.engine import EngineSpec, engine_env, uses_cpu_async_overlay
from ratebench.plan import engine_spec
from ratebench.profiles import ProfileError, load_profile, parse_profile

# The config vLLM resolves for the tiny model (no engine, no worker): the platform hook
# runs in VllmConfig.__post_init__, after vLLM decided on async scheduling.
CONFIG_PROBE = textwrap.dedent('''
    import json, sys
    from vllm.engine.arg_utils import EngineArgs
    args = EngineArgs(model=sys.argv[1], max_model_len=512, max_num_seqs=4, enforce_eager=True,
                      async_scheduling=sys.argv[2] == "async")
    config = args.create_engine_config()
    import vllm.platforms.cpu as cpu_platform
    import vllm.v1.worker.cpu_model_runner as cpu_runner
    import vllm.v1.worker.gpu_model_runner as gpu_runner
    print("PROBE " + json.dumps({
        "async_scheduling": config.scheduler_config.async_scheduling,
        "scheduler_cls": config.scheduler_config.get_scheduler_cls().__name__,
        "max_concurrent_batches": config.max_concurrent_batches,
        "platform_patched": getattr(cpu_platform.CpuPlatform.check_and_update_config.__func__,
                                    "__ratebench_cpu_async__", False),
        "output_class": gpu_runner.AsyncGPUModelRunnerOutput.__name__,
        "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None),
    }))
''')


def _probe(tmp_path: Path, model: Path, mode: str, overlay: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", cpu_async.ENV_DIR)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_CPU_KVCACHE_SPACE="1")
    if overlay:
        ov = cpu_async.write_overlay(tmp_path / "overlay")
        env.update(cpu_async.overlay_env(ov, tmp_path / "stats", None))
    script = tmp_path / "probe.py"
    script.write_text(CONFIG_PROBE)
    proc = subprocess.run([sys.executable, str(script), str(model), mode], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    assert "Error in sitecustomize" not in proc.stderr
    return {**json.loads(lines[-1][6:]), "stderr": proc.stderr}


def test_stock_cpu_platform_turns_async_scheduling_off(tmp_path, tiny_model):
    got = _probe(tmp_path, tiny_model, "async", overlay=False)
    assert got["async_scheduling"] is False
    assert got["scheduler_cls"] != "AsyncScheduler"
    assert got["max_concurrent_batches"] == 1
    assert got["output_class"] == "AsyncGPUModelRunnerOutput"


def test_overlay_keeps_async_scheduling_asked_for(tmp_path, tiny_model):
    got = _probe(tmp_path, tiny_model, "async", overlay=True)
    assert got["platform_patched"] is True
    assert got["async_scheduling"] is True
    assert got["scheduler_cls"] == "AsyncScheduler"
    assert got["max_concurrent_batches"] == 2  # the engine core's batch queue: two batches in flight
    assert got["output_class"] == "CPUAsyncModelRunnerOutput"
    assert got["sitecustomize"].startswith(str(tmp_path / "overlay"))
    assert cpu_async.LOG_PREFIX in got["stderr"]
    assert cpu_async.read_stats(tmp_path / "stats")["kept_async"] is True


def test_overlay_leaves_sync_scheduling_alone(tmp_path, tiny_model):
    got = _probe(tmp_path, tiny_model, "sync", overlay=True)
    assert got["async_scheduling"] is False
    assert got["max_concurrent_batches"] == 1
    assert cpu_async.read_stats(tmp_path / "stats")["kept_async"] is False


# ---- the model runner's async output on CPU ----------------------------------------------


@pytest.fixture(scope="module")
def cpu_output_class():
    from vllm.v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput

    return cpu_async.make_cpu_async_output_class(AsyncGPUModelRunnerOutput)


def _runner_output():
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(req_ids=["a", "b", "c"], req_id_to_index={"a": 0, "b": 1, "c": 2})


def test_cpu_async_output_copies_and_clears_discarded_rows(cpu_output_class, monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_async.ENV_DIR, str(tmp_path))
    sampled = torch.tensor([[5], [7], [9]], dtype=torch.int32)
    out = cpu_output_class(_runner_output(), sampled, None, [1], None, vocab_size=100)
    assert out.sampled_token_ids_cpu.data_ptr() != sampled.data_ptr()  # a copy, as the GPU's D2H copy
    sampled.fill_(0)  # the runner may reuse its tensor: the output keeps what was sampled
    result = out.get_output()
    assert result.sampled_token_ids == [[5], [], [9]]
    assert result.logprobs is None
    assert cpu_async.read_stats(tmp_path)["cpu_async_outputs"] >= 1


def test_cpu_async_output_carries_logprobs(cpu_output_class):
    from vllm.v1.outputs import LogprobsTensors

    lp = LogprobsTensors(torch.tensor([[5, 1], [7, 2]]), torch.tensor([[-0.1, -2.0], [-0.2, -3.0]]),
                         torch.tensor([0, 0]))
    out = cpu_output_class(_runner_output(), torch.tensor([[5], [7]]), lp, [], None, vocab_size=100)
    result = out.get_output()
    assert result.sampled_token_ids == [[5], [7]]
    assert result.logprobs is not None
    assert [list(map(int, row)) for row in result.logprobs.logprob_token_ids] == [[5, 1], [7, 2]]


def test_cpu_async_output_refuses_expert_parallel_fault_checks(cpu_output_class):
    with pytest.raises(RuntimeError, match="need a GPU"):
        cpu_output_class(_runner_output(), torch.tensor([[5]]), None, [], None, vocab_size=100, check_ep_fault=True)


def test_cuda_event_placeholder_only_while_the_runner_is_built():
    shipped = torch.cuda.Event
    with cpu_async._cuda_event_placeholder():
        ev = torch.cuda.Event(blocking=True)
        ev.record()
        ev.synchronize()
        assert ev.query() is True
    assert torch.cuda.Event is shipped


# ---- the engine core's batch queue ----------------------------------------------------------


class _FakeCore:
    def __init__(self, size: int) -> None:
        from collections import deque

        self.batch_queue_size = size
        self.batch_queue = deque(maxlen=size) if size > 1 else None
        self.async_scheduling = size > 1
        self.scheduler = type("AsyncScheduler", (), {})()
        self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue

    def step(self):
        return "step"

    def step_with_batch_queue(self):
        # As vLLM's: schedule a batch (appendleft); when the queue is full, wait for the oldest (pop).
        self.batch_queue.appendleft(object())
        if len(self.batch_queue) == self.batch_queue_size:
            self.batch_queue.pop()
        return "batch"


def test_engine_core_counts_full_batch_queue(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_async.ENV_DIR, str(tmp_path))
    module = type(sys)("fake_core")
    module.EngineCore = type("EngineCore", (_FakeCore,), {})
    cpu_async.patch_engine_core(module)
    core = module.EngineCore(2)
    assert isinstance(core.batch_queue, cpu_async.CountingBatchQueue)
    for _ in range(3):
        assert core.step_fn() == "batch"
    core._ratebench_cpu_async_counts.write()
    stats = cpu_async.read_stats(tmp_path)
    assert stats["batch_queue_steps"] == 3
    assert stats["full_queue"] == 2 and stats["max_in_flight"] == 2
    assert stats["core"][0]["step_fn"] == "step_with_batch_queue"
    assert stats["core"][0]["scheduler_cls"] == "AsyncScheduler"


def test_stats_problems_name_a_synchronous_engine(tmp_path):
    (tmp_path / "core-1.json").write_text(json.dumps(
        {"role": "core", "pid": 1, "async_scheduling": False, "step_fn": "step", "scheduler_cls": "Scheduler",
         "full_queue": 0}))
    problems = cpu_async.stats_problems(cpu_async.read_stats(tmp_path))
    assert any("not overruled" in p for p in problems)
    assert any("ran Scheduler with step" in p for p in problems)
    assert any("never held two batches" in p for p in problems)
    assert cpu_async.stats_problems(cpu_async.read_stats(tmp_path / "absent")) != []


def test_stats_of_an_async_engine_pass(tmp_path):
    (tmp_path / "platform-1.json").write_text(json.dumps({"role": "platform", "kept_async": True}))
    (tmp_path / "core-2.json").write_text(json.dumps(
        {"role": "core", "pid": 2, "async_scheduling": True, "step_fn": "step_with_batch_queue",
         "scheduler_cls": "AsyncScheduler", "full_queue": 7, "max_in_flight": 2, "batch_queue_steps": 9}))
    (tmp_path / "worker-3.json").write_text(json.dumps({"role": "worker", "cpu_async_outputs": 6}))
    stats = cpu_async.read_stats(tmp_path)
    assert cpu_async.stats_problems(stats) == []
    assert stats["cpu_async_outputs"] == 6 and stats["full_queue"] == 7


# ---- wiring: profile, plan, engine environment --------------------------------------------


def test_cpu_tiny_async_engines_ask_for_the_overlay():
    profile = load_profile("cpu-tiny")
    assert profile.engine.cpu_async_overlay is True
    for name, wanted in [("patched-async", True), ("patched-sync", False), ("stock-async", True)]:
        spec = engine_spec(profile, name, "/m", use_patch=True, pristine_files=dict)
        assert uses_cpu_async_overlay(spec) is wanted, name


def test_overlay_only_on_cpu_profiles():
    data = {"profile": {"device": "cuda"}, "model": {"source": "tiny"},
            "engine": {"max_num_seqs": 4, "max_num_active_seqs": 4, "cpu_async_overlay": True},
            "limits": {"default_tps": 10}, "scenarios": []}
    with pytest.raises(ProfileError, match="cpu_async_overlay"):
        parse_profile(data, "x.toml")


def test_engine_env_puts_the_overlay_after_the_stock_one(tmp_path):
    spec = EngineSpec(name="stock-async", kind="stock", feature=False, async_scheduling=True, model="/m",
                      served_name="m", flags=[], cpu_async_overlay=True)
    env = engine_env(spec, events_path=None, overlay_dir=tmp_path / "stock", cpu_async_dir=tmp_path / "ca")
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[:2] == [str(tmp_path / "stock"), str(tmp_path / "ca" / "overlay")]
    assert env[cpu_async.ENV_DIR] == str(tmp_path / "ca" / "stats")
    plain = engine_env(spec, events_path=None, overlay_dir=None)
    assert cpu_async.ENV_DIR not in plain


def test_engine_env_keeps_the_profiles_own_pythonpath_behind_the_overlays(tmp_path, monkeypatch):
    """A profile's ``env = { PYTHONPATH = ... }`` (a sitecustomize of its own, say) still reaches an
    engine that runs through an overlay: behind the overlays, in place of the inherited path."""
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    spec = EngineSpec(name="patched-async", kind="patched", feature=True, async_scheduling=True, model="/m",
                      served_name="m", flags=[], cpu_async_overlay=True, env={"PYTHONPATH": "/profile-site"})
    env = engine_env(spec, events_path=None, overlay_dir=None, cpu_async_dir=tmp_path / "ca")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "ca" / "overlay"), "/profile-site"]
    inherited = engine_env(EngineSpec(name="patched-async", kind="patched", feature=True, async_scheduling=True,
                                      model="/m", served_name="m", flags=[], cpu_async_overlay=True),
                           events_path=None, overlay_dir=None, cpu_async_dir=tmp_path / "ca")
    assert inherited["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "ca" / "overlay"), "/inherited"]
