"""PNG plots (matplotlib, Agg): one file per scenario phase, and one for the overhead scenario's rounds.

A phase's plot: for each limited user, the slack over time on both sides of its promise (tokens
under the bound, red; tokens above the even-spacing line less its allowance, blue; below 0 is
broken) with the tightest window of each side shaded; then the inter-token gap CDFs of every user;
then the per-stream tokens of the user with the most streams. A phase shown by tier (a ``mix``,
``outputs/tiers.py``) has instead one chart per tier with the slack of every limited user of the
tier (the worst and the failing ones drawn bold and named), then the gaps of its tightest users.
The overhead rounds' plot: each role's throughput per round, and each pair's per-round ratio
beside its median.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from ratebench.analysis.load import RunData  # noqa: E402
from ratebench.analysis.plotdata import PhaseFigures  # noqa: E402
from ratebench.analysis.series import UserSeries  # noqa: E402
from ratebench.analysis.slack import SlackSeries, UserSlack  # noqa: E402
from ratebench.analysis.verdict import OverheadSummary, UserPhaseSummary, Verdict  # noqa: E402
from ratebench.outputs.format import group_plot_file, in_rounds, plot_file  # noqa: E402
from ratebench.outputs.tiers import by_tier, tier_of  # noqa: E402

MAX_POINTS = 1500  # points per line; longer series are thinned evenly (slack: each bin's lowest and highest)
PANEL_W_IN, PANEL_H_IN, DPI = 6.4, 3.9, 80
UPPER, LOWER = "#c62828", "#1565c0"  # the bound's side, red; even spacing's side, blue


def _thin(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(x) <= MAX_POINTS:
        return x, y
    idx = np.unique(np.linspace(0, len(x) - 1, MAX_POINTS).astype(np.int64))
    return x[idx], y[idx]


def _envelope(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """At most MAX_POINTS points keeping each bin's lowest and highest value in time order, so
    a dip of one event survives; NaN (a break in the line) only where a whole bin is NaN."""
    if len(x) <= MAX_POINTS:
        return x, y
    k = -(-len(x) // (MAX_POINTS // 2))
    pad = (-len(x)) % k
    yy = np.concatenate([y, np.full(pad, np.nan)]).reshape(-1, k)
    empty = np.isnan(yy).all(axis=1)
    lo = np.argmin(np.where(np.isnan(yy), np.inf, yy), axis=1)
    hi = np.argmax(np.where(np.isnan(yy), -np.inf, yy), axis=1)
    base = np.arange(len(yy)) * k
    pos = np.sort(np.stack([base + np.minimum(lo, hi), base + np.maximum(lo, hi)], axis=1), axis=1).ravel()
    pos = np.minimum(pos, len(x) - 1)
    out_y = y[pos].astype(np.float64)
    out_y[np.repeat(empty, 2)] = np.nan
    return x[pos], out_y


def _worst_first(rows: list[UserPhaseSummary]) -> list[UserPhaseSummary]:
    def key(r):
        b = r.bound_dispatch or r.bound_emit
        slack = b.worst.slack_tokens if b is not None and b.worst is not None else float("inf")
        return (r.passed, r.limit_tps is None, slack)

    return sorted(rows, key=key)


def _phases_to_plot(verdict: Verdict, run: RunData) -> dict[int, list[UserPhaseSummary]]:
    """Each phase's rows, for the phases that get a plot of their own: every phase but the
    overhead rounds, and a round only when one of its checks failed."""
    index = {p.key: p.index for p in run.phases}
    failed = {(c.scenario, c.phase, c.engine) for c in verdict.failures}
    out: dict[int, list[UserPhaseSummary]] = {}
    for r in verdict.rows:
        key = (r.scenario, r.phase, r.engine)
        i = index.get(key)
        if i is not None and (not in_rounds(r.role) or key in failed or not r.passed):
            out.setdefault(i, []).append(r)
    return out


def choose(run: RunData, verdict: Verdict, max_users: int = 8) -> list[PhaseFigures]:
    """The phases that get a plot and the users each shows (at most ``max_users`` limited users,
    failing and tightest first; every limited user, by tier, in a phase shown by tier); their figures
    are for ``analysis.plotdata.phase_figures`` to fill."""
    out: list[PhaseFigures] = []
    for p_index, rows in _phases_to_plot(verdict, run).items():
        rows = _worst_first(rows)
        tiered = by_tier(rows)
        limited = [r for r in rows if r.limit_tps][: None if tiered else max_users]
        others = [r for r in rows if not r.limit_tps][:max_users]
        out.append(PhaseFigures(p_index, run.phases[p_index].label, limited, others, tiered))
    return out


def write_plots(run: RunData, figures: list[PhaseFigures], overheads: list[OverheadSummary], out_dir: str | Path,
                max_users: int = 8) -> list[Path]:
    """Draw one plot per phase from its figures (``choose``, then ``analysis.plotdata.phase_figures``)
    and one per overhead scenario; PNGs of earlier layouts left in ``out_dir`` are removed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = out_dir.parent
    written: list[Path] = []
    for f in figures:
        p = run.phases[f.phase_index]
        path = run_dir / plot_file(p.scenario, p.phase, p.engine)
        if f.tiered:
            tightest = (f.limited + f.others)[:max_users]
            written.append(_tier_figure(path, f.label, f.limited, tightest, f.series, f.slack))
        else:
            written.append(_phase_figure(path, f.label, f.limited, f.others, f.series, f.slack))
    for o in overheads:
        if o.round_throughput_tps:
            written.append(_rounds_figure(run_dir / group_plot_file(o.scenario), o))
    for stale in set(out_dir.glob("*.png")) - set(written):
        stale.unlink()
    return written


