"""Request traces: one streamed request per JSONL line, replayed by the ``trace`` scenario.

The format is documented in ``docs/trace.md``. A line::

    {"at_s": 0.25, "user": "user-a", "prompt": 64, "max_tokens": 40}

``at_s`` is the arrival offset from the start of the phase (s), ``user`` the rate-limit
user (null: none sent, the request is ``__anonymous__``), ``prompt`` a token count or a
text, then the optional ``cancel_after_tokens``, ``cancel_after_s``, ``eos`` (true: a real
EOS may end the answer), ``prefix_group`` with ``prefix_tokens`` (requests of one group
share a common prefix of that many tokens) and ``api`` ("completions" | "chat").

Reading refuses unknown fields and malformed values with the file, the line and what was
expected (:class:`TraceError`); :func:`trace_from_records` turns the client records of an
earlier run (``requests.jsonl``) into a trace.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ratebench.runrecords import ClientRecord
from ratebench.events import ANONYMOUS_USER, APIS

TRACE_SUFFIX = ".jsonl"


class TraceError(ValueError):
    """A trace that cannot be replayed: names the file, the line (0: the file) and what was expected."""

    def __init__(self, path: Path | str, line: int, field: str, expected: str, got: Any = None, *,
                 has_got: bool = True):
        self.path, self.line, self.field, self.expected = str(path), line, field, expected
        self.got, self.has_got = got, has_got
        where = f"line {line}" if line else "(file)"
        msg = f"{path}: {where}" + (f": {field}" if field else "") + f": expected {expected}"
        if has_got:
            msg += f", got {got!r}"
        super().__init__(msg)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    at_s: float  # arrival offset from the start of the phase
    user: str | None  # None: no output_rate_user (the engine's __anonymous__)
    prompt: int | str  # a token count, or the prompt text
    max_tokens: int
    cancel_after_tokens: int | None = None
    cancel_after_s: float | None = None
    eos: bool = False  # true: a real EOS may end the answer (ignore_eos false)
    prefix_group: str | None = None
    prefix_tokens: int | None = None  # the group's shared prefix length (with prefix_group)
    api: str = "completions"
    line: int = 0  # where it came from in its file (0: made in memory); not written
    # a closed loop (made by a mix, not written): at most this many of the user's requests open at
    # once, each sent at_s after one of them ends, in list order (None: sent at_s after the start)
    loop_streams: int | None = None

    def expected_tokens(self) -> int | None:
        """The output tokens it receives at most before it ends, when known (None: a real EOS may end it)."""
        if self.eos:
            return None
        return min(self.max_tokens, self.cancel_after_tokens or self.max_tokens)

    def to_json(self) -> dict[str, Any]:
        """Its line, without the fields at their defaults."""
        out: dict[str, Any] = {"at_s": self.at_s, "user": self.user, "prompt": self.prompt,
                               "max_tokens": self.max_tokens}
        for key in ("cancel_after_tokens", "cancel_after_s", "prefix_group", "prefix_tokens"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.eos:
            out["eos"] = True
        if self.api != "completions":
            out["api"] = self.api
        return out


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# field -> (check, what it must be, required)
_FIELDS: dict[str, tuple[Any, str, bool]] = {
    "at_s": (lambda v: _num(v) and v >= 0, "an arrival offset in seconds, a number >= 0", True),
    "user": (lambda v: v is None or (isinstance(v, str) and v != "" and v != ANONYMOUS_USER),
             "a user name, or null for a request without one (not \"__anonymous__\")", False),
    "prompt": (lambda v: _pos_int(v) or (isinstance(v, str) and v != ""),
               "a prompt length in tokens (a positive integer) or the prompt text (a non-empty string)", True),
    "max_tokens": (_pos_int, "a positive integer", True),
    "cancel_after_tokens": (lambda v: v is None or _pos_int(v), "a positive integer or null", False),
    "cancel_after_s": (lambda v: v is None or (_num(v) and v > 0), "a positive number of seconds or null", False),
    "eos": (lambda v: isinstance(v, bool), "true (a real EOS may end the answer) or false", False),
    "prefix_group": (lambda v: v is None or (isinstance(v, str) and v != ""), "a group name or null", False),
    "prefix_tokens": (lambda v: v is None or _pos_int(v), "a positive integer or null", False),
    "api": (lambda v: v in APIS, f"one of {list(APIS)}", False),
}


def parse_trace_line(obj: Any, path: Path | str, line: int) -> TraceRequest:
    """One parsed JSON line as a request; raises TraceError naming the field."""
    if not isinstance(obj, dict):
        raise TraceError(path, line, "", "a JSON object (one request)", obj)
    for key in obj:
        if key not in _FIELDS:
            raise TraceError(path, line, key, f"one of the known fields {sorted(_FIELDS)}", key)
    for key, (ok, expected, required) in _FIELDS.items():
        if key not in obj:
            if required:
                raise TraceError(path, line, key, f"this field ({expected}; it is required)", has_got=False)
            continue
        if not ok(obj[key]):
            raise TraceError(path, line, key, expected, obj[key])
    group, prefix = obj.get("prefix_group"), obj.get("prefix_tokens")
    if (group is None) != (prefix is None):
        raise TraceError(path, line, "prefix_tokens" if group is not None else "prefix_group",
                         "prefix_group and prefix_tokens together (a group shares a prefix of that many tokens)",
                         has_got=False)
    return TraceRequest(
        at_s=float(obj["at_s"]), user=obj.get("user"), prompt=obj["prompt"], max_tokens=obj["max_tokens"],
        cancel_after_tokens=obj.get("cancel_after_tokens"),
        cancel_after_s=None if obj.get("cancel_after_s") is None else float(obj["cancel_after_s"]),
        eos=obj.get("eos", False), prefix_group=group, prefix_tokens=prefix, api=obj.get("api", "completions"),
        line=line,
    )


def parse_trace(text: str, path: Path | str) -> list[TraceRequest]:
    """Every request of a trace's text, in arrival order (stable); blank lines are skipped."""
    out: list[TraceRequest] = []
    for line, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            raise TraceError(path, line, "", f"one JSON object per line ({exc})", has_got=False) from None
        out.append(parse_trace_line(obj, path, line))
    if not out:
        raise TraceError(path, 0, "", "at least one request (one JSON object per line)", has_got=False)
    prefixes: dict[str, TraceRequest] = {}
    for r in out:
        if r.prefix_group is None:
            continue
        first = prefixes.setdefault(r.prefix_group, r)
        if r.prefix_tokens != first.prefix_tokens:
            raise TraceError(path, r.line, "prefix_tokens",
                             f"the prefix length of group {r.prefix_group!r} as on line {first.line} "
                             f"({first.prefix_tokens})", r.prefix_tokens)
    return sorted(out, key=lambda r: r.at_s)


