"""Launch, health, logs and shutdown of vLLM OpenAI servers.

An engine runs ``python -m vllm.entrypoints.openai.api_server`` in its own
process group, bound to 127.0.0.1 on a free port, with its stdout and stderr in
``engines/<name>/engine.log`` of the run folder. It is ready when ``/health``
answers 200 and ``/v1/models`` lists the served model, and :func:`warm_up` then
runs the request shapes the phases will use once. :meth:`RunningEngine.stop`
always leaves no process of the group behind: SIGINT, then SIGTERM, then SIGKILL
after the grace period.

The process group stays in the driver's session (``process_group=0``, not
``start_new_session``): the kernel's autogroup scheduling makes every session its
own CPU group, and with the engine in a session of its own the driver (the
client whose timestamps we measure) sat on the run queue for 1.8 to 2.5 s of
each 2.5 s phase on a 2-core machine while the engine core busy-polled its
worker; in one session it waits 0.2 to 0.4 s and its event loop never stalls
more than about 50 ms.

A *stock* engine serves the real pristine vLLM beside the patched install: the
pristine content of the files the patch touches is imported from an overlay (a
``sitecustomize`` on the engine's ``PYTHONPATH``), every other file is the
installed one. The installed tree is never changed while engines run, so a run
interrupted at any point leaves vLLM patched, and other processes never see a
half-reverted tree.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import signal
import tempfile
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ratebench.events import ENV_VAR as EVENTS_ENV_VAR
from ratebench.procstats import group_members

LOG_TAIL_LINES = 30


class EngineError(RuntimeError):
    """An engine that did not start or died; carries the last lines of its log."""

    def __init__(self, message: str, log_tail: str = "", log_path: Path | None = None) -> None:
        super().__init__(message)
        self.log_tail = log_tail
        self.log_path = log_path


@dataclass
class EngineSpec:
    """What one engine of a run is: code (patched or stock), limiter and flags."""

    name: str  # engines/<name>/ in the run folder, e.g. "patched-sync"
    kind: str  # "patched" | "stock"
    feature: bool  # limiter flags passed (feature on)
    async_scheduling: bool
    model: str  # folder or Hugging Face id
    served_name: str
    flags: list[str]  # the profile's engine flags (without limiter and scheduling flags)
    default_tps: int | None = None
    user_tps: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    record_events: bool = True
    # kind "stock": the pristine content of the files the patch touches (path relative
    # to site-packages -> bytes, None: absent in the release); served through an
    # import overlay so the installed (patched) tree is never changed. None: as installed.
    pristine_files: dict[str, bytes | None] | None = field(default=None, repr=False)
    # CPU: keep --async-scheduling through ratebench/cpu_async.py's overlay (async engines only).
    cpu_async_overlay: bool = False
    # vLLM's --scheduling-policy the engine is meant to run: "fcfs" or "priority". Where the profile's
    # flags say otherwise (an engine of the "priority" scheduling mode), all_flags adds the flag.
    scheduling_policy: str = "fcfs"

    def limiter_flags(self) -> list[str]:
        if not self.feature:
            return []
        import json

        out = ["--default-user-output-tokens-per-second", str(self.default_tps)]
        if self.user_tps:
            out += ["--user-output-tokens-per-second", json.dumps(self.user_tps, separators=(",", ":"))]
        return out

    def all_flags(self) -> list[str]:
        """Every server flag except host and port (recorded in the manifest)."""
        flags = ["--model", self.model, "--served-model-name", self.served_name, *self.flags]
        if self.async_scheduling:
            flags.append("--async-scheduling")
        if flag_policy(self.flags) != self.scheduling_policy:
            flags += ["--scheduling-policy", self.scheduling_policy]
        return flags + self.limiter_flags()

    def argv(self, port: int | str) -> list[str]:
        """The server's command line (``port``: a placeholder string where it is not chosen yet)."""
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                "--port", str(port), *self.all_flags()]


