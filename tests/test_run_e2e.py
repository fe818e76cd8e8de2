"""`ratebench run` end to end on real CPU engines, with a small, fast profile.

One run of every scenario kind (feature on, feature off, stock vLLM) is shared
by the tests of this module; a killed run and an engine that cannot start have
their own. No assertion depends on timing: rates and the bound are the verifier's
business (tests/test_analysis_*); here we check what was sent, recorded and
stopped.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from ratebench.procstats import group_members
from ratebench.events import FINISH_REASONS, KIND_FINISH, read_engine_events
from ratebench.runrecords import client_id_of, read_client_records
from ratebench.profiles import ANONYMOUS_USER, load_profile, scenario_kinds
from ratebench.runner import RunOptions, run_profile

from conftest import hold_engine_lock
from e2e_profiles import e2e_profile

pytestmark = pytest.mark.e2e

# Sync only: every engine costs a minute to start here; asynchronous scheduling on CPU (the
# cpu_async_overlay) has its own end-to-end test, tests/test_cpu_async_e2e.py. A KV cache of 2,048
# tokens (64 blocks of 32): kv-pressure's throttled streams fill most of it.
SMALL_PROFILE = e2e_profile(
    "test: every scenario kind, small and fast",
    {"user-a": 100, "user-b": 300, "user-fast": 5000, "user-slow": 5, "bulk": 1000000}, """
[[scenarios]]
kind = "seed-experiment"
user = "user-a"
neighbour = "user-b"
streams = [1, 2]
max_tokens = 30
neighbour_max_tokens = 60

[[scenarios]]
kind = "isolation"
throttled_user = "user-a"
throttled_streams = 3
user = "user-fast"
streams = 1
max_tokens = 60
lead_s = 0.3

[[scenarios]]
kind = "cancellation"
user = "user-b"
streams = 2
cancel_after_tokens = 5
cancel_after_s = 0.3
max_tokens = 500
followup_streams = 1
followup_max_tokens = 30
settle_s = 0.2

[[scenarios]]
kind = "long-prompt"
user = "user-b"
streams = 1
prompt_tokens = 400
max_tokens = 20

[[scenarios]]
kind = "prefix-cache"
user = "user-b"
requests = 4
concurrency = 2
prefix_tokens = 256
prompt_tokens = 8
max_tokens = 8

[[scenarios]]
kind = "eos"
user = "user-fast"
requests = 4
concurrency = 2
max_tokens = 256
api = "chat"

[[scenarios]]
kind = "parallel-sampling"
user = "user-a"                  # 100 tok/s over 4 answers on 2 places: the budget binds
requests = 2
n = 2
max_tokens = 20

[[scenarios]]
kind = "request-options"
user = "user-a"                  # 100 tok/s over 14 streams, one per option users send: the budget binds
max_tokens = 10
bad_words = ["re", "<|im_end|>"] # the tiny model says " re" and its EOS (ignore_eos) every other token: the ban binds
banned_token_ids = [299, 2]       # the same two tokens, banned by the logit-bias option's bias of -100

[[scenarios]]
kind = "anonymous-and-spoofing"
streams = 1
spoof_streams = 5
spoof_as = "user-fast"
max_tokens = 30

[[scenarios]]
kind = "waiting"
user = "user-slow"
probe_user = "user-fast"
streams = 2
max_tokens = 6
wait_s = 2.5
probes = 6
cancels = 4
busy_max_tokens = 100

[[scenarios]]
kind = "trace"
trace = "example-trace"
users_at_default_rate = true     # user-c runs at default_tps

[[scenarios]]
kind = "mix"
seed = 2
duration_s = 2
anonymous_rate = 1.0
output_tokens = { dist = "uniform", low = 4, high = 16 }
eos_fraction = 0.25
cancel_fraction = 0.25
prefix_fraction = 0.5
prefix_tokens = 64
chat_fraction = 0.25
[[scenarios.tiers]]
name = "tier"
users = 2
limit_tps = 50
rate = 1.5
[[scenarios.tiers]]
name = "burst"
users = 2
burst = true

