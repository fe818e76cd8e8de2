"""Run a workload through the real patched scheduler and write it as a run folder.

The scheduler is the real patched ``Scheduler`` / ``AsyncScheduler`` of
``tests/sched_harness.py`` with a hand-driven clock; the output is a run folder
as ``ratebench run`` writes it (docs/run-folder.md), so ``verify_run`` checks it
exactly as it checks a real run.

Times, all on the fake clock, so that engine and client sides agree:

* dispatch: the events the patch's own recorder writes (it stamps them with the
  limiter's clock, which is the fake clock); their user is rewritten to the user
  the client sent, so a mutant that charges someone else is still judged
  against the real user;
* emit: the step's dispatch time plus that step's length (the model ran in
  between), with the tokens ``update_from_output`` returned for the request;
* finish: at the emit of the last token, with its reason and total;
* client chunks: emit time plus a small delay (2 to 2.5 ms), the stream's end at its last chunk.

The client side is derived from the harness's own emit stamps, so the two-witness checks
(``ratebench/analysis/witness.py``: witness-order, witness-emits) hold here by construction: they
check that this module's two sides agree, not the patch's recorder (which writes only the dispatch
events kept here). bound-client is judged as on a real run; on these truthful emits it fails only
where bound-emit does.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ratebench._io import atomic_write_json
from ratebench.manifest import Manifest
from ratebench.events import (
    ENV_VAR,
    KIND_ARRIVE,
    KIND_DISPATCH,
    KIND_REFUSE,
    KIND_EMIT,
    KIND_FINISH,
    RECORD_DTYPE,
    EventFileWriter,
    read_engine_events,
)
from ratebench.runrecords import EngineEntry, ClientRecord, write_client_records
from sched_harness import NS_PER_S, Engine, FakeClock, create_scheduler, make_request

ENGINE = "patched-sched"
RUN_ID = "3a7c0de5"
CLIENT_DELAY_NS = 2_000_000  # engine emit to the client's chunk
# vLLM FinishReason (STOP 0, LENGTH 1, ABORT 2, ERROR 3) -> engine event reason code
_FINISH_CODES = {0: 1, 1: 2, 2: 3, 3: 5}
_FINISH_NAMES = {0: "stop", 1: "length", 2: "abort", 3: "error"}


@dataclass
class Stream:
    """One client stream: ``requests`` requests one after the other (closed loop)."""

    user: str
    max_tokens: int
    prompt_len: int = 10
    requests: int = 1
    start_s: float = 0.0  # after the phase starts
    pause_s: float = 0.0  # from one request's last token to sending the next
    priority: int = 0  # the request's priority (the PRIORITY policy: lower first)
    n: int = 1  # answers per request: n > 1 adds one request per answer, <index>_<id>, as vLLM's frontend does


@dataclass
class Phase:
    """One scenario phase: its streams, and the users whose delivery is checked."""

    name: str
    streams: list[Stream]
    backlogged: set[str] = field(default_factory=set)
    role: str = "measure"
    scenario: str = "mutants"
    kind: str = "seed-experiment"
    max_s: float = 60.0  # the clients give up after this much fake time (errors: the verdict fails)
    params: dict = field(default_factory=dict)  # more of scenarios.json's params (place_share, stream_wait)
    tiers: dict[str, str] = field(default_factory=dict)  # user -> its tier (a mix's users)


@dataclass
class Workload:
    """Limits, scheduler settings and phases; phases run one after the other on one scheduler."""

    default_tps: int
    user_tps: dict[str, int]
    phases: list[Phase]
    scheduler_kw: dict = field(default_factory=dict)  # create_scheduler() arguments
    idle_s: float = 0.5  # clock time between phases (the engine idles)

    def limit_of(self, user: str) -> int:
        return self.user_tps.get(user, self.default_tps)


class Mutant:
    """A limiter change applied to one scheduler; the base class changes nothing (the patch as shipped)."""

    name = "correct"
    # The events name the user the client sent (a mutant that charges someone else is judged against
    # the real user), unless the mutant is about whom the engine charges: then they name that user.
    events_name_charged_user = False

    def apply(self, scheduler) -> None:
        """Change the scheduler or its limiter in place (monkeypatching the instance)."""

    def on_request(self, request) -> None:
        """Change a request before it is added."""


@dataclass
class HarnessRun:
    """What a harness run produced, besides the folder."""

    run_dir: Path
    steps: int
    engine: Engine


class _Recorder:
    """Collects emit/finish events and client chunks from update_from_output."""

    def __init__(self, scheduler, clock: FakeClock, is_async: bool, rng: random.Random) -> None:
        self.clock = clock
        self.rng = rng
        self.step_of: dict[int, tuple[int, int]] = {}  # id(SchedulerOutput) -> (t_ns, step_ns)
        self.current_step_ns = 0
        self.emits: list[tuple[int, int, str, int, int]] = []  # (t, kind, req, reason, count)
        self.chunks: dict[str, list[tuple[int, int]]] = {}
        self.finish: dict[str, tuple[int, str, int]] = {}  # req -> (t, reason, total)
        self.timed_out: set[str] = set()  # requests the client gave up on (the phase's max_s)
        self.requests: dict[str, object] = {}  # every request added (the scheduler forgets finished ones)
        # a step's duration from what it scheduled (run_workload's step_s_per_token), and the engine whose
        # clock it advances; None: the step time the driver set
        self.step_cost = None
        self.engine: Engine | None = None
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def recording_schedule():
            out = schedule()
            if self.step_cost is not None:
                self.current_step_ns = self.step_cost(out)
                self.engine.step_ns = self.current_step_ns
            self.step_of[id(out)] = (clock(), self.current_step_ns)
            return out

        def recording_update(scheduler_output, model_runner_output):
            outputs = update(scheduler_output, model_runner_output)
            t0, step_ns = self.step_of.pop(id(scheduler_output))
            t_emit = t0 + step_ns
            for eco in (o for outs in outputs.values() for o in outs.outputs):
                n = len(eco.new_token_ids)
                if n:
                    self.emits.append((t_emit, KIND_EMIT, eco.request_id, 0, n))
                    delay = CLIENT_DELAY_NS + self.rng.randrange(0, 500_000)
                    self.chunks.setdefault(eco.request_id, []).append((t_emit + delay, n))
                if eco.finish_reason is not None:
                    code = int(eco.finish_reason)
                    total = self.requests[eco.request_id].num_output_tokens
                    self.emits.append((t_emit, KIND_FINISH, eco.request_id, _FINISH_CODES.get(code, 0), total))
                    self.finish[eco.request_id] = (t_emit, _FINISH_NAMES.get(code, "unknown"), total)
            return outputs

        scheduler.schedule = recording_schedule
        scheduler.update_from_output = recording_update


def run_workload(
    run_dir: str | Path,
    workload: Workload,
    *,
    mutant: Mutant | None = None,
    async_scheduling: bool = False,
    step_s: float = 0.005,
    step_jitter: float = 0.0,
    seed: int = 0,
    step_s_per_token: float = 0.0,
) -> HarnessRun:
    """Drive the workload through the real scheduler (with ``mutant`` applied) and write a run folder.

    ``step_jitter``: each step lasts ``step_s * uniform(1 - j, 1 + j)``. ``step_s_per_token``: each step
    lasts ``step_s`` plus this much per token it scheduled, as on a CPU, where a 256-token prompt chunk
    makes a step ten times a decode step's length (a GPU's steps cost about the same whatever they
    carry: the default, 0); with it, ``step_jitter`` is not applied.
    """
    run_dir = Path(run_dir)
    (run_dir / "engines" / ENGINE).mkdir(parents=True, exist_ok=True)
    mutant = mutant or Mutant()
    rng = random.Random(seed)
    clock = FakeClock()
    with tempfile.TemporaryDirectory() as tmp:
        raw_events = Path(tmp) / "raw.rbev"
        old = os.environ.get(ENV_VAR)
        os.environ[ENV_VAR] = str(raw_events)
        try:
            scheduler = create_scheduler(
                default_tps=workload.default_tps, user_tps=workload.user_tps or None, clock=clock,
                async_scheduling=async_scheduling, **workload.scheduler_kw,
            )
        finally:
            if old is None:
                del os.environ[ENV_VAR]
            else:
                os.environ[ENV_VAR] = old
        mutant.apply(scheduler)
        engine = Engine(scheduler, clock, step_s=step_s)
        rec = _Recorder(scheduler, clock, engine.is_async, rng)
        if step_s_per_token:
            rec.engine = engine
            rec.step_cost = lambda out: round(
                (step_s + step_s_per_token * out.total_num_scheduled_tokens) * NS_PER_S)
        client, scen, user_of_req, steps = _drive(engine, rec, workload, mutant, step_s, step_jitter, rng)
        scheduler.shutdown()
        raw = read_engine_events(raw_events)
    # vLLM's CPU platform resets scheduler_config.async_scheduling, so the recorder's header says
    # False; the scheduler class is what decides here.
    raw.meta["async_scheduling"] = engine.is_async
    if mutant.events_name_charged_user:
        user_of_req = {req: rec.requests[req].output_rate_user for req in user_of_req}
    _write_events(run_dir, raw, rec, user_of_req)
    _write_client_side(run_dir, workload, client, scen, rec, async_scheduling, mutant)
    return HarnessRun(run_dir, steps, engine)


def _drive(engine: Engine, rec: _Recorder, workload: Workload, mutant: Mutant, step_s: float,
           step_jitter: float, rng: random.Random):
    clock = engine.clock
    scheduler = engine.scheduler
    n_request = 0
    client: list[dict] = []  # per request: what the client record needs
    scen: list[dict] = []
    user_of_req: dict[str, str] = {}
    steps = 0
    for phase in workload.phases:
        start_ns = clock()
        deadline = start_ns + round(phase.max_s * NS_PER_S)
        # per stream: requests still to send, the request in flight
        todo = [s.requests for s in phase.streams]
        in_flight: list[str | None] = [None] * len(phase.streams)
        phase_requests: list[str] = []
        while True:
            now = clock()
            # clients ready in the same step race: they reach the engine in random order
            for i in rng.sample(range(len(phase.streams)), len(phase.streams)):
                s = phase.streams[i]
                if todo[i] == 0 or now < start_ns + round(s.start_s * NS_PER_S):
                    continue
                if in_flight[i] is not None:
                    done = [rec.finish.get(r) for r in in_flight[i]]
                    if None in done or now < max(d[0] for d in done) + round(s.pause_s * NS_PER_S):
                        continue
                n_request += 1
                client_id = f"rb-{RUN_ID}-{n_request}"
                req_id = f"cmpl-{client_id}-0-{rng.getrandbits(32):08x}"
                # a request of n answers: vLLM's frontend adds one engine request per answer, <index>_<id>
                ids = [req_id] if s.n == 1 else [f"{k}_{req_id}" for k in range(s.n)]
                for child in ids:
                    request = make_request(child, user=s.user, prompt_len=s.prompt_len, max_tokens=s.max_tokens,
                                           arrival_time=now / NS_PER_S, priority=s.priority)
                    mutant.on_request(request)
                    engine.add(request)
                    rec.requests[child] = request
                    user_of_req[child] = s.user
                todo[i] -= 1
                in_flight[i] = ids
                phase_requests.extend(ids)
                client.append(dict(client_id=client_id, req_ids=ids, phase=phase, user=s.user, stream_index=i,
                                   max_tokens=s.max_tokens, prompt_tokens=s.prompt_len, sent_ns=now,
                                   priority=s.priority))
            if not any(todo) and all(r in rec.finish for r in phase_requests):
                break
            if now >= deadline:
                # The clients give up (as ratebench's driver does at its timeout): the requests still
                # unanswered are aborted and recorded as errors, which the verifier fails
                # (reconciliation: answered with an error), and the next phase starts.
                from vllm.v1.request import RequestStatus

                stuck = [r for r in phase_requests if r not in rec.finish]
                scheduler.finish_requests(stuck, RequestStatus.FINISHED_ABORTED)
                for r in stuck:
                    rec.finish[r] = (now, "abort", sum(n for _, n in rec.chunks.get(r, [])))
                    rec.timed_out.add(r)
                break
            engine.step_ns = round(step_s * NS_PER_S * rng.uniform(1 - step_jitter, 1 + step_jitter))
            rec.current_step_ns = engine.step_ns
            engine.step()
            steps += 1
        engine.drain()
        end_ns = clock()
        users = sorted({s.user for s in phase.streams})
        scen.append({
            "scenario": phase.scenario, "kind": phase.kind, "phase": phase.name, "engine": ENGINE,
            "start_ns": start_ns, "end_ns": end_ns, "role": phase.role,
            "users": {u: {"limit_tps": workload.limit_of(u), "streams": sum(s.n for s in phase.streams if s.user == u),
                          "backlogged": u in phase.backlogged,
                          **({"tier": phase.tiers[u]} if u in phase.tiers else {})} for u in users},
            "params": {"max_tokens": max(s.max_tokens for s in phase.streams), "ignore_eos": True,
                       "prompt_tokens": max(s.prompt_len for s in phase.streams), "harness": True,
                       **phase.params},
        })
        clock.advance_s(workload.idle_s)
        assert not scheduler.has_unfinished_requests()
    return client, scen, user_of_req, steps


def _write_events(run_dir: Path, raw, rec: _Recorder, user_of_req: dict[str, str]) -> None:
    """Dispatch, refuse and arrive events of the patch's recorder (fake-clock times) plus harness-timed emits
    and finishes."""
    d = raw.records[np.isin(raw.records["kind"], (KIND_DISPATCH, KIND_REFUSE, KIND_ARRIVE))]
    rows = [(int(r["t_ns"]), int(r["kind"]), raw.strings[r["req"]], 0, int(r["count"])) for r in d]
    rows += rec.emits
    rows.sort(key=lambda r: r[0])  # stable: a step's dispatches before its emits at equal times
    with EventFileWriter(run_dir / "engines" / ENGINE / "events.rbev", raw.meta) as w:
        arr = np.zeros(len(rows), dtype=RECORD_DTYPE)
        for i, (t, kind, req, reason, count) in enumerate(rows):
            arr[i] = (t, kind, reason, 0, w.intern(req), w.intern(user_of_req[req]), count)
        for i in range(0, max(len(arr), 1), 4096):
            w.write_block(arr[i:i + 4096])
        if len(raw.steps):
            w.write_steps(raw.steps)


def _write_client_side(run_dir: Path, workload: Workload, client: list[dict], scen: list[dict], rec: _Recorder,
                       async_scheduling: bool, mutant: Mutant) -> None:
    records = []
    for c in client:
        ids = c["req_ids"]
        per = [rec.chunks.get(r, []) for r in ids]
        chunks = sorted((x for p in per for x in p), key=lambda x: x[0])
        fins = [rec.finish[r] for r in ids]
        t_fin, reason, total = max(f[0] for f in fins), fins[-1][1], sum(f[2] for f in fins)
        phase: Phase = c["phase"]
        # several answers: each its own chunks and total, the request's the answers' together
        choices = None if len(ids) == 1 else [
            {"index": k, "chunk_ns": [t for t, _ in p], "chunk_tokens": [n for _, n in p], "completion_tokens": f[2],
             "finish_reason": f[1], "token_ids": None} for k, (p, f) in enumerate(zip(per, fins))]
        records.append(ClientRecord(
            client_id=c["client_id"], scenario=phase.scenario, phase=phase.name, engine=ENGINE, user=c["user"],
            api="completions", stream_index=c["stream_index"], max_tokens=c["max_tokens"], ignore_eos=True,
            prompt_tokens=c["prompt_tokens"], scheduled_ns=c["sent_ns"], sent_ns=c["sent_ns"],
            first_token_ns=chunks[0][0] if chunks else None, done_ns=chunks[-1][0] if chunks else t_fin,
            chunk_ns=[t for t, _ in chunks], chunk_tokens=[n for _, n in chunks], completion_tokens=total,
            finish_reason=reason, http_status=200, priority=c["priority"],
            error=(f"no answer after the phase's {phase.max_s} s of fake time (the client gave up)"
                   if any(r in rec.timed_out for r in ids) else None),
            choices=choices,
        ))
    (run_dir / "engines" / ENGINE / "engine.log").write_text(
        f"in-process patched scheduler (tests/sched_harness.py), limiter: {mutant.name}\n")
    engine = EngineEntry(
        kind="patched", feature=True, async_scheduling=async_scheduling,
        default_tps=workload.default_tps, user_tps=dict(workload.user_tps),
        flags=["--default-user-output-tokens-per-second", str(workload.default_tps)]
        + [f"{k}={v}" for k, v in sorted(workload.scheduler_kw.items())],
        events_file=f"engines/{ENGINE}/events.rbev", log_file=f"engines/{ENGINE}/engine.log",
        # the harness steps every step_s of fake time whatever the scheduler gave it, so while every user
        # waits its loop makes an empty step every few milliseconds: a polling loop by construction, whose
        # waiting (wait-steps, wait-cpu) is information only (ratebench/analysis/waiting.py, LOOP_POLLS)
        loop="polls",
    )
    write_run_files(run_dir, ENGINE, engine, scen, records, profile_name="sched-harness",
                    machine={"hostname": "harness", "cpu": "fake clock", "cpus": 1, "gpu": None,
                             "platform": "in-process"})


def write_run_files(run_dir: Path, engine_name: str, engine: EngineEntry | dict, scenarios: list[dict],
                    records: list[ClientRecord], *, profile_name: str, machine: dict | None = None) -> None:
    """scenarios.json, requests.jsonl and a manifest (state "complete") of one engine's run folder."""
    atomic_write_json(run_dir / "scenarios.json", scenarios)
    write_client_records(run_dir / "requests.jsonl", records)
    entry = engine if isinstance(engine, EngineEntry) else EngineEntry.from_json(engine)
    Manifest.synthetic(run_dir, run_id=RUN_ID, profile_name=profile_name, engines={engine_name: entry},
                       started_monotonic_ns=scenarios[0]["start_ns"], ended_monotonic_ns=scenarios[-1]["end_ns"],
                       machine=machine)
