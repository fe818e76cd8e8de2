"""PNG plots (matplotlib, Agg): per phase, each user's cumulative tokens beside the bound,
the inter-token gap CDFs, and one multi-stream user's per-stream timelines."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ratebench.analysis.load import RunData  # noqa: E402
from ratebench.analysis.rates import burst_tokens  # noqa: E402
from ratebench.analysis.series import phase_series  # noqa: E402
from ratebench.analysis.verdict import UserPhaseSummary, Verdict  # noqa: E402
from ratebench.outputs.format import plot_slug  # noqa: E402

MAX_POINTS = 1500  # points per line; longer series are thinned evenly


def _thin(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(x) <= MAX_POINTS:
        return x, y
    idx = np.unique(np.linspace(0, len(x) - 1, MAX_POINTS).astype(np.int64))
    return x[idx], y[idx]


def _rows_by_phase(verdict: Verdict, run: RunData) -> dict[int, list[UserPhaseSummary]]:
    index = {p.key: p.index for p in run.phases}
    out: dict[int, list[UserPhaseSummary]] = {}
    for r in verdict.rows:
        i = index.get((r.scenario, r.phase, r.engine))
        if i is not None:
            out.setdefault(i, []).append(r)
    return out


def _worst_first(rows: list[UserPhaseSummary]) -> list[UserPhaseSummary]:
    def key(r):
        b = r.bound_dispatch or r.bound_emit
        slack = b.worst.slack_tokens if b is not None and b.worst is not None else float("inf")
        return (r.passed, slack)

    return sorted(rows, key=key)


def write_plots(run: RunData, verdict: Verdict, out_dir: str | Path, max_users: int = 8) -> list[Path]:
    """Write the plots of every phase; at most ``max_users`` users per phase (failing and tightest first)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for p_index, rows in _rows_by_phase(verdict, run).items():
        p = run.phases[p_index]
        rows = _worst_first(rows)[:max_users]
        series = phase_series(run, p_index, [r.user for r in rows])
        if not any(len(s.dispatch_t_ns) or len(s.emit_t_ns) or len(s.client_t_ns) for s in series.values()):
            continue
        t0 = min(int(x[0]) for s in series.values() for x in (s.dispatch_t_ns, s.emit_t_ns, s.client_t_ns) if len(x))
        slug = plot_slug(p.scenario, p.phase, p.engine)
        written.append(_cumulative(out_dir / f"cumulative-{slug}.png", p.label, rows, series, t0,
                                   verdict.thresholds.delivery_min, verdict.thresholds.burst_ns))
        written.append(_gap_cdf(out_dir / f"gaps-{slug}.png", p.label, rows, series))
        multi = [r for r in rows if r.streams > 1 and (len(series[r.user].dispatch_t_ns) or len(series[r.user].emit_t_ns))]
        if multi:
            r = max(multi, key=lambda r: r.streams)
            path = _streams(out_dir / f"streams-{slug}.png", p.label, r, series[r.user], t0)
            if path:
                written.append(path)
    return written


def _cumulative(path, label, rows, series, t0, delivery_min, burst_ns) -> Path:
    n = len(rows)
    cols = min(n, 2)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 3.6 * nrows), squeeze=False)
    for ax, r in zip(axes.flat, rows):
        s = series[r.user]
        for name, t, c, style in (("dispatch", s.dispatch_t_ns, None, "-"), ("emit", s.emit_t_ns, s.emit_count, "-"),
                                  ("client", s.client_t_ns, s.client_tokens, ":")):
            if len(t):
                y = np.cumsum(c) if c is not None else np.arange(1, len(t) + 1)
                x, y = _thin((t - t0) / 1e9, y)
                ax.step(x, y, where="post", linestyle=style, label=name)
        first = s.dispatch_t_ns if len(s.dispatch_t_ns) else s.emit_t_ns
        if r.limit_tps and len(first):
            n_lim = r.limit_tps
            xs = np.array([first[0], first[-1]], dtype=np.float64)
            x_s = (xs - t0) / 1e9
            span = (xs - first[0]) / 1e9
            ax.plot(x_s, n_lim * span + n_lim * burst_ns / 1e9 + 1, "r--", lw=1,
                    label=f"bound {n_lim}·t + {n_lim * burst_ns / 1e9:g} + 1")
            b = burst_tokens(n_lim, burst_ns)
            ax.plot(x_s, b + delivery_min * n_lim * span, "k:", lw=1, label=f"delivery {delivery_min:g}·N")
        b = r.bound_dispatch or r.bound_emit
        if b is not None and b.worst is not None:
            w = b.worst
            ax.axvspan((w.start_ns - t0) / 1e9, max((w.end_ns - t0) / 1e9, (w.start_ns - t0) / 1e9 + 1e-3),
                       color="red" if w.slack_tokens < 0 else "grey", alpha=0.15,
                       label=f"worst window: {w.tokens} tok, slack {w.slack_tokens:+.2f}")
        ax.set_title(f"{r.user} (limit {r.limit_tps or 'none'}, {r.streams} stream{'s' if r.streams != 1 else ''})"
                     f"{'' if r.passed else ' FAIL'}", fontsize=9)
        ax.set_xlabel("s since phase's first token")
        ax.set_ylabel("cumulative tokens")
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"Cumulative tokens: {label}", fontsize=10)
    # fixed margins: tight_layout costs a second on a figure of many axes
    fig.subplots_adjust(left=0.08, right=0.98, top=1 - 0.75 / (3.6 * nrows), bottom=0.6 / (3.6 * nrows),
                        wspace=0.22, hspace=0.45)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _per_request_gaps(t: np.ndarray, stream: np.ndarray) -> np.ndarray:
    if len(t) < 2:
        return np.empty(0)
    order = np.lexsort((t, stream))
    ts, ss = t[order], stream[order]
    same = ss[1:] == ss[:-1]
    return np.diff(ts)[same]


def _gap_cdf(path, label, rows, series) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        s = series[r.user]
        for name, g, style in (("emit", _per_request_gaps(s.emit_t_ns, s.emit_request), "-"),
                               ("client", _per_request_gaps(s.client_t_ns, s.client_request), ":")):
            g = g[g > 0] / 1e6
            if len(g):
                g = np.sort(g)
                x, y = _thin(g, np.arange(1, len(g) + 1) / len(g))
                ax.plot(x, y, linestyle=style, label=f"{r.user} {name}")
    ax.set_xscale("log")
    ax.set_xlabel("inter-token gap per request (ms): engine emit events, client chunks")
    ax.set_ylabel("fraction of gaps ≤ x")
    ax.set_title(f"Inter-token gaps: {label}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.subplots_adjust(left=0.1, right=0.97, top=0.92, bottom=0.13)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _streams(path, label, row, s, t0) -> Path | None:
    t, stream = (s.dispatch_t_ns, s.dispatch_stream) if len(s.dispatch_t_ns) else (s.emit_t_ns, s.emit_stream)
    if not len(t) or (stream < 0).all():
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in np.unique(stream):
        tk = t[stream == k]
        x, y = _thin((tk - t0) / 1e9, np.arange(1, len(tk) + 1))
        ax.step(x, y, where="post", label=f"stream {k}")
    ax.set_xlabel("s since phase's first token")
    ax.set_ylabel("tokens (dispatch events)")
    ax.set_title(f"Per-stream tokens of {row.user}: {label} (spread {row.stream_spread})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.subplots_adjust(left=0.1, right=0.97, top=0.92, bottom=0.13)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
