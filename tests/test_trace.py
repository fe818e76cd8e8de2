"""The trace scenario: the trace format and every mistake in it (refused at profile load, naming the
file and line), traces made from a run's client records, the requests a trace becomes, its phase's
users and estimate, and the trace-lateness check. Against a real engine: tests/test_trace_e2e.py."""

from __future__ import annotations

import asyncio
import copy
import json
import time
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ratebench.analysis.lateness import trace_lateness
from ratebench.cli import app
from ratebench.runrecords import ClientRecord, write_client_records
from ratebench.profiles import BUILTIN_DIR, Limits, ProfileError, load_profile, parse_profile
from ratebench.scenarios import ScenarioContext, plan_scenario
from ratebench.scenarios.trace import trace_estimate, trace_phase_users, trace_streams
from synth import SimEngine, SimPhase, SimRequest, write_run_folder
from ratebench.trace import (
    TraceError,
    TraceRequest,
    parse_trace,
    read_trace,
    trace_from_records,
    trace_users,
    write_trace,
)
from ratebench.verify import analyse_run
from ratebench.workload import Driver, PhaseContext

from synthetic_runs import edit_client_records

EXAMPLE = BUILTIN_DIR / "example-trace.jsonl"
REPO = Path(__file__).resolve().parent.parent


# ---- the format ---------------------------------------------------------------------


def test_the_example_trace_has_every_feature_of_the_format() -> None:
    reqs = read_trace(EXAMPLE)
    assert 24 <= len(reqs) <= 60 and 5 <= max(r.at_s for r in reqs) <= 12
    users = trace_users(reqs)
    assert 4 <= len(users) <= 6 and "__anonymous__" in users
    assert any(r.cancel_after_tokens for r in reqs) and any(r.cancel_after_s for r in reqs)
    assert any(r.eos for r in reqs) and any(r.prefix_group for r in reqs)
    assert {r.api for r in reqs} == {"completions", "chat"}
    assert any(isinstance(r.prompt, str) for r in reqs) and any(isinstance(r.prompt, int) for r in reqs)
    assert [r.at_s for r in reqs] == sorted(r.at_s for r in reqs)


