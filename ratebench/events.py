"""The engines' event files, written by the patched vLLM (the run folder's other records, client requests
and scenario phases, are :mod:`ratebench.runrecords`').

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
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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
