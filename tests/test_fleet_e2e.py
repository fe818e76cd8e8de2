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
from e2e_profiles import e2e_profile
from ratebench.profiles import load_profile
from ratebench.runner import RunOptions, run_profile

pytestmark = pytest.mark.e2e

PROFILE = e2e_profile(
    "test: two engines behind HAProxy", {"user-a": 30, "user-d": 30, "user-l": 1000, "user-m": 1000,
                                          "user-n": 1000, "user-o": 1000}, """
[[scenarios]]
kind = "fleet"
users = ["user-a", "user-d"]
streams = 2
max_tokens = 24
engines = 2
failover_after_s = 1.0
failover_requests = 4
failover_max_tokens = 12
light_users = ["user-l", "user-m", "user-n", "user-o"]
light_requests = 10
light_max_tokens = 8
light_every_s = 0.2
baseline = true
""", max_engines=2, max_num_seqs=8,
    extra_args=("--enforce-eager", "--block-size", "32", "--num-gpu-blocks-override", "64",
                "--output-rate-metrics-users", "8"))

FLEET = "fleet2-sync"
MEMBERS = ["patched-sync.e0", "patched-sync.e1"]
OFF_FLEET = "fleet2-off-sync"  # the same requests on limiter-off engines: the isolation baseline
OFF_MEMBERS = ["feature-off-sync.e0", "feature-off-sync.e1"]
HEAVY, LIGHT = ("user-a", "user-d"), ("user-l", "user-m", "user-n", "user-o")
FLEET_BOUNDS = ("fleet-bound-dispatch", "fleet-bound-emit", "fleet-bound-client")


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory, patched_vllm: str, tiny_model: Path):
    folder = tmp_path_factory.mktemp("fleet")
    path = folder / "fleet.toml"
    path.write_text(PROFILE)
    with hold_engine_lock():
        # the checks made before the engines start (promise 7, the flags) are test_run_e2e's: left out here
        outcome = run_profile(load_profile(str(path)), RunOptions(results_dir=folder / "results", live=False,
                                                                  check_before_engines=False),
                              console=Console(stderr=True))
    assert outcome.state == "complete", outcome.reason
    assert outcome.verdict is not None
    return outcome


def test_every_request_went_through_the_balancer_and_names_the_engine_that_served_it(fleet_run) -> None:
    records = [json.loads(line) for line in (fleet_run.run_dir / "requests.jsonl").read_text().splitlines()]
    base = [r for r in records if r["phase"].endswith("-baseline")]
    records = [r for r in records if r["phase"] in ("round-robin", "user-hash")]  # failover: see its test
    assert len(records) == len(base) == 2 * (2 * 2 + 4 * 10)  # two policies; two users' two streams, 10 light answers
    # of each of four light users
    assert all(r["fleet"] == FLEET and r["engine"] in MEMBERS and r["error"] is None for r in records)
    assert all(r["fleet"] == OFF_FLEET and r["engine"] in OFF_MEMBERS and r["error"] is None for r in base)
    assert all(r["completion_tokens"] == (24 if r["user"] in HEAVY else 8) for r in records + base)
    hashed = {}
    for r in records:
        if r["phase"] == "user-hash":
            hashed.setdefault(r["user"], set()).add(r["engine"])
    assert all(len(engines) == 1 for engines in hashed.values()), hashed  # user-hash: one engine per user
    spread = {}
    for r in records:
        if r["phase"] == "round-robin" and r["user"] in HEAVY:
            spread.setdefault(r["user"], set()).add(r["engine"])
    assert all(len(engines) == 2 for engines in spread.values()), spread  # sent in order, 25 ms apart
    # each phase recorded once per member, tied together by params.fleet
    phases = json.loads((fleet_run.run_dir / "scenarios.json").read_text())
    assert sorted((p["phase"], p["engine"]) for p in phases) == sorted(
        [(policy, m) for policy in ("round-robin", "user-hash", "failover") for m in MEMBERS]
        + [(f"{policy}-baseline", m) for policy in ("round-robin", "user-hash") for m in OFF_MEMBERS])
    assert all(p["params"]["fleet"]["name"] == (OFF_FLEET if p["engine"] in OFF_MEMBERS else FLEET) for p in phases)
    assert all(p["role"] == ("baseline" if p["engine"] in OFF_MEMBERS else "measure") for p in phases)
    assert all(p["params"]["fleet"]["unserved"] == 0 for p in phases if p["phase"] != "failover")