[[scenarios]]
kind = "kv-pressure"
throttled_user = "user-slow"     # 5 tok/s, 2 streams of 900-token prompts: 58 of the 64 blocks
                                 # (a preempted stream's recompute, 8 chunks, costs under a token)
throttled_streams = 2
prompt_tokens = 900
user = "user-fast"               # 3 requests of 256 + 20 tokens (9 blocks each)
requests = 3
interval_s = 0.4
lead_s = 0.6
user_prompt_tokens = 256
max_tokens = 20

[[scenarios]]
kind = "active-cap-fairness"     # 3 users x 2 streams on 2 active places; then 3 x 1 and cap-high x 2
users = 3
streams = 2
max_tokens = 160                 # 60 were done in 0.4 s once: before cap-high's arrival + settle
lead_s = 0.2

[[scenarios]]
kind = "overhead"
user = "bulk"
streams = 2
max_tokens = 40
rounds = 1
""", max_engines=3, max_num_seqs=8, max_num_active_seqs=2, max_num_batched_tokens=128, default_tps=200,
    extra_args=("--enforce-eager", "--block-size", "32", "--num-gpu-blocks-override", "64"))


def _write_profile(folder: Path, text: str, name: str = "small") -> Path:
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, patched_vllm: str, tiny_model: Path):
    folder = tmp_path_factory.mktemp("run")
    profile = load_profile(str(_write_profile(folder, SMALL_PROFILE)))
    from ratebench import patching

    with hold_engine_lock():
        patch_hash = patching.patch_sha256()  # now: the patch may be edited while a session waits
        outcome = run_profile(profile, RunOptions(results_dir=folder / "results", verify=False, live=False),
                              console=Console(stderr=True))
    return outcome, patch_hash


def _manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def _assert_no_engine_left(manifest: dict) -> None:
    for name, engine in manifest["engines"].items():
        pid = engine.get("pid")
        if pid is None:
            continue
        assert group_members(pid) == [], f"engine {name}: processes of group {pid} still alive"


def _without_limiter(flags: list[str]) -> list[str]:
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in ("--default-user-output-tokens-per-second", "--user-output-tokens-per-second"):
            skip = True
        else:
            out.append(flag)
    return out


def test_run_completes_and_writes_the_run_folder(small_run) -> None:
    outcome, _ = small_run
    tail = outcome.engine_error.log_tail if outcome.engine_error else ""
    assert outcome.state == "complete", f"{outcome.reason}\n{tail}"
    assert outcome.exit_code == 0
    run_dir = outcome.run_dir
    assert run_dir.parent.name == "small"
    stamp, run_id = run_dir.name.split("-")
    assert len(stamp) == len("20260101T000000Z") and stamp.endswith("Z") and len(run_id) == 8
    for name in ("manifest.json", "scenarios.json", "requests.jsonl"):
        assert (run_dir / name).is_file()
    engines = {"patched-sync", "patched-noevents-sync", "feature-off-sync", "stock-sync"}
    assert {p.name for p in (run_dir / "engines").iterdir()} == engines
    for name in engines:
        assert (run_dir / "engines" / name / "engine.log").stat().st_size > 0
    for name in engines - {"stock-sync", "patched-noevents-sync"}:
        assert (run_dir / "engines" / name / "events.rbev").is_file()
    assert not (run_dir / "engines" / "stock-sync" / "events.rbev").exists()  # stock vLLM records nothing
    assert not (run_dir / "engines" / "patched-noevents-sync" / "events.rbev").exists()  # events off
    stock_log = (run_dir / "engines" / "stock-sync" / "engine.log").read_text()
    assert "output-rate" not in stock_log and "output_rate" not in stock_log
    assert "output-rate engine events" in (run_dir / "engines" / "patched-sync" / "engine.log").read_text()
    # promise 7 without an engine: the limiter-off scheduler against upstream's, step by step
    feature_off = json.loads((run_dir / "feature-off.json").read_text())
    assert feature_off["error"] is None and len(feature_off["configs"]) == 12
    assert all(c["identical"] for c in feature_off["configs"])
    flags = json.loads((run_dir / "flags.json").read_text())
    assert flags["error"] is None and flags["cases"] and all(c["ok"] for c in flags["cases"])


def test_manifest_records_versions_machine_and_each_engine(small_run) -> None:
    outcome, patch_hash = small_run
    m = _manifest(outcome.run_dir)
    assert m["state"] == "complete" and m["partial_reason"] is None
    assert m["profile_name"] == "small" and m["profile"]["limits"]["user_tps"]["user-a"] == 100
    assert m["vllm_version"] == "0.32.0" and m["patch_sha256"] == patch_hash
    assert m["python"] and m["machine"]["cpus"] and m["git_commit"]
    assert m["started_monotonic_ns"] < m["ended_monotonic_ns"] and m["started_unix_s"] < m["ended_unix_s"]
    # where the time went: preparation, engines, each scenario
    stages = m["stage_s"]
    assert {"prepare (patch, model)", "engines start", "engines warm-up", "engines stop",
            "scenario kv-pressure", "scenario overhead", "before the engines (feature off, flags)"} <= set(stages), stages
    assert all(v >= 0 for v in stages.values()) and stages["engines start"] > 1
    e = m["engines"]
    assert (e["stock-sync"]["kind"], e["stock-sync"]["feature"]) == ("stock", False)
    assert e["stock-sync"]["stock_overlay"] and not e["patched-sync"]["stock_overlay"]
    assert (e["feature-off-sync"]["kind"], e["feature-off-sync"]["feature"]) == ("patched", False)
    assert e["patched-sync"]["feature"] and e["patched-sync"]["default_tps"] == 200
    assert "--default-user-output-tokens-per-second" in e["patched-sync"]["flags"]
    assert not any("output-tokens-per-second" in f for f in e["stock-sync"]["flags"])
    # Same engine flags for the four overhead engines, apart from the limiter's.
    assert e["stock-sync"]["flags"] == e["feature-off-sync"]["flags"] == _without_limiter(e["patched-sync"]["flags"])
    assert e["patched-noevents-sync"]["flags"] == e["patched-sync"]["flags"]
    assert e["patched-sync"]["events_file"] == "engines/patched-sync/events.rbev"
    assert e["stock-sync"]["events_file"] is None and e["patched-noevents-sync"]["events_file"] is None
    assert e["patched-sync"]["record_events"] and not e["patched-noevents-sync"]["record_events"]
    # every engine ran the warm-up: two single requests, then max_num_seqs streams, one of them long
    for engine in e.values():
        assert engine["warm_up"]["requests"] == 2 + 8 and not engine["warm_up"]["timed_out"]


def test_no_engine_process_outlives_the_run_and_the_patch_is_back(small_run) -> None:
    outcome, _ = small_run
    m = _manifest(outcome.run_dir)
    _assert_no_engine_left(m)
    assert all(e["killed_pids"] == [] for e in m["engines"].values()), "engines stopped on SIGINT"
    from ratebench import patching

    assert patching.patch_status().overall == "patched"


def test_every_scenario_kind_ran_with_its_phases_and_roles(small_run) -> None:
    outcome, _ = small_run
    phases = json.loads((outcome.run_dir / "scenarios.json").read_text())
    assert {p["kind"] for p in phases} == set(scenario_kinds()) - {"fleet"}  # the fleet: tests/test_fleet_e2e.py
    seed = [(p["phase"], p["engine"]) for p in phases if p["kind"] == "seed-experiment"]
    assert seed == [("1-stream", "patched-sync"), ("2-streams", "patched-sync")]
    roles = collections.Counter((p["kind"], p["role"]) for p in phases)
    assert roles[("isolation", "baseline")] == 1 and roles[("isolation", "shared")] == 1
    assert {r for (k, r) in roles if k == "overhead"} == {"feature-on", "feature-on-no-events", "feature-off", "stock"}
    over = {p["role"]: p for p in phases if p["kind"] == "overhead"}
    assert over["feature-on"]["users"]["bulk"]["limit_tps"] == 1000000
    assert over["feature-on-no-events"]["users"]["bulk"]["limit_tps"] == 1000000
    assert over["feature-on-no-events"]["engine"] == "patched-noevents-sync"
    assert over["stock"]["users"]["bulk"]["limit_tps"] is None and over["stock"]["engine"] == "stock-sync"
    anon = next(p for p in phases if p["kind"] == "anonymous-and-spoofing")
    assert list(anon["users"]) == [ANONYMOUS_USER] and anon["users"][ANONYMOUS_USER]["limit_tps"] == 200
    assert all(p["start_ns"] <= p["end_ns"] for p in phases)
    # the machine's CPU use over each phase, this run's share, and the rest
    assert all(set(p["machine_cpu"]) == {"busy", "run", "other"} and p["machine_cpu"]["run"] > 0
               and p["machine_cpu"]["other"] >= 0 for p in phases)


ENGINES_WITHOUT_EVENTS = ("stock-sync", "patched-noevents-sync")


def _records(outcome):
    """The client's records, one per answer (a request of n answers is n engine requests)."""
    return [a for r in read_client_records(outcome.run_dir / "requests.jsonl") for a in r.answers()]


