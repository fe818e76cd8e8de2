"""What report.md and report.html say, in order, as plain blocks each format renders.

The order: the verdict (its headline: the outcome, the broken promises, the promises exercised and
not); the failures, by the promise each broke; a partial run's missing
phases; warnings; the run; the phases of many users by tier (the worst user of each check) and
their latency by tier beside their baseline; the users table (the overhead rounds collapsed into
the overhead table of paired ratios, the passing users of the phases of many users into their
tiers: verdict.json keeps every row); inter-token gaps; the whole-file bound (by tier for many
users); the promises, exercised or not; the checks, one row per kind; the plots; the definitions. Inline text may hold ``**bold**``
and ```code``` (markdown's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ratebench.analysis.verdict import Check, OverheadSummary, Verdict
from ratebench.outputs.format import ROW_COLUMNS, check_where, in_rounds, overrides_text, row_cells, threshold_items
from ratebench.outputs.promises import failures_by_promise, headline, meaning, promise_coverage
from ratebench.outputs.tiers import (
    LATENCY_HEADER,
    LATENCY_INTRO,
    figure_text,
    latency_tables,
    phases_by_tier,
    tier_lines,
    tier_of,
)


@dataclass
class Outcome:
    """The verdict's word: the report's title."""

    outcome: str  # PASS, FAIL, PARTIAL or FAIL (PARTIAL)
    headline: str = ""  # the title: the outcome, broken promises, promises exercised (promises.headline)


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Text:
    text: str  # one paragraph


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    path: Path  # the PNG
    rel: str  # its path from the report
    alt: str


Block = Outcome | Heading | Text | Bullets | Table | Image

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
- **Even spacing**: the lower side. A backlogged user whose budget limits it gets at least
  `N * W - A` tokens in every window W of its backlog, `A = 1 + N * (P + slack)`, P the phase's
  longest step period (`ratebench/analysis/spacing.py`). The figure: the emptiest window's
  shortfall against N * W, in tokens.
- **Slack over time** (the plots): at each of a user's events, the tokens under the bound in the
  tightest window ending there (`0.1 N - (a_j - min over i <= j of a_i)`, `a_k = k - N t_k`; on emit
  events with the step tolerance), and the tokens above even spacing in the emptiest window ending
  there (`A` less its shortfall), only where the budget limited the user. Each line's lowest point is
  the verdict's figure; below 0 that side is broken.
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
- **Isolation**, for every user whose limit did not bind, in every phase with a baseline (the
  `isolation` and `kv-pressure` scenarios' user against its solo phase; a `mix` against
  `mix-baseline`, the same requests on the limiter-off engine). **Did not bind**: the limiter-on
  engine recorded no refuse event (a charge refused, the user out of budget) for the user in the
  phase; an event file with no refuse event and no step records cannot tell, and then only the
  scenario's own user and the tiers marked `isolated` are judged, the rest shown for information
  with the reason. Outside a mix per user; in a mix per tier, pooled over its unbound users.
  **Time to first token**: per request, the first token-carrying chunk minus the send time;
  **end-to-end**: the last chunk minus the send time, answers that ended by themselves;
  **inter-token gap**: between one request's consecutive chunks (all three on the engine's emit
  events when the client recorded no chunks). Each at p50, p90 and p99 at most factor x the
  baseline's + slack (1.5 x + 20 ms first token and gap, 1.5 x + 50 ms end to end); a quantile
  with fewer than 10 (p90) or 100 (p99) samples on either phase is information only. **Rate**:
  the unit's tokens over its first to last token, at least `isolation_min` (0.9) x the baseline's.
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

PLOTS_INTRO = (
    "One plot per scenario phase; the overhead rounds share one (each role's throughput per round, each "
    "pair's per-round ratio beside its median). A phase's plot has one panel per limited user: the slack "
    "over time on both sides of the promise, in tokens, below 0 broken. **Red**: tokens under the bound "
    "in the tightest window ending at each moment (solid on dispatch events, dashed on emit events with "
    "the step tolerance). **Blue**: tokens above even spacing (`N * W` less the allowance) in the emptiest "
    "window ending there, only where the budget, not the engine, limited the user. Shaded: the bound's "
    "tightest window (red) and even spacing's emptiest (blue), as the verdict reports them. Then the "
    "inter-token gap CDFs and the per-stream tokens of the user with the most streams. A `mix` phase's "
    "plot (or a phase of more than a dozen users) has one panel per tier instead: every limited user of "
    "the tier on one chart, thin, with the worst user and the first failing ones bold and named (dotted "
    "when failing; dispatch events, emit where there are none; a pause of over 0.5 s left blank); then the gaps of "
    "the tightest users."
)


def _definitions() -> Bullets:
    items = [" ".join(line.strip() for line in item.splitlines()) for item in DEFINITIONS[2:].split("\n- ")]
    return Bullets(items)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def report_blocks(verdict: Verdict, plot_paths: list[Path] | None = None,
                  base_dir: Path | None = None) -> list[Block]:
    """The report's content, in order (``plot_paths`` relative to ``base_dir`` in the text)."""
    v = verdict
    ms = v.manifest_summary
    coverage = promise_coverage(v)
    out: list[Block] = [Outcome(v.outcome, headline(v, coverage))]
    n_info = sum(c.passed is None for c in v.checks)
    out.append(Text(f"Run `{v.run_dir}`, id `{v.run_id}`, profile `{v.profile_name}`. "
                    f"{len(v.checks) - n_info} checks, {len(v.failures)} failed, {n_info} informational."))
    if v.partial:
        out.append(Text(f"**PARTIAL**: the run did not complete (state `{ms.get('state')}`); only its completed "
                        f"phases were checked, {len(v.missing_phases)} phases were not (below). A partial verdict "
                        "never passes."))
    # what broke first: the failures, under the promise each tests, with where to look
    if v.failures:
        out.append(Heading(2, "Failures"))
        for promise, hints in failures_by_promise(v):
            out.append(Text(f"**Broken {promise}**"))
            out.append(Bullets([f"**{h.check.name}** {check_where(h.check)}: {h.broke}. {h.check.explanation}. "
                                f"Look: {h.look}." for h in hints]))
    if v.missing_phases:
        out.append(Heading(2, "Missing phases (not checked)"))
        out.append(Table(["scenario", "phase", "engine", "why"],
                         [[m.scenario, m.phase, m.engine, m.why] for m in v.missing_phases]))
    if v.warnings:
        out += [Heading(2, "Warnings"), Bullets(list(v.warnings))]
    out += _run(v)
    out += _tiers(v)
    out += _tier_latency(v)
    out += _users(v)
    for o in v.overheads:
        out += _overhead(v, o)
    out += _gaps(v)
    out += _whole_file_bounds(v)
    out += _promises(coverage)
    out += _checks(v)
    if plot_paths:
        out += [Heading(2, "Plots"), Text(PLOTS_INTRO)]
        for p in plot_paths:
            p = Path(p)
            out.append(Image(p, os.path.relpath(p, base_dir) if base_dir else str(p), p.stem))
    out += [Heading(2, "Definitions"), _definitions()]
    return out


