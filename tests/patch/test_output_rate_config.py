"""Configuring the limiter: every malformed flag and every refused set-up is
refused with a message that names the flag (docs/promise.md section 1).

Flags go through vLLM's real ``vllm serve`` parser; configurations through the
real ``SchedulerConfig`` / ``VllmConfig`` built from the tiny model. The user a
request is charged to comes only from ``extra_args["output_rate_user"]``.
"""

from __future__ import annotations

import contextlib
import io
from unittest import mock
from unittest.mock import PropertyMock

import pytest
from vllm.config import (
    CacheConfig,
    ECTransferConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.aux_output import AuxOutputConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.generate.beam_search.utils import validate_beam_search_output_rate
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.sampling_params import SamplingParams
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.core.sched.output_rate import ANONYMOUS_USER, output_rate_user_of
from vllm.v1.request import Request

from ratebench.tinymodel import ensure_tiny_model

pytestmark = pytest.mark.usefixtures("patched_vllm")

DEFAULT_FLAG = "--default-user-output-tokens-per-second"
USER_FLAG = "--user-output-tokens-per-second"
# The config field both flags set; pydantic's own type errors name it.
DEFAULT_FIELD = "default_user_output_tokens_per_second"
USER_FIELD = "user_output_tokens_per_second"
MAX_MODEL_LEN = 4096


# --------------------------------------------------------------------------
# Flags, through vLLM's real parser
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serve_parser() -> FlexibleArgumentParser:
    return make_arg_parser(FlexibleArgumentParser())


def parse_error(parser: FlexibleArgumentParser, *args: str) -> str:
    """The argparse error (stderr) of ``vllm serve m ARGS``; fails if it parses."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["m", *args])
    assert exit_info.value.code == 2, stderr.getvalue()
    return stderr.getvalue()


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "abc", "", "1e3", "true", "10 tok/s"])
def test_a_malformed_default_rate_is_an_argparse_error_naming_the_flag(serve_parser, value):
    message = parse_error(serve_parser, f"{DEFAULT_FLAG}={value}")
    # argparse's prefix names the flag, and so does the parser's own reason
    assert f"argument {DEFAULT_FLAG}: {DEFAULT_FLAG} must be a positive integer" in message
    assert repr(value) in message


def test_a_negative_default_rate_as_a_separate_argument_is_refused(serve_parser):
    message = parse_error(serve_parser, DEFAULT_FLAG, "-3")
    assert f"{DEFAULT_FLAG} must be a positive integer" in message


MALFORMED_USER_RATES = [
    # (flag value, what the message says)
    ('{"a": 1', "invalid JSON"),
    ("not json", "invalid JSON"),
    ("{'a': 1}", "invalid JSON"),  # Python, not JSON
    ("[1, 2]", "must be a JSON object mapping user to tokens per second, got list"),
    ('[["a", 1]]', "got list"),
    ('"a"', "got str"),
    ("5", "got int"),
    ("null", "got NoneType"),
    ('{"a": 0}', "the rate of user 'a' must be a positive integer"),
    ('{"a": -5}', "the rate of user 'a' must be a positive integer"),
    ('{"a": 1.5}', "the rate of user 'a' must be a positive integer"),
    ('{"a": 10.0}', "the rate of user 'a' must be a positive integer"),
    ('{"a": "5"}', "the rate of user 'a' must be a positive integer"),
    ('{"a": true}', "the rate of user 'a' must be a positive integer"),
    ('{"a": false}', "the rate of user 'a' must be a positive integer"),
    ('{"a": null}', "the rate of user 'a' must be a positive integer"),
    ('{"a": [5]}', "the rate of user 'a' must be a positive integer"),
    ('{"a": {"b": 5}}', "the rate of user 'a' must be a positive integer"),
    ('{"ok": 5, "bad": 0}', "the rate of user 'bad' must be a positive integer"),
    ('{"": 5}', "user names must be non-empty strings"),
]


@pytest.mark.parametrize(("value", "reason"), MALFORMED_USER_RATES)
def test_malformed_user_rates_are_an_argparse_error_naming_the_flag(serve_parser, value, reason):
    message = parse_error(serve_parser, USER_FLAG, value)
    assert f"argument {USER_FLAG}: {USER_FLAG}" in message
    assert reason in message


def test_valid_flags_parse_to_an_int_and_a_dict(serve_parser):
    args = serve_parser.parse_args(
        ["m", DEFAULT_FLAG, "10", USER_FLAG, '{"user-a": 100, "user-b": 500}']
    )
    assert args.default_user_output_tokens_per_second == 10
    assert type(args.default_user_output_tokens_per_second) is int
    assert args.user_output_tokens_per_second == {"user-a": 100, "user-b": 500}
    assert type(args.user_output_tokens_per_second) is dict


def test_dotted_overrides_parse_to_the_same_dict(serve_parser):
    """vLLM's ``--flag.key value`` form for JSON flags goes through the same check."""
    args = serve_parser.parse_args(
        ["m", DEFAULT_FLAG, "10", f"{USER_FLAG}.user-a", "100", f"{USER_FLAG}.user-b", "5"]
    )
    assert args.user_output_tokens_per_second == {"user-a": 100, "user-b": 5}
    message = parse_error(serve_parser, DEFAULT_FLAG, "10", f"{USER_FLAG}.user-a", "true")
    assert f"{USER_FLAG}: the rate of user 'user-a' must be a positive integer" in message


def test_a_config_file_goes_through_the_same_checks(serve_parser, tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(
        "default-user-output-tokens-per-second: 10\n"
        "user-output-tokens-per-second:\n  user-a: 100\n"
    )
    args = serve_parser.parse_args(["m", "--config", str(good)])
    assert args.default_user_output_tokens_per_second == 10
    assert args.user_output_tokens_per_second == {"user-a": 100}
    bad = tmp_path / "bad.yaml"
    bad.write_text("default-user-output-tokens-per-second: 0\n")
    assert f"{DEFAULT_FLAG} must be a positive integer" in parse_error(
        serve_parser, "--config", str(bad)
    )


def test_without_the_flags_the_feature_is_off(serve_parser):
    args = serve_parser.parse_args(["m"])
    assert args.default_user_output_tokens_per_second is None
    assert args.user_output_tokens_per_second is None


@pytest.fixture(scope="module")
def tiny_model_path() -> str:
    return str(ensure_tiny_model())


def engine_config_from_flags(parser, model: str, *flags: str) -> VllmConfig:
    """What ``vllm serve`` does with its flags: parse, EngineArgs, engine config."""
    args = parser.parse_args(
        ["--model", model, "--skip-tokenizer-init", "--dtype", "float32",
         "--max-model-len", str(MAX_MODEL_LEN), *flags]
    )
    return EngineArgs.from_cli_args(args).create_engine_config()


def test_parsed_flags_reach_the_scheduler_config(serve_parser, tiny_model_path):
    config = engine_config_from_flags(
        serve_parser, tiny_model_path, DEFAULT_FLAG, "10", USER_FLAG, '{"user-a": 100}'
    )
    assert config.scheduler_config.default_user_output_tokens_per_second == 10
    assert config.scheduler_config.user_output_tokens_per_second == {"user-a": 100}


def test_overrides_without_a_default_are_refused_at_start_up(serve_parser, tiny_model_path):
    with pytest.raises(ValueError) as error:
        engine_config_from_flags(serve_parser, tiny_model_path, USER_FLAG, '{"user-a": 100}')
    assert f"{USER_FLAG} needs {DEFAULT_FLAG}" in str(error.value)


# --------------------------------------------------------------------------
# SchedulerConfig
# --------------------------------------------------------------------------


def scheduler_config(**kwargs) -> SchedulerConfig:
    return SchedulerConfig(max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False, **kwargs)


def test_scheduler_config_is_off_by_default():
    config = scheduler_config()
    assert config.default_user_output_tokens_per_second is None
    assert config.user_output_tokens_per_second is None


def test_scheduler_config_keeps_valid_rates():
    config = scheduler_config(
        default_user_output_tokens_per_second=20, user_output_tokens_per_second={"a": 1}
    )
    assert config.default_user_output_tokens_per_second == 20
    assert config.user_output_tokens_per_second == {"a": 1}


@pytest.mark.parametrize("overrides", [{"a": 5}, {"a": 5, "b": 7}])
def test_overrides_without_a_default_name_both_flags(overrides):
    with pytest.raises(ValueError) as error:
        scheduler_config(user_output_tokens_per_second=overrides)
    assert f"{USER_FLAG} needs {DEFAULT_FLAG}" in str(error.value)


def test_empty_overrides_without_a_default_leave_the_feature_off():
    assert scheduler_config(user_output_tokens_per_second={}).default_user_output_tokens_per_second is None


@pytest.mark.parametrize("rate", [0, -3])
def test_a_non_positive_default_rate_is_refused_naming_the_flag(rate):
    with pytest.raises(ValueError) as error:
        scheduler_config(default_user_output_tokens_per_second=rate)
    assert f"{DEFAULT_FLAG} must be a positive integer" in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"a": 0}, "the rate of user 'a' must be a positive integer"),
        ({"a": -1}, "the rate of user 'a' must be a positive integer"),
        ({"": 5}, "user names must be non-empty strings"),
    ],
)
def test_a_bad_override_is_refused_naming_the_flag(overrides, reason):
    with pytest.raises(ValueError) as error:
        scheduler_config(default_user_output_tokens_per_second=10, user_output_tokens_per_second=overrides)
    assert f"{USER_FLAG}: {reason}" in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"default_user_output_tokens_per_second": 1.5}, DEFAULT_FIELD),
        ({"default_user_output_tokens_per_second": "abc"}, DEFAULT_FIELD),
        ({"default_user_output_tokens_per_second": 10, "user_output_tokens_per_second": {"a": 1.5}}, USER_FIELD),
        ({"default_user_output_tokens_per_second": 10, "user_output_tokens_per_second": [("a", 5)]}, USER_FIELD),
    ],
)
def test_a_rate_of_the_wrong_type_is_refused_naming_the_setting(kwargs, field):
    """Pydantic refuses these before the limiter's check runs; its message names
    the config field (the keyword a Python caller wrote), not the flag."""
    with pytest.raises(ValueError, match=field):
        scheduler_config(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"default_user_output_tokens_per_second": True},
        {"default_user_output_tokens_per_second": 10, "user_output_tokens_per_second": {"a": True}},
    ],
    ids=["default", "override"],
)
def test_a_boolean_rate_is_refused_by_the_scheduler_config_as_by_the_flags(kwargs):
    with pytest.raises(ValueError, match="must be a positive integer"):
        scheduler_config(**kwargs)