def _finishes(outcome) -> dict[str, tuple[str, int, str]]:
    """client id -> (finish reason, total output tokens, user), over every engine."""
    out = {}
    for path in (outcome.run_dir / "engines").glob("*/events.rbev"):
        ev = read_engine_events(path)
        for rec in ev.of_kind(KIND_FINISH):
            cid = client_id_of(ev.strings[rec["req"]])
            out[cid] = (FINISH_REASONS[int(rec["reason"])], int(rec["count"]), ev.strings[rec["user"]])
    return out


def test_every_finished_stream_reconciles_with_the_engine(small_run) -> None:
    outcome, _ = small_run
    records = _records(outcome)
    finishes = _finishes(outcome)
    run_id = _manifest(outcome.run_dir)["run_id"]
    assert len({r.client_id for r in records}) == len(records)
    assert all(r.client_id.startswith(f"rb-{run_id}-") for r in records)
    done = [r for r in records if not r.cancelled]
    assert done and all(r.error is None for r in records), [r.error for r in records if r.error]
    for r in done:
        assert r.completion_tokens == r.streamed_tokens, r.client_id
        if r.ignore_eos:
            assert r.completion_tokens == r.max_tokens and r.finish_reason == "length"
        if r.engine not in ENGINES_WITHOUT_EVENTS:
            reason, total, _ = finishes[r.client_id]
            assert total == r.completion_tokens, r.client_id


