"""Unified diffs, strictly: parsed into files and hunks, and applied (or reverted) only where every
line of a hunk matches at the line its header names. What :mod:`ratebench.patching` applies the
limiter patch with."""

from __future__ import annotations

import re
from dataclasses import dataclass

_EPOCH_TIMESTAMP = re.compile(rb"\t1970-01-01 00:00:00(\.0+)? \+0000\s*$")
_HUNK_HEADER = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(Exception):
    """Anything that stops a patch operation; the message says what to do about it."""


@dataclass(frozen=True)
class Hunk:
    """One ``@@`` hunk. Lines keep their line ending; a line followed by
    ``\\ No newline at end of file`` has none."""

    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[tuple[str, bytes], ...]  # (" " | "-" | "+", line)
    header_line_no: int  # line of the @@ header in its diff file, 1-based

    @property
    def old_lines(self) -> list[bytes]:
        return [text for op, text in self.lines if op != "+"]

    @property
    def new_lines(self) -> list[bytes]:
        return [text for op, text in self.lines if op != "-"]

    @property
    def header(self) -> str:
        return f"@@ -{self.old_start},{self.old_len} +{self.new_start},{self.new_len} @@"

    def reversed(self) -> Hunk:
        swap = {" ": " ", "-": "+", "+": "-"}
        return Hunk(
            old_start=self.new_start,
            old_len=self.new_len,
            new_start=self.old_start,
            new_len=self.old_len,
            lines=tuple((swap[op], text) for op, text in self.lines),
            header_line_no=self.header_line_no,
        )


@dataclass(frozen=True)
class FileDiff:
    """The hunks of one diff file that touch one target file."""

    path: str  # relative to site-packages, POSIX separators
    creates: bool  # the file does not exist before this diff
    deletes: bool  # the file does not exist after this diff
    hunks: tuple[Hunk, ...]
    source: str  # the diff file's name, for messages
    # Old side named a real path yet every hunk starts at -0,0 (``diff -N`` style new
    # file without an epoch timestamp): a new file or an edit of an empty one.
    # refresh-hashes decides which from the pristine tree.
    maybe_creates: bool = False

    def reversed(self) -> FileDiff:
        return FileDiff(
            path=self.path,
            creates=self.deletes,
            deletes=self.creates,
            hunks=tuple(h.reversed() for h in self.hunks),
            source=f"{self.source} (reversed)",
        )


def _split_lines(data: bytes) -> list[bytes]:
    """Lines with their b"\\n"; only b"\\n" ends a line (a stray b"\\r" is content)."""
    lines = data.split(b"\n")
    tail = lines.pop()
    result = [line + b"\n" for line in lines]
    if tail:
        result.append(tail)
    return result


def _diff_path(raw: bytes, where: str) -> str | None:
    """The target path named on a ``---``/``+++`` line, without its ``a/``/``b/`` prefix;
    None for /dev/null."""
    name = raw.split(b"\t", 1)[0].rstrip(b"\r\n")
    if name == b"/dev/null":
        return None
    if name.startswith(b'"'):
        raise PatchError(f"{where}: quoted file names are not supported ({name.decode(errors='replace')})")
    try:
        text = name.decode("utf-8")
    except UnicodeDecodeError:
        raise PatchError(f"{where}: the file name is not UTF-8") from None
    if not (text.startswith("a/") or text.startswith("b/")):
        raise PatchError(
            f"{where}: path {text!r} lacks the a/ or b/ prefix; make diffs with "
            "`diff -ruN a/ b/` or `git diff` from the site-packages folder"
        )
    path = text[2:]
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise PatchError(f"{where}: path {text!r} must be relative to site-packages, without . or ..")
    return path


