"""A fleet end to end: two real limiter-on CPU engines behind real HAProxy, one phase per routing
policy, through `ratebench run` and the verifier.

Round-robin is the broken configuration here: each engine keeps its own bound, and a user whose
streams it spread over both engines receives about twice its limit. The verifier must say FAIL
for the fleet bound in that phase and name the policy; under user-hash the same users pass."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from conftest import hold_engine_lock
from ratebench.profiles import load_profile
from ratebench.runner import RunOptions, run_profile

pytestmark = pytest.mark.e2e

PROFILE = """
[profile]
description = "test: two engines behind HAProxy"
device = "cpu"
scheduling = ["sync"]
startup_timeout_s = 300
shutdown_grace_s = 15
max_engines = 2

[model]
source = "tiny"
served_name = "tiny-qwen3"
max_model_len = 1024

[engine]
max_num_seqs = 8
max_num_active_seqs = 4
max_num_batched_tokens = 256
enable_chunked_prefill = true
enable_prefix_caching = true
extra_args = ["--enforce-eager", "--block-size", "32", "--num-gpu-blocks-override", "64",
              "--output-rate-metrics-users", "8"]
env = { VLLM_CPU_KVCACHE_SPACE = "1" }

[limits]
default_tps = 100
[limits.users]
user-a = 30
user-d = 30

