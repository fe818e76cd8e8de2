"""End to end on CPU: real patched vLLM servers broken on purpose must fail verify-bound, by the right check.

Each test writes a ``sitecustomize.py`` (``_hook``) into a temporary folder and puts it
first on the engine's ``PYTHONPATH``: in every process of the server (the API server and
the EngineCore), as soon as the targeted vLLM module is imported, it is changed (the
limiter's burst, the API's request models, the EngineCore's wait). Nothing installed
changes. Real HTTP streams through ratebench's driver, the engine's own event file, the
run folder written as ``ratebench run`` writes it, then the verdict.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import pytest
from typer.testing import CliRunner

from e2e_profiles import e2e_profile
from mutants.hooks import break_on_import as _hook
from mutants.runfolder import write_run_files
from ratebench.cli import app
from ratebench.engine import EngineSpec, start_engine
from ratebench.events import read_engine_events
from ratebench.verify import verify_run
from ratebench.workload import Driver, PhaseContext, StreamRequest

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("patched_vllm", "engine_lock")]

ENGINE = "patched-burst-1s"
LIMITS = {"user-a": 20, "user-b": 100}
BURST_1S_NS = 1_000_000_000
MARKER = "ratebench test mutant: OutputRateLimiter burst 1 s"

# the EngineCore's limiter gets a 1 s burst instead of 100 ms
BURST_1S = f'''
cls = module.OutputRateLimiter
shipped_init = cls.__init__

def init_with_1s_burst(self, *args, **kwargs):
    shipped_init(self, *args, **kwargs)
    self.burst_ns = {BURST_1S_NS}

cls.__init__ = init_with_1s_burst
'''


def test_a_real_engine_with_a_one_second_burst_fails_verify_bound(tmp_path, tiny_model):
    hook_dir = tmp_path / "mutant-site"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(_hook({"vllm.v1.core.sched.output_rate": BURST_1S}, MARKER))
    run_dir = tmp_path / "run"
    pythonpath = os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH")) if p)
    spec = EngineSpec(
        name=ENGINE, kind="patched", feature=True, async_scheduling=False, model=str(tiny_model),
        served_name="tiny-qwen3",
        flags=["--max-model-len", "1024", "--max-num-seqs", "8", "--enforce-eager"],
        default_tps=100, user_tps={"user-a": LIMITS["user-a"]},
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": pythonpath},
    )
    engine = start_engine(spec, run_dir / "engines" / ENGINE, timeout_s=600)
    driver = Driver(uuid.uuid4().hex[:8], live=False)
    ctx = PhaseContext("seed-experiment", "2-streams", ENGINE, engine.endpoint, "tiny-qwen3")
    # user-a: 2 streams x 30 tokens at 20 tok/s (with the broken burst, 21 of them at once);
    # user-b: 1 stream x 60 tokens at 100 tok/s
    requests = [StreamRequest("user-a", "Rate limits in a shared scheduler", 30, stream_index=i) for i in range(2)]
    requests.append(StreamRequest("user-b", "Tokens per second for everyone", 60))
    try:
        start_ns = time.monotonic_ns()
        records = asyncio.run(driver.run_phase(ctx, requests, limits=dict(LIMITS)))
        end_ns = time.monotonic_ns()
    finally:
        engine.stop()
    log = engine.log_path.read_text(errors="replace")
    assert MARKER in log, "the broken limiter was not injected"
    meta = read_engine_events(engine.events_path).meta
    assert meta["burst_ns"] == BURST_1S_NS  # the EngineCore's own limiter ran with the broken burst
    assert all(r.error is None and r.completion_tokens == r.max_tokens for r in records), records

    write_run_files(
        run_dir, ENGINE,
        {"kind": "patched", "feature": True, "async_scheduling": False, "default_tps": spec.default_tps,
         "user_tps": spec.user_tps, "flags": spec.all_flags(), "events_file": f"engines/{ENGINE}/events.rbev",
         "log_file": f"engines/{ENGINE}/engine.log", "endpoint": engine.endpoint, "engine_meta": meta},
        [{"scenario": ctx.scenario, "kind": "seed-experiment", "phase": ctx.phase, "engine": ENGINE,
          "start_ns": start_ns, "end_ns": end_ns, "role": "measure",
          "users": {"user-a": {"limit_tps": 20, "streams": 2, "backlogged": True},
                    "user-b": {"limit_tps": 100, "streams": 1, "backlogged": False}},
          "params": {"max_tokens": 30, "ignore_eos": True}}],
        records, profile_name="cpu-tiny-mutant",
    )
    verdict = verify_run(run_dir, plots=False)
    failed = {(c.name, c.user) for c in verdict.failures}
    assert {("bound-dispatch", "user-a"), ("bound-dispatch-run", "user-a")} <= failed, verdict.summary()
    # the engine's own header says so too (engine-as-asked); the bound fails on the events alone
    assert {name for name, _ in failed} <= {"bound-dispatch", "bound-dispatch-run", "bound-emit", "bound-emit-run",
                                           "bound-client", "engine-as-asked"}, verdict.summary()
    worst = next(c for c in verdict.failures if (c.name, c.user) == ("bound-dispatch", "user-a"))
    assert worst.figure <= -10  # about 21 tokens at once where 0.1 * 20 + 1 = 3 may go
    # the header's 1 s burst is reported (engine-as-asked), not believed (the bound's burst stays 100 ms)
    (asked,) = [c for c in verdict.failures if c.name == "engine-as-asked"]
    assert "burst is 1000000000 ns" in asked.explanation

    result = CliRunner().invoke(app, ["verify-bound", str(run_dir), "--no-plots"])
    assert result.exit_code == 1, result.output
    assert "bound-dispatch" in result.output


# ---- broken engines driven by `ratebench run` ---------------------------------------------------------
# Each writes a sitecustomize that changes one module of vLLM in the engine's processes as it is
# imported (the API server's request models, or the EngineCore's loop), runs one scenario of a small
# profile through ratebench's own runner, and expects the verdict to name the promise it breaks.

# the API server takes the OpenAI `user` field for the rate-limit user (a careless gateway or patch)
TRUSTS_USER_FIELD = '''
cls = module.CompletionRequest if hasattr(module, "CompletionRequest") else module.ChatCompletionRequest
shipped = cls.to_sampling_params

def to_sampling_params(self, *args, **kwargs):
    params = shipped(self, *args, **kwargs)
    if getattr(self, "user", None):
        params.extra_args = {**(params.extra_args or {}), "output_rate_user": self.user}
    return params

cls.to_sampling_params = to_sampling_params
'''

# the EngineCore keeps a budget per user and priority: a request's priority, which vLLM 0.32.0 accepts
# under either policy, is part of whose budget it spends (a client sending priorities gets a budget
# for each)
BUDGET_PER_PRIORITY = '''
shipped = module.Request.__init__

def __init__(self, *args, **kwargs):
    shipped(self, *args, **kwargs)
    if self.priority:
        self.output_rate_user = f"{self.output_rate_user}/priority{self.priority}"

module.Request.__init__ = __init__
'''

# the answers of a request of n > 1 beyond the first (vLLM's child requests <index>_<id>) lose their user
ANSWERS_LOSE_THEIR_USER = '''
shipped = module.Request.__init__

def __init__(self, *args, **kwargs):
    shipped(self, *args, **kwargs)
    head = self.request_id.split("_", 1)[0]
    if head.isdigit() and head != "0":
        self.output_rate_user = "__anonymous__"

module.Request.__init__ = __init__
'''

# requests with structured outputs (a grammar the structured-output manager compiled) are never charged:
# their user is a str equal to the request's user (so every record names it) that the limiter lets through
STRUCTURED_OUTPUTS_FREE_REQUEST = '''
class _Uncharged(str):
    pass

shipped_init = module.Request.__init__

def __init__(self, *args, **kwargs):
    shipped_init(self, *args, **kwargs)
    if self.use_structured_output:
        self.output_rate_user = _Uncharged(self.output_rate_user)

module.Request.__init__ = __init__
'''
STRUCTURED_OUTPUTS_FREE_LIMITER = '''
cls = module.OutputRateLimiter
shipped_take, shipped_refund = cls.try_take, cls.refund

def try_take(self, user, now_ns):
    if type(user).__name__ == "_Uncharged":
        if not self.__dict__.get("_mutant_said"):
            self._mutant_said = True
            print("ratebench test mutant: structured outputs go uncharged", file=sys.stderr, flush=True)
        return True
    return shipped_take(self, user, now_ns)

def refund(self, user):
    if type(user).__name__ != "_Uncharged":
        shipped_refund(self, user)

cls.try_take, cls.refund = try_take, refund
'''

# the EngineCore polls its input queue instead of blocking on it while users wait for budget
POLLING_WAIT = '''
def poll(self, timeout_s):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            req = self.input_queue.get_nowait()
        except queue.Empty:
            continue
        self._handle_client_request(*req)
        return

module.EngineCoreProc._wait_for_output_rate_budget = poll
'''

# the EngineCore sleeps through the wait: new requests and aborts wait for it to end
DEAF_WAIT = '''
def sleep_through(self, timeout_s):
    time.sleep(timeout_s)

module.EngineCoreProc._wait_for_output_rate_budget = sleep_through
'''

# the EngineCore waits its full 50 ms whatever the users' ready times (it still listens for input)
# waits 200 ms whenever every request is throttled, whatever the users' ready times (with 50 ms, a CI
# run on a slow host let user-b pass: one 34 ms engine step widened even spacing's allowance to 4.9
# tokens of a 100 tok/s user, about the 50 ms it lost)
WAIT_IGNORES_READY = '''
def wait_200ms(self, timeout_s):
    try:
        req = self.input_queue.get(timeout=0.2)
    except queue.Empty:
        return
    self._handle_client_request(*req)

module.EngineCoreProc._wait_for_output_rate_budget = wait_200ms
'''

_USERS = {"user-a": 20, "user-b": 100, "user-slow": 5, "user-fast": 5000}

_WAITING = """
[[scenarios]]
kind = "waiting"
user = "user-slow"
probe_user = "user-fast"
streams = 2
max_tokens = 8
wait_s = 3.0
probes = 8
cancels = 6
busy_max_tokens = 150
"""

# with async scheduling, the empty batch in flight is left in the batch queue: the loop sleeps 1 ms
# and schedules the next empty batch (the shipped patch's loop before it finished that batch first)
ASYNC_POLLS_EMPTY_BATCHES = '''
module.EngineCoreProc._finish_output_rate_empty_batches = lambda self: False
'''

# a request that stops (EOS) while parked stays in the parked set: woken later, a finished request
# goes back into running (the patch takes it out of the parked set on any finish)
STOPPED_LEFT_PARKED = '''
cls = module.Scheduler
shipped_free = cls._free_request

def free_leaving_parked(self, request, *args, **kwargs):
    if getattr(request, "output_rate_parked", False) and request.status == module.RequestStatus.FINISHED_STOPPED:
        print("ratebench test mutant: a stopped request left parked", file=sys.stderr, flush=True)
        request.output_rate_parked = False
    return shipped_free(self, request, *args, **kwargs)

cls._free_request = free_leaving_parked
'''

# a request refused a charge is answered with an error after the step instead of pausing (the
# requests of users with budget are untouched): the scheduler remembers its refusals, the engine core
# finishes those requests with an error and tells the client, as it does for its own errors
ERROR_WHEN_REFUSED_SCHEDULER = '''
cls = module.Scheduler
shipped_refuse = cls._refuse_output_rate_charge

def refuse_and_remember(self, request, *args, **kwargs):
    self.__dict__.setdefault("_mutant_refused", set()).add(request.request_id)
    return shipped_refuse(self, request, *args, **kwargs)

cls._refuse_output_rate_charge = refuse_and_remember
'''
ERROR_WHEN_REFUSED_CORE = '''
from vllm.v1.request import RequestStatus

cls = module.EngineCoreProc
shipped_step = cls._process_engine_step

def step_failing_the_refused(self):
    executed = shipped_step(self)
    scheduler = self.scheduler
    refused = scheduler.__dict__.pop("_mutant_refused", set())
    alive = [scheduler.requests[r] for r in refused
             if r in scheduler.requests and not scheduler.requests[r].is_finished()]
    if alive:
        print("ratebench test mutant: refused requests answered with an error", file=sys.stderr, flush=True)
        scheduler.finish_requests([r.request_id for r in alive], RequestStatus.FINISHED_ERROR)
        by_client = {}
        for r in alive:
            by_client.setdefault(r.client_index, []).append(r.request_id)
        for client_index, ids in by_client.items():
            self._send_error_outputs_to_client(ids, client_index)
    return executed

cls._process_engine_step = step_failing_the_refused
'''

_EOS_ASYNC = """
[[scenarios]]
kind = "eos"
scheduling = ["async"]
user = "user-b"
requests = 16
concurrency = 4
max_tokens = 256
eos_logit_bias = 0
api = "chat"
"""

_SPOOFING = """
[[scenarios]]
kind = "anonymous-and-spoofing"
streams = 1
spoof_streams = 4
spoof_as = "user-fast"
named_user = "user-b"
named_streams = 2
max_tokens = 30
"""

_SEED = """
[[scenarios]]
kind = "seed-experiment"
user = "user-a"
neighbour = "user-b"
streams = [4]
neighbour_streams = 2
max_tokens = 20
neighbour_max_tokens = 100
"""

MARKER_ENGINE = "ratebench test mutant: broken engine"


def _run_broken(tmp_path, targets: dict[str, str], scenario: str, mode: str = "sync", max_engines: int = 1):
    """Run ``scenario`` on engines with ``targets`` injected (module -> code); ``max_engines`` 2: a
    phase on the limiter-on engine and its baseline on the limiter-off one start both engines at once
    (an engine start is mostly imports: two overlap on two cores)."""
    from rich.console import Console

    from ratebench.profiles import load_profile
    from ratebench.runner import RunOptions, run_profile

    hook_dir = tmp_path / "mutant-site"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(_hook(targets, MARKER_ENGINE))
    pythonpath = os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH")) if p)
    path = tmp_path / "broken.toml"
    path.write_text(e2e_profile("test: one scenario on a broken engine", _USERS, scenario, scheduling=(mode,),
                                max_engines=max_engines, max_num_seqs=8, env={"PYTHONPATH": pythonpath},
                                cpu_async_overlay=True))
    # the checks made before the engines start (promise 7, the flags) have their own broken limiters
    # (tests/test_feature_off_replay.py, tests/test_flag_check.py): left out here, 14 s a run
    outcome = run_profile(load_profile(str(path)), RunOptions(results_dir=tmp_path / "results", verify=True,
                                                              live=False, check_before_engines=False),
                          console=Console(stderr=True))
    logs = "".join(p.read_text(errors="replace") for p in (outcome.run_dir / "engines").glob("*/engine.log"))
    assert MARKER_ENGINE in logs, "the broken engine was not injected"
    assert outcome.verdict is not None, outcome.reason
    return outcome.verdict


def _failed(verdict) -> set[tuple[str, str | None]]:
    return {(c.name, c.user) for c in verdict.failures}


def test_an_api_server_that_trusts_the_openai_user_field_fails_identity(tmp_path, tiny_model):
    verdict = _run_broken(tmp_path, {"vllm.entrypoints.openai.completion.protocol": TRUSTS_USER_FIELD,
                                     "vllm.entrypoints.openai.chat_completion.protocol": TRUSTS_USER_FIELD},
                          _SPOOFING)
    failed = _failed(verdict)
    # the anonymous requests that name user-fast in the user field, and user-b's that do the same
    assert {("identity", "__anonymous__"), ("identity", "user-b")} <= failed, verdict.summary()
    anon = next(c for c in verdict.failures if (c.name, c.user) == ("identity", "__anonymous__"))
    assert "OpenAI user field" in anon.explanation and "charged to user-fast" in anon.explanation
    # spoofs through headers, other vllm_xargs keys and priorities reach nobody: only the user-field
    # requests fail
    assert anon.figure == 2  # one completions stream with the user field, one chat stream with all channels
    named = next(c for c in verdict.failures if (c.name, c.user) == ("identity", "user-b"))
    assert named.figure == 1, named.explanation  # its two streams: priority 1, and the chat one


# the API server reads output_rate_user on its streaming path only: a request answered in one body (no
# "stream") loses it, and the engine charges it to __anonymous__ (every streamed request as shipped)
UNSTREAMED_LOSE_THEIR_USER = '''
cls = module.CompletionRequest if hasattr(module, "CompletionRequest") else module.ChatCompletionRequest
shipped = cls.to_sampling_params

def to_sampling_params(self, *args, **kwargs):
    params = shipped(self, *args, **kwargs)
    if not self.stream and params.extra_args and "output_rate_user" in params.extra_args:
        params.extra_args = {k: v for k, v in params.extra_args.items() if k != "output_rate_user"}
    return params

cls.to_sampling_params = to_sampling_params
'''


def test_an_api_server_that_loses_the_user_of_unstreamed_requests_fails_identity_unstreamed(tmp_path, tiny_model):
    """Every streamed request is charged as shipped; the requests answered in one body that name user-b
    (one per API, and a batch of two prompts), and those naming near twins of its name, are charged to
    __anonymous__: a user could leave its budget by not streaming."""
    verdict = _run_broken(tmp_path, {"vllm.entrypoints.openai.completion.protocol": UNSTREAMED_LOSE_THEIR_USER,
                                     "vllm.entrypoints.openai.chat_completion.protocol": UNSTREAMED_LOSE_THEIR_USER},
                          _SPOOFING)
    # (delivery of __anonymous__ may fail beside it: on this small engine its 5 streams and user-b's 2 are at
    # the machine's capacity, 0.957 to 0.98 of its limit shipped, with or without these probes)
    failed = _failed(verdict) - {("delivery", "__anonymous__")}
    # user-b's three (a batch of two prompts among them), and the two near twins of its name (USER-B, "user-b ")
    assert failed == {("identity-unstreamed", u) for u in ("user-b", "USER-B", "user-b ")}, verdict.summary()
    bad = [c for c in verdict.failures if c.name == "identity-unstreamed"]
    assert sorted(c.figure for c in bad) == [4, 4, 4, 4, 8], [c.explanation for c in bad]
    assert all("charged to __anonymous__" in c.explanation and f"instead (0 tokens to {c.user})" in c.explanation
               for c in bad), [c.explanation for c in bad]


# the EngineCore folds a user's name (case, spaces around it) before it looks up the budget: "USER-B" and
# "user-b " spend user-b's. Every name the phase's streams send is folded already
NAMES_FOLDED = '''
shipped = module.Request.__init__

def __init__(self, *args, **kwargs):
    shipped(self, *args, **kwargs)
    self.output_rate_user = self.output_rate_user.strip().lower()

module.Request.__init__ = __init__
'''


def test_an_engine_that_folds_user_names_fails_identity_unstreamed(tmp_path, tiny_model):
    """Near twins of user-b's name, sent after the phase's streams, are charged to user-b: a client could
    spend (or leave) another user's budget by changing the case of its name. (Delivery of __anonymous__ may
    fail beside it, as in the test above.)"""
    verdict = _run_broken(tmp_path, {"vllm.v1.request": NAMES_FOLDED}, _SPOOFING)
    failed = _failed(verdict) - {("delivery", "__anonymous__")}
    assert failed == {("identity-unstreamed", "USER-B"), ("identity-unstreamed", "user-b ")}, verdict.summary()
    for c in verdict.failures:
        if c.name == "identity-unstreamed":
            assert "charged to user-b (4 tokens) instead" in c.explanation, c.explanation


def test_an_engine_that_keeps_a_budget_per_priority_fails_identity(tmp_path, tiny_model):
    verdict = _run_broken(tmp_path, {"vllm.v1.request": BUDGET_PER_PRIORITY}, _SPOOFING)
    failed = _failed(verdict)
    # the anonymous chat stream sent with priority -1, and user-b's streams with priority 1 and -1
    assert {("identity", "__anonymous__"), ("identity", "user-b")} <= failed, verdict.summary()
    anon = next(c for c in verdict.failures if (c.name, c.user) == ("identity", "__anonymous__"))
    assert "priority -1" in anon.explanation and "charged to __anonymous__/priority-1" in anon.explanation
    assert anon.figure == 1, anon.explanation  # spoof_streams = 4: the fifth channel (priority 1) unused
    named = next(c for c in verdict.failures if (c.name, c.user) == ("identity", "user-b"))
    assert named.figure == 2 and "charged to user-b/priority1" in named.explanation, named.explanation


def test_an_engine_whose_parallel_answers_lose_their_user_fails_identity(tmp_path, tiny_model):
    """A request of three answers is three engine requests; an engine that charges the second and third to
    the anonymous user (a user attached to the request's first answer only) gives user-a three answers
    for the price of one. Before the client read each answer apart, no scenario sent such a request."""
    verdict = _run_broken(tmp_path, {"vllm.v1.request": ANSWERS_LOSE_THEIR_USER}, """
[[scenarios]]
kind = "parallel-sampling"
user = "user-a"
requests = 2
n = 3
max_tokens = 20
""")
    assert ("identity", "user-a") in _failed(verdict), verdict.summary()
    (ident,) = [c for c in verdict.failures if (c.name, c.user) == ("identity", "user-a")]
    assert ident.figure == 4 and "charged to __anonymous__" in ident.explanation, ident.explanation


def test_an_engine_that_leaves_structured_outputs_uncharged_fails_the_bound(tmp_path, tiny_model):
    """Every scenario but request-options sends plain requests: a limiter that let requests with a JSON
    schema, a regex or a choice through uncharged passed them all. Here user-a (20 tok/s) sends one stream
    per option; the three structured ones run at the engine's speed."""
    verdict = _run_broken(tmp_path, {"vllm.v1.request": STRUCTURED_OUTPUTS_FREE_REQUEST,
                                     "vllm.v1.core.sched.output_rate": STRUCTURED_OUTPUTS_FREE_LIMITER}, """
[[scenarios]]
kind = "request-options"
user = "user-a"
options = ["json-schema", "regex", "choice", "logprobs", "chat"]
max_tokens = 20
""")
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "structured outputs go uncharged" in logs, "no structured request was charged: the path was not run"
    failed = _failed(verdict)
    assert {("bound-dispatch", "user-a"), ("bound-emit", "user-a"), ("bound-client", "user-a")} <= failed, \
        verdict.summary()
    # the three structured streams' 60 tokens, dispatched within the bound's window: -59.7 and -60.0 in two
    # runs; the emitted tokens spread with the engine's speed (-25.7 and -9.7)
    (dispatch,) = [c for c in verdict.failures if (c.name, c.user) == ("bound-dispatch", "user-a")]
    assert dispatch.figure <= -40, dispatch.explanation


# A structured request parked for its user's budget has its grammar matcher rolled back one token (as a
# refund path that gives back a token the request already sampled, or a resume from a stale state, would):
# the next token is masked as if the last were not there. vLLM's own check passes it (the engine's matcher
# is the one that went wrong); only the answer's tokens, held to a fresh matcher, show it.
GRAMMAR_FORGETS_ON_PARK = """
cls = module.Scheduler
shipped_park = cls._park_output_rate_request

def park_forgetting_the_grammar(self, request, ready_at_ns):
    shipped_park(self, request, ready_at_ns)
    so = request.structured_output_request
    if so is None or request.num_output_tokens == 0:
        return
    grammar = so.grammar
    if grammar is None or isinstance(grammar, Exception) or grammar.is_terminated():
        return
    if getattr(grammar, "num_processed_tokens", 0) > 0:
        grammar.rollback(1)
        if not self.__dict__.get("_mutant_said"):
            self._mutant_said = True
            print("ratebench test mutant: a parked request's grammar rolled back", file=sys.stderr, flush=True)

cls._park_output_rate_request = park_forgetting_the_grammar
"""


def test_an_engine_whose_parked_structured_requests_lose_their_grammar_state_fails_structured_answers(
        tmp_path, tiny_model):
    """Every structured request is charged and timed like a plain one, and vLLM accepts each token its own
    (rolled back) matcher allowed: the bound, spacing, reconciliation and vLLM's grammar check all pass.
    structured-answers feeds each constrained answer's tokens to a fresh matcher of its constraint."""
    verdict = _run_broken(tmp_path, {"vllm.v1.core.sched.scheduler": GRAMMAR_FORGETS_ON_PARK}, """
[[scenarios]]
kind = "request-options"
user = "user-a"
options = ["json-schema", "json-object", "regex", "choice", "allowed-token-ids", "chat"]
max_tokens = 20
""")
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "a parked request's grammar rolled back" in logs, "no structured request was parked: the path was not run"
    assert ("structured-answers", None) in _failed(verdict), verdict.summary()
    (check,) = [c for c in verdict.checks if c.name == "structured-answers"]
    assert check.figure >= 2, check.explanation  # of the four grammars (a choice may end before it is parked)
    # nothing else is wrong with the run: the answers are as long and as well timed as ever
    assert {name for name, _ in _failed(verdict)} == {"structured-answers"}, verdict.summary()


# The model runner drops a request from its persistent batch in a step that does not schedule it (a parked
# request) and adds it back when it runs again. Here, added back, it comes without its bad words (as a
# limiter that rebuilt a parked request's sampling state from part of its parameters would leave it): the
# ban holds for the first stretch of the answer only. Every token is charged and timed as before.
def _forget_on_readd(what: str, forget: str) -> str:
    """Mutant code for vllm.v1.worker.gpu_input_batch: a request added back to the persistent batch (it was
    there before: a parked one) runs ``forget`` (statements on ``self``, ``index`` and ``request`` that set
    ``forgot``) and says, once, that it came back without ``what``."""
    body = "\n".join(" " * 8 + line for line in forget.strip().splitlines())
    return f"""
cls = module.InputBatch
shipped_add = cls.add_request

def add_request_forgetting(self, request):
    index = shipped_add(self, request)
    seen = self.__dict__.setdefault("_mutant_seen", set())
    forgot = False
    if request.req_id in seen:
{body}
    if forgot and not self.__dict__.get("_mutant_said"):
        self._mutant_said = True
        print("ratebench test mutant: a request added back without its {what}", file=sys.stderr, flush=True)
    seen.add(request.req_id)
    return index

cls.add_request = add_request_forgetting
"""


BAD_WORDS_LOST_ON_READD = _forget_on_readd("bad words", """
forgot = self.bad_words_token_ids.pop(index, None) is not None
""")


def test_an_engine_whose_parked_requests_come_back_without_their_bad_words_fails_structured_answers(
        tmp_path, tiny_model):
    """The bad-words stream of a throttled user is parked between its tokens, out of the model runner's
    batch; added back without its ban it says a bad word (the tiny model says " re" or its EOS every other
    token; with " re" banned alone, one run in four of this test got an answer of 20 tokens that never came
    back to it). Its tokens are charged and timed as before; structured-answers expands the words as vLLM
    does and finds a banned sequence in the answer."""
    check = _one_option_broken(tmp_path, "vllm.v1.worker.gpu_input_batch", BAD_WORDS_LOST_ON_READD, "bad-words",
                               "a request added back without its bad words", 'bad_words = ["re", "<|im_end|>"]')
    assert any(f"the token sequence [{t}]" in check.explanation for t in (299, 268, 2)), check.explanation


def _one_option_broken(tmp_path, module: str, code: str, option: str, mutant_said: str, extra: str = ""):
    """request-options with one stream of ``option`` and a chat stream, of throttled user-a (``extra``: more
    of the scenario's lines), on an engine with ``code`` injected into ``module``: only that answer is
    broken (``_only_one_answer_broken``). Returns the check."""
    verdict = _run_broken(tmp_path, {module: code}, f"""
[[scenarios]]
kind = "request-options"
user = "user-a"
options = ["{option}", "chat"]
max_tokens = 20
{extra}
""")
    return _only_one_answer_broken(tmp_path, verdict, mutant_said, option)


def _only_one_answer_broken(tmp_path, verdict, mutant_said: str, option: str):
    """The mutant's path was run, structured-answers names the one answer of ``option`` as broken, and no
    other check failed (the answers are as long and as well timed as ever). Returns the check."""
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert mutant_said in logs, f"the mutant never acted ({mutant_said!r} not logged): the path was not run"
    assert ("structured-answers", None) in _failed(verdict), verdict.summary()
    (check,) = [c for c in verdict.checks if c.name == "structured-answers"]
    assert check.figure == 1 and f"(user-a, {option})" in check.explanation, check.explanation
    assert {name for name, _ in _failed(verdict)} == {"structured-answers"}, verdict.summary()
    return check


# vLLM masks a request's stop tokens until it has min_tokens (a logits processor fed, row by row, as the
# model runner adds requests to its persistent batch). Here a request added back after it had sampled (a
# parked one) loses that mask: the answer may stop early in content while ignore_eos keeps it running.
MIN_TOKENS_LOST_ON_READD = """
cls = module.MinTokensLogitsProcessor
shipped_add = cls.add_request

def add_request_forgetting_min_tokens(params, prompt_tok_ids, output_tok_ids):
    if output_tok_ids and params.min_tokens and len(output_tok_ids) < params.min_tokens:
        if not getattr(cls, "_mutant_said", False):
            cls._mutant_said = True
            print("ratebench test mutant: a request added back without its min_tokens", file=sys.stderr, flush=True)
        return None
    return shipped_add(params, prompt_tok_ids, output_tok_ids)

cls.add_request = staticmethod(add_request_forgetting_min_tokens)
"""


def test_an_engine_whose_parked_requests_come_back_without_min_tokens_fails_structured_answers(
        tmp_path, tiny_model):
    """The min-tokens stream (min_tokens = max_tokens, ignore_eos) of a throttled user, added back to the
    batch after it was parked, loses its mask of the stop tokens: the tiny model then says its EOS (token 2)
    soon. Every token is charged and the answer runs to max_tokens under ignore_eos, so nothing but its
    content shows it."""
    check = _one_option_broken(tmp_path, "vllm.v1.sample.logits_processor.builtin", MIN_TOKENS_LOST_ON_READD,
                               "min-tokens", "a request added back without its min_tokens")
    assert "a stop token among its first 20 tokens" in check.explanation, check.explanation


# vLLM applies a request's logit bias with a logits processor fed, row by row, as the model runner adds
# requests to its persistent batch. Here a request added back after it had sampled (a parked one) comes
# without its biases: a token its bias of -100 banned may come next.
LOGIT_BIAS_LOST_ON_READD = """
import dataclasses

cls = module.LogitBiasLogitsProcessor
shipped_update = cls.update_state

def update_forgetting_logit_bias(self, batch_update):
    if batch_update is not None and any(output and params is not None and params.logit_bias
                                        for _, params, _, output in batch_update.added):
        added = []
        for index, params, prompt, output in batch_update.added:
            if output and params is not None and params.logit_bias:
                params = params.clone()
                params.logit_bias = None
                if not getattr(cls, "_mutant_said", False):
                    cls._mutant_said = True
                    print("ratebench test mutant: a request added back without its logit bias", file=sys.stderr,
                          flush=True)
            added.append((index, params, prompt, output))
        batch_update = dataclasses.replace(batch_update, added=added)
    return shipped_update(self, batch_update)

cls.update_state = update_forgetting_logit_bias
"""


def test_an_engine_whose_parked_requests_come_back_without_their_logit_bias_fails_structured_answers(
        tmp_path, tiny_model):
    """The logit-bias stream of a throttled user bans " re" and the EOS (-100), tokens the tiny model says
    every other token; added back to the batch after it was parked it loses the bias, and says one of them.
    Every token is charged and timed as before, so nothing but the answer's content shows it."""
    check = _one_option_broken(tmp_path, "vllm.v1.sample.logits_processor.builtin", LOGIT_BIAS_LOST_ON_READD,
                               "logit-bias", "a request added back without its logit bias", "banned_token_ids = [299, 2]")
    assert "logit bias of -100 bans" in check.explanation, check.explanation


# The model runner's persistent batch holds each row's presence and frequency penalties. Here a request
# added back after it was parked comes without them (as a limiter that rebuilt a parked request's sampling
# state from part of its parameters would leave it): it repeats what its penalties held back.
PENALTIES_LOST_ON_READD = _forget_on_readd("penalties", """
forgot = request.req_id in self.presence_penalties_reqs | self.frequency_penalties_reqs
self.presence_penalties_cpu[index] = 0.0
self.frequency_penalties_cpu[index] = 0.0
self.presence_penalties_reqs.discard(request.req_id)
self.frequency_penalties_reqs.discard(request.req_id)
""")


def test_an_engine_whose_parked_requests_come_back_without_their_penalties_fails_structured_answers(
        tmp_path, tiny_model):
    """The penalties stream (presence and frequency 0.5, greedy) of a throttled user, added back to the batch
    after it was parked, loses its penalties and says again what they held back (the tiny model says " re"
    and its EOS every other token). Its tokens are charged and timed as before; the run scores the answer
    on the engine (raw prompt logprobs) and structured-answers applies the penalties itself."""
    check = _one_option_broken(tmp_path, "vllm.v1.worker.gpu_input_batch", PENALTIES_LOST_ON_READD, "penalties",
                               "a request added back without its penalties")
    assert "once its penalties (presence 0.5, frequency 0.5) were applied" in check.explanation, check.explanation


# The persistent batch holds each row's repetition penalty too. Here a request added back after it was parked
# comes without it: it repeats a token of its prompt or answer the penalty held back. The penalty scales a
# logit by its sign, which no logprob gives, so the run asks the engine again at each position (a fresh request
# under the penalty, biased a little towards the answer's token) and structured-answers holds the answer to
# what it picks.
REPETITION_PENALTY_LOST_ON_READD = _forget_on_readd("repetition penalty", """
forgot = request.req_id in self.repetition_penalties_reqs
self.repetition_penalties_cpu[index] = 1.0
self.repetition_penalties_reqs.discard(request.req_id)
""")


def test_an_engine_whose_parked_requests_come_back_without_their_repetition_penalty_fails_structured_answers(
        tmp_path, tiny_model):
    """The repetition-penalty stream (1.2, greedy) of a throttled user, added back to the batch after it was
    parked, loses its penalty and says again what it held back. Its tokens are charged and timed as before;
    the engine, asked again token by token under the penalty, picks other tokens."""
    check = _one_option_broken(tmp_path, "vllm.v1.worker.gpu_input_batch", REPETITION_PENALTY_LOST_ON_READD,
                               "repetition-penalty", "a request added back without its repetition penalty")
    assert "under the request's repetition penalty (1.2)" in check.explanation, check.explanation


def test_an_engine_that_polls_while_users_wait_fails_wait_cpu(tmp_path, tiny_model):
    verdict = _run_broken(tmp_path, {"vllm.v1.engine.core": POLLING_WAIT}, _WAITING)
    assert ("wait-cpu", None) in _failed(verdict), verdict.summary()
    assert {name for name, _ in _failed(verdict)} <= {"wait-cpu", "wait-steps", "wake-first-token", "wake-abort",
                                                     "even-spacing-emit", "even-spacing-dispatch"}, verdict.summary()
    (cpu,) = [c for c in verdict.checks if c.name == "wait-cpu"]
    assert cpu.figure > 0.3  # a core spinning, shared with the driver on two cores


def test_an_async_engine_that_polls_with_an_empty_batch_in_flight_fails_wait_cpu(tmp_path, tiny_model):
    """The waiting scenario on an async engine whose loop leaves the empty batch it scheduled in the
    batch queue, so it never blocks (seen here at 0.36 CPUs in cpu-tiny's scenario; 0.02 shipped)."""
    verdict = _run_broken(tmp_path, {"vllm.v1.engine.core": ASYNC_POLLS_EMPTY_BATCHES},
                          _WAITING.replace('kind = "waiting"', 'kind = "waiting"\nscheduling = ["async"]'), "async")
    # the polling shows in the engine's CPU (wait-cpu) or, on a slow CPU where the polls cost less than
    # the threshold, in its empty steps (wait-steps: 749 a second where 40 are allowed, seen once in CI)
    failed = {name for name, _ in _failed(verdict)}
    assert failed & {"wait-cpu", "wait-steps"}, verdict.summary()
    assert failed <= {"wait-cpu", "wait-steps", "wake-first-token", "wake-abort",
                      "even-spacing-emit", "even-spacing-dispatch"}, verdict.summary()
    assert all(c.engine.endswith("async") for c in verdict.failures), verdict.summary()


def test_an_async_engine_that_leaves_a_stopped_request_parked_fails(tmp_path, tiny_model):
    """With async scheduling user-b's request samples EOS in one step and is refused (parked) in the
    next, before the EOS arrives; a scheduler that then leaves it in the parked set wakes a finished
    request later. The run must not pass (the shipped patch passes this scenario: cpu-tiny's eos)."""
    verdict = _run_broken(tmp_path, {"vllm.v1.core.sched.scheduler": STOPPED_LEFT_PARKED}, _EOS_ASYNC, "async")
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "a stopped request left parked" in logs, "no request stopped while parked: the path was not run"
    assert not verdict.passed, verdict.summary()


def test_an_engine_that_answers_throttled_requests_with_an_error_fails_reconciliation(tmp_path, tiny_model):
    """Promise 3: a request out of budget pauses and resumes, it is never answered with an error.
    Here every request refused a charge is finished with an error after the step and the client told
    so (its stream ends early with finish_reason "error"); bound and spacing of what was delivered
    may hold."""
    verdict = _run_broken(tmp_path, {"vllm.v1.core.sched.scheduler": ERROR_WHEN_REFUSED_SCHEDULER,
                                     "vllm.v1.engine.core": ERROR_WHEN_REFUSED_CORE}, _SEED)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "refused requests answered with an error" in logs, "no request was refused: the path was not run"
    assert ("reconciliation", "user-a") in _failed(verdict), verdict.summary()
    (rec,) = [c for c in verdict.failures if (c.name, c.user) == ("reconciliation", "user-a")]
    assert "answered with an error" in rec.explanation or "finish_reason 'error'" in rec.explanation, rec


def test_an_engine_that_sleeps_through_its_wait_fails_to_wake(tmp_path, tiny_model):
    verdict = _run_broken(tmp_path, {"vllm.v1.engine.core": DEAF_WAIT}, _WAITING)
    names = {name for name, _ in _failed(verdict)}
    assert names & {"wake-first-token", "wake-abort"}, verdict.summary()
    assert names <= {"wake-first-token", "wake-abort"}, verdict.summary()


def test_an_engine_that_waits_past_the_ready_time_fails_even_spacing(tmp_path, tiny_model):
    verdict = _run_broken(tmp_path, {"vllm.v1.engine.core": WAIT_IGNORES_READY}, _SEED)
    failed = _failed(verdict)
    assert ("even-spacing-dispatch", "user-b") in failed, verdict.summary()
    assert ("even-spacing-dispatch", "user-a") in failed, verdict.summary()
    # the bound holds; the rate may suffer as well (delivery)
    assert {name for name, _ in failed} <= {"even-spacing-dispatch", "even-spacing-emit", "delivery"}, \
        verdict.summary()


# a throttled resident that gives its slot to a user with budget loses its KV blocks but keeps its
# computed tokens: it resumes (no recompute) on blocks that hold nothing of its own
YIELD_LOSING_KV = '''
cls = module.Scheduler
shipped_yield = cls._yield_output_rate_slot

def yield_losing_kv(self, request, timestamp):
    kept = shipped_yield(self, request, timestamp)
    if kept:
        if not self.__dict__.get("_mutant_said"):
            self._mutant_said = True
            print("ratebench test mutant: a request out of its slot lost its KV", file=sys.stderr, flush=True)
        self.kv_cache_manager.free(request)
    return kept

cls._yield_output_rate_slot = yield_losing_kv
'''

# more throttled users than slots (8), beside a tier whose limit never binds: throttled residents give
# their slots way and resume; the same greedy requests on the limiter-off engine. The crowd's answers
# are long enough (12 to 20 tokens) for many resumes with tokens after them: the tiny model's greedy
# answers repeat a few tokens, so a resume on the wrong KV parts from the right answer only now and
# then (9 and 2 of 77 answers in two runs with 6 to 12 tokens)
_CROWD_MIX = """
[[scenarios]]
kind = "mix"
name = "crowd"
seed = 3
duration_s = 3
output_tokens = { dist = "uniform", low = 12, high = 20 }
prompt_tokens = { dist = "lognormal", median = 24, sigma = 0.5, max = 120 }
lateness_ms = 100
baseline = true
[[scenarios.tiers]]
name = "crowd"
users = 12
limit_tps = 5
arrival = "closed"
streams = 2
requests = 2
[[scenarios.tiers]]
name = "steady"
users = 4
limit_tps = 2000
tier_rate = 20
"""


def test_an_engine_that_resumes_requests_on_kv_they_lost_fails_answers_intact(tmp_path, tiny_model):
    """Promise 3: a throttled answer resumes intact. Here a request moved out of its slot loses its KV
    but resumes as if it had kept it: every answer still has its length and its tokens come on time
    (bound, spacing, reconciliation hold), but what follows the resume is another text: the greedy
    answers differ from the limiter-off engine's."""
    verdict = _run_broken(tmp_path, {"vllm.v1.core.sched.scheduler": YIELD_LOSING_KV}, _CROWD_MIX, max_engines=2)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "a request out of its slot lost its KV" in logs, "no request gave its slot: the path was not run"
    print(verdict.summary())
    assert ("answers-intact", None) in _failed(verdict), verdict.summary()
    # how many answers part depends on how many throttled requests gave their slot right before a
    # token: 9 of 77 in one run, 2 of 77 in another; any is a failure
    (check,) = [c for c in verdict.failures if c.name == "answers-intact"]
    assert check.figure >= 1, check.explanation
    # scored on the limiter-off engine: not a tie broken the other way (20 of 77 in one run, each with a
    # token about 0.5 nats below that engine's choice)
    assert "not a tie, not its greedy answer" in check.explanation, check.explanation


# throttled residents keep their slots (the patch before work conservation): no slot is given to a
# request of a user with budget, which waits in the queue while the active places idle
KEEP_SLOTS = '''
cls = module.Scheduler
shipped_victim = cls._output_rate_victim

def victim_but_no_slot(self, request, benched=False, for_slot=False):
    if for_slot:
        if not self.__dict__.get("_mutant_said"):
            self._mutant_said = True
            print("ratebench test mutant: throttled residents keep their slots", file=sys.stderr, flush=True)
        return None
    return shipped_victim(self, request, benched)

cls._output_rate_victim = victim_but_no_slot
'''


def test_an_engine_whose_throttled_residents_keep_their_slots_fails_work_conservation(tmp_path, tiny_model):
    """Promise 4: throttled users never hold a resident slot a user with budget waits for. Here the
    crowd's parked requests keep all 8 slots: the steady tier's requests queue behind them while the
    active places idle. The engine's step records show it (work-conservation)."""
    # (no baseline phase: work conservation is judged from the limiter-on engine's own step records)
    # (and short answers: with the slots held, the steady tier waits for whole crowd answers)
    verdict = _run_broken(tmp_path, {"vllm.v1.core.sched.scheduler": KEEP_SLOTS},
                          _CROWD_MIX.replace("baseline = true", "baseline = false")
                          .replace("low = 12, high = 20", "low = 6, high = 12"))
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "throttled residents keep their slots" in logs, "no slot was asked for: the path was not run"
    print(verdict.summary())
    failed = _failed(verdict)
    assert ("work-conservation", None) in failed, verdict.summary()
    (check,) = [c for c in verdict.failures if c.name == "work-conservation"]
    assert check.figure > 10, check.explanation


def _rewriting_recorder(said: str, state: str, rewrite: str) -> str:
    """Mutant code for vllm.v1.core.sched.output_rate_events: a recorder whose header says the 100 ms burst,
    whose ``__init__`` runs ``state`` (statements on ``self`` and ``meta``, its header) and says ``said``, and
    whose ``end_step`` passes each pending event ``(t, kind, reason, req, user, count)`` through ``rewrite``
    (statements that may change ``t``) before handing it over."""
    state = "\n".join(" " * 4 + line for line in state.strip().splitlines())
    rewrite = "\n".join(" " * 12 + line for line in rewrite.strip().splitlines())
    return f"""
cls = module.OutputRateEventRecorder
shipped_init = cls.__init__
shipped_end_step = cls.end_step

def init_rewriting(self, path, meta):
    shipped_init(self, path, {{**meta, "burst_ns": 100_000_000}})
{state}
    print("ratebench test mutant: {said}", file=sys.stderr, flush=True)

def end_step_rewriting(self):
    if self._pending:
        out = []
        for t, kind, reason, req, user, count in self._pending:
{rewrite}
            out.append((t, kind, reason, req, user, count))
        self._pending = out
    shipped_end_step(self)

cls.__init__ = init_rewriting
cls.end_step = end_step_rewriting
"""


# the recorder lies: its header says the 100 ms burst, and it stamps each user's dispatches and emits on
# an even 1/N schedule (never earlier than the truth), so a one-second burst reads as a user served
# evenly at its limit
SMOOTHING_RECORDER = _rewriting_recorder("a recorder that smooths its stamps", """
self._mutant_rates = (meta.get("default_tps"), dict(meta.get("user_tps") or {}))
self._mutant_next = {}
""", """
default, users = self._mutant_rates
if default and kind in (module.KIND_DISPATCH, module.KIND_EMIT):
    key = (user, kind)
    t = max(t, self._mutant_next.get(key, 0))
    self._mutant_next[key] = t + count * (1_000_000_000 // users.get(user, default))
""")


def test_a_real_engine_with_a_burst_its_recorder_smooths_away_fails_the_client_witness(tmp_path, tiny_model):
    """Two witnesses: a limiter with a one-second burst whose event recorder stamps each user's tokens on
    an even 1/N schedule (and writes the 100 ms burst in its header) passes every check made on the
    file alone. The client, on the same clock, got user-a's burst at once: its tokens arrive before
    the engine says it emitted them (witness-order), and its chunks break the bound (bound-client)."""
    verdict = _run_broken(tmp_path, {"vllm.v1.core.sched.output_rate": BURST_1S,
                                     "vllm.v1.core.sched.output_rate_events": SMOOTHING_RECORDER}, _SEED)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "a recorder that smooths its stamps" in logs, "the recorder was not replaced"
    print(verdict.summary())
    failed = _failed(verdict)
    assert {("witness-order", "user-a"), ("bound-client", "user-a")} <= failed, verdict.summary()
    # on its own file the user looks served evenly at its limit: the bound holds there
    assert not {("bound-dispatch", "user-a"), ("bound-emit", "user-a")} & failed, verdict.summary()


# the recorder stretches one step a second: of the charges of a request it has seen for 1.6 s, one a second
# is stamped 1.5 s before it was made (after the request's first event, so no send contradicts it; every
# other stamp true). The phase's longest dispatch-to-emit then reads far longer than any step the engine
# ran (about 200 ms here, as the verifier pairs a request's emits with its charges): the step tolerance by
# which bound-emit and bound-client widen every window of the phase, room for a burst of that many tokens
STRETCHING_RECORDER = _rewriting_recorder("a recorder that stretches a step a second", """
self._mutant_seen = {}
self._mutant_stretched = 0
""", """
seen = self._mutant_seen.setdefault(req, t)
if kind == module.KIND_DISPATCH and t - self._mutant_stretched >= 1_000_000_000 and t - seen >= 1_600_000_000:
    self._mutant_stretched = t
    t -= 1_500_000_000
""")


def test_a_real_engine_whose_recorder_stretches_a_step_a_second_fails_witness_steps(tmp_path, tiny_model):
    """The limiter as shipped; its recorder stamps one charge a second 1.5 s early, so the phase's longest
    step (the bound's tolerance on emits and client chunks) reads about 200 ms. The client heard from the
    engine every few tens of milliseconds all along: no step was that long (witness-steps). The moved
    charges may also crowd a window of the user's charges (bound-dispatch, by a token or two) and leave
    another (even spacing, stream turns)."""
    verdict = _run_broken(tmp_path, {"vllm.v1.core.sched.output_rate_events": STRETCHING_RECORDER}, _SEED)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "a recorder that stretches a step a second" in logs, "the recorder was not replaced"
    failed = _failed(verdict)
    assert ("witness-steps", "user-a") in failed, verdict.summary()
    steps = [c for c in verdict.failures if c.name == "witness-steps"]
    assert all(c.figure > 2 * c.threshold for c in steps), verdict.summary()
    # the emits and what the client saw are true: the stretch only widened their windows. (Checks on the
    # charges may fail beside it, as the moved charges crowd one window and leave another: bound-dispatch,
    # even spacing, stream turns.)
    assert not {name for name, _ in failed} & {"bound-emit", "bound-client", "witness-order", "witness-emits",
                                               "witness-delivery"}, verdict.summary()


# the EngineCore's output thread gets what the engine sends in clumps: each output waits for the next
# half-second mark (the scheduler, its charges and its event file untouched: emits stay even and true)
CLUMPED_OUTPUTS = '''
cls = module.EngineCoreProc
shipped_init = cls.__init__

def init_clumping_outputs(self, *args, **kwargs):
    shipped_init(self, *args, **kwargs)
    out_q = self.output_queue
    shipped_get = out_q.get
    mark = [0.0]  # the last half-second mark a clump left at

    def get_in_clumps(*a, **k):
        item = shipped_get(*a, **k)
        if isinstance(item, tuple) and item[0] >= 0:  # a client's outputs (not stats, not the end)
            now = time.monotonic()
            if now >= mark[0] + 0.02:  # not part of the clump leaving now: held to the next mark
                mark[0] = (now // 0.5 + 1) * 0.5
                time.sleep(mark[0] - now)
        return item

    out_q.get = get_in_clumps
    print("ratebench test mutant: outputs held back in clumps", file=sys.stderr, flush=True)

cls.__init__ = init_clumping_outputs
'''


def test_a_real_engine_that_holds_outputs_back_in_clumps_fails_witness_delivery(tmp_path, tiny_model):
    """The engine schedules, charges and records as shipped, but its output thread hands the API server
    each output at the next half-second mark: the client gets a user's tokens in clumps the event file
    does not show. Every check made on the file passes, and bound-client too (its windows widen by the
    delivery spread it measures); the spread is judged (witness-delivery)."""
    verdict = _run_broken(tmp_path, {"vllm.v1.engine.core": CLUMPED_OUTPUTS}, _SEED)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "outputs held back in clumps" in logs, "the output path was not changed"
    failed = _failed(verdict)
    assert ("witness-delivery", "user-a") in failed, verdict.summary()
    assert {name for name, _ in failed} <= {"witness-delivery"}, verdict.summary()
    worst = max(c.figure for c in verdict.failures)
    assert worst > 300, verdict.summary()


# under the PRIORITY policy the places are a sort of running by priority and the users' turns
# (_order_output_rate_running; FCFS has the bench instead): here running keeps its order and the queue's
# head never takes a turn, so whoever is first in running keeps the places (the harness's
# places-in-list-order, on a real engine)
PLACES_IN_LIST_ORDER = '''
cls = module.Scheduler

def places_in_list_order(self, now_ns):
    if not self.__dict__.get("_mutant_said"):
        self._mutant_said = True
        print("ratebench test mutant: places in list order", file=sys.stderr, flush=True)
    return 0

cls._order_output_rate_running = places_in_list_order
'''

_ACTIVE_CAP = """
[[scenarios]]
kind = "active-cap-fairness"     # 4 users x 2 streams on 4 active places; then 4 x 1 and cap-high x 2
users = 4
streams = 2
max_tokens = 300
lead_s = 0.2
"""


def test_a_priority_engine_whose_places_go_in_list_order_fails_place_share(tmp_path, tiny_model):
    """Promise 4 under vLLM's PRIORITY policy (the "priority" scheduling mode: its own places code):
    with more streams than places, the users first in running keep the places and the others get
    none while they wait."""
    verdict = _run_broken(tmp_path, {"vllm.v1.core.sched.scheduler": PLACES_IN_LIST_ORDER}, _ACTIVE_CAP,
                          mode="priority")
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "places in list order" in logs, "the places were never ordered: the path was not run"
    failed = _failed(verdict)
    assert "place-share" in {name for name, _ in failed}, verdict.summary()
    print(verdict.summary())
    worst = min(c.figure for c in verdict.failures if c.name == "place-share")
    assert worst < 0.3, verdict.summary()
    (asked,) = [c for c in verdict.checks if c.name == "engine-as-asked"]
    assert asked.passed and "priority policy" in asked.explanation, asked.explanation


# under the PRIORITY policy the places go round the users in turn whatever their priorities (running sorted
# by the users' turns only, as under FCFS): the harness's places-ignore-priority, on a real engine
PLACES_IGNORE_PRIORITY = '''
from vllm.v1.core.sched.request_queue import SchedulingPolicy

cls = module.Scheduler
shipped_order = cls._order_output_rate_running

def order_by_turns_only(self, now_ns):
    if not self.__dict__.get("_mutant_said"):
        self._mutant_said = True
        print("ratebench test mutant: places ignore priorities", file=sys.stderr, flush=True)
    policy = self.policy
    self.policy = SchedulingPolicy.FCFS
    try:
        return shipped_order(self, now_ns)
    finally:
        self.policy = policy

cls._order_output_rate_running = order_by_turns_only
'''


def test_a_priority_engine_whose_places_ignore_priorities_fails_place_share(tmp_path, tiny_model):
    """Higher priorities first (the "priority" mode's cap-priority phase: cap-high's two streams at
    priority -1 beside four users at 0 on 4 places): places in turn give cap-high one place a step
    where its two streams could have two. cap-equal and cap-high, one priority each, pass."""
    verdict = _run_broken(tmp_path, {"vllm.v1.core.sched.scheduler": PLACES_IGNORE_PRIORITY}, _ACTIVE_CAP,
                          mode="priority")
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "places ignore priorities" in logs, "the places were never ordered: the path was not run"
    print(verdict.summary())
    failed = _failed(verdict)
    # place-share's floor (0.5) is met or missed by a hair by places that go round the six streams evenly
    # (0.50 of cap-high's fair share once running was sorted by turn keys); cap-high, above the lowest
    # priority, is owed its whole share: place-share-priority fails it
    assert ("place-share-priority", "cap-high") in failed, verdict.summary()
    (high,) = [c for c in verdict.failures if c.name == "place-share-priority"]
    assert high.phase == "cap-priority" and high.figure < 0.8, high.explanation
    assert {name for name, _ in failed} <= {"place-share", "place-share-jain", "place-share-max", "place-share-priority"}, \
        verdict.summary()


# the API server lets beam search through with the limiter on (the patch's refusal skipped on both APIs)
BEAM_SEARCH_LET_THROUGH = '''
module.validate_beam_search_output_rate = lambda vllm_config: None
'''


def test_an_api_server_that_lets_beam_search_through_fails_beam_search_refused(tmp_path, tiny_model):
    verdict = _run_broken(tmp_path, {"vllm.entrypoints.openai.completion.serving": BEAM_SEARCH_LET_THROUGH,
                                     "vllm.entrypoints.openai.chat_completion.serving": BEAM_SEARCH_LET_THROUGH},
                          _SPOOFING)
    probes = [c for c in verdict.checks if c.name == "beam-search-refused"]
    print("\n".join(c.explanation for c in probes))
    assert len(probes) == 2 and not any(c.passed for c in probes), [c.explanation for c in probes]
    assert all(c.figure != 400 for c in probes)


# the API server refuses beam search whether the limiter is on or off (say, a refusal that asks whether the
# patch is installed instead of whether the limiter is on): promise 7 broken at the API, not in the scheduler
BEAM_SEARCH_ALWAYS_REFUSED = '''
module.validate_beam_search_output_rate = lambda vllm_config: (
    "Beam search is not supported while per-user output rate limiting is enabled.")
'''

_SMALL_MIX = """
[[scenarios]]
kind = "mix"
seed = 4
duration_s = 1
output_tokens = { dist = "uniform", low = 4, high = 12 }
baseline = true
[[scenarios.tiers]]
name = "tier"
users = 2
limit_tps = 50
rate = 2.0
"""


def test_an_api_server_that_refuses_beam_search_with_the_limiter_off_fails_beam_search_off_served(
        tmp_path, tiny_model):
    """Promise 7 at the API: the mix's phase on the limiter-off engine probes beam search on each API."""
    verdict = _run_broken(tmp_path, {"vllm.entrypoints.openai.completion.serving": BEAM_SEARCH_ALWAYS_REFUSED,
                                     "vllm.entrypoints.openai.chat_completion.serving": BEAM_SEARCH_ALWAYS_REFUSED},
                          _SMALL_MIX, max_engines=2)
    probes = [c for c in verdict.checks if c.name == "beam-search-off-served"]
    print("\n".join(c.explanation for c in probes))
    assert len(probes) == 2 and not any(c.passed for c in probes), [c.explanation for c in probes]
    assert all(c.figure == 400 and c.engine.startswith("feature-off") for c in probes)
    assert {c.name for c in verdict.failures} == {"beam-search-off-served"}, verdict.summary()


# a refused request's prompt runs up to the token that samples whatever its sampling (the patch before it kept
# a seeded request's prompt whole on CPU): the model runner then rewinds the seeded request's generator, which
# the CPU build cannot do ("CPU Generator does not use offset"), and the engine dies
SEEDED_PARTIAL_PREFILL = '''
cls = module.Scheduler
shipped_init = cls.__init__

def init_with_partial_seeded_prefills(self, *args, **kwargs):
    shipped_init(self, *args, **kwargs)
    self._output_rate_seeded_prefill_whole = False
    print("ratebench test mutant: seeded prompts run partly while refused", file=sys.stderr, flush=True)

cls.__init__ = init_with_partial_seeded_prefills
'''

_EOS = """
[[scenarios]]
kind = "eos"
user = "user-b"
requests = 8
concurrency = 4
max_tokens = 64
eos_logit_bias = 0
api = "chat"
"""


def test_an_engine_that_runs_a_refused_seeded_prompt_partly_fails_on_cpu(tmp_path, tiny_model):
    """Promise 3 (never answered with an error): the eos scenario's answers are sampled with seeds of their
    own; a throttled user's new request is refused at its last prompt token. Run partly, its seeded
    generator must be rewound, which kills the CPU engine: every answer after it is an error."""
    verdict = _run_broken(tmp_path, {"vllm.v1.core.sched.scheduler": SEEDED_PARTIAL_PREFILL}, _EOS)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "seeded prompts run partly" in logs, "the scheduler was not changed"
    assert "does not use offset" in logs, "no seeded partial prefill reached the model runner"
    print(verdict.summary())
    assert ("reconciliation", "user-b") in _failed(verdict), verdict.summary()
    (rec,) = [c for c in verdict.failures if c.name == "reconciliation"]
    assert "answered with an error" in rec.explanation, rec.explanation


# the scheduler ends an answer that may end at its EOS early, calling it "stop", once its user is out of
# budget (say, a throttled request the patch gave up on): its tokens, usage and engine events all agree
CUT_THROTTLED_AS_STOP = '''
from vllm.v1.request import RequestStatus

cls = module.Scheduler
shipped_update = cls._update_request_with_output

def update_cutting_throttled(self, request, new_token_ids, *args, **kwargs):
    new_token_ids, stopped = shipped_update(self, request, new_token_ids, *args, **kwargs)
    limiter = self.output_rate_limiter
    params = request.sampling_params
    if (not stopped and limiter is not None and params is not None and not params.ignore_eos
            and request.num_output_tokens >= 4
            and limiter.ready_at_ns(request.output_rate_user) > limiter.clock_ns()):
        request.status = RequestStatus.FINISHED_STOPPED
        stopped = True
        print("ratebench test mutant: a throttled answer cut as stop", file=sys.stderr, flush=True)
    return new_token_ids, stopped

cls._update_request_with_output = update_cutting_throttled
'''


def test_an_engine_that_cuts_throttled_answers_short_as_stop_fails_reconciliation(tmp_path, tiny_model):
    """Promise 3 (never truncated): an answer that may end at its EOS, ended early by the scheduler while its
    user is out of budget and called "stop". Its usage, its streamed tokens and the engine's events agree,
    and its finish reason is one an answer may end with: only its last token, not one of the model's stop
    tokens, shows it was cut."""
    verdict = _run_broken(tmp_path, {"vllm.v1.core.sched.scheduler": CUT_THROTTLED_AS_STOP}, _EOS)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "results").rglob("engine.log"))
    assert "a throttled answer cut as stop" in logs, "no answer was cut"
    assert ("reconciliation", "user-b") in _failed(verdict), verdict.summary()
    (rec,) = [c for c in verdict.failures if c.name == "reconciliation"]
    assert "is not one of the model's stop tokens (ids 2)" in rec.explanation, rec.explanation
    assert {c.name for c in verdict.failures} == {"reconciliation"}, verdict.summary()


