"""The run folder's data files: engine event files (written by the patched vLLM), client
request records (requests.jsonl) and scenario phases (scenarios.json, :class:`PhaseRecord`).

Engine event file format ("RBEV", version 3; versions 1 and 2 are read too), written by
``vllm/v1/core/sched/output_rate_events.py`` in the patched engine when the
environment variable ``VLLM_OUTPUT_RATE_EVENTS_FILE`` names a file:

* File header: the 8 bytes ``b"RBEVFILE"``, a little-endian ``u32`` version (3),
  a ``u32`` length L, then L bytes of UTF-8 JSON with the writer's metadata
  (``pid``, ``vllm_version``, ``started_monotonic_ns``, ``started_unix_s``,
  ``default_tps``, ``user_tps`` (object), ``burst_ns``, ``async_scheduling``,
  ``max_num_seqs``, ``max_num_active_seqs``, ``policy``; version 2 adds
  ``max_num_batched_tokens``, ``num_kv_blocks`` (the KV cache's blocks in all) and
  ``block_size``).
* Then blocks of two types, interleaved in file order, each opening with the same
  16-byte header (8 bytes of magic, ``u32``, ``u32``):

  - event blocks, one per flush: ``b"RBEVBLK1"``, ``u32`` S (bytes of new strings),
    ``u32`` R (records), S bytes of UTF-8 JSON array holding the strings first used
    in this block (they extend one string table, indexed from 0 in order of first
    use), then R records of 24 bytes each, numpy dtype :data:`RECORD_DTYPE`::

      t_ns   int64   time.monotonic_ns() when the event happened
      kind   uint8   1 dispatch, 2 emit, 3 finish, 4 refuse (version 2), 5 arrive (version 3)
      reason uint8   finish only: see FINISH_REASONS; else 0
      flags  uint16  reserved, 0
      req    uint32  string-table index of the engine request id
      user   uint32  string-table index of the rate-limit user
      count  uint32  dispatch: 1; emit: new output tokens; finish: total output tokens;
                     refuse: 1; arrive: prompt tokens

    A refuse record is a charge refused because the user was out of budget; its
    ``t_ns`` is the step's clock. An arrive record is a request entering the scheduler
    (``add_request``), on the limiter's clock: from then on it waits until its first
    dispatch (the work-conservation witness, ``analysis/waiting_witness.py``).

  - step blocks (version 2): ``b"RBEVSTP1"``, ``u32`` 0 (reserved), ``u32`` R, then R
    records of 44 bytes each, one per scheduler step, numpy dtype :data:`STEP_DTYPE`::

      t_ns          int64   the step's clock: time.monotonic_ns() at the start of schedule()
      reqs          uint32  requests given tokens this step
      tokens        uint32  tokens scheduled this step
      resident      uint32  requests holding a resident slot after the step (running
                            and parked: throttled, or waiting for a place)
      throttled     uint32  of the resident, those parked because their user is out of budget
      waiting       uint32  requests in the waiting queue after the step
      waiting_ready uint32  of them, those whose user could be charged at t_ns (a user
                            with budget; with the limiter off: all), less those whose
                            structured-output grammar is still being compiled
      yielded       uint32  throttled residents preempted this step for a request of a
                            user with budget
      kv_free       uint32  free KV blocks after the step
      ready_blocks  uint32  KV blocks the smallest waiting request of a user with budget
                            needs for all its tokens (no prefix-cache hit counted, plus
                            the cache's admission watermark); 0 when none waits

A block of either type is written whole with one ``write``; a reader stops at a
truncated last block and says so (``truncated``).

``time.monotonic_ns()`` is one clock for every process on a host, so engine
and client timestamps compare directly.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ratebench.phasefacts import PhaseFacts
from ratebench.roles import PHASE_MEASURE

FILE_MAGIC = b"RBEVFILE"
BLOCK_MAGIC = b"RBEVBLK1"
STEP_BLOCK_MAGIC = b"RBEVSTP1"
FORMAT_VERSION = 3  # what EventFileWriter writes
# what read_engine_events reads (version 1: no step blocks, no refuse records; version 2: no arrive records)
READ_VERSIONS = (1, 2, 3)
ENV_VAR = "VLLM_OUTPUT_RATE_EVENTS_FILE"

# The user of a request that names none (no vllm_xargs output_rate_user): one budget for all of them,
# as the patch names it in its event file.
ANONYMOUS_USER = "__anonymous__"
# The APIs a request is sent through (ClientRecord.api).
APIS = ("completions", "chat")

KIND_DISPATCH = 1
KIND_EMIT = 2
KIND_FINISH = 3
KIND_REFUSE = 4
KIND_ARRIVE = 5
KIND_NAMES = {KIND_DISPATCH: "dispatch", KIND_EMIT: "emit", KIND_FINISH: "finish", KIND_REFUSE: "refuse",
              KIND_ARRIVE: "arrive"}

# Finish reasons, as the patched engine encodes vLLM's RequestStatus.
FINISH_REASONS = {0: "unknown", 1: "stop", 2: "length", 3: "abort", 4: "ignored", 5: "error"}

RECORD_DTYPE = np.dtype(
    [
        ("t_ns", "<i8"),
        ("kind", "u1"),
        ("reason", "u1"),
        ("flags", "<u2"),
        ("req", "<u4"),
        ("user", "<u4"),
        ("count", "<u4"),
    ]
)
assert RECORD_DTYPE.itemsize == 24

# One scheduler step (version 2): what it scheduled and what it left, after the step's refunds.
STEP_DTYPE = np.dtype(
    [
        ("t_ns", "<i8"),  # the step's clock: time.monotonic_ns() read at the start of schedule()
        ("reqs", "<u4"),  # requests given tokens this step
        ("tokens", "<u4"),  # tokens scheduled this step
        ("resident", "<u4"),  # requests holding a resident slot after the step (running + parked)
        ("throttled", "<u4"),  # of the resident, those parked because their user is out of budget
        ("waiting", "<u4"),  # requests in the waiting queue after the step
        ("waiting_ready", "<u4"),  # of them, those whose user could be charged at t_ns (limiter off: all)
        ("yielded", "<u4"),  # throttled residents preempted this step for a request of a user with budget
        ("kv_free", "<u4"),  # free KV blocks after the step
        # KV blocks the smallest waiting request of a user with budget needs (0: none waits)
        ("ready_blocks", "<u4"),
    ]
)
assert STEP_DTYPE.itemsize == 44

_HEADER = struct.Struct("<8sII")  # magic, version or string bytes, length or records


class EventFileError(ValueError):
    """An engine event file that cannot be read: says which file and why."""


@dataclass
class EngineEvents:
    """All events of one engine event file, as parallel numpy arrays."""

    path: Path
    meta: dict
    records: np.ndarray  # RECORD_DTYPE, in file order (time order per writer)
    strings: list[str]
    truncated: bool = False
    # STEP_DTYPE, in file order: the per-step records (empty for a version 1 file)
    steps: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=STEP_DTYPE))
    version: int = FORMAT_VERSION
    _index: dict[str, int] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.records)

    def string_index(self, value: str) -> int | None:
        if self._index is None:
            self._index = {s: i for i, s in enumerate(self.strings)}
        return self._index.get(value)

    def of_kind(self, kind: int) -> np.ndarray:
        return self.records[self.records["kind"] == kind]


def read_engine_events(path: str | Path) -> EngineEvents:
    """Load an engine event file whole (version 1 or 2); fast for millions of events.

    Two passes over the file: block headers only (``pread`` of 16 bytes each), then every
    block's records read straight into one of two preallocated arrays, events and steps (no
    copy of the whole file).
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise EventFileError(f"{path}: cannot read engine event file ({exc.strerror})") from exc
    with f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEADER.size, 0)
        if len(head) < _HEADER.size or head[:8] != FILE_MAGIC:
            raise EventFileError(f"{path}: not a ratebench engine event file (bad magic)")
        _, version, meta_len = _HEADER.unpack(head)
        if version not in READ_VERSIONS:
            raise EventFileError(f"{path}: format version {version}, this ratebench reads versions "
                                 + ", ".join(map(str, READ_VERSIONS)))
        pos = _HEADER.size
        try:
            meta = json.loads(os.pread(fd, meta_len, pos))
        except ValueError as exc:
            raise EventFileError(f"{path}: header metadata is not valid JSON ({exc})") from exc
        pos += meta_len
        # (body start, string bytes (-1: a step block), records), in file order
        blocks: list[tuple[int, int, int]] = []
        total = total_steps = 0
        truncated = False
        while pos < size:
            if size - pos < _HEADER.size:
                truncated = True
                break
            magic, n_str, n_rec = _HEADER.unpack(os.pread(fd, _HEADER.size, pos))
            if magic == BLOCK_MAGIC:
                end = pos + _HEADER.size + n_str + n_rec * RECORD_DTYPE.itemsize
            elif magic == STEP_BLOCK_MAGIC and version >= 2:
                if n_str != 0:
                    raise EventFileError(f"{path}: corrupt step block header at byte {pos} "
                                         f"(reserved field {n_str}, not 0)")
                end = pos + _HEADER.size + n_rec * STEP_DTYPE.itemsize
            else:
                raise EventFileError(f"{path}: corrupt block header at byte {pos}")
            if end > size:
                truncated = True
                break
            if magic == BLOCK_MAGIC:
                blocks.append((pos + _HEADER.size, n_str, n_rec))
                total += n_rec
            else:
                blocks.append((pos + _HEADER.size, -1, n_rec))
                total_steps += n_rec
            pos = end
        strings: list[str] = []
        records = np.empty(total, dtype=RECORD_DTYPE)
        steps = np.empty(total_steps, dtype=STEP_DTYPE)
        raw = memoryview(records.view(np.uint8))
        raw_steps = memoryview(steps.view(np.uint8))
        out = out_steps = 0
        for spos, n_str, n_rec in blocks:
            f.seek(spos)
            if n_str < 0:
                size_rec = n_rec * STEP_DTYPE.itemsize
                if size_rec and f.readinto(raw_steps[out_steps : out_steps + size_rec]) != size_rec:
                    raise EventFileError(f"{path}: file shrank while being read")
                out_steps += size_rec
                continue
            if n_str:
                strings.extend(json.loads(f.read(n_str)))
            size_rec = n_rec * RECORD_DTYPE.itemsize
            if size_rec and f.readinto(raw[out : out + size_rec]) != size_rec:
                raise EventFileError(f"{path}: file shrank while being read")
            out += size_rec
    return EngineEvents(path=path, meta=meta, records=records, strings=strings, truncated=truncated, steps=steps,
                        version=version)


