"""The limiter's flags as a run judges them (docs/promise.md section 1): ``ratebench.flagcheck`` puts
malformed and valid flags through ``vllm serve``'s real parser and engine config, and verify-bound's
``flags-refused`` check judges the result. Broken flag handling fails it, and only it: through a
``sitecustomize.py`` in the child's environment (as a run's child sees the engines' ``PYTHONPATH``), and
in this process by replacing the parser's functions (the same code paths, faster)."""

from __future__ import annotations

import json
import shutil

import pytest

import vllm.engine.arg_utils as arg_utils
from mutants import Phase, Stream, Workload, run_workload
from mutants.hooks import break_on_import
from ratebench.flagcheck import FILE, check_all, run_flag_check
from ratebench.verify import verify_run

pytestmark = pytest.mark.usefixtures("patched_vllm")


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    workload = Workload(default_tps=100, user_tps={"user-a": 20}, phases=[
        Phase("shared", [Stream("user-a", 24) for _ in range(2)], backlogged={"user-a"})])
    return run_workload(tmp_path_factory.mktemp("flags") / "run", workload).run_dir


def _verdict(run_folder, tmp_path, result: dict):
    run_dir = tmp_path / "run"
    shutil.copytree(run_folder, run_dir)
    (run_dir / FILE).write_text(json.dumps(result))
    return verify_run(run_dir, plots=False)


def _only_flags_fail(verdict, name: str = "flags-refused") -> None:
    assert not verdict.passed
    assert {c.name for c in verdict.failures} == {name}, verdict.summary()


def test_the_patch_refuses_every_malformed_flag_naming_it_and_keeps_valid_ones(run_folder, tmp_path):
    result = run_flag_check(tmp_path)
    assert json.loads((tmp_path / FILE).read_text()) == result
    assert result["error"] is None and all(c["ok"] for c in result["cases"]), result["cases"]
    stages = {c["stage"] for c in result["cases"]}
    assert stages == {"arguments", "engine config", None}  # both ways of refusing, and the valid flags
    verdict = _verdict(run_folder, tmp_path, result)
    assert verdict.passed, verdict.summary()
    (check,) = [c for c in verdict.checks if c.name == "flags-refused"]
    assert check.passed and check.figure == 0
    # the unsupported configurations: refused with the limiter on, accepted with it off
    (config,) = [c for c in verdict.checks if c.name == "config-refused"]
    assert config.passed and config.figure == 0 and "16 cases" in config.explanation, config.explanation
    assert {c["name"].split(",")[0] for c in result["cases"] if c.get("group") == "config"} == {
        "speculative decoding", "data parallel", "pipeline parallel", "a custom scheduler class",
        "a KV connector", "KV offloading", "an EC connector", "a pooling runner"}


def test_a_parser_that_rounds_rates_fails_flags_refused(run_folder, tmp_path):
    # through the child, as a run makes it: the default rate parsed leniently (1.5 -> 1, "0" accepted)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(break_on_import(
        {"vllm.v1.core.sched.output_rate": "module.parse_default_output_rate = lambda v: int(float(v))\n"},
        "ratebench test mutant: lenient rate parser"))
    result = run_flag_check(tmp_path, {"PYTHONPATH": str(hook)})
    assert result["error"] is None, result["error"]
    bad = {c["name"] for c in result["cases"] if not c["ok"]}
    assert "a fractional rate" in bad, result["cases"]  # accepted as 1 tok/s
    _only_flags_fail(_verdict(run_folder, tmp_path, result))


def test_overrides_left_without_a_default_silently_fail_flags_refused(run_folder, tmp_path, monkeypatch):
    # the start-up check of per-user rates without a default skipped: the feature stays off without a word
    import vllm.v1.core.sched.output_rate as output_rate

    shipped = output_rate.verify_output_rate_config

    def without_the_default_check(default, users):
        shipped(1 if default is None else default, users)

    monkeypatch.setattr(output_rate, "verify_output_rate_config", without_the_default_check)
    result = check_all()
    (bad,) = [c for c in result["cases"] if not c["ok"]]
    assert bad["name"] == "per-user rates without a default" and not bad["refused"]
    _only_flags_fail(_verdict(run_folder, tmp_path, result))


def test_valid_per_user_rates_dropped_fail_flags_refused(run_folder, tmp_path, monkeypatch):
    # every malformed value still refused, but valid per-user rates never reach the scheduler
    shipped = arg_utils.parse_user_output_rates

    def drops_valid(value):
        shipped(value)
        return {}

    monkeypatch.setattr(arg_utils, "parse_user_output_rates", drops_valid)
    result = check_all()
    bad = {c["name"]: c for c in result["cases"] if not c["ok"]}
    assert "where 10 and" in bad["valid flags"]["why"], result["cases"]
    _only_flags_fail(_verdict(run_folder, tmp_path, result))


def test_a_check_that_cannot_run_fails_flags_refused(run_folder, tmp_path):
    _only_flags_fail(_verdict(run_folder, tmp_path, {"version": 1, "cases": [], "error": "the check exited"}))


def _start_up_check_sees(monkeypatch, config_of, key, value) -> None:
    """The patch's start-up check of unsupported configurations sees ``key`` of ``config_of(vllm_config)``
    as ``value`` (``None``: the value given, or 1 where none was), and the config is left as given."""
    from vllm.config.vllm import VllmConfig

    shipped = VllmConfig._verify_user_output_rate_config

    def seeing(self):
        part = config_of(self)
        given = getattr(part, key)
        setattr(part, key, (given or 1) if value is None else value)
        try:
            shipped(self)
        finally:
            setattr(part, key, given)

    monkeypatch.setattr(VllmConfig, "_verify_user_output_rate_config", seeing)


def test_data_parallel_let_through_with_the_limiter_on_fails_config_refused(run_folder, tmp_path, monkeypatch):
    # the start-up check does not see data_parallel_size: each rank would grant a user its own budget
    _start_up_check_sees(monkeypatch, lambda c: c.parallel_config, "data_parallel_size", 1)
    result = check_all()
    (bad,) = [c for c in result["cases"] if not c["ok"]]
    assert bad["name"] == "data parallel, limiter on" and bad["why"] == "accepted with the limiter on"
    _only_flags_fail(_verdict(run_folder, tmp_path, result), "config-refused")


def test_configurations_refused_with_the_limiter_off_fail_config_refused(run_folder, tmp_path, monkeypatch):
    # the start-up check runs whatever the flags: the limiter off no longer serves what upstream serves
    _start_up_check_sees(monkeypatch, lambda c: c.scheduler_config, "default_user_output_tokens_per_second", None)
    result = check_all()
    bad = {c["name"] for c in result["cases"] if not c["ok"]}
    assert bad == {f"{name}, limiter off" for name in ("speculative decoding", "data parallel", "pipeline parallel",
                                                      "a custom scheduler class", "a KV connector",
                                                      "KV offloading", "an EC connector",
                                                      "a pooling runner")}, bad
    _only_flags_fail(_verdict(run_folder, tmp_path, result), "config-refused")
