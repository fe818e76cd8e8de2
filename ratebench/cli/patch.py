"""`ratebench patch apply|check|revert|status|refresh-hashes`: the limiter patch on an installed vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ratebench import patching
from ratebench.cli._console import fail, stdout

EXIT_REFUSED = 2

app = typer.Typer(
    help=(
        f"Apply, check, revert or inspect ratebench's limiter patch on vLLM {patching.SUPPORTED_VLLM_VERSION} "
        "(by default the vLLM of this Python). Every change is all or nothing. "
        "Exit code 2 means refused or failed, with the reason."
    ),
    no_args_is_help=True,
)

SitePackagesOption = Annotated[
    Path | None,
    typer.Option(
        "--site-packages",
        help="Work on the vLLM under this folder (it holds vllm/) instead of the installed one; "
        "the version then comes from vllm/_version.py.",
        file_okay=False,
    ),
]
PatchDirOption = Annotated[
    Path | None,
    typer.Option("--patch-dir", help="The patch folder (series, *.patch, pristine.sha256).", file_okay=False),
]

_STATE_STYLE = {"pristine": "yellow", "patched": "green", "modified": "bold red"}


def _refused(exc: patching.PatchError) -> typer.Exit:
    return fail(str(exc), EXIT_REFUSED)


def _result_line(result: patching.ApplyResult) -> str:
    verb = {"apply": "patched", "revert": "reverted"}[result.action]
    counts = f"{len(result.written)} file(s) to write, {len(result.deleted)} to delete"
    if result.dry_run:
        return f"{counts} in {result.root / 'vllm'}"
    return f"{verb} {result.root / 'vllm'}: " + counts.replace(" to write", " written").replace(" to delete", " deleted")


def _print_changes(result: patching.ApplyResult, *, unchanged: str, wrote: str) -> None:
    """The files apply or revert changed, and the reminder about running servers; or that nothing changed."""
    out = stdout()
    if not result.changed:
        out.print(f"{unchanged}: nothing to do ({escape(str(result.root / 'vllm'))})")
        return
    out.print(escape(_result_line(result)))
    for path in result.written:
        out.print(f"  {wrote} {escape(path)}")
    for path in result.deleted:
        out.print(f"  deleted  {escape(path)}")
    out.print("vLLM servers already running keep the old code until restarted")


@app.command("apply")
def apply(site_packages: SitePackagesOption = None, patch_dir: PatchDirOption = None) -> None:
    """Patch vLLM (exit 0; already patched: nothing to do).

    Refused, exit 2, with the files listed, when a target file is neither pristine nor patched.
    """
    try:
        result = patching.apply_patch(site_packages, patch_dir)
    except patching.PatchError as exc:
        raise _refused(exc) from None
    _print_changes(result, unchanged="already patched", wrote="wrote  ")


@app.command("check")
def check(site_packages: SitePackagesOption = None, patch_dir: PatchDirOption = None) -> None:
    """Dry run of apply: exit 0 if apply would succeed or has nothing to do, 2 if not."""
    try:
        result = patching.apply_patch(site_packages, patch_dir, dry_run=True)
    except patching.PatchError as exc:
        raise _refused(exc) from None
    if not result.changed:
        stdout().print(f"already patched: apply would change nothing ({escape(str(result.root / 'vllm'))})")
    else:
        stdout().print(f"apply would succeed: {escape(_result_line(result))}")


@app.command("revert")
def revert(site_packages: SitePackagesOption = None, patch_dir: PatchDirOption = None) -> None:
    """Restore the pristine vLLM files (exit 0; already pristine: nothing to do).

    The result is checked against pristine.sha256; refused, exit 2, when a file is neither
    pristine nor patched.
    """
    try:
        result = patching.revert_patch(site_packages, patch_dir)
    except patching.PatchError as exc:
        raise _refused(exc) from None
    _print_changes(result, unchanged="already pristine", wrote="restored")


@app.command("status")
def status(site_packages: SitePackagesOption = None, patch_dir: PatchDirOption = None) -> None:
    """Show each target file as pristine, patched or modified; exit 0 patched, 1 pristine, 2 modified.

    Exit codes: 0 when fully patched, 1 when pristine, 2 when any file is modified, the tree
    is half patched, or the check itself failed.
    """
    try:
        state = patching.patch_status(site_packages, patch_dir)
    except patching.PatchError as exc:
        raise _refused(exc) from None
    out = stdout()
    for f in state.files:
        style = _STATE_STYLE[f.state]
        detail = f"  ({escape(f.problem)})" if f.problem else ""
        out.print(f"  [{style}]{f.state:<9}[/] {escape(f.path)}{detail}")
    style = _STATE_STYLE[state.overall]
    out.print(
        f"overall: [{style}]{state.overall}[/] (vLLM {escape(state.vllm_version)} at "
        f"{escape(str(state.root / 'vllm'))}; patch sha256 {state.patch_sha256[:16]})"
    )
    raise typer.Exit({"patched": 0, "pristine": 1}.get(state.overall, EXIT_REFUSED))


@app.command("refresh-hashes")
def refresh_hashes(
    pristine: Annotated[
        Path,
        typer.Option("--from", help="A pristine vLLM 0.32.0 site-packages folder (it holds vllm/).", file_okay=False),
    ],
    patch_dir: PatchDirOption = None,
) -> None:
    """Maintainers: regenerate pristine.sha256 from a pristine vLLM tree after changing the series.

    The target files are those the series touches; the series must apply to the tree.
    """
    try:
        out = patching.refresh_pristine_hashes(pristine, patch_dir)
    except patching.PatchError as exc:
        raise _refused(exc) from None
    stdout().print(f"wrote {escape(str(out))}")
