"""Version 2 of the engine event file (step blocks, refuse records) and the work-conservation check
(ratebench/analysis/workcons.py).

Event files are written with EventFileWriter; run folders come from the simulated engine, with
step records added to its event file the way the patched engine's recorder writes them."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from ratebench.analysis.checks import build_checks
from ratebench.analysis.load import load_run
from ratebench.analysis.summary import summarize_run
from ratebench.analysis.verdict import Thresholds
from ratebench.analysis.workcons import NOT_RECORDED, StepLimits, phase_figures, runs_of, violations
from ratebench.events import (
    KIND_DISPATCH,
    KIND_NAMES,
    KIND_REFUSE,
    RECORD_DTYPE,
    STEP_DTYPE,
    EventFileError,
    EventFileWriter,
    read_engine_events,
)
from synth import SimEngine, SimPhase, SimRequest, write_run_folder
from synthetic_runs import one_phase_run

META = {"pid": 1, "default_tps": 50, "user_tps": {}, "burst_ns": 100_000_000, "async_scheduling": False,
        "max_num_seqs": 4, "max_num_active_seqs": 2, "policy": "FCFS", "max_num_batched_tokens": 64,
        "num_kv_blocks": 100, "block_size": 16}
LIMITS = StepLimits(max_num_seqs=4, max_num_active_seqs=2, max_num_batched_tokens=64, num_kv_blocks=100)
STEP_NS = 5_000_000

# a step that conserves work: both places used, nothing waiting
OK = dict(reqs=2, tokens=2, resident=4, throttled=2, waiting=0, waiting_ready=0, yielded=0, kv_free=10, ready_blocks=20)
# slot: every slot resident, three of them throttled, a place idle, a ready request waiting
SLOT = dict(reqs=1, tokens=1, resident=4, throttled=3, waiting=1, waiting_ready=1, yielded=0, kv_free=10, ready_blocks=20)
# place: one place idle while a throttled resident could give way to a ready request
PLACE = dict(reqs=1, tokens=1, resident=3, throttled=2, waiting=1, waiting_ready=1, yielded=0, kv_free=10, ready_blocks=20)
# a place idle, a ready request waiting, nothing throttled and the KV cache short: not the limiter's doing
KV_SHORT = dict(reqs=1, tokens=1, resident=1, throttled=0, waiting=1, waiting_ready=1, yielded=0, kv_free=10, ready_blocks=20)
# resident: a place idle while a resident of a user with budget (on the bench, not throttled) got no tokens
LEFT_OUT = dict(reqs=1, tokens=1, resident=4, throttled=0, waiting=1, waiting_ready=1, yielded=0, kv_free=0, ready_blocks=20)
# the same with both places used: it waits for its turn, no place idles
TURN = dict(reqs=2, tokens=2, resident=4, throttled=0, waiting=1, waiting_ready=1, yielded=0, kv_free=0, ready_blocks=20)


def steps_of(kinds: list[dict], t0_ns: int, step_ns: int = STEP_NS) -> np.ndarray:
    arr = np.zeros(len(kinds), dtype=STEP_DTYPE)
    for i, k in enumerate(kinds):
        arr[i] = (t0_ns + i * step_ns, k["reqs"], k["tokens"], k["resident"], k["throttled"], k["waiting"],
                  k["waiting_ready"], k["yielded"], k["kv_free"], k["ready_blocks"])
    return arr


def events(n: int, t0_ns: int = 10**12, kind: int = KIND_DISPATCH) -> np.ndarray:
    arr = np.zeros(n, dtype=RECORD_DTYPE)
    arr["t_ns"] = t0_ns + np.arange(n) * 1_000_000
    arr["kind"], arr["req"], arr["user"], arr["count"] = kind, 0, 1, 1
    return arr


# ---- the file format -------------------------------------------------------------------------


def test_the_refuse_kind_is_named():
    assert KIND_REFUSE == 4 and KIND_NAMES[KIND_REFUSE] == "refuse"


def test_a_version_1_file_still_reads_without_steps(tmp_path):
    path = tmp_path / "v1.rbev"
    recs = events(10)
    with EventFileWriter(path, {"pid": 1}, version=1) as w:
        w.intern("req-0"), w.intern("user-a")
        w.write_block(recs)
        with pytest.raises(ValueError):
            w.write_steps(steps_of([OK], 10**12))
    assert path.read_bytes()[8:12] == struct.pack("<I", 1)
    ev = read_engine_events(path)
    assert ev.version == 1 and not ev.truncated
    assert np.array_equal(ev.records, recs) and ev.strings == ["req-0", "user-a"]
    assert ev.steps.dtype == STEP_DTYPE and len(ev.steps) == 0


def test_a_step_block_in_a_version_1_file_is_corrupt(tmp_path):
    path = tmp_path / "v1.rbev"
    with EventFileWriter(path, {}, version=1) as w:
        w.write_block(events(2))
    with open(path, "ab") as f:
        f.write(struct.pack("<8sII", b"RBEVSTP1", 0, 1) + steps_of([OK], 0).tobytes())
    with pytest.raises(EventFileError, match="corrupt block header"):
        read_engine_events(path)


def test_version_2_with_interleaved_blocks_reads_back_identically(tmp_path):
    path = tmp_path / "v2.rbev"
    recs = events(30)
    recs[5]["kind"] = KIND_REFUSE
    steps = steps_of([OK, SLOT, PLACE, KV_SHORT] * 5, 10**12)
    with EventFileWriter(path, META, version=2) as w:
        w.intern("req-0"), w.intern("user-a")
        w.write_steps(steps[:3])
        w.write_block(recs[:10])
        w.write_block(recs[10:10])  # an empty block
        w.write_steps(steps[3:3])  # an empty step block
        w.write_steps(steps[3:11])
        w.intern("req-1")
        w.write_block(recs[10:])
        w.write_steps(steps[11:])
    ev = read_engine_events(path)
    assert ev.version == 2 and not ev.truncated and ev.meta == META
    assert np.array_equal(ev.records, recs) and np.array_equal(ev.steps, steps)
    assert ev.strings == ["req-0", "user-a", "req-1"]
    assert ev.of_kind(KIND_REFUSE)["t_ns"].tolist() == [recs[5]["t_ns"]]


def test_a_step_record_is_44_little_endian_bytes_in_its_documented_order(tmp_path):
    """Byte for byte what the engine's recorder writes: struct '<qIIIIIIIII' after the 16-byte header."""
    path = tmp_path / "v2.rbev"
    meta = json.dumps({"pid": 7}).encode()
    body = struct.pack("<qIIIIIIIII", 123456789, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    path.write_bytes(struct.pack("<8sII", b"RBEVFILE", 2, len(meta)) + meta
                     + struct.pack("<8sII", b"RBEVSTP1", 0, 1) + body)
    ev = read_engine_events(path)
    assert STEP_DTYPE.itemsize == 44 and len(ev.records) == 0
    assert ev.steps.tolist() == [(123456789, 1, 2, 3, 4, 5, 6, 7, 8, 9)]
    assert list(STEP_DTYPE.names) == ["t_ns", "reqs", "tokens", "resident", "throttled", "waiting", "waiting_ready",
                                      "yielded", "kv_free", "ready_blocks"]
    with EventFileWriter(tmp_path / "w.rbev", {"pid": 7}, version=2) as w:
        w.write_steps(ev.steps)
    assert (tmp_path / "w.rbev").read_bytes() == path.read_bytes()


@pytest.mark.parametrize("cut", [7, 40, 85])  # into the last step block's records (104 bytes in all), its header
def test_a_truncated_last_step_block_is_dropped_and_said(tmp_path, cut):
    path = tmp_path / "v2.rbev"
    steps = steps_of([OK] * 6, 10**12)
    with EventFileWriter(path, META) as w:
        w.write_block(events(4))
        w.write_steps(steps[:4])
        w.write_steps(steps[4:])  # 16 + 80 bytes
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - cut)
    ev = read_engine_events(path)
    assert ev.truncated and len(ev.records) == 4
    assert np.array_equal(ev.steps, steps[:4])


