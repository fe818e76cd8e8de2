"""The ratebench command line: parse, call, print. No logic lives here."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="ratebench",
    help="Prove that a per-user output-token rate limit in vLLM 0.32.0 keeps its promise.",
    no_args_is_help=True,
    add_completion=False,
)

# ---- patch: ratebench patch apply|check|revert|status ------------------------------
# (section owned by ratebench/patching.py)

# ---- tiny model: ratebench tiny-model ----------------------------------------------
# (section owned by ratebench/tinymodel.py)

# ---- run / profiles ------------------------------------------------------------------
# (section owned by ratebench/profiles.py, engine.py, workload.py, runner.py)

# ---- verify-bound / compare ----------------------------------------------------------
# (section owned by ratebench/analysis/, ratebench/outputs/)

# ---- profile-scheduler -----------------------------------------------------------------
# (section owned by ratebench/profiling.py)


def main() -> None:  # pragma: no cover
    app()
