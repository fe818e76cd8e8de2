"""Asynchronous scheduling on the CPU build of vLLM 0.32.0: an engine overlay.

vLLM's CPU platform hook switches ``--async-scheduling`` off ("async scheduling is
not required on CPU", ``vllm/platforms/cpu.py``), so an engine asked for async
scheduling runs the synchronous scheduler there. This overlay, applied only to the
engines that ask for it (a ``sitecustomize`` first on the engine's ``PYTHONPATH``,
like the stock overlay of :mod:`ratebench.engine`; the installed tree stays as it
is), changes three modules as they are imported:

``vllm.platforms.cpu``
    ``CpuPlatform.check_and_update_config`` keeps ``async_scheduling`` as vLLM's
    config resolved it before the hook (on for ``--async-scheduling``). vLLM then
    picks ``AsyncScheduler`` and a batch queue of two (``max_concurrent_batches``).
``vllm.v1.worker.cpu_model_runner``
    The model runner's async output path asks CUDA for an event
    (``torch.cuda.Event(blocking=True)``: ``prepare_inputs_event`` and the output's
    copy-ready event), a copy stream and ``torch.cuda.current_stream()``; a CPU-only
    torch refuses all three. On CPU every copy is synchronous and the worker runs
    its steps one after another, so the CPU equivalents are: an event that is
    complete as soon as it is recorded (record/synchronize/query are no-ops), no
    stream, and a real copy (``clone``) of the sampled token ids where the GPU
    starts a non-blocking device-to-host copy (``tensor.to("cpu")`` would alias
    the tensor on CPU; the copy keeps the output independent of the runner, as it
    is on a GPU). The placeholders are installed the way vLLM's own CPU runner
    installs its ``torch.Event``/``torch.cuda.Stream`` placeholders: only while
    ``CPUModelRunner.__init__`` runs. ``AsyncGPUModelRunnerOutput`` (a module
    global of ``gpu_model_runner``) becomes a subclass that does the above for
    CPU tensors and defers to vLLM's class for any other device.
``vllm.v1.core.sched.output_rate_events``
    The limiter patch's event recorder adds ``"cpu_async_overlay": "ratebench-cpu-async"`` to the
    event file's header (beside ``async_scheduling``, which the scheduler reports as it ran).
``vllm.v1.engine.core``
    Evidence from inside the engine: the batch queue becomes a deque that counts,
    and ``step_with_batch_queue`` is counted. Each process writes what it saw as
    JSON into the folder named by :data:`ENV_DIR` (``core-<pid>.json``,
    ``worker-<pid>.json``, ``platform-<pid>.json``) and logs one line the first
    time two batches are in flight.

:func:`read_stats` sums those files; :func:`write_overlay` writes the
``sitecustomize``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

ENV_DIR = "RATEBENCH_CPU_ASYNC_DIR"  # where each engine process writes its counts
OVERLAY_NAME = "ratebench-cpu-async"
LOG_PREFIX = "ratebench cpu-async overlay:"

PLATFORM_MODULE = "vllm.platforms.cpu"
RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
CORE_MODULE = "vllm.v1.engine.core"

_WRITE_EVERY_S = 0.5


def _log(msg: str) -> None:
    print(f"{LOG_PREFIX} {msg}", file=sys.stderr, flush=True)


# ---- counts, one JSON file per process --------------------------------------------------


class _Counts:
    """What one engine process saw; written to ``<ENV_DIR>/<role>-<pid>.json`` (atomically)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.data: dict[str, Any] = {"overlay": OVERLAY_NAME, "role": role, "pid": os.getpid()}
        self._last = 0.0
        self._lock = threading.Lock()
        self._written: str | None = None
        atexit.register(self.write)
        # Engine processes are often ended by a signal (atexit may not run): flush what changed.
        threading.Thread(target=self._flush_loop, name="ratebench-cpu-async", daemon=True).start()

    def _flush_loop(self) -> None:
        while True:
            time.sleep(_WRITE_EVERY_S)
            self.write()

    def write(self, force: bool = True) -> None:
        folder = os.environ.get(ENV_DIR)
        if not folder:
            return
        now = time.monotonic()
        if not force and now - self._last < _WRITE_EVERY_S:
            return
        with self._lock:
            self._last = now
            text = json.dumps(self.data, sort_keys=True)
            if text == self._written:
                return
            path = Path(folder) / f"{self.role}-{os.getpid()}.json"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(text)
                os.replace(tmp, path)
                self._written = text
            except OSError:
                pass