# --------------------------------------------------------------------------
# VllmConfig: configurations the limiter refuses at start-up
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_config(tiny_model_path) -> ModelConfig:
    return ModelConfig(
        model=tiny_model_path, skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_MODEL_LEN
    )


def vllm_config(model_config: ModelConfig, default_tps: int | None = 10, **kwargs) -> VllmConfig:
    scheduler_kwargs = kwargs.pop("scheduler_kwargs", {})
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config(default_user_output_tokens_per_second=default_tps, **scheduler_kwargs),
        **kwargs,
    )


@pytest.fixture(scope="module")
def rate_limited_config(tiny_model_config) -> VllmConfig:
    """A normally built config with the feature on (tiny decoder-only model, one GPU-less rank)."""
    return vllm_config(tiny_model_config)


def model_property(name: str):
    """Make every ModelConfig report ``name`` as True (a data descriptor, so it
    also hides a value cached_property already stored on the instance)."""
    return lambda config: mock.patch.object(ModelConfig, name, new_callable=PropertyMock, return_value=True)


# (id, alteration of a built config -> context manager, the words of the refusal)
REFUSED_SETUPS = [
    ("speculative-decoding",
     lambda c: mock.patch.object(c, "speculative_config", mock.sentinel.speculative_config),
     "speculative decoding"),
    ("data-parallel",
     lambda c: mock.patch.object(c.parallel_config, "data_parallel_size", 2),
     "data_parallel_size > 1"),
    ("pipeline-parallel",
     lambda c: mock.patch.object(c.parallel_config, "pipeline_parallel_size", 2),
     "pipeline_parallel_size > 1"),
    ("kv-connector",
     lambda c: mock.patch.object(
         c, "kv_transfer_config", KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")),
     "KV connectors"),
    ("kv-offloading",
     lambda c: mock.patch.object(c.cache_config, "kv_offloading_size", 1.0),
     "KV offloading"),
    ("ec-connector",
     lambda c: mock.patch.object(
         c, "ec_transfer_config", ECTransferConfig(ec_connector="ECExampleConnector", ec_role="ec_both")),
     "EC connectors"),
    ("aux-output-connector",
     lambda c: mock.patch.object(c, "aux_output_config", AuxOutputConfig(enable_return_routed_experts=True)),
     "aux output connectors"),
    ("custom-scheduler-cls",
     lambda c: mock.patch.object(c.scheduler_config, "scheduler_cls", "my_package.MyScheduler"),
     "a custom scheduler_cls"),
    ("multimodal", model_property("is_multimodal_model"), "multimodal models"),
    ("encoder-decoder", model_property("is_encoder_decoder"), "encoder-decoder models"),
    ("hybrid", model_property("is_hybrid"), "hybrid models"),
    ("attention-free", model_property("is_attention_free"), "attention-free models"),
    ("pooling", lambda c: mock.patch.object(c.model_config, "runner_type", "pooling"), "pooling models"),
    ("diffusion", model_property("is_diffusion"), "diffusion models"),
]
REFUSED_IDS = [setup[0] for setup in REFUSED_SETUPS]


def refused_features(error: ValueError) -> list[str]:
    """The list in '... is not supported with: A; B. Unset it, ...'."""
    message = str(error)
    assert message.startswith(f"{DEFAULT_FLAG} (per-user output rate limiting) is not supported with: ")
    listed = message.split("is not supported with: ", 1)[1].split(". Unset it", 1)[0]
    return listed.split("; ")


def test_the_normal_config_with_the_feature_on_is_accepted(rate_limited_config):
    assert rate_limited_config.scheduler_config.default_user_output_tokens_per_second == 10
    rate_limited_config._verify_user_output_rate_config()


@pytest.mark.parametrize(("alter", "feature"), [s[1:] for s in REFUSED_SETUPS], ids=REFUSED_IDS)
def test_an_unsupported_setup_is_refused_naming_the_flag_and_the_feature(
    rate_limited_config, alter, feature
):
    """Each set-up is made by altering a normally built config and calling the
    check VllmConfig runs at start-up (building one with a real DP/PP size, a
    draft model or a multimodal model would start distributed or model work)."""
    with alter(rate_limited_config), pytest.raises(ValueError) as error:
        rate_limited_config._verify_user_output_rate_config()
    listed = refused_features(error.value)
    assert len(listed) == 1 and listed[0].startswith(feature), listed


def test_every_unsupported_setup_is_named_in_one_message(rate_limited_config):
    with contextlib.ExitStack() as stack:
        for _, alter, _ in REFUSED_SETUPS:
            stack.enter_context(alter(rate_limited_config))
        with pytest.raises(ValueError) as error:
            rate_limited_config._verify_user_output_rate_config()
    listed = refused_features(error.value)
    assert len(listed) == len(REFUSED_SETUPS)
    for _, _, feature in REFUSED_SETUPS:
        assert sum(item.startswith(feature) for item in listed) == 1, (feature, listed)


@pytest.mark.parametrize(("alter", "feature"), [s[1:] for s in REFUSED_SETUPS], ids=REFUSED_IDS)
def test_with_the_feature_off_the_same_setup_is_not_refused_by_this_check(
    rate_limited_config, alter, feature
):
    with mock.patch.object(
        rate_limited_config.scheduler_config, "default_user_output_tokens_per_second", None
    ), alter(rate_limited_config):
        rate_limited_config._verify_user_output_rate_config()


def test_tensor_parallel_is_not_refused(rate_limited_config):
    with mock.patch.object(rate_limited_config.parallel_config, "tensor_parallel_size", 2):
        rate_limited_config._verify_user_output_rate_config()


@pytest.mark.parametrize(
    ("kwargs", "features"),
    [
        ({"scheduler_kwargs": {"scheduler_cls": "my_package.MyScheduler"}}, ["a custom scheduler_cls"]),
        ({"kv_transfer_config": KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")},
         ["KV connectors"]),
        # vLLM turns KV offloading into an offloading KV connector before the check
        ({"cache_config": CacheConfig(kv_offloading_size=1.0)}, ["KV connectors", "KV offloading"]),
        ({"ec_transfer_config": ECTransferConfig(ec_connector="ECExampleConnector", ec_role="ec_both")},
         ["EC connectors"]),
    ],
    ids=["custom-scheduler-cls", "kv-connector", "kv-offloading", "ec-connector"],
)
def test_building_an_unsupported_config_fails_at_start_up(tiny_model_config, kwargs, features):
    """The check really runs when VllmConfig is built (for set-ups cheap to build
    here; on this CPU build vLLM itself refuses aux outputs earlier, as they need
    Model Runner V2)."""
    with pytest.raises(ValueError) as error:
        vllm_config(tiny_model_config, **kwargs)
    message = str(error.value)
    assert f"{DEFAULT_FLAG} (per-user output rate limiting) is not supported with: " in message
    for feature in features:
        assert feature in message


# --------------------------------------------------------------------------
# Beam search
# --------------------------------------------------------------------------


def test_beam_search_is_refused_while_the_feature_is_on(rate_limited_config):
    message = validate_beam_search_output_rate(rate_limited_config)
    assert message is not None
    assert "Beam search is not supported" in message
    assert DEFAULT_FLAG in message


def test_beam_search_is_allowed_while_the_feature_is_off(rate_limited_config):
    with mock.patch.object(
        rate_limited_config.scheduler_config, "default_user_output_tokens_per_second", None
    ):
        assert validate_beam_search_output_rate(rate_limited_config) is None


# --------------------------------------------------------------------------
# Whose budget a request spends
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra_args", "user"),
    [
        ({"output_rate_user": "alice"}, "alice"),
        ({"output_rate_user": "alice", "other": 1}, "alice"),
        ({"output_rate_user": " "}, " "),  # any non-empty string is a name
        (None, ANONYMOUS_USER),
        ({}, ANONYMOUS_USER),
        ({"other": "alice"}, ANONYMOUS_USER),
        ({"user": "alice"}, ANONYMOUS_USER),
        ({"output_rate_user": ""}, ANONYMOUS_USER),
        ({"output_rate_user": None}, ANONYMOUS_USER),
        ({"output_rate_user": 42}, ANONYMOUS_USER),
        ({"output_rate_user": ["alice"]}, ANONYMOUS_USER),
        ({"output_rate_user": True}, ANONYMOUS_USER),
    ],
)
def test_the_user_is_output_rate_user_of_extra_args_else_anonymous(extra_args, user):
    assert output_rate_user_of(extra_args) == user


def test_the_anonymous_user_is_named_anonymous():
    assert ANONYMOUS_USER == "__anonymous__"


def make_request(sampling_params: SamplingParams | None) -> Request:
    return Request(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        sampling_params=sampling_params,
        pooling_params=None,
    )


def test_a_request_spends_the_budget_named_in_its_extra_args():
    request = make_request(SamplingParams(max_tokens=4, extra_args={"output_rate_user": "u"}))
    assert request.output_rate_user == "u"


def test_a_request_without_extra_args_is_anonymous():
    assert make_request(SamplingParams(max_tokens=4)).output_rate_user == ANONYMOUS_USER


def test_the_openai_user_field_plays_no_part():
    """An OpenAI request's ``user`` does not name the budget; ``vllm_xargs`` does."""
    with_user = CompletionRequest(model="m", prompt="hi", user="alice")
    assert make_request(with_user.to_sampling_params(max_tokens=4)).output_rate_user == ANONYMOUS_USER
    with_both = CompletionRequest(
        model="m", prompt="hi", user="alice", vllm_xargs={"output_rate_user": "bob"}
    )
    assert make_request(with_both.to_sampling_params(max_tokens=4)).output_rate_user == "bob"