def _promises(coverage) -> list[Block]:
    """Every promise the verdict counts: exercised by this run's phases or not, and how that was decided."""
    rows = [[p.name, "yes" if p.exercised else "**no**", str(p.checks_judged),
             f"**{p.checks_failed}**" if p.checks_failed else "0", p.how, p.words] for p in coverage]
    return [Heading(2, "Promises"),
            Text("A promise is exercised when at least one check guarding it was judged (passed or failed, not "
                 "information only) in this run; sync and async scheduling when checks were judged on both a "
                 "synchronous and an asynchronous limiter-on engine (its event file's header, else its name). "
                 "`ratebench/outputs/promises.py` maps each check to the promises it guards."),
            Table(["promise", "exercised", "checks judged", "failed", "how decided", "in words"], rows)]


def _run(v: Verdict) -> list[Block]:
    ms = v.manifest_summary
    info = [[k, f"`{ms.get(k)}`"] for k in ("state", "ratebench_version", "vllm_version", "git_commit",
                                            "patch_sha256", "python", "machine") if k in ms]
    eng_rows = []
    for name, e in (ms.get("engines") or {}).items():
        step = v.engine_steps.get(name)
        longest = f"{step.longest_ns / 1e6:.2f} ms" if step and step.samples else "n/a"
        eng_rows.append([name, _fmt(e.get("kind")), _fmt(e.get("feature")), _fmt(e.get("async_scheduling")),
                         _fmt(e.get("default_tps")), overrides_text(e.get("user_tps")), longest])
    return [Heading(2, "Run"), Table(["", "value"], info),
            Table(["engine", "kind", "feature", "async", "default tok/s", "overrides: tok/s (users)", "longest step"],
                  eng_rows),
            Text("Thresholds: " + ", ".join(f"`{k}` = {x}" for k, x in threshold_items(v.thresholds)))]