def test_the_example_trace_ships_in_the_package() -> None:
    with (REPO / "pyproject.toml").open("rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["ratebench"]
    assert "profiles/*.jsonl" in package_data


def test_a_line_reads_with_its_defaults_and_writes_back_the_same() -> None:
    text = ('{"at_s": 1.5, "user": null, "prompt": 12, "max_tokens": 8}\n\n'
            '{"at_s": 0, "user": "u", "prompt": "hello", "max_tokens": 4, "eos": true, "api": "chat", '
            '"cancel_after_tokens": 2, "cancel_after_s": 0.5, "prefix_group": "g", "prefix_tokens": 64}\n')
    first, second = parse_trace(text, "t.jsonl")  # sorted by arrival
    assert (first.user, first.line, first.eos, first.api) == ("u", 3, True, "chat")
    assert (second.user, second.line, second.eos, second.api, second.prefix_group) == (None, 1, False,
                                                                                        "completions", None)
    assert second.to_json() == {"at_s": 1.5, "user": None, "prompt": 12, "max_tokens": 8}
    assert first.expected_tokens() is None and second.expected_tokens() == 8
    assert parse_trace("\n".join(json.dumps(r.to_json()) for r in (second, first)), "x")[0].to_json() == \
        first.to_json()


_GOOD = {"at_s": 0.5, "user": "u", "prompt": 16, "max_tokens": 8}


@pytest.mark.parametrize("line, field, expected", [
    ({**_GOOD, "usr": "u"}, "usr", "one of the known fields"),
    ([1, 2], "", "a JSON object"),
    ({k: v for k, v in _GOOD.items() if k != "at_s"}, "at_s", "it is required"),
    ({k: v for k, v in _GOOD.items() if k != "prompt"}, "prompt", "it is required"),
    ({k: v for k, v in _GOOD.items() if k != "max_tokens"}, "max_tokens", "it is required"),
    ({**_GOOD, "at_s": -1}, "at_s", "a number >= 0"),
    ({**_GOOD, "at_s": "1"}, "at_s", "a number >= 0"),
    ({**_GOOD, "at_s": True}, "at_s", "a number >= 0"),
    ({**_GOOD, "user": ""}, "user", "a user name, or null"),
    ({**_GOOD, "user": 7}, "user", "a user name, or null"),
    ({**_GOOD, "user": "__anonymous__"}, "user", "not \"__anonymous__\""),
    ({**_GOOD, "prompt": 0}, "prompt", "a prompt length in tokens"),
    ({**_GOOD, "prompt": ""}, "prompt", "the prompt text"),
    ({**_GOOD, "prompt": 1.5}, "prompt", "a positive integer"),
    ({**_GOOD, "max_tokens": 0}, "max_tokens", "a positive integer"),
    ({**_GOOD, "max_tokens": True}, "max_tokens", "a positive integer"),
    ({**_GOOD, "cancel_after_tokens": 0}, "cancel_after_tokens", "a positive integer"),
    ({**_GOOD, "cancel_after_s": 0}, "cancel_after_s", "a positive number of seconds"),
    ({**_GOOD, "eos": "yes"}, "eos", "true"),
    ({**_GOOD, "api": "responses"}, "api", "one of ['completions', 'chat']"),
    ({**_GOOD, "prefix_group": "g"}, "prefix_tokens", "prefix_group and prefix_tokens together"),
    ({**_GOOD, "prefix_tokens": 64}, "prefix_group", "prefix_group and prefix_tokens together"),
    ({**_GOOD, "prefix_group": "", "prefix_tokens": 64}, "prefix_group", "a group name"),
    ({**_GOOD, "prefix_group": "g", "prefix_tokens": 0}, "prefix_tokens", "a positive integer"),
])
def test_every_malformed_field_is_refused_with_file_line_and_expectation(line, field, expected) -> None:
    text = json.dumps(_GOOD) + "\n" + json.dumps(line) + "\n"
    with pytest.raises(TraceError) as info:
        parse_trace(text, "my.jsonl")
    err = info.value
    assert (err.path, err.line, err.field) == ("my.jsonl", 2, field)
    assert expected in str(err) and str(err).startswith("my.jsonl: line 2")


def test_a_line_that_is_not_json_names_its_line() -> None:
    with pytest.raises(TraceError, match=r"^t.jsonl: line 2: expected one JSON object per line"):
        parse_trace(json.dumps(_GOOD) + "\n{at_s: 1}\n", "t.jsonl")


def test_an_empty_trace_is_refused() -> None:
    with pytest.raises(TraceError, match="at least one request"):
        parse_trace("\n\n", "t.jsonl")


def test_a_prefix_group_has_one_length() -> None:
    text = "\n".join(json.dumps({**_GOOD, "prefix_group": "g", "prefix_tokens": n}) for n in (64, 64, 32))
    with pytest.raises(TraceError) as info:
        parse_trace(text, "t.jsonl")
    assert info.value.line == 3 and "as on line 1 (64)" in str(info.value)


def test_a_changed_trace_is_refused_against_its_digest(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(_GOOD) + "\n")
    with pytest.raises(TraceError, match="as it was when the profile was loaded"):
        read_trace(path, sha256="0" * 64)


# ---- in a profile -------------------------------------------------------------------

_PROFILE = {
    "profile": {"scheduling": ["sync"]},
    "model": {"source": "tiny", "max_model_len": 1024},
    "engine": {"max_num_seqs": 8, "max_num_active_seqs": 2},
    "limits": {"default_tps": 100, "users": {"user-a": 20, "user-b": 100, "user-c": 200, "user-fast": 2000}},
    "scenarios": [{"kind": "trace", "trace": "example-trace"}],
}


def _profile(tmp_path: Path, **scenario) -> dict:
    data = copy.deepcopy(_PROFILE)
    data["scenarios"][0].update(scenario)
    return data


def _refused(data: dict, path: Path | str, key: str, expected: str) -> ProfileError:
    with pytest.raises(ProfileError) as info:
        parse_profile(data, path)
    assert info.value.key == key, str(info.value)
    assert expected in str(info.value), str(info.value)
    return info.value


def test_a_builtin_trace_loads_with_its_digest_and_size(tmp_path: Path) -> None:
    prof = parse_profile(_profile(tmp_path), tmp_path / "p.toml")
    p = prof.scenarios[0].params
    assert p["trace_path"] == str(EXAMPLE.resolve()) and p["trace_requests"] == len(read_trace(EXAMPLE))
    assert len(p["trace_sha256"]) == 64 and p["lateness_ms"] is None and p["backlogged"] == []
    assert "api" not in p and "prompt_tokens" not in p  # each request says its own


def test_a_trace_path_is_relative_to_the_profile(tmp_path: Path) -> None:
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "mine.jsonl").write_text(json.dumps({**_GOOD, "user": "user-a"}) + "\n")
    prof = parse_profile(_profile(tmp_path, trace="traces/mine.jsonl"), tmp_path / "p.toml")
    assert prof.scenarios[0].params["trace_path"] == str((tmp_path / "traces" / "mine.jsonl").resolve())


