"""scenarios.json: one type (ratebench.runrecords.PhaseRecord) writes an entry and reads it back."""

from __future__ import annotations

import json

import pytest

from ratebench.runrecords import PhaseRecord, PhaseUser

# An entry as the runner wrote it before writer and reader became one type.
WRITTEN = """[
  {
    "scenario": "mix",
    "kind": "mix",
    "phase": "mix",
    "engine": "patched-sync",
    "start_ns": 100,
    "end_ns": 900,
    "users": {
      "low-00": {
        "limit_tps": 20,
        "streams": 2,
        "backlogged": false,
        "tier": "low",
        "requests": 5
      },
      "__anonymous__": {
        "limit_tps": null,
        "streams": 1
      }
    },
    "role": "measure",
    "params": {
      "seed": 1
    },
    "machine_cpu": {
      "busy": 1.9,
      "run": 1.8,
      "other": 0.1
    },
    "engine_core_cpu_s": 0.42
  }
]
"""


def _dump(records: list[PhaseRecord]) -> str:
    return json.dumps([r.to_json() for r in records], indent=2) + "\n"  # as ratebench._io.atomic_write_json


def test_an_entry_written_by_a_scenario_is_the_file_s_format() -> None:
    record = PhaseRecord(scenario="mix", kind="mix", phase="mix", engine="patched-sync", start_ns=100, end_ns=100,
                         users={}, params={"seed": 1})
    record.users["low-00"] = {"limit_tps": 20, "streams": 2, "backlogged": False, "tier": "low", "requests": 5}
    record.users["__anonymous__"] = {"limit_tps": None, "streams": 1}
    record.end_ns, record.machine_cpu, record.engine_core_cpu_s = 900, {"busy": 1.9, "run": 1.8, "other": 0.1}, 0.42
    assert _dump([record]) == WRITTEN


def test_an_entry_reads_back_typed_and_writes_back_byte_identical() -> None:
    records = [PhaseRecord.from_json(i, e) for i, e in enumerate(json.loads(WRITTEN))]
    low, anonymous = records[0].users["low-00"], records[0].users["__anonymous__"]
    assert (low.limit_tps, low.streams, low.backlogged, low.tier) == (20, 2, False, "low")
    assert (anonymous.limit_tps, anonymous.streams, anonymous.backlogged, anonymous.tier) == (None, 1, False, None)
    assert records[0].key == ("mix", "mix", "patched-sync") and records[0].index == 0
    assert _dump(records) == WRITTEN


def test_a_user_entry_that_is_not_one_is_refused_when_read() -> None:
    with pytest.raises(ValueError):
        PhaseUser.read({"limit_tps": "fast"})


def test_what_the_analysis_reads_of_params_is_typed_and_round_trips() -> None:
    from ratebench.phasefacts import KEY_FLEET, BeamProbe, Failover, FleetInfo

    stop = Failover("patched-sync.e1", 1_000, 1.5, ["user-a"])
    info = FleetInfo("fleet2-sync", "failover", ["patched-sync.e0", "patched-sync.e1"], balancer="haproxy",
                     served_by_header="X-Ratebench-Engine", requests=12, unserved=1, failover=stop)
    probe = BeamProbe("chat", "use_beam_search, n 2", 400, "beam search is not supported")
    params = {"max_tokens": 8, KEY_FLEET: info.to_json(), "beam_search": [probe.to_json()], "round": 2,
              "scheduling": "async", "kv_usage_max": 0.97, "stream_wait": ["user-a"], "place_share": True,
              "greedy_answers": True}
    entry = json.loads(json.dumps({"scenario": "s", "phase": "p", "engine": "e", "users": {}, "params": params}))
    facts = PhaseRecord.from_json(0, entry).facts
    assert facts.fleet == info and facts.fleet.failover == stop and facts.beam_search == (probe,)
    assert (facts.round, facts.scheduling, facts.kv_usage_max, facts.preemptions) == (2, "async", 0.97, None)
    assert facts.kv_measured and facts.stream_wait == ("user-a",) and facts.place_share and facts.greedy
    # a phase without them (another kind, or a folder written before one was recorded): the defaults
    bare = PhaseRecord.from_json(0, {"scenario": "s", "phase": "p", "engine": "e", "users": {}}).facts
    assert bare.fleet is None and bare.beam_search == () and not bare.kv_measured and not bare.greedy
    assert FleetInfo.read({"policy": "round-robin"}) is None  # a fleet without a name ties nothing together