[[scenarios]]
kind = "fleet"
users = ["user-a", "user-d"]
streams = 2
max_tokens = 24
engines = 2
failover_after_s = 1.0
failover_requests = 4
failover_max_tokens = 12
"""

FLEET = "fleet2-sync"
MEMBERS = ["patched-sync.e0", "patched-sync.e1"]
FLEET_BOUNDS = ("fleet-bound-dispatch", "fleet-bound-emit", "fleet-bound-client")


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory, patched_vllm: str, tiny_model: Path):
    folder = tmp_path_factory.mktemp("fleet")
    path = folder / "fleet.toml"
    path.write_text(PROFILE)
    with hold_engine_lock():
        outcome = run_profile(load_profile(str(path)), RunOptions(results_dir=folder / "results", live=False),
                              console=Console(stderr=True))
    assert outcome.state == "complete", outcome.reason
    assert outcome.verdict is not None
    return outcome


def test_every_request_went_through_the_balancer_and_names_the_engine_that_served_it(fleet_run) -> None:
    records = [json.loads(line) for line in (fleet_run.run_dir / "requests.jsonl").read_text().splitlines()]
    records = [r for r in records if r["phase"] != "failover"]  # see the failover test
    assert len(records) == 2 * 2 * 2  # two policies, two users, two streams
    assert all(r["fleet"] == FLEET and r["engine"] in MEMBERS and r["error"] is None for r in records)
    assert all(r["completion_tokens"] == 24 for r in records)
    hashed = {}
    for r in records:
        if r["phase"] == "user-hash":
            hashed.setdefault(r["user"], set()).add(r["engine"])
    assert all(len(engines) == 1 for engines in hashed.values()), hashed  # user-hash: one engine per user
    spread = {}
    for r in records:
        if r["phase"] == "round-robin":
            spread.setdefault(r["user"], set()).add(r["engine"])
    assert all(len(engines) == 2 for engines in spread.values()), spread  # sent in order, 25 ms apart
    # each phase recorded once per member, tied together by params.fleet
    phases = json.loads((fleet_run.run_dir / "scenarios.json").read_text())
    assert sorted((p["phase"], p["engine"]) for p in phases) == sorted(
        (policy, m) for policy in ("round-robin", "user-hash", "failover") for m in MEMBERS)
    assert all(p["params"]["fleet"]["name"] == FLEET for p in phases)
    assert all(p["params"]["fleet"]["unserved"] == 0 for p in phases if p["phase"] != "failover")


def test_round_robin_fails_the_fleet_bound_that_every_engine_keeps_and_user_hash_passes(fleet_run) -> None:
    verdict = fleet_run.verdict
    print(verdict.summary())
    assert not verdict.passed
    by = {}
    for c in verdict.checks:
        by.setdefault(c.name, []).append(c)
    records = [json.loads(line) for line in (fleet_run.run_dir / "requests.jsonl").read_text().splitlines()]
    spread_users = {u for u in ("user-a", "user-d")
                    if len({r["engine"] for r in records if r["phase"] == "round-robin" and r["user"] == u}) == 2}
    records = [r for r in records if r["phase"] != "failover"]
    for name in FLEET_BOUNDS:
        rr = {c.user: c for c in by[name] if c.phase == "round-robin"}
        hashed = {c.user: c for c in by[name] if c.phase == "user-hash"}
        assert set(hashed) == {"user-a", "user-d"}, name
        for user in spread_users:
            assert rr[user].passed is False and "round-robin" in rr[user].explanation, rr[user]
            assert rr[user].figure < -5, rr[user]  # about one limit's worth of tokens too many, not a rounding
        assert all(c.passed for c in hashed.values()), [c.explanation for c in hashed.values() if not c.passed]
    # every engine's own bound holds in both phases: only the fleet sees the breach
    own = [c for c in verdict.checks if c.name in ("bound-dispatch", "bound-emit") and c.engine in MEMBERS]
    assert len(own) >= 2 * 2 * 2 and all(c.passed for c in own), [c.explanation for c in own if not c.passed]
    # the operator's view: each engine's per-user counter on /metrics equals its charges of the user, and the
    # sum over the engines is the user's tokens across the fleet (2 streams x 24 tokens)
    counted = {(c.phase, c.user): c for c in by["fleet-metrics"]}
    assert set(counted) == {(p, u) for p in ("round-robin", "user-hash") for u in ("user-a", "user-d")}
    assert all(c.passed and "across the fleet 48 tokens" in c.explanation for c in counted.values()), \
        [c.explanation for c in counted.values()]
    served = [c for c in by["fleet-served"] if c.phase != "failover"]
    assert len(served) == 2 and all(c.passed for c in served)
    failed = {c.name for c in verdict.failures}
    assert set(FLEET_BOUNDS) <= failed


def test_an_engine_stopped_mid_phase_moves_its_users_and_loses_no_request_silently(fleet_run) -> None:
    verdict = fleet_run.verdict
    phases = json.loads((fleet_run.run_dir / "scenarios.json").read_text())
    (stop,) = {json.dumps(p["params"]["fleet"]["failover"]) for p in phases if p["phase"] == "failover"}
    stop = json.loads(stop)
    assert stop["engine"] in MEMBERS and stop["users_before"], stop
    manifest = json.loads((fleet_run.run_dir / "manifest.json").read_text())
    assert manifest["engines"][stop["engine"]]["failover_stopped_monotonic_ns"] >= stop["stopped_ns"]
    records = [json.loads(line) for line in (fleet_run.run_dir / "requests.jsonl").read_text().splitlines()]
    # (the balancer marks the engine down on the first connection it refuses: within a request or two)
    after = [r for r in records if r["phase"] == "failover" and (r["sent_ns"] or 0) > stop["stopped_ns"] + 2e8
             and r["engine"] in MEMBERS]
    assert after and all(r["engine"] != stop["engine"] for r in after), "the stopped engine's users moved"
    checks = {(c.name, c.user): c for c in verdict.checks if c.phase == "failover"}
    lost, moved = checks[("fleet-failover-lost", None)], checks[("fleet-failover-moved", None)]
    assert lost.passed and lost.figure == 0, lost.explanation
    assert moved.passed and moved.figure == 0, moved.explanation
    served = checks[("fleet-served", None)]  # users the stopped engine never served: nothing refused
    assert served.passed, served.explanation
    for user in stop["users_before"]:
        assert user in moved.explanation
        for name in FLEET_BOUNDS:  # a fresh budget on the new engine: one burst and one token allowed
            c = checks[(name, user)]
            assert c.passed and "one burst and one token for its move" in c.explanation, c.explanation
    # the answers the stop cut short are not reconciled as finished ones; the others are
    recon = [c for c in verdict.checks if c.name == "reconciliation" and c.phase == "failover"]
    assert recon and all(c.passed for c in recon), [c.explanation for c in recon if not c.passed]


def test_the_balancer_is_recorded_and_stopped_with_the_engines(fleet_run) -> None:
    manifest = json.loads((fleet_run.run_dir / "manifest.json").read_text())
    entry = manifest["balancers"][FLEET]
    assert entry["members"] == MEMBERS and entry["killed_pids"] == [] and entry["stopped_monotonic_ns"]
    assert set(entry["endpoints"]) == {"round-robin", "user-hash"}
    # the plan names each member's record of each phase (what verify-bound --partial looks for)
    assert sorted((p["phase"], p["engine"]) for p in manifest["planned_phases"]) == sorted(
        (policy, m) for policy in ("round-robin", "user-hash", "failover") for m in MEMBERS)
    cfg = (fleet_run.run_dir / entry["config"]).read_text()
    assert "balance roundrobin" in cfg and "balance hdr(X-Ratebench-User)" in cfg
    with pytest.raises(ProcessLookupError):
        os.kill(entry["pid"], 0)
    for name in MEMBERS:
        engine = manifest["engines"][name]
        assert engine["feature"] is True and engine["stopped_monotonic_ns"]
        # the failover's engine may be killed after 2 s (its API server waits for open connections)
        assert engine["killed_pids"] == [] or engine.get("failover_stopped_monotonic_ns"), engine


def test_a_partial_fleet_run_keeps_each_fleet_phase_whole(fleet_run, tmp_path) -> None:
    """verify-bound --partial on a fleet: a member that served nobody is complete, the requests the balancer
    refused and the answers the failover cut do not make a phase incomplete, and the fleet checks are
    the complete run's."""
    import shutil

    from ratebench.verify import verify_run

    folder = tmp_path / "partial"
    shutil.copytree(fleet_run.run_dir, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.update(state="partial", partial_reason="test: marked partial")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    verdict = verify_run(folder, partial=True, write=False, plots=False)
    assert verdict.missing_phases == []
    whole = {(c.name, c.phase, c.user, c.passed) for c in fleet_run.verdict.checks if c.name.startswith("fleet")}
    assert {(c.name, c.phase, c.user, c.passed) for c in verdict.checks if c.name.startswith("fleet")} == whole
