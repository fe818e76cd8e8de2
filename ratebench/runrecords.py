"""The run folder's records: client request records (requests.jsonl, :class:`ClientRecord`), scenario
phases (scenarios.json, :class:`PhaseRecord`) and the entries of manifest.json that name the engines and
balancers (:class:`EngineEntry`, :class:`BalancerEntry`). The engines' own event files are
:mod:`ratebench.events`'."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ratebench.events import EventFileError
from ratebench.phasefacts import PhaseFacts
from ratebench.roles import PHASE_MEASURE


# Client request ids: the driver sends ``X-Request-Id: rb-<run>-<n>``; vLLM turns
# it into engine ids like ``cmpl-rb-<run>-<n>-0-1a2b3c4d`` or
# ``chatcmpl-rb-<run>-<n>-1a2b3c4d``, and a request of n > 1 answers into one
# engine request per answer, ``<index>_cmpl-rb-<run>-<n>-0-1a2b3c4d``. This finds
# the client id inside.
CLIENT_ID_RE = re.compile(r"(rb-[0-9a-f]+-[0-9]+)")
_CHILD_RE = re.compile(r"([0-9]+)_")


def client_id_of(engine_request_id: str) -> str | None:
    """The driver's request id embedded in an engine request id, if any; for one answer of a request of
    n > 1 (vLLM's child request ``<index>_<id>``), ``<client id>/<index>`` (``ClientRecord.answers``)."""
    m = CLIENT_ID_RE.search(engine_request_id)
    if not m:
        return None
    child = _CHILD_RE.match(engine_request_id)
    return f"{m.group(1)}/{int(child.group(1))}" if child else m.group(1)


ERROR_INTERRUPTED = "interrupted"  # ClientRecord.error of a stream still open when the run was interrupted


@dataclass
class BalancerEntry:
    """One load balancer of ``manifest.json``'s ``balancers`` (a fleet's HAProxy, ratebench/balancer.py):
    what it fronts and where its files are (written when it starts), its process and how it stopped."""

    kind: str  # "haproxy"
    members: list[str]  # the engines behind it
    config: str  # relative to the run folder
    log_file: str
    user_header: str  # the header user-hash routing reads
    served_by_header: str  # the response header naming the engine that served a request
    endpoints: dict[str, str] | None = None  # routing policy -> URL
    started_monotonic_ns: int | None = None
    stopped_monotonic_ns: int | None = None
    pid: int | None = None
    killed_pids: list[int] = field(default_factory=list)
    exit_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EngineEntry:
    """One engine of ``manifest.json``'s ``engines``: what the run asked of it (written when it starts)
    and what became of it (as it runs and stops). Every writer of a run folder, the runner's engine set
    and the tests' synthetic folders alike, writes these; :mod:`ratebench.analysis.load` reads them
    back (:meth:`from_json`, tolerant of the fields older run folders lack)."""

    kind: str  # "patched" | "stock" | "external"
    feature: bool  # the limiter on
    async_scheduling: bool | None
    default_tps: int | None
    user_tps: dict[str, int] | None
    flags: list[str] | None  # the vllm serve flags (None: a server someone else started)
    # the --scheduling-policy asked ("fcfs" or "priority"; None: not known, a server someone else started
    # or a run folder from before it was recorded)
    scheduling_policy: str | None = None
    events_file: str | None = None  # relative to the run folder
    log_file: str | None = None
    endpoint: str | None = None
    started_monotonic_ns: int | None = None
    ready_monotonic_ns: int | None = None
    stopped_monotonic_ns: int | None = None
    killed_pids: list[int] = field(default_factory=list)
    stock_overlay: bool = False  # stock vLLM through the pristine sources (ratebench.engine)
    cpu_async_overlay: bool = False
    record_events: bool = True
    warm_up: dict[str, Any] | None = None
    pid: int | None = None
    exit_code: int | None = None
    failover_stopped_monotonic_ns: int | None = None  # a fleet member stopped by its failover
    served_model: str | None = None  # an attached server: the model it serves
    cpu_async: dict[str, Any] | None = None  # what the CPU async overlay counted inside the engine
    engine_meta: dict[str, Any] | None = None  # its event file's header, read when it stopped
    events_error: str | None = None  # why that header could not be read
    warning: str | None = None  # the engine ran another scheduling mode than asked
    warnings: list[str] = field(default_factory=list)  # the CPU async overlay's findings
    # "polls": a loop that steps whatever it is given, by construction (the tests' in-process scheduler
    # harness): its waiting is information only (ratebench/analysis/waiting.py)
    loop: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> EngineEntry:
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in entry.items() if k in known}
        data.setdefault("kind", "patched")
        for key, default in (("feature", False), ("async_scheduling", False), ("default_tps", None),
                             ("user_tps", None), ("flags", None)):
            data.setdefault(key, default)
        return cls(**data)