def flag_policy(flags: list[str]) -> str:
    """The --scheduling-policy that ``flags`` give vLLM (the last one wins; "fcfs", vLLM's default)."""
    policy = "fcfs"
    for k, flag in enumerate(flags):
        if flag == "--scheduling-policy" and k + 1 < len(flags):
            policy = flags[k + 1]
        elif flag.startswith("--scheduling-policy="):
            policy = flag.split("=", 1)[1]
    return policy.lower()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with path.open("r", errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return ""


# ---- stock vLLM beside the patched install ---------------------------------------------
# Every Python process of the stock engine (API server, EngineCore, workers; spawned
# or forked) runs this sitecustomize first (PYTHONPATH). It puts a finder in front
# of the import system that loads the files the patch touches from their pristine
# copies; every other file is the installed one, which the patch does not touch.

_OVERLAY_MAP = "ratebench-stock-files.json"
_OVERLAY_SITECUSTOMIZE = '''"""ratebench: serve stock vLLM (pristine copies of the files the limiter patch touches)."""
import importlib.abc
import importlib.util
import json
import os
import sys

_ROOT = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_ROOT, "ratebench-stock-files.json")) as _f:
    _FILES = json.load(_f)  # module -> {"file": path or null, "package_dir": path or null}


class RatebenchStockFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        entry = _FILES.get(name)
        if entry is None:
            return None
        if entry["file"] is None:
            raise ModuleNotFoundError(f"No module named {name!r} (not part of stock vLLM)", name=name)
        locations = [entry["package_dir"]] if entry["package_dir"] else None
        return importlib.util.spec_from_file_location(name, entry["file"], submodule_search_locations=locations)


sys.meta_path.insert(0, RatebenchStockFinder())
# Chain to a sitecustomize further down the path, if there is one.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _ROOT]
_SELF = sys.modules.pop("sitecustomize")
try:
    import sitecustomize  # noqa: F401
except ImportError:
    # none further down: the import system expects this module back under its name
    sys.modules["sitecustomize"] = _SELF
'''


def stock_overlay_env(dest: Path | str) -> dict[str, str]:
    """The environment a stock engine needs for the overlay in ``dest``."""
    pythonpath = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(dest) + (os.pathsep + pythonpath if pythonpath else "")}


def write_stock_overlay(pristine_files: dict[str, bytes | None], site_packages: Path, dest: Path) -> dict[str, str]:
    """Write the overlay for a stock engine into ``dest``; returns the environment it needs."""
    import json

    files: dict[str, dict[str, str | None]] = {}
    for rel, content in pristine_files.items():
        parts = Path(rel).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        target = None
        if content is not None:
            target = dest / "pristine" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        files[module] = {
            "file": str(target) if target is not None else None,
            "package_dir": str(site_packages / Path(rel).parent) if is_package else None,
        }
    (dest / _OVERLAY_MAP).write_text(json.dumps(files, indent=1))
    (dest / "sitecustomize.py").write_text(_OVERLAY_SITECUSTOMIZE)
    return stock_overlay_env(dest)


_LIVE: dict[int, "RunningEngine"] = {}


@atexit.register
def _kill_leftovers() -> None:  # last resort: an interpreter exiting with engines up
    for engine in list(_LIVE.values()):
        engine.kill_now()


class RunningEngine:
    """A started engine; stop() is idempotent and leaves no process behind."""

    def __init__(self, spec: EngineSpec, process: subprocess.Popen, port: int, folder: Path,
                 events_path: Path | None, log_file, overlay_dir: Path | None = None,
                 ipc_dir: Path | None = None) -> None:
        self.spec = spec
        self.overlay_dir = overlay_dir
        self.ipc_dir = ipc_dir  # where its processes' ZMQ sockets live (VLLM_RPC_BASE_PATH), removed at stop
        self.process = process
        self.pgid = process.pid  # process_group=0: the leader's pid is the group id
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"
        self.folder = folder
        self.log_path = folder / "engine.log"
        self.events_path = events_path
        self._log_file = log_file
        self.stopped = False
        _LIVE[self.pgid] = self

    def alive(self) -> bool:
        return self.process.poll() is None

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill_now(self) -> None:
        self._signal_group(signal.SIGKILL)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _LIVE.pop(self.pgid, None)
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        for folder in (self.overlay_dir, self.ipc_dir):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def stop(self, grace_s: float = 20.0) -> list[int]:
        """SIGINT the group, SIGTERM at half the grace, SIGKILL after it.

        Returns the pids that needed SIGKILL (empty on a clean shutdown).
        """
        if self.stopped:
            return []
        killed: list[int] = []
        try:
            self._signal_group(signal.SIGINT)
            deadline = time.monotonic() + grace_s
            sent_term = False
            while time.monotonic() < deadline:
                if self.process.poll() is not None and not group_members(self.pgid):
                    break
                if not sent_term and time.monotonic() > deadline - grace_s / 2:
                    self._signal_group(signal.SIGTERM)
                    sent_term = True
                time.sleep(0.1)
            killed = group_members(self.pgid)
            if killed:
                self._signal_group(signal.SIGKILL)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            end = time.monotonic() + 10
            while group_members(self.pgid) and time.monotonic() < end:
                self._signal_group(signal.SIGKILL)
                time.sleep(0.1)
        finally:
            self.stopped = True
            _LIVE.pop(self.pgid, None)
            self._remove_scratch()
            try:
                self._log_file.close()
            except OSError:
                pass
        return killed


