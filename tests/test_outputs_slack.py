"""The slack plot: both sides of the promise over time, whose lowest points are the verdict's figures."""

from __future__ import annotations

import numpy as np
import pytest

from ratebench.analysis.bound import check_bound
from ratebench.analysis.slack import bound_slack, phase_slack, spacing_margin
from ratebench.outputs.plots import MAX_POINTS, _envelope
from synth import standard_run
from ratebench.verify import analyse_run, verify_run
from synthetic_runs import one_phase_run


def _by_phase(result):
    index = {p.key: p.index for p in result.run.phases}
    out = {}
    for r in result.verdict.rows:
        out.setdefault(index[(r.scenario, r.phase, r.engine)], []).append(r)
    return out


@pytest.mark.parametrize("limiter", ["gcra", "burst-1s", "half-rate"])
def test_each_lines_lowest_point_is_the_verdicts_figure(tmp_path, limiter):
    result = analyse_run(standard_run(tmp_path / "run", limiter=limiter, overhead=False))
    slack_ns = result.verdict.thresholds.spacing_slack_ns
    seen_lower = 0
    for p_index, rows in _by_phase(result).items():
        sides = phase_slack(result.run, p_index, rows, slack_ns)
        for r in rows:
            if not r.limit_tps:
                continue
            s = sides[r.user]
            for line, b in ((s.upper_dispatch, r.bound_dispatch), (s.upper_emit, r.bound_emit)):
                assert np.nanmin(line.tokens) == pytest.approx(b.worst.slack_tokens, abs=1e-9)
            for line, sp in ((s.lower_dispatch, r.spacing_dispatch), (s.lower_emit, r.spacing_emit)):
                if sp is None or sp.worst is None:
                    continue
                seen_lower += 1
                expected = sp.allowance_tokens(slack_ns) - sp.worst.deficit_tokens
                assert np.nanmin(line.tokens) == pytest.approx(expected, abs=1e-9)
    assert seen_lower >= 4


def test_running_slack_of_an_even_user_stays_within_the_burst_and_a_burst_goes_below_zero():
    n = 10
    even = np.arange(50, dtype=np.int64) * 100_000_000  # 10 tok/s exactly
    s = bound_slack(even, None, n, burst_ns=100_000_000)
    assert s.tokens[0] == pytest.approx(1.0) and np.all(s.tokens >= -1e-12) and np.all(s.tokens <= 1.0)
    burst = np.r_[np.zeros(5, dtype=np.int64), even[5:]]  # five tokens at once: 3 over 0.1 * 10 + 1
    s = bound_slack(burst, None, n, burst_ns=100_000_000)
    assert s.tokens.min() == pytest.approx(check_bound(burst, n).worst.slack_tokens) == pytest.approx(-3.0)


def test_even_spacing_margin_is_drawn_only_where_the_budget_limited_the_user():
    n = 10
    t = np.r_[np.arange(10), np.arange(20, 30)].astype(np.int64) * 100_000_000
    req = np.zeros(len(t), dtype=np.int64)
    req[10:] = 1
    steps = (t.copy(), np.full(len(t), 100_000_000), np.ones(len(t), dtype=bool))
    steps[2][9] = False  # the engine waited after the first request: two runs of steps
    m = spacing_margin(t, req, None, n, 2.0, steps)
    assert np.isnan(m.tokens).sum() == 2  # one break after each run
    finite = m.tokens[np.isfinite(m.tokens)]
    assert finite == pytest.approx(np.full(len(finite), 1.0))  # N * 0.1 s - 0 tokens between neighbours
    assert not ((m.t_ns > t[9]) & (m.t_ns < t[10])).any()  # nothing drawn in the gap


def test_thinning_keeps_a_one_event_dip():
    x = np.arange(100_000, dtype=np.float64)
    y = np.ones_like(x)
    y[54_321] = -7.0
    tx, ty = _envelope(x, y)
    assert len(tx) <= MAX_POINTS + 2 and ty.min() == -7.0 and 54_321.0 in tx
    assert np.all(np.diff(tx) >= 0)


def test_a_phase_plot_has_a_slack_panel_per_limited_user_then_gaps_and_streams(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    run = one_phase_run(tmp_path / "run", limiter="burst-1s", streams=2)
    titles = []
    original = plt.Figure.savefig

    def spy(fig, *a, **kw):
        titles.append([ax.get_title() for ax in fig.axes])
        return original(fig, *a, **kw)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    verify_run(run)
    (panels,) = titles
    assert panels[:2] == ["user-a: N = 50 tok/s, 2 streams  FAIL", "inter-token gaps"]
    assert panels[2].startswith("user-a's streams")
