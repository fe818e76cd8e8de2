"""The patched engine core loop blocks on its input queue while users are out of budget.

``EngineCoreProc._process_engine_step`` is the real method; the engine around it is
a bare object with a controlled step, scheduler and input queue, so the test sees
exactly which wait the loop chose (no timing).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("patched_vllm")


class _Scheduler:
    def __init__(self, wait_s):
        self.wait_s = wait_s

    def has_requests(self):
        return True

    def get_output_rate_wait_seconds(self):
        return self.wait_s


class _Queue:
    def __init__(self, item=None):
        self.item = item
        self.timeouts = []

    def get(self, timeout=None):
        import queue

        self.timeouts.append(timeout)
        if self.item is None:
            raise queue.Empty
        item, self.item = self.item, None
        return item


def _engine(step_outputs, wait_s, queued=None):
    from vllm.v1.engine.core import EngineCoreProc

    engine = EngineCoreProc.__new__(EngineCoreProc)
    engine.step_fn = lambda: (step_outputs, False)  # the step ran no model
    engine.scheduler = _Scheduler(wait_s)
    engine.input_queue = _Queue(queued)
    engine.batch_queue = None
    engine.post_step = lambda model_executed: None
    engine.handled = []
    engine._handle_client_request = lambda *req: engine.handled.append(req)

    class _Out:
        def put_nowait(self, item):
            pass

    engine.output_queue = _Out()
    return engine


def _stats_only_outputs():
    from vllm.v1.engine import EngineCoreOutputs

    # With stats on, every step returns EngineCoreOutputs, even without request outputs.
    return {0: EngineCoreOutputs()}


def test_engine_blocks_on_input_queue_while_users_wait_for_budget(monkeypatch):
    import time

    slept = []
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s))
    engine = _engine(_stats_only_outputs(), wait_s=0.03)
    engine._process_engine_step()
    assert engine.input_queue.timeouts == [0.03]
    assert slept == []


def test_a_request_arriving_during_the_wait_is_handled_at_once():
    engine = _engine({}, wait_s=0.05, queued=("ADD", "request"))
    engine._process_engine_step()
    assert engine.input_queue.timeouts == [0.05]
    assert engine.handled == [("ADD", "request")]


def test_no_wait_without_throttled_users_or_after_request_outputs(monkeypatch):
    import time

    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    slept = []
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s))
    nobody_waiting = _engine(_stats_only_outputs(), wait_s=None)
    nobody_waiting._process_engine_step()
    with_outputs = _engine(
        {0: EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="r", new_token_ids=[1])])},
        wait_s=0.03,
    )
    with_outputs._process_engine_step()
    assert nobody_waiting.input_queue.timeouts == [] and with_outputs.input_queue.timeouts == []
    assert slept == [0.001, 0.001]  # upstream's short yield