def read_stats(folder: Path | str) -> dict[str, Any]:
    """The counts every process of an engine wrote into ``folder`` (the overlay's :data:`ENV_DIR`):
    ``kept_async`` (the platform hook was overruled), ``core`` (per EngineCore: ``async_scheduling``,
    ``scheduler_cls``, ``batch_queue_size``, ``batch_queue_steps``, ``full_queue`` (times two batches
    were in flight), ``max_in_flight``), ``cpu_async_outputs`` (async model runner outputs the workers
    made through the CPU path)."""
    out: dict[str, Any] = {"kept_async": False, "core": [], "cpu_async_outputs": 0, "workers": 0}
    folder = Path(folder)
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        role = data.get("role")
        if role == "platform":
            out["kept_async"] |= bool(data.get("kept_async"))
        elif role == "core":
            out["core"].append(data)
        elif role == "worker":
            out["workers"] += 1
            out["cpu_async_outputs"] += int(data.get("cpu_async_outputs", 0))
    out["full_queue"] = sum(int(c.get("full_queue", 0)) for c in out["core"])
    out["batch_queue_steps"] = sum(int(c.get("batch_queue_steps", 0)) for c in out["core"])
    out["max_in_flight"] = max((int(c.get("max_in_flight", 0)) for c in out["core"]), default=0)
    return out


def stats_problems(stats: dict[str, Any]) -> list[str]:
    """What :func:`read_stats` shows against an engine that really ran asynchronous scheduling."""
    problems = []
    if not stats["kept_async"]:
        problems.append("the CPU platform hook was not overruled (no process kept async scheduling)")
    if not stats["core"]:
        problems.append("no engine core reported its counts")
    for core in stats["core"]:
        if not core.get("async_scheduling") or core.get("step_fn") != "step_with_batch_queue":
            problems.append(f"engine core {core.get('pid')} ran {core.get('scheduler_cls')} with "
                            f"{core.get('step_fn')} (async_scheduling={core.get('async_scheduling')})")
    if stats["core"] and not stats["full_queue"]:
        problems.append("the batch queue never held two batches in flight")
    return problems


# ---- vllm.platforms.cpu -----------------------------------------------------------------


def patch_platform(module: Any) -> None:
    """Keep ``async_scheduling`` through ``CpuPlatform.check_and_update_config``."""
    cls = module.CpuPlatform
    shipped = cls.check_and_update_config.__func__

    def check_and_update_config(klass, vllm_config) -> None:
        sched = vllm_config.scheduler_config
        resolved = sched.async_scheduling
        shipped(klass, vllm_config)
        if resolved and not sched.async_scheduling:
            sched.async_scheduling = True
            counts = _Counts("platform")
            counts.data["kept_async"] = True
            counts.write()
            _log("kept async scheduling on (vLLM's CPU platform hook switched it off)")

    check_and_update_config.__ratebench_cpu_async__ = True  # type: ignore[attr-defined]
    cls.check_and_update_config = classmethod(check_and_update_config)


# ---- vllm.v1.worker.cpu_model_runner ------------------------------------------------------