@dataclass
class ClientRecord:
    """What the client saw of one streamed request (one line of ``requests.jsonl``)."""

    client_id: str  # the X-Request-Id sent: rb-<run>-<n>
    scenario: str
    phase: str  # a part of the scenario, e.g. "1-stream", "4-streams", "baseline"
    engine: str  # engine name: the run folder's engines/<engine>/
    user: str | None  # vllm_xargs.output_rate_user sent; None when the field was absent
    api: str  # "completions" or "chat"
    stream_index: int
    max_tokens: int
    ignore_eos: bool
    prompt_tokens: int | None = None
    scheduled_ns: int = 0  # when the driver meant to send it
    sent_ns: int | None = None
    first_token_ns: int | None = None
    done_ns: int | None = None
    chunk_ns: list[int] = field(default_factory=list)  # chunks that carried tokens: arrival time
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    completion_tokens: int | None = None  # final usage.completion_tokens (None: no final usage)
    finish_reason: str | None = None
    error: str | None = None
    http_status: int | None = None
    cancelled: bool = False
    cancel_ns: int | None = None
    openai_user: str | None = None  # the OpenAI "user" field, if the scenario sent one
    spoof: str | None = None  # the channels through which the request named another user, if any
    priority: int = 0  # the request's priority as sent (vLLM acts on it under --scheduling-policy priority)
    # the answer's token ids as streamed (choices[].token_ids, sent with return_token_ids); None when the
    # server sent none (a run folder from before they were recorded, or a server that ignores the field)
    token_ids: list[int] | None = None
    # a greedy answer that parted from the same request's on the limiter-off engine, scored there
    # (ratebench/answerscore.py): per token, [its logprob, the likeliest token's logprob] in that engine's
    # context of this answer's own tokens; scored_on names that engine. None: not scored
    answer_scores: list[list[float]] | None = None
    scored_on: str | None = None
    # a fleet's phase: the fleet's engine name (fleet<K>-<mode>) the request was sent through; ``engine``
    # is then the member engine that served it (the balancer's response header), or the fleet's name
    # when no engine did (refused by the balancer)
    fleet: str | None = None
    # a request of n > 1 answers (parallel sampling): per answer, in index order, what the client saw of it
    # ({"index", "chunk_ns", "chunk_tokens", "completion_tokens", "finish_reason", "token_ids"}: its own
    # usage.completion_tokens counts); the record's own chunk lists are the answers' together and its
    # completion_tokens the final usage's sum. None: one answer
    choices: list[dict[str, Any]] | None = None

    @property
    def streamed_tokens(self) -> int:
        return int(sum(self.chunk_tokens))

    def answers(self) -> list[ClientRecord]:
        """One record per answer, as the analysis joins them to the engine's requests: the record itself for
        a request of one answer; for n > 1, a record per choice, its client id ``<id>/<index>`` (what
        ``client_id_of`` makes of the engine's child request ``<index>_<engine id>``) and its stream index
        ``stream_index * 1000 + index``, with that choice's chunks, tokens, finish reason and token ids and
        the request's times; an error when the final usage is not the choices' sum."""
        if self.choices is None:
            return [self]
        total = sum(int(c.get("completion_tokens") or 0) for c in self.choices)
        error = self.error
        if error is None and self.completion_tokens is not None and self.completion_tokens != total:
            error = (f"the final usage.completion_tokens ({self.completion_tokens}) is not the sum of the "
                     f"{len(self.choices)} answers' ({total})")
        out = []
        for c in self.choices:
            times = list(c.get("chunk_ns") or [])
            out.append(replace(
                self, client_id=f"{self.client_id}/{int(c['index'])}",
                stream_index=self.stream_index * 1000 + int(c["index"]), chunk_ns=times,
                chunk_tokens=list(c.get("chunk_tokens") or []), first_token_ns=times[0] if times else None,
                completion_tokens=None if self.completion_tokens is None else int(c.get("completion_tokens") or 0),
                finish_reason=c.get("finish_reason"), token_ids=c.get("token_ids"), error=error, choices=None))
        return out


def greedy_pair_comparable(a: ClientRecord, b: ClientRecord) -> bool:
    """Whether two records of the same greedy request (on the limiter-on engine and its baseline) are held
    together token for token (answers-intact, and the scoring of answers that part): both ran to
    ``max_tokens`` (``ignore_eos``) and neither was answered with an error."""
    return a.ignore_eos and b.ignore_eos and not a.error and not b.error