def parse_diff(data: bytes, source: str) -> list[FileDiff]:
    """Parse a unified diff (``diff -ruN`` or ``git diff`` output) into file diffs.

    Refused: renames, binary diffs, mode-only changes, ``Only in`` lines (use ``diff -N``),
    hunk counts that disagree with the hunk's lines.
    """
    if data and not data.endswith(b"\n"):
        # Its last line would count as "no newline at end of file" in the patched file.
        raise PatchError(f"{source}: the diff file does not end with a newline (truncated or edited?); "
                         "regenerate it")
    lines = _split_lines(data)
    result: list[FileDiff] = []
    git_new = git_deleted = False
    git_section: str | None = None  # the `diff --git` line of the section without ---/+++ yet
    seen_diff = False
    i = 0
    n = len(lines)
    while i < n:
        line = lines[i]
        where = f"{source}:{i + 1}"
        if line.startswith(b"diff --git "):
            if git_section is not None:
                raise PatchError(f"{git_section}: a git diff section without hunks (mode change, rename, "
                                 "empty or binary file) is not supported")
            git_section, git_new, git_deleted = where, False, False
            i += 1
            continue
        if line.startswith(b"new file mode"):
            git_new = True
        elif line.startswith(b"deleted file mode"):
            git_deleted = True
        elif line.startswith((b"rename from", b"rename to", b"copy from", b"copy to")):
            raise PatchError(f"{where}: renames and copies are not supported; diff the new file from /dev/null")
        elif line.startswith((b"Binary files", b"GIT binary patch")):
            raise PatchError(f"{where}: binary diffs are not supported")
        elif line.startswith(b"Only in "):
            raise PatchError(f"{where}: {line.decode(errors='replace').strip()!r}: make the diff with `diff -ruN` "
                             "so new files appear as diffs from nothing")
        elif line == b"-- \n" and git_section is None and seen_diff:
            break  # the signature git format-patch puts after the last diff
        elif line.startswith(b"--- ") and i + 1 < n and lines[i + 1].startswith(b"+++ "):
            old_raw, new_raw = line[4:], lines[i + 1][4:]
            old_path = _diff_path(old_raw, where)
            new_path = _diff_path(new_raw, f"{source}:{i + 2}")
            if old_path is None and new_path is None:
                raise PatchError(f"{where}: both sides of the diff are /dev/null")
            if old_path is not None and new_path is not None and old_path != new_path:
                raise PatchError(f"{where}: old path {old_path!r} and new path {new_path!r} differ; "
                                 "renames are not supported")
            path = new_path if new_path is not None else old_path
            assert path is not None
            creates = old_path is None or git_new or bool(_EPOCH_TIMESTAMP.search(old_raw))
            deletes = new_path is None or git_deleted or bool(_EPOCH_TIMESTAMP.search(new_raw))
            if creates and deletes:
                raise PatchError(f"{where}: a diff cannot both create and delete {path}")
            i += 2
            hunks: list[Hunk] = []
            while i < n and lines[i].startswith(b"@@"):
                hunk, i = _parse_hunk(lines, i, source)
                hunks.append(hunk)
            if not hunks:
                raise PatchError(f"{where}: no hunks follow the ---/+++ lines of {path}")
            if creates and any(h.old_len != 0 for h in hunks):
                raise PatchError(f"{where}: {path} is a new file, yet a hunk removes or keeps old lines")
            if deletes and any(h.new_len != 0 for h in hunks):
                raise PatchError(f"{where}: {path} is deleted, yet a hunk keeps or adds lines")
            maybe_creates = not creates and old_path is not None and all(
                h.old_start == 0 and h.old_len == 0 for h in hunks
            )
            result.append(FileDiff(path=path, creates=creates, deletes=deletes, hunks=tuple(hunks),
                                   source=source, maybe_creates=maybe_creates))
            git_section, git_new, git_deleted = None, False, False
            seen_diff = True
            continue
        elif seen_diff and line[:1] in (b" ", b"+", b"-", b"\\") and line.strip():
            # Hunk content past the count its @@ header gives: a hand-edited diff whose
            # counts were not updated. Dropping the line silently would ship a wrong patch.
            raise PatchError(f"{where}: a diff line outside any hunk; the @@ line counts of the hunk "
                             "above do not cover it (fix the counts or regenerate the diff)")
        elif line.startswith(b"@@"):
            raise PatchError(f"{where}: a hunk without ---/+++ file lines before it")
        i += 1
    if git_section is not None:
        raise PatchError(f"{git_section}: a git diff section without hunks (mode change, rename, "
                         "empty or binary file) is not supported")
    return result