class CPUEvent:
    """``torch.cuda.Event`` on CPU: work on CPU is done when the call that does it returns, so an
    event is complete as soon as it is recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True


_worker_counts: _Counts | None = None


def _count_output() -> None:
    global _worker_counts
    if _worker_counts is None:
        _worker_counts = _Counts("worker")
        _worker_counts.data["cpu_async_outputs"] = 0
    c = _worker_counts
    c.data["cpu_async_outputs"] += 1
    c.write(force=c.data["cpu_async_outputs"] == 1)


def make_cpu_async_output_class(base: type) -> type:
    """A subclass of vLLM's ``AsyncGPUModelRunnerOutput`` that takes CPU tensors without CUDA."""

    class CPUAsyncModelRunnerOutput(base):  # type: ignore[misc, valid-type]
        __ratebench_cpu_async__ = True

        def __init__(self, model_runner_output, sampled_token_ids, logprobs_tensors, invalid_req_indices,
                     async_output_copy_stream, vocab_size, check_ep_fault=False, num_nans=None):
            if sampled_token_ids.device.type != "cpu":
                super().__init__(model_runner_output, sampled_token_ids, logprobs_tensors, invalid_req_indices,
                                 async_output_copy_stream, vocab_size, check_ep_fault, num_nans)
                return
            if check_ep_fault:
                raise RuntimeError(f"{LOG_PREFIX} expert-parallel fault checks need a GPU")
            self._model_runner_output = model_runner_output
            self._invalid_req_indices = invalid_req_indices
            self.async_copy_ready_event = CPUEvent()
            self._sampled_token_ids = sampled_token_ids
            self.vocab_size = vocab_size
            self._logprobs_tensors = logprobs_tensors
            self._num_nans = num_nans
            self._has_fault = None
            # The GPU's device-to-host copy, done at once: a copy, not an alias of the sampler's tensor.
            self.sampled_token_ids_cpu = sampled_token_ids.clone()
            self._logprobs_tensors_cpu = None
            if logprobs_tensors is not None:
                lt = logprobs_tensors
                self._logprobs_tensors_cpu = type(lt)(
                    lt.logprob_token_ids.clone(), lt.logprobs.clone(), lt.selected_token_ranks.clone(),
                    lt.cu_num_generated_tokens,
                    None if lt.cu_num_generated_tokens_tensor is None else lt.cu_num_generated_tokens_tensor.clone(),
                )
            self._num_nans_cpu = None if num_nans is None else num_nans.clone()
            self.async_copy_ready_event.record()
            _count_output()

    return CPUAsyncModelRunnerOutput


@contextlib.contextmanager
def _cuda_event_placeholder():
    import torch

    shipped = torch.cuda.Event
    torch.cuda.Event = CPUEvent
    try:
        yield
    finally:
        torch.cuda.Event = shipped


def patch_cpu_model_runner(module: Any) -> None:
    """CUDA-free async output path for ``CPUModelRunner``."""
    import vllm.v1.worker.gpu_model_runner as gmr

    shipped_wrapper = module._torch_cuda_wrapper

    @contextlib.contextmanager
    def torch_cuda_wrapper():
        with shipped_wrapper(), _cuda_event_placeholder():
            yield

    module._torch_cuda_wrapper = torch_cuda_wrapper
    base = gmr.AsyncGPUModelRunnerOutput
    if not getattr(base, "__ratebench_cpu_async__", False):
        gmr.AsyncGPUModelRunnerOutput = make_cpu_async_output_class(base)


# ---- vllm.v1.engine.core ------------------------------------------------------------------


class CountingBatchQueue(deque):
    """The engine core's batch queue, counting how often it holds ``maxlen`` batches (all in flight)."""

    def __init__(self, iterable=(), maxlen=None, counts: _Counts | None = None) -> None:
        super().__init__(iterable, maxlen)
        self.counts = counts if counts is not None else _Counts("core")
        self.counts.data.setdefault("full_queue", 0)
        self.counts.data.setdefault("max_in_flight", 0)
        self.counts.data.setdefault("appended", 0)

    def appendleft(self, item) -> None:
        super().appendleft(item)
        d = self.counts.data
        d["appended"] += 1
        n = len(self)
        if n > d["max_in_flight"]:
            d["max_in_flight"] = n
        if self.maxlen is not None and n >= self.maxlen:
            d["full_queue"] += 1
            if d["full_queue"] == 1:
                _log(f"step_with_batch_queue has {n} batches in flight (queue full)")
                self.counts.write()
                return
        self.counts.write(force=False)