def test_a_step_block_with_its_reserved_field_set_is_corrupt(tmp_path):
    path = tmp_path / "v2.rbev"
    with EventFileWriter(path, {}) as w:
        w.write_block(events(1))
    with open(path, "ab") as f:
        f.write(struct.pack("<8sII", b"RBEVSTP1", 3, 1) + steps_of([OK], 0).tobytes())
    with pytest.raises(EventFileError, match="reserved field 3"):
        read_engine_events(path)


# ---- the figures -----------------------------------------------------------------------------


def test_each_condition_alone():
    cases = {
        "ok": (OK, False, False),
        "slot": (SLOT, True, True),
        # every place used: the ready request could not have run in this step whoever held the slots
        "places full": (dict(SLOT, reqs=2, tokens=2), False, False),
        "place": (PLACE, False, True),
        "kv short": (KV_SHORT, False, False),
        # a place idle with nothing throttled, a free slot and KV for the smallest ready request: room
        "room": (dict(KV_SHORT, kv_free=20), False, True),
        # ... but one block short of it: the KV, not the limiter
        "one block short": (dict(KV_SHORT, kv_free=19), False, False),
        # the whole token budget used: nothing more could be scheduled
        "tokens full": (dict(SLOT, tokens=64), False, False),
        # nothing ready waits: the throttled may keep their slots
        "none ready": (dict(SLOT, waiting_ready=0), False, False),
    }
    steps = steps_of([c[0] for c in cases.values()], 0)
    slot, place = violations(steps, LIMITS)
    for i, (name, (_, want_slot, want_place)) in enumerate(cases.items()):
        assert (bool(slot[i]), bool(place[i])) == (want_slot, want_place), name


