"""Broken limiters as test fixtures, and the adapter that turns a run of the real
patched scheduler (tests/sched_harness.py) into a run folder for the verifier.

Never shipped, never a patch a user could apply: tests/test_mutants.py and
tests/test_mutants_e2e.py use them to show that verify-bound says no.
"""

from mutants.runfolder import HarnessRun, Mutant, Phase, Stream, Workload, run_workload

__all__ = ["HarnessRun", "Mutant", "Phase", "Stream", "Workload", "run_workload"]