def _shown(v: Verdict):
    """The rows the tables show: all but the overhead rounds' and the phases of many users' (their tiers
    stand for them); a failing one stays."""
    tiered = set(phases_by_tier(v.rows))
    return [r for r in v.rows if not r.passed or not (in_rounds(r.role) or (r.scenario, r.phase, r.engine) in tiered)]


def _tiers(v: Verdict) -> list[Block]:
    """Each phase of many users (a mix) by tier: the worst user of each check; every user is below."""
    lines = [line for members in phases_by_tier(v.rows).values() for line in tier_lines(v, members)]
    if not lines:
        return []
    checks = list(dict.fromkeys(name for line in lines for name in line.worst))

    def cell(line, name: str) -> str:
        w = line.worst.get(name)
        if w is None:
            return "-"
        failed = f", **{w.failed} of {w.checked} FAIL**" if w.failed else ""
        return f"{figure_text(w.figure)} ({w.user}{failed})"

    rows = [[f"{x.scenario}/{x.phase}", x.engine, x.tier, str(len(x.users)),
             x.limits_text, str(x.streamed_tokens),
             "pass" if x.passed else f"FAIL ({_some(x.failed_users)})", *(cell(x, n) for n in checks)]
            for x in lines]
    return [Heading(2, "Users by tier"),
            Text("A phase of many users (a `mix`, or more than a dozen users) by tier: for each check, the "
                 "figure of the tier's user furthest from its threshold (or past it), and that user. Its failing "
                 "users' rows are in the users table below; verdict.json has every user's row."),
            Table(["scenario/phase", "engine", "tier", "users", "N", "tokens", "result", *checks], rows)]


def _tier_latency(v: Verdict) -> list[Block]:
    """Each many-user phase's tiers, the limiter-on phase beside its baseline, as vllm bench serve prints."""
    tables = latency_tables(v)
    if not tables:
        return []
    rows = [[f"{x.line.scenario}/{x.phase}", x.engine, x.line.tier, str(len(x.line.users)), x.limits_text,
             *x.cells()] for members in tables.values() for x in members]
    return [Heading(2, "Latency by tier"), Text(LATENCY_INTRO),
            Table(["scenario/phase", "engine", "tier", "users", "N", *LATENCY_HEADER], rows)]


def _some(users: list[str], most: int = 5) -> str:
    """The first few names, and how many more."""
    more = f" and {len(users) - most} more" if len(users) > most else ""
    return ", ".join(users[:most]) + more