def test_runs_of_consecutive_steps():
    starts, lengths = runs_of(np.array([1, 1, 0, 1, 0, 0, 1, 1, 1], dtype=bool))
    assert starts.tolist() == [0, 3, 6] and lengths.tolist() == [2, 1, 3]
    assert [x.tolist() for x in runs_of(np.zeros(3, dtype=bool))] == [[], []]


def test_the_longest_run_is_timed_to_the_step_that_ended_it():
    t0 = 10**12
    steps = steps_of([OK, SLOT, OK, SLOT, PLACE, SLOT, OK, SLOT, SLOT], t0)
    f = phase_figures(steps, LIMITS, start_ns=t0 - 1_000_000)
    assert (f["steps"], f["violating"], f["slot"], f["place"], f["runs"], f["long_runs"]) == (9, 6, 5, 6, 3, 2)
    assert f["longest_run_steps"] == 3
    assert f["longest_run_ns"] == 3 * STEP_NS and f["longest_run_start_ns"] == 1_000_000 + 3 * STEP_NS
    # a run that ends the phase: to the engine's next step, else to its own last step
    last = phase_figures(steps[6:], LIMITS, start_ns=t0)
    assert last["longest_run_steps"] == 2 and last["longest_run_ns"] == STEP_NS
    assert phase_figures(steps[6:], LIMITS, t0, next_t_ns=t0 + 20 * STEP_NS)["longest_run_ns"] == 13 * STEP_NS


def test_capacities_come_from_the_header():
    assert StepLimits.from_meta(META) == LIMITS
    assert StepLimits.from_meta(dict(META, max_num_active_seqs=None)).max_num_active_seqs == 4
    why = StepLimits.from_meta({k: v for k, v in META.items() if k != "num_kv_blocks"})
    assert isinstance(why, str) and "num_kv_blocks" in why