def read_trace(path: Path | str, *, sha256: str | None = None) -> list[TraceRequest]:
    """Read and check a trace file; with ``sha256``, refuse a file whose content differs. Raises TraceError."""
    try:
        data = Path(path).read_bytes()
        text = data.decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(path, 0, "", f"a readable UTF-8 trace file ({exc})", has_got=False) from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise TraceError(path, 0, "", f"the trace as it was when the profile was loaded (sha256 {sha256})",
                         has_got=False)
    return parse_trace(text, path)


def trace_sha256(path: Path | str) -> str:
    """The digest of a trace file, as the run's parameters record it."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def resolve_trace(name_or_path: str, relative_to: Path | str, builtin_dir: Path) -> Path:
    """A trace named by a profile: a path relative to the profile's folder (or absolute), else a
    built-in trace (``builtin_dir/<name>.jsonl``: ``ratebench/profiles``). Raises TraceError when
    neither exists."""
    p = Path(name_or_path)
    candidate = p if p.is_absolute() else Path(relative_to) / p
    if candidate.is_file():
        return candidate
    builtin = builtin_dir / (name_or_path if name_or_path.endswith(TRACE_SUFFIX)
                             else name_or_path + TRACE_SUFFIX)
    if "/" not in name_or_path and builtin.is_file():
        return builtin
    names = ", ".join(sorted(f.stem for f in builtin_dir.glob(f"*{TRACE_SUFFIX}"))) or "none"
    raise TraceError(candidate, 0, "", f"an existing trace file (a path relative to the profile, or a built-in "
                                       f"trace: {names})", has_got=False)


def trace_users(requests: Iterable[TraceRequest]) -> list[str]:
    """The rate-limit users of a trace as the engine names them (__anonymous__ for null), in order of first arrival."""
    return list(dict.fromkeys(r.user or ANONYMOUS_USER for r in requests))


def write_trace(path: Path | str, requests: Iterable[TraceRequest]) -> None:
    """Write a trace file (atomically)."""
    from ratebench._io import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r.to_json()) + "\n" for r in requests))


@dataclass
class FromRecords:
    """A trace made of client records, and what was left out (with why)."""

    requests: list[TraceRequest]
    skipped: dict[str, int]  # why -> how many records


def trace_from_records(records: Iterable[ClientRecord], *, scenario: str | None = None, phase: str | None = None,
                       engine: str | None = None) -> FromRecords:
    """The requests an earlier run sent (its client records), as a trace: arrival at the time the driver
    meant to send each (``scheduled_ns``, from the first record chosen), the user, the prompt length,
    ``max_tokens``, the API, EOS allowed when ``ignore_eos`` was off, and a cancelled stream closed
    after the time it ran (``cancel_ns - sent_ns``). Prompt texts, shared prefixes and spoofing
    fields are not in the records: prompts become token counts of fresh text. Records never sent,
    those whose prompt length is unknown (no usage came back) and requests of several answers (a
    trace has no ``n``) are left out and counted."""
    chosen = [r for r in records if (scenario is None or r.scenario == scenario)
              and (phase is None or r.phase == phase) and (engine is None or r.engine == engine)]
    skipped: dict[str, int] = {}
    kept: list[ClientRecord] = []
    for r in chosen:
        why = None
        if r.sent_ns is None:
            why = "never sent (closed while waiting for its start)"
        elif r.prompt_tokens is None or r.prompt_tokens <= 0:
            why = "prompt length unknown (no usage came back)"
        elif r.choices is not None:
            why = f"{len(r.choices)} answers a request (n > 1: a trace's requests have one answer each)"
        if why:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            kept.append(r)
    kept.sort(key=lambda r: (r.scheduled_ns, r.client_id))
    t0 = kept[0].scheduled_ns if kept else 0
    out = []
    for r in kept:
        cancel_s = None
        if r.cancelled and r.cancel_ns is not None and r.sent_ns is not None:
            cancel_s = round(max(r.cancel_ns - r.sent_ns, 1_000_000) / 1e9, 3)
        out.append(TraceRequest(
            at_s=round((r.scheduled_ns - t0) / 1e9, 4), user=None if r.user in (None, ANONYMOUS_USER) else r.user,
            prompt=int(r.prompt_tokens), max_tokens=r.max_tokens, cancel_after_s=cancel_s, eos=not r.ignore_eos,
            api=r.api if r.api in APIS else "completions",
        ))
    return FromRecords(out, skipped)


def describe(requests: list[TraceRequest]) -> str:
    """A trace in one line: requests, span, users, and how many cancel, may end at EOS, share a prefix, use chat."""
    users = trace_users(requests)
    counts = {
        "cancelled": sum(1 for r in requests if r.cancel_after_s is not None or r.cancel_after_tokens is not None),
        "EOS allowed": sum(1 for r in requests if r.eos),
        "sharing a prefix": sum(1 for r in requests if r.prefix_group is not None),
        "on chat": sum(1 for r in requests if r.api == "chat"),
    }
    return (f"{len(requests)} requests over {max(r.at_s for r in requests):.2f} s, {len(users)} users "
            f"({', '.join(users)}); " + ", ".join(f"{n} {what}" for what, n in counts.items()))