def _users(v: Verdict) -> list[Block]:
    shown = _shown(v)
    out: list[Block] = [Heading(2, "Users by scenario phase" + (" (PARTIAL: the completed phases only)"
                                                               if v.partial else ""))]
    if shown:
        out += [Text("Rates in tok/s, slack in tokens, gaps in ms."),
                Table(list(ROW_COLUMNS), [row_cells(r) for r in shown])]
    hidden = {(r.scenario, r.phase, r.engine) for r in v.rows if in_rounds(r.role)} - \
        {(r.scenario, r.phase, r.engine) for r in shown}
    if hidden:
        scenarios = sorted({s for s, _, _ in hidden})
        out.append(Text(f"The {len(hidden)} passing phases of the overhead rounds (scenario "
                        f"{', '.join(f'`{s}`' for s in scenarios)}) are collapsed into the overhead table below; "
                        "verdict.json has each round's rows."))
    tiered = phases_by_tier(v.rows)
    if tiered:
        passing = sum(r.passed for members in tiered.values() for r in members)
        out.append(Text(f"The {passing} passing users of the {len(tiered)} phases of many users ("
                        + ", ".join(f"`{s}/{p}@{e}`" for s, p, e in tiered)
                        + ") are collapsed into their tiers (Users by tier, Latency by tier, above); only their "
                          "failing users have a row here and in the gaps table; verdict.json has every user's row."))
    return out


def _overhead(v: Verdict, o: OverheadSummary) -> list[Block]:
    """Per pair the per-round ratios' median and spread beside the pooled ratio; per role its pooled
    throughput and step time. Each round's figures are in verdict.json."""
    rows = [[pair, f"{p.median:.3f}", f"{p.min:.3f}..{p.max:.3f}", str(p.rounds), f"{p.pooled:.3f}"]
            for pair, p in o.paired.items()]
    rows += [[pair, "-", "-", "0", f"{ratio:.3f}"] for pair, ratio in o.ratios.items() if pair not in o.paired]
    rounds = len(o.round_throughput_tps)
    role_rows = []
    for role in o.throughput_tps:
        step = o.step_p50_ns.get(role)
        ran = sum(role in r for r in o.round_throughput_tps.values())
        other = [c[role] for c in o.round_other_cpu.values() if role in c]
        role_rows.append([role, str(ran), _fmt(o.tokens.get(role)), f"{o.throughput_tps[role]:.1f}",
                          "-" if step is None else f"{step / 1e6:.3f}", f"{max(other):.2f}" if other else "-"])
    return [
        Heading(2, f"Overhead (scenario `{o.scenario}`)"),
        Text(f"Throughput ratios a/b over {rounds} rounds, paired round by round: the median of the per-round "
             "ratios (the figure the checks use), their spread (min..max), and the pooled ratio (all tokens over "
             "all time of each role). verdict.json has each round's ratios and throughputs."),
        Table(["pair a/b", "median", "spread", "rounds", "pooled"], rows),
        Text("Per role: throughput in tok/s over all rounds, the median engine step in ms, and the most CPUs that "
             "processes outside the run kept busy in any of its phases (a busy machine makes that round say less)."),
        Table(["role", "rounds", "tokens", "pooled tok/s", "engine step p50", "other CPUs, max"], role_rows),
    ]


def _gaps(v: Verdict) -> list[Block]:
    rows = []
    for r in _shown(v):
        for label, g in (("emit/request", r.gaps_emit_request), ("emit/user", r.gaps_emit_user),
                         ("client/request", r.gaps_client_request), ("client/user", r.gaps_client_user),
                         ("first token, client", r.ttft_client), ("first token, engine", r.ttft_engine)):
            if g is not None:
                rows.append([f"{r.scenario}/{r.phase}", r.engine, r.user, label, str(g.count),
                             *(f"{x / 1e6:.2f}" for x in (g.min_ns, g.p50_ns, g.p90_ns, g.p99_ns, g.max_ns))])
    head = Heading(2, "Inter-token gaps and times to first token (ms)")
    if not rows:  # every user is in a phase of many users, and passed
        return [head, Text("Every user's gaps are in verdict.json; by tier, see Latency by tier above.")]
    return [head, Table(["scenario/phase", "engine", "user", "gaps", "n", "min", "p50", "p90", "p99", "max"], rows)]


