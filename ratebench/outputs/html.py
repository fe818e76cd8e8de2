"""report.html: the blocks of ``report.py`` as one self-contained page (plots inline as base64 PNG,
styles inline, no scripts, nothing fetched), in report.md's order."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from ratebench._io import atomic_write_text
from ratebench.analysis.verdict import Verdict
from ratebench.outputs.report import Block, Bullets, Heading, Image, Outcome, Table, Text, report_blocks

# the verdict banner's background, by outcome (tests look for these colours in a screenshot)
OUTCOME_COLOURS = {"PASS": "#1b7f3b", "FAIL": "#c62828", "PARTIAL": "#b26a00", "FAIL (PARTIAL)": "#c62828"}

_CSS = """
body { font: 14px/1.45 -apple-system, "Segoe UI", "DejaVu Sans", Helvetica, Arial, sans-serif; color: #1a1a1a;
       margin: 0 auto; max-width: 1240px; padding: 0 20px 40px; background: #fff; }
.outcome { color: #fff; padding: 18px 22px; margin: 16px 0 10px; border-radius: 6px; font-size: 28px; }
.outcome .promises { font-size: 17px; font-weight: normal; }
h2 { border-bottom: 1px solid #ddd; padding-bottom: 3px; margin-top: 28px; font-size: 20px; }
code { background: #f2f2f2; padding: 0 3px; border-radius: 3px; font-size: 12.5px; word-break: break-all; }
.table { overflow-x: auto; margin: 8px 0 12px; }
table { border-collapse: collapse; font-size: 12.5px; }
th, td { border: 1px solid #d4d4d4; padding: 3px 7px; text-align: left; vertical-align: top; }
td { white-space: nowrap; }
td.wrap { white-space: normal; min-width: 320px; }
th { background: #eef1f5; }
tr:nth-child(even) td { background: #fafafa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.fail { color: #fff; background: #c62828 !important; font-weight: bold; }
td.pass { color: #1b7f3b; }
li { margin: 3px 0; }
figure { margin: 14px 0; }
figure img { max-width: 100%; border: 1px solid #e0e0e0; }
figcaption { font-size: 12px; color: #555; }
"""

_NUM = re.compile(r"^[+-]?[0-9.]+(k|e[+-]?[0-9]+)?(/[+-]?[0-9.k-]+)*$|^-$")


def inline(text: str) -> str:
    """The report's inline markdown (``code``, **bold**, *italic*) as escaped HTML."""
    parts = text.split("`")
    out = []
    for i, part in enumerate(parts):
        if i % 2 and i < len(parts) - 1:
            out.append(f"<code>{html.escape(part)}</code>")
        else:
            escaped = html.escape(part if i % 2 == 0 else "`" + part)
            escaped = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped)
            out.append(re.sub(r"(?<![*\w])\*(\w[^*]*?)\*(?![*\w])", r"<em>\1</em>", escaped))
    return "".join(out)


def _cell(value: str) -> str:
    cls = {"FAIL": "fail", "pass": "pass"}.get(value, "num" if _NUM.match(value) else "wrap" if len(value) > 60 else "")
    return f"<td class=\"{cls}\">{inline(value)}</td>" if cls else f"<td>{inline(value)}</td>"


def _image(b: Image) -> str:
    try:
        data = base64.b64encode(Path(b.path).read_bytes()).decode("ascii")
    except OSError:
        return f"<p>(plot {html.escape(b.rel)} missing)</p>"
    return (f"<figure><img alt=\"{html.escape(b.alt)}\" src=\"data:image/png;base64,{data}\">"
            f"<figcaption>{html.escape(b.rel)}</figcaption></figure>")


def render_blocks(blocks: list[Block], title: str = "ratebench verdict") -> str:
    """One HTML page of the report's blocks."""
    body = []
    for b in blocks:
        if isinstance(b, Outcome):
            colour = OUTCOME_COLOURS.get(b.outcome, "#555555")
            rest = b.headline[len(b.outcome):] if b.headline.startswith(b.outcome) else ""
            rest = f"<span class=\"promises\">{html.escape(rest)}</span>" if rest else ""
            body.append(f"<h1 class=\"outcome\" style=\"background: {colour}\">ratebench verdict: "
                        f"{html.escape(b.outcome)}{rest}</h1>")
        elif isinstance(b, Heading):
            body.append(f"<h{b.level}>{inline(b.text)}</h{b.level}>")
        elif isinstance(b, Text):
            body.append(f"<p>{inline(b.text)}</p>")
        elif isinstance(b, Bullets):
            body.append("<ul>" + "".join(f"<li>{inline(item)}</li>" for item in b.items) + "</ul>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{inline(h)}</th>" for h in b.header)
            rows = "".join("<tr>" + "".join(_cell(str(c)) for c in r) + "</tr>" for r in b.rows)
            body.append(f"<div class=\"table\"><table><thead><tr>{head}</tr></thead>"
                        f"<tbody>{rows}</tbody></table></div>")
        elif isinstance(b, Image):
            body.append(_image(b))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def render_report(verdict: Verdict, plot_paths: list[Path] | None = None, base_dir: Path | None = None) -> str:
    """report.html's text."""
    title = f"ratebench verdict: {verdict.outcome} ({verdict.run_id or verdict.run_dir})"
    return render_blocks(report_blocks(verdict, plot_paths, base_dir), title)


def write_report(verdict: Verdict, path: str | Path, plot_paths: list[Path] | None = None) -> Path:
    path = Path(path)
    atomic_write_text(path, render_report(verdict, plot_paths, base_dir=path.parent))
    return path
