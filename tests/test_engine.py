"""The engine launcher: flags, readiness, logs, and shutdown that leaves nothing behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from rich.console import Console

from e2e_profiles import e2e_profile
from ratebench.engine import EngineSpec, RunningEngine, WarmUpPlan, start_engine, warm_up
from ratebench.procstats import group_members
from ratebench.events import ENV_VAR, read_engine_events


def _spec(**kw) -> EngineSpec:
    base = dict(name="patched-sync", kind="patched", feature=True, async_scheduling=False, model="/m",
                served_name="tiny-qwen3", flags=["--max-num-seqs", "8"], default_tps=100,
                user_tps={"user-a": 20})
    base.update(kw)
    return EngineSpec(**base)


def test_feature_on_passes_the_limiter_flags() -> None:
    argv = _spec().argv(8123)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--default-user-output-tokens-per-second") + 1] == "100"
    assert json.loads(argv[argv.index("--user-output-tokens-per-second") + 1]) == {"user-a": 20}
    assert "--async-scheduling" not in argv and "--max-num-seqs" in argv


def test_feature_off_and_stock_pass_no_limiter_flag() -> None:
    for spec in (_spec(feature=False, default_tps=None, user_tps={}), _spec(kind="stock", feature=False)):
        argv = spec.argv(1)
        assert not any("output-tokens-per-second" in a for a in argv)


def test_async_scheduling_flag() -> None:
    assert "--async-scheduling" in _spec(async_scheduling=True).argv(1)


def _stubborn_group(tmp_path: Path) -> subprocess.Popen:
    """A process group whose leader and child ignore SIGINT and SIGTERM."""
    script = "trap '' INT TERM; sleep 600 & sleep 600; wait"
    return subprocess.Popen(["sh", "-c", script], start_new_session=True, stdout=subprocess.DEVNULL)


def test_stop_kills_a_group_that_ignores_sigint_and_sigterm(tmp_path: Path) -> None:
    proc = _stubborn_group(tmp_path)
    deadline = time.monotonic() + 5
    while len(group_members(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_members(proc.pid)) >= 2
    engine = RunningEngine(_spec(), proc, 1, tmp_path, None, open(tmp_path / "engine.log", "ab"))
    killed = engine.stop(grace_s=1.0)
    assert killed, "the stubborn processes needed SIGKILL"
    assert group_members(proc.pid) == []
    assert engine.stop() == []  # idempotent


def test_stop_is_quick_when_the_group_exits_on_sigint(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    time.sleep(0.2)
    engine = RunningEngine(_spec(), proc, 1, tmp_path, None, open(tmp_path / "engine.log", "ab"))
    t0 = time.monotonic()
    engine.stop(grace_s=30.0)
    assert group_members(proc.pid) == []
    assert time.monotonic() - t0 < 25  # well inside the grace: no SIGKILL wait


def test_a_run_keeps_at_most_max_engines_and_starts_each_before_its_phase(tmp_path: Path, monkeypatch) -> None:
    from ratebench.profiles import load_profile
    from ratebench.runner import Run, RunOptions
    from ratebench.scenarios import plan_scenario

    def five_engines():
        """cpu-tiny with the overhead scenario in full (as cpu-tiny-overhead has it): patched sync,
        async and priority, and for the overhead scenario (sync) the patched engine without events,
        feature off and stock."""
        profile = load_profile("cpu-tiny")
        for spec in profile.scenarios:
            if spec.kind == "overhead":
                spec.params["against"] = ["feature-off", "stock", "no-events"]
        return profile

    plans = [p for spec in five_engines().scenarios for p in plan_scenario(spec)]
    names = set(p.engine for p in plans)
    assert names == {"patched-sync", "patched-async", "patched-priority", "patched-noevents-sync",
                     "feature-off-sync", "stock-sync"}
    for cap in (1, 2, 4, 5, 6):
        profile = five_engines()
        profile.max_engines = cap
        engines = Run(profile, RunOptions(results_dir=tmp_path / str(cap)), Console(stderr=True)).engine_set
        starts: list[list[str]] = []

        def fake_ensure(names, engines=engines, starts=starts):
            starts.append(list(names))
            for n in names:
                engines.running[n] = object()

        monkeypatch.setattr(engines, "ensure_engines", fake_ensure)
        monkeypatch.setattr(engines, "stop", lambda name, engines=engines, **kw: engines.running.pop(name, None))
        for k, plan in enumerate(plans):
            engines.arrange_engines([p.engine for p in plans[k:]])
            assert plan.engine in engines.running
            assert len(engines.running) <= cap
        started = [n for batch in starts for n in batch]
        if cap >= 5:
            # each engine started once: all up front with room for all; else the last one
            # when another is done
            assert sorted(started) == sorted(names)
            assert len(starts[0]) == min(cap, len(names))
        else:
            # The overhead phases alternate engines: with fewer slots they restart.
            assert len(started) > len(names)


# ---- against a real CPU engine ---------------------------------------------------------------
# (An engine that cannot start: tests/test_run_e2e.py, through `ratebench run`.)


@pytest.mark.e2e
def test_engine_serves_records_events_and_stops_clean(
        tmp_path: Path, patched_vllm: str, tiny_model: Path, engine_lock: None) -> None:
    spec = _spec(model=str(tiny_model), flags=["--max-num-seqs", "4", "--max-num-active-seqs", "2",
                                               "--max-num-batched-tokens", "128", "--max-model-len", "512",
                                               "--enforce-eager"],
                 env={"VLLM_CPU_KVCACHE_SPACE": "1"}, default_tps=1000, user_tps={})
    engine = start_engine(spec, tmp_path / "engine", timeout_s=300, console=Console(stderr=True), grace_s=15)
    try:
        assert engine.events_path is not None
        # its processes' ZMQ sockets in a folder of its own (vLLM leaves them in the temp folder otherwise)
        assert engine.ipc_dir is not None and any(p.is_socket() for p in engine.ipc_dir.iterdir())
        warmed = warm_up(engine, WarmUpPlan(streams=4, long_prompt_tokens=300))
        assert warmed.requests == 2 + 4 + 1 and not warmed.timed_out
        r = httpx.post(f"{engine.endpoint}/v1/completions", timeout=60,
                       json={"model": "tiny-qwen3", "prompt": "Hello", "max_tokens": 5, "ignore_eos": True,
                             "vllm_xargs": {"output_rate_user": "user-a"}},
                       headers={"X-Request-Id": "rb-abc-1"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        attached = _attach_a_run(tmp_path, engine)
    finally:
        killed = engine.stop(grace_s=15)
    assert group_members(engine.pgid) == []
    assert killed == [], "the engine shut down on SIGINT within the grace period"
    assert not engine.ipc_dir.exists(), "its socket folder removed with it"
    assert "Application startup complete" in (tmp_path / "engine" / "engine.log").read_text()
    _check_attached_run(attached)
    events = read_engine_events(engine.events_path)
    assert events.meta.get("default_tps") == 1000
    first = events.string_index(next(s for s in events.strings if "rb-abc-1" in s))
    finishes = events.of_kind(3)
    finishes = finishes[finishes["req"] == first]
    assert len(finishes) == 1 and int(finishes["count"][0]) == 5
    # its arrival (version 3): once, before its first dispatch, with its prompt's tokens
    arrivals = events.of_kind(5)
    mine = arrivals[arrivals["req"] == first]
    dispatches = events.of_kind(1)
    assert events.version == 3 and len(mine) == 1 and int(mine["count"][0]) >= 1
    assert int(mine["t_ns"][0]) <= int(dispatches[dispatches["req"] == first]["t_ns"].min())
    # every request the engine finished (the warm-up's and this one) arrived once
    finished = set(events.of_kind(3)["req"].tolist())
    assert len(np.unique(arrivals["req"])) == len(arrivals) and finished <= set(arrivals["req"].tolist())
    assert ENV_VAR not in os.environ
    _check_warm_up_wave(events, "patched-sync", streams=4, max_tokens=WarmUpPlan(0, None).max_tokens)


def _check_warm_up_wave(events, engine: str, *, streams: int, max_tokens: int) -> None:
    """The wave's streams (the warm-up requests after the two single ones) ran to their end, several
    of them in one batch."""
    number = re.compile(rf"warmup-{re.escape(engine)}-([0-9]+)")
    wave = [i for i, s in enumerate(events.strings) if (m := number.search(s)) and int(m.group(1)) >= 2]
    assert len(wave) == streams + 1  # the short streams and the long prompt
    fin = events.of_kind(3)
    fin = fin[np.isin(fin["req"], wave)]
    assert len(fin) == streams + 1 and set(fin["count"].tolist()) == {max_tokens}
    emits = events.of_kind(2)
    _, per_step = np.unique(emits[np.isin(emits["req"], wave)]["t_ns"], return_counts=True)
    assert per_step.max() >= 2, "the wave's streams ran in one batch"


# the server is the test's own (attach mode): the profile's engine settings are never used; max_model_len
# sizes the answers
ATTACH_PROFILE = e2e_profile("test: attach to a running server", {"user-a": 1000}, """
[[scenarios]]
kind = "cancellation"
user = "user-a"
streams = 2
cancel_after_tokens = 3
cancel_after_s = 0.3
max_tokens = 400
followup_streams = 1
followup_max_tokens = 10
settle_s = 0.1
[[scenarios]]
kind = "overhead"
user = "user-a"
streams = 1
max_tokens = 5
""", max_num_seqs=4, max_num_active_seqs=2, default_tps=1000, max_model_len=512)


def _attach_a_run(tmp_path: Path, engine: RunningEngine) -> Path:
    """`ratebench run --endpoint URL --events-file PATH` against the engine: no engine launched."""
    from ratebench.profiles import load_profile
    from ratebench.runner import RunOptions, run_profile

    path = tmp_path / "attach.toml"
    path.write_text(ATTACH_PROFILE)
    outcome = run_profile(load_profile(str(path)),
                          RunOptions(results_dir=tmp_path / "results", endpoint=engine.endpoint,
                                     events_file=engine.events_path, verify=False, live=False),
                          console=Console(stderr=True))
    assert outcome.state == "complete", outcome.reason
    return outcome.run_dir


def _check_attached_run(run_dir: Path) -> None:
    from ratebench.runrecords import read_client_records

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert list(manifest["engines"]) == ["external"] and manifest["engines"]["external"]["kind"] == "external"
    assert manifest["skipped_scenarios"][0]["scenario"] == "overhead"  # it needs launched engines
    assert not (run_dir / "engines" / "external" / "engine.log").exists()
    records = read_client_records(run_dir / "requests.jsonl")
    assert {r.engine for r in records} == {"external"} and any(r.cancelled for r in records)
    events = read_engine_events(run_dir / "engines" / "external" / "events.rbev")
    ids = {events.strings[i] for i in events.records["req"]}
    assert any(r.client_id in i for r in records for i in ids)


def test_stock_overlay_imports_the_pristine_files_and_nothing_the_patch_added(tmp_path: Path,
                                                                               patched_vllm: str) -> None:
    from ratebench import patching
    from ratebench.engine import write_stock_overlay

    pristine = patching.read_pristine_files()
    env = dict(os.environ)
    env.update(write_stock_overlay(pristine, patching.site_packages_of_vllm(), tmp_path))
    probe = (
        "import hashlib, importlib, json, sys\n"
        "out = {}\n"
        "for name in ('vllm.v1.core.sched.scheduler', 'vllm.engine.arg_utils'):\n"
        "    m = importlib.import_module(name)\n"
        "    out[name] = [m.__file__, hashlib.sha256(open(m.__file__, 'rb').read()).hexdigest()]\n"
        "try:\n"
        "    import vllm.v1.core.sched.output_rate\n"
        "    out['added'] = 'imported'\n"
        "except ModuleNotFoundError:\n"
        "    out['added'] = 'absent'\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    import hashlib

    for name, rel in (("vllm.v1.core.sched.scheduler", "vllm/v1/core/sched/scheduler.py"),
                      ("vllm.engine.arg_utils", "vllm/engine/arg_utils.py")):
        path, digest = out[name]
        assert path.startswith(str(tmp_path))
        assert digest == hashlib.sha256(pristine[rel]).hexdigest()
    assert out["added"] == "absent"
    assert b"output_rate" not in pristine["vllm/v1/core/sched/scheduler.py"]
    assert patching.patch_status().overall == "patched"  # the installed tree was not touched
