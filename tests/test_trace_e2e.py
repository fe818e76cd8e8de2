"""The example trace replayed against a real CPU engine: every request sent within the stated
lateness of its trace time, and each reached the engine as the user it named (or __anonymous__)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from ratebench.events import KIND_FINISH, read_engine_events
from ratebench.runrecords import client_id_of, read_client_records
from ratebench.profiles import ANONYMOUS_USER, BUILTIN_DIR, load_profile
from ratebench.runner import RunOptions, run_profile
from ratebench.trace import read_trace
from e2e_profiles import e2e_profile
from ratebench.verify import analyse_run

pytestmark = pytest.mark.e2e

LATENESS_MS = 20

TRACE_PROFILE = e2e_profile("test: the example trace on one engine", {"user-a": 20, "user-b": 100, "user-fast": 2000},
                            f"""
[[scenarios]]
kind = "trace"
trace = "example-trace"
users_at_default_rate = true     # user-c is not declared: it runs at default_tps
lateness_ms = {LATENESS_MS}
""")


def test_the_example_trace_reaches_the_engine_on_time_and_as_its_users(
        tmp_path: Path, patched_vllm: str, tiny_model: Path, engine_lock: None) -> None:
    path = tmp_path / "trace.toml"
    path.write_text(TRACE_PROFILE)
    # the checks made before the engines start (promise 7, the flags) are test_run_e2e's: left out here
    outcome = run_profile(load_profile(str(path)), RunOptions(results_dir=tmp_path / "results", verify=False,
                                                              live=False, check_before_engines=False),
                          console=Console(stderr=True))
    assert outcome.state == "complete", outcome.reason
    trace = read_trace(BUILTIN_DIR / "example-trace.jsonl")
    records = read_client_records(outcome.run_dir / "requests.jsonl")
    assert len(records) == len(trace)
    t0 = min(r.scheduled_ns for r in records)
    by_index = sorted(records, key=lambda r: r.stream_index)
    late_ms = []
    for want, rec in zip(trace, by_index):
        assert (rec.scheduled_ns - t0) / 1e9 == pytest.approx(want.at_s, abs=1e-6)
        assert rec.sent_ns is not None and rec.error is None, (rec.client_id, rec.error)
        assert (rec.user, rec.api, rec.max_tokens, rec.ignore_eos) == (want.user, want.api, want.max_tokens,
                                                                       not want.eos)
        late_ms.append((rec.sent_ns - rec.scheduled_ns) / 1e6)
    print(f"lateness ms: max {max(late_ms):.2f}, all {sorted(round(x, 2) for x in late_ms)}")
    # trace-lateness judges the p99 (of 33 requests: all but the latest, nearly); one request sent late by a
    # stall of this 2-core host (22.4 ms once in a fresh-clone CI run, the next latest 8.4 ms) is within it,
    # a driver that sends late is not: every request but one within the lateness, none beyond three times it
    assert 0 <= min(late_ms) and sorted(late_ms)[-2] <= LATENESS_MS and max(late_ms) <= 3 * LATENESS_MS, late_ms

    events = read_engine_events(outcome.run_dir / "engines" / "patched-sync" / "events.rbev")
    engine_user = {}
    for ev in events.of_kind(KIND_FINISH):
        cid = client_id_of(events.strings[ev["req"]])
        if cid is not None:
            engine_user[cid] = events.strings[ev["user"]]
    for rec in records:
        assert engine_user.get(rec.client_id) == (rec.user or ANONYMOUS_USER), rec.client_id

    (check,) = [c for c in analyse_run(outcome.run_dir).verdict.checks if c.name == "trace-lateness"]
    assert check.passed, check.explanation
