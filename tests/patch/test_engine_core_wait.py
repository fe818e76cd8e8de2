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


def _record_sleeps(monkeypatch) -> list[float]:
    """The engine loop's ``time.sleep`` calls on this thread (not slept). Other threads sleep for real:
    a thread left running by an earlier test, patched too, spun and filled the list (48,090 x 0.5 s
    in a CI run)."""
    import threading
    import time

    slept: list[float] = []
    real_sleep = time.sleep
    me = threading.get_ident()

    def sleep(seconds: float) -> None:
        if threading.get_ident() == me:
            slept.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return slept


def test_engine_blocks_on_input_queue_while_users_wait_for_budget(monkeypatch):
    slept = _record_sleeps(monkeypatch)
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
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    slept = _record_sleeps(monkeypatch)
    nobody_waiting = _engine(_stats_only_outputs(), wait_s=None)
    nobody_waiting._process_engine_step()
    with_outputs = _engine(
        {0: EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="r", new_token_ids=[1])])},
        wait_s=0.03,
    )
    with_outputs._process_engine_step()
    assert nobody_waiting.input_queue.timeouts == [] and with_outputs.input_queue.timeouts == []
    assert slept == [0.001, 0.001]  # upstream's short yield


class _Done:
    """A finished future of the executor."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class _Batch:
    def __init__(self, tokens):
        self.total_num_scheduled_tokens = tokens


def _async_engine(batch_tokens, wait_s, *, outputs_of_batch=None):
    """The engine after an async step that queued a batch of ``batch_tokens`` tokens and returned
    early (no outputs, no model output yet)."""
    from collections import deque

    engine = _engine(None, wait_s)
    batch = _Batch(batch_tokens)
    engine.batch_queue = deque([(_Done("model output"), batch, _Done(None))])
    engine.updated = []
    engine.put = []

    def update_from_output(scheduler_output, model_output):
        engine.updated.append((scheduler_output, model_output))
        return outputs_of_batch or {}

    engine.scheduler.update_from_output = update_from_output
    engine._process_aborts_queue = lambda: None
    engine._weight_version = 0
    engine.output_queue.put_nowait = engine.put.append
    return engine, batch


def test_with_async_scheduling_the_empty_batch_in_flight_is_finished_then_the_engine_blocks(monkeypatch):
    """Async scheduling queues the empty batch a step scheduled while every user waits for budget:
    the loop finishes it and blocks on the input queue (before, it slept 1 ms and scheduled the next
    empty batch: a 1 kHz poll, 0.36 CPUs of the EngineCore in cpu-tiny's waiting scenario)."""
    slept = _record_sleeps(monkeypatch)
    engine, batch = _async_engine(0, wait_s=0.04)
    engine._process_engine_step()
    assert engine.updated == [(batch, "model output")]
    assert not engine.batch_queue
    assert engine.input_queue.timeouts == [0.04]
    assert slept == []


def test_with_async_scheduling_a_batch_that_runs_the_model_is_not_waited_for(monkeypatch):
    slept = _record_sleeps(monkeypatch)
    engine, _ = _async_engine(3, wait_s=0.04)
    engine._process_engine_step()
    assert engine.updated == [] and len(engine.batch_queue) == 1
    assert engine.input_queue.timeouts == []
    assert slept == [0.001]  # upstream's short yield; the next step collects the batch


def test_with_async_scheduling_outputs_of_the_empty_batch_go_out_and_the_engine_does_not_wait(monkeypatch):
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    slept = _record_sleeps(monkeypatch)
    out = {0: EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="r", new_token_ids=[])])}
    engine, _ = _async_engine(0, wait_s=0.04, outputs_of_batch=out)
    engine._process_engine_step()
    assert engine.put == [(0, out[0])]
    assert engine.input_queue.timeouts == [] and slept == []
