"""report.md and compare.md."""

from __future__ import annotations

import os
from pathlib import Path

from ratebench._io import atomic_write_text
from ratebench.analysis.compare import Comparison
from ratebench.analysis.verdict import OverheadSummary, Verdict
from ratebench.outputs.format import ROW_COLUMNS, check_where, row_cells
from ratebench.outputs.promises import failures_by_promise

DEFINITIONS = """\
- **The bound**: in any window of W seconds a user receives at most `(W + 0.1) * N + 1`
  tokens. Checked exactly, in integer nanoseconds, over every window between two of the
  user's events (equivalent to every window): `max over i <= j of (C_j - 1 - N t_j) - (P_i - N t_i)
  <= 0.1 N`, C and P the inclusive and exclusive token counts. *slack* = allowed - tokens in
  the worst window; negative means broken. On **dispatch** events (the engine's charges) it must
  hold with no tolerance; on **emit** events (tokens appended to the request) every window gets
  the engine's longest step as tolerance; on **client** chunks it is information only.
  Checked per scenario phase and over each engine's whole event file (`*/*` rows), because a
  limiter's state carries across phases.
- **Longest engine step**: the largest dispatch-to-emit latency: each emit event paired with the
  latest dispatch event of its request at or before it, and never later than the k-th dispatch for
  its first token k plus the request's extra charges (dispatch events - emitted tokens), so charges
  that sample nothing do not stretch it, and async scheduling's look-ahead dispatch does not halve it.
- **Seed rate**: tokens / (last token time - first token time), the seed article's method.
- **Steady rate**: `(tokens - b) / (last - first)`, b = floor(0.1 N) + 1 the tokens GCRA lets
  through at once: the rate beyond the initial burst; exactly N for an ideal limiter and a
  backlogged user, never above N when the bound holds. Without a limit: tokens after the first
  0.5 s over the time from there.
- **Delivery**: a backlogged user's steady rate / N, on dispatch events and on emitted tokens;
  both at least the threshold (a limiter that charges without emitting fails on emitted tokens).
- **Charge parity**: for each finished request, dispatch events - emitted tokens = 0 when it
  finished by length (or by stop under synchronous scheduling); 0 or 1 for a stop under async
  scheduling (the look-ahead step), at most the steps already dispatched for an abort (1, 2 with
  async scheduling). The figure: tokens outside that allowance, summed over the user's requests.
- **Inter-token gap, per request**: time between consecutive emit events (engine) or
  token-carrying chunks (client) of one request, pooled over the user's requests in the phase.
  **Per user**: the same over all the user's events merged in time. Percentiles interpolate linearly.
- **Reconciliation**: for every finished request, `usage.completion_tokens` = tokens streamed
  = tokens emitted by the engine = the engine finish event's count (= max_tokens with
  finish_reason "length" under ignore_eos). Requests refused with an error are not counted.
- **Cancellation**: the engine finishes a cancelled request with abort (or had finished it
  already), nothing happens for it after its finish event, and at most the threshold of its emit
  events come after the client's cancel time. Charged tokens: its dispatch events.
- **Isolation**: the unthrottled user's rate (and p99 gap) beside a throttled neighbour
  (`shared`) over its rate alone (`baseline`). **Time to first token**: per request, the first
  token-carrying chunk minus the send time (client; engine side: the first emit event minus the
  send time); its p50 beside the neighbour must be at most `isolation_ttft_factor` x the p50
  alone + `isolation_ttft_slack_ns` (defaults 2 x + 50 ms).
- **Overhead**: the overhead scenario runs its roles (feature-on: limits never reached;
  feature-on-no-events: the same without engine events; feature-off; stock vLLM) interleaved,
  one phase each per round. A phase's throughput = its client tokens / (last token received -
  first request sent). Per pair and round, the ratio of the two roles' throughputs; the figure
  is 1 - the median of those ratios (`overhead` against feature-off and stock,
  `event-recording` against feature-on-no-events), shown with their spread (min..max) and the
  pooled ratio (all tokens / all time of each role). **Engine step p50**: the median over a
  role's phases of the median time from one engine step's emit events to the next's.
- **Stream fairness**: the largest difference between one user's streams' token counts
  (counted from when the last stream started) while all of them are active.
- **Jain's index**: `(sum x)^2 / (n sum x^2)` of the steady rates of backlogged users with equal limits.
"""


