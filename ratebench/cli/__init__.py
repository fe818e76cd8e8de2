"""The ratebench command line: parse, call, print. No logic lives here.

One module per command group; this file is the table of commands (the console
script ``ratebench`` is ``ratebench.cli:app``):

    patch.py    ratebench patch apply|check|revert|status|refresh-hashes
    run.py      ratebench tiny-model, profiles, run
    verify.py   ratebench verify-bound, compare
    profile.py  ratebench profile-scheduler
    trace.py    ratebench trace from-run|check
"""

from __future__ import annotations

import typer

from ratebench.cli import patch, profile, run, trace, verify

app = typer.Typer(
    name="ratebench",
    help="Prove that a per-user output-token rate limit in vLLM 0.32.0 keeps its promise.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(patch.app, name="patch")
app.add_typer(trace.app, name="trace")
app.command("tiny-model")(run.tiny_model)
app.command("profiles")(run.list_profiles)
app.command("run")(run.run)
app.command("verify-bound")(verify.verify_bound)
app.command("compare")(verify.compare)
app.command("profile-scheduler")(profile.profile_scheduler)


def main() -> None:  # pragma: no cover
    app()
