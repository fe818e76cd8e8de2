"""report.md (the blocks of ``report.py`` as markdown) and compare.md."""

from __future__ import annotations

from pathlib import Path

from ratebench._io import atomic_write_text
from ratebench.analysis.compare import Comparison
from ratebench.analysis.verdict import Verdict
from ratebench.outputs.report import Block, Bullets, Heading, Image, Outcome, Table, Text, report_blocks


def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def render_blocks(blocks: list[Block]) -> str:
    """Markdown of the report's blocks (``report.report_blocks``)."""
    out = []
    for b in blocks:
        if isinstance(b, Outcome):
            out.append(f"# ratebench verdict: {b.headline or b.outcome}\n")
        elif isinstance(b, Heading):
            out.append(f"{'#' * b.level} {b.text}\n")
        elif isinstance(b, Text):
            out.append(b.text + "\n")
        elif isinstance(b, Bullets):
            out.append("".join(f"- {item}\n" for item in b.items))
        elif isinstance(b, Table):
            out.append(_table(b.header, b.rows))
        elif isinstance(b, Image):
            out.append(f"![{b.alt}]({b.rel})\n")
    return "\n".join(out)


def render_report(verdict: Verdict, plot_paths: list[Path] | None = None, base_dir: Path | None = None) -> str:
    """report.md's text."""
    return render_blocks(report_blocks(verdict, plot_paths, base_dir))


def write_report(verdict: Verdict, path: str | Path, plot_paths: list[Path] | None = None) -> Path:
    path = Path(path)
    atomic_write_text(path, render_report(verdict, plot_paths, base_dir=path.parent))
    return path


def render_comparison(c: Comparison) -> str:
    out = ["# ratebench compare\n\n",
           f"- A: `{c.run_a}` ({'PASS' if c.passed_a else 'FAIL'})\n",
           f"- B: `{c.run_b}` ({'PASS' if c.passed_b else 'FAIL'})\n\n"]
    out.append(_table(["scenario/phase", "engine", "user", "figure", "A", "B", "B/A"], [l.cells() for l in c.lines]))
    if c.notes:
        out.append("\n" + "".join(f"- {n}\n" for n in c.notes))
    out.append("\nFigures as defined in each run's report.md.\n")
    return "".join(out)


def write_comparison(c: Comparison, path: str | Path) -> Path:
    path = Path(path)
    atomic_write_text(path, render_comparison(c))
    return path
