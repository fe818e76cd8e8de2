"""Writing a set of files all or nothing: under a lock on their folder, each through a temporary file
and a rename; a failed write rolls back the files already written. What :mod:`ratebench.patching`
applies and reverts the patch with."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ratebench._io import file_lock
from ratebench.unidiff import PatchError


@contextlib.contextmanager
def tree_lock(root: Path) -> Iterator[None]:
    """One patch operation per tree at a time, machine-wide."""
    key = hashlib.sha256(str(root).encode()).hexdigest()[:16]
    with file_lock(Path(tempfile.gettempdir()) / f"ratebench-patch-{key}.lock"):
        yield


def write_all(root: Path, changes: dict[str, bytes | None], originals: dict[str, bytes | None], *,
              reinstall: str) -> None:
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
                write_file_atomically(full, content, mode=_mode_of(full))
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
                + f": these files are in an unknown state; reinstall {reinstall}"
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
                write_file_atomically(full, original, mode=mode)
                _ensure_new_mtime(full, old_mtime_s)
        except Exception as exc:  # noqa: BLE001 - keep rolling back the others
            failures.append(f"{path} ({exc})")
    return failures


def _mode_of(path: Path) -> int | None:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return None


def write_file_atomically(path: Path, data: bytes, *, mode: int | None) -> None:
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
