"""report.html: one self-contained page in report.md's order, checked in a real headless browser.

The browser is Chromium (Debian's package; scripts/test.sh installs it when missing). Without it
these tests fail rather than skip, so CI cannot pass them unseen.
"""

from __future__ import annotations

import base64
import html as html_lib
import io
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image as mpimg

from ratebench.outputs.html import OUTCOME_COLOURS, inline
from synth import standard_run
from ratebench.verify import verify_run
from synthetic_runs import mix_run_folder, one_phase_run

WIDTH, HEIGHT = 1280, 2000


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no chromium on PATH: scripts/test.sh installs it (apt-get install chromium)")


def screenshot(page: Path, out: Path, height: int = HEIGHT) -> np.ndarray:
    """The page as headless Chromium draws it at 1280 x ``height`` (2000), RGB uint8."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", f"--screenshot={out}", f"--window-size={WIDTH},{height}",
             page.resolve().as_uri()],
            capture_output=True, timeout=120, check=False)
    assert out.is_file() and out.stat().st_size > 0, "chromium wrote no screenshot"
    img = mpimg.imread(out)
    return (img[..., :3] * 255).round().astype(np.uint8)


def colour_pixels(img: np.ndarray, hex_colour: str, tol: int = 3) -> np.ndarray:
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
    return (np.abs(img.astype(np.int16) - rgb).max(axis=2) <= tol)


@pytest.fixture(scope="module")
def failing_run(tmp_path_factory):
    run = standard_run(tmp_path_factory.mktemp("broken") / "run", limiter="burst-1s")
    verify_run(run)
    return run


def test_the_page_is_self_contained_with_the_verdict_and_the_plots_inline(failing_run):
    page = (failing_run / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "ratebench verdict: FAIL" in page
    assert "<script" not in page and "<link" not in page
    assert not re.search(r"""(src|href)=["'](?!data:)""", page)  # nothing fetched
    pngs = re.findall(r'<img alt="[^"]+" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    plots = sorted((failing_run / "plots").glob("*.png"))
    assert len(pngs) == len(plots) >= 2
    img = mpimg.imread(io.BytesIO(base64.b64decode(pngs[0])), format="png")
    assert img.shape[0] > 200 and img.shape[1] > 400


def test_the_page_follows_report_md_order(failing_run):
    md = (failing_run / "report.md").read_text()
    page = (failing_run / "report.html").read_text()
    md_heads = [h.replace("`", "") for h in re.findall(r"^##+ (.+)$", md, flags=re.M)]
    page_heads = [html_lib.unescape(re.sub(r"<[^>]+>", "", h)) for h in re.findall(r"<h[23]>(.+?)</h[23]>", page)]
    assert page_heads == md_heads
    assert md_heads[0] == "Failures"
    # the same failures, in the same order
    md_fail = re.findall(r"^- \*\*([a-z-]+)\*\* (\S+)", md, flags=re.M)
    page_fail = re.findall(r"<li><strong>([a-z-]+)</strong> (\S+)", page)
    assert md_fail and page_fail[:len(md_fail)] == md_fail
    # the tables' cells, as in report.md
    assert page.count("<tr>") == sum(1 for line in md.splitlines() if line.startswith("| "))


def test_inline_markdown_becomes_escaped_html():
    assert inline("**bold** `a < b` & c") == "<strong>bold</strong> <code>a &lt; b</code> &amp; c"


def test_a_failing_report_reads_red_in_a_real_browser(failing_run, tmp_path):
    # two screens: the failures come first, and a long list of them pushes the tables' FAIL cells down
    img = screenshot(failing_run / "report.html", tmp_path / "fail.png", height=2 * HEIGHT)
    assert img.shape == (2 * HEIGHT, WIDTH, 3)
    red = colour_pixels(img, OUTCOME_COLOURS["FAIL"])
    banner = red[:150]
    assert banner.sum() > 0.5 * 60 * 1200  # the verdict banner, near the top
    assert not colour_pixels(img[:150], OUTCOME_COLOURS["PASS"]).any()
    # not blank: text and tables drawn in many colours over much of the page
    colours = np.unique(img.reshape(-1, 3), axis=0)
    assert len(colours) > 50
    white = (img >= 250).all(axis=2).mean()
    assert 0.3 < white < 0.97
    # FAIL cells in the tables below the banner
    assert red[150:].sum() > 500


def test_a_passing_report_reads_green_in_a_real_browser(tmp_path):
    run = one_phase_run(tmp_path / "run", streams=2)
    verify_run(run)
    img = screenshot(run / "report.html", tmp_path / "pass.png")
    green = colour_pixels(img, OUTCOME_COLOURS["PASS"])
    assert green[:150].sum() > 0.5 * 60 * 1200
    assert not colour_pixels(img[:150], OUTCOME_COLOURS["FAIL"]).any()  # (the plots draw the bound in red)
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 50


def test_thresholds_read_in_milliseconds_on_the_page(failing_run):
    page = (failing_run / "report.html").read_text()
    para = next(p for p in re.findall(r"<p>(.*?)</p>", page) if p.startswith("Thresholds: "))
    assert "<code>spacing_slack</code> = 5 ms" in para and "<code>isolation_ttft_slack</code> = 20 ms" in para
    assert "_ns</code>" not in para and "000000" not in para


def _header_bands(img: np.ndarray) -> int:
    """Tables drawn: separate bands of rows holding table-header cells (their background, #eef1f5)."""
    rows = np.flatnonzero(colour_pixels(img, "#eef1f5", tol=1).sum(axis=1) > 40)
    return 0 if not len(rows) else 1 + int((np.diff(rows) > 1).sum())


def test_a_mix_report_shows_its_tiers_and_their_latency_on_the_first_screen(tmp_path):
    """55 users' overrides are one short cell and their rows fold into tiers: the run's tables, the users by
    tier and the latency by tier (limiter on beside the baseline) all fit the first 2000 pixels."""
    run = mix_run_folder(tmp_path / "run", baseline=True)
    verify_run(run)
    page = (run / "report.html").read_text()
    assert "<td class=\"wrap\">55 users: 20 (25), 50 (10), 200 (20)</td>" in page or \
        "<td>55 users: 20 (25), 50 (10), 200 (20)</td>" in page
    latency = page[page.index("<h2>Latency by tier</h2>"):page.index("<h2>Users by scenario phase</h2>")]
    assert latency.count("<tr>") == 1 + 8  # the header, each tier on the phase and on its baseline
    assert re.search(r'<td>low</td><td class="num">25</td><td class="num">20</td><td class="num">50</td>'
                     r'<td class="num">400</td><td class="num">[0-9.]+</td>'
                     r'<td class="num">[0-9.]+/[0-9.]+/[0-9.]+</td>', latency)
    img = screenshot(run / "report.html", tmp_path / "mix.png")
    assert colour_pixels(img, OUTCOME_COLOURS["PASS"])[:150].sum() > 0.5 * 60 * 1200
    # the run's two tables, the users by tier, the latency by tier, and the users table below them
    assert _header_bands(img) >= 5