def test_the_verdict_pairs_every_overhead_role_round_by_round(small_run) -> None:
    from ratebench.verify import analyse_run

    outcome, _ = small_run
    (o,) = analyse_run(outcome.run_dir).verdict.overheads
    assert set(o.paired) == {"feature-on/feature-off", "feature-on/stock", "feature-off/stock",
                             "feature-on/feature-on-no-events"}
    assert all(p.rounds == 1 for p in o.paired.values())
    assert set(o.step_p50_ns) == {"feature-on", "feature-off"}  # the engines that record events


# phases whose cancelled streams are long ignore_eos answers, closed long before their end
LONG_CANCELLED = {("cancellation", "cancel"), ("isolation", "shared")}


def test_cancelled_streams_are_aborted_in_the_engine(small_run) -> None:
    outcome, _ = small_run
    finishes = _finishes(outcome)
    cancelled = [r for r in _records(outcome) if r.cancelled]
    kinds = {(r.scenario, r.phase) for r in cancelled}
    assert ("cancellation", "cancel") in kinds and ("isolation", "shared") in kinds
    for r in cancelled:
        reason, total, _ = finishes[r.client_id]
        assert r.completion_tokens is None and r.cancel_ns is not None
        assert r.streamed_tokens <= total, r.client_id
        if (r.scenario, r.phase) in LONG_CANCELLED or reason == "abort":
            # long ignore_eos answers closed early can only end by the abort; an aborted one ended early
            assert reason == "abort", r.client_id
            assert total < r.max_tokens, r.client_id  # the engine stopped generating for it
        else:
            # a short mix answer may end by itself as the client closes it: its EOS, when it may
            # have one, or max_tokens (verify-bound's reconciliation judges when it ended)
            assert (reason == "stop" and not r.ignore_eos) or (reason == "length" and total == r.max_tokens), \
                (r.client_id, reason, total)


