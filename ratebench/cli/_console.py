"""The consoles every command prints on, and the one way a command reports an error."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape


def stdout() -> Console:
    """Results: what a command was asked for."""
    return Console(soft_wrap=True, highlight=False)


def stderr() -> Console:
    """Progress, warnings and errors."""
    return Console(stderr=True, soft_wrap=True, highlight=False)


def fail(message: str, code: int, *, label: str = "error") -> typer.Exit:
    """Print ``label: message`` on stderr; returns the Exit for the caller to raise."""
    stderr().print(f"[bold red]{label}:[/] {escape(message)}")
    return typer.Exit(code)
