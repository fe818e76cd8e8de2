"""Promise 7, feature off = upstream, as a run judges it: ``ratebench.upstream_replay`` drives the
installed scheduler with the limiter off and upstream's through the same requests, in a child process
with the engines' environment, and verify-bound's ``feature-off-upstream`` check judges the result.

Broken limiter-off paths are injected the way the end-to-end mutants are (a ``sitecustomize.py`` first
on the child's ``PYTHONPATH`` changes vLLM's scheduler module as it is imported); the real scheduler,
KV manager and request objects do the rest. Each must fail the check, and only it, where the patch as
shipped passes."""

from __future__ import annotations

import json
import shutil

import pytest

from mutants import Phase, Stream, Workload, run_workload
from mutants.hooks import break_on_import
from ratebench.upstream_replay import FILE, first_difference, run_replay
from ratebench.verify import verify_run

pytestmark = pytest.mark.usefixtures("patched_vllm")

MARKER = "ratebench test mutant: the limiter-off scheduler"

# with the limiter off, when every running request fits the step, running is rotated by one: the same
# requests are scheduled at every step as upstream, in another order (the batch the worker builds)
ROTATES_RUNNING = '''
cls = module.Scheduler
shipped = cls.schedule

def schedule(self, *args, **kwargs):
    if getattr(self, "output_rate_limiter", None) is None and 1 < len(self.running) <= 6 and not self.waiting:
        self.running.append(self.running.pop(0))
    return shipped(self, *args, **kwargs)

cls.schedule = schedule
'''

# with the limiter off, a request that names a user goes to the front of the FCFS queue (a queue keyed by
# user left switched on)
USERS_FIRST = '''
cls = module.Scheduler
shipped = cls.add_request

def add_request(self, request, *args, **kwargs):
    shipped(self, request, *args, **kwargs)
    if (getattr(self, "output_rate_limiter", None) is None and request.output_rate_user != "__anonymous__"
            and request in self.waiting and hasattr(self.waiting, "prepend_request")):
        self.waiting.remove_request(request)
        self.waiting.prepend_request(request)

cls.add_request = add_request
'''


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A small run of the patch as shipped (the real scheduler, limiter on), as a run folder."""
    workload = Workload(default_tps=100, user_tps={"user-a": 20}, phases=[
        Phase("shared", [Stream("user-a", 24) for _ in range(2)] + [Stream("user-b", 24)], backlogged={"user-a"})])
    return run_workload(tmp_path_factory.mktemp("feature-off") / "run", workload).run_dir


def _judged(run_folder, tmp_path, env=None):
    """The comparison in a child process (with ``env``), in a copy of the run folder; its verdict."""
    run_dir = tmp_path / "run"
    shutil.copytree(run_folder, run_dir)
    result = run_replay(run_dir, env)
    assert json.loads((run_dir / FILE).read_text()) == result
    return result, verify_run(run_dir, plots=False)


def _hooked(tmp_path, body: str) -> dict[str, str]:
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(break_on_import({"vllm.v1.core.sched.scheduler": body}, MARKER))
    return {"PYTHONPATH": str(hook_dir)}


def test_the_patch_with_the_limiter_off_schedules_as_upstream(run_folder, tmp_path):
    result, verdict = _judged(run_folder, tmp_path)
    assert result["error"] is None and len(result["configs"]) == 12
    assert all(c["identical"] for c in result["configs"])
    assert sum(c["preempting_steps"] for c in result["configs"]) > 0  # the workloads preempt
    assert verdict.passed, verdict.summary()
    (check,) = [c for c in verdict.checks if c.name == "feature-off-upstream"]
    assert check.passed and check.figure == 0 and "every step" in check.explanation


@pytest.mark.parametrize("body, configs, what", [
    (ROTATES_RUNNING, {"fcfs", "priority"}, "tokens scheduled per request, in batch order"),
    (USERS_FIRST, {"fcfs"}, None),
], ids=["rotates-running", "users-first"])
def test_a_limiter_off_path_that_schedules_otherwise_fails_feature_off_upstream(run_folder, tmp_path, body, configs,
                                                                               what):
    result, verdict = _judged(run_folder, tmp_path, _hooked(tmp_path, body))
    assert result["error"] is None, result["error"]
    parted = [c for c in result["configs"] if not c["identical"]]
    assert {c["policy"] for c in parted} == configs
    if what is not None:
        assert parted[0]["first_difference"]["what"] == what
    assert not verdict.passed
    assert {c.name for c in verdict.failures} == {"feature-off-upstream"}, verdict.summary()
    (check,) = verdict.failures
    assert check.figure == len(parted) and "parted" in check.explanation


def test_a_comparison_that_cannot_run_fails_feature_off_upstream(run_folder, tmp_path):
    # a limiter-off path that raises: the child fails, and the check says so instead of leaving it out
    body = "module.Scheduler.schedule = lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError('broken'))\n"
    result, verdict = _judged(run_folder, tmp_path, _hooked(tmp_path, body))
    assert result["error"] and "broken" in result["error"]
    assert {c.name for c in verdict.failures} == {"feature-off-upstream"}, verdict.summary()


def test_first_difference_names_the_step_and_the_part():
    same = ([([("a", 1)], [], ([], [], [], [], []), [], [], 1)], [[("a", [7], None, None)]])
    other = ([([("b", 1)], [], ([], [], [], [], []), [], [], 1)], [[("a", [7], None, None)]])
    assert first_difference(same, same) is None
    d = first_difference(other, same)
    assert d["step"] == 0 and d["what"] == "tokens scheduled per request, in batch order"
    assert '"b"' in d["installed"] and '"a"' in d["upstream"]