def test_users_reach_the_engine_as_sent_and_no_other_channel_changes_them(small_run) -> None:
    outcome, _ = small_run
    finishes = _finishes(outcome)
    for r in _records(outcome):
        if r.engine in ENGINES_WITHOUT_EVENTS:
            continue
        _, _, engine_user = finishes[r.client_id]
        if r.engine == "feature-off-sync":
            continue
        assert engine_user == (r.user or ANONYMOUS_USER), r.client_id
    spoofed = [r for r in _records(outcome) if r.spoof]
    # the user field, headers, other vllm_xargs keys and a priority, on completions, and all of them on chat
    assert len({r.spoof for r in spoofed}) == 5 and {r.api for r in spoofed} == {"completions", "chat"}
    assert sum("priority" in r.spoof for r in spoofed) == 2
    assert all(finishes[r.client_id][2] == ANONYMOUS_USER for r in spoofed)


def test_a_request_of_several_answers_is_one_engine_request_per_answer_each_charged_to_its_user(small_run) -> None:
    outcome, _ = small_run
    finishes = _finishes(outcome)
    sent = [r for r in read_client_records(outcome.run_dir / "requests.jsonl") if r.scenario == "parallel-sampling"]
    assert len(sent) == 2
    for r in sent:
        assert [c["index"] for c in r.choices] == [0, 1] and r.completion_tokens == 2 * r.max_tokens
        assert r.streamed_tokens == r.completion_tokens and r.token_ids is None
        for a in r.answers():
            assert a.completion_tokens == a.streamed_tokens == r.max_tokens and len(a.token_ids) == r.max_tokens
            assert finishes[a.client_id] == ("length", r.max_tokens, "user-a"), a.client_id