def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def render_report(verdict: Verdict, plot_paths: list[Path] | None = None, base_dir: Path | None = None) -> str:
    v = verdict
    ms = v.manifest_summary
    out = [f"# ratebench verdict: {v.outcome}\n\n"]
    out.append(f"Run `{v.run_dir}`, id `{v.run_id}`, profile `{v.profile_name}`.\n")
    n_info = sum(c.passed is None for c in v.checks)
    out.append(f"{len(v.checks) - n_info} checks, {len(v.failures)} failed, {n_info} informational.\n")
    if v.partial:
        out.append(f"\n**PARTIAL**: the run did not complete (state `{ms.get('state')}`); only its completed "
                   f"phases were checked, {len(v.missing_phases)} phases were not (below). A partial verdict "
                   "never passes.\n")
    # what broke first: the failures, under the promise each tests, with where to look
    if v.failures:
        out.append("\n## Failures\n")
        for promise, hints in failures_by_promise(v):
            out.append(f"\n**Broken {promise}**\n\n")
            out.append("".join(f"- **{h.check.name}** {check_where(h.check)}: {h.broke}. {h.check.explanation}. "
                               f"Look: {h.look}.\n" for h in hints))
    if v.missing_phases:
        out.append("\n## Missing phases (not checked)\n\n")
        out.append(_table(["scenario", "phase", "engine", "why"],
                          [(m.scenario, m.phase, m.engine, m.why) for m in v.missing_phases]))
    if v.warnings:
        out.append("\n## Warnings\n\n" + "".join(f"- {w}\n" for w in v.warnings))
    out.append("\n## Run\n\n")
    info = [(k, ms.get(k)) for k in ("state", "ratebench_version", "vllm_version", "git_commit", "patch_sha256",
                                      "python", "machine") if k in ms]
    out.append(_table(["", "value"], [(k, f"`{val}`") for k, val in info]))
    eng_rows = []
    for name, e in (ms.get("engines") or {}).items():
        step = v.engine_steps.get(name)
        longest = f"{step.longest_ns / 1e6:.2f} ms" if step and step.samples else "n/a"
        eng_rows.append((name, e.get("kind"), e.get("feature"), e.get("async_scheduling"), e.get("default_tps"),
                         f"`{e.get('user_tps')}`", longest))
    out.append("\n" + _table(["engine", "kind", "feature", "async", "default tok/s", "overrides", "longest step"],
                             eng_rows))
    th = v.thresholds
    out.append("\nThresholds: " + ", ".join(f"`{k}` = {_fmt(getattr(th, k))}" for k in th.__dataclass_fields__) + "\n")
    out.append("\n## Users by scenario phase" + (" (PARTIAL: the completed phases only)" if v.partial else "")
               + "\n\nRates in tok/s, slack in tokens, gaps in ms.\n\n")
    out.append(_table(ROW_COLUMNS, [row_cells(r) for r in v.rows]))
    out.append("\n## Inter-token gaps and times to first token (ms)\n\n")
    gap_rows = []
    for r in v.rows:
        for label, g in (("emit/request", r.gaps_emit_request), ("emit/user", r.gaps_emit_user),
                         ("client/request", r.gaps_client_request), ("client/user", r.gaps_client_user),
                         ("first token, client", r.ttft_client), ("first token, engine", r.ttft_engine)):
            if g is not None:
                gap_rows.append((f"{r.scenario}/{r.phase}", r.engine, r.user, label, g.count,
                                 *(f"{x / 1e6:.2f}" for x in (g.min_ns, g.p50_ns, g.p90_ns, g.p99_ns, g.max_ns))))
    out.append(_table(["scenario/phase", "engine", "user", "gaps", "n", "min", "p50", "p90", "p99", "max"], gap_rows))
    if v.engine_bounds:
        out.append("\n## The bound over each engine's whole event file\n\n")
        rows = []
        for eb in v.engine_bounds:
            for label, b in (("dispatch", eb.dispatch), ("emit", eb.emit)):
                if b is not None and b.worst is not None:
                    w = b.worst
                    rows.append((eb.engine, eb.user, eb.limit_tps, label, b.events, b.tokens,
                                 f"{w.window_s:.3f}", w.tokens, f"{w.allowed_tokens:.2f}", f"{w.slack_tokens:+.3f}",
                                 "pass" if b.passed else "FAIL"))
        out.append(_table(["engine", "user", "limit", "on", "events", "tokens", "worst W s", "tokens in W",
                           "allowed", "slack", "result"], rows))
    if v.overheads:
        out.append("\n## Overhead\n\n")
        for o in v.overheads:
            out.append(_overhead_tables(o))
    out.append("\n## Checks\n\n")
    order = {"fail": 0, "pass": 1, "info": 2}
    checks = sorted(v.checks, key=lambda c: order[c.status])
    out.append(_table(["status", "check", "where", "figure", "threshold", "explanation"],
                      [(c.status.upper() if c.status == "fail" else c.status, c.name, check_where(c),
                        f"{_fmt(c.figure)} {c.unit}", f"{c.op} {_fmt(c.threshold)}", c.explanation) for c in checks]))
    if plot_paths:
        out.append("\n## Plots\n\n")
        for p in plot_paths:
            rel = os.path.relpath(p, base_dir) if base_dir else p
            out.append(f"![{Path(p).stem}]({rel})\n\n")
    out.append("\n## Definitions\n\n" + DEFINITIONS)
    return "".join(out)


