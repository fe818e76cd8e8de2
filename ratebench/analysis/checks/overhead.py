"""Overhead: with the feature on and limits never reached, the limiter costs little throughput
against the feature off and against stock vLLM; with the feature off, the patched engine costs little
against stock vLLM (promise 7); recording engine events costs little (checks overhead, feature-off-cost,
event-recording)."""

from __future__ import annotations

from ratebench.analysis.checks.base import CheckMeaning, meanings, per_run
from ratebench.analysis.load import RunData
from ratebench.analysis.overhead import EVENTS_PAIR, ROLE_OFF, ROLE_ON, ROLE_STOCK
from ratebench.analysis.runsummary import RunSummary
from ratebench.analysis.thresholds import for_phase, phase_param_of
from ratebench.analysis.verdict import Check, Thresholds

MEANINGS = meanings({
    "overhead": CheckMeaning("overhead", "with limits never reached, the limiter costs more throughput than "
                             "allowed against the limiter off or stock vLLM",
                             "report.md, Overhead: the ratios' spread and the CPUs other processes took; the rounds' "
                             "plot; verdict.json, overheads: each round", also=("7",)),
    "feature-off-cost": CheckMeaning("7", "with the limiter off, the patched engine served less throughput than "
                                     "stock vLLM by more than allowed: the patch costs even when it is off",
                                     "report.md, Overhead: the feature-off/stock rounds; verdict.json, overheads",
                                     also=("overhead",)),
    "event-recording": CheckMeaning("events", "recording engine events costs more throughput than allowed",
                                    "report.md, Overhead: the feature-on/feature-on-no-events rounds"),
})


# the patched engine with the limiter off against stock vLLM (promise 7: off, it is upstream), judged
# with the same threshold as the limiter's own overhead
OFF_PAIR = f"{ROLE_OFF}/{ROLE_STOCK}"


@per_run(90)
def overhead(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    return _overhead(run, s, th)


def _scenario_params(run: RunData, scenario: str) -> dict:
    """The parameters of the overhead scenario's phases (the first that states a max_overhead)."""
    for p in run.phases:
        if p.scenario == scenario and p.params.get(phase_param_of("max_overhead")) is not None:
            return p.params
    return {}


def _overhead(run: RunData, s: RunSummary, th: Thresholds) -> list[Check]:
    """feature-on against each other role: 1 - the median of the per-round throughput ratios, judged
    against ``--max-overhead`` or else the scenario's ``max_overhead`` (the profile's), if either is given."""
    out = []
    for o in s.overheads:
        overhead_limit = for_phase(th, "max_overhead", _scenario_params(run, o.scenario))
        for pair, pooled in o.ratios.items():
            if not pair.startswith(f"{ROLE_ON}/") and pair != OFF_PAIR:
                continue
            a, b = pair.split("/")
            paired = o.paired.get(pair)
            ratio = paired.median if paired is not None else pooled
            overhead = 1 - ratio
            name, limit = ("event-recording", th.max_event_overhead) if pair == EVENTS_PAIR else \
                ("feature-off-cost", overhead_limit) if pair == OFF_PAIR else ("overhead", overhead_limit)
            source = "--max-event-overhead" if name == "event-recording" else \
                "--max-overhead" if th.max_overhead is not None else "the profile's max_overhead"
            passed = None if limit is None else overhead <= limit
            if paired is not None:
                text = (f"median of {paired.rounds} per-round throughput ratios {a}/{b} {paired.median:.3f} "
                        f"(spread {paired.min:.3f}..{paired.max:.3f}), pooled {pooled:.3f}")
            else:
                text = f"no round ran both: pooled ratio {pooled:.3f}"
            text += f"; throughput over all rounds {a} {o.throughput_tps[a]:.1f} vs {b} {o.throughput_tps[b]:.1f} tok/s"
            if a in o.step_p50_ns and b in o.step_p50_ns:
                text += (f"; engine step p50 {o.step_p50_ns[a] / 1e6:.3f} ms vs "
                         f"{o.step_p50_ns[b] / 1e6:.3f} ms")
            text += f"; at most {limit:g} ({source})" if limit is not None else "; report only (no threshold given)"
            out.append(Check(name, o.scenario, pair, "*", None, round(overhead, 4), limit, "<=", "fraction", passed,
                             text))
    return out