def test_round_robin_fails_the_fleet_bound_that_every_engine_keeps_and_user_hash_passes(fleet_run) -> None:
    verdict = fleet_run.verdict
    print(verdict.summary())
    assert not verdict.passed
    by = {}
    for c in verdict.checks:
        by.setdefault(c.name, []).append(c)
    records = [json.loads(line) for line in (fleet_run.run_dir / "requests.jsonl").read_text().splitlines()]
    spread_users = {u for u in HEAVY
                    if len({r["engine"] for r in records if r["phase"] == "round-robin" and r["user"] == u}) == 2}
    records = [r for r in records if r["phase"] != "failover"]
    for name in FLEET_BOUNDS:
        rr = {c.user: c for c in by[name] if c.phase == "round-robin"}
        hashed = {c.user: c for c in by[name] if c.phase == "user-hash"}
        assert set(hashed) == set(HEAVY + LIGHT), name  # (the limiter-off fleet has no bound to judge)
        assert all(rr[u].passed for u in LIGHT), name  # a light user's every token fits in one burst
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
    assert set(counted) == {(p, u) for p in ("round-robin", "user-hash") for u in HEAVY + LIGHT}
    assert all(c.passed and f"across the fleet {48 if c.user in HEAVY else 80} tokens" in c.explanation
               for c in counted.values()), \
        [c.explanation for c in counted.values()]  # (2 x 24 tokens a heavy user, 10 x 8 a light one)
    served = [c for c in by["fleet-served"] if c.phase != "failover"]
    assert sorted((c.engine, c.phase) for c in served) == sorted(
        [(FLEET, p) for p in ("round-robin", "user-hash")] + [(OFF_FLEET, f"{p}-baseline")
                                                              for p in ("round-robin", "user-hash")])
    assert all(c.passed for c in served)
    failed = {c.name for c in verdict.failures}
    assert set(FLEET_BOUNDS) <= failed


def test_an_engine_stopped_mid_phase_moves_its_users_and_loses_no_request_silently(fleet_run) -> None:
    verdict = fleet_run.verdict
    phases = json.loads((fleet_run.run_dir / "scenarios.json").read_text())
    (stop,) = {json.dumps(p["params"]["fleet"]["failover"]) for p in phases if p["phase"] == "failover"}
    stop = json.loads(stop)
    assert stop["engine"] in MEMBERS and stop["users_before"], stop
    # the stopped engine's CPU time stays in the run's: no negative "run", no phantom "other" load
    (cpu,) = {json.dumps(p["machine_cpu"]) for p in phases if p["phase"] == "failover"}
    cpu = json.loads(cpu)
    assert cpu["run"] > 0.5 and cpu["other"] < cpu["busy"], cpu
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
    for fleet, members in ((FLEET, MEMBERS), (OFF_FLEET, OFF_MEMBERS)):
        entry = manifest["balancers"][fleet]
        assert entry["members"] == members and entry["killed_pids"] == [] and entry["stopped_monotonic_ns"]
        assert set(entry["endpoints"]) == {"round-robin", "user-hash"}
        cfg = (fleet_run.run_dir / entry["config"]).read_text()
        assert "balance roundrobin" in cfg and "balance hdr(X-Ratebench-User)" in cfg
        with pytest.raises(ProcessLookupError):
            os.kill(entry["pid"], 0)
    # the plan names each member's record of each phase (what verify-bound --partial looks for)
    assert sorted((p["phase"], p["engine"]) for p in manifest["planned_phases"]) == sorted(
        [(policy, m) for policy in ("round-robin", "user-hash", "failover") for m in MEMBERS]
        + [(f"{policy}-baseline", m) for policy in ("round-robin", "user-hash") for m in OFF_MEMBERS])
    for name in OFF_MEMBERS:
        assert manifest["engines"][name]["feature"] is False and manifest["engines"][name]["killed_pids"] == []
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