def _first_ns(series: dict[str, UserSeries]) -> int:
    return min(int(x[0]) for s in series.values() for x in (s.dispatch_t_ns, s.emit_t_ns, s.client_t_ns) if len(x))


def _grid(n: int):
    """A figure of ``n`` panels, two a row: the figure, its axes in order."""
    cols = min(n, 2)
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(PANEL_W_IN * cols, PANEL_H_IN * nrows), squeeze=False)
    return fig, list(axes.flat)


def _save(fig, flat: list, n: int, label: str, path: Path) -> Path:
    """Hide the unused panels, title the figure, write it."""
    for ax in flat[n:]:
        ax.axis("off")
    nrows = max(1, len(flat) // 2)  # two panels a row (one when there is one)
    fig.suptitle(label, fontsize=10, fontweight="bold")
    # fixed margins: tight_layout costs a second on a figure of many axes
    fig.subplots_adjust(left=0.07, right=0.98, top=1 - 0.55 / (PANEL_H_IN * nrows),
                        bottom=1.1 / (PANEL_H_IN * nrows), wspace=0.2, hspace=0.8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _phase_figure(path: Path, label: str, limited: list[UserPhaseSummary], others: list[UserPhaseSummary],
                  series: dict[str, UserSeries], slack: dict[str, UserSlack]) -> Path:
    rows = limited + others
    t0 = _first_ns(series)
    multi = [r for r in rows if r.streams > 1 and (len(series[r.user].dispatch_t_ns) or len(series[r.user].emit_t_ns))]
    n = len(limited) + 1 + bool(multi)
    fig, flat = _grid(n)
    for ax, r in zip(flat, limited):
        _slack_panel(ax, r, slack[r.user], t0)
    _gap_panel(flat[len(limited)], rows, series)
    if multi:
        r = max(multi, key=lambda r: r.streams)
        _streams_panel(flat[len(limited) + 1], r, series[r.user], t0)
    return _save(fig, flat, n, label, path)


def _tier_figure(path: Path, label: str, limited: list[UserPhaseSummary], tightest: list[UserPhaseSummary],
                 series: dict[str, UserSeries], slack: dict[str, UserSlack]) -> Path:
    """One chart per tier with the slack of each of its limited users, then the gaps of the tightest."""
    tiers: dict[str, list[UserPhaseSummary]] = {}
    for r in limited:  # worst first: each tier's first row is its worst
        tiers.setdefault(tier_of(r), []).append(r)
    t0 = _first_ns(series)
    n = len(tiers) + 1
    fig, flat = _grid(n)
    for ax, (tier, members) in zip(flat, tiers.items()):
        _tier_panel(ax, tier, members, slack, t0)
    _gap_panel(flat[len(tiers)], tightest, series)
    return _save(fig, flat, n, label, path)


IDLE_BREAK_S = 0.5  # a tier chart leaves a user's line open across a pause longer than this


def _break_idle(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A NaN between two events further apart than IDLE_BREAK_S: a user's idle stretch is left blank
    rather than drawn as a slope across the chart (with tens of users, a thicket)."""
    gaps = np.flatnonzero(np.diff(x) > IDLE_BREAK_S)
    if not len(gaps):
        return x, y
    return np.insert(x, gaps + 1, x[gaps] + IDLE_BREAK_S / 2), np.insert(y, gaps + 1, np.nan)


def _tier_panel(ax, tier: str, members: list[UserPhaseSummary], slack: dict[str, UserSlack], t0: int) -> None:
    """Every member's slack on both sides (dispatch events, else emit), thin; the worst member and the
    failing ones bold, with their names."""
    named = {r.user for r in members[:4] if r is members[0] or not r.passed}  # failing first: the first few
    for r in members:
        s = slack[r.user]
        bold = r.user in named
        for side, color, what in ((s.upper_dispatch or s.upper_emit, UPPER, "under the bound"),
                                  (s.lower_dispatch or s.lower_emit, LOWER, "above even spacing")):
            if side is None or not len(side.t_ns):
                continue
            x, y = _envelope(*_break_idle((side.t_ns - t0) / 1e9, side.tokens.astype(np.float64)))
            ax.plot(x, y, color=color, lw=1.2 if bold else 0.5, alpha=1.0 if bold else 0.35,
                    linestyle="-" if r.passed else ":",
                    label=f"{r.user} {what}{'' if r.passed else ' (FAIL)'}" if bold else None)
    ax.axhline(0, color="black", lw=0.8)
    limits = sorted({r.limit_tps for r in members})
    failed = sum(not r.passed for r in members)
    users = f"{len(members)} user{'s' if len(members) != 1 else ''}"
    ax.set_title(f"tier {tier}: {users} at {'/'.join(map(str, limits))} tok/s"
                 f"{f', {failed} FAIL' if failed else ''}", fontsize=9, color=UPPER if failed else "black")
    ax.set_xlabel("s since the phase's first token", fontsize=8)
    ax.set_ylabel("tokens to spare (< 0: broken)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)


def _line(ax, s: SlackSeries | None, t0: int, color: str, style: str, label: str) -> None:
    if s is None or not len(s.t_ns):
        return
    x, y = _envelope((s.t_ns - t0) / 1e9, s.tokens)
    ax.plot(x, y, linestyle=style, color=color, lw=1.0 if style == "-" else 0.8,
            alpha=1.0 if style == "-" else 0.6, label=label)


def _span(ax, start_ns: int, end_ns: int, t0: int, color: str, label: str) -> None:
    lo, hi = ax.get_xlim()
    a, b = (start_ns - t0) / 1e9, (end_ns - t0) / 1e9
    width = max(b - a, 0.005 * (hi - lo))  # a window of a few ms stays visible on a phase of minutes
    ax.axvspan(a, a + width, color=color, alpha=0.18, lw=0, label=label)


def _slack_panel(ax, r: UserPhaseSummary, s: UserSlack, t0: int) -> None:
    _line(ax, s.upper_dispatch, t0, UPPER, "-", "under the bound, dispatch")
    _line(ax, s.upper_emit, t0, UPPER, "--", "under the bound, emit")
    _line(ax, s.lower_dispatch, t0, LOWER, "-", "above even spacing, dispatch")
    _line(ax, s.lower_emit, t0, LOWER, "--", "above even spacing, emit")
    ax.axhline(0, color="black", lw=0.8)
    b = r.bound_dispatch or r.bound_emit
    if b is not None and b.worst is not None:
        w = b.worst
        _span(ax, w.start_ns, w.end_ns, t0, UPPER, f"tightest window: {w.tokens} tok in {w.window_s:.3f} s, "
                                                   f"slack {w.slack_tokens:+.2f}")
    sp = r.spacing_dispatch if r.spacing_dispatch is not None and r.spacing_dispatch.worst else r.spacing_emit
    if sp is not None and sp.worst is not None:
        w = sp.worst
        _span(ax, w.start_ns, w.end_ns, t0, LOWER, f"emptiest window: {w.tokens} tok in {w.window_s:.3f} s, "
                                                   f"{w.deficit_tokens:.2f} short of N·W")
    ax.set_title(f"{r.user}: N = {r.limit_tps} tok/s, {r.streams} stream{'s' if r.streams != 1 else ''}"
                 f"{'' if r.passed else '  FAIL'}", fontsize=9, color="black" if r.passed else UPPER)
    ax.set_xlabel("s since the phase's first token", fontsize=8)
    ax.set_ylabel("tokens to spare (< 0: broken)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # under the axes: the lines stay visible
        ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)


def _per_request_gaps(t: np.ndarray, stream: np.ndarray) -> np.ndarray:
    if len(t) < 2:
        return np.empty(0)
    order = np.lexsort((t, stream))
    ts, ss = t[order], stream[order]
    same = ss[1:] == ss[:-1]
    return np.diff(ts)[same]


def _gap_panel(ax, rows: list[UserPhaseSummary], series: dict[str, UserSeries]) -> None:
    for r in rows:
        s = series[r.user]
        for name, g, style in (("emit", _per_request_gaps(s.emit_t_ns, s.emit_request), "-"),
                               ("client", _per_request_gaps(s.client_t_ns, s.client_request), ":")):
            g = g[g > 0] / 1e6
            if len(g):
                g = np.sort(g)
                x, y = _thin(g, np.arange(1, len(g) + 1) / len(g))
                ax.plot(x, y, linestyle=style, lw=1, label=f"{r.user} {name}")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("inter-token gap per request, ms (engine emit, client chunks)", fontsize=8)
    ax.set_ylabel("fraction of gaps ≤ x", fontsize=8)
    ax.set_title("inter-token gaps", fontsize=9)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, loc="lower right")


def _streams_panel(ax, row: UserPhaseSummary, s: UserSeries, t0: int) -> None:
    t, stream = (s.dispatch_t_ns, s.dispatch_stream) if len(s.dispatch_t_ns) else (s.emit_t_ns, s.emit_stream)
    for k in np.unique(stream):
        tk = t[stream == k]
        x, y = _thin((tk - t0) / 1e9, np.arange(1, len(tk) + 1))
        ax.step(x, y, where="post", lw=1, label=f"stream {k}" if k >= 0 else "no stream")
    ax.set_xlabel("s since the phase's first token", fontsize=8)
    ax.set_ylabel("tokens (dispatch events)", fontsize=8)
    spread = "" if row.stream_spread is None else f", spread {row.stream_spread}"
    ax.set_title(f"{row.user}'s streams{spread}", fontsize=9)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper left")


def _rounds_figure(path: Path, o: OverheadSummary) -> Path:
    """Each role's throughput per round, and each pair's per-round ratio with its median (dashed)."""
    rounds = list(o.round_throughput_tps)
    x = np.arange(len(rounds))
    fig, (left, right) = plt.subplots(1, 2, figsize=(2 * PANEL_W_IN, PANEL_H_IN))
    for role in o.throughput_tps:
        y = [o.round_throughput_tps[r].get(role, np.nan) for r in rounds]
        left.plot(x, y, marker="o", ms=4, lw=1, label=f"{role} (pooled {o.throughput_tps[role]:.0f})")
    left.set_ylabel("throughput, tok/s", fontsize=8)
    left.set_title("throughput per round", fontsize=9)
    for i, (pair, p) in enumerate(o.paired.items()):
        color = f"C{i}"
        right.plot([rounds.index(r) for r in p.per_round], list(p.per_round.values()), marker="o", ms=4, lw=1,
                   color=color, label=f"{pair}: median {p.median:.3f} ({p.min:.3f}..{p.max:.3f})")
        right.axhline(p.median, color=color, ls="--", lw=0.8)
    right.axhline(1.0, color="black", lw=0.8)
    right.set_ylabel("throughput ratio a/b", fontsize=8)
    right.set_title("paired ratios per round (dashed: median)", fontsize=9)
    for ax in (left, right):
        ax.set_xticks(x, rounds, fontsize=7)
        ax.set_xlabel("round", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="best")
    fig.suptitle(f"{o.scenario}: {len(rounds)} rounds", fontsize=10, fontweight="bold")
    fig.subplots_adjust(left=0.06, right=0.98, top=0.86, bottom=0.16, wspace=0.2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