# the patched scheduler costs 4 ms a step whether the limiter is on or off (say, bookkeeping run before
# it asks whether the feature is on); stock vLLM, served from the pristine sources, is left alone
SLOW_EVEN_WHEN_OFF = '''
import time

cls = module.Scheduler
if hasattr(cls, "_order_output_rate_running"):  # the patched scheduler, not the stock engine's pristine one
    shipped_schedule = cls.schedule

    def slow_schedule(self, *args, **kwargs):
        time.sleep(0.010)
        return shipped_schedule(self, *args, **kwargs)

    cls.schedule = slow_schedule
    print("ratebench test mutant: 10 ms a step, limiter on or off", file=sys.stderr, flush=True)
'''

_OVERHEAD = """
[[scenarios]]
kind = "overhead"
user = "user-fast"
streams = 8
max_tokens = 96
rounds = 1
against = ["feature-off", "stock"]
max_overhead = 0.35
"""


def test_a_patch_that_slows_every_step_even_with_the_limiter_off_fails_against_stock(tmp_path, tiny_model):
    """The limiter-off engine is every isolation check's baseline: a patch that slows every step, limiter on
    or off, keeps the limiter-on engine level with it and passes them all. Only stock vLLM, side by side,
    shows the cost: overhead (feature-on/stock) and feature-off-cost (feature-off/stock, promise 7). (The
    mutant adds 10 ms a step: 4 ms, on a slow afternoon whose stock steps took about 6 ms, cost the
    limiter-on engine only 0.31 of stock's throughput in a one-round run, under the 0.35 allowed.)"""
    verdict = _run_broken(tmp_path, {"vllm.v1.core.sched.scheduler": SLOW_EVEN_WHEN_OFF}, _OVERHEAD, max_engines=3)
    checks = {c.phase: c for c in verdict.checks if c.name in ("overhead", "feature-off-cost")}
    print("\n".join(f"{c.name} {c.phase}: {c.figure} ({c.explanation})" for c in checks.values()))
    assert checks["feature-off/stock"].passed is False and checks["feature-off/stock"].figure > 0.35
    assert checks["feature-on/stock"].passed is False
    assert checks["feature-on/feature-off"].passed  # both slowed alike: the pair that cannot see it