def _parse_hunk(lines: list[bytes], i: int, source: str) -> tuple[Hunk, int]:
    header = lines[i]
    match = _HUNK_HEADER.match(header)
    if not match:
        raise PatchError(f"{source}:{i + 1}: malformed hunk header {header.decode(errors='replace').strip()!r}")
    old_start, new_start = int(match.group(1)), int(match.group(3))
    old_len = int(match.group(2)) if match.group(2) is not None else 1
    new_len = int(match.group(4)) if match.group(4) is not None else 1
    header_line_no = i + 1
    body: list[tuple[str, bytes]] = []
    old_seen = new_seen = 0
    i += 1
    while old_seen < old_len or new_seen < new_len:
        if i >= len(lines):
            raise PatchError(f"{source}:{header_line_no}: the hunk ends early (the file ends before "
                             f"{old_len} old and {new_len} new lines were seen)")
        line = lines[i]
        op = line[:1]
        if line in (b"\n", b"\r\n"):
            # An editor stripped the blank context line's leading space.
            op, line = b" ", b" " + line
        if op == b" ":
            old_seen += 1
            new_seen += 1
        elif op == b"-":
            old_seen += 1
        elif op == b"+":
            new_seen += 1
        elif op == b"\\" and body:  # "\\ No newline at end of file", in any locale
            body[-1] = (body[-1][0], _strip_newline(body[-1][1]))
            i += 1
            continue
        else:
            raise PatchError(f"{source}:{i + 1}: unexpected line inside a hunk "
                             f"({line.decode(errors='replace').rstrip()!r}); the @@ counts "
                             f"{header.decode(errors='replace').strip()!r} do not match the hunk")
        if old_seen > old_len or new_seen > new_len:
            raise PatchError(f"{source}:{i + 1}: the hunk has more lines than its header "
                             f"{header.decode(errors='replace').strip()!r} says")
        body.append((op.decode(), line[1:]))
        i += 1
    if i < len(lines) and lines[i].startswith(b"\\") and body:
        body[-1] = (body[-1][0], _strip_newline(body[-1][1]))
        i += 1
    if old_len == 0 and old_start == 0 and new_len == 0:
        raise PatchError(f"{source}:{header_line_no}: an empty hunk")
    return Hunk(old_start, old_len, new_start, new_len, tuple(body), header_line_no), i


def _strip_newline(line: bytes) -> bytes:
    return line[:-1] if line.endswith(b"\n") else line


def apply_file_diff(content: bytes | None, fd: FileDiff) -> bytes | None:
    """Apply one file diff to a file's content (None: the file does not exist), strictly."""
    where = f"{fd.source}: {fd.path}"
    if fd.creates:
        if content is not None:
            raise PatchError(f"{where}: the diff creates this file, but it already exists")
        lines: list[bytes] = []
    elif content is None:
        if not fd.maybe_creates:
            raise PatchError(f"{where}: the diff changes this file, but it does not exist")
        lines = []
    else:
        lines = _split_lines(content)
    out: list[bytes] = []
    pos = 0
    for hunk in fd.hunks:
        hunk_where = f"{where}: hunk {hunk.header} (line {hunk.header_line_no} of {fd.source.split(' ')[0]})"
        start = hunk.old_start - 1 if hunk.old_len > 0 else hunk.old_start
        if start < pos:
            raise PatchError(f"{hunk_where}: overlaps the hunk before it or comes before it")
        old = hunk.old_lines
        if start + len(old) > len(lines) or lines[start : start + len(old)] != old:
            raise PatchError(f"{hunk_where}: {_mismatch(lines, start, old)}")
        out.extend(lines[pos:start])
        expected_new_start = len(out) + (1 if hunk.new_len > 0 else 0)
        if hunk.new_start != expected_new_start:
            raise PatchError(f"{hunk_where}: the header puts the result at line {hunk.new_start}, "
                             f"but it lands at line {expected_new_start}; the diff was edited by hand "
                             "without fixing its line numbers")
        out.extend(hunk.new_lines)
        pos = start + len(old)
    out.extend(lines[pos:])
    for line in out[:-1]:
        if not line.endswith(b"\n"):
            raise PatchError(f"{where}: the result would have a line without a newline before its last "
                             "line (a misplaced '\\ No newline at end of file')")
    if fd.deletes:
        if out:
            raise PatchError(f"{where}: the diff deletes this file, but {len(out)} lines would remain")
        return None
    return b"".join(out)


def _mismatch(lines: list[bytes], start: int, old: list[bytes]) -> str:
    """Say where a hunk's old lines fail to match, and where else they occur, if anywhere."""
    detail = f"the file has {len(lines)} lines; the hunk needs lines {start + 1} to {start + len(old)}"
    for k, want in enumerate(old):
        have = lines[start + k] if start + k < len(lines) else None
        if have != want:
            found = "end of file" if have is None else repr(have.decode(errors="replace"))
            detail = (f"line {start + k + 1} should be {want.decode(errors='replace')!r}, "
                      f"found {found}")
            break
    elsewhere = [
        s + 1 for s in range(0, len(lines) - len(old) + 1) if old and lines[s : s + len(old)] == old
    ]
    if elsewhere:
        at = ", ".join(str(s) for s in elsewhere[:5])
        detail += (f"; the hunk's lines do occur at line {at}: the diff was made against another "
                   "version of the file (regenerate it; diffs are never applied at an offset)")
    return "context does not match: " + detail


def apply_chain(content: bytes | None, diffs: list[FileDiff], *, reverse: bool = False) -> bytes | None:
    """Apply several diffs of one file in series order (or undo them, in reverse order)."""
    chain = [fd.reversed() for fd in reversed(diffs)] if reverse else diffs
    for fd in chain:
        content = apply_file_diff(content, fd)
    return content