def test_every_request_option_is_served_whole_and_charged_to_its_user(small_run) -> None:
    """Structured outputs, logprobs, penalties, stop strings, ...: each option's stream ran to max_tokens,
    answered without error, and every token of it was the user's (the warm-up probes are no phase's)."""
    from ratebench.scenarios.request_options import OPTIONS

    OPTIONS_ORDER = list(OPTIONS)  # the scenario's default options: one stream each, in this order
    outcome, _ = small_run
    finishes = _finishes(outcome)
    sent = [r for r in read_client_records(outcome.run_dir / "requests.jsonl") if r.scenario == "request-options"]
    assert len(sent) == len(OPTIONS)
    assert {r.api for r in sent} == {"completions", "chat"}
    for r in sent:
        assert not r.error and r.completion_tokens == r.streamed_tokens == r.max_tokens == 10, r
        assert finishes[r.client_id] == ("length", r.max_tokens, "user-a"), r.client_id
    phases = [p for p in json.loads((outcome.run_dir / "scenarios.json").read_text())
              if p["scenario"] == "request-options"]
    assert phases and all(p["params"]["option_probes"] == [f"{o} 200" for o in OPTIONS] for p in phases)
    # the constrained answers (json-schema, json-object, regex, choice, penalties, repetition-penalty,
    # logit-bias, allowed-token-ids, bad-words, min-tokens) obey their constraints, held to fresh grammar
    # matchers, the model's raw scores under the penalties (scored after the phase), the engine's own greedy
    # tokens under the repetition penalty (asked again at each position), the banned ids, vLLM's bad-word
    # sequences with the model's tokenizer, and the stop tokens min_tokens masks
    from ratebench.verify import analyse_run

    assert all(set(p["params"]["penalty_scores"]) == {str(OPTIONS_ORDER.index("penalties"))} for p in phases)
    repetition = str(OPTIONS_ORDER.index("repetition-penalty"))
    assert all(set(p["params"]["repetition_probes"]["tokens"]) == {repetition} for p in phases)
    assert all(len(p["params"]["repetition_probes"]["tokens"][repetition]) == 10 for p in phases)
    checks = [c for c in analyse_run(outcome.run_dir).verdict.checks if c.name == "structured-answers"]
    assert len(checks) == len(phases), checks
    assert all(c.passed and c.explanation.startswith("0 of 10 constrained answers") for c in checks), \
        [c.explanation for c in checks]


def test_long_prompts_eos_and_prefix_cache_send_what_they_say(small_run) -> None:
    outcome, _ = small_run
    records = _records(outcome)
    long = [r for r in records if r.scenario == "long-prompt"]
    assert long and all(r.prompt_tokens == 400 for r in long)
    eos = [r for r in records if r.scenario == "eos"]
    assert eos and not any(r.ignore_eos for r in eos)
    assert any(r.finish_reason == "stop" and r.completion_tokens < r.max_tokens for r in eos)
    prefix = [r for r in records if r.scenario == "prefix-cache"]
    assert len(prefix) == 4 and all(r.prompt_tokens == 256 + 8 for r in prefix)
    phase = next(p for p in json.loads((outcome.run_dir / "scenarios.json").read_text())
                 if p["kind"] == "prefix-cache")
    if "prefix_cache_hits_tokens" in phase["params"]:
        assert phase["params"]["prefix_cache_hits_tokens"] > 0


# ---- a killed run, an engine that cannot start ------------------------------------------


SLOW_PROFILE = e2e_profile("test: one long scenario, to be interrupted", {"user-a": 10, "user-b": 100}, """
[[scenarios]]
kind = "seed-experiment"
user = "user-a"
neighbour = "user-b"
streams = [1, 4]
max_tokens = 600
neighbour_max_tokens = 600
""", max_num_seqs=8)


