"""The run around the phases: the run folder's record when a run cannot start (no engine needed)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from rich.console import Console

from ratebench.profiles import load_profile
from ratebench.runner import EXIT_RUN_FAILED, RunOptions, run_profile


def test_an_endpoint_that_does_not_answer_leaves_a_failed_run_folder(tmp_path: Path) -> None:
    options = RunOptions(results_dir=tmp_path, endpoint="http://127.0.0.1:9/", verify=False, live=False)
    outcome = run_profile(load_profile("cpu-tiny"), options, Console(stderr=True, quiet=True))
    assert (outcome.state, outcome.exit_code) == ("failed", EXIT_RUN_FAILED)
    assert "/v1/models did not answer" in outcome.reason
    manifest = json.loads((outcome.run_dir / "manifest.json").read_text())
    assert manifest["state"] == "failed" and manifest["partial_reason"] == outcome.reason
    assert manifest["endpoint"] == "http://127.0.0.1:9/"
    assert manifest["planned_phases"] and manifest["ended_monotonic_ns"] >= manifest["started_monotonic_ns"]
    assert json.loads((outcome.run_dir / "scenarios.json").read_text()) == []
    assert (outcome.run_dir / "requests.jsonl").read_text() == ""


def test_sigterm_stops_a_run_as_ctrl_c_does_whatever_sigint_the_process_inherited() -> None:
    """SIGTERM becomes the KeyboardInterrupt run_profile turns into a partial run with every engine
    stopped: with SIGINT at its default (a terminal) and with SIGINT ignored (a background job, which
    a raised SIGINT would not reach)."""
    import subprocess
    import sys

    probe = (
        "import os, signal, sys\n"
        "from ratebench.runner import _sigterm_as_sigint\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN if sys.argv[1] == 'ignored' else signal.default_int_handler)\n"
        "signal.signal(signal.SIGTERM, _sigterm_as_sigint)\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    signal.pause()\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
    )
    for inherited in ("default", "ignored"):
        proc = subprocess.run([sys.executable, "-c", probe, inherited], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0 and proc.stdout.strip() == "interrupted", (inherited, proc.stdout, proc.stderr)


class _StallingServer:
    """A server that speaks enough of vLLM's API for an attached run (``/v1/models``, ``/tokenize``,
    streamed ``/v1/completions``): it streams every answer, except that it leaves ``stall_user``'s
    streams without a byte after their first token, as a limiter that never wakes a user would."""

    def __init__(self, stall_user: str) -> None:
        import threading

        self.stall_user = stall_user
        self.completions: list[str] = []  # the user of each completion asked
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _serve(self, ready) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                method, path = head.split(" ")[:2]
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in head.split("\r\n")[1:])
                           if k}
                body = json.loads(await reader.readexactly(int(headers.get("content-length", "0"))) or b"{}")
                if path == "/v1/models":
                    self._json(writer, {"data": [{"id": "tiny-qwen3"}]})
                elif path == "/tokenize":
                    self._json(writer, {"tokens": [5 + i % 50 for i in range(len(body.get("prompt", "").split()))]})
                elif path == "/v1/completions":
                    await self._stream(writer, body)
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    def _json(writer, obj) -> None:
        data = json.dumps(obj).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(data), data))

    async def _stream(self, writer, body: dict) -> None:
        user = body.get("vllm_xargs", {}).get("output_rate_user")
        self.completions.append(user)
        n = int(body["max_tokens"])

        def event(obj) -> bytes:
            e = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            return b"%x\r\n%s\r\n" % (len(e), e)

        def usage(k: int) -> dict:
            return {"prompt_tokens": 4, "completion_tokens": k, "total_tokens": 4 + k}

        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for k in range(1, n + 1):
            writer.write(event({"choices": [{"index": 0, "text": " x", "token_ids": [7],
                                              "finish_reason": "length" if k == n else None}], "usage": usage(k)}))
            await writer.drain()
            if user == self.stall_user:
                await asyncio.sleep(30)  # never wakes: the client's stall timeout closes the stream
            await asyncio.sleep(0.002)
        writer.write(event({"choices": [], "usage": usage(n)}) + event(b"[DONE]") + b"0\r\n\r\n")

    def close(self) -> None:
        async def stop() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            await asyncio.sleep(0.05)
            asyncio.get_running_loop().stop()

        asyncio.run_coroutine_threadsafe(stop(), self.loop)
        self.thread.join(5)


def test_a_phase_whose_streams_stall_stops_the_run_and_its_verdict_fails(tmp_path: Path) -> None:
    """A stream left without a byte for the profile's stall_timeout_s is closed as stalled, and the run
    stops after that phase (every later phase would wait as long): partial, verified as far as it went,
    the verdict FAIL naming the stalled streams, exit code 1, the later phases never sent."""
    from e2e_profiles import e2e_profile

    from ratebench.runner import EXIT_VERDICT_FAILED

    toml = e2e_profile("stall", {"user-a": 20, "user-b": 100}, """
[[scenarios]]
kind = "seed-experiment"
user = "user-a"
neighbour = "user-b"
streams = [1, 2]
max_tokens = 6
neighbour_max_tokens = 6
""").replace("shutdown_grace_s = 15", "shutdown_grace_s = 15\nstall_timeout_s = 1")
    path = tmp_path / "stall.toml"
    path.write_text(toml)
    server = _StallingServer("user-a")
    try:
        t0 = time.monotonic()
        options = RunOptions(results_dir=tmp_path / "results", endpoint=server.endpoint, verify=True, live=False)
        outcome = run_profile(load_profile(str(path)), options, Console(stderr=True, quiet=True))
        took = time.monotonic() - t0
    finally:
        server.close()
    assert (outcome.state, outcome.exit_code) == ("partial", EXIT_VERDICT_FAILED), outcome.reason
    assert outcome.reason.startswith("1 stream of seed-experiment/1-stream on patched-sync stalled: no byte from "
                                     "the server for 1 s (users user-a)"), outcome.reason
    assert "users user-a" in outcome.reason
    assert server.completions.count("user-a") == 1  # the 2-stream phase never ran
    assert took < 20, took
    verdict = json.loads((outcome.run_dir / "verdict.json").read_text())
    assert verdict["passed"] is False
    (rec,) = [json.loads(line) for line in (outcome.run_dir / "requests.jsonl").read_text().splitlines()
              if json.loads(line)["user"] == "user-a"]
    assert rec["error"].startswith("ReadTimeout: stalled: no data from the server for 1 s")
    failed = {c["name"] for c in verdict["checks"] if c["passed"] is False}
    assert "reconciliation" in failed, failed