def test_a_missing_trace_is_refused_naming_the_builtin_ones(tmp_path: Path) -> None:
    err = _refused(_profile(tmp_path, trace="nope.jsonl"), tmp_path / "p.toml", "scenarios[0].trace",
                   "an existing trace file")
    assert "example-trace" in str(err) and str(err).startswith(str(tmp_path / "p.toml"))


def test_a_malformed_trace_line_is_refused_at_profile_load_with_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text(json.dumps({**_GOOD, "user": "user-a"}) + "\n" +
                                      json.dumps({**_GOOD, "user": "user-a", "max_tokens": -3}) + "\n")
    err = _refused(_profile(tmp_path, trace="t.jsonl"), tmp_path / "p.toml", "line 2: max_tokens",
                   "a positive integer, got -3")
    assert str(err).startswith(f"{tmp_path / 't.jsonl'}: line 2: max_tokens: expected")


def test_an_empty_trace_file_is_refused_at_profile_load(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text("")
    _refused(_profile(tmp_path, trace="t.jsonl"), tmp_path / "p.toml", "(file)", "at least one request")


def test_trace_users_must_be_declared_unless_they_take_the_default_rate(tmp_path: Path) -> None:
    data = _profile(tmp_path)
    del data["limits"]["users"]["user-c"]
    err = _refused(data, tmp_path / "p.toml", "line 6: user", "a user declared in [limits.users]")
    assert "users_at_default_rate" in str(err) and str(err).startswith(str(EXAMPLE))
    data["scenarios"][0]["users_at_default_rate"] = True
    prof = parse_profile(data, tmp_path / "p.toml")
    assert prof.limits.limit_of("user-c") == 100


def test_backlogged_users_must_be_users_of_the_trace(tmp_path: Path) -> None:
    _refused(_profile(tmp_path, backlogged=["user-z"]), tmp_path / "p.toml", "scenarios[0].backlogged",
             "users of the trace")
    _refused(_profile(tmp_path, backlogged="user-a"), tmp_path / "p.toml", "scenarios[0].backlogged",
             "a list of distinct user names")
    prof = parse_profile(_profile(tmp_path, backlogged=["user-a", "__anonymous__"]), tmp_path / "p.toml")
    assert prof.scenarios[0].params["backlogged"] == ["user-a", "__anonymous__"]


def test_each_request_must_fit_the_model_length(tmp_path: Path) -> None:
    data = _profile(tmp_path)
    data["model"]["max_model_len"] = 200
    _refused(data, tmp_path / "p.toml", "line 6: max_tokens", "within model.max_model_len (200)")


@pytest.mark.parametrize("key, value, expected", [
    ("lateness_ms", 0, "a positive number"),
    ("users_at_default_rate", "yes", "true or false"),
    ("api", "chat", "one of the known keys"),
    ("prompt_tokens", 32, "one of the known keys"),
])
def test_trace_scenario_parameters_are_checked(tmp_path: Path, key, value, expected) -> None:
    _refused(_profile(tmp_path, **{key: value}), tmp_path / "p.toml", f"scenarios[0].{key}", expected)


def test_a_trace_scenario_needs_its_trace(tmp_path: Path) -> None:
    data = _profile(tmp_path)
    del data["scenarios"][0]["trace"]
    _refused(data, tmp_path / "p.toml", "scenarios[0].trace", "it is required")


def test_a_bad_trace_exits_2_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text('{"at_s": 0, "prompt": 4, "max_tokens": 4, "colour": "red"}\n')
    toml = (BUILTIN_DIR / "cpu-tiny.toml").read_text().replace('trace = "example-trace"', 'trace = "t.jsonl"')
    (tmp_path / "bad.toml").write_text(toml)
    result = CliRunner().invoke(app, ["run", "--profile", str(tmp_path / "bad.toml"),
                                      "--results", str(tmp_path / "results")])
    assert result.exit_code == 2
    assert "t.jsonl: line 1: colour: expected one of the known fields" in " ".join(result.output.split())
    assert not (tmp_path / "results").exists()


# ---- the phase ----------------------------------------------------------------------


def test_the_trace_is_one_phase_with_every_trace_user_backlogged_only_where_the_profile_says() -> None:
    prof = load_profile("cpu-tiny")
    spec = next(s for s in prof.scenarios if s.kind == "trace")
    (phase,) = plan_scenario(spec)
    assert (phase.phase, phase.engine) == ("trace", "patched-sync")
    reqs = read_trace(EXAMPLE)
    users = trace_phase_users(reqs, ["user-a"])
    assert set(users) == set(trace_users(reqs))
    assert sum(u["streams"] for u in users.values()) == len(reqs)
    assert [u for u, info in users.items() if info["backlogged"]] == ["user-a"]


def test_the_estimate_is_the_last_arrival_or_a_users_tokens_at_its_limit() -> None:
    limits = Limits(default_tps=100, user_tps={"a": 10})
    reqs = [TraceRequest(0.5, "a", 8, 40), TraceRequest(1.0, "a", 8, 60, cancel_after_tokens=10),
            TraceRequest(2.0, None, 8, 500, cancel_after_s=1.0), TraceRequest(3.0, None, 8, 500, eos=True)]
    est = trace_estimate(reqs, limits)
    assert est.at_least_s == pytest.approx(0.5 + 50 / 10)
    assert "a 50 tok at 10 tok/s from 0.5 s: 5.5 s" in est.basis and "4 requests" in est.basis
    assert trace_estimate(reqs, None).at_least_s == 3.0


class _FakeMaker:
    """Token ids 1000 + n for prompts; a distinct id below 1000 per salt for headers (one table for
    every maker: ``hash(salt) % 1000``, which changes from run to run, made two of 33 prompts equal
    in a CI run)."""

    _salt_ids: dict[str, int] = {}

    async def token_prompt(self, n: int, salt: str, prefix: list[int] | None = None) -> list[int]:
        salt_id = self._salt_ids.setdefault(salt, len(self._salt_ids) % 1000)
        return (prefix or []) + [salt_id] + [1000 + i for i in range(n - 1)]

    def text_prompt(self, approx_tokens: int, salt: str) -> str:
        return f"[{salt}] " + "w " * approx_tokens


class _FakeDriver:
    def __init__(self) -> None:
        self.run_id = "ab12cd34"

    async def prompts(self, endpoint: str, model: str) -> _FakeMaker:
        return _FakeMaker()


def test_each_trace_request_becomes_a_stream_request_as_the_line_says() -> None:
    from ratebench.scenarios import EngineRef

    reqs = read_trace(EXAMPLE)
    ctx = ScenarioContext(profile=None, spec=None, driver=_FakeDriver(), on_phase=lambda p: None)  # type: ignore
    engine = EngineRef("patched-sync", "http://engine", "tiny-qwen3", True, "patched")
    out = asyncio.run(trace_streams(ctx, engine, reqs, "salt"))
    assert len(out) == len(reqs)
    for i, (r, s) in enumerate(zip(reqs, out)):
        assert (s.user, s.max_tokens, s.api, s.ignore_eos, s.delay_s, s.stream_index) == (
            r.user, r.max_tokens, r.api, not r.eos, r.at_s, i)
        assert (s.cancel_after_tokens, s.cancel_after_s) == (r.cancel_after_tokens, r.cancel_after_s)
        if isinstance(r.prompt, str):
            assert isinstance(s.prompt, str) and s.prompt.endswith(r.prompt) and s.prompt_tokens is None
        elif r.api == "chat":
            assert isinstance(s.prompt, str) and s.prompt_tokens is None
        else:
            assert s.prompt_tokens == len(s.prompt) == r.prompt + (r.prefix_tokens or 0)
    grouped = [(r, s) for r, s in zip(reqs, out) if r.prefix_group]
    heads = {tuple(s.prompt[:r.prefix_tokens]) if isinstance(s.prompt, list) else s.prompt[:40] for r, s in grouped}
    assert len(grouped) >= 2 and len(heads) == 1  # one shared prefix
    assert len({tuple(s.prompt) if isinstance(s.prompt, list) else s.prompt for s in out}) == len(out)


def test_the_driver_sends_a_trace_within_its_lateness() -> None:
    import httpx

    async def stream(_req):
        yield b'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 0}}\n\n'
        yield b"data: [DONE]\n\n"

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream(request))

    reqs = read_trace(EXAMPLE)
    ctx = ScenarioContext(profile=None, spec=None, driver=_FakeDriver(), on_phase=lambda p: None)  # type: ignore
    from ratebench.scenarios import EngineRef

    streams = asyncio.run(trace_streams(ctx, EngineRef("e", "http://engine", "m", True, "patched"), reqs, "s"))
    for s in streams:  # a shorter replay of the same arrivals
        s.delay_s /= 10
    driver = Driver("ab12", live=False, transport=httpx.MockTransport(handler))
    recs = asyncio.run(driver.run_phase(PhaseContext("trace", "trace", "e", "http://engine", "m"), streams))
    t0 = min(r.scheduled_ns for r in recs)
    assert [round((r.scheduled_ns - t0) / 1e9, 4) for r in recs] == [round(s.delay_s, 4) for s in streams]
    late_ms = sorted((r.sent_ns - r.scheduled_ns) / 1e6 for r in recs)
    assert late_ms[0] >= 0 and late_ms[-1] < 20, late_ms  # the first request too (the client is ready first)