# ---- the check on run folders ----------------------------------------------------------------


def _add_steps(run_dir, engine: str, kinds: list[dict], *, meta: dict | None = None, offset_ns: int = 0,
               phase_index: int = 0) -> None:
    """Rewrite the engine's event file as version 2 with these step records, one step every STEP_NS from
    ``offset_ns`` after the start of phase ``phase_index``, the step blocks interleaved with the events."""
    path = run_dir / "engines" / engine / "events.rbev"
    phase = json.loads((run_dir / "scenarios.json").read_text())[phase_index]
    ev = read_engine_events(path)
    steps = steps_of(kinds, phase["start_ns"] + offset_ns)
    half = len(ev.records) // 2
    with EventFileWriter(path, {**ev.meta, **(META if meta is None else meta),
                                "default_tps": ev.meta["default_tps"], "user_tps": ev.meta["user_tps"]}) as w:
        for s in ev.strings:
            w.intern(s)
        w.write_steps(steps[:2])
        w.write_block(ev.records[:half])
        w.write_steps(steps[2:])
        w.write_block(ev.records[half:])


def _work_checks(run_dir, th: Thresholds | None = None):
    run = load_run(run_dir)
    return [c for c in build_checks(run, summarize_run(run), th or Thresholds()) if c.name == "work-conservation"]


def test_three_consecutive_slot_violations_fail(tmp_path):
    run_dir = one_phase_run(tmp_path / "run")
    _add_steps(run_dir, "patched-sync", [OK] * 5 + [SLOT] * 3 + [OK] * 5, offset_ns=10_000_000)
    [check] = _work_checks(run_dir)
    assert check.passed is False and check.figure == 3 and check.threshold == 1
    assert "3 of 13 steps" in check.explanation and "3 slot" in check.explanation and "3 place" in check.explanation
    assert "longest run 3 step(s), 15.0 ms, from 0.035 s into the phase" in check.explanation
    # a looser threshold lets it pass
    [loose] = _work_checks(run_dir, Thresholds(work_conservation_max_run_steps=3))
    assert loose.passed is True


def test_one_isolated_violating_step_passes(tmp_path):
    """The step in which a budget flips: a single violating step between conserving ones."""
    run_dir = one_phase_run(tmp_path / "run")
    _add_steps(run_dir, "patched-sync", [OK, OK, SLOT, OK, PLACE, OK, OK, SLOT])
    [check] = _work_checks(run_dir)
    assert check.passed is True and check.figure == 1, check.explanation
    assert "3 of 8 steps" in check.explanation and "0 of 3 runs longer than one step" in check.explanation


def test_a_place_idle_with_throttled_residents_fails(tmp_path):
    run_dir = one_phase_run(tmp_path / "run")
    _add_steps(run_dir, "patched-sync", [OK] * 3 + [PLACE] * 4 + [OK])
    [check] = _work_checks(run_dir)
    assert check.passed is False and check.figure == 4
    assert "4 place" in check.explanation and "0 slot" in check.explanation


def test_nothing_throttled_with_the_kv_short_passes(tmp_path):
    run_dir = one_phase_run(tmp_path / "run")
    _add_steps(run_dir, "patched-sync", [OK] * 2 + [KV_SHORT] * 10 + [OK])
    [check] = _work_checks(run_dir)
    assert check.passed is True and check.figure == 0 and "0 of 13 steps" in check.explanation


def test_steps_outside_the_phase_are_not_judged(tmp_path):
    run_dir = one_phase_run(tmp_path / "run")
    # three slot violations just before the phase starts, then conserving steps inside it
    _add_steps(run_dir, "patched-sync", [SLOT] * 3 + [OK] * 4, offset_ns=-3 * STEP_NS)
    [check] = _work_checks(run_dir)
    assert check.passed is True and "0 of 4 steps" in check.explanation