class EventFileWriter:
    """A writer of the same format, for tests and synthetic traces.

    The engine has its own writer inside the patch (it cannot import ratebench);
    tests check that both produce files this module reads identically.
    """

    def __init__(self, path: str | Path, meta: dict | None = None, *, version: int = FORMAT_VERSION) -> None:
        """``version``: 2 (the current format) or 1 (no step blocks, as older engines wrote)."""
        if version not in READ_VERSIONS:
            raise ValueError(f"format version {version}: this writer writes versions {READ_VERSIONS}")
        self.version = version
        self._f = open(path, "wb")
        meta_bytes = json.dumps(meta or {}).encode()
        self._f.write(_HEADER.pack(FILE_MAGIC, version, len(meta_bytes)) + meta_bytes)
        self._ids: dict[str, int] = {}
        self._new: list[str] = []

    def intern(self, value: str) -> int:
        idx = self._ids.get(value)
        if idx is None:
            idx = self._ids[value] = len(self._ids)
            self._new.append(value)
        return idx

    def write_block(self, records: np.ndarray) -> None:
        """Write records (RECORD_DTYPE; req/user already interned) as one block."""
        strings = json.dumps(self._new).encode() if self._new else b""
        self._new = []
        body = np.ascontiguousarray(records, dtype=RECORD_DTYPE).tobytes()
        self._f.write(_HEADER.pack(BLOCK_MAGIC, len(strings), len(records)) + strings + body)

    def write_steps(self, steps: np.ndarray) -> None:
        """Write step records (STEP_DTYPE) as one step block (version 2 only)."""
        if self.version < 2:
            raise ValueError("step blocks are version 2 of the format; this file is version 1")
        body = np.ascontiguousarray(steps, dtype=STEP_DTYPE).tobytes()
        self._f.write(_HEADER.pack(STEP_BLOCK_MAGIC, 0, len(steps)) + body)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "EventFileWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