def _isolation(checks, engine: str) -> dict[tuple[str, str], object]:
    return {(c.phase, c.name): c for c in checks if c.name.startswith("isolation-") and c.engine == engine}


def test_the_light_users_fare_across_the_fleet_as_on_the_limiter_off_fleet(fleet_run) -> None:
    """Isolation across a fleet: the users whose limits never bound (the light users), pooled over the
    fleet's engines, against the same requests on two limiter-off engines behind their own balancer."""
    checks = _isolation(fleet_run.verdict.checks, FLEET)
    slow: list[str] = []
    for policy in ("round-robin", "user-hash"):
        binding = checks[(policy, "isolation-binding")]
        # the backlogged users are bound (refused on the fleet, and past their limits on the baseline)
        assert "user-a" in binding.explanation and "user-d" in binding.explanation, binding.explanation
        assert binding.figure == 4 and "unbound users (4 users)" in binding.explanation, binding.explanation
        for name in ("isolation-ttft", "isolation-ttft-p90", "isolation-e2e-p50", "isolation-e2e-p90",
                     "isolation-gap-p50", "isolation-gap-p90", "isolation-rate"):
            c = checks[(policy, name)]
            assert c.user == "unbound users" and "user-l" in c.explanation and "user-m" in c.explanation
            assert f"{policy}-baseline@{OFF_FLEET}" in c.explanation and "client side" in c.explanation
            assert c.passed is not None, c.explanation  # judged (40 samples a side: p90 too)
            if name == "isolation-rate":
                assert c.passed, c.explanation
            elif not c.passed:
                slow.append(f"{policy} {name}: {c.explanation}")
        assert checks[(policy, "isolation-ttft-p99")].passed is None  # 40 samples: too few for a p99
    assert not _isolation(fleet_run.verdict.checks, OFF_FLEET)  # the baseline is not judged against itself
    # Known defect (issue 20), not the verifier's: on this 2-core machine's slow hours the limiter-on
    # engines serve users whose limits never bind more slowly than the limiter-off ones (the main job's
    # mix and crowd tiers, 2026-12-06; here in two fresh-clone CI runs of three that day: e2e p90
    # 144.9 ms against 63.1 and 147.3 against 55.3, 144.7 and 132.9 allowed). The check says FAIL
    # and names it; the test shows it as this known defect rather than pass or hide it.
    if slow:
        pytest.xfail("known defect (issue 20): the light users slower on the limiter-on fleet: " + "; ".join(slow))


def test_a_fleet_that_keeps_its_light_users_waiting_fails_isolation(fleet_run, tmp_path) -> None:
    """The same run with the light users' answers on the limiter-on fleet arriving 300 ms late (what a
    fleet whose throttled requests kept their slots would do to them): isolation across the fleet FAILs,
    naming the fleet and the policy."""
    import shutil

    from ratebench.verify import verify_run

    folder = tmp_path / "late"
    shutil.copytree(fleet_run.run_dir, folder)
    late = 300_000_000
    lines = []
    for line in (folder / "requests.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["fleet"] == FLEET and r["user"] in LIGHT and r["phase"] != "failover":
            r["chunk_ns"] = [t + late for t in r["chunk_ns"]]
            for key in ("first_token_ns", "done_ns"):
                if r.get(key):
                    r[key] += late
        lines.append(json.dumps(r))
    (folder / "requests.jsonl").write_text("\n".join(lines) + "\n")
    # and the user-hash phase shared the machine with other work: still a FAIL, which says so
    phases = json.loads((folder / "scenarios.json").read_text())
    for p in phases:
        if p["phase"] == "user-hash":
            p["machine_cpu"] = {"busy": 1.9, "run": 1.3, "other": 0.6}
    (folder / "scenarios.json").write_text(json.dumps(phases))
    verdict = verify_run(folder, write=False, plots=False)
    checks = _isolation(verdict.checks, FLEET)
    for policy in ("round-robin", "user-hash"):
        for name in ("isolation-ttft", "isolation-e2e-p50"):
            c = checks[(policy, name)]
            assert c.passed is False and c.figure > 300, c.explanation
            assert ("other processes used 0.60 CPUs" in c.explanation) == (policy == "user-hash"), c.explanation
        assert checks[(policy, "isolation-gap-p50")].passed  # the gaps did not change