def patch_engine_core(module: Any) -> None:
    """Count the batch queue and the batch-queue steps of every ``EngineCore``."""
    cls = module.EngineCore
    shipped_init = cls.__init__
    shipped_step = cls.step_with_batch_queue

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        shipped_init(self, *args, **kwargs)
        counts = _Counts("core")
        sched = type(self.scheduler).__name__ if getattr(self, "scheduler", None) is not None else None
        counts.data.update(
            async_scheduling=bool(getattr(self, "async_scheduling", False)), scheduler_cls=sched,
            batch_queue_size=self.batch_queue_size, batch_queue_steps=0,
            step_fn=getattr(self.step_fn, "__name__", str(self.step_fn)),
        )
        if self.batch_queue is not None:
            self.batch_queue = CountingBatchQueue(self.batch_queue, self.batch_queue.maxlen, counts)
        self._ratebench_cpu_async_counts = counts
        counts.write()
        _log(f"engine core: scheduler {sched}, async_scheduling={counts.data['async_scheduling']}, "
             f"batch queue size {self.batch_queue_size}, step function {counts.data['step_fn']}")

    def step_with_batch_queue(self, *args: Any, **kwargs: Any):
        counts = getattr(self, "_ratebench_cpu_async_counts", None)
        if counts is not None:
            counts.data["batch_queue_steps"] += 1
        return shipped_step(self, *args, **kwargs)

    cls.__init__ = __init__
    cls.step_with_batch_queue = step_with_batch_queue


# ---- vllm.v1.core.sched.output_rate_events (the limiter patch's recorder) -------------------


def patch_event_recorder(module: Any) -> None:
    """The event file's header says the engine ran through this overlay (``cpu_async_overlay``)."""
    cls = module.OutputRateEventRecorder
    shipped = cls.from_env.__func__

    def from_env(klass, meta):
        return shipped(klass, {**meta, "cpu_async_overlay": OVERLAY_NAME})

    cls.from_env = classmethod(from_env)


# ---- the import hook ------------------------------------------------------------------------

RECORDER_MODULE = "vllm.v1.core.sched.output_rate_events"
PATCHES = {PLATFORM_MODULE: patch_platform, RUNNER_MODULE: patch_cpu_model_runner, CORE_MODULE: patch_engine_core,
           RECORDER_MODULE: patch_event_recorder}


class CpuAsyncFinder(importlib.abc.MetaPathFinder):
    """Finds the target modules through the rest of the import system, then patches them once loaded."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        patch = PATCHES.get(name)
        if patch is None or name in self._busy:
            return None
        self._busy.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy.discard(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once); modules already imported are patched now."""
    if any(isinstance(f, CpuAsyncFinder) for f in sys.meta_path):
        return
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, CpuAsyncFinder())


# ---- the overlay folder ----------------------------------------------------------------------

_SITECUSTOMIZE = '''"""ratebench: asynchronous scheduling on the CPU build of vLLM (see ratebench/cpu_async.py)."""
import os
import sys

_ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, {ratebench_parent!r})
try:
    from ratebench.cpu_async import install
finally:
    del sys.path[0]
install()
# Chain to a sitecustomize further down the path, if there is one.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _ROOT]
_SELF = sys.modules.pop("sitecustomize")
try:
    import sitecustomize  # noqa: F401
except ImportError:
    # None further down: the import system expects this module under its name when it returns.
    sys.modules["sitecustomize"] = _SELF
'''


def write_overlay(dest: Path | str) -> Path:
    """Write the overlay's ``sitecustomize.py`` into ``dest``; returns ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    parent = str(Path(__file__).resolve().parent.parent)
    (dest / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(ratebench_parent=parent))
    return dest


def overlay_env(overlay_dir: Path | str, stats_dir: Path | str, pythonpath: str | None) -> dict[str, str]:
    """``PYTHONPATH`` with the overlay first (before ``pythonpath``) and the counts' folder."""
    return {"PYTHONPATH": str(overlay_dir) + (os.pathsep + pythonpath if pythonpath else ""),
            ENV_DIR: str(stats_dir)}