# ---- from a run's records -----------------------------------------------------------


def _rec(i: int, **kw) -> ClientRecord:
    base = dict(client_id=f"rb-ab12-{i}", scenario="sc", phase="ph", engine="patched-sync", user="user-a",
                api="completions", stream_index=i, max_tokens=50, ignore_eos=True, prompt_tokens=32,
                scheduled_ns=10_000_000_000 + i * 250_000_000, sent_ns=10_000_000_000 + i * 250_000_000 + 1000)
    base.update(kw)
    return ClientRecord(**base)


def test_client_records_become_a_trace_of_what_was_sent() -> None:
    recs = [
        _rec(2, user=None, api="chat", ignore_eos=False),
        _rec(0),
        _rec(1, cancelled=True, cancel_ns=10_250_000_000 + 1000 + 400_000_000),
        _rec(3, sent_ns=None, cancelled=True),  # closed before its start
        _rec(4, prompt_tokens=None, error="HTTP 500"),  # no usage came back
        _rec(5, phase="other"),
        _rec(6, choices=[{"index": 0}, {"index": 1}]),  # n = 2: a trace has no n
    ]
    made = trace_from_records(recs, phase="ph")
    assert [r.to_json() for r in made.requests] == [
        {"at_s": 0.0, "user": "user-a", "prompt": 32, "max_tokens": 50},
        {"at_s": 0.25, "user": "user-a", "prompt": 32, "max_tokens": 50, "cancel_after_s": 0.4},
        {"at_s": 0.5, "user": None, "prompt": 32, "max_tokens": 50, "eos": True, "api": "chat"},
    ]
    assert sum(made.skipped.values()) == 3 and made.skipped["2 answers a request (n > 1: a trace's requests have "
                                                            "one answer each)"] == 1
    assert len(trace_from_records(recs).requests) == 4  # every phase


