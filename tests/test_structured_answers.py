"""structured-answers: constrained answers held to their constraints by a fresh grammar matcher (the tiny
model's real tokenizer and xgrammar; run folders built in memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratebench.analysis.checks.resume import structured_answers
from ratebench.analysis.load import RunData
from ratebench.analysis.structured import constraint_of, structured_conformance
from ratebench.runrecords import ClientRecord, PhaseRecord
from ratebench.scenarios.request_options import OPTIONS, option_body

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


def _bodies(options, bad_words=None, banned=None):
    return [{"option": o, "api": option_body(o, 30, bad_words, banned)[0],
             "body": option_body(o, 30, bad_words, banned)[1]} for o in options]


def _run(model: Path | None, options: list[str], answers: dict[int, list[int] | None], *,
         bodies=True, error: set[int] = frozenset(), bad_words=None, banned=None) -> RunData:
    params = ({"option_bodies": _bodies(options, bad_words, banned)} if bodies
              else {"option_probes": [f"{o} 200" for o in options]})
    phase = PhaseRecord(scenario="request-options", kind="request-options", phase="request-options",
                        engine="patched-sync", start_ns=0, end_ns=10**9, users={}, params=params, index=0)
    records = [ClientRecord(client_id=f"rb-x-{i}", scenario="request-options", phase="request-options",
                            engine="patched-sync", user="user-b", api=option_body(options[i], 30)[0], stream_index=i,
                            max_tokens=30, ignore_eos=True, token_ids=ids,
                            error="HTTP 500" if i in error else None)
               for i, ids in answers.items()]
    manifest = {"model_path": str(model) if model else None, "model_stop_token_ids": [EOS]}
    return RunData(run_dir=Path("."), manifest=manifest, phases=[phase], records=records, engines={}, traces={})


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_every_option_of_request_options_has_its_constraint_or_none():
    kinds = {o: (constraint_of(option_body(o, 30)[1]) or (None,))[0] for o in OPTIONS}
    assert kinds == {"json-schema": "json", "json-object": "json_object", "regex": "regex", "choice": "choice",
                     "allowed-token-ids": "allowed", "logprobs": None, "top-logprobs": None,
                     "penalties": "penalties", "repetition-penalty": "repetition", "stop": None, "logit-bias": None, "bad-words": "bad_words", "min-tokens": "min_tokens", "chat": None}
    # the profile's words replace the bad-words option's default, and only its
    assert option_body("bad-words", 30, ["re"])[1]["bad_words"] == ["re"]
    assert option_body("bad-words", 30)[1]["bad_words"] == ["the"]
    assert "bad_words" not in option_body("regex", 30, ["re"])[1]
    # the profile's banned token ids join the logit-bias option's biases at -100, and make it a constraint
    body = option_body("logit-bias", 30, None, [299, 2])[1]
    assert body["logit_bias"] == {"100": 5.0, "101": -5.0, "299": -100.0, "2": -100.0}
    assert constraint_of(body) == ("banned", [2, 299])
    assert "logit_bias" not in option_body("regex", 30, None, [299])[1]


def _penalised_run(answer, rows, **kw):
    run = _run(None, ["penalties", "chat"], {0: answer, 1: [5, 5]}, **kw)
    run.phases[0].params["penalty_scores"] = {"0": rows}
    return run


def test_a_penalised_answer_greedy_under_its_penalties_passes_and_one_sampled_without_them_fails():
    # the model's raw scores: token 10 first (-1.0), 11 next (-1.3), 12 after (-1.6), at every position.
    # Under presence 0.5 + frequency 0.5 a token said once loses 1.0: greedy says 10, 11, 12, then 10 again
    # (10 at -2.0 against 11 at -2.3 and 12 at -2.6)
    row = {"10": -1.0, "11": -1.3, "12": -1.6}
    run = _penalised_run([10, 11, 12, 10], [row] * 4)
    (check,) = structured_answers(run, None, None)
    assert check.passed is True and check.figure == 0, check.explanation
    assert "penalties" in check.explanation
    # an answer that lost its penalties (or their history) after its first token says 10 again at once
    run = _penalised_run([10, 10, 11, 12], [row] * 4)
    (check,) = structured_answers(run, None, None)
    assert check.passed is False and check.figure == 1, check.explanation
    assert "at token 1: 10" in check.explanation and "token 11 beat by 0.70 nats" in check.explanation
    # within the tolerance (ties of bfloat16 rounding) it passes: 11 at -1.02 is a tie with 10 at -1.0
    run = _penalised_run([11, 10], [{"10": -1.0, "11": -1.02}] * 2)
    (check,) = structured_answers(run, None, None)
    assert check.passed is True, check.explanation


def test_a_penalised_answer_the_run_could_not_score_fails():
    run = _run(None, ["penalties", "chat"], {0: [10, 11], 1: [5]})
    run.phases[0].params["penalty_scores_unscored"] = {"count": 1, "first": "rb-x-0: HTTP 500"}
    (check,) = structured_answers(run, None, None)
    assert check.passed is False and check.figure == 1, check.explanation
    assert "could not be scored (first: rb-x-0: HTTP 500)" in check.explanation


def test_a_repetition_penalised_answer_is_held_to_the_engines_own_probes():
    # probes[j]: the engine's greedy token after the prompt and the answer's first j tokens, under the
    # penalty and a bias towards the answer's token j. All agree: it passes, token ids alone
    run = _run(None, ["repetition-penalty", "chat"], {0: [10, 11, 12, 10], 1: [5, 5]})
    run.phases[0].params["repetition_probes"] = {"bias": 0.125, "tokens": {"0": [10, 11, 12, 10]}}
    (check,) = structured_answers(run, None, None)
    assert check.passed is True and check.figure == 0, check.explanation
    # an answer that said 10 again where the engine, asked again under its penalty, says 11: it fails there
    run = _run(None, ["repetition-penalty", "chat"], {0: [10, 10, 12, 10], 1: [5, 5]})
    run.phases[0].params["repetition_probes"] = {"bias": 0.125, "tokens": {"0": [10, 11, 12, 10]}}
    (check,) = structured_answers(run, None, None)
    assert check.passed is False and check.figure == 1, check.explanation
    assert "rb-x-0 (user-b, repetition-penalty) at token 1: 10" in check.explanation, check.explanation
    assert "repetition penalty (1.2) with 0.125 more logit bias on it, does not pick (it picks 11; the answer had " \
           "said 10 1 times and 11 0 times before)" in check.explanation, check.explanation
    # probes missing (or fewer than the tokens): not scored, so not passed
    for probes in (None, {"bias": 0.125, "tokens": {"0": [10, 11]}}):
        run = _run(None, ["repetition-penalty", "chat"], {0: [10, 11, 12], 1: [5]})
        if probes:
            run.phases[0].params["repetition_probes"] = probes
        (check,) = structured_answers(run, None, None)
        assert check.passed is False and check.figure == 1, check.explanation
        assert "no repetition probes recorded for its tokens" in check.explanation, check.explanation


def test_only_a_greedy_repetition_penalty_alone_is_a_repetition_constraint():
    assert constraint_of({"repetition_penalty": 1.2}) == ("repetition", 1.2)
    assert constraint_of({"repetition_penalty": 1.2, "temperature": 0.7}) is None
    assert constraint_of({"repetition_penalty": 1.0}) is None
    assert constraint_of({"repetition_penalty": 1.2, "presence_penalty": 0.5}) is None


def test_a_repetition_probe_biases_the_answers_token_on_top_of_the_requests_own_biases():
    from ratebench.answerscore import probe_token, repetition_probe_body
    body = repetition_probe_body({"repetition_penalty": 1.2, "logit_bias": {"7": 2.0, "9": 99.95}}, 7)
    assert body["logit_bias"] == {"7": 2.125, "9": 99.95} and body["repetition_penalty"] == 1.2
    assert body["max_tokens"] == 1 and body["temperature"] == 0.0 and body["return_token_ids"] is True
    assert repetition_probe_body({"repetition_penalty": 1.2, "logit_bias": {"9": 99.95}}, 9)["logit_bias"] == {"9": 100.0}
    assert probe_token(200, '{"choices": [{"token_ids": [42], "text": "x"}]}') == 42
    from ratebench.workload import WorkloadError
    for status, text in ((500, "boom"), (200, '{"choices": [{"text": "x"}]}'), (200, "not json")):
        with pytest.raises(WorkloadError):
            probe_token(status, text)


def test_a_token_its_logit_bias_bans_fails_without_a_tokenizer():
    # the ban (-100) on " re" and the EOS; the mild biases of the option (100 up, 101 down) bind nothing
    run = _run(None, ["logit-bias", "chat"], {0: [100, 101, 7, 299, 5], 1: [299, 299]}, banned=[299, 2])
    (check,) = structured_answers(run, None, None)
    assert check.passed is False and check.figure == 1, check.explanation
    assert "rb-x-0 (user-b, logit-bias) at token 3: 299" in check.explanation, check.explanation
    assert "logit bias of -100 bans" in check.explanation
    run = _run(None, ["logit-bias", "chat"], {0: [100, 101, 7, 5], 1: [299, 299]}, banned=[299, 2])
    (check,) = structured_answers(run, None, None)
    assert check.passed is True and check.figure == 0, check.explanation


def test_answers_that_obey_their_constraints_pass_and_the_free_tail_after_the_grammar_ends_is_free(
        tiny_model, tokenizer):
    junk = _ids(tokenizer, "}}} Not JSON at all [[[")
    answers = {
        0: _ids(tokenizer, '{"words": ["rate", "limit"]}') + [EOS] + junk,  # ended, then free (ignore_eos)
        1: _ids(tokenizer, '{ "a" : [1, {"b": null}], "c": "d"') ,  # unfinished at max_tokens: a prefix
        2: _ids(tokenizer, "tokens per second for everyone"),
        3: _ids(tokenizer, "yes") + [EOS] + junk,
        4: [100, 399, 250],
    }
    run = _run(tiny_model, ["json-schema", "json-object", "regex", "choice", "allowed-token-ids"], answers)
    (c,) = structured_conformance(run)
    assert c.checked == 5 and not c.broken and c.not_made is None, c
    (check,) = structured_answers(run, None, None)
    assert check.passed and check.figure == 0, check.explanation
    assert "0 of 5 constrained answers" in check.explanation


@pytest.mark.parametrize("option,text,bad_at_text", [
    # the grammar's state rolled back a token: the opening brace again inside the object
    ("json-schema", '{"words": ["rate", {', '{"words": ["rate", {'),
    ("json-object", '{"a": 1}}', '{"a": 1}}'),
    ("regex", "tokens per Second", "tokens per S"),
    ("choice", "yeyes", "yey"),
])
def test_an_answer_that_breaks_its_grammar_fails_at_the_token_a_fresh_matcher_refuses(
        tiny_model, tokenizer, option, text, bad_at_text):
    ids = _ids(tokenizer, text)
    run = _run(tiny_model, [option, "chat"], {0: ids, 1: _ids(tokenizer, "free text")})
    (c,) = structured_conformance(run)
    assert c.checked == 1 and len(c.broken) == 1, c
    b = c.broken[0]
    assert tokenizer.decode(ids[:b.position + 1]).startswith(tokenizer.decode(ids[:b.position]))
    assert len(tokenizer.decode(ids[:b.position + 1])) >= len(bad_at_text) - 2
    (check,) = structured_answers(run, None, None)
    assert check.passed is False and check.figure == 1
    assert f"rb-x-0 (user-b, {option}) at token {b.position}" in check.explanation


def test_a_token_outside_the_allowed_set_fails_without_a_tokenizer():
    run = _run(None, ["allowed-token-ids"], {0: [100, 101, 7, 102]})
    (check,) = structured_answers(run, None, None)
    assert check.passed is False and "at token 2: 7" in check.explanation


def test_the_check_says_why_it_was_not_made():
    run = _run(None, ["json-schema"], {0: [1, 2, 3]})
    (check,) = structured_answers(run, None, None)
    assert check.passed is None and "served model's folder is not here" in check.explanation
    run = _run(None, ["json-schema"], {0: [1, 2, 3]}, bodies=False)
    (check,) = structured_answers(run, None, None)
    assert check.passed is None and "before option_bodies" in check.explanation
    run = _run(None, ["logprobs", "chat"], {0: [1], 1: [2]})
    (check,) = structured_answers(run, None, None)
    assert check.passed is None and "no stream of the phase carried a constraint" in check.explanation


def test_answers_with_an_error_or_without_token_ids_are_named_not_judged(tiny_model, tokenizer):
    run = _run(tiny_model, ["regex", "choice", "json-object"],
               {0: _ids(tokenizer, "abc"), 1: None, 2: _ids(tokenizer, "{{")}, error={2})
    (check,) = structured_answers(run, None, None)
    assert check.passed is True and check.figure == 0
    assert "1 without token ids" in check.explanation and "1 answered with an error" in check.explanation


def test_bad_words_are_expanded_into_token_sequences_as_vllm_expands_them(tiny_model):
    """The words as is and with a leading space, the spaced form kept only when it is a new token of the
    same length: on the tiny model's tokenizer "the" bans [86, 261] but not " the" (one token), "re" both
    [268] and " re" (299, a token the tiny model says every other token)."""
    from vllm.sampling_params import SamplingParams
    from vllm.tokenizers import get_tokenizer

    from ratebench.analysis.structured import _grammars

    words = ["re", "the", "rate limit", " that"]
    sp = SamplingParams(bad_words=words)
    sp.update_from_tokenizer(get_tokenizer(str(tiny_model)))
    assert _grammars(str(tiny_model)).bad_word_sequences(words) == sp.bad_words_token_ids
    assert [299] in sp.bad_words_token_ids


def test_an_answer_that_says_a_bad_word_fails_where_the_sequence_completes(tiny_model, tokenizer):
    ok = [796, 2, 300, 2, 300]
    said = [796, 2, 300, 2, 299, 2]  # " re" at token 4
    run = _run(tiny_model, ["bad-words", "chat"], {0: said, 1: ok}, bad_words=["re"])
    (c,) = structured_conformance(run)
    assert c.checked == 1 and [b.position for b in c.broken] == [4], c
    (check,) = structured_answers(run, None, None)
    assert check.passed is False and check.figure == 1
    assert "rb-x-0 (user-b, bad-words) at token 4: 299" in check.explanation
    assert "completes a bad word of ['re'] as vLLM bans it (the token sequence [299])" in check.explanation
    run = _run(tiny_model, ["bad-words", "chat"], {0: ok, 1: said}, bad_words=["re"])
    (check,) = structured_answers(run, None, None)
    assert check.passed is True and "0 of 1 constrained answers (bad-words" in check.explanation


def test_a_bad_word_of_several_tokens_is_banned_only_whole_within_the_answer(tiny_model):
    """vLLM bans a sequence's last token after its others among the answer's own tokens: "the" is
    [86, 261] here, so 261 alone (its first token in the prompt) passes, and 86 then 261 fails."""
    run = _run(tiny_model, ["bad-words", "chat"], {0: [261, 5, 86, 7, 261, 86, 261], 1: [1]}, bad_words=["the"])
    (c,) = structured_conformance(run)
    assert [b.position for b in c.broken] == [6], c


def test_a_min_tokens_answer_with_a_stop_token_before_its_minimum_fails_without_a_tokenizer():
    """vLLM masks the stop tokens (the engine's EOS, the request's stop_token_ids) until an answer has
    min_tokens; ignore_eos does not lift the mask. After the minimum a stop token is free."""
    m = 30  # option_body's min_tokens: the stream's max_tokens
    clean = [796, 70, 614] * 10
    late = clean + [EOS, 299]  # past the minimum (an answer longer than it)
    early = clean[:7] + [EOS] + clean[8:]
    run = _run(None, ["min-tokens", "chat"], {0: late, 1: [EOS]})
    (check,) = structured_answers(run, None, None)
    assert check.passed is True and "0 of 1 constrained answers (min-tokens" in check.explanation
    run = _run(None, ["min-tokens", "chat"], {0: early, 1: [EOS]})
    (c,) = structured_conformance(run)
    assert [b.position for b in c.broken] == [7] and c.tokens == 8, c
    (check,) = structured_answers(run, None, None)
    assert check.passed is False and f"a stop token among its first {m} tokens, which min_tokens masks" \
        in check.explanation
    # the request's own stop_token_ids count as stop tokens too
    bodies = _bodies(["min-tokens", "chat"])
    bodies[0]["body"]["stop_token_ids"] = [614]
    run = _run(None, ["min-tokens", "chat"], {0: clean, 1: [EOS]})
    run.phases[0].params["option_bodies"] = bodies
    (c,) = structured_conformance(run)
    assert [b.position for b in c.broken] == [2], c
    # no stop tokens known: not made, and said why
    run = _run(None, ["min-tokens", "chat"], {0: early, 1: [EOS]})
    run.manifest["model_stop_token_ids"] = []
    (check,) = structured_answers(run, None, None)
    assert check.passed is None and "names no stop tokens" in check.explanation


def test_penalty_rows_keep_each_answer_tokens_raw_scores_and_refuse_a_reply_without_them():
    import json

    from ratebench.answerscore import penalty_rows
    from ratebench.workload import WorkloadError

    rows = [None, {"7": {"logprob": -0.1}}, {"10": {"logprob": -1.0}, "11": {"logprob": -1.25}},
            {"11": {"logprob": -0.5}, "12": {"logprob": -2.0}}]
    reply = json.dumps({"choices": [{"prompt_logprobs": rows}]})
    assert penalty_rows(200, reply, 2, [11, 12]) == [{"10": -1.0, "11": -1.25}, {"11": -0.5, "12": -2.0}]
    with pytest.raises(WorkloadError, match="HTTP 400"):
        penalty_rows(400, "bad", 2, [11, 12])
    with pytest.raises(WorkloadError, match="token 13 missing"):
        penalty_rows(200, reply, 2, [11, 13])
    with pytest.raises(WorkloadError, match="every token"):
        penalty_rows(200, reply, 3, [11, 12])