# Set for every engine: nothing is downloaded, nothing reported, logs arrive as written.
ENGINE_BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}


def records_events(spec: EngineSpec) -> bool:
    """Whether the engine writes an engine event file (patched engines that record)."""
    return spec.record_events and spec.kind == "patched"


def uses_cpu_async_overlay(spec: EngineSpec) -> bool:
    """Whether the engine runs through the CPU async overlay (asked for, and async scheduling)."""
    return spec.cpu_async_overlay and spec.async_scheduling


def engine_env(spec: EngineSpec, *, events_path: Path | str | None, overlay_dir: Path | str | None,
               cpu_async_dir: Path | str | None = None) -> dict[str, str]:
    """The variables ratebench sets for an engine, over the inherited environment (from which the
    event file variable is always removed). ``events_path``: where the engine records events, if it
    does; ``overlay_dir``: a stock engine's import overlay; ``cpu_async_dir``: the folder of the CPU
    async overlay (``overlay/``) and its counts (``stats/``), see :mod:`ratebench.cpu_async`."""
    env = {**ENGINE_BASE_ENV, **spec.env}
    env.pop(EVENTS_ENV_VAR, None)
    paths = [str(overlay_dir)] if overlay_dir is not None else []
    if cpu_async_dir is not None:
        # Behind the stock overlay: its sitecustomize chains to this one, whose finder then goes in
        # front of the stock finder and patches the pristine modules that finder loads.
        from ratebench.cpu_async import overlay_env

        cpu_env = overlay_env(Path(cpu_async_dir) / "overlay", Path(cpu_async_dir) / "stats", None)
        env.update(cpu_env)
        paths.append(cpu_env["PYTHONPATH"])
    if paths:
        # The overlays go first; then the profile's own PYTHONPATH if it sets one, else the inherited.
        behind = spec.env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join(paths + ([behind] if behind else []))
    if events_path is not None:
        env[EVENTS_ENV_VAR] = str(events_path)
    return env


