"""Where the scheduler's time goes: py-spy under a real engine, and the microbenchmark.

``ratebench profile-scheduler`` has two parts (``docs/profile-scheduler.md``):

1. **Under a real engine** (:func:`record_engine`): the patched engine of a profile
   with ``--max-num-seqs`` raised to the largest R, a load that keeps R requests
   resident, most of them throttled, and ``py-spy record`` on the EngineCore
   process for a few seconds per R: raw stacks, counted into the shares of samples in
   ``Scheduler.schedule``, the limiter, the rotation and ``update_from_output``; then,
   in a second window, py-spy's own flame graph (``engine/R<r>.svg``) and speedscope
   file (``engine/R<r>.speedscope.json``); :mod:`ratebench.profiling.pyspy` says why.
2. **In-process microbenchmark** (:func:`run_microbench` measures;
   :func:`summarize_microbench` summarises): microseconds per ``schedule()`` call of
   the four variants, as ratios to the feature off, interleaved in rounds.

Plus :func:`breakdown` and :func:`line_breakdown`: where inside ``schedule()`` the
time goes in one microbenchmark variant.

One module per concern; measuring, statistics and presentation never mixed:

    microbench.py   measures schedule() in-process (the four variants, rounds)
    statistics.py   spreads, ratios to "off", warnings, the targets
    breakdown.py    cProfile and py-spy line breakdowns of schedule()
    pyspy.py        can py-spy attach, which process is the EngineCore, the record command
    samples.py      py-spy's collapsed stacks, sorted into the engine table's categories
    load.py         R streams kept resident on an engine
    engine.py       part 1: the engine launched, loaded and recorded for each R
    tables.py       the console tables
    results.py      the output folder and profile-scheduler.json
"""

from ratebench.profiling.breakdown import (
    BREAKDOWN_VARIANTS,
    Breakdown,
    LineBreakdown,
    breakdown,
    line_breakdown,
    patch_added_lines,
)
from ratebench.profiling.engine import (
    ENGINE_PART_FAILED,
    EngineProfileSettings,
    EngineReport,
    ProfilingError,
    failed_engine_report,
    r_values_for,
    record_engine,
)
from ratebench.profiling.microbench import MicrobenchSettings, run_microbench
from ratebench.profiling.pyspy import ptrace_problem
from ratebench.profiling.results import new_out_dir, write_results
from ratebench.profiling.samples import classify_samples, read_collapsed
from ratebench.profiling.statistics import MicrobenchReport, summarize_microbench, target_verdicts
from ratebench.profiling.tables import breakdown_table, engine_table, line_breakdown_table, microbench_table

__all__ = [
    "BREAKDOWN_VARIANTS",
    "Breakdown",
    "ENGINE_PART_FAILED",
    "EngineProfileSettings",
    "EngineReport",
    "LineBreakdown",
    "MicrobenchReport",
    "MicrobenchSettings",
    "ProfilingError",
    "breakdown",
    "breakdown_table",
    "classify_samples",
    "engine_table",
    "failed_engine_report",
    "line_breakdown",
    "line_breakdown_table",
    "microbench_table",
    "new_out_dir",
    "patch_added_lines",
    "ptrace_problem",
    "r_values_for",
    "read_collapsed",
    "record_engine",
    "run_microbench",
    "summarize_microbench",
    "target_verdicts",
    "write_results",
]