def test_a_killed_run_is_partial_and_leaves_no_engine(tmp_path: Path, patched_vllm: str, tiny_model: Path) -> None:
    profile = _write_profile(tmp_path, SLOW_PROFILE, "slow")
    results = tmp_path / "results"
    with hold_engine_lock():
        # a run started in the background (`ratebench run ... &`, nohup, a CI script) inherits SIGINT
        # ignored, and is stopped with SIGTERM (kill, a CI timeout): it must end as Ctrl-C ends one.
        # (Ctrl-C itself: tests/test_runner.py, the same KeyboardInterrupt)
        proc = subprocess.Popen(
            [sys.executable, "-m", "ratebench", "run", "--profile", str(profile), "--results", str(results)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            deadline = time.monotonic() + 300
            manifest_path = None
            while time.monotonic() < deadline and proc.poll() is None:
                found = list(results.glob("slow/*/manifest.json"))
                if found:
                    manifest_path = found[0]
                    m = json.loads(manifest_path.read_text())
                    engine = m["engines"].get("patched-sync", {})
                    if engine.get("ready_monotonic_ns"):
                        break
                time.sleep(0.5)
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(2.0)  # the scenario is streaming now
            proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired as exc:
                # where it hangs (seen once in CI, 2026-12-06, not reproduced here): every thread's stack
                spy = Path(sys.executable).with_name("py-spy")
                dump = subprocess.run([str(spy), "dump", "--pid", str(proc.pid)], capture_output=True, text=True,
                                      timeout=60)
                pytest.fail(f"the run did not end within 120 s of SIGTERM; its output:\n{exc.output}\n"
                            f"py-spy dump:\n{dump.stdout}{dump.stderr}")
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, out
    m = json.loads(manifest_path.read_text())
    assert m["state"] == "partial" and "interrupted" in m["partial_reason"]
    _assert_no_engine_left(m)
    records = read_client_records(manifest_path.parent / "requests.jsonl")
    assert records and any(r.cancelled for r in records)
    assert "state: partial" in out


def test_an_engine_that_exits_fails_the_run_with_its_log_and_leaves_nothing(
        tmp_path: Path, patched_vllm: str, tiny_model: Path) -> None:
    bad = SLOW_PROFILE.replace('extra_args = ["--enforce-eager"]', 'extra_args = ["--kv-cache-dtype", "no-such-dtype"]')
    profile = _write_profile(tmp_path, bad, "broken")
    results = tmp_path / "results"
    with hold_engine_lock():
        proc = subprocess.run(
            [sys.executable, "-m", "ratebench", "run", "--profile", str(profile), "--results", str(results)],
            capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 130), out
    assert "exited with code" in out and "last lines of" in out
    assert "kv-cache-dtype" in out or "kv_cache_dtype" in out  # vLLM's own complaint, from the log tail
    (manifest_path,) = results.glob("broken/*/manifest.json")
    m = json.loads(manifest_path.read_text())
    assert m["state"] == "failed"
    _assert_no_engine_left(m)
    assert os.path.getsize(manifest_path.parent / "engines" / "patched-sync" / "engine.log") > 0


def test_the_shipped_limiter_keeps_identity_spacing_and_waits_without_cost(small_run) -> None:
    """The checks of the promise beyond the bound, on the real engine: every spoofing channel charged
    nothing, backlogged users evenly spaced, the waiting engine cheap and awake."""
    from ratebench.verify import analyse_run

    outcome, _ = small_run
    verdict = analyse_run(outcome.run_dir).verdict
    by_name = collections.defaultdict(list)
    for c in verdict.checks:
        by_name[c.name].append(c)
    for name in ("identity", "even-spacing-dispatch", "even-spacing-emit", "wait-cpu", "wake-first-token",
                 "wake-abort", "kv-pressure-applied", "stream-wait", "place-share", "place-share-jain",
                 "feature-off-upstream", "flags-refused", "beam-search-refused", "identity-unstreamed"):
        # every one judged passes (a row where the engine, not the budget, limited the user is not judged)
        assert any(c.passed for c in by_name[name]), f"no {name} check judged"
        assert all(c.passed is not False for c in by_name[name]), [c.explanation for c in by_name[name]
                                                                    if c.passed is False]
    # a beam search request on each API, refused with HTTP 400 naming beam search
    assert sorted(c.figure for c in by_name["beam-search-refused"]) == [400, 400]
    # a request answered in one body on each API, sending every spoof channel (no named user here): charged
    # to __anonymous__, its four tokens emitted
    unstreamed = by_name["identity-unstreamed"]
    assert len(unstreamed) == 2 and all(c.user == ANONYMOUS_USER and "its 4 charges all to __anonymous__" in c.explanation
                                        for c in unstreamed), [c.explanation for c in unstreamed]
    anon = [c for c in by_name["identity"] if c.scenario == "anonymous-and-spoofing"]
    assert anon and anon[0].user == ANONYMOUS_USER and "6 requests" in anon[0].explanation  # 1 stream and 5 spoofs