def _overhead_tables(o: OverheadSummary) -> str:
    """Per pair the per-round ratios' median and spread beside the pooled ratio; per role and round
    the throughput."""
    rows = [(pair, f"{p.median:.3f}", f"{p.min:.3f}..{p.max:.3f}", p.rounds, f"{o.ratios[pair]:.3f}",
             " ".join(f"{r}: {x:.3f}" for r, x in p.per_round.items()))
            for pair, p in o.paired.items()]
    rows += [(pair, "-", "-", 0, f"{ratio:.3f}", "") for pair, ratio in o.ratios.items() if pair not in o.paired]
    text = f"Scenario `{o.scenario}`: throughput ratios, paired round by round.\n\n"
    text += _table(["pair", "median", "spread", "rounds", "pooled", "per round"], rows)
    rounds = list(o.round_throughput_tps)
    roles = list(o.throughput_tps)
    role_rows = []
    for role in roles:
        step = o.step_p50_ns.get(role)
        role_rows.append((role, o.tokens.get(role), f"{o.throughput_tps[role]:.1f}",
                          "-" if step is None else f"{step / 1e6:.3f}",
                          *(_fmt_tps(o.round_throughput_tps[r].get(role)) for r in rounds)))
    text += "\nThroughput in tok/s (all rounds pooled, then each round); engine step p50 in ms.\n\n"
    text += _table(["role", "tokens", "pooled", "engine step p50", *rounds], role_rows)
    if o.round_other_cpu:
        text += ("\nCPUs that processes outside the run kept busy, on average over each phase "
                 "(a busy machine makes that round's ratios say less).\n\n")
        text += _table(["role", *rounds], [(role, *(_fmt_cpus(o.round_other_cpu.get(r, {}).get(role)) for r in rounds))
                                           for role in roles])
    return text


def _fmt_cpus(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _fmt_tps(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


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