def test_an_engine_without_step_records_is_said_not_judged(tmp_path):
    run_dir = one_phase_run(tmp_path / "run")  # the simulated engine writes no step blocks
    [check] = _work_checks(run_dir)
    assert check.passed is None and check.explanation.startswith(NOT_RECORDED)
    assert "work conservation not judged" in check.explanation


def test_a_header_without_capacities_is_said_not_judged(tmp_path):
    run_dir = one_phase_run(tmp_path / "run")
    _add_steps(run_dir, "patched-sync", [SLOT] * 5, meta={"max_num_seqs": 4})
    [check] = _work_checks(run_dir)
    assert check.passed is None and "lacks max_num_batched_tokens, num_kv_blocks" in check.explanation


def test_the_limiter_off_engine_s_figures_are_information(tmp_path):
    """The feature-off engine serving the same requests: its figures are the reference, never judged."""
    on = SimEngine("feature-on", default_tps=50)
    off = SimEngine("feature-off", feature=False, default_tps=None)
    users = {"user-a": {"limit_tps": 50, "streams": 2, "backlogged": False}}
    phases = [SimPhase("iso", "isolation", "shared", name, role, users,
                       [SimRequest(f"rb-5e1f0001-{base + i}", "user-a", i, 30) for i in range(2)])
              for base, name, role in ((0, "feature-off", "baseline"), (2, "feature-on", "shared"))]
    run_dir = write_run_folder(tmp_path / "run", [on, off], phases)
    room = dict(KV_SHORT, kv_free=80, ready_blocks=5)  # an active place idle with plainly room: a violation on either engine
    _add_steps(run_dir, "feature-off", [OK] + [room] * 4 + [OK], phase_index=0)
    _add_steps(run_dir, "feature-on", [OK] * 6, phase_index=1)
    checks = {c.engine: c for c in _work_checks(run_dir)}
    assert checks["feature-off"].passed is None and checks["feature-off"].figure == 4
    assert checks["feature-off"].explanation.startswith("limiter off (the reference, not judged)")
    assert "4 place" in checks["feature-off"].explanation
    assert checks["feature-on"].passed is True and checks["feature-on"].figure == 0


def test_the_threshold_is_an_option_and_reaches_the_verdict(tmp_path):
    from typer.testing import CliRunner

    from ratebench.cli import app

    run_dir = one_phase_run(tmp_path / "run")
    _add_steps(run_dir, "patched-sync", [OK] + [SLOT] * 2 + [OK])
    runner = CliRunner()
    assert runner.invoke(app, ["verify-bound", str(run_dir), "--no-plots"]).exit_code == 1
    result = runner.invoke(app, ["verify-bound", str(run_dir), "--no-plots", "--work-conservation-max-run-steps", "2"])
    assert result.exit_code == 0, result.output
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["thresholds"]["work_conservation_max_run_steps"] == 2
    [check] = [c for c in verdict["checks"] if c["name"] == "work-conservation"]
    assert check["passed"] is True and check["figure"] == 2


def test_a_place_left_idle_beside_a_resident_with_budget_counts_as_resident():
    """The patch until this check kept a place for the head of the queue no slot could take: every slot
    held by streams of users with budget waiting on the bench, one place idled (no limit binding). Judged
    apart (work-conservation-places), on synchronous engines only."""
    from dataclasses import replace

    from ratebench.analysis.workcons import left_out

    steps = steps_of([OK, LEFT_OUT, LEFT_OUT, LEFT_OUT, TURN, OK, LEFT_OUT], 10**12)
    assert left_out(steps, LIMITS).tolist() == [False, True, True, True, False, False, True]
    fig = phase_figures(steps, LIMITS, 10**12)
    assert fig["resident"] == 4 and fig["resident_longest_run"] == 3 and fig["resident_judged"]
    assert not left_out(steps, replace(LIMITS, async_scheduling=True)).any()