def _whole_file_bounds(v: Verdict) -> list[Block]:
    """Per engine and user; the users of the phases of many users by tier: each tier's tightest user on
    each side, and every failing one (verdict.json has every user)."""
    tier: dict[tuple[str, str], str] = {}  # (engine, user) -> its tier, for the users of a phase of many users
    for members in phases_by_tier(v.rows).values():
        for r in members:
            tier.setdefault((r.engine, r.user), tier_of(r))
    # (engine, tier, side) -> the tier's users on that side, and the tightest
    users: dict[tuple[str, str, str], int] = {}
    tightest: dict[tuple[str, str, str], tuple[float, str]] = {}
    for eb in v.engine_bounds:
        t = tier.get((eb.engine, eb.user))
        for label, b in (("dispatch", eb.dispatch), ("emit", eb.emit)):
            if t is not None and b is not None and b.worst is not None:
                key = (eb.engine, t, label)
                users[key] = users.get(key, 0) + 1
                if key not in tightest or b.worst.slack_tokens < tightest[key][0]:
                    tightest[key] = (b.worst.slack_tokens, eb.user)
    rows = []
    for eb in v.engine_bounds:
        t = tier.get((eb.engine, eb.user))
        for label, b in (("dispatch", eb.dispatch), ("emit", eb.emit)):
            if b is None or b.worst is None:
                continue
            who = eb.user
            if t is not None:
                key = (eb.engine, t, label)
                if tightest[key][1] != eb.user and b.passed:
                    continue  # by tier: its tightest user stands for it
                if tightest[key][1] == eb.user and users[key] > 1:
                    who = f"{eb.user} (tightest of tier {t}, {users[key]} users)"
            w = b.worst
            rows.append([eb.engine, who, str(eb.limit_tps), label, str(b.events), str(b.tokens),
                         f"{w.window_s:.3f}", str(w.tokens), f"{w.allowed_tokens:.2f}", f"{w.slack_tokens:+.3f}",
                         "pass" if b.passed else "FAIL"])
    if not rows:
        return []
    out: list[Block] = [Heading(2, "The bound over each engine's whole event file")]
    if tier:
        out.append(Text("The users of the phases of many users by tier: each tier's tightest user (least slack) on "
                        "each side, and every failing one; verdict.json has every user's."))
    return out + [Table(["engine", "user", "limit", "on", "events", "tokens", "worst W s", "tokens in W", "allowed",
                         "slack", "result"], rows)]


def _margin(c: Check) -> float | None:
    """How far a judged check's figure is from its threshold, on its passing side (negative: failed)."""
    if c.passed is None or not isinstance(c.figure, (int, float)) or not isinstance(c.threshold, (int, float)):
        return None
    if c.op == ">=":
        return c.figure - c.threshold
    if c.op == "<=":
        return c.threshold - c.figure
    return None


def _checks(v: Verdict) -> list[Block]:
    """One row per kind of check: how many passed, failed, informed, and the closest call."""
    kinds: dict[str, list[Check]] = {}
    for c in v.checks:
        kinds.setdefault(c.name, []).append(c)
    rows = []
    for name, checks in kinds.items():
        judged = [(m, c) for c in checks if (m := _margin(c)) is not None]
        figures = [c.figure for c in checks if isinstance(c.figure, (int, float))]
        closest = "-"
        if judged:
            _, c = min(judged, key=lambda mc: mc[0])
            closest = f"{_fmt(c.figure)} {c.unit} {c.op} {_fmt(c.threshold)}: {check_where(c)}"
        elif figures:  # informational only: the range of its figures
            closest = f"{_fmt(min(figures))}..{_fmt(max(figures))} {checks[0].unit} (information)"
        rows.append([name, meaning(name).promise, str(sum(c.passed is True for c in checks)),
                     str(sum(c.passed is False for c in checks)),
                     str(sum(c.passed is None for c in checks)), closest])
    rows.sort(key=lambda r: (r[3] == "0", r[0]))
    return [Heading(2, "Checks"),
            Text(f"{len(v.checks)} checks of {len(kinds)} kinds, one row per kind: how many passed, failed and "
                 "informed, and the closest call (the figure nearest its threshold, and where; for a check that only "
                 "informs, the range of its figures). The failed ones "
                 "are under Failures above; verdict.json has every check with its explanation."),
            Table(["check", "promise", "pass", "FAIL", "info", "closest call"], rows)]