def launch_engine(spec: EngineSpec, folder: Path) -> RunningEngine:
    """Start the server process (not waiting for it); see :func:`wait_ready`."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    overlay_dir = None
    if spec.pristine_files is not None:
        from ratebench.patching import site_packages_of_vllm

        overlay_dir = Path(tempfile.mkdtemp(prefix=f"ratebench-{spec.name}-"))
        write_stock_overlay(spec.pristine_files, site_packages_of_vllm(), overlay_dir)
    events_path = (folder / "events.rbev") if records_events(spec) else None
    cpu_async_dir = None
    if uses_cpu_async_overlay(spec):
        from ratebench.cpu_async import write_overlay

        cpu_async_dir = (folder / "cpu-async").resolve()
        shutil.rmtree(cpu_async_dir / "stats", ignore_errors=True)  # counts of this start only
        write_overlay(cpu_async_dir / "overlay")
    env = dict(os.environ)
    env.pop(EVENTS_ENV_VAR, None)
    env.update(engine_env(spec, events_path=events_path.resolve() if events_path else None, overlay_dir=overlay_dir,
                          cpu_async_dir=cpu_async_dir))
    ipc_dir = None
    if "VLLM_RPC_BASE_PATH" not in env:
        # vLLM binds its processes' ZMQ sockets in the temp folder and leaves them there when stopped by a
        # signal (thousands of socket files after a test suite): a folder of the engine's own, removed at stop
        ipc_dir = Path(tempfile.mkdtemp(prefix="ratebench-ipc-"))
        env["VLLM_RPC_BASE_PATH"] = str(ipc_dir)
    log_file = open(folder / "engine.log", "ab")
    log_file.write(f"# ratebench: {' '.join(spec.argv(port))}\n".encode())
    log_file.flush()
    try:
        process = subprocess.Popen(
            spec.argv(port), stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            env=env, process_group=0, cwd=folder,
        )
    except OSError:
        log_file.close()
        for scratch in (overlay_dir, ipc_dir):
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        raise
    return RunningEngine(spec, process, port, folder, events_path, log_file, overlay_dir, ipc_dir)


def start_engine(spec: EngineSpec, folder: Path, *, timeout_s: float, console: Console | None = None,
                 grace_s: float = 20.0) -> RunningEngine:
    """Start an engine and wait until it serves; on failure stop it and raise EngineError."""
    engine = launch_engine(spec, folder)
    try:
        wait_ready([engine], timeout_s, console or Console(stderr=True))
    except BaseException:
        engine.stop(grace_s)
        raise
    return engine


def wait_ready(engines: list[RunningEngine], timeout_s: float, console: Console) -> None:
    """Wait until every engine serves its model, with one progress line per engine.

    Raises EngineError (with the log tail) for the first engine that exits or times out;
    stopping the engines is the caller's business.
    """
    start = time.monotonic()
    stage = {e.spec.name: "starting" for e in engines}
    pending = list(engines)
    with httpx.Client(timeout=2.0) as client, Progress(
        SpinnerColumn(), TextColumn("[bold]{task.fields[name]}[/]: {task.description}"), TimeElapsedColumn(),
        console=console, transient=True,
    ) as progress:
        tasks = {e.spec.name: progress.add_task("starting", name=e.spec.name) for e in engines}
        while pending:
            for engine in list(pending):
                name = engine.spec.name
                if not engine.alive():
                    raise EngineError(
                        f"engine {name} exited with code {engine.process.returncode} before it was ready",
                        log_tail(engine.log_path), engine.log_path)
                if time.monotonic() - start > timeout_s:
                    raise EngineError(f"engine {name} was not ready after {timeout_s:.0f} s "
                                      f"(profile.startup_timeout_s)", log_tail(engine.log_path), engine.log_path)
                try:
                    if stage[name] == "starting":
                        if client.get(f"{engine.endpoint}/health").status_code == 200:
                            stage[name] = "models"
                    if stage[name] == "models":
                        r = client.get(f"{engine.endpoint}/v1/models")
                        if r.status_code == 200 and any(m.get("id") == engine.spec.served_name
                                                        for m in r.json().get("data", [])):
                            pending.remove(engine)
                            progress.update(tasks[name], description="ready")
                            continue
                except (httpx.TransportError, ValueError):
                    pass
                last = log_tail(engine.log_path, 1).strip()
                progress.update(tasks[name], description=(last[-100:] if last else stage[name]))
            if pending:
                time.sleep(0.5)



@dataclass
class WarmUpPlan:
    """The concurrent wave :func:`warm_up` sends after its two single requests.

    A CPU engine pays a first-use cost for each new batch shape (a 0.2 to 0.4 s
    first model step when a phase first ran four sequences at once after single
    requests only); the wave runs those shapes before any phase is timed.
    """

    streams: int  # concurrent short streams (with the long one: the profile's max_num_seqs in all)
    long_prompt_tokens: int | None  # one more stream with a prompt this long (chunked prefill); None: none
    short_prompt_tokens: tuple[int, ...] = (16, 32, 48, 64)  # the short streams' prompt lengths, in turn
    max_tokens: int = 16
    timeout_s: float = 120.0


@dataclass
class WarmUpResult:
    """What the warm-up sent (recorded in the manifest)."""

    requests: int
    seconds: float
    timed_out: bool  # the wave hit WarmUpPlan.timeout_s and was closed (the run goes on)


def warm_up(engine: RunningEngine, plan: WarmUpPlan | None = None) -> WarmUpResult:
    """A short streamed completion and chat request, then ``plan``'s concurrent wave.

    A fresh server initialises parts of its request path on its first requests (the
    first engine step took 0.7 s on CPU), and a CPU engine's first step of each new
    batch shape costs more; either would otherwise stall a phase. Every request
    carries ``X-Request-Id: warmup-<engine>-<n>`` (no client record has such an id)
    and leaves ``output_rate_user`` out.
    """
    t0 = time.monotonic()
    common = {"model": engine.spec.served_name, "max_tokens": 8, "stream": True, "ignore_eos": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    bodies = (("/v1/completions", {"prompt": "Hello, world. " * 8}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}))
    with httpx.Client(timeout=120.0) as client:
        for n, (path, body) in enumerate(bodies):
            headers = {"X-Request-Id": f"warmup-{engine.spec.name}-{n}"}
            with client.stream("POST", f"{engine.endpoint}{path}", json={**common, **body}, headers=headers) as r:
                text = r.read().decode(errors="replace")
            if r.status_code != 200:
                raise _warm_up_error(engine, path, f"answered HTTP {r.status_code}: {text[:300]}")
    sent, timed_out = len(bodies), False
    if plan is not None and (plan.streams > 0 or plan.long_prompt_tokens):
        wave, timed_out = asyncio.run(_warm_up_wave(engine, plan, first_index=sent))
        sent += wave
    return WarmUpResult(requests=sent, seconds=time.monotonic() - t0, timed_out=timed_out)


def _warm_up_error(engine: RunningEngine, path: str, problem: str) -> EngineError:
    return EngineError(f"engine {engine.spec.name}: warm-up request to {path} {problem}",
                       log_tail(engine.log_path), engine.log_path)


async def _warm_up_wave(engine: RunningEngine, plan: WarmUpPlan, first_index: int) -> tuple[int, bool]:
    """``plan.streams`` short streams and the long one, all at once; returns (requests, timed out)."""
    url = engine.endpoint
    async with httpx.AsyncClient(timeout=plan.timeout_s) as client:
        try:
            r = await client.post(f"{url}/tokenize", json={"model": engine.spec.served_name,
                                                           "prompt": "Hello, world. How are you today? " * 8,
                                                           "add_special_tokens": False})
        except httpx.HTTPError as exc:
            raise _warm_up_error(engine, "/tokenize", f"failed: {exc}") from exc
        if r.status_code != 200:
            raise _warm_up_error(engine, "/tokenize", f"answered HTTP {r.status_code}: {r.text[:300]}")
        base = list(r.json()["tokens"]) or [0]
        lengths = [plan.short_prompt_tokens[i % len(plan.short_prompt_tokens)] for i in range(plan.streams)]
        if plan.long_prompt_tokens:
            lengths.append(plan.long_prompt_tokens)

        async def one(i: int, n_tokens: int) -> None:
            # A different rotation of the text for each stream: no prefix-cache hits between them.
            prompt = [base[(7 * i + j) % len(base)] for j in range(n_tokens)]
            body = {"model": engine.spec.served_name, "prompt": prompt, "max_tokens": plan.max_tokens,
                    "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            headers = {"X-Request-Id": f"warmup-{engine.spec.name}-{first_index + i}"}
            try:
                async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
                    text = (await resp.aread()).decode(errors="replace")
            except httpx.HTTPError as exc:
                raise _warm_up_error(engine, "/v1/completions", f"failed: {exc}") from exc
            if resp.status_code != 200:
                raise _warm_up_error(engine, "/v1/completions", f"answered HTTP {resp.status_code}: {text[:300]}")

        tasks = [asyncio.create_task(one(i, n)) for i, n in enumerate(lengths)]
        timed_out = False
        try:
            async with asyncio.timeout(plan.timeout_s):
                await asyncio.gather(*tasks)
        except TimeoutError:
            timed_out = True
        finally:  # a failed stream closes the others
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return len(lengths), timed_out