def test_trace_from_run_writes_a_trace_that_reads_back(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_client_records(run_dir / "requests.jsonl", [_rec(i) for i in range(4)] + [_rec(9, sent_ns=None)])
    out = tmp_path / "t.jsonl"
    result = CliRunner().invoke(app, ["trace", "from-run", str(run_dir), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "4 requests over 0.75 s" in result.output and "left out 1 record" in result.output
    assert [r.at_s for r in read_trace(out)] == [0.0, 0.25, 0.5, 0.75]
    check = CliRunner().invoke(app, ["trace", "check", str(out)])
    assert check.exit_code == 0 and "1 users (user-a)" in check.output
    nothing = CliRunner().invoke(app, ["trace", "from-run", str(run_dir), "-o", str(out), "--phase", "zz"])
    assert nothing.exit_code == 2 and "no request to write with --phase zz" in nothing.output
    missing = CliRunner().invoke(app, ["trace", "from-run", str(tmp_path / "nope"), "-o", str(out)])
    assert missing.exit_code == 2


def test_trace_check_exits_2_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    write_trace(bad, [TraceRequest(0.0, "u", 4, 4)])
    bad.write_text(bad.read_text() + '{"at_s": 1, "prompt": 4}\n')
    result = CliRunner().invoke(app, ["trace", "check", str(bad)])
    assert result.exit_code == 2
    assert "line 2: max_tokens: expected this field" in " ".join(result.output.split())


# ---- trace-lateness -----------------------------------------------------------------


def _trace_run(run_dir: Path, lateness_ms: float = 20) -> Path:
    eng = SimEngine("patched-sync", default_tps=100)
    reqs = [SimRequest(f"rb-5e1f0001-{i}", "user-a" if i % 2 else None, i, 10, arrive_offset_ns=i * 100_000_000)
            for i in range(20)]
    phase = SimPhase("trace", "trace", "trace", "patched-sync", "measure",
                     {"user-a": {"limit_tps": 100, "streams": 10, "backlogged": False},
                      "__anonymous__": {"limit_tps": 100, "streams": 10, "backlogged": False}}, reqs,
                     params={"lateness_ms": lateness_ms})
    return write_run_folder(run_dir, [eng], [phase])


def _lateness_check(run_dir: Path):
    verdict = analyse_run(run_dir).verdict
    return [c for c in verdict.checks if c.name == "trace-lateness"]


def test_trace_lateness_passes_when_every_request_left_on_time(tmp_path: Path) -> None:
    (check,) = _lateness_check(_trace_run(tmp_path / "run"))
    assert check.passed and check.figure == pytest.approx(0.1) and check.threshold == 20
    assert "20 requests sent" in check.explanation


def test_trace_lateness_fails_when_the_p99_request_left_late(tmp_path: Path) -> None:
    run_dir = _trace_run(tmp_path / "run", lateness_ms=5)

    def late(recs):
        for r in recs[:2]:
            r.scheduled_ns -= 30_000_000

    edit_client_records(run_dir, late)
    (check,) = _lateness_check(run_dir)
    assert check.passed is False and check.figure > 5 and "did not replay the trace faithfully" in check.explanation
    from ratebench.analysis.load import load_run

    (fig,) = trace_lateness(load_run(run_dir))
    assert fig.max_ns == pytest.approx(30_100_000) and fig.sent == 20 and fig.unsent == 0


def test_no_lateness_check_without_a_trace_phase(tmp_path: Path) -> None:
    from synthetic_runs import one_phase_run

    assert _lateness_check(one_phase_run(tmp_path / "run")) == []