def write_client_records(path: str | Path, records: list[ClientRecord]) -> None:
    """Write records as JSONL, atomically."""
    from ratebench._io import atomic_write_bytes
    from dataclasses import asdict

    atomic_write_bytes(path, b"".join(orjson.dumps(asdict(r)) + b"\n" for r in records))


def read_client_records(path: str | Path) -> list[ClientRecord]:
    """Read ``requests.jsonl``; errors name the file and line.

    Each line is parsed in place (a memoryview slice of the file's bytes): no copy of the lines,
    and less fresh memory than one parse of the whole file as an array, which matters at
    millions of chunk times.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EventFileError(f"{path}: cannot read client records ({exc.strerror})") from exc
    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10).tolist()
    if not data.endswith(b"\n"):
        ends.append(len(data))
    view = memoryview(data)
    out: list[ClientRecord] = []
    start = 0
    for lineno, end in enumerate(ends, 1):
        line = view[start:end]
        start = end + 1
        try:
            obj = orjson.loads(line)
            if type(obj) is not dict:
                raise TypeError(f"a JSON {type(obj).__name__}, not an object")
            out.append(ClientRecord(**obj))
        except (ValueError, TypeError) as exc:
            if not bytes(line).strip():
                continue
            raise EventFileError(f"{path}:{lineno}: not a client record ({exc})") from exc
    return out


# ---- scenario phases (scenarios.json) ------------------------------------------------------


class PhaseUser(dict):
    """One user of a phase as ``scenarios.json`` holds it: a JSON object with ``limit_tps``,
    ``streams``, ``backlogged``, ``tier`` and whatever else the scenario recorded (kept as
    written); the properties read it with the defaults of older run folders."""

    @classmethod
    def read(cls, entry: dict[str, Any]) -> PhaseUser:
        """``entry`` as written, its typed keys checked (TypeError, ValueError, AttributeError)."""
        user = cls(entry.items())
        user.limit_tps, user.streams, user.backlogged, user.tier  # noqa: B018 - each must convert
        return user

    @property
    def limit_tps(self) -> int | None:
        return None if self.get("limit_tps") is None else int(self["limit_tps"])

    @property
    def streams(self) -> int:
        return int(self.get("streams", 1))

    @property
    def backlogged(self) -> bool:
        """Its streams always wait for tokens, so the delivery check applies."""
        return bool(self.get("backlogged", False))

    @property
    def tier(self) -> str | None:
        """A mix's tier user: its tier's name."""
        return None if self.get("tier") is None else str(self["tier"])


@dataclass
class PhaseRecord:
    """One entry of ``scenarios.json`` (``docs/run-folder.md``): a phase of a scenario on one
    engine, which users took part and at which limits. The runner writes one as each phase
    ends (:meth:`to_json`); the analysis reads them back (:meth:`from_json`)."""

    scenario: str
    kind: str
    phase: str
    engine: str
    start_ns: int
    end_ns: int
    # user -> its entry; a scenario fills in plain dicts, the reader gives PhaseUser
    users: dict[str, PhaseUser]
    role: str = PHASE_MEASURE
    params: dict[str, Any] = field(default_factory=dict)
    # CPUs in use on average over the phase (CPU-seconds per second): "busy" all processes, "run" this
    # run's (driver and engines), "other" the rest; None when not measured (and in older runs)
    machine_cpu: dict[str, float] | None = None
    # CPU seconds the engine's EngineCore process used over the phase (None: not measured)
    engine_core_cpu_s: float | None = None
    index: int = -1  # its place in scenarios.json (set by the reader; not written)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.scenario, self.phase, self.engine)

    @property
    def label(self) -> str:
        return f"{self.scenario}/{self.phase}@{self.engine}"

    @cached_property
    def facts(self) -> PhaseFacts:
        """What the analysis reads of ``params``, typed (read once, when the phase is done)."""
        return PhaseFacts.read(self.params)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        del doc["index"]
        return doc

    @classmethod
    def from_json(cls, index: int, entry: dict[str, Any]) -> PhaseRecord:
        """Entry ``index`` of scenarios.json; KeyError, TypeError, ValueError or AttributeError
        when it is not a phase."""
        return cls(
            index=index, scenario=str(entry["scenario"]), kind=str(entry.get("kind", "")),
            phase=str(entry["phase"]), engine=str(entry["engine"]),
            start_ns=int(entry.get("start_ns") or 0), end_ns=int(entry.get("end_ns") or 0),
            users={str(name): PhaseUser.read(u) for name, u in entry["users"].items()},
            role=str(entry.get("role", "measure")), params=dict(entry.get("params") or {}),
            machine_cpu=dict(entry["machine_cpu"]) if entry.get("machine_cpu") else None,
            engine_core_cpu_s=entry.get("engine_core_cpu_s"),
        )
